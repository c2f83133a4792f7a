"""GGUF files converted once into a transformers folder (docs/YOUR_MODEL.md, "The
converted-GGUF cache").

transformers takes ~16 s to load SmolLM2's 98 MB GGUF on a 2-core CPU: it parses the
file three times (config, tokenizer, weights), builds gguf's tensor-name table once per
module (397 times), and de-quantizes every tensor. :func:`one_parse` cuts that to ~5 s
(one parse, one table: :func:`_read_gguf` uses it). The same
model saved as a transformers folder (float32 safetensors, ``tokenizer.json``) loads in
well under a second. So the first load of a GGUF file saves that folder into a cache, and
later loads, in any process, read it instead:

- the folder is named by the file's SHA-256 and the transformers version, so an edited
  file or another transformers gets a new one;
- it is written beside its final name and renamed when complete, after it was read back
  and compared with the model just loaded from the GGUF (every tensor bit for bit, the
  config, the tokenizer's ids of a probe text): a folder that does not equal the GGUF is
  never used;
- only safetensors and JSON are read from it (no pickle, no remote code).

``PYTRT_KV_MODEL_CACHE`` names the cache folder (default
``$XDG_CACHE_HOME/pytrt_kv/models``, else ``~/.cache/pytrt_kv/models``); ``off`` turns
the cache off. A folder that cannot be written is not an error: the GGUF is loaded as it
is, with a warning.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import shutil
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

#: The environment variable naming the cache folder ("off": no cache).
CACHE_ENV = "PYTRT_KV_MODEL_CACHE"
#: Written last into a complete folder: its content is the folder's key.
DONE = "pytrt_kv_complete"
#: Tokenized by both tokenizers when a folder is made (they must give the same ids).
PROBE = "The capital of France is <|im_start|>user\ndef fibonacci(n):\n\treturn 日本語 ü 🙂"


def cache_root() -> Path | None:
    """The cache folder, or None when ``PYTRT_KV_MODEL_CACHE`` is ``off`` (or ``0``)."""
    value = os.environ.get(CACHE_ENV)
    if value is not None:
        if value.strip().lower() in ("", "0", "off", "no", "false"):
            return None
        return Path(value).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pytrt_kv" / "models"


_KEYS: dict[tuple[str, int, int], str] = {}


def _key(gguf: Path) -> str:
    """The file's SHA-256 (remembered per path, size and mtime for the process) and the
    transformers version."""
    import transformers  # noqa: PLC0415

    st = gguf.stat()
    stamp = (str(gguf.resolve()), st.st_size, st.st_mtime_ns)
    if stamp in _KEYS:
        return _KEYS[stamp]
    h = hashlib.sha256()
    with open(gguf, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    key = _KEYS[stamp] = f"{h.hexdigest()[:24]}-transformers{transformers.__version__}"
    return key


def _folder(gguf: Path) -> tuple[Path, str] | None:
    root = cache_root()
    if root is None:
        return None
    key = _key(gguf)
    return root / f"{gguf.stem}-{key}", key


def _complete(folder: Path, key: str) -> bool:
    try:
        return (folder / DONE).read_text() == key
    except OSError:
        return False


def cached_folder(gguf: Path) -> Path | None:
    """The complete converted folder of ``gguf`` if there is one (nothing is converted)."""
    found = _folder(gguf)
    if found is None:
        return None
    folder, key = found
    return folder if _complete(folder, key) else None


def load_gguf(gguf: Path, dtype: Any) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of the GGUF file ``gguf`` in the torch ``dtype``, from its
    converted folder, made first if there is none (the GGUF read in float32, saved,
    compared); from the GGUF itself when the cache is off or not writable. A folder that
    cannot be read (damaged since it was made) is removed, with a warning, and made
    again."""
    import torch  # noqa: PLC0415

    if cache_root() is None:  # no cache: read once, in the type asked for
        return _read_gguf(gguf, dtype)
    folder = cached_folder(gguf)
    if folder is not None:
        try:
            return _read_folder(folder, dtype)
        except Exception as exc:  # noqa: BLE001 - any reader error: the folder goes
            warnings.warn(
                f"{CACHE_ENV}: {folder} cannot be read ({type(exc).__name__}: {exc}); "
                f"removed, converting {gguf.name} again",
                stacklevel=2,
            )
            shutil.rmtree(folder, ignore_errors=True)
    model, tok = _read_gguf(gguf, torch.float32)
    folder = converted_folder(gguf, model, tok)
    if folder is None:
        if dtype is not torch.float32:
            model = _read_gguf(gguf, dtype)[0]
        return model, tok
    del model
    return _read_folder(folder, dtype)


