"""Old import path of :mod:`pytrt_kv.graph.check` (the graph layer, docs/ARCHITECTURE.md).

``onnx_export._check`` IS that module (same object in ``sys.modules``), so old imports,
attribute reads and monkeypatching keep working. New code imports ``pytrt_kv.graph.check``.
"""

import sys
from typing import TYPE_CHECKING

from pytrt_kv.graph import check as _module

if TYPE_CHECKING:  # what type checkers see; at run time the module object below
    from pytrt_kv.graph.check import *  # noqa: F403


sys.modules[__name__] = _module
