"""Every option of every ``pytrt-kv`` subcommand says what it does in ``--help``."""

from __future__ import annotations

import argparse

import pytest

from pytrt_kv.cli import SUBCOMMANDS, build_parser


def _subparsers(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices
    raise AssertionError("pytrt-kv has no subcommands")


@pytest.mark.parametrize("command", [name for name, _, _ in SUBCOMMANDS])
def test_every_option_has_help(command):
    sub = _subparsers(build_parser())[command]
    missing = [
        action.option_strings[0] if action.option_strings else action.dest
        for action in sub._actions
        if not isinstance(action, argparse._HelpAction)
        and (not action.help or action.help == argparse.SUPPRESS)
    ]
    assert not missing, f"pytrt-kv {command}: options without help text: {missing}"


def test_bench_help_lists_defaults(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for fragment in (
        "which kernels to time",
        "untimed calls before each timed run",
        "CUDA device index",
        "raw results as JSON",
    ):
        assert fragment in text
