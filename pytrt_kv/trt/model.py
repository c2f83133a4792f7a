"""Old import path of :mod:`pytrt_kv.graph.tensorrt` (the graph layer, docs/ARCHITECTURE.md).

``pytrt_kv.trt.model`` IS that module (same object in ``sys.modules``), so old imports, attribute
reads and monkeypatching keep working. New code imports ``pytrt_kv.graph.tensorrt``.
"""

import sys

from ..graph import tensorrt as _module

sys.modules[__name__] = _module
