"""Pre-flight checks: the config against the disk and the machine, run before any model or data loads.

:func:`validate` adds to the config's own checks (:func:`distill.config.check_values`) the data sources and the
local model folders; :func:`check_inputs` the data files (every JSON line parsed, the configured fields present),
the output folders and a precision the device supports; :func:`preflight_source` reads one source the way
training will. Each raises :class:`~distill.config.SetupError` naming the setting (or the file, line and field)
and the fix.
"""
from __future__ import annotations

import codecs
import contextlib
import gzip
import json
import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from decode import outputs
from decode.gguf import find_gguf
from decode.loading import looks_local, shown_path
from decode.prompts import GZIP_ERRORS
from distill.checkpoint import LATEST_FILE, run_folder_hint
from distill.config import (ARCH_KEYS, AT_LEAST, CHOICES, SetupError, check_choice, check_values, eval_prompts_source,
                            typed_config)
from distill.corpus import CORPORA, check_corpus
from distill.data import BUILDERS, field_text, load_rows, not_text, resolve_path, source_kind, suffix_of
from distill.precision import accelerator_precision
from distill.target_data import check_target_data_dir


# ------------------------------------------------------------------------------------------------ the config

def validate(cfg: DictConfig, model_paths: bool = True) -> None:
    """Every check that needs no model, data or run: unknown keys, ranges, allowed values
    (:func:`distill.config.check_values`), the data sources named, target and draft given (and, with
    ``model_paths``, that their local folders exist: off for a pipeline that makes them later).

    Raises:
        SetupError: the first problem, naming the key, the allowed values and the fix.
    """
    check_values(cfg)
    _check_sources(cfg)
    if model_paths:
        _check_models(cfg)


def normalize_config(cfg: DictConfig) -> DictConfig:
    """Validate ``cfg`` (see :func:`validate`) and return a resolved, untyped copy for the recipe.

    Raises:
        SetupError: a key is unknown, missing, out of range or not one of its allowed values.
    """
    typed = typed_config(cfg)
    validate(typed)
    return OmegaConf.create(OmegaConf.to_container(typed, resolve=True))


def _check_sources(cfg: DictConfig) -> None:
    ev = eval_prompts_source(cfg)
    sources = [("data.source", cfg.data.source)] + ([("eval.prompts", ev)] if ev is not None else [])
    for key, src in sources:
        if src.path and src.corpus:
            raise SetupError(f"{key} names both a corpus ({src.corpus!r}) and a file ({src.path!r}); keep one: "
                             f"{key}.corpus=null to use the file (an experiment may have set the corpus), or "
                             f"{key}.path=null to use the corpus")
        if not src.path and not src.corpus:
            raise SetupError(f"{key} has no data: set {key}.path=FILE (jsonl/json/parquet/csv/txt) or "
                             f"{key}.corpus=NAME ({', '.join(CORPORA)})")
        if src.corpus:
            check_choice(f"{key}.corpus", src.corpus, tuple(CORPORA))
        for sub in ("kind", "sample_by", "split"):
            check_choice(f"{key}.{sub}", src[sub], CHOICES[f"data.source.{sub}"])
        for sub in ("limit", "prompt_tokens", "completion_tokens", "windows_per_doc"):  # data.source's: AT_LEAST
            value = src.get(sub)
            if key != "data.source" and value is not None and value < AT_LEAST[f"data.source.{sub}"]:
                raise SetupError(f"{key}.{sub}={value} must be an integer >= {AT_LEAST[f'data.source.{sub}']} "
                                 f"(null: no limit), e.g. {key}.{sub}=32")


