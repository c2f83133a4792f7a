"""Helpers shared by the tests (the one place for them: tests never import each other).

- :mod:`support.env`: the repository path and why GPU / TensorRT tests skip here;
- :mod:`support.arrays`: random non-zero data, sentinels, bit-exact comparison, torch copies;
- :mod:`support.gather_cases`: valid GatherSelectionKvCache calls and input skeletons;
- :mod:`support.models`: the single-op models the TensorRT engine tests build;
- ``support/datadist_node.py``: a datadist node process driven by the multi-process tests.
"""
