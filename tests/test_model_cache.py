"""The converted-GGUF cache (pytrt_kv/model_cache.py, docs/YOUR_MODEL.md): a folder is
kept only when it reads back equal to the model it was saved from, is found again by the
file's content, and a cache that cannot be written only costs a warning. A tiny
random-weight Llama stands in for the model (the SmolLM2 tests go through the real
GGUF: the session's first load converts, the others read the folder)."""

from __future__ import annotations

import importlib.util
import os

import pytest

from pytrt_kv import model_cache

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None or importlib.util.find_spec("torch") is None,
    reason="transformers/torch not installed (the 'study' extra)",
)


def _tiny():
    import tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = ["[UNK]", "The", "capital", "of", "France", "is"]
    wl = tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]")
    t = tokenizers.Tokenizer(wl)
    t.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=t, unk_token="[UNK]")
    cfg = LlamaConfig(vocab_size=len(words), hidden_size=16, intermediate_size=32,
                      num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1)  # fmt: skip
    return LlamaForCausalLM(cfg).eval(), tok


def test_cache_root(monkeypatch, tmp_path):
    monkeypatch.setenv(model_cache.CACHE_ENV, "off")
    assert model_cache.cache_root() is None
    monkeypatch.setenv(model_cache.CACHE_ENV, str(tmp_path))
    assert model_cache.cache_root() == tmp_path
    monkeypatch.delenv(model_cache.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert model_cache.cache_root() == tmp_path / "xdg" / "pytrt_kv" / "models"


def test_a_kept_folder_equals_the_model_and_is_found_by_content(monkeypatch, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv(model_cache.CACHE_ENV, str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF one")
    model, tok = _tiny()
    assert model_cache.cached_folder(gguf) is None
    folder = model_cache.converted_folder(gguf, model, tok)
    assert folder is not None and model_cache.cached_folder(gguf) == folder
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]  # no temporary left
    back = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    want, got = model.state_dict(), back.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert model_cache._differs(model, tok, folder) == ""

    # What the read-back compares: a weight, the config, the tokenizer.
    with torch.no_grad():
        model.model.norm.weight[0] += 1
    assert model_cache._differs(model, tok, folder) == "differs in model.norm.weight"
    other, _ = _tiny()
    other.load_state_dict(back.state_dict())
    other.config.rms_norm_eps = 1e-3
    assert "has another config (['rms_norm_eps'])" in model_cache._differs(other, tok, folder)
    _, tok2 = _tiny()
    tok2.add_tokens(["extra"])
    assert model_cache._differs(back, tok2, folder) == "tokenizes differently"

    # Another file content (the same name): another folder, none yet.
    gguf.write_bytes(b"GGUF two")
    os.utime(gguf, ns=(1, 1))
    assert model_cache.cached_folder(gguf) is None


def test_a_folder_that_reads_back_differently_is_not_kept(monkeypatch, tmp_path):
    monkeypatch.setenv(model_cache.CACHE_ENV, str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    model, tok = _tiny()
    monkeypatch.setattr(model_cache, "_differs", lambda m, t, w: "differs in x")
    with pytest.warns(UserWarning, match="not kept, the converted m.gguf differs in x"):
        assert model_cache.converted_folder(gguf, model, tok) is None
    assert model_cache.cached_folder(gguf) is None
    assert list((tmp_path / "cache").iterdir()) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder")
def test_an_unwritable_cache_costs_a_warning(monkeypatch, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    monkeypatch.setenv(model_cache.CACHE_ENV, str(ro / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    model, tok = _tiny()
    with pytest.warns(UserWarning, match="cannot write the converted m.gguf"):
        assert model_cache.converted_folder(gguf, model, tok) is None


def test_a_cache_path_that_is_a_file_costs_a_warning(monkeypatch, tmp_path):
    blocker = tmp_path / "cache"
    blocker.write_text("not a folder")
    monkeypatch.setenv(model_cache.CACHE_ENV, str(blocker))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    model, tok = _tiny()
    with pytest.warns(UserWarning, match="cannot write the converted m.gguf"):
        assert model_cache.converted_folder(gguf, model, tok) is None
    assert model_cache.cached_folder(gguf) is None


def test_a_damaged_folder_is_made_again(monkeypatch, tmp_path):
    """A kept folder whose weights were damaged after it was made (the cache is outside
    this process's control) is removed with a warning and converted again; the model
    returned equals the GGUF's."""
    import torch

    monkeypatch.setenv(model_cache.CACHE_ENV, str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    model, tok = _tiny()
    reads = []

    def read_gguf(path, dtype):  # transformers' GGUF reading, of the tiny model
        reads.append(dtype)
        return model, tok

    monkeypatch.setattr(model_cache, "_read_gguf", read_gguf)
    folder = model_cache.converted_folder(gguf, model, tok)
    assert folder is not None
    (folder / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.warns(UserWarning, match="cannot be read .*removed, converting m.gguf again"):
        got, _ = model_cache.load_gguf(gguf, torch.float32)
    assert reads == [torch.float32] and model_cache.cached_folder(gguf) == folder
    want, back = model.state_dict(), got.state_dict()
    assert all(torch.equal(want[k], back[k]) for k in want)
    # Read from the folder now: no GGUF read.
    model_cache.load_gguf(gguf, torch.bfloat16)
    assert reads == [torch.float32]


def test_with_the_cache_off_the_gguf_is_read_once_in_the_type_asked(monkeypatch, tmp_path):
    import torch

    monkeypatch.setenv(model_cache.CACHE_ENV, "off")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    model, tok = _tiny()
    reads = []
    monkeypatch.setattr(model_cache, "_read_gguf", lambda p, d: (reads.append(d), (model, tok))[1])
    assert model_cache.load_gguf(gguf, torch.bfloat16) == (model, tok)
    assert reads == [torch.bfloat16] and list(tmp_path.iterdir()) == [gguf]


def test_one_parse_shares_readers_and_restores_gguf(tmp_path):
    """``one_parse`` (the GGUF read in one parse, pytrt_kv/model_cache.py): inside it a
    file opened twice is one reader (its tensors those of a plain reader) and a tensor-name
    table is built once; after it, also after an exception, gguf's own class and function
    are back."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("llama.block_count", 2)
    w.add_tensor("token_embd.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    cls, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    plain = cls(str(path))
    with model_cache.one_parse():
        a, b = gguf.GGUFReader(str(path)), gguf.GGUFReader(path)
        assert a is b and isinstance(a, cls)
        assert [t.name for t in a.tensors] == [t.name for t in plain.tensors]
        assert np.array_equal(a.tensors[0].data, plain.tensors[0].data)
        arch = gguf.MODEL_ARCH.LLAMA
        assert gguf.get_tensor_name_map(arch, 2) is gguf.get_tensor_name_map(arch, 2)
    assert gguf.GGUFReader is cls and gguf.get_tensor_name_map is name_map
    assert cls(str(path)) is not cls(str(path))
    with pytest.raises(RuntimeError, match="inside"), model_cache.one_parse():
        raise RuntimeError("inside")
    assert gguf.GGUFReader is cls and gguf.get_tensor_name_map is name_map