def _check_model_dir(role: str, name: str, fix: str, tokenizer_only: bool = False) -> None:
    """A local model path must be a folder holding a ``config.json`` (what ``from_pretrained`` reads), a distill
    checkpoint (``trainer_state.json``, e.g. ``<run>/best``), a peft adapter (``adapter_config.json``) or a GGUF
    file (``*.gguf``, or a folder of one: :func:`decode.gguf.find_gguf`); with ``tokenizer_only`` (a target in cached
    mode, which is never loaded) a tokenizer's files are enough."""
    if not looks_local(name):
        return
    try:
        if find_gguf(name, f"{role} path") is not None:
            return
    except FileNotFoundError as err:  # not a GGUF file, or a folder of several
        raise SetupError(f"{err} (fix {fix})") from err
    path = Path(name).expanduser()
    if not path.exists():
        raise SetupError(f"{role} path {shown_path(name)} does not exist; fix {fix}")
    if not path.is_dir():
        pointed = path.read_text(errors="replace").strip() if path.name == LATEST_FILE else ""
        if pointed:  # a run's pointer file: name the checkpoint it points to
            raise SetupError(f"{role} path {name!r} is the run's pointer to its newest checkpoint, not a folder; "
                             f"give that checkpoint: {path.parent / Path(pointed).name} (fix {fix})")
        raise SetupError(f"{role} path {name!r} is a file, not a checkpoint folder; fix {fix} (the folder "
                         "save_pretrained wrote)")
    wanted = ("config.json", "trainer_state.json", "adapter_config.json")
    if tokenizer_only:
        wanted += ("tokenizer_config.json", "tokenizer.json")
    if not any((path / f).is_file() for f in wanted):
        hint = run_folder_hint(path)
        if hint is not None:
            raise SetupError(f"{role} path: {hint}; fix {fix}")
        raise SetupError(f"{role} path {name!r} has no config.json, so it is not a checkpoint folder written by "
                         f"save_pretrained (nor a distill checkpoint); fix {fix}")


def _check_models(cfg: DictConfig) -> None:
    name = cfg.target.name_or_path
    if not name:
        raise SetupError("no target given: pass +target=NAME (conf/target/NAME.yaml) or "
                         "+target.name_or_path=/path/or/hub-id")
    cached = str(cfg.data.get("target_logits") or "online") == "cached"  # the target gives its tokenizer only
    _check_model_dir("target", str(name), "+target.name_or_path=/path/to/checkpoint", tokenizer_only=cached)
    draft = cfg.draft
    if draft.get("name_or_path"):
        _check_model_dir("draft", str(draft.name_or_path), "draft.name_or_path=/path")
    elif all(draft.get(k) is None for k in ARCH_KEYS):
        raise SetupError("no draft: set draft.name_or_path=/path/or/hub-id, or build one from the target's config "
                         "with draft.num_hidden_layers=N (or draft=small)")


# ------------------------------------------------------------------------------------------------ inputs on disk

def check_output_file(path: str | os.PathLike, key: str, overwrite: bool = False) -> Path:
    """A results file the command will write at the end (``--out``): its folder must exist and be writable, and an
    existing file is kept unless ``overwrite``. Checked at start, so a finished run never fails on its last line.

    Raises:
        SetupError: naming ``key`` and the fix.
    """
    try:
        return outputs.check_output_file(path, key, overwrite)
    except ValueError as err:
        raise SetupError(str(err)) from err


def check_output_dir(path: str | os.PathLike, key: str) -> Path:
    """:func:`decode.outputs.check_output_dir` (not a file, nor under one; its nearest existing parent writable)
    with the problem as a SetupError. (Whether an existing non-empty folder may be reused is the run folder's own
    rule.)"""
    try:
        return outputs.check_output_dir(path, key)
    except ValueError as err:
        raise SetupError(str(err)) from err


