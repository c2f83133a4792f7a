"""The operator contract of pytrt_kv (docs/SPEC.md) as code: op identity, dtypes, limits,
status codes, version and every argument check. Every other layer (reference, kernels'
ctypes layer, graph layer, TensorRT helpers, CLI) imports from here; this package imports
nothing else of pytrt_kv (docs/ARCHITECTURE.md)."""
