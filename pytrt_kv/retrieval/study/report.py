"""The study's report: a summary per (task, length, method), paired McNemar tests, the
Markdown tables, the machine-readable rows (``retrieval_study.json``), the plot, and
:func:`run_study`, which runs everything and writes the files."""

from __future__ import annotations

import datetime as _dt
import json
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from ..._lib import install_command
from ..config import LOWRANK, REPRESENTATIONS, RetrievalConfig
from .calibration import (
    CALIBRATION_MODULE,
    CALIBRATION_SKIP,
    CALIBRATION_TOKENS,
    calibrate_lowrank,
    calibration_ids,
)
from .methods import StudySettings
from .model import MODEL_NAME, load_model
from .statistics import mcnemar, wilson
from .tasks import LOAD_S, Clock, calibration_cost, estimate_seconds, run_loss, run_needles

#: Baselines every selector is tested against (paired, per trial).
BASELINES = ("window", "random", "random_fixed")
#: Significance level of the paired tests.
ALPHA = 0.01


def _f(x, fmt: str) -> str:
    return "–" if x is None else format(x, fmt)


def summarize(needles: list[dict]) -> list[dict]:
    """One row per (task, length, method label): values found / asked with a Wilson
    interval, the attended share (budget), and the ratio to the oracle of the same
    setting on the same trials."""
    out = []
    groups: dict[tuple, list[dict]] = {}
    for r in needles:
        groups.setdefault((r["task"], r["length"], r["method"]), []).append(r)
    for (task, length, label), rs in groups.items():
        h, n = sum(r["found"] for r in rs), sum(r["values"] for r in rs)
        r0 = rs[0]
        orc = groups.get((task, length, f"oracle {r0['setting']}")) if r0["setting"] else None
        oh = sum(r["found"] for r in orc) if orc else None
        out.append(
            {
                "task": task,
                "length": length,
                "method": label,
                "name": r0["name"],
                "setting": r0["setting"],
                "recall": r0["percent"],
                "block": r0["block_size"],
                "budget": float(np.mean([r["budget"] for r in rs])),
                "found": h,
                "asked": n,
                "accuracy": h / n if n else 0.0,
                "ci": list(wilson(h, n)),
                "oracle_found": oh,
                "of_oracle": (h / oh) if oh else None,
            }
        )
    return out


def outcomes(needles: list[dict], task: str, length: int, label: str) -> dict[int, int]:
    """trial -> 1 if every value was found (paired tests compare these)."""
    return {
        r["trial"]: int(r["found"] == r["values"])
        for r in needles
        if r["task"] == task and r["length"] == length and r["method"] == label
    }


def paired(needles: list[dict], task: str, length: int, a: str, b: str):
    """McNemar ``(a only, b only, p)`` of two method labels on their common trials."""
    x, y = outcomes(needles, task, length, a), outcomes(needles, task, length, b)
    common = sorted(set(x) & set(y))
    if not common:
        return None
    return mcnemar([x[t] for t in common], [y[t] for t in common])


def best_representation(summary: list[dict], settings: StudySettings) -> str | None:
    """The representation (docs/SPEC.md R5 name) that found the most single needles at
    the longest length in the tightest setting (lowest budget); ties to the R5 order."""
    longest = max(settings.lengths)
    rows = [
        r for r in summary
        if r["task"] == "single" and r["length"] == longest and r["name"] in REPRESENTATIONS
    ]  # fmt: skip
    if not rows:
        return None
    tight = min(rows, key=lambda r: r["budget"])["setting"]
    rows = [r for r in rows if r["setting"] == tight]
    return max(rows, key=lambda r: (r["found"], -REPRESENTATIONS.index(r["name"])))["name"]


def json_rows(summary: list[dict], settings: StudySettings) -> dict:
    """``{"default": NAME, "rows": [...]}`` (docs/RETRIEVAL.md, machine-readable)."""
    keys = ("task", "length", "method", "recall", "block", "budget", "found", "asked")
    rows = []
    for r in summary:
        row = {k: r[k] for k in keys}
        row["method"] = r["name"]
        row["setting"] = r["setting"]
        rows.append(row)
    return {"default": best_representation(summary, settings), "rows": rows}


def _header(settings: StudySettings, seconds: float) -> list[str]:
    sets = "; ".join(
        f"recall {p:g}, blocks of {b}, init {i}, local {lo}" for p, b, i, lo in settings.settings
    )
    trials = ", ".join(f"{settings.trials_at(n)} at {n}" for n in settings.lengths)
    return [
        f"Model: {MODEL_NAME}. Date: {_dt.date.today().isoformat()}. CPU, float32, "
        f"{seconds / 60:.0f} min. Text: Python's pydoc_data.topics, topics in seeded "
        f"random order (seed {settings.seed}). Settings (every trial): {sets}. Single "
        f"needle: {trials} tokens, depths (i + 0.5)/n of the retrievable span; "
        f"multi-key ({settings.num_keys} keys) and multi-value ({settings.num_values} "
        f"values): {settings.multi_trials} trials at "
        f"{', '.join(map(str, settings.multi_lengths))} tokens. Intervals: 95% Wilson; "
        f"paired tests: exact McNemar against the baselines, significant at p < {ALPHA}."
        + (
            f" lowrank: rank {RetrievalConfig().rank}, its basis calibrated once on the first "
            f"{CALIBRATION_TOKENS} tokens of the {CALIBRATION_MODULE} module's source (the "
            f"first {CALIBRATION_SKIP} left out)."
            if LOWRANK in settings.methods
            else ""
        ),
        "",
    ]


