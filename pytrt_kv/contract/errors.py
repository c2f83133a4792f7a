"""Uniform error messages: every refusal names the argument, what was expected and what
came (house style, docs/ARCHITECTURE.md habit 3)."""

from __future__ import annotations

from typing import Any


def describe(x: Any) -> str:
    """Short description of an argument: ``float16[4, 16, 8]``, ``None`` or its type."""
    if x is None:
        return "None"
    shape = getattr(x, "shape", None)
    dtype = getattr(x, "dtype", None)
    if shape is not None and dtype is not None:
        try:
            from .dtypes import name_of

            dt = name_of(dtype)
        except TypeError:
            dt = str(dtype)
        return f"{dt}[{', '.join(str(int(d)) for d in shape)}]"
    return type(x).__name__


def value_error(arg: str, expected: str, got: Any) -> ValueError:
    """``ValueError("key_cache: expected ..., got ...")``."""
    return ValueError(f"{arg}: expected {expected}, got {got}")


def type_error(arg: str, expected: str, got: Any) -> TypeError:
    return TypeError(f"{arg}: expected {expected}, got {got}")
