"""Old import path of :mod:`pytrt_kv.contract.specs` (the contract layer, docs/ARCHITECTURE.md).

``pytrt_kv.specs`` IS that module (same object in sys.modules), so old imports,
attribute reads and monkeypatching keep working. New code imports ``pytrt_kv.contract.specs``.
"""

import sys

from .contract import specs as _module

sys.modules[__name__] = _module