def _main_table(settings: StudySettings, needles: list[dict], summary: list[dict]) -> list[str]:
    lines = []
    main = {m.label for m in settings.main_methods()}
    for task in dict.fromkeys(r["task"] for r in summary):
        for length in dict.fromkeys(r["length"] for r in summary if r["task"] == task):
            rows = [
                r for r in summary
                if r["task"] == task and r["length"] == length and r["method"] in main
            ]  # fmt: skip
            lines += [
                f"**{task}, {length} tokens** (budget = attended share at the question; "
                "of oracle = found / oracle's found, same setting; vs baselines: "
                "a only / b only, McNemar p):",
                "",
                "| method | budget | found | accuracy [95% CI] | of oracle "
                + "".join(f"| vs {b} " for b in BASELINES)
                + "|",
                "|---|---|---|---|---|" + "---|" * len(BASELINES),
            ]
            for r in rows:
                tests = []
                for b in BASELINES:
                    t = (
                        paired(needles, task, length, r["method"], f"{b} {r['setting']}")
                        if r["setting"] and r["name"] not in BASELINES
                        else None
                    )
                    tests.append(
                        "–" if t is None else f"{t[0]}/{t[1]} p={t[2]:.2g}" + ("*" * (t[2] < ALPHA))
                    )
                lines.append(
                    f"| {r['method']} | {r['budget']:.1%} | {r['found']}/{r['asked']} | "
                    f"{r['accuracy']:.2f} [{r['ci'][0]:.2f}, {r['ci'][1]:.2f}] | "
                    f"{_f(r['of_oracle'], '.2f')} | " + " | ".join(tests) + " |"
                )
            lines.append("")
    return lines


