"""GGUF files (llama.cpp's one-file format: weights, config and tokenizer) as ordinary transformers models.

A ``.gguf`` file, or a folder that holds no ``config.json`` and exactly one ``.gguf`` file, is a model path like a
``save_pretrained`` folder (:func:`find_gguf`). transformers reads it (``from_pretrained(folder, gguf_file=name)``)
and dequantizes every tensor; :func:`load_gguf_model` then rebuilds a plain model of the same config without the GGUF
quantization state, so ``save_pretrained``, peft and the decoder see an ordinary model, and logs that the weights were
dequantized (the file, its tensor types, the dtype the model now runs in). The tokenizer comes from the same file
(:func:`load_gguf_tokenizer`). The file is read through its parser only (``gguf.GGUFReader`` and transformers' GGUF
support): nothing is unpickled and no code runs.

Use :func:`decode.loading.load_causal_lm` and :func:`decode.loading.load_tokenizer`, which call this module for a
GGUF path, and ``python -m decode import-gguf FILE.gguf OUT_DIR`` (:func:`import_gguf`) to keep a plain checkpoint
of it.
"""
from __future__ import annotations

import copy
import hashlib
import logging
import os
import shutil
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import gguf
import torch

from decode.outputs import replace_dir, umask, write_json

# transformers is imported where it is used: `python -m decode bench` sets HF_HUB_OFFLINE after `import decode`.

log = logging.getLogger(__name__)

SUFFIX = ".gguf"
MAGIC = b"GGUF"  # a GGUF file's first four bytes
SOURCE_FILE = "gguf_source.json"  # import_gguf's record of the file a checkpoint was made from
IMPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def find_gguf(name_or_path: str | Path, role: str = "model") -> Path | None:
    """The GGUF file a model path stands for: the path itself when it is an existing file named ``*.gguf``, or the one
    ``*.gguf`` file of an existing folder that has no ``config.json`` (nor ``adapter_config.json``). None for anything
    else (a checkpoint folder, a hub id, a missing path).

    Raises:
        FileNotFoundError: naming ``role``: the file is not GGUF (its first bytes are not ``GGUF``), or the folder
            holds several ``.gguf`` files (listed; name one).
    """
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.name.lower().endswith(SUFFIX):
        check_magic(path, role)
        return path
    if not path.is_dir() or (path / "config.json").exists() or (path / "adapter_config.json").exists():
        return None
    found = sorted(p for p in path.iterdir() if p.is_file() and p.name.lower().endswith(SUFFIX))
    if len(found) > 1:
        raise FileNotFoundError(f"the {role} folder {str(path)!r} has no config.json and {len(found)} GGUF files "
                                f"({', '.join(p.name for p in found)}); name one: {path / found[0].name}")
    if found:
        check_magic(found[0], role)
    return found[0] if found else None


def check_magic(path: Path, role: str = "model") -> None:
    """Raise FileNotFoundError, naming ``role``, when ``path`` does not start with the GGUF magic bytes."""
    with open(path, "rb") as f:
        head = f.read(len(MAGIC))
    if head != MAGIC:
        raise FileNotFoundError(f"the {role} {str(path)!r} is not a GGUF file (it starts with {head!r}, not "
                                f"{MAGIC!r}); give a .gguf file written by llama.cpp's convert script or the gguf "
                                "package, or a folder written by save_pretrained")


def quantization_types(path: str | Path) -> list[str]:
    """The tensor types of a GGUF file (``Q4_1``, ``Q6_K``, ``F32``, ...), the most frequent first, read by
    ``gguf.GGUFReader`` (the header and tensor index only; the weights stay on disk, memory-mapped)."""
    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError) as err:
        raise FileNotFoundError(f"cannot read the GGUF file {str(path)!r}: {err}") from err
    counts = Counter(t.tensor_type.name for t in reader.tensors)
    return [name for name, _ in counts.most_common()]


