"""Prompt sets for benchmarking the speculative decoder.

Named sets are read from the shared data folder (:func:`shared_data_dir`: ``$DRAFTKIT_SHARED_DATA``, else beside
the repository); never
copied into the repository. Any local ``.jsonl`` / ``.jsonl.gz`` file works too, with a configurable text field.

| name        | file                          | text field  | category |
| ----------- | ----------------------------- | ----------- | -------- |
| humaneval   | humaneval/HumanEval.jsonl.gz  | prompt      | -        |
| mbpp        | mbpp/mbpp.jsonl               | text        | -        |
| spec_bench  | spec_bench/question.jsonl     | turns[0]    | category |
| mt_bench    | mt_bench/question.jsonl       | turns[0]    | category |
| gsm8k       | gsm8k/test.jsonl              | question    | -        |
| mbpp_code   | mbpp/mbpp.jsonl               | code prompt | -        |

``mbpp`` is the task as written (``text``); ``mbpp_code`` is the same task shaped as a code prompt: the tested
function's ``def`` line, then the task as its docstring, ending where the body starts (the shape of a HumanEval
prompt, what a code model continues). Each name means one prompt set everywhere (bench, quickstart, recipe).

Spec-Bench (Xia et al., 2024) and MT-Bench (Zheng et al., 2023) are single-turn here: only the first turn is used,
as Spec-Bench does for its speed measurements of the first turn.
"""
from __future__ import annotations

import gzip
import itertools
import json
import os
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from decode.loading import chat_prompt_ids

SHARED_DATA_ENV = "DRAFTKIT_SHARED_DATA"
# What reading a .gz raises when it is not a whole gzip file (plain text named .gz, a truncated download).
GZIP_ERRORS = (gzip.BadGzipFile, EOFError, zlib.error)


@dataclass(frozen=True)
class PromptSetSpec:
    """Where a named prompt set lives under the shared data folder and which fields hold its text and category."""

    relpath: str
    field: str
    id_field: str | None
    category_field: str | None = None


PROMPT_SETS: dict[str, PromptSetSpec] = {
    "humaneval": PromptSetSpec("humaneval/HumanEval.jsonl.gz", "prompt", "task_id"),
    "mbpp": PromptSetSpec("mbpp/mbpp.jsonl", "text", "task_id"),
    "spec_bench": PromptSetSpec("spec_bench/question.jsonl", "turns", "question_id", "category"),
    "mt_bench": PromptSetSpec("mt_bench/question.jsonl", "turns", "question_id", "category"),
    "gsm8k": PromptSetSpec("gsm8k/test.jsonl", "question", None),
}

# Sets derived from another set's rows: name -> (base set, row -> prompt text).
DERIVED_SETS: dict[str, tuple[str, Any]] = {}

# Tried in order when a local jsonl is given without a field.
DEFAULT_LOCAL_FIELDS = ("prompt", "text", "question", "turns", "instruction")


@dataclass(frozen=True)
class Prompt:
    """One benchmark prompt: an id unique within its set, the raw text (no chat template), and an optional category."""

    id: str
    text: str
    category: str | None = None


def checkout_root() -> Path | None:
    """The repository's folder when the packages run from a checkout (or an editable install), None when they are
    installed (a wheel, ``pip install .``): the one test of which it is."""
    repo = Path(__file__).resolve().parents[1]
    return repo if (repo / "conf" / "config.yaml").is_file() else None


def shared_data_dir() -> Path:
    """The shared data folder: ``$DRAFTKIT_SHARED_DATA`` if set; else ``shared/data`` beside the repository when
    the package runs from a checkout; else ``../shared/data`` taken from the current folder, as the literal path
    reads (an installed package has no repository). The one resolver of that folder: prompt sets, corpora and
    ``../shared/data/...`` paths in configs all go through it (:data:`SHARED_DATA_HINT` says how to point at it).
    """
    env = os.environ.get(SHARED_DATA_ENV)
    if env:
        return Path(env)
    repo = checkout_root()
    return repo.parent / "shared" / "data" if repo is not None else Path("../shared/data").resolve()


SHARED_DATA_HINT = (f"set {SHARED_DATA_ENV} to the folder holding humaneval/, mbpp/, tinystories/ and "
                    "tinyshakespeare/ (without it: shared/data beside the repository in a checkout, ../shared/data "
                    "from the current folder for an installed package)")


