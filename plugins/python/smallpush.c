/*
 * The small-push path of pytrt_kv.datadist in C (docs/DATADIST.md decision 15).
 *
 * push(node, cache, index, src_blocks, dst_blocks, ext_param, timeout_s, tag) is
 * LlmDataDist.push_kv_blocks for a kept plan of host memory, already prepared: the kept
 * plan's key and checks (PlanMixin._kept), the tag, the timeout, the claim (Writes.claim),
 * the post and the spin (_Prepared.push) and the release of the claim, on the same objects
 * and in the same order as the Python path (llm_datadist.py, plans.py, inflight.py,
 * nixl_prepared.py), which stays the reference and the fallback. It returns
 *   - None, having done nothing, whenever the request is not that case (no kept plan, a
 *     plan no longer valid or not prepared, arguments of other types, a memo to refresh):
 *     the caller then takes the Python path from the start;
 *   - the tag, once the transfer completed;
 * and raises what the Python path raises. The branches other than the common one (a
 * claim that must take the lock, no idle transfer, a post that fails, is refused or
 * outlasts the spin, a closed plan) call the Python methods the Python path calls there,
 * so that each of those rules is written once.
 *
 * Why: between back-to-back small pushes each microsecond before NIXL's post costs ~3 us
 * of the push (docs/DATADIST.md, "Where the small-push time goes"); this does in ~1.8 us
 * what the Python path does in ~2.5 us.
 *
 * Stable ABI (Py_LIMITED_API 3.10): one build serves CPython 3.10 and later. Everything
 * runs with the GIL held, as the Python path's dict and list operations do, so the
 * lock-free reasoning of inflight.py and nixl_prepared.py holds here unchanged.
 */
#define Py_LIMITED_API 0x030A0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <time.h>

/* Interned attribute names. */
/* clang-format off */
#define NAMES(X)                                                                                 \
    X(_fast) X(fast) X(_ext_memo) X(_index_memo) X(_drained_at) X(_drain) X(_transport)          \
    X(_tag_prefix) X(_timeout) X(_writes) X(claim) X(_post_failed) X(_small_wait) X(cache_id)    \
    X(broken) X(pending) X(epoch) X(caches) X(nbytes) X(prepared) X(alive) X(handles) X(push)    \
    X(t) X(_handle) X(_post) X(_status) X(_after) X(_keep) X(_drop) X(ndim) X(size) X(dtype)     \
    X(tobytes) X(closed) X(_tag)
/* clang-format on */
#define DECLARE(n) static PyObject *s_##n;
NAMES(DECLARE)
#undef DECLARE
static PyObject *s_src_cache; /* the argument a failed post names */
static PyObject *zero;

/* What setup() was given: the Python path's types, helper and constants (one source). */
static PyObject *cache_type, *ndarray_type, *ids_key;
static Py_ssize_t plan_blocks, idle_per_plan;
static double drain_every_s, poll_spin_s;

/* node._fast and kept.fast (llm_datadist.py, node_base.Kept): objects fixed for the life
 * of the node / plan, one attribute read instead of one per object. */
enum { N_PLANS, N_CACHES, N_PEERS, N_BY_DST, N_CLAIM_IDS, N_TAGS, N_MEMO };
/* node._fast[N_MEMO]: the last request whose plan was found (see memo_hit). */
enum { M_CACHE, M_INDEX, M_EXT, M_CID, M_SDTYPE, M_SBYTES, M_DDTYPE, M_DBYTES, M_KEPT, M_LEN };
enum {
    K_LOCAL,
    K_LOCAL_ID,
    K_PEER,
    K_PEER_ID,
    K_REMOTE,
    K_REMOTE_ID,
    K_EPOCH,
    K_PLAN,
    K_NOTIF,
    K_DST,
    K_LO,
    K_HI,
    K_SMALL
};

