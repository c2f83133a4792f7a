"""torch.ops.pytrt_kv (pytrt_kv/torch_ops.py, docs/GRAPH_MODE.md "torch.compile"): in-place
custom ops equal to the reference, eager and under torch.compile(fullgraph=True)."""

from __future__ import annotations

import numpy as np
import pytest

from onnx_export import single_op_model
from pytrt_kv import reference
from pytrt_kv.contract import dtypes, specs
from pytrt_kv.graph.feeds import make_feeds

torch = pytest.importorskip("torch", reason="torch not installed (extra 'torch')")
torch_ops = pytest.importorskip("pytrt_kv.torch_ops")

GATHER_NAMES = specs.GATHER_SELECTION_KV_CACHE.input_names


def _scatter_feeds(dt, value=True, seed=0):
    d = dtypes.numpy_dtype(dt)
    shapes = {
        "key": np.zeros((5, 2, 8), d),
        "key_cache": np.zeros((6, 4, 2, 8), d),
        "slot_mapping": np.zeros(5, np.int32),
    }
    if value:
        shapes["value"] = np.zeros((5, 2, 8), d)
        shapes["value_cache"] = np.zeros((6, 4, 2, 8), d)
    return make_feeds(single_op_model("ScatterPaKvCache", shapes), seed=seed)


def _tensor(a):
    """A CPU tensor with ``a``'s bytes (bfloat16/float8 through a same-width view)."""
    name = dtypes.name_of(a.dtype)
    if name in (specs.BFLOAT16, specs.FLOAT8_E4M3, specs.FLOAT8_E5M2):
        raw = torch.from_numpy(a.view(np.int16 if a.dtype.itemsize == 2 else np.uint8).copy())
        return raw.view(getattr(torch, name))
    return torch.from_numpy(a.copy())


def _bytes(t):
    return torch_ops.as_numpy(t, "t").tobytes()


def _scatter_ref(f):
    r = {k: v.copy() for k, v in f.items()}
    reference.scatter_pa_kv_cache(
        r["key"], r.get("value"), r["key_cache"], r.get("value_cache"), r["slot_mapping"]
    )
    return r


@pytest.mark.parametrize("dt", ["float16", "bfloat16", "float32", "float8_e4m3fn", "int8"])
@pytest.mark.parametrize("value", [True, False])
def test_scatter_eager_writes_the_caches_in_place(dt, value):
    f = _scatter_feeds(dt, value)
    t = {k: _tensor(v) for k, v in f.items()}
    ptr = t["key_cache"].data_ptr()
    out = torch.ops.pytrt_kv.scatter_pa_kv_cache_(
        t["key"], t.get("value"), t["key_cache"], t.get("value_cache"), t["slot_mapping"]
    )
    assert out is None and t["key_cache"].data_ptr() == ptr
    want = _scatter_ref(f)
    assert _bytes(t["key_cache"]) == want["key_cache"].tobytes()
    assert not value or _bytes(t["value_cache"]) == want["value_cache"].tobytes()
    assert _bytes(t["key_cache"]) != f["key_cache"].tobytes()  # something was written


def _gather_case(dt="float16", seed=0):
    from support.models import gather_model

    model = gather_model(dt, False, 4)
    f = make_feeds(model, seed=seed)
    return [f[n] for n in GATHER_NAMES]


def test_gather_eager_equals_reference_and_returns_actual_seq():
    args = _gather_case()
    t = [_tensor(a) for a in args]
    actual = torch.ops.pytrt_kv.gather_selection_kv_cache_(*t, 4)
    want = [a.copy() for a in args]
    want_actual = reference.gather_selection_kv_cache(*want, selection_topk_block_size=4)
    assert actual.dtype == torch.int32 and actual.numpy().tobytes() == want_actual.tobytes()
    for i in (0, 1, 3):  # the mutated arguments
        assert _bytes(t[i]) == want[i].tobytes(), GATHER_NAMES[i]


def test_refusals_are_the_references():
    f = _scatter_feeds("float16")
    f["slot_mapping"] = f["slot_mapping"].copy()
    f["slot_mapping"][:2] = 3
    t = {k: _tensor(v) for k, v in f.items()}
    with pytest.raises(ValueError) as want:
        _scatter_ref(f)
    with pytest.raises(ValueError) as got:
        torch.ops.pytrt_kv.scatter_pa_kv_cache_(
            t["key"], t["value"], t["key_cache"], t["value_cache"], t["slot_mapping"]
        )
    assert str(got.value) == str(want.value)
    assert _bytes(t["key_cache"]) == f["key_cache"].tobytes()  # a refused call wrote nothing


