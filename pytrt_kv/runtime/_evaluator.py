"""Old import path of :mod:`pytrt_kv.graph.runtime` (the graph layer, docs/ARCHITECTURE.md).

``pytrt_kv.runtime._evaluator`` IS that module (same object in ``sys.modules``), so old imports, attribute
reads and monkeypatching keep working. New code imports ``pytrt_kv.graph.runtime``.
"""

import sys

from ..graph import runtime as _module

sys.modules[__name__] = _module