_PATCH_LOCK = threading.Lock()


@contextlib.contextmanager
def one_parse() -> Iterator[None]:
    """Within this block, ``gguf.GGUFReader(path)`` parses each file once (later calls get
    the same reader) and ``gguf.get_tensor_name_map`` builds each table once. transformers
    imports both from ``gguf`` inside its GGUF loader at each call, so its three parses of
    one file (config, tokenizer, weights) become one and its 397 tables for SmolLM2 one:
    ~16 s -> ~5 s on 2 cores. Both objects are only read by transformers (the reader maps
    the file read-only), so what it loads is the same. The originals are back on exit;
    one block at a time (a lock); without ``gguf`` it does nothing."""
    try:
        import gguf as _gguf  # noqa: PLC0415
    except ImportError:
        yield
        return
    gguf: Any = _gguf  # its attributes are replaced below, then restored
    with _PATCH_LOCK:
        reader_cls, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
        readers: dict[tuple[str, str], Any] = {}

        def reader(path: Any, mode: Any = "r") -> Any:
            key = (os.path.realpath(os.fspath(path)), mode)
            if key not in readers:
                readers[key] = reader_cls(path, mode)
            return readers[key]

        gguf.GGUFReader = reader
        gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(name_map)
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = reader_cls, name_map


def _read_gguf(gguf: Path, dtype: Any) -> tuple[Any, Any]:
    """transformers' own GGUF reading, the file parsed once (:func:`one_parse`; ~5 s for
    SmolLM2 on 2 cores)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    src: dict[str, Any] = {"gguf_file": gguf.name, "local_files_only": True}
    with one_parse():
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), **src)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=dtype, **src)
    return model, tok


def _read_folder(folder: Path, dtype: Any) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, local_files_only=True)
    return model, tok


def converted_folder(gguf: Path, model: Any, tok: Any) -> Path | None:
    """Save ``model`` and ``tok``, just loaded from ``gguf`` in float32, as its converted
    folder, and return it; None when the cache is off, cannot be written, or the folder
    read back differs from them (a warning says which)."""
    found = _folder(gguf)
    if found is None:
        return None
    folder, key = found
    if _complete(folder, key):
        return folder
    tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        _save(model, tok, tmp)
        why = _differs(model, tok, tmp)
        if why:
            warnings.warn(f"{CACHE_ENV}: not kept, the converted {gguf.name} {why}", stacklevel=2)
            shutil.rmtree(tmp, ignore_errors=True)
            return None
        (tmp / DONE).write_text(key)
        try:
            os.rename(tmp, folder)
        except OSError:  # another process made it meanwhile (or a stale one is there)
            shutil.rmtree(tmp, ignore_errors=True)
            if not _complete(folder, key):
                shutil.rmtree(folder, ignore_errors=True)
                return None
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        warnings.warn(
            f"{CACHE_ENV}: cannot write the converted {gguf.name} under {folder.parent} "
            f"({exc}); loading the GGUF each time (set {CACHE_ENV} to a writable folder, "
            f"or to off)",
            stacklevel=2,
        )
        return None
    return folder


def _save(model: Any, tok: Any, where: Path) -> None:
    """A GGUF-loaded model is not serializable as it is (transformers marks it quantized):
    its weights go into a plain model of the same config."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    plain = AutoModelForCausalLM.from_config(model.config)
    plain.load_state_dict(model.state_dict())
    plain.save_pretrained(where)
    tok.save_pretrained(where)


#: Config fields that say where and how a model was stored, not what it computes.
_BOOKKEEPING = frozenset(
    ("transformers_version", "_name_or_path", "architectures", "dtype", "torch_dtype",
     "quantization_config")
)  # fmt: skip


def _differs(model: Any, tok: Any, where: Path) -> str:
    """Why the folder ``where`` does not equal ``model`` and ``tok`` ("" if it does)."""
    import torch  # noqa: PLC0415

    back, tok2 = _read_folder(where, torch.float32)
    want, got = model.state_dict(), back.state_dict()
    if want.keys() != got.keys():
        return f"has other tensors ({sorted(want.keys() ^ got.keys())[:3]}...)"
    for name, t in want.items():
        if t.dtype != got[name].dtype or not torch.equal(t, got[name]):
            return f"differs in {name}"
    a = {k: v for k, v in model.config.to_dict().items() if k not in _BOOKKEEPING}
    b = {k: v for k, v in back.config.to_dict().items() if k not in _BOOKKEEPING}
    if a != b:
        keys = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
        return f"has another config ({keys})"
    if tok(PROBE)["input_ids"] != tok2(PROBE)["input_ids"] or len(tok) != len(tok2):
        return "tokenizes differently"
    return ""
