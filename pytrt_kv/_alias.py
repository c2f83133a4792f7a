"""Old import path of :mod:`pytrt_kv.contract.alias` (the contract layer, docs/ARCHITECTURE.md).

``pytrt_kv._alias`` IS that module (same object in sys.modules), so old imports,
attribute reads and monkeypatching keep working. New code imports ``pytrt_kv.contract.alias``.
"""

import sys

from .contract import alias as _module

sys.modules[__name__] = _module
