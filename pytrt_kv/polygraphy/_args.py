"""``--pytrt-kv-ref``: the argument group Polygraphy adds through the entry point."""

from __future__ import annotations

from polygraphy.tools.args.backend.onnx import OnnxLoadArgs
from polygraphy.tools.args.base import BaseRunnerArgs
from polygraphy.tools.script import make_invocable


class PytrtKvRefRunnerArgs(BaseRunnerArgs):
    """pytrt_kv CPU reference: run ONNX models with pytrt_kv ops on the NumPy reference.

    Depends on:

        - OnnxLoadArgs
    """

    def get_name_opt_impl(self):
        return "pytrt_kv CPU reference", "pytrt-kv-ref"

    def get_extra_help_text_impl(self):
        return ("Standard ops run on onnx.reference; ScatterPaKvCache and "
                "GatherSelectionKvCache on the NumPy reference. Feed valid index inputs with "
                "--data-loader-script <pytrt_kv/polygraphy/data_loader.py>.")

    def add_to_script_impl(self, script):
        script.add_import(imports=["PytrtKvRefRunner"], frm="pytrt_kv.polygraphy")
        onnx_name = self.arg_groups[OnnxLoadArgs].add_to_script(script)
        script.add_runner(make_invocable("PytrtKvRefRunner", onnx_name))
