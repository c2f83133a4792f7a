"""Exact or refused (docs/YOUR_MODEL.md "Families"): every field of each family's
transformers config class is either read by the exporter (implemented), refused with a
line naming it, or on the explicit list of fields that never change the math
(``spec.NON_MATH``); unsupported values are refused before export, by name, with
ValueError/NotImplementedError (never a bare KeyError)."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="transformers is not installed (the 'study' extra)",
)

CONFIG_CLASSES = {
    "llama": "LlamaConfig",
    "mistral": "MistralConfig",
    "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config",
    "gemma": "GemmaConfig",
    "phi3": "Phi3Config",
}


def _fields(cls) -> set[str]:
    names = set(cls().to_dict())
    if dataclasses.is_dataclass(cls):
        names |= {f.name for f in dataclasses.fields(cls)}
    return {n for n in names if not n.startswith("_") or n == "_name_or_path"}


def test_every_family_has_a_config_class():
    from onnx_export.decoder import FAMILIES

    assert sorted(f.name for f in FAMILIES) == sorted(CONFIG_CLASSES)


@pytest.mark.parametrize("family", sorted(CONFIG_CLASSES))
def test_every_config_field_is_implemented_refused_or_not_math(family):
    """Fails when transformers gives the config class a field this package does not
    account for (a new field may change the math: implement it or refuse it)."""
    import transformers

    from onnx_export.decoder import FAMILIES, NON_MATH

    fam = next(f for f in FAMILIES if f.name == family)
    cls = getattr(transformers, CONFIG_CLASSES[family])
    unknown = _fields(cls) - fam.fields - NON_MATH
    assert not unknown, f"{family}: fields neither implemented, refused nor non-math: {unknown}"
    # The lists say something: no field is both non-math and read.
    assert not (fam.fields & NON_MATH)


def _config(cls_name: str, **kw):
    import transformers

    base = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return getattr(transformers, cls_name)(**{**base, **kw})


REFUSED = [
    ("LlamaConfig", dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4,
                                          "short_factor": [1.0] * 4, "long_factor": [1.0] * 4,
                                          "original_max_position_embeddings": 32}),
     "config.rope_parameters: rope_type 'longrope' is not supported"),
    ("LlamaConfig", dict(hidden_act="relu2"), "config.hidden_act: got 'relu2'; supported: silu"),
    ("LlamaConfig", dict(hidden_act="gelu_10"), "config.hidden_act: got 'gelu_10'"),
    ("LlamaConfig", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                          "partial_rotary_factor": 0.5}),
     "config.rope_parameters: partial_rotary_factor 0.5; supported: 1.0"),
    ("GemmaConfig", dict(head_dim=8, use_bidirectional_attention=True),
     "config.use_bidirectional_attention: got True; supported: None or False"),
    ("Phi3Config", dict(pad_token_id=0, rope_parameters={
        "rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 4,
        "long_factor": [1.0] * 4, "original_max_position_embeddings": 32}),
     "config.rope_parameters: rope_type 'longrope'"),
    ("GPT2Config", {}, "config.model_type: got 'gpt2'; supported: llama, mistral"),
]  # fmt: skip


@pytest.mark.parametrize("cls_name, kw, match", REFUSED, ids=[r[2][7:40] for r in REFUSED])
def test_unsupported_values_are_refused_by_name(cls_name, kw, match):
    from onnx_export.decoder import decoder_spec

    with pytest.raises(NotImplementedError, match=match.replace("(", r"\(")):
        decoder_spec(_config(cls_name, **kw))


def test_bad_shapes_are_value_errors_naming_the_field():
    from onnx_export.decoder import decoder_spec

    cfg = _config("LlamaConfig")
    # The configs validate their own fields; a hand-edited config.json or another
    # library's config object may not: set past the validators.
    object.__setattr__(cfg, "num_key_value_heads", 3)
    with pytest.raises(ValueError, match="config.num_key_value_heads: expected a divisor of"):
        decoder_spec(cfg)
    cfg = _config("LlamaConfig")
    object.__setattr__(cfg, "rms_norm_eps", None)
    with pytest.raises(ValueError, match="config.rms_norm_eps: expected a positive float"):
        decoder_spec(cfg)
    cfg = _config("Qwen2Config")
    object.__setattr__(cfg, "layer_types", ["full_attention", "chunked_attention"])
    with pytest.raises(NotImplementedError, match="config.layer_types: got"):
        decoder_spec(cfg)


def test_sparse_with_a_sliding_window_is_refused_before_export():
    import transformers

    from onnx_export.decoder import export_decoder
    from pytrt_kv.retrieval.config import RetrievalConfig

    cfg = RetrievalConfig(init_tokens=4, local_tokens=8, topk_percent=0.25, block_size=4,
                          dense_boundary=0, offload_boundary=0)  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(
        _config("MistralConfig", sliding_window=8)
    )
    with pytest.raises(NotImplementedError, match="config.sliding_window: retrieval"):
        export_decoder(model, block_size=4, decode=True, retrieval=cfg, max_pages=8)


def test_generate_without_the_study_extra_names_it_in_one_line(monkeypatch, capsys):
    """No torch/transformers: one line naming the extra and the real install command."""
    import importlib.util as iu

    from pytrt_kv.cli import main

    real = iu.find_spec

    def find_spec(name, *args):
        return None if name in ("torch", "transformers") else real(name, *args)

    monkeypatch.setattr(iu, "find_spec", find_spec)
    rc = main(["generate", "--prompt", "hi", "--model", __file__.replace(".py", ".gguf")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1, err
    # The path is checked first (a missing file is named), then the libraries.
    assert "model:" in err[0] and "does not exist" in err[0]
    import onnx_export.decoder.load as load

    monkeypatch.setattr(load, "find_model", lambda path=None: __import__("pathlib").Path("m.gguf"))
    rc = main(["generate", "--prompt", "hi"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1, err
    assert "torch, transformers not installed (the 'study' extra)" in err[0]
    assert "-m pip install '" in err[0] and "[study]'" in err[0] and "/path/to" not in err[0]


def test_install_hints_print_the_real_command(monkeypatch, tmp_path):
    """Every "install the extra" hint is pytrt_kv._lib.install_command: this Python, and
    where this pytrt_kv came from (the checkout it runs from; else the folder, wheel or
    URL its distribution was installed from; else its name on an index), never a
    placeholder path."""
    import json
    import pathlib
    import sys
    from importlib import metadata

    from pytrt_kv import _lib

    # Imported from a checkout (a pyproject.toml beside the package): that folder.
    checkout = tmp_path / "my src"
    (checkout / "pytrt_kv").mkdir(parents=True)
    (checkout / "pyproject.toml").write_text("")
    monkeypatch.setattr(_lib, "__file__", str(checkout / "pytrt_kv" / "_lib.py"))
    want_checkout = f"{sys.executable} -m pip install '{checkout}[study]'"
    assert _lib.install_command("study") == want_checkout
    # Installed (no pyproject.toml next to the package): the distribution's record.
    monkeypatch.setattr(_lib, "__file__", str(tmp_path / "site" / "pytrt_kv" / "_lib.py"))
    record: dict[str, str | None] = {}

    class Dist:
        def read_text(self, name):
            assert name == "direct_url.json"
            return record.get("text")

    monkeypatch.setattr(metadata, "distribution", lambda name: Dist())
    for text, want in (
        (json.dumps({"url": "file:///opt/my%20src/pytrt_kv", "dir_info": {}}),
         "'/opt/my src/pytrt_kv[trt]'"),
        (json.dumps({"url": "file:///w/pytrt_kv-0.1-cp311-linux_x86_64.whl", "archive_info": {}}),
         "'/w/pytrt_kv-0.1-cp311-linux_x86_64.whl[trt]'"),
        (json.dumps({"url": "https://example.org/pytrt_kv.tar.gz", "archive_info": {}}),
         "'pytrt-kv[trt] @ https://example.org/pytrt_kv.tar.gz'"),
        (None, "'pytrt-kv[trt]'"),  # from an index: no direct_url.json
    ):  # fmt: skip
        record["text"] = text
        assert _lib.install_command("trt") == f"{sys.executable} -m pip install {want}"
    # No source file of the package prints a placeholder install path.
    repo = pathlib.Path(__file__).resolve().parents[1]
    for package in ("pytrt_kv", "onnx_export"):
        for path in (repo / package).rglob("*.py"):
            assert "/path/to/pytrt_kv" not in path.read_text(), path
