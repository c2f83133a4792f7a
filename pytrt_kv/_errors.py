"""Old import path of :mod:`pytrt_kv.contract.errors` (the contract layer,
docs/ARCHITECTURE.md).

``pytrt_kv._errors`` IS that module (same object in sys.modules), so old imports, attribute
reads and monkeypatching keep working. New code imports ``pytrt_kv.contract.errors``.
"""

import sys
from typing import TYPE_CHECKING

from .contract import errors as _module

if TYPE_CHECKING:  # what type checkers see; at run time the module object below
    from .contract.errors import *  # noqa: F403


sys.modules[__name__] = _module
