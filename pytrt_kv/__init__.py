"""pytrt_kv: paged-KV-cache operators for TensorRT engines.

``ScatterPaKvCache`` writes new key/value tokens into a paged KV cache;
``GatherSelectionKvCache`` gathers top-k selected tokens/blocks of a (possibly
host-resident) full cache into a compact selection cache. The operator contract is
docs/SPEC.md.

Importing this package needs only NumPy and ml_dtypes: TensorRT, torch, CUDA and a GPU
are loaded lazily by the submodules that use them (``pytrt_kv.ops``, ``pytrt_kv.trt``).
"""

from .contract import specs
from .contract.limits import VERSION as __version__  # the one source of the version
from .reference import gather_selection_kv_cache, scatter_pa_kv_cache

__all__ = ["specs", "scatter_pa_kv_cache", "gather_selection_kv_cache", "__version__"]
