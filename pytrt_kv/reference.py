"""NumPy reference of both operators (layer 1): obviously correct, strictly validated.

Exactly docs/SPEC.md. Every argument is validated before the first write; a broken
rule raises ValueError (TypeError for a wrong type) naming the argument, what was expected
and what came, and leaves every argument untouched. An argument that shares memory with
a cache the op writes is refused the same way, naming both.

Thread safety: the functions take no lock; calls that update the same caches must be
serialized by the caller.
"""

from ._gather import gather_selection_kv_cache
from ._scatter import scatter_pa_kv_cache

__all__ = ["scatter_pa_kv_cache", "gather_selection_kv_cache"]
