"""The datadist tests' backends: ``BACKENDS`` parametrizes a test over the in-process
transport ("local") and NIXL, which skips saying why where NIXL cannot run here."""

from __future__ import annotations

import pytest

from pytrt_kv.datadist import nixl_unavailable_reason

NIXL_SKIP = nixl_unavailable_reason()
#: Marks a test that needs NIXL.
NIXL_ONLY = pytest.mark.skipif(NIXL_SKIP is not None, reason=str(NIXL_SKIP))
BACKENDS = ["local", pytest.param("nixl", marks=NIXL_ONLY)]
