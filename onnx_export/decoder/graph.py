"""The graph builder of the decoder exporters: unique names, constants, and one method
per piece of math (RMSNorm, linear, RoPE, activations) in the activation dtype, with
float32 where transformers computes in float32 (norms, softmax, RoPE tables)."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

#: --dtype names -> (numpy dtype, ONNX element type).
DTYPES: dict[str, tuple[Any, int]] = {
    "float32": (np.dtype(np.float32), TensorProto.FLOAT),
    "float16": (np.dtype(np.float16), TensorProto.FLOAT16),
}


def _bf16() -> Any:
    import ml_dtypes  # noqa: PLC0415

    return np.dtype(ml_dtypes.bfloat16)


def dtype_of(name: str) -> tuple[Any, int]:
    """``(numpy dtype, ONNX type)`` of ``name``, or ValueError naming the choices."""
    if name == "bfloat16":
        return _bf16(), TensorProto.BFLOAT16
    if name not in DTYPES:
        raise ValueError(f"dtype: expected 'float32', 'float16' or 'bfloat16', got {name!r}")
    return DTYPES[name]


#: Weights of at least this many bytes go to a ``held`` dict when one is given.
HELD_BYTES = 1 << 16
#: The ``location`` of a weight kept outside the graph, in a ``held`` dict.
IN_RUNNER = "<held by DecoderRunner.weights>"


def placeholder(name: str, value: np.ndarray) -> onnx.TensorProto:
    """A weight's declaration (name, dims, type) whose bytes are held elsewhere."""
    t = onnx.TensorProto()
    t.name = name
    t.dims.extend(value.shape)
    t.data_type = helper.np_dtype_to_tensor_dtype(value.dtype)
    t.data_location = TensorProto.EXTERNAL
    t.external_data.add(key="location", value=IN_RUNNER)
    return t


def is_held(t: onnx.TensorProto) -> bool:
    return t.data_location == TensorProto.EXTERNAL and any(
        e.key == "location" and e.value == IN_RUNNER for e in t.external_data
    )


class Graph:
    """Nodes and initializers of one graph; ``dt``/``onnx_dt``: the activation type.
    ``held``: where large weights go instead of the graph (see :func:`placeholder`)."""

    def __init__(self, dtype: str = "float32", held: dict[str, np.ndarray] | None = None):
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.dt, self.onnx_dt = dtype_of(dtype)
        self.held = held
        self._n = 0

    def name(self, base: str) -> str:
        self._n += 1
        return f"{base}_{self._n}"

    def const(self, value: Any, dtype: Any = np.int64, base: str = "c") -> str:
        n = self.name(base)
        self.inits.append(numpy_helper.from_array(np.asarray(value, dtype), n))
        return n

    def fconst(self, value: float) -> str:
        """A scalar in the activation dtype."""
        return self.const(np.asarray(value, np.float32).astype(self.dt), self.dt)

    def weight(self, name: str, value: np.ndarray) -> str:
        if self.held is not None and value.nbytes >= HELD_BYTES:
            self.held.setdefault(name, np.ascontiguousarray(value))
            self.inits.append(placeholder(name, value))
        else:
            self.inits.append(numpy_helper.from_array(np.ascontiguousarray(value), name))
        return name

    def op(self, op_type: str, inputs: list[str], n_out: int = 1, domain: str = "", **attrs):
        outs = [self.name(op_type.lower()) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, domain=domain, **attrs))
        return outs[0] if n_out == 1 else outs

    def to_float(self, x: str) -> str:
        return (
            x if self.onnx_dt == TensorProto.FLOAT else self.op("Cast", [x], to=TensorProto.FLOAT)
        )

    def to_act(self, x: str) -> str:
        return x if self.onnx_dt == TensorProto.FLOAT else self.op("Cast", [x], to=self.onnx_dt)

    def rms_norm(self, x: str, w: str, eps: float, offset: float = 0.0) -> str:
        """transformers' RMSNorm: in float32, back to the activation dtype, times the
        weight (Llama); Gemma (``offset`` 1) multiplies by ``1 + w`` in float32 first."""
        xf = self.to_float(x)
        mean = self.op("ReduceMean", [self.op("Mul", [xf, xf])], axes=[-1], keepdims=1)
        inv = self.op(
            "Reciprocal", [self.op("Sqrt", [self.op("Add", [mean, self.const(eps, np.float32)])])]
        )
        normed = self.op("Mul", [xf, inv])
        if offset:
            scale = self.op("Add", [self.to_float(w), self.const(offset, np.float32)])
            return self.to_act(self.op("Mul", [normed, scale]))
        return self.op("Mul", [w, self.to_act(normed)])

    def linear(self, x: str, w_t: str, bias: str | None = None) -> str:
        y = self.op("MatMul", [x, w_t])
        return y if bias is None else self.op("Add", [y, bias])

    def rope(self, x: str, cos: str, sin: str, rot: int, d: int) -> str:
        """x ``[T, H, D]``: its first ``rot`` dims times cos ``[T, 1, rot]`` plus
        rotate_half times sin; dims ``rot..D`` pass through (partial rotary)."""
        half = rot // 2
        part = x
        if rot < d:
            part = self.op("Slice", [x, self.const([0]), self.const([rot]), self.const([2])])
        lo = self.op("Slice", [part, self.const([0]), self.const([half]), self.const([2])])
        hi = self.op("Slice", [part, self.const([half]), self.const([rot]), self.const([2])])
        rotated = self.op("Concat", [self.op("Neg", [hi]), lo], axis=-1)
        out = self.op("Add", [self.op("Mul", [part, cos]), self.op("Mul", [rotated, sin])])
        if rot < d:
            rest = self.op("Slice", [x, self.const([rot]), self.const([d]), self.const([2])])
            out = self.op("Concat", [out, rest], axis=-1)
        return out

    def act(self, x: str, kind: str) -> str:
        """The MLP activation (``spec.ACTIVATIONS`` formulas)."""
        if kind == "silu":
            return self.op("Mul", [x, self.op("Sigmoid", [x])])
        if kind == "relu":
            return self.op("Relu", [x])
        if kind == "quick_gelu":
            return self.op(
                "Mul", [x, self.op("Sigmoid", [self.op("Mul", [x, self.fconst(1.702)])])]
            )
        half_x = self.op("Mul", [x, self.fconst(0.5)])
        if kind == "gelu":  # 0.5 x (1 + erf(x / sqrt 2))
            inner = self.op("Erf", [self.op("Mul", [x, self.fconst(1 / np.sqrt(2.0))])])
        elif kind == "gelu_tanh":  # 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
            cube = self.op("Mul", [self.op("Mul", [x, x]), x])
            arg = self.op("Add", [x, self.op("Mul", [cube, self.fconst(0.044715)])])
            inner = self.op("Tanh", [self.op("Mul", [arg, self.fconst(np.sqrt(2 / np.pi))])])
        else:
            raise ValueError(
                f"act: expected one of silu, relu, quick_gelu, gelu, gelu_tanh, got {kind!r}"
            )
        return self.op("Mul", [half_x, self.op("Add", [inner, self.fconst(1.0)])])
