"""The model checks' invariant over a corpus of mutated models (issue 31 item 1).

A small, seeded mutation fuzzer takes a few single-op models (tests/support/models.py) and
the example model and breaks them one way each (attributes dropped or changed, declared
dtypes and dims changed, dims made symbolic, shapes removed, constant scales, outputs and
readers added or dropped, inputs swapped or emptied, the domain dropped, an empty file).
For every model of the corpus:

- ``check_model`` refuses it => the CPU runtime, ``make_evaluator``, the Polygraphy runner
  and ``pytrt-kv check`` refuse it with the same first line; with the TensorRT rules
  (``tensorrt=True``), ``prepare_for_tensorrt``, ``pytrt-kv prepare``, ``build_plan``
  and ``pytrt-kv build`` refuse it with that line too, before TensorRT is imported;
- ``check_model`` accepts it and every input shape is concrete => the runtime runs it on
  ``make_feeds`` inputs (the base's sizes where a mutant left a dim open) and
  ``prepare_for_tensorrt`` takes it; and (where TensorRT-RTX and the plugin library are
  installed) every accepted mutant is built by TensorRT-RTX (seventeen single-op and
  example models, seconds): no path ever surfaces a bare TensorRT error.

docs/GRAPH_MODE.md, "Model checks".
"""

from __future__ import annotations

import random

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper

from pytrt_kv import runtime
from pytrt_kv.cli import main
from pytrt_kv.graph import check_model
from pytrt_kv.graph.feeds import make_feeds
from pytrt_kv.graph.tensorrt import prepare_for_tensorrt
from support.env import fix_kernel_archs, forbid_tensorrt, rtx_unavailable_reason
from support.models import compress_model, gather_model, quant_model, scatter_model

#: The kernels' architectures for every path here (as scripts/test.sh builds them).
SEED = 31
#: Mutated models per base model (6 bases -> 60 mutants, seconds on the CPU), and the
#: share that gets two mutations.
PER_BASE = 10
COMPOUND = 0.4


def _bases():
    from onnx_export.example import build_example_model

    return {
        "scatter-nd": scatter_model("nd", "float16", "int32", T=3, NB=3, BS=4),
        "scatter-nz": scatter_model("nz", "bfloat16", "int64", T=3, NB=3, BS=4),
        "quant": quant_model("hnd", "float16", "float8_e4m3fn", True, T=3, NB=3, BS=4),
        "compress": compress_model("float16", "int32", "rope", B=2, Smax=4, H=2, NB=6, BS=4),
        "gather": gather_model("float16", False, 4, B=2, S=1, K=4, FBN=12, FMAX=4),
        "example": build_example_model(),
    }


# --- mutations -----------------------------------------------------------------------------


def _ours(m):
    return [n for n in m.graph.node if n.domain == "pytrt_kv"]


def _real_inputs(m):
    inits = {i.name for i in m.graph.initializer}
    return [vi for vi in m.graph.input if vi.name not in inits]


def _set_attr(node, name, value):
    kept = [a for a in node.attribute if a.name != name]
    del node.attribute[:]
    node.attribute.extend(kept)
    if value is not None:
        node.attribute.append(helper.make_attribute(name, value))


def m_drop_attribute(m, r):
    node = r.choice(_ours(m))
    names = [a.name for a in node.attribute]
    _set_attr(node, r.choice(names), None)


def m_change_attribute(m, r):
    node = r.choice(_ours(m))
    if node.op_type == "ScatterPaKvCache":
        name, value = r.choice(
            [("cache_layout", "nd"), ("cache_layout", "hnd"), ("cache_layout", "nz"),
             ("compress_mode", "omni"), ("alias_io", 2), ("alias_io", 0)]
        )  # fmt: skip
    else:
        name, value = r.choice(
            [("selection_topk_block_size", v) for v in (1, 2, 3, 8, 64, 0)] + [("alias_io", 0)]
        )
    _set_attr(node, name, value)


DTYPES = [TP.FLOAT16, TP.BFLOAT16, TP.FLOAT, TP.INT32, TP.INT64, TP.INT8, TP.UINT8,
          TP.FLOAT8E4M3FN, TP.FLOAT8E5M2, TP.DOUBLE]  # fmt: skip


