"""``python -m pytrt_kv``: the ``pytrt-kv`` command (:mod:`pytrt_kv.cli`)."""

import sys

from pytrt_kv.cli import main

if __name__ == "__main__":
    sys.exit(main())