static double monotonic(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* time.monotonic()'s clock on Linux */
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* obj.name: 1 true, 0 false, -1 error. */
static int attr_true(PyObject *obj, PyObject *name)
{
    PyObject *v = PyObject_GetAttr(obj, name);
    int r = v == NULL ? -1 : PyObject_IsTrue(v);
    Py_XDECREF(v);
    return r;
}

/* obj.name is expect: 1 yes, 0 no, -1 error. */
static int attr_is(PyObject *obj, PyObject *name, PyObject *expect)
{
    PyObject *v = PyObject_GetAttr(obj, name);
    int r = v == NULL ? -1 : v == expect;
    Py_XDECREF(v);
    return r;
}

/* d.get(k) is expect: 1 yes, 0 no, -1 error. */
static int listed(PyObject *d, PyObject *k, PyObject *expect)
{
    PyObject *v = k == NULL ? NULL : PyDict_GetItemWithError(d, k); /* borrowed */
    return v == NULL && PyErr_Occurred() ? -1 : v == expect;
}

/* The kept-plan key of one block-id argument as PlanMixin._kept takes it: an exact
 * ndarray, 1-D with at most plan_blocks ids, gives (dtype, bytes); anything else what
 * _ids_key gives (None: not kept). New reference; NULL: error. */
static PyObject *blocks_key(PyObject *blocks)
{
    if (Py_TYPE(blocks) != (PyTypeObject *)ndarray_type) {
        PyObject *pair = PyObject_CallFunctionObjArgs(ids_key, blocks, NULL);
        PyObject *key = pair == NULL ? NULL : PyTuple_GetItem(pair, 0);
        Py_XINCREF(key);
        Py_XDECREF(pair);
        return key;
    }
    PyObject *v = PyObject_GetAttr(blocks, s_ndim), *dtype = NULL, *bytes = NULL, *key = NULL;
    long ndim = v == NULL ? -1 : PyLong_AsLong(v);
    Py_XDECREF(v);
    if (PyErr_Occurred())
        return NULL;
    v = PyObject_GetAttr(blocks, s_size);
    Py_ssize_t n = v == NULL ? -1 : PyLong_AsSsize_t(v);
    Py_XDECREF(v);
    if (PyErr_Occurred())
        return NULL;
    if (ndim != 1 || n > plan_blocks)
        Py_RETURN_NONE;
    if ((dtype = PyObject_GetAttr(blocks, s_dtype)) != NULL &&
        (bytes = PyObject_CallMethodObjArgs(blocks, s_tobytes, NULL)) != NULL)
        key = PyTuple_Pack(2, dtype, bytes);
    Py_XDECREF(dtype);
    Py_XDECREF(bytes);
    return key;
}

/* The key memoized for a frozen argument (node._ext_memo / _index_memo: (the last
 * object, its key)): a new reference; None when the memo holds another object or the key
 * is None (the Python path refreshes the memo, or decides); NULL: error. */
static PyObject *memo_key(PyObject *node, PyObject *name, PyObject *arg)
{
    PyObject *memo = PyObject_GetAttr(node, name);
    PyObject *obj = memo == NULL ? NULL : PyTuple_GetItem(memo, 0);
    PyObject *key = obj == NULL ? NULL : obj == arg ? PyTuple_GetItem(memo, 1) : Py_None;
    Py_XINCREF(key);
    Py_XDECREF(memo);
    return key;
}

/* The block-id array a (an exact ndarray) is 1-D with the dtype object dtype and the
 * bytes bytes: 1 yes, 0 no, -1 error. */
static int same_ids(PyObject *a, PyObject *dtype, PyObject *bytes)
{
    PyObject *v = PyObject_GetAttr(a, s_ndim);
    long ndim = v == NULL ? -1 : PyLong_AsLong(v);
    Py_XDECREF(v);
    if (PyErr_Occurred())
        return -1;
    if (ndim != 1 || (v = PyObject_GetAttr(a, s_dtype)) == NULL)
        return ndim != 1 ? 0 : -1;
    int r = v == dtype;
    Py_DECREF(v);
    if (!r || (v = PyObject_CallMethodObjArgs(a, s_tobytes, NULL)) == NULL)
        return r ? -1 : 0;
    r = PyObject_RichCompareBool(v, bytes, Py_EQ);
    Py_DECREF(v);
    return r;
}

/* The request's kept plan from the node's memo of the last request whose plan was found
 * (node._fast[N_MEMO]), without its key: the same cache, index and ext_param objects
 * (frozen: their keys are fixed), block-id arrays of the same dtype object and bytes,
 * and the plan not closed (a plan is closed whenever it leaves node._plans, so it is
 * still the one kept under that key). 1: hit (*kept and *cid borrowed), 0: miss, -1:
 * error. */
static int memo_hit(PyObject *memo, PyObject **args, PyObject **kept, PyObject **cid)
{
    if (PyList_Size(memo) != M_LEN || PyList_GetItem(memo, M_CACHE) != args[1] ||
        PyList_GetItem(memo, M_INDEX) != args[2] || PyList_GetItem(memo, M_EXT) != args[5])
        return 0;
    for (int i = 0; i < 2; i++) {
        int r = Py_TYPE(args[3 + i]) != (PyTypeObject *)ndarray_type
                    ? 0
                    : same_ids(args[3 + i], PyList_GetItem(memo, M_SDTYPE + 2 * i),
                               PyList_GetItem(memo, M_SBYTES + 2 * i));
        if (r != 1)
            return r;
    }
    *kept = PyList_GetItem(memo, M_KEPT);
    *cid = PyList_GetItem(memo, M_CID);
    int r = attr_true(*kept, s_closed);
    return r < 0 ? -1 : !r;
}

/* Remember the request whose kept plan was found (arrays only: what memo_hit checks). */
static int memo_set(PyObject *memo, PyObject **args, PyObject *cid, PyObject *skey, PyObject *dkey,
                    PyObject *kept)
{
    if (Py_TYPE(args[3]) != (PyTypeObject *)ndarray_type ||
        Py_TYPE(args[4]) != (PyTypeObject *)ndarray_type)
        return PyList_SetSlice(memo, 0, PY_SSIZE_T_MAX, NULL);
    PyObject *items = PyList_New(M_LEN);
    if (items == NULL)
        return -1;
    PyObject *v[M_LEN] = {args[1],
                          args[2],
                          args[5],
                          cid,
                          PyTuple_GetItem(skey, 0),
                          PyTuple_GetItem(skey, 1),
                          PyTuple_GetItem(dkey, 0),
                          PyTuple_GetItem(dkey, 1),
                          kept};
    for (int i = 0; i < M_LEN; i++) {
        Py_XINCREF(v[i]);
        PyList_SetItem(items, i, v[i]);
    }
    int r = PyErr_Occurred() ? -1 : PyList_SetSlice(memo, 0, PY_SSIZE_T_MAX, items);
    Py_DECREF(items);
    return r;
}

/* The kept plan of the request, if it can be used as it is (PlanMixin._kept): a new
 * reference, its fast tuple in *kf (new); None: the Python path decides; NULL: error.
 * Reads the in-band notices first when due, as _kept does. nf: node._fast. */
static PyObject *kept_plan(PyObject *node, PyObject *nf, PyObject **args, PyObject **kf)
{
    PyObject *cache = args[1], *ekey = NULL, *ikey = NULL, *skey = NULL, *dkey = NULL, *cid = NULL,
             *key = NULL;
    PyObject *kept = NULL, *v = NULL, *result = NULL;
    int r = 0, hit = memo_hit(PyTuple_GetItem(nf, N_MEMO), args, &kept, &cid);
    if (hit < 0)
        return NULL;
    if (hit) {
        Py_INCREF(kept);
        Py_INCREF(cid);
        goto found;
    }
    kept = cid = NULL;
    if ((ekey = memo_key(node, s__ext_memo, args[5])) == NULL ||
        (ikey = memo_key(node, s__index_memo, args[2])) == NULL)
        goto done;
    if (ekey == Py_None || ikey == Py_None)
        goto none;
    if ((skey = blocks_key(args[3])) == NULL || (dkey = blocks_key(args[4])) == NULL)
        goto done;
    if (skey == Py_None || dkey == Py_None)
        goto none;
    if ((cid = PyObject_GetAttr(cache, s_cache_id)) == NULL ||
        (key = PyTuple_Pack(6, s_push, cid, ikey, skey, dkey, ekey)) == NULL)
        goto done;
    if ((kept = PyDict_GetItemWithError(PyTuple_GetItem(nf, N_PLANS), key)) == NULL) {
        if (PyErr_Occurred())
            goto done;
        goto none;
    }
    Py_INCREF(kept);
found:
    /* The in-band notices first, when due (decision 12). */
    v = PyObject_GetAttr(node, s__drained_at);
    double drained = v == NULL ? -1.0 : PyFloat_AsDouble(v);
    Py_CLEAR(v);
    if (PyErr_Occurred())
        goto done;
    if (monotonic() - drained >= drain_every_s) {
        if ((v = PyObject_CallMethodObjArgs(node, s__drain, NULL)) == NULL)
            goto done;
        Py_CLEAR(v);
    }
    /* Everything the plan was checked against still this node's: the local cache
     * registered, the peer linked, not broken, its metadata loaded, the same link epoch,
     * and the remote CacheInfo the one in the peer's table (see _kept). */
    if ((*kf = PyObject_GetAttr(kept, s_fast)) == NULL)
        goto done;
    PyObject *peer = PyTuple_GetItem(*kf, K_PEER);
    if (peer == NULL || (r = listed(PyTuple_GetItem(nf, N_CACHES), cid, cache)) != 1 ||
        (r = listed(PyTuple_GetItem(nf, N_PEERS), PyTuple_GetItem(*kf, K_PEER_ID), peer)) != 1)
        goto check;
    if ((r = attr_true(peer, s_broken)) != 0) {
        r = r < 0 ? -1 : 0;
        goto check;
    }
    if ((r = attr_is(peer, s_pending, Py_None)) != 1 ||
        (r = attr_is(peer, s_epoch, PyTuple_GetItem(*kf, K_EPOCH))) != 1)
        goto check;
    if ((v = PyObject_GetAttr(peer, s_caches)) == NULL)
        goto done;
    if ((r = listed(v, PyTuple_GetItem(*kf, K_REMOTE_ID), PyTuple_GetItem(*kf, K_REMOTE))) != 1)
        goto check;
    if (!hit && memo_set(PyTuple_GetItem(nf, N_MEMO), args, cid, skey, dkey, kept) < 0)
        goto done;
    result = kept;
    kept = NULL;
    goto done;
check:
    if (r < 0)
        goto done;
none:
    Py_INCREF(Py_None);
    result = Py_None;
done:
    if (result == NULL || result == Py_None)
        Py_CLEAR(*kf);
    Py_XDECREF(ekey);
    Py_XDECREF(ikey);
    Py_XDECREF(skey);
    Py_XDECREF(dkey);
    Py_XDECREF(cid);
    Py_XDECREF(key);
    Py_XDECREF(kept);
    Py_XDECREF(v);
    return result;
}

/* Writes.claim (inflight.py): its lock-free branch, a destination with nothing in
 * flight; otherwise Writes.claim itself, which may raise REPEAT_REQUEST. New reference;
 * NULL: error. */
static PyObject *claim(PyObject *node, PyObject *nf, PyObject *kf)
{
    PyObject *by_dst = PyTuple_GetItem(nf, N_BY_DST), *plan = PyTuple_GetItem(kf, K_PLAN);
    PyObject *dst = PyTuple_GetItem(kf, K_DST), *lo = PyTuple_GetItem(kf, K_LO),
             *hi = PyTuple_GetItem(kf, K_HI);
    PyObject *busy = NULL, *cid = NULL, *c = NULL, *writes = NULL, *span = NULL;
    if (by_dst == NULL || plan == NULL || dst == NULL || lo == NULL || hi == NULL)
        return NULL;
    busy = PyDict_GetItemWithError(by_dst, dst); /* borrowed */
    if (busy == NULL && PyErr_Occurred())
        return NULL;
    if (busy != NULL && PyDict_Size(busy) == 0) {
        Py_INCREF(busy);
        if ((cid = PyIter_Next(PyTuple_GetItem(nf, N_CLAIM_IDS))) == NULL ||
            (c = PyList_New(7)) == NULL)
            goto fail;
        PyObject *items[7] = {dst, lo, hi, plan, Py_None, busy, cid}; /* inflight.py's claim list */
        for (int i = 0; i < 7; i++) {
            Py_INCREF(items[i]);
            PyList_SetItem(c, i, items[i]);
        }
        if (PyDict_SetItem(busy, cid, c) < 0)
            goto fail;
        if (PyDict_Size(busy) == 1 && PyDict_GetItemWithError(by_dst, dst) == busy)
            goto out; /* claimed */
        if (PyErr_Occurred())
            goto fail;
        if (PyDict_DelItem(busy, cid) < 0) /* another claim came in at once: busy.pop(cid, None) */
        {
            if (!PyErr_ExceptionMatches(PyExc_KeyError))
                goto fail;
            PyErr_Clear();
        }
        Py_CLEAR(c);
        Py_CLEAR(busy);
        Py_CLEAR(cid);
    }
    if ((writes = PyObject_GetAttr(node, s__writes)) != NULL &&
        (span = PyTuple_Pack(2, lo, hi)) != NULL)
        c = PyObject_CallMethodObjArgs(writes, s_claim, dst, plan, span, NULL);
    Py_XDECREF(writes);
    Py_XDECREF(span);
    return c;
fail:
    Py_CLEAR(c);
out:
    Py_XDECREF(busy);
    Py_XDECREF(cid);
    return c;
}

/* Writes.release, inline: the claim popped from its destination's dict. 0, or -1: error. */
static int release(PyObject *c)
{
    if (PyDict_DelItem(PyList_GetItem(c, 5), PyList_GetItem(c, 6)) == 0)
        return 0;
    if (!PyErr_ExceptionMatches(PyExc_KeyError))
        return -1;
    PyErr_Clear();
    return 0;
}

/* The exception being raised, its traceback attached; the error indicator cleared. */
static PyObject *fetch(void)
{
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (value != NULL && tb != NULL)
        PyException_SetTraceback(value, tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    return value;
}

/* The bindings' status code st is code (~0.1 us: a pybind11 enum). 1, 0, -1: error. */
static int is(PyObject *st, PyObject *code)
{
    return PyObject_RichCompareBool(st, code, Py_EQ);
}

/* _Prepared.push (nixl_prepared.py): None when complete within spin_s (the transfer kept
 * for the next post), else the transfer, for the caller's wait; NULL: the post failed. */
static PyObject *post(PyObject *prepared, PyObject *notif, double spin_s)
{
    PyObject *handles = PyObject_GetAttr(prepared, s_handles), *h = NULL, *t = NULL, *raw = NULL,
             *fn = NULL;
    PyObject *status = NULL, *st = NULL, *exc = NULL, *result = NULL;
    Py_ssize_t n = handles == NULL || !PyList_CheckExact(handles) ? -1 : PyList_Size(handles);
    int posted = 0, r;
    if (handles == NULL && PyErr_ExceptionMatches(PyExc_AttributeError))
        PyErr_Clear(); /* another backend's Prepared (no idle transfers): its push */
    if (n <= 0) {      /* none idle: _Prepared.push makes one */
        PyObject *spin = PyErr_Occurred() ? NULL : PyFloat_FromDouble(spin_s);
        if (spin != NULL)
            result = PyObject_CallMethodObjArgs(prepared, s_push, notif, spin, NULL);
        Py_XDECREF(spin);
        Py_XDECREF(handles);
        return result;
    }
    /* handles.pop(): atomic, as in Python (nothing between the two calls runs Python). */
    h = PyList_GetItem(handles, n - 1);
    Py_INCREF(h);
    if (PySequence_DelItem(handles, n - 1) < 0)
        goto done;
    if ((t = PyObject_GetAttr(prepared, s_t)) == NULL ||
        (raw = PyObject_GetAttr(h, s__handle)) == NULL ||
        (fn = PyObject_GetAttr(t, s__post)) == NULL ||
        (status = PyObject_GetAttr(t, s__status)) == NULL ||
        (st = PyObject_CallFunctionObjArgs(fn, raw, notif, NULL)) == NULL)
        goto raised;
    posted = 1;
    PyObject *check = PyTuple_GetItem(status, 0), *done_code = PyTuple_GetItem(status, 1);
    PyObject *proc = PyTuple_GetItem(status, 2);
    if (check == NULL || done_code == NULL || proc == NULL || (r = is(st, proc)) < 0)
        goto raised;
    if (r) { /* the spin: one comparison per check */
        double end = monotonic() + spin_s;
        for (;;) {
            Py_CLEAR(st);
            if ((st = PyObject_CallFunctionObjArgs(check, raw, NULL)) == NULL ||
                (r = is(st, done_code)) < 0)
                goto raised;
            if (r)
                break;
            if ((r = is(st, proc)) < 0)
                goto raised;
            if (!r || monotonic() >= end) /* failed, or still running */
            {
                result =
                    PyObject_CallMethodObjArgs(prepared, s__after, h, st, Py_None, Py_True, NULL);
                goto done;
            }
        }
    } else if ((r = is(st, done_code)) <= 0) {
        if (r < 0)
            goto raised;
        result = PyObject_CallMethodObjArgs(prepared, s__after, h, st, Py_None, Py_False,
                                            NULL); /* refused */
        goto done;
    }
    /* Complete: kept for the next post (_Prepared._keep's common branch, inline). */
    Py_CLEAR(handles);
    if ((r = attr_true(prepared, s_alive)) < 0 ||
        (handles = PyObject_GetAttr(prepared, s_handles)) == NULL)
        goto done;
    if (!r || !PyList_CheckExact(handles) || PyList_Size(handles) >= idle_per_plan)
        result = PyObject_CallMethodObjArgs(prepared, s__keep, h, NULL);
    else if (PyList_Append(handles, h) == 0 && (r = attr_true(prepared, s_alive)) > 0) {
        Py_INCREF(Py_None);
        result = Py_None;
    } else if (r == 0) /* closed meanwhile */
        result = PyObject_CallMethodObjArgs(prepared, s__drop, h, NULL);
    goto done;
raised: /* _Prepared._after decides: a failed post raises, a failed check is waited on */
    exc = fetch();
    result = PyObject_CallMethodObjArgs(prepared, s__after, h, Py_None, exc ? exc : Py_None,
                                        posted ? Py_True : Py_False, NULL);
done:
    Py_XDECREF(handles);
    Py_XDECREF(h);
    Py_XDECREF(t);
    Py_XDECREF(raw);
    Py_XDECREF(fn);
    Py_XDECREF(status);
    Py_XDECREF(st);
    Py_XDECREF(exc);
    return result;
}

/* The tag: the caller's as node._tag checks it (PARAM_INVALID), or "<prefix><n>" as
 * f"{self._tag_prefix}{next(self._tags)}". */
static PyObject *make_tag(PyObject *node, PyObject *nf, PyObject *tag)
{
    if (tag != Py_None)
        return PyObject_CallMethodObjArgs(node, s__tag, tag, NULL);
    PyObject *prefix = PyObject_GetAttr(node, s__tag_prefix), *num = NULL, *s = NULL, *out = NULL;
    if (prefix != NULL && (num = PyIter_Next(PyTuple_GetItem(nf, N_TAGS))) != NULL &&
        (s = PyObject_Str(num)) != NULL)
        out = PyUnicode_Concat(prefix, s);
    else if (prefix != NULL && !PyErr_Occurred())
        PyErr_SetString(PyExc_RuntimeError, "the tag counter ended");
    Py_XDECREF(prefix);
    Py_XDECREF(num);
    Py_XDECREF(s);
    return out;
}

static PyObject *py_push(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    (void)mod;
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "push: expected 8 arguments");
        return NULL;
    }
    PyObject *node = args[0], *timeout_s = args[6], *tag = args[7];
    PyObject *nf = NULL, *kept = NULL, *kf = NULL, *prepared = NULL, *tagobj = NULL,
             *timeout = NULL, *c = NULL;
    PyObject *notif = NULL, *xfer = NULL, *result = NULL, *v = NULL;
    int r;
    /* A tag that is not a non-empty exact str, or a cache of another type: the Python
     * path says what is wrong. */
    if (cache_type == NULL ||
        (tag != Py_None && !(PyUnicode_CheckExact(tag) && PyUnicode_GetLength(tag) > 0)) ||
        Py_TYPE(args[1]) != (PyTypeObject *)cache_type)
        Py_RETURN_NONE;
    if ((nf = PyObject_GetAttr(node, s__fast)) == NULL ||
        (kept = kept_plan(node, nf, (PyObject **)args, &kf)) == NULL)
        goto done;
    if (kept == Py_None || (r = PyObject_IsTrue(PyTuple_GetItem(kf, K_SMALL))) == 0)
        goto none;
    if (r < 0 || (v = PyObject_GetAttr(node, s__transport)) == NULL)
        goto done;
    r = v == Py_None;
    Py_CLEAR(v);
    if (r)
        goto none;
    /* A plan not prepared yet, or closed, is prepared by the Python path (under its lock). */
    if ((prepared = PyObject_GetAttr(kept, s_prepared)) == NULL)
        goto done;
    if (prepared == Py_None || (r = attr_true(prepared, s_alive)) == 0)
        goto none;
    if (r < 0)
        goto done;
    /* From here on, the Python path's order: the tag, the timeout, the claim, the post. */
    if ((tagobj = make_tag(node, nf, tag)) == NULL)
        goto done;
    PyObject *plan = PyTuple_GetItem(kf, K_PLAN);
    if ((PyFloat_CheckExact(timeout_s) || PyLong_CheckExact(timeout_s)) &&
        (r = PyObject_RichCompareBool(timeout_s, zero, Py_GT)) !=
            0) { /* a number > 0 (NaN is not), as _timeout */
        if (r < 0)
            goto done;
        Py_INCREF(timeout_s);
        timeout = timeout_s;
    } else { /* the default, or PARAM_INVALID */
        PyObject *nbytes = PyObject_GetAttr(plan, s_nbytes);
        if (nbytes != NULL)
            timeout = PyObject_CallMethodObjArgs(node, s__timeout, nbytes, timeout_s, NULL);
        Py_XDECREF(nbytes);
        if (timeout == NULL)
            goto done;
    }
    double seconds = PyFloat_AsDouble(timeout);
    if (seconds == -1.0 &&
        PyErr_Occurred()) { /* an int too large for a double: as long as inf here */
        if (!PyErr_ExceptionMatches(PyExc_OverflowError))
            goto done;
        PyErr_Clear();
        seconds = Py_HUGE_VAL;
    }
    double spin = seconds > poll_spin_s ? poll_spin_s : seconds;
    if ((c = claim(node, nf, kf)) == NULL) /* REPEAT_REQUEST (D8) */
        goto done;
    /* The post: what raises from here is the Python path's _post_failed (claim released). */
    PyObject *tail = PyUnicode_AsUTF8String(tagobj);
    notif = PyTuple_GetItem(kf, K_NOTIF);
    Py_XINCREF(notif);
    if (tail == NULL || notif == NULL)
        Py_CLEAR(notif);
    else
        PyBytes_Concat(&notif, tail); /* kept.notif + tag.encode() */
    Py_XDECREF(tail);
    if (notif == NULL || (xfer = post(prepared, notif, spin)) == NULL) {
        PyObject *exc = fetch();
        if (exc != NULL) /* raises */
            v = PyObject_CallMethodObjArgs(node, s__post_failed, exc, c, s_src_cache,
                                           PyTuple_GetItem(kf, K_LOCAL),
                                           PyTuple_GetItem(kf, K_PEER), NULL);
        Py_XDECREF(exc);
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_RuntimeError, "the small push failed and _post_failed returned");
        goto done;
    }
    if (xfer == Py_None) { /* complete within the spin */
        if (release(c) == 0) {
            Py_INCREF(tagobj);
            result = tagobj;
        }
        goto done;
    }
    /* Outlasted the spin, or failed: the Python path's handle and wait. */
    PyObject *pyspin = PyFloat_FromDouble(spin);
    if (pyspin != NULL)
        result = PyObject_CallMethodObjArgs(node, s__small_wait, xfer, tagobj, kept, timeout, c,
                                            pyspin, NULL);
    Py_XDECREF(pyspin);
    goto done;