def _decode_step(key, value, key_cache, value_cache, slot_mapping, gather):
    torch.ops.pytrt_kv.scatter_pa_kv_cache_(key, value, key_cache, value_cache, slot_mapping)
    return torch.ops.pytrt_kv.gather_selection_kv_cache_(*gather, 4)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_decode_step_has_no_graph_break_and_writes_in_place(backend):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    f = _scatter_feeds("float16")
    g = _gather_case()
    t = {k: _tensor(v) for k, v in f.items()}
    tg = [_tensor(a) for a in g]
    ptrs = [t["key_cache"].data_ptr(), tg[1].data_ptr()]
    compiled = torch.compile(_decode_step, fullgraph=True, backend=backend)
    actual = compiled(t["key"], t["value"], t["key_cache"], t["value_cache"], t["slot_mapping"], tg)
    assert not counters["graph_break"]
    assert [t["key_cache"].data_ptr(), tg[1].data_ptr()] == ptrs
    want = _scatter_ref(f)
    assert _bytes(t["key_cache"]) == want["key_cache"].tobytes()
    assert _bytes(t["value_cache"]) == want["value_cache"].tobytes()
    wg = [a.copy() for a in g]
    want_actual = reference.gather_selection_kv_cache(*wg, selection_topk_block_size=4)
    assert actual.numpy().tobytes() == want_actual.tobytes()
    for i in (0, 1, 3):
        assert _bytes(tg[i]) == wg[i].tobytes(), GATHER_NAMES[i]


def test_fake_tensors_give_the_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    g = _gather_case()
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(_tensor(a)) for a in g]
        out = torch.ops.pytrt_kv.gather_selection_kv_cache_(*fake, 4)
        assert tuple(out.shape) == (g[2].shape[0],) and out.dtype == torch.int32


def test_ops_under_torch_compile_goes_through_the_registered_op(monkeypatch):
    """pytrt_kv.ops with torch tensors inside a compiled function: traced as the
    registered op (no graph break), which then runs on the tensors' device."""
    from torch._dynamo.utils import counters

    from pytrt_kv import ops

    torch._dynamo.reset()
    counters.clear()
    f = _scatter_feeds("float32")
    t = {k: _tensor(v) for k, v in f.items()}

    def step(key, value, key_cache, value_cache, slot_mapping):
        ops.scatter_pa_kv_cache(key, value, key_cache, value_cache, slot_mapping)
        return key_cache

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    compiled(t["key"], t["value"], t["key_cache"], t["value_cache"], t["slot_mapping"])
    assert not counters["graph_break"]
    assert _bytes(t["key_cache"]) == _scatter_ref(f)["key_cache"].tobytes()


@pytest.mark.real_gpu
def test_cuda_tensors_run_the_kernels():
    """CUDA tensors dispatch to pytrt_kv.ops' kernels (needs a real GPU: the emulated
    device has no torch CUDA tensors)."""
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    f = _scatter_feeds("bfloat16")
    t = {k: _tensor(v).cuda() for k, v in f.items()}
    compiled = torch.compile(_decode_step_scatter_only, fullgraph=True)
    compiled(t["key"], t["value"], t["key_cache"], t["value_cache"], t["slot_mapping"])
    torch.cuda.synchronize()
    assert _bytes(t["key_cache"].cpu()) == _scatter_ref(f)["key_cache"].tobytes()
    g = _gather_case("bfloat16")
    tg = [_tensor(a).cuda() for a in g]
    actual = torch.ops.pytrt_kv.gather_selection_kv_cache_(*tg, 4)
    wg = [a.copy() for a in g]
    want = reference.gather_selection_kv_cache(*wg, selection_topk_block_size=4)
    assert actual.cpu().numpy().tobytes() == want.tobytes()
    assert _bytes(tg[1].cpu()) == wg[1].tobytes()


def _decode_step_scatter_only(key, value, key_cache, value_cache, slot_mapping):
    torch.ops.pytrt_kv.scatter_pa_kv_cache_(key, value, key_cache, value_cache, slot_mapping)


def test_ops_module_does_not_import_the_torch_ops():
    """pytrt_kv.torch_ops imports pytrt_kv.ops (CUDA tensors), never the reverse: the
    registration is the explicit `import pytrt_kv.torch_ops` (docs/ARCHITECTURE.md, no
    import cycles)."""
    import subprocess
    import sys

    code = "import sys, torch, pytrt_kv.ops; print('pytrt_kv.torch_ops' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr
