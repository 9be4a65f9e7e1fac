"""Real text nobody here wrote, present offline: corpora for pretraining and prompt sets for evaluation.

Corpora (``load_corpus``), each split deterministically into train/validation/test by a hash of a stable key,
so every machine with the same inputs gets the same split and no file is in two splits:

- ``stdlib``: the ``.py`` files of the running interpreter's standard library (key: path relative to the stdlib
  root). Tests, site-packages and generated tables (``encodings``, ``pydoc_data``) are left out.
- ``tinystories``, ``tinyshakespeare``: text files under the shared data folder (``$DRAFTKIT_SHARED_DATA``, else
  ``<repo>/../shared/data``: :func:`decode.prompts.shared_data_dir`), cut into blank-line separated chunks (key:
  the chunk's text).

Prompt sets (``load_prompts``) for measuring acceptance on held-out real prompts: every named set of
``decode.prompts`` (the one registry: ``humaneval``, ``mbpp``, ``mbpp_code``, ...; a name means the same prompts in
the benchmark and here), plus

- ``stdlib``: held-out (``test`` split) stdlib files cut just after their first ``def`` line, so the model
  continues real code rather than a license header.
"""
from __future__ import annotations

import hashlib
import os
import re
import sysconfig
from pathlib import Path

import datasets

from decode import prompts as dprompts

SPLITS = ("train", "validation", "test")
# Fractions of train and validation; test gets the rest. Keys hash uniformly, so sizes are close to these.
DEFAULT_FRACTIONS = (0.90, 0.05)

# Path components never read from the stdlib: tests (code about code, huge and repetitive), installed packages
# (differ between machines, so the split would too), and generated codec/doc tables that are data, not code.
_STDLIB_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__",
                     "encodings", "pydoc_data", "lib-dynload"}

_TEXT_FILES = {"tinystories": "tinystories/tinystories_val.txt", "tinyshakespeare": "tinyshakespeare/input.txt"}
CORPORA = ("stdlib",) + tuple(_TEXT_FILES)
# Named prompt sets: decode.prompts' registry (one meaning per name everywhere) plus held-out stdlib files.
PROMPT_SETS = tuple(dprompts.PROMPT_SETS) + tuple(dprompts.DERIVED_SETS) + ("stdlib",)


def split_of(key: str, fractions: tuple[float, float] = DEFAULT_FRACTIONS) -> str:
    """The split ("train", "validation" or "test") that ``key`` falls in, from the SHA-1 of the key.

    Stable across processes and machines (unlike ``hash``), so a file never moves between splits.
    """
    u = int(hashlib.sha1(key.encode("utf-8")).hexdigest()[:12], 16) / float(16**12)  # uniform in [0, 1)
    if u < fractions[0]:
        return "train"
    return "validation" if u < fractions[0] + fractions[1] else "test"


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}: use one of {', '.join(SPLITS)}")


