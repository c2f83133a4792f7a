"""``--pytrt-kv-ref``: the argument group Polygraphy adds through the entry point."""

from __future__ import annotations

from polygraphy.logger import G_LOGGER
from polygraphy.tools.args.backend.onnx import OnnxLoadArgs
from polygraphy.tools.args.base import BaseRunnerArgs
from polygraphy.tools.script import make_invocable

#: The loader script users pass with --data-loader-script (shown in the error below).
_LOADER_HINT = (
    '--data-loader-script $(python3 -c "import pytrt_kv.polygraphy.data_loader '
    'as m; print(m.__file__)")'
)


def index_inputs_fed_by_graph(model_path: str) -> list:
    """``"<graph input> -> <op input> of <node>"`` for every index input of a pytrt_kv
    node that a graph input feeds directly (the values the default loader gets wrong);
    [] when the model cannot be read here (Polygraphy then reports that itself)."""
    import onnx

    from .data_loader import INDEX_PORTS, _our_nodes

    try:
        model = onnx.load(model_path, load_external_data=False)
    except Exception:  # noqa: BLE001 - Polygraphy's own loader reports a broken model
        return []
    graph_inputs = {i.name for i in model.graph.input} - {i.name for i in model.graph.initializer}
    found = []
    for node, op, ports in _our_nodes(model):
        for port in INDEX_PORTS[op.name]:
            if ports.get(port) in graph_inputs:
                found.append(f"{ports[port]} -> {port} of {node.name or op.name}")
    return found


class PytrtKvRefRunnerArgs(BaseRunnerArgs):
    """pytrt_kv CPU reference: run ONNX models with pytrt_kv ops on the NumPy reference.

    Depends on:

        - OnnxLoadArgs
        - ModelArgs
        - DataLoaderArgs
    """

    def get_name_opt_impl(self):
        return "pytrt_kv CPU reference", "pytrt-kv-ref"

    def get_extra_help_text_impl(self):
        return (
            "Standard ops run on onnx.reference; ScatterPaKvCache and "
            "GatherSelectionKvCache on the NumPy reference. Feed valid index inputs with "
            "--data-loader-script <pytrt_kv/polygraphy/data_loader.py> (required when "
            "graph inputs feed index inputs of those ops)."
        )

    def _check_data_loader(self):
        # Polygraphy's default loader fills index inputs with small random integers: every
        # kv_len <= 0 or duplicate slots, so a comparison would pass while checking
        # nothing (every row skipped) or fail on invalid data. Refuse such a run.
        from polygraphy.tools.args import DataLoaderArgs, ModelArgs

        groups = dict(self.arg_groups.items())  # Polygraphy's TypedDict has no .get
        loader = groups.get(DataLoaderArgs)
        model = groups.get(ModelArgs)
        if loader is None or model is None or not getattr(model, "path", None):
            return
        if getattr(loader, "data_loader_script", None) or getattr(
            loader, "load_inputs_paths", None
        ):
            return
        fed = index_inputs_fed_by_graph(model.path)
        if fed:
            G_LOGGER.critical(
                f"--pytrt-kv-ref: the model's index inputs ({'; '.join(fed)}) need valid "
                f"values, which Polygraphy's default data loader does not make (a run would "
                f"skip every row and check nothing). Pass {_LOADER_HINT}, or --load-inputs "
                f"with data of your own."
            )

    def add_to_script_impl(self, script):
        self._check_data_loader()
        script.add_import(imports=["PytrtKvRefRunner"], frm="pytrt_kv.polygraphy")
        onnx_name = self.arg_groups[OnnxLoadArgs].add_to_script(script)
        script.add_runner(make_invocable("PytrtKvRefRunner", onnx_name))