def m_input_dtype(m, r):
    vi = r.choice(_real_inputs(m))
    vi.type.tensor_type.elem_type = r.choice(DTYPES)


def m_dim_symbolic(m, r):
    vi = r.choice([v for v in _real_inputs(m) if v.type.tensor_type.shape.dim])
    dim = r.choice(list(vi.type.tensor_type.shape.dim))
    dim.dim_param = r.choice(["T", "B", "X"])


def m_leading_dims_symbolic(m, r):
    """Dim 0 of every input symbolic (one name per input): the dtype and divisibility
    rules must still apply (they were skipped with any symbolic dim)."""
    del r
    for vi in _real_inputs(m):
        dims = vi.type.tensor_type.shape.dim
        if dims:
            dims[0].dim_param = f"N_{vi.name}"


def m_drop_cache_layout(m, r):
    del r
    nodes = [n for n in _ours(m) if any(a.name == "cache_layout" for a in n.attribute)]
    if not nodes:
        return False
    _set_attr(nodes[0], "cache_layout", None)
    return True


def m_dim_changed(m, r):
    vi = r.choice([v for v in _real_inputs(m) if v.type.tensor_type.shape.dim])
    dim = r.choice(list(vi.type.tensor_type.shape.dim))
    if dim.HasField("dim_value"):
        dim.dim_value = max(0, dim.dim_value + r.choice([-1, 1, 3]))


def m_no_shape(m, r):
    r.choice(_real_inputs(m)).type.tensor_type.ClearField("shape")


def m_constant_scale(m, r):
    """Make a scatter's scale input a constant (0, NaN, -1, inf or a valid 0.5)."""
    node = next((n for n in _ours(m) if len(n.input) > 8 and n.input[8]), None)
    if node is None:
        return False
    name = node.input[8]
    vi = next(v for v in m.graph.input if v.name == name)
    dims = [d.dim_value for d in vi.type.tensor_type.shape.dim]
    value = r.choice([0.0, float("nan"), -1.0, float("inf"), 0.5])
    keep = [v for v in m.graph.input if v.name != name]
    del m.graph.input[:]
    m.graph.input.extend(keep)
    m.graph.initializer.append(
        helper.make_tensor(name, TP.FLOAT, dims, np.full(dims, value, np.float32).ravel())
    )
    return True


def m_drop_output(m, r):
    out = r.choice(list(m.graph.output))
    keep = [o for o in m.graph.output if o.name != out.name]
    del m.graph.output[:]
    m.graph.output.extend(keep)


def m_cache_also_output(m, r):
    """A cache input returned as a graph output, or read by another node too."""
    node = r.choice(_ours(m))
    idx = [2, 3] if node.op_type == "ScatterPaKvCache" else [0, 1, 3]
    name = node.input[r.choice([i for i in idx if i < len(node.input) and node.input[i]])]
    src = next((v for v in m.graph.input if v.name == name), None)
    if src is None:
        return False
    if r.random() < 0.5:
        m.graph.output.append(src)
    else:
        m.graph.node.append(helper.make_node("Identity", [name], ["peek"], name="peek"))
        peek = onnx.ValueInfoProto()
        peek.CopyFrom(src)
        peek.name = "peek"
        m.graph.output.append(peek)
    return True


def m_empty_input(m, r):
    node = r.choice(_ours(m))
    i = r.randrange(len(node.input))
    node.input[i] = ""


def m_swap_inputs(m, r):
    node = r.choice(_ours(m))
    i, j = r.sample(range(len(node.input)), 2)
    node.input[i], node.input[j] = node.input[j], node.input[i]


def m_op_or_domain(m, r):
    node = r.choice(_ours(m))
    what = r.choice(["op", "opset", "version"])
    if what == "op":
        node.op_type = "ScatterKvCache"
    elif what == "opset":
        keep = [o for o in m.opset_import if o.domain != "pytrt_kv"]
        del m.opset_import[:]
        m.opset_import.extend(keep)
    else:
        for o in m.opset_import:
            if o.domain == "pytrt_kv":
                o.version = 2


