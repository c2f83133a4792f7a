"""Helpers shared by the tests (the one place for them: tests never import each other).

- :mod:`support.env`: the repository path, why GPU / TensorRT / TensorRT-RTX tests skip
  here, child Python processes (``run_python``), fixed kernel architectures and a guard
  that fails a test reaching TensorRT;
- :mod:`support.arrays`: random non-zero data, sentinels, bit-exact comparison, torch
  copies, the cache shape of each layout;
- :mod:`support.device`: device buffers for the ``gpu`` tests and the ``gpu`` /
  ``real_gpu`` markers;
- :mod:`support.op_names`: the ops' input names as docs/SPEC.md spells them (the pins);
- :mod:`support.gather_cases`: valid GatherSelectionKvCache calls and input skeletons;
- :mod:`support.models`: the single-op models the TensorRT engine tests build (shapes from
  the C++ harness's case maker), shared feeds and a small RetrievalKV configuration;
- :mod:`support.datadist`: the datadist tests' backends (local, NIXL where it runs);
- ``support/datadist_node.py``: a datadist node process driven by the multi-process tests.
"""
