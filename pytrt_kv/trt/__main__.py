"""``python -m pytrt_kv.trt``: small TensorRT-side tools.

  prepare IN.onnx OUT.onnx   rewrite pytrt_kv nodes into the plugins' positional form
                             (for polygraphy/trtexec, which parse the file themselves)
  availability               print why TensorRT cannot be used here ('' = usable)
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pytrt_kv.trt", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="rewrite pytrt_kv nodes into the plugin form")
    p.add_argument("src")
    p.add_argument("dst")
    sub.add_parser("availability", help="why TensorRT is not usable here")
    args = parser.parse_args(argv)
    if args.command == "prepare":
        import onnx

        from .model import prepare_for_tensorrt

        onnx.save(prepare_for_tensorrt(onnx.load(args.src)), args.dst)
        print(f"wrote {args.dst}")
        return 0
    from . import availability

    reason = availability()
    print(reason or "TensorRT usable")
    return 0 if not reason else 1


if __name__ == "__main__":
    sys.exit(main())