def stdlib_root() -> Path:
    """The running interpreter's standard library folder (``sysconfig.get_paths()['stdlib']``)."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: str | os.PathLike | None = None) -> list[tuple[str, Path]]:
    """Sorted ``(relative_path, absolute_path)`` of the stdlib ``.py`` files used as a corpus."""
    root = Path(root) if root is not None else stdlib_root()
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Pruning in place keeps os.walk from descending into skipped folders at all.
        dirnames[:] = sorted(d for d in dirnames if d not in _STDLIB_SKIP_DIRS and not d.startswith("config-"))
        for name in sorted(filenames):
            if name.endswith(".py") and not name.startswith("_sysconfigdata"):
                path = Path(dirpath) / name
                out.append((path.relative_to(root).as_posix(), path))
    return out


def _stdlib_rows(split: str, fractions, root=None, max_files: int | None = None) -> dict[str, list[str]]:
    rows: dict[str, list[str]] = {"text": [], "path": []}
    for rel, path in stdlib_files(root):
        if split_of(rel, fractions) != split:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if text.strip():
            rows["text"].append(text)
            rows["path"].append(rel)
        if max_files is not None and len(rows["text"]) >= max_files:
            break
    return rows


def check_corpus(name: str) -> None:
    """Raise FileNotFoundError (naming the file and how to point at it) when corpus ``name`` reads a file of the
    shared data folder that is not there; the stdlib corpus needs none."""
    if name in _TEXT_FILES:
        path = dprompts.shared_data_dir() / _TEXT_FILES[name]
        if not path.is_file():
            raise FileNotFoundError(f"corpus {name!r} reads {path}, which does not exist: {dprompts.SHARED_DATA_HINT}")


def _text_rows(name: str, split: str, fractions, max_chunks: int | None = None) -> dict[str, list[str]]:
    check_corpus(name)
    path = dprompts.shared_data_dir() / _TEXT_FILES[name]
    chunks = [c.strip() for c in re.split(r"\n\s*\n", path.read_text(encoding="utf-8"))]
    texts = [c for c in chunks if c and split_of(c, fractions) == split]
    return {"text": texts[:max_chunks] if max_chunks is not None else texts}


def load_corpus(name: str, split: str, *, fractions: tuple[float, float] = DEFAULT_FRACTIONS,
                max_items: int | None = None, root: str | os.PathLike | None = None) -> datasets.Dataset:
    """One split of a pretraining corpus as a ``datasets.Dataset``.

    Args:
        name: "stdlib", "tinystories" or "tinyshakespeare".
        split: "train", "validation" or "test".
        fractions: (train, validation) fractions of keys; test gets the rest.
        max_items: keep at most this many files/chunks (in sorted order), for tests.
        root: stdlib folder to read instead of the running interpreter's (for tests).

    Returns:
        A Dataset with a "text" column (one file or chunk per row), plus "path" (relative to the stdlib root)
        for stdlib.

    Raises:
        ValueError: unknown corpus or split, or the split came out empty.
        FileNotFoundError: a shared-data corpus file is missing.
    """
    _check_split(split)
    if name == "stdlib":
        rows = _stdlib_rows(split, fractions, root, max_items)
    elif name in _TEXT_FILES:
        rows = _text_rows(name, split, fractions, max_items)
    else:
        raise ValueError(f"unknown corpus {name!r}: use one of {', '.join(CORPORA)}")
    if not rows["text"]:
        raise ValueError(f"corpus {name!r} split {split!r} is empty: check fractions={fractions} and the source")
    return datasets.Dataset.from_dict(rows)


# ----------------------------------------------------------------------------------------------- prompt sets

def stdlib_prompt(text: str, max_chars: int = 600) -> str | None:
    """A held-out file cut just after its first ``def`` line, keeping at most the last ``max_chars``
    characters at line boundaries; ``None`` if the file has no ``def``."""
    m = re.search(r"^[ \t]*def .*:[ \t]*\n", text, flags=re.M)
    if m is None:
        return None
    prefix = text[: m.end()]
    if len(prefix) > max_chars:
        cut = prefix.find("\n", len(prefix) - max_chars)
        prefix = prefix[cut + 1:]
    return prefix


def _stdlib_prompts(split: str, max_chars: int, root=None) -> list[str]:
    rows = _stdlib_rows(split, DEFAULT_FRACTIONS, root)
    return [p for p in (stdlib_prompt(t, max_chars) for t in rows["text"]) if p]


def load_prompts(name: str, n: int | None = None, *, split: str = "test", max_chars: int = 600,
                 root: str | os.PathLike | None = None) -> list[str]:
    """Held-out real prompts for evaluation.

    Args:
        name: a set of ``decode.prompts`` (``humaneval``, ``mbpp``, ``mbpp_code``, ...) or ``stdlib``.
        n: the first ``n`` prompts (in file order; stdlib in path order), or all.
        split: the stdlib split to cut prompts from ("test": never trained on).
        max_chars: longest stdlib prompt, in characters.
        root: stdlib folder to read instead of the running interpreter's (for tests).

    Returns:
        A list of prompt strings.

    Raises:
        ValueError: unknown prompt set, or no prompts.
        FileNotFoundError: a shared-data file is missing.
    """
    if name in dprompts.PROMPT_SETS or name in dprompts.DERIVED_SETS:
        prompts = [p.text for p in dprompts.load_prompts(name)]
    elif name == "stdlib":
        _check_split(split)
        prompts = _stdlib_prompts(split, max_chars, root)
    else:
        raise ValueError(f"unknown prompt set {name!r}: use one of {', '.join(PROMPT_SETS)}")
    if not prompts:
        raise ValueError(f"prompt set {name!r} is empty")
    return prompts[:n] if n is not None else prompts
