"""``python -m pytrt_kv.trt``: the TensorRT-side subcommands of ``pytrt-kv``, kept for
scripts that call it this way.

  prepare IN.onnx OUT.onnx   = pytrt-kv prepare
  build MODEL.onnx [...]     = pytrt-kv build
  availability               print why TensorRT cannot run engines here ('' = usable)
"""

from __future__ import annotations

import sys


def main(argv=None) -> int:
    from .. import __main__ as cli

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["availability"]:
        from . import availability

        reason = availability()
        print(reason or "TensorRT usable")
        return 0 if not reason else 1
    if not argv or argv[0] not in ("prepare", "build"):
        print(__doc__, file=sys.stderr)
        return 2
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
