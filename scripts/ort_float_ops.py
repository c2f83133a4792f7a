"""Which standard ops give the CPU runtime's bytes on ONNX Runtime's own kernels: each op
as a one-node model on random inputs (float32, float16, float64), ONNX Runtime's output
against onnx's ReferenceEvaluator (the CPU runtime's base), byte for byte. What
``pytrt_kv.ort._float_math`` keeps on ONNX Runtime (EXACT, IEEE) comes from this table
(docs/GRAPH_MODE.md, "ONNX Runtime").

    python3 scripts/ort_float_ops.py            # one line per op and dtype: EQ or DIFF
"""

from __future__ import annotations

import warnings

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

RNG = np.random.default_rng(0)
SHAPE = (4, 33, 67)
TYPES = {np.float32: TensorProto.FLOAT, np.float16: TensorProto.FLOAT16, np.float64: 11}
UNARY = (
    "Exp Log Tanh Erf Sigmoid Sqrt Reciprocal Neg Abs Relu Sin Cos Tan Asin Acos Atan Sinh "
    "Cosh Asinh Acosh Atanh Softplus Softsign Elu Selu LeakyRelu HardSigmoid HardSwish Mish "
    "Gelu Floor Ceil Round Sign Identity ThresholdedRelu Celu"
).split()
REDUCE = (
    "ReduceSum ReduceMean ReduceMax ReduceMin ReduceProd ReduceL1 ReduceL2 ReduceLogSum "
    "ReduceLogSumExp ReduceSumSquare"
).split()


def compare(op, inputs, attrs=None, opset=21, out_types=None) -> str:
    """'EQ', 'DIFF n=<differing>/<size> max=<abs diff>' or why it did not run."""
    names = [f"x{i}" for i in range(len(inputs))]
    ins = [
        helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
        for n, a in zip(names, inputs)
    ]
    out_types = out_types or [helper.np_dtype_to_tensor_dtype(inputs[0].dtype)]
    outs = [f"y{i}" for i in range(len(out_types))]
    node = helper.make_node(op, names, outs, **(attrs or {}))
    infos = [helper.make_tensor_value_info(o, t, None) for o, t in zip(outs, out_types)]
    model = helper.make_model(
        helper.make_graph([node], "g", ins, infos),
        opset_imports=[helper.make_opsetid("", opset)],
    )
    model.ir_version = 10
    feeds = dict(zip(names, inputs))
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    try:
        session = ort.InferenceSession(model.SerializeToString(), options)
        got = session.run(None, feeds)
    except Exception as exc:  # noqa: BLE001 - reported as a row
        return f"not on ONNX Runtime ({str(exc)[:50]})"
    want = ReferenceEvaluator(model).run(None, feeds)
    rows = []
    for g, w in zip(got, want):
        w = np.asarray(w)
        if g.tobytes() == w.tobytes():
            rows.append("EQ")
            continue
        a, b = g.astype(np.float64), w.astype(np.float64)
        bad = ~((a == b) | (np.isnan(a) & np.isnan(b)))
        rows.append(f"DIFF n={int(bad.sum())}/{bad.size} max={np.abs(a - b)[bad].max():.3g}")
    return "; ".join(rows)


def _r(dtype, lo=-3.0, hi=3.0, shape=SHAPE):
    return RNG.uniform(lo, hi, shape).astype(dtype)


def _unary(dtype) -> None:
    for op in UNARY:
        x = _r(dtype)
        if op in ("Log", "Sqrt"):
            x = _r(dtype, 0.01, 5)
        elif op in ("Asin", "Acos", "Atanh"):
            x = _r(dtype, -0.99, 0.99)
        elif op == "Acosh":
            x = _r(dtype, 1.01, 5)
        print(dtype.__name__, op, compare(op, [x]))


def _binary_and_reductions(dtype) -> None:
    for op in ("Add", "Sub", "Mul", "Div", "Pow", "Max", "Min"):
        a = _r(dtype, 0.1, 3) if op == "Pow" else _r(dtype)
        b = _r(dtype, 0.5, 2) if op in ("Div", "Pow") else _r(dtype)
        print(dtype.__name__, op, compare(op, [a, b]))
    for op in REDUCE:
        for axes in ([-1], [1], [0, 2]):
            x = _r(dtype, 0.9, 1.1) if op == "ReduceProd" else _r(dtype, 0.1, 2)
            res = compare(op, [x, np.array(axes, np.int64)], {"keepdims": 1})
            print(dtype.__name__, op, axes, res)


def _products(dtype) -> None:
    print(dtype.__name__, "MatMul", compare("MatMul", [_r(dtype), _r(dtype, shape=(67, 50))]))
    a, b = _r(dtype, shape=(1, 576)), _r(dtype, shape=(576, 1536))
    print(dtype.__name__, "MatMul [1,576]x[576,1536]", compare("MatMul", [a, b]))
    a, b, c = _r(dtype, shape=(33, 67)), _r(dtype, shape=(67, 50)), _r(dtype, shape=(50,))
    print(dtype.__name__, "Gemm", compare("Gemm", [a, b, c]))
    for op in ("Softmax", "LogSoftmax"):
        print(dtype.__name__, op, compare(op, [_r(dtype)], {"axis": -1}))
    s, b = _r(dtype, shape=(67,)), _r(dtype, shape=(67,))
    print(dtype.__name__, "LayerNormalization", compare("LayerNormalization", [_r(dtype), s, b]))
    print(dtype.__name__, "CumSum", compare("CumSum", [_r(dtype), np.array(2, np.int64)]))
    print(dtype.__name__, "Sum of 3", compare("Sum", [_r(dtype), _r(dtype), _r(dtype)]))
    print(dtype.__name__, "Mean of 3", compare("Mean", [_r(dtype), _r(dtype), _r(dtype)]))
    clip = [_r(dtype), np.array(-1, dtype), np.array(1, dtype)]
    print(dtype.__name__, "Clip", compare("Clip", clip))


def _casts() -> None:
    x = RNG.standard_normal(SHAPE).astype(np.float32) * 100
    for src, to in ((np.float32, TensorProto.FLOAT16), (np.float16, TensorProto.FLOAT)):
        res = compare("Cast", [x.astype(src)], {"to": to}, out_types=[to])
        print("Cast", np.dtype(src).name, "->", TensorProto.DataType.Name(to), res)
    for to in (TensorProto.FLOAT, TensorProto.FLOAT16):
        res = compare("Cast", [x.astype(np.float64) * 1.000001], {"to": to}, out_types=[to])
        print("Cast float64 ->", TensorProto.DataType.Name(to), res)


def main() -> None:
    warnings.filterwarnings("ignore")
    print("onnxruntime", ort.__version__)
    for dtype in (np.float32, np.float16, np.float64):
        _unary(dtype)
        _binary_and_reductions(dtype)
        _products(dtype)
    _casts()


if __name__ == "__main__":
    main()