def mbpp_to_prompt(text: str, code: str, test_list: list[str] | None = None) -> str:
    """An MBPP task as a code prompt: the solution's ``def`` line for the tested function, then ``text`` as a
    docstring, ending where the body starts (the same shape as a HumanEval prompt).

    The function is the one the first test asserts on; if its ``def`` line is not found, the first ``def`` line
    is used, and with none at all the prompt is the docstring followed by ``def``.
    """
    code = code.replace("\r\n", "\n")
    text = " ".join(text.split())
    m = re.search(r"assert\s+(?:not\s+)?\(?\s*(?:set\()?(\w+)\(", " ".join(test_list or []))
    defs = re.findall(r"^def .*:\s*$", code, flags=re.M)
    wanted = [d for d in defs if m and d.startswith(f"def {m.group(1)}(")]
    if wanted or defs:
        return f"{(wanted or defs)[0].rstrip()}\n    \"\"\"{text}\n    \"\"\"\n"
    return f"\"\"\"{text}\"\"\"\ndef"


DERIVED_SETS["mbpp_code"] = ("mbpp", lambda row: mbpp_to_prompt(row["text"], row["code"], row.get("test_list")))


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The rows of a JSON-lines file (gunzipped for .gz). Raises ValueError naming the file for a line that is not
    JSON, text that is not UTF-8, or a .gz that is not a whole gzip file."""
    opener = gzip.open if path.suffix == ".gz" else open
    rows = []
    try:
        with opener(path, "rt", encoding="utf-8-sig") as f:  # a leading byte-order mark is dropped
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg}); each line must be one JSON "
                                     "object") from e
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.object[e.start]:#04x}); re-encode the file, e.g. "
                         "iconv -f latin1 -t utf-8") from None
    except GZIP_ERRORS as e:
        raise ValueError(f"{path}: not a whole gzip file ({e}); check it with gzip -t, or give the .jsonl "
                         "uncompressed") from None
    return rows


def _text_of(row: dict[str, Any], field: str, where: str) -> str:
    if field not in row:
        raise ValueError(f"{where}: no field {field!r}; fields present: {sorted(row)}. "
                       "Pass the right one with --prompt-field (load_prompts: field=)")
    value = row[field]
    if isinstance(value, list):  # chat-style `turns`: the first user turn opens the conversation
        if not value:
            raise ValueError(f"{where}: field {field!r} is an empty list")
        value = value[0]
    if not isinstance(value, str):
        raise ValueError(f"{where}: field {field!r} holds {type(value).__name__}, expected a string or list of "
                         "strings")
    return value


def _balanced(prompts: list[Prompt], limit: int) -> list[Prompt]:
    """Round-robin over categories in first-seen order, so a small limit still covers every category."""
    groups: dict[str | None, list[Prompt]] = {}
    for p in prompts:
        groups.setdefault(p.category, []).append(p)
    out = []
    for row in itertools.zip_longest(*groups.values()):
        out.extend(p for p in row if p is not None)
        if len(out) >= limit:
            break
    return out[:limit]


def _prompt_source(name: str, field: str | None,
                   category_field: str | None) -> tuple[Path, str | None, str | None, str | None]:
    """Where the prompts of a set name or local file are: ``(path, text field, id field, category field)``; the
    text field is None for a local file without ``field`` (:func:`_check_rows` picks it)."""
    if name in PROMPT_SETS:
        spec = PROMPT_SETS[name]
        path = shared_data_dir() / spec.relpath
        if not path.exists():
            raise FileNotFoundError(
                f"prompt set {name!r} expects {path}; {SHARED_DATA_HINT}")
        return path, field or spec.field, spec.id_field, spec.category_field
    path = Path(name)
    looks_like_path = path.suffix in (".jsonl", ".gz", ".json") or os.sep in name
    if not path.exists():
        if looks_like_path:
            raise FileNotFoundError(f"prompt file {path} does not exist")
        raise ValueError(f"unknown prompt set {name!r}; use one of {sorted(PROMPT_SETS) + sorted(DERIVED_SETS)} "
                         "or a path to a .jsonl file")
    if path.is_dir():
        raise ValueError(f"prompt path {path} is a directory; give a .jsonl or .jsonl.gz file")
    return path, field, "id", category_field


def _check_rows(path: Path, rows: list, text_field: str | None) -> str:
    """Every row is a JSON object; returns the text field (given, or the first of ``DEFAULT_LOCAL_FIELDS`` in the
    first row)."""
    if not rows:
        raise ValueError(f"prompt file {path} has no rows")
    bad = next((i for i, row in enumerate(rows) if not isinstance(row, dict)), None)
    if bad is not None:
        raise ValueError(f"{path}:{bad + 1} is a JSON {type(rows[bad]).__name__}, not an object; each line must be "
                         'an object with the prompt field, e.g. {"prompt": "def f():"}')
    if text_field is None:
        text_field = next((f for f in DEFAULT_LOCAL_FIELDS if f in rows[0]), None)
        if text_field is None:
            raise ValueError(f"{path}: none of the fields {list(DEFAULT_LOCAL_FIELDS)} found in the first row "
                             f"(fields present: {sorted(rows[0])}); pass the prompt field with --prompt-field "
                             "(load_prompts: field=)")
    return text_field


def load_prompts(
    source: str | os.PathLike,
    limit: int | None = None,
    field: str | None = None,
    category_field: str | None = "category",
    balanced: bool = True,
) -> list[Prompt]:
    """Load a prompt set by name (see ``PROMPT_SETS``) or from a local ``.jsonl`` / ``.jsonl.gz`` file.

    Args:
        source: a set name (``humaneval``, ``mbpp``, ``mbpp_code``, ``spec_bench``, ``mt_bench``, ``gsm8k``) or a
            path.
        limit: keep at most this many prompts (None: all). For sets with categories and ``balanced=True``, prompts
            are taken round-robin over categories so that e.g. ``limit=26`` gives two of each Spec-Bench category.
        field: the text field; for named sets it overrides the default, for a local file it defaults to the first of
            ``prompt, text, question, turns, instruction`` present in the first row. A list value uses its first item.
        category_field: for a local file, the field holding the category, if present (missing -> no category).
        balanced: round-robin over categories when limiting (else the first ``limit`` rows in file order).

    Returns:
        list of ``Prompt`` in a deterministic order.

    Raises:
        ValueError: unknown set name that is not a path either, non-positive limit, bad JSON, empty file, a row
            that is not a JSON object, or a row without the text field (the message lists the fields present).
        FileNotFoundError: a path, or the shared data folder, does not exist.
    """
    if limit is not None and limit < 1:
        raise ValueError(f"prompt limit must be >= 1 (got {limit}); omit it to use every prompt")
    name = str(source)
    derive = None
    if name in DERIVED_SETS:
        name, derive = DERIVED_SETS[name]
    path, text_field, id_field, cat_field = _prompt_source(name, field, category_field)
    rows = _read_jsonl(path)
    text_field = _check_rows(path, rows, text_field)
    prompts = []
    for i, row in enumerate(rows):
        where = f"{path}:{i + 1}"
        pid = str(row[id_field]) if id_field and id_field in row else str(i)
        cat = row.get(cat_field) if cat_field else None
        category = None if cat is None else str(cat)
        text = derive(row) if derive is not None else _text_of(row, text_field, where)
        prompts.append(Prompt(id=pid, text=text, category=category))
    if limit is None:
        return prompts
    has_categories = any(p.category is not None for p in prompts)
    return _balanced(prompts, limit) if balanced and has_categories else prompts[:limit]


def encode_prompts(
    prompts: list[Prompt],
    tokenizer,
    chat_template: bool = True,
    max_prompt_tokens: int | None = None,
) -> list[list[int]]:
    """Tokenize prompts, applying the tokenizer's chat template when it has one.

    Args:
        prompts: from ``load_prompts``.
        tokenizer: a Hugging Face tokenizer.
        chat_template: apply ``tokenizer.apply_chat_template`` (single user turn, generation prompt added) when the
            tokenizer defines a template; otherwise plain ``tokenizer(text)`` with its special tokens.
        max_prompt_tokens: keep only the last this many tokens (the end of the prompt is what the model continues).

    Returns:
        one list of token ids per prompt (no padding).

    Raises:
        ValueError: a prompt encodes to zero tokens, or ``max_prompt_tokens < 1``.
    """
    if max_prompt_tokens is not None and max_prompt_tokens < 1:
        raise ValueError(f"max_prompt_tokens must be >= 1 (got {max_prompt_tokens})")
    use_template = chat_template and getattr(tokenizer, "chat_template", None)
    out = []
    for p in prompts:
        if use_template:
            ids = chat_prompt_ids(tokenizer, [{"role": "user", "content": p.text}])
        else:
            ids = tokenizer(p.text)["input_ids"]
        ids = list(ids)
        if not ids:
            raise ValueError(f"prompt {p.id!r} encodes to zero tokens")
        if max_prompt_tokens is not None:
            ids = ids[-max_prompt_tokens:]
        out.append([int(t) for t in ids])
    return out