none:
    Py_INCREF(Py_None);
    result = Py_None;
done:
    Py_XDECREF(nf);
    Py_XDECREF(kept);
    Py_XDECREF(kf);
    Py_XDECREF(v);
    Py_XDECREF(prepared);
    Py_XDECREF(tagobj);
    Py_XDECREF(timeout);
    Py_XDECREF(c);
    Py_XDECREF(notif);
    Py_XDECREF(xfer);
    return result;
}

static PyObject *py_setup(PyObject *mod, PyObject *args)
{
    (void)mod;
    PyObject *cache, *ndarray, *ids;
    if (!PyArg_ParseTuple(args, "OOOnddn:setup", &cache, &ndarray, &ids, &plan_blocks,
                          &drain_every_s, &poll_spin_s, &idle_per_plan))
        return NULL;
    PyObject *old[3] = {cache_type, ndarray_type, ids_key};
    Py_INCREF(cache);
    Py_INCREF(ndarray);
    Py_INCREF(ids);
    cache_type = cache;
    ndarray_type = ndarray;
    ids_key = ids;
    for (int i = 0; i < 3; i++)
        Py_XDECREF(old[i]);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"push", (PyCFunction)(void (*)(void))py_push, METH_FASTCALL,
     "push(node, cache, index, src_blocks, dst_blocks, ext_param, timeout_s, tag): the tag once "
     "the push "
     "completed, or None (not a kept small push: nothing done)."},
    {"setup", py_setup, METH_VARARGS,
     "setup(Cache, ndarray, ids_key, plan_blocks, drain_every_s, poll_spin_s, idle_per_plan): the "
     "Python "
     "path's types, helper and constants."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT,
                                    "_smallpush",
                                    "The small-push path in C (docs/DATADIST.md decision 15).",
                                    -1,
                                    methods,
                                    NULL,
                                    NULL,
                                    NULL,
                                    NULL};

PyMODINIT_FUNC PyInit__smallpush(void)
{
#define INTERN(n)                                                                                  \
    if ((s_##n = PyUnicode_InternFromString(#n)) == NULL)                                          \
        return NULL;
    NAMES(INTERN)
#undef INTERN
    if ((s_src_cache = PyUnicode_InternFromString("src_cache")) == NULL ||
        (zero = PyLong_FromLong(0)) == NULL)
        return NULL;
    return PyModule_Create(&module);
}