def check_inputs(cfg: DictConfig, *, training: bool = True, generating: bool = False,
                 evaluating: bool = False) -> None:
    """Checks against the disk and the machine, run at start before any model loads: the data files (exist, not
    empty, every JSON line parses, the configured fields are present and not null), the output folder, and a
    precision the device supports. ``generating`` (``generate-data``, which writes the target-data cache whatever
    ``data.completions`` says): the cache folder is checked too. ``evaluating`` (``eval``): ``data.source`` only
    when the prompts come from it (``eval.prompts`` names no file or corpus).

    Raises:
        SetupError: naming the setting (or the file, line and field) and the fix.
    """
    if not evaluating or eval_prompts_source(cfg) is None:
        preflight_source(cfg.data.source, "data.source", cfg.data)
    if eval_prompts_source(cfg) is not None:
        preflight_source(OmegaConf.merge({"completion_field": None}, cfg.eval.prompts), "eval.prompts", cfg.data)
    if generating or cfg.data.get("completions") in ("target", "both"):  # the KD cache is written into this folder
        path = cfg.data.target_generated.get("path")
        if path:
            check_output_dir(path, "data.target_generated.path")
        check_target_data_dir(path or Path(cfg.train.output_dir) / "target_data")
    if training:
        check_output_dir(cfg.train.output_dir, "train.output_dir")
        accelerator_precision(cfg.train)  # fp16 on a CPU is refused here, before any model loads
        if str(cfg.draft.get("dtype")) in ("fp16", "float16"):
            raise SetupError("draft.dtype=fp16 trains fp16 master weights, whose updates overflow and underflow (the "
                             "loss goes to NaN within steps); keep draft.dtype=null (float32 weights) and set "
                             "train.mixed_precision=bf16, or fp16 on a GPU, for half-precision compute")


# ------------------------------------------------------------------------------------------------ a data source

def preflight_source(src: Any, key: str, data_cfg: Any = None) -> None:
    """Check a source on disk before any model loads (the tokenizer is not needed): the file exists, is not
    empty, has a known format; for JSON files every line parses, and every row used (``limit``) has the configured
    prompt/completion (or text) field, not null. A corpus (its name was checked by the config): the file it reads
    from the shared data folder exists.

    Raises:
        SetupError: naming ``key`` (``data.source`` or ``eval.prompts``), the file, the line and the field.
    """
    if src.get("corpus"):
        try:
            check_corpus(src.corpus)
        except FileNotFoundError as err:
            raise SetupError(f"{key}.corpus={src.corpus}: {err}") from None
        return
    if not src.get("path"):
        return
    path = resolve_path(src.path)
    builder = _source_builder(src, path, key)
    if builder in ("text", "csv"):  # the datasets builders fail on other encodings without naming the cause
        _check_utf8(path, key)
    if builder == "text":
        return
    if source_kind(src) == "text":
        fields = [src.get("text_field") or "text"]
    else:
        fields = [src.get("prompt_field") or "prompt"] + ([src.completion_field] if src.get("completion_field") else [])
    if builder == "json":
        rows = ((f"{path}:{n}", f"line {n}", row) for n, row in _json_rows(path, key))
    else:  # parquet, csv: read as training will (datasets' builder; a csv's empty cell is null)
        rows = ((f"{path}, row {n}", f"row {n}", row) for n, row in enumerate(load_rows(src), 1))
    limit, n = src.get("limit"), 0
    for at, line, row in rows:
        _check_row(src, key, fields, at, line, row)
        n += 1
        if limit and n >= int(limit):
            break
    if n == 0:
        raise SetupError(f"{key}.path: data file {path} has no rows; point {key}.path at a file with rows")


def _source_builder(src: Any, path: Path, key: str) -> str:
    """The ``datasets`` builder of a source's file, which must exist, be a file, have a known format and not be
    empty."""
    if not path.exists():
        raise SetupError(f"{key}.path: data file {path} does not exist (from {key}.path={src.path!r}); fix the "
                         "path, or set DRAFTKIT_SHARED_DATA to the shared data folder")
    if path.is_dir():
        raise SetupError(f"{key}.path={src.path!r} is a folder; give a file ({', '.join(sorted(BUILDERS))})")
    builder = BUILDERS.get(suffix_of(path))
    if builder is None:
        raise SetupError(f"{key}.path: data file {path}: unknown format {suffix_of(path)!r}; use one of "
                         f"{sorted(BUILDERS)}")
    if path.stat().st_size == 0:
        raise SetupError(f"{key}.path: data file {path} is empty; point {key}.path at a file with rows")
    return builder


