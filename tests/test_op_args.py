"""Each op's Python arguments are described once, by its OpSpec (pytrt_kv/contract/args.py):
every function that takes them lists them in the spec's order under the spec's names."""

from __future__ import annotations

import inspect

import pytest

from pytrt_kv import ops, reference
from pytrt_kv.contract import args, gather, scatter, specs
from support.op_names import SCATTER_INPUTS

SCATTER = specs.SCATTER_PA_KV_CACHE
GATHER = specs.GATHER_SELECTION_KV_CACHE

# (function, op); pytrt_kv.ops imports without a GPU.
FUNCTIONS = [
    (reference.scatter_pa_kv_cache, SCATTER),
    (ops.scatter_pa_kv_cache, SCATTER),
    (ops.prepare_scatter, SCATTER),
    (scatter.check_scatter, SCATTER),
    (scatter.validate_scatter, SCATTER),
    (reference.gather_selection_kv_cache, GATHER),
    (ops.gather_selection_kv_cache, GATHER),
    (ops.prepare_gather, GATHER),
    (gather.check_gather, GATHER),
    (gather.validate_gather, GATHER),
]


@pytest.mark.parametrize(
    "fn, op", FUNCTIONS, ids=[f"{f.__module__}.{f.__name__}" for f, _ in FUNCTIONS]
)
def test_signature_takes_the_spec_arguments(fn, op):
    sig = inspect.signature(fn).parameters
    names = args.arg_names(op)
    where = f"{fn.__module__}.{fn.__name__}"
    # Keyword-only arguments and attributes may come in any order; the positional inputs
    # are the op's first inputs in the op's order.
    positional = [
        n for n, p in sig.items() if p.kind is p.POSITIONAL_OR_KEYWORD and n in op.input_names
    ]
    assert tuple(positional) == op.input_names[: len(positional)], (
        f"{where}: expected its positional arguments to be the op's first inputs "
        f"{op.input_names}, got {positional}"
    )
    missing = set(names) - set(sig)
    assert not missing, f"{where}: expected every argument of the op spec, missing {missing}"
    extra = [n for n in sig if n not in names]
    assert set(extra) <= {"stream", "validate", "out", "read", "place"}, (
        f"{where}: expected no argument beyond the op spec's but the calling options, got {extra}"
    )


def test_arg_names_are_inputs_then_python_attributes():
    assert args.arg_names(SCATTER) == (*SCATTER_INPUTS, "cache_layout", "compress_mode")
    assert args.arg_names(GATHER)[-1] == "selection_topk_block_size"
    assert "alias_io" not in args.arg_names(GATHER)


def test_op_args_reads_a_scope_in_spec_order_and_names_a_missing_argument():
    scope = {name: i for i, name in enumerate(reversed(args.arg_names(SCATTER)))}
    scope["stream"] = object()
    got = args.op_args(SCATTER, scope)
    assert list(got) == list(args.arg_names(SCATTER))
    assert list(args.op_tensors(SCATTER, scope)) == list(SCATTER.input_names)
    del scope["seq_lens"]
    with pytest.raises(KeyError, match="seq_lens"):
        args.op_args(SCATTER, scope)


@pytest.mark.parametrize(
    "fn, op",
    [
        (reference.scatter_pa_kv_cache, SCATTER),
        (ops.scatter_pa_kv_cache, SCATTER),
        (reference.gather_selection_kv_cache, GATHER),
        (ops.gather_selection_kv_cache, GATHER),
    ],
    ids=["reference.scatter", "ops.scatter", "reference.gather", "ops.gather"],
)
def test_public_signatures_agree_with_the_generated_one(fn, op):
    """The explicit signatures of the public faces take each argument as the spec's
    generated signature does (same kind, same default), so a caller of validate_* or
    prepare_* may pass what it passes to them."""

    def kinds(sig):
        return {n: (p.kind, p.default) for n, p in sig.parameters.items() if n in names}

    names = args.arg_names(op)
    assert kinds(inspect.signature(fn)) == kinds(args.signature(op))


def test_op_call_binds_like_a_signature_and_names_the_function():
    got = scatter.validate_scatter.__wrapped__  # the undecorated body takes one dict
    assert list(inspect.signature(got).parameters) == ["call"]
    sig = inspect.signature(scatter.validate_scatter)
    assert list(sig.parameters)[-1] == "read" and sig.parameters["read"].default == "numpy"
    with pytest.raises(TypeError, match=r"validate_scatter\(\): .*unexpected.*'cache_layot'"):
        scatter.validate_scatter(None, None, None, None, None, cache_layot="nd")
    with pytest.raises(TypeError, match=r"prepare_gather\(\): missing .*'full_q_actual_seq'"):
        ops.prepare_gather(*range(9))
