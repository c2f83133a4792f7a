"""Old import path of :mod:`pytrt_kv.contract.dtypes` (the contract layer,
docs/ARCHITECTURE.md).

``pytrt_kv.dtypes`` IS that module (same object in sys.modules), so old imports, attribute
reads and monkeypatching keep working. New code imports ``pytrt_kv.contract.dtypes``.
"""

import sys
from typing import TYPE_CHECKING

from .contract import dtypes as _module

if TYPE_CHECKING:  # what type checkers see; at run time the module object below
    from .contract.dtypes import *  # noqa: F403


sys.modules[__name__] = _module