def _check_row(src: Any, key: str, fields: list[str], at: str, line: str, row: Any) -> None:
    """One row of a source: an object whose configured ``fields`` hold text (``at``/``line`` say where it is)."""
    if not isinstance(row, dict):
        raise SetupError(f"{at}: a row must be a JSON object with the field(s) {fields}, "
                         f"not {type(row).__name__}")
    for f in fields:
        which = "prompt_field" if f == fields[0] else "completion_field"
        if source_kind(src) == "text":
            which = "text_field"
        if f not in row:
            raise SetupError(f"{at}: field {f!r} not found (fields: {sorted(row)}); set "
                             f"{key}.{which} to one of them")
        if row[f] is None:
            raise SetupError(f"{at}: \"{f}\" is null; every row needs a text in {f!r} "
                             f"({key}.{which}): fix or delete {line}")
        if field_text(row[f]) is None:
            raise SetupError(f"{at}: \"{f}\" {not_text(row[f])}; every row needs a string in "
                             f"{f!r} ({key}.{which}): fix or delete {line}")


def _utf8_text(path: Path, key: str) -> str:
    """The file's text (gunzipped for .gz). Raises SetupError naming the line of the first byte that is not UTF-8."""
    with _gzip_errors(path, key), (gzip.open if path.suffix == ".gz" else open)(path, "rb") as f:
        raw = f.read()
    try:
        return raw.decode("utf-8-sig")  # a leading byte-order mark (Windows tools write one) is not text
    except UnicodeDecodeError as e:
        raise _not_utf8(path, key, raw.count(b"\n", 0, e.start) + 1, raw[e.start], e.start) from e


@contextlib.contextmanager
def _gzip_errors(path: Path, key: str):
    """A .gz that is not a whole gzip file (plain text named .gz, a truncated download) as a SetupError."""
    try:
        yield
    except GZIP_ERRORS as e:
        raise SetupError(f"{path}: not a whole gzip file ({e}); {key}.path: check it with gzip -t, or give it "
                         "uncompressed") from None


def _not_utf8(path: Path, key: str, lineno: int, byte: int, offset: int) -> SetupError:
    return SetupError(f"{path}:{lineno}: not UTF-8 text (byte {byte:#04x} at offset {offset}); {key}.path must be "
                      f"UTF-8: re-encode the file (e.g. iconv -f latin1 -t utf-8) or fix line {lineno}")


def _check_utf8(path: Path, key: str, chunk: int = 1 << 20) -> None:
    """:func:`_utf8_text`'s check without holding the file in memory (a large text or csv corpus)."""
    decoder, offset, lines = codecs.getincrementaldecoder("utf-8")(), 0, 0
    with _gzip_errors(path, key), (gzip.open if path.suffix == ".gz" else open)(path, "rb") as f:
        while True:
            raw = f.read(chunk)
            try:
                decoder.decode(raw, final=not raw)
            except UnicodeDecodeError as e:  # e.start counts from the bytes the decoder still held, then raw
                held = len(e.object) - len(raw)
                at = max(e.start - held, 0)
                raise _not_utf8(path, key, lines + raw.count(b"\n", 0, at) + 1, e.object[e.start],
                                offset + e.start - held) from e
            if not raw:
                return
            offset, lines = offset + len(raw), lines + raw.count(b"\n")


def _json_rows(path: Path, key: str):
    """``(line_number, row)`` of a JSON-lines file (or a .json array), each row a JSON object.

    Raises SetupError naming the file, the line and the fix for a line that does not parse or is not an object.
    """
    text = _utf8_text(path, key)
    if suffix_of(path) == ".json" and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise SetupError(f"{path}:{e.lineno}: not valid JSON ({e.msg}); fix the file given as {key}.path") from e
        yield from ((i + 1, r) for i, r in enumerate(rows))
        return
    # split on newlines only: str.splitlines also splits at U+2028/U+2029/U+0085/form feed, which JSON strings
    # may hold unescaped (json.dumps(..., ensure_ascii=False) writes them so)
    for lineno, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise SetupError(f"{path}:{lineno}: not valid JSON ({e.msg}, column {e.colno}); every line of "
                             f"{key}.path must be one JSON object: fix or delete line {lineno}") from e
        yield lineno, row
