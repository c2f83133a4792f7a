"""Export models that use the pytrt_kv custom ONNX ops (docs/SPEC.md section O).

Importing this package registers both op schemas with ``onnx.defs`` so that
``onnx.checker`` and shape inference accept models using them.

- :func:`single_op_model`: a one-node model with the docs/SPEC.md tensor names;
- :mod:`onnx_export.graphsurgeon`: append our nodes to an onnx-graphsurgeon graph;
- :mod:`onnx_export.torch_export`: functions for ``nn.Module.forward`` that
  ``torch.onnx.export(..., dynamo=True)`` turns into our nodes (torch optional);
- :mod:`onnx_export.example`: the sparse-attention decode example
  (``pytrt-kv export-example``).
"""

from pytrt_kv.graph import schemas

from .graphsurgeon import (
    add_gather_selection_kv_cache,
    add_node,
    add_scatter_pa_kv_cache,
    export_model,
)
from .models import finalize_model, single_op_model

__all__ = [
    "schemas",
    "single_op_model",
    "finalize_model",
    "add_node",
    "add_scatter_pa_kv_cache",
    "add_gather_selection_kv_cache",
    "export_model",
]