MUTATIONS = [
    m_drop_attribute, m_change_attribute, m_input_dtype, m_dim_symbolic, m_dim_changed,
    m_no_shape, m_constant_scale, m_drop_output, m_cache_also_output, m_empty_input,
    m_swap_inputs, m_op_or_domain, m_leading_dims_symbolic, m_drop_cache_layout,
]  # fmt: skip


def _concrete(model) -> dict[str, tuple[int, ...]]:
    """Input name -> shape of a base model (all static): the sizes its mutants run and
    build with where a mutation made a dim symbolic or removed the shape."""
    return {
        vi.name: tuple(d.dim_value for d in vi.type.tensor_type.shape.dim)
        for vi in _real_inputs(model)
    }


def d_cache_dtype(m, r):
    """Another float dtype for the first cache input of the first pytrt_kv node."""
    del r
    node = _ours(m)[0]
    name = node.input[2 if node.op_type == "ScatterPaKvCache" else 1]
    for vi in _real_inputs(m):
        if vi.name == name:
            tt = vi.type.tensor_type
            tt.elem_type = TP.BFLOAT16 if tt.elem_type != TP.BFLOAT16 else TP.FLOAT16
            return True
    return False


def d_drop_tbs(m, r):
    del r
    nodes = [n for n in _ours(m) if n.op_type == "GatherSelectionKvCache"]
    if not nodes:
        return False
    _set_attr(nodes[0], "selection_topk_block_size", None)  # the default, 64
    return True


#: Directed mutants made of every base (where they apply): the rule each one targets is
#: not left to the seed.
DIRECTED = [
    (m_drop_cache_layout,),
    (m_leading_dims_symbolic, d_cache_dtype),
    (m_leading_dims_symbolic, d_drop_tbs),
]


def _mutant(base, chosen, r: random.Random):
    """(a copy of ``base`` with each mutation of ``chosen`` applied, drawing from ``r``;
    the mutations' names joined by "+"), or None when one of them does not apply."""
    m = onnx.ModelProto()
    m.CopyFrom(base)
    if any(mutate(m, r) is False for mutate in chosen):
        return None
    return m, "+".join(mutate.__name__[2:] for mutate in chosen)


def corpus():
    """(id, model, base shapes): the unmutated bases, PER_BASE seeded mutants of each,
    an empty model."""
    r = random.Random(SEED)
    out = []
    for base_name, base in _bases().items():
        shapes = _concrete(base)
        out.append((base_name, base, shapes))
        made = 0
        while made < PER_BASE:
            # One mutation, or two (a symbolic dim and a dtype change together are what
            # used to skip the dtype rules).
            chosen = r.sample(MUTATIONS, 2 if r.random() < COMPOUND else 1)
            mutant = _mutant(base, chosen, r)
            if mutant is None:
                continue
            out.append((f"{base_name}/{made}-{mutant[1]}", mutant[0], shapes))
            made += 1
        for chosen in DIRECTED:
            mutant = _mutant(base, chosen, r)
            if mutant is not None:
                out.append((f"{base_name}/directed-{mutant[1]}", mutant[0], shapes))
    out.append(("empty-file", onnx.ModelProto(), {}))
    return out


CORPUS = corpus()


def _dynamic_shapes(model, shapes) -> dict[str, tuple[int, ...]]:
    """The base's shapes of the inputs of ``model`` that are not static (symbolic dims
    or no shape), for make_feeds and the build's profile."""
    out = {}
    for vi in _real_inputs(model):
        tt = vi.type.tensor_type
        if tt.HasField("shape") and all(d.HasField("dim_value") for d in tt.shape.dim):
            continue
        if vi.name in shapes:
            out[vi.name] = shapes[vi.name]
    return out


@pytest.fixture(autouse=True)
def _no_tensorrt(monkeypatch):
    """Fixed kernel architectures, and TensorRT never imported in the refusal paths."""
    fix_kernel_archs(monkeypatch)
    forbid_tensorrt(monkeypatch)


def _static(m) -> bool:
    return all(
        vi.type.tensor_type.HasField("shape")
        and all(d.HasField("dim_value") for d in vi.type.tensor_type.shape.dim)
        for vi in _real_inputs(m)
    )