def _pairs_table(settings: StudySettings, needles: list[dict], summary: list[dict]) -> list[str]:
    """Selector against selector at each setting of the longest length."""
    longest = max(settings.lengths)
    lines = [
        f"Selector pairs, single needle at {longest} tokens (row only / column only, "
        "McNemar p; * p < 0.01):",
        "",
    ]
    names = [n for n in settings.methods if n not in ("dense", *BASELINES)]
    for s in dict.fromkeys(
        r["setting"] for r in summary if r["setting"] and r["length"] == longest
    ):
        lines += [f"Setting {s}:", "", "| | " + " | ".join(names) + " |"]
        lines.append("|---|" + "---|" * len(names))
        for a in names:
            cells = []
            for b in names:
                t = None if a == b else paired(needles, "single", longest, f"{a} {s}", f"{b} {s}")
                cells.append(
                    "–" if t is None else f"{t[0]}/{t[1]} {t[2]:.2g}" + ("*" * (t[2] < ALPHA))
                )
            lines.append(f"| {a} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def _depth_table(settings: StudySettings, needles: list[dict]) -> list[str]:
    """Single needles found per fifth of the retrievable span (first setting)."""
    main = [m.label for m in settings.main_methods() if m.setting in ("", _first(settings))]
    lines = [
        "Single needle by depth (fifths of the retrievable span, first setting; found / trials):",
        "",
    ]
    for length in settings.lengths:
        rs = [r for r in needles if r["task"] == "single" and r["length"] == length]
        if not rs:
            continue
        lines += [
            f"| {length} tokens | "
            + " | ".join(f"d{k / 5:.1f}-{(k + 1) / 5:.1f}" for k in range(5))
            + " |"
        ]
        lines.append("|---|" + "---|" * 5)
        for label in main:
            cells = []
            for k in range(5):
                band = [r for r in rs if r["method"] == label and k <= r["depth"] * 5 < k + 1]
                cells.append(f"{sum(r['found'] for r in band)}/{len(band)}")
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def _first(settings: StudySettings) -> str:
    from .methods import Method

    return Method("mean", *settings.main).setting


def _curve_table(settings: StudySettings, needles: list[dict]) -> list[str]:
    curve = {m.label for m in settings.curve_methods()}
    main = {m.label for m in settings.main_methods()}
    rows = [r for r in needles if r["task"] == "single" and r["method"] in curve]
    trials = {r["trial"] for r in rows if r["method"] in curve - main}
    rs = summarize([r for r in rows if r["trial"] in trials])
    if not trials:
        return []
    lines = [
        f"Curve settings (single needle, the {len(trials)} trials that ran them all):",
        "",
        "| length | method | budget | found | of oracle |",
        "|---|---|---|---|---|",
    ]
    for r in rs:
        lines.append(
            f"| {r['length']} | {r['method']} | {r['budget']:.1%} | {r['found']}/{r['asked']} "
            f"| {_f(r['of_oracle'], '.2f')} |"
        )
    return lines + [""]


def _loss_table(loss: list[dict], settings: StudySettings) -> list[str]:
    if not loss:
        return []
    lines = [
        f"Next-token loss over the last {loss[0]['tokens']} tokens of a "
        f"{settings.loss_context}-token text (budget at the middle of the scored span):",
        "",
        "| method | budget | loss (nats) | Δ vs dense [95% CI] | top-1 agreement |",
        "|---|---|---|---|---|",
    ]
    for r in loss:
        lines.append(
            f"| {r['method']} | {r['budget']:.1%} | {r['loss']:.4f} | {r['delta']:+.4f} "
            f"[{r['delta_ci'][0]:+.4f}, {r['delta_ci'][1]:+.4f}] | {r['top1_agree']:.3f} |"
        )
    return lines + [""]


def markdown(settings: StudySettings, needles: list[dict], loss: list[dict], seconds: float) -> str:
    summary = summarize(needles)
    lines = _header(settings, seconds)
    lines += _main_table(settings, needles, summary)
    lines += _pairs_table(settings, needles, summary)
    lines += _depth_table(settings, needles)
    lines += _curve_table(settings, needles)
    lines += _loss_table(loss, settings)
    best = best_representation(summary, settings)
    lines.append(f"Best representation at the tightest setting of the longest length: {best}.")
    return "\n".join(lines) + "\n"


def plot(settings: StudySettings, needles: list[dict], path: Path) -> None:
    """Single-needle accuracy per length at each main setting, one bar group per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = [r for r in summarize(needles) if r["task"] == "single"]
    sets = list(dict.fromkeys(m.setting for m in settings.main_methods() if m.setting))
    fig, axes = plt.subplots(1, max(1, len(sets)), figsize=(6 * max(1, len(sets)), 4.5))
    axes = np.atleast_1d(axes)
    names = [n for n in settings.methods if n != "dense"]
    for ax, s in zip(axes, sets):
        for i, length in enumerate(settings.lengths):
            ys = []
            for n in names:
                r = next(
                    (x for x in summary if x["length"] == length and x["method"] == f"{n} {s}"),
                    None,
                )
                ys.append(r["accuracy"] if r else 0.0)
            w = 0.8 / len(settings.lengths)
            ax.bar(np.arange(len(names)) + i * w, ys, width=w, label=f"{length} tokens")
        ax.set_xticks(np.arange(len(names)) + 0.4 - 0.4 / len(settings.lengths), names, rotation=45)
        ax.set_ylabel("single-needle accuracy")
        ax.set_title(s)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(f"RetrievalKV on {MODEL_NAME}: equal budgets per setting")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_study(
    settings: StudySettings, out_dir: Path, model_path: str | None = None, progress=None
) -> dict:
    """Needles (and loss, if asked); writes ``study.md``, ``study.json`` (everything),
    ``retrieval_study.json`` (the rows) and ``study.png`` to ``out_dir``; ``progress``
    gets one line per trial (trial i of n, elapsed, ETA)."""
    t0 = time.time()
    model, tok = load_model(model_path)
    import torch

    torch.manual_seed(settings.seed)
    total = estimate_seconds(settings)
    if progress:
        progress(
            f"model loaded in {time.time() - t0:.0f}s; the study takes about "
            f"{total / 60:.0f} min on 2 idle CPU cores"
        )
    clock = Clock(progress, total, t0, done=LOAD_S)  # the model is loaded
    if LOWRANK in settings.methods:  # the "lowrank" basis: a constant of the model
        ids = calibration_ids(tok)
        calibrate_lowrank(model, ids, max(m.config().rank for m in settings.main_methods()))
        clock.step(calibration_cost(settings), f"lowrank basis calibrated on {len(ids)} tokens")
    needles = run_needles(model, tok, settings, progress, clock)
    loss = run_loss(model, tok, settings, progress, clock) if settings.loss_context else []
    seconds = time.time() - t0
    out_dir.mkdir(parents=True, exist_ok=True)
    md = markdown(settings, needles, loss, seconds)
    (out_dir / "study.md").write_text(md)
    summary = summarize(needles)
    rows = json_rows(summary, settings)
    (out_dir / "retrieval_study.json").write_text(json.dumps(rows, indent=1) + "\n")
    result = {
        "model": MODEL_NAME,
        "date": _dt.date.today().isoformat(),
        "settings": {
            k: list(v) if isinstance(v, tuple) else v for k, v in asdict(settings).items()
        },
        "needles": needles,
        "loss": loss,
        "summary": summary,
        "default": rows["default"],
        "seconds": seconds,
        "markdown": md,
    }
    (out_dir / "study.json").write_text(json.dumps(result, indent=1))
    try:
        plot(settings, needles, out_dir / "study.png")
    except ImportError:
        if progress:
            progress(f"matplotlib is not installed: no plot ({install_command('study')})")
    return result