def sha256(path: str | Path) -> str:
    """The sha256 of a file's bytes, read in 16 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(16 << 20):
            h.update(block)
    return h.hexdigest()


def source_record(path: str | Path) -> dict:
    """Where a checkpoint imported from a GGUF file came from: file name, size in bytes, sha256, tensor types."""
    path = Path(path)
    return {"file": path.name, "size": path.stat().st_size, "sha256": sha256(path),
            "quantization_types": quantization_types(path)}


def plain_copy(model: Any) -> Any:
    """A model of ``model``'s class and config without ``quantization_config``, holding ``model``'s weights (the
    same tensors: no copy, so no second model's memory) and generation config: what transformers' GGUF loading
    leaves marked as quantized (an ``hf_quantizer`` that refuses ``save_pretrained``) becomes an ordinary model.
    Tied embeddings stay tied."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):  # the structure only: every tensor is replaced by model's below
        plain = AutoModelForCausalLM.from_config(config, dtype=next(model.parameters()).dtype)
    plain.load_state_dict(model.state_dict(), strict=True, assign=True)
    for name, buf in model.named_buffers():  # the non-persistent ones (rotary frequencies) are not in the state dict
        owner, _, leaf = name.rpartition(".")
        setattr(plain.get_submodule(owner), leaf, buf)
    plain.tie_weights()
    left = [n for n, t in [*plain.named_parameters(), *plain.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"rebuilding the GGUF model as a plain {type(plain).__name__} left {left} unset")
    plain.generation_config = copy.deepcopy(model.generation_config)
    return plain


def load_gguf_model(path: str | Path, dtype: Any = torch.float32, role: str = "model") -> Any:
    """The causal LM of a GGUF file, dequantized to ``dtype`` (a torch.dtype, ``"auto"``, or None for transformers'
    default) and rebuilt as a plain model (:func:`plain_copy`); logs a warning naming the file, its tensor types and
    the dtype the model now runs in.

    Raises:
        FileNotFoundError: naming ``role``: not a GGUF file, or one transformers cannot read (an architecture its
            GGUF support lacks, a tensor type it cannot dequantize).
    """
    from transformers import AutoModelForCausalLM

    path = Path(path).expanduser()
    check_magic(path, role)
    types = quantization_types(path)
    kw = {} if dtype is None else {"dtype": dtype}
    try:
        loaded = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, **kw)
    except (OSError, ValueError, KeyError, NotImplementedError) as err:
        raise FileNotFoundError(f"could not load the {role} from the GGUF file {str(path)!r} (tensor types "
                                f"{', '.join(types)}): {err}") from err
    model = plain_copy(loaded)
    del loaded
    model.name_or_path = str(path)
    log.warning("%s %s: GGUF tensors (%s) dequantized; the model runs in %s", role, path, ", ".join(types),
                str(next(model.parameters()).dtype).removeprefix("torch."))
    return model


def load_gguf_tokenizer(path: str | Path, role: str = "tokenizer") -> Any:
    """The tokenizer stored in a GGUF file's metadata (vocabulary, merges, special tokens, chat template), through
    ``AutoTokenizer.from_pretrained(folder, gguf_file=name)``.

    Raises:
        FileNotFoundError: naming ``role``: not a GGUF file, or its tokenizer cannot be read.
    """
    from transformers import AutoTokenizer

    path = Path(path).expanduser()
    check_magic(path, role)
    try:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except (OSError, ValueError, KeyError, NotImplementedError) as err:
        raise FileNotFoundError(f"could not load the {role} from the GGUF file {str(path)!r}: {err}") from err


def import_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, dtype: str | torch.dtype = "float32") -> Path:
    """Write a plain Hugging Face checkpoint of a GGUF file into ``out_dir`` and return its path: ``config.json``,
    ``model.safetensors`` (the weights dequantized to ``dtype``: float32, bfloat16 or float16),
    ``generation_config.json`` (the GGUF's bos and eos), the tokenizer's files (vocabulary, merges, chat template),
    and ``gguf_source.json`` (:func:`source_record`, and the dtype). The result loads with plain ``from_pretrained``.

    The checkpoint is written into a temporary folder beside ``out_dir`` and renamed into place, so an interrupted
    import leaves no partial ``out_dir``. ``python -m decode import-gguf FILE.gguf OUT_DIR [--dtype float32]``.

    Raises:
        FileNotFoundError: ``gguf_path`` is missing, a folder, or not a GGUF file (or one transformers cannot read).
        FileExistsError: ``out_dir`` exists and is not an empty folder (nothing is overwritten).
        ValueError: ``dtype`` is not one of float32, bfloat16, float16.
    """
    src, out = Path(gguf_path).expanduser(), Path(out_dir).expanduser()
    if not src.is_file():
        what = "is a folder" if src.is_dir() else "does not exist"
        raise FileNotFoundError(f"GGUF file {str(gguf_path)!r} {what}; give the path of a .gguf file")
    check_magic(src, "GGUF file")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"OUT_DIR {str(out_dir)!r} exists and is not an empty folder; nothing there is "
                              "overwritten: give a new folder (or remove that one yourself)")
    torch_dtype = dtype if isinstance(dtype, torch.dtype) else IMPORT_DTYPES.get(str(dtype))
    if torch_dtype not in IMPORT_DTYPES.values():
        raise ValueError(f"--dtype {dtype!r}: the import writes {', '.join(IMPORT_DTYPES)}; use one of them")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        os.chmod(tmp, 0o777 & ~umask())  # a folder like any other the user makes (mkdtemp's is private)
        load_gguf_model(src, torch_dtype, "GGUF model").save_pretrained(tmp)
        load_gguf_tokenizer(src).save_pretrained(tmp)
        write_json(tmp / SOURCE_FILE, {**source_record(src), "dtype": str(torch_dtype).removeprefix("torch.")})
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
