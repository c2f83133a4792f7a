"""Rule names carried by the model checks' errors (docs/GRAPH_MODE.md, "Model checks").

A check raises its ValueError or TypeError through :func:`ruled`, which attaches the name
of the rule it enforces; :func:`pytrt_kv.graph.lint.check_model` reads it back with
:func:`rule_of`, never from the message text. No imports: every graph module uses it.
"""

from __future__ import annotations

from typing import TypeVar

E = TypeVar("E", bound=BaseException)


def ruled(rule: str, exc: E) -> E:
    """``exc`` carrying the name of the model-check rule it breaks (``exc.rule``)."""
    exc.rule = rule  # type: ignore[attr-defined]
    return exc


def rule_of(exc: BaseException, default: str) -> str:
    """The rule ``exc`` carries (:func:`ruled`), else ``default``."""
    rule = getattr(exc, "rule", None)
    return rule if isinstance(rule, str) else default
