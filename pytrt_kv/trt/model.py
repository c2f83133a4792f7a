"""Old import path of :mod:`pytrt_kv.graph.tensorrt` (the graph layer, docs/ARCHITECTURE.md).

``pytrt_kv.trt.model`` IS that module (same object in ``sys.modules``), so old imports,
attribute reads and monkeypatching keep working. New code imports
``pytrt_kv.graph.tensorrt``.
"""

import sys
from typing import TYPE_CHECKING

from ..graph import tensorrt as _module

if TYPE_CHECKING:  # what type checkers see; at run time the module object below
    from ..graph.tensorrt import *  # noqa: F403


sys.modules[__name__] = _module