def _refused_alike(call, line, kind):
    with pytest.raises((ValueError, TypeError)) as exc:
        call()
    assert type(exc.value) is kind and str(exc.value) == line, (str(exc.value), line)


def test_the_corpus_is_small_varied_and_seeded():
    assert 60 <= len(CORPUS) <= 100
    assert [i for i, _, _ in corpus()] == [i for i, _, _ in CORPUS]
    refused = sum(1 for _, m, _ in CORPUS if check_model(m, tensorrt=True))
    # Both outcomes are exercised: most mutants break a rule, some stay valid.
    assert 20 <= refused < len(CORPUS) - 5, refused


@pytest.mark.parametrize("mid,model,shapes", CORPUS, ids=[i for i, _, _ in CORPUS])
def test_the_checks_agree_with_every_path(mid, model, shapes, tmp_path, capsys):
    from pytrt_kv.polygraphy import PytrtKvRefRunner
    from pytrt_kv.trt import build_plan

    src = tmp_path / "m.onnx"
    onnx.save(model, src)
    plain = check_model(model)
    full = check_model(model, tensorrt=True)
    assert [str(p) for p in plain] == [str(p) for p in full if not p.rule.startswith("tensorrt.")]
    capsys.readouterr()
    assert main(["check", str(src)]) == (1 if plain else 0)
    out = capsys.readouterr().out.splitlines()
    assert out == [str(p) for p in plain] if plain else out[0].endswith(": ok") or "ok (" in out[0]
    assert main(["check", str(src), "--tensorrt"]) == (1 if full else 0)
    if full:
        assert capsys.readouterr().out.splitlines() == [str(p) for p in full]

    if plain:
        line, kind = str(plain[0]), plain[0].kind
        _refused_alike(lambda: runtime.run(model, {}), line, kind)
        _refused_alike(lambda: runtime.make_evaluator(str(src)), line, kind)
        runner = PytrtKvRefRunner(str(src))
        _refused_alike(runner.activate, line, kind)
    else:
        # Accepted: it runs, with the base's sizes where the mutant left them open.
        feeds = make_feeds(model, seed=SEED, shapes=_dynamic_shapes(model, shapes))
        outputs = runtime.run(model, feeds)
        assert set(outputs) == {o.name for o in model.graph.output}

    if full:
        line, kind = str(full[0]), full[0].kind
        _refused_alike(lambda: prepare_for_tensorrt(model), line, kind)
        _refused_alike(lambda: build_plan(src, flavour="rtx", targets=["sm89"]), line, kind)
        dst, plan = tmp_path / "p.onnx", tmp_path / "m.plan"
        capsys.readouterr()
        assert main(["prepare", str(src), str(dst)]) == 1
        assert main(["build", str(src), "-o", str(plan), "--target", "sm89"]) == 1
        err = capsys.readouterr().err.splitlines()
        assert err == [f"pytrt-kv prepare: error: {line}", f"pytrt-kv build: error: {line}"]
        assert not dst.exists() and not plan.exists()
    else:
        prepare_for_tensorrt(model)


# --- TensorRT-RTX: accepted models build ------------------------------------------------------


def _rtx_sample():
    """Every accepted mutant (the bases themselves are test_rtx_build's)."""
    return [
        (mid, m, shapes)
        for mid, m, shapes in CORPUS
        if "/" in mid and not check_model(m, tensorrt=True)
    ]


@pytest.mark.skipif(bool(rtx_unavailable_reason()), reason=rtx_unavailable_reason() or "-")
@pytest.mark.parametrize("mid,model,shapes", _rtx_sample(), ids=[i for i, _, _ in _rtx_sample()])
def test_an_accepted_model_builds_with_tensorrt_rtx(mid, model, shapes, tmp_path, monkeypatch):
    monkeypatch.undo()  # the real TensorRT-RTX here
    fix_kernel_archs(monkeypatch)
    from pytrt_kv.trt import build_plan

    src = tmp_path / "m.onnx"
    onnx.save(model, src)
    profile = _dynamic_shapes(model, shapes)
    assert len(build_plan(src, flavour="rtx", targets=["sm89"], shapes=profile)) > 1000
