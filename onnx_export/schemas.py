"""Old import path of :mod:`pytrt_kv.graph.schemas` (the graph layer, docs/ARCHITECTURE.md).

``onnx_export.schemas`` IS that module (same object in ``sys.modules``), so old imports,
attribute reads and monkeypatching keep working. New code imports
``pytrt_kv.graph.schemas``.
"""

import sys
from typing import TYPE_CHECKING

from pytrt_kv.graph import schemas as _module

if TYPE_CHECKING:  # what type checkers see; at run time the module object below
    from pytrt_kv.graph.schemas import *  # noqa: F403


sys.modules[__name__] = _module
