"""Data: sources -> tokenized (prompt, completion) examples -> padded training batches; target-generated cache.

A source (``data.source``, or ``eval.prompts``) is one of

- a local file through ``datasets``: ``.jsonl``/``.jsonl.gz``/``.json`` (json builder), ``.parquet``, ``.txt``
  (text builder, ``sample_by`` line/paragraph/document). Paths starting with ``../shared/data/`` resolve against
  :func:`decode.prompts.shared_data_dir` (``$DRAFTKIT_SHARED_DATA``, else ``<repo>/../shared/data``); other
  relative paths against the working directory.
- a text corpus by name (``corpus: stdlib``), loaded with ``distill.corpus.load_corpus(name, split)``.

``kind: prompts`` rows give a prompt (``prompt_field``) and optionally a fixed completion (``completion_field``);
the chat template is applied to prompts when the tokenizer has one. ``kind: text`` rows are documents
(``text_field``), cut into consecutive windows of ``prompt_tokens`` prefix + ``completion_tokens`` continuation:
that is how a corpus without prompt/completion split becomes distillation data.

Every example is ``{"prompt_ids": list[int], "completion_ids": list[int]}`` (completion possibly empty).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
from pathlib import Path
from typing import Any

import torch

from distill.models import SetupError

SHARED_PREFIX = "../shared/data/"
BUILDERS = {".jsonl": "json", ".json": "json", ".gz": "json", ".parquet": "parquet", ".txt": "text",
            ".csv": "csv"}


def resolve_path(path: str) -> Path:
    """A data path: ``../shared/data/...`` lives in :func:`decode.prompts.shared_data_dir` (the one resolver of
    the shared data folder, honouring ``$DRAFTKIT_SHARED_DATA``); other paths are taken as given."""
    from decode.prompts import shared_data_dir

    p = str(path)
    if p.startswith(SHARED_PREFIX):
        return shared_data_dir() / p[len(SHARED_PREFIX):]
    return Path(p).expanduser()


def load_rows(src: Any) -> Any:
    """The raw ``datasets.Dataset`` of a source config (``path`` or ``corpus``), limited to ``src.limit`` rows.

    Raises SetupError for a missing file, unknown suffix, missing corpus module, or no rows.
    """
    import datasets

    if src.get("corpus") and src.get("path"):
        raise SetupError(f"the data source names both a corpus ({src.corpus!r}) and a file ({src.path!r}); keep one: "
                         "data.source.corpus=null to use the file (an experiment may have set the corpus), or "
                         "data.source.path=null to use the corpus")
    if src.get("corpus"):
        try:
            from distill.corpus import load_corpus
        except ImportError as e:
            raise SetupError(f"data corpus {src.corpus!r} needs distill/corpus.py (load_corpus), which is not "
                             f"installed here ({e}); use data.source.path=FILE instead") from e
        ds = load_corpus(src.corpus, src.get("split") or "train", **dict(src.get("corpus_kwargs") or {}))
        where = f"corpus {src.corpus!r}"
    elif src.get("path"):
        path = resolve_path(src.path)
        if not path.exists():
            raise SetupError(f"data file {path} does not exist (from path={src.path!r}); fix the path, or set "
                             "DRAFTKIT_SHARED_DATA to the shared data folder")
        suffix = _suffix(path)
        builder = BUILDERS.get(suffix)
        if builder is None:
            raise SetupError(f"data file {path}: unknown format {suffix!r}; use one of {sorted(BUILDERS)}")
        if path.stat().st_size == 0:
            raise SetupError(f"data file {path} is empty; point the source at a file with rows")
        kw = {"sample_by": src.get("sample_by") or "paragraph"} if builder == "text" else {}
        if builder == "csv":  # cells are text as written: no "0070" -> 70, no "None"/"NA" -> null (only empty is)
            import csv

            with open(path, newline="", encoding="utf-8-sig") as f:
                header = next(csv.reader(f), [])
            kw = {"features": datasets.Features({name: datasets.Value("string") for name in header}),
                  "keep_default_na": False, "na_values": [""]}
        try:
            ds = datasets.load_dataset(builder, data_files=str(path), split="train", **kw)
        except Exception as e:  # datasets raises many types (ArrowInvalid, DatasetGenerationError, ...)
            if _no_table_rows(path, builder):  # the builders fail on a header or schema without rows, vaguely
                raise SetupError(f"data file {path} has a {'header' if builder == 'csv' else 'schema'} but no rows; "
                                 "point the source at a file with rows") from None
            raise SetupError(f"cannot read {path} with the datasets '{builder}' builder ({type(e).__name__}: {e}); "
                             "check the file's format") from e
        where = str(path)
    else:
        raise SetupError("no data source: set data.source.path=FILE (jsonl/json/parquet/txt) or "
                         "data.source.corpus=NAME")
    if src.get("limit"):
        ds = ds.select(range(min(int(src.limit), len(ds))))
    if len(ds) == 0:
        raise SetupError(f"data source {where} is empty; point data.source at a file with rows")
    return ds


def _no_table_rows(path: Path, builder: str) -> bool:
    """True for a parquet file whose metadata counts 0 rows, or a csv file with at most its header line; False for
    anything else, also a file that cannot be read this way (the caller's error then names the builder's)."""
    try:
        if builder == "parquet":
            import pyarrow.parquet as pq

            return pq.read_metadata(path).num_rows == 0
        if builder == "csv":
            import csv
            from itertools import islice

            with open(path, newline="", encoding="utf-8-sig") as f:
                return len(list(islice(csv.reader(f), 2))) < 2
    except Exception:
        return False
    return False


def _suffix(path: Path) -> str:
    return path.suffixes[-2] if path.suffix == ".gz" and len(path.suffixes) > 1 else path.suffix


def _utf8_text(path: Path, key: str) -> str:
    """The file's text (gunzipped for .gz). Raises SetupError naming the line of the first byte that is not UTF-8."""
    import gzip

    with _gzip_errors(path, key), (gzip.open if path.suffix == ".gz" else open)(path, "rb") as f:
        raw = f.read()
    try:
        return raw.decode("utf-8-sig")  # a leading byte-order mark (Windows tools write one) is not text
    except UnicodeDecodeError as e:
        raise _not_utf8(path, key, raw.count(b"\n", 0, e.start) + 1, raw[e.start], e.start) from e


@contextlib.contextmanager
def _gzip_errors(path: Path, key: str):
    """A .gz that is not a whole gzip file (plain text named .gz, a truncated download) as a SetupError."""
    from decode.prompts import GZIP_ERRORS

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
    import codecs
    import gzip

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
    if _suffix(path) == ".json" and text.lstrip().startswith("["):
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


def preflight_source(src: Any, key: str, data_cfg: Any = None) -> None:
    """Check a source on disk before any model loads (the tokenizer is not needed): the file exists, is not
    empty, has a known format; for JSON files every line parses, and every row used (``limit``) has the configured
    prompt/completion (or text) field, not null. A corpus (its name was checked by the config): the file it reads
    from the shared data folder exists.

    Raises:
        SetupError: naming ``key`` (``data.source`` or ``eval.prompts``), the file, the line and the field.
    """
    if src.get("corpus"):
        from distill.corpus import check_corpus

        try:
            check_corpus(src.corpus)
        except FileNotFoundError as err:
            raise SetupError(f"{key}.corpus={src.corpus}: {err}") from None
        return
    if not src.get("path"):
        return
    path = resolve_path(src.path)
    if not path.exists():
        raise SetupError(f"{key}.path: data file {path} does not exist (from {key}.path={src.path!r}); fix the "
                         "path, or set DRAFTKIT_SHARED_DATA to the shared data folder")
    if path.is_dir():
        raise SetupError(f"{key}.path={src.path!r} is a folder; give a file ({', '.join(sorted(BUILDERS))})")
    builder = BUILDERS.get(_suffix(path))
    if builder is None:
        raise SetupError(f"{key}.path: data file {path}: unknown format {_suffix(path)!r}; use one of "
                         f"{sorted(BUILDERS)}")
    if path.stat().st_size == 0:
        raise SetupError(f"{key}.path: data file {path} is empty; point {key}.path at a file with rows")
    if builder in ("text", "csv"):  # the datasets builders fail on other encodings without naming the cause
        _check_utf8(path, key)
    if builder == "text":
        return
    if _source_kind(src) == "text":
        fields = [src.get("text_field") or "text"]
    else:
        fields = [src.get("prompt_field") or "prompt"] + ([src.completion_field] if src.get("completion_field") else [])
    if builder == "json":
        rows = ((f"{path}:{n}", f"line {n}", row) for n, row in _json_rows(path, key))
    else:  # parquet, csv: read as training will (datasets' builder; a csv's empty cell is null)
        rows = ((f"{path}, row {n}", f"row {n}", row) for n, row in enumerate(load_rows(src), 1))
    limit, n = src.get("limit"), 0
    for at, line, row in rows:
        if not isinstance(row, dict):
            raise SetupError(f"{at}: a row must be a JSON object with the field(s) {fields}, "
                             f"not {type(row).__name__}")
        for f in fields:
            which = "prompt_field" if f == fields[0] else "completion_field"
            if _source_kind(src) == "text":
                which = "text_field"
            if f not in row:
                raise SetupError(f"{at}: field {f!r} not found (fields: {sorted(row)}); set "
                                 f"{key}.{which} to one of them")
            if row[f] is None:
                raise SetupError(f"{at}: \"{f}\" is null; every row needs a text in {f!r} "
                                 f"({key}.{which}): fix or delete {line}")
            if field_text(row[f]) is None:
                raise SetupError(f"{at}: \"{f}\" {_not_text(row[f])}; every row needs a string in "
                                 f"{f!r} ({key}.{which}): fix or delete {line}")
        n += 1
        if limit and n >= int(limit):
            break
    if n == 0:
        raise SetupError(f"{key}.path: data file {path} has no rows; point {key}.path at a file with rows")


def field_text(value: Any) -> str | None:
    """The text a row's field holds: a string, a number's digits (a csv column of numbers is read as numbers), or
    the first of a list of strings (multi-turn sets such as MT-Bench's "turns" give their first turn). None for
    anything else (an object, a bool, a chat ``messages`` list of role/content objects): such a field is not text,
    and its Python repr must not be trained on."""
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        value = value[0]
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return str(value)
    return value if isinstance(value, str) else None


def _not_text(value: Any) -> str:
    """Why a field is not text, and the fix (for :func:`field_text`'s None)."""
    what = f"a list of {type(value[0]).__name__}" if isinstance(value, list) and value else type(value).__name__
    if isinstance(value, float) and not math.isfinite(value):  # JSON's NaN, a parquet float column's missing value
        what = f"{value} (a missing number)"
    hint = (" (a chat messages list? give the user turn's text as its own field)"
            if isinstance(value, list) and value and isinstance(value[0], dict) else "")
    return f"holds {what}, not text{hint}"


def _field(row: dict, field: str, where: str, index: int | None = None) -> str:
    at = f"{where}, row {index + 1}" if index is not None else where
    if field not in row:
        raise SetupError(f"{at}: field {field!r} not found (fields: {sorted(row)}); set the *_field key to one "
                         "of them")
    value = row[field]
    if value is None:
        raise SetupError(f"{at}: field {field!r} is null; give every row a text there, or drop the row")
    text = field_text(value)
    if text is None:
        raise SetupError(f"{at}: field {field!r} {_not_text(value)}; give every row a string there")
    return text


def encode_prompt(tokenizer: Any, text: str, chat_template: bool) -> list[int]:
    """Token ids of a prompt: the tokenizer's chat template (one user turn + generation prompt) when it has one."""
    if chat_template and getattr(tokenizer, "chat_template", None):
        from decode.loading import chat_prompt_ids

        return chat_prompt_ids(tokenizer, [{"role": "user", "content": text}])
    return [int(t) for t in tokenizer(text)["input_ids"]]


def _source_kind(src: Any) -> str:
    kind = src.get("kind") or "auto"
    if kind == "auto":
        is_txt = bool(src.get("path")) and str(src.path).endswith(".txt")
        return "text" if src.get("corpus") or is_txt else "prompts"
    if kind not in ("prompts", "text"):
        raise SetupError(f"data source kind {kind!r}: use auto, prompts or text")
    return kind


def build_examples(src: Any, tokenizer: Any, data_cfg: Any) -> list[dict[str, list[int]]]:
    """Tokenized examples of a source (see module doc). Completions are cut to ``data.max_new_tokens``.

    Raises SetupError if no example results (empty source, documents shorter than one window), or a prompt has no
    tokens (an empty prompt field with a tokenizer that adds no bos token).
    """
    rows = load_rows(src)
    where = src.get("path") or f"corpus {src.get('corpus')}"
    max_new = int(data_cfg.max_new_tokens)
    out = []
    if _source_kind(src) == "text":
        p_len, c_len = int(src.get("prompt_tokens") or 32), int(src.get("completion_tokens") or max_new)
        per_doc = src.get("windows_per_doc")
        text_field = src.get("text_field") or "text"
        bos = [tokenizer.bos_token_id] if src.get("add_bos", True) and tokenizer.bos_token_id is not None else []
        for i, row in enumerate(rows):
            ids = tokenizer(_field(row, text_field, where, i), add_special_tokens=False)["input_ids"]
            n_win = len(ids) // (p_len + c_len)
            for w in range(n_win if per_doc is None else min(n_win, int(per_doc))):
                chunk = ids[w * (p_len + c_len):(w + 1) * (p_len + c_len)]
                out.append({"prompt_ids": bos + chunk[:p_len], "completion_ids": chunk[p_len:][:max_new]})
        if not out:
            raise SetupError(f"{where}: no document has {p_len + c_len} tokens (prompt_tokens + completion_tokens);"
                             " lower data.source.prompt_tokens / completion_tokens")
        return out
    prompt_field, completion_field = src.get("prompt_field") or "prompt", src.get("completion_field")
    eos = [tokenizer.eos_token_id] if data_cfg.get("append_eos", True) and tokenizer.eos_token_id is not None else []
    for i, row in enumerate(rows):
        prompt = encode_prompt(tokenizer, _field(row, prompt_field, where, i), bool(data_cfg.get("chat_template", True)))
        completion = []
        if completion_field:
            completion = tokenizer(_field(row, completion_field, where, i), add_special_tokens=False)["input_ids"]
            completion = (list(completion) + eos)[:max_new]
        out.append({"prompt_ids": prompt, "completion_ids": completion})
    empty = [i + 1 for i, e in enumerate(out) if not e["prompt_ids"]]
    if empty:  # the first completion token would have nothing to be predicted from (the row trained nothing)
        raise SetupError(f"{where}: {len(empty)} of {len(out)} prompts have no tokens (rows "
                         f"{', '.join(map(str, empty[:5]))}{', ...' if len(empty) > 5 else ''}: an empty prompt, and "
                         "the tokenizer adds no bos token); give every row a prompt, e.g. move the completion's first "
                         "words into it, or use text data (kind: text)")
    return out


def check_lengths(examples: list[dict], context: int | None, data_cfg: Any, what: str = "data.source",
                  max_new_key: str = "data.max_new_tokens") -> list[dict]:
    """Enforce ``len(prompt) + max_new_tokens <= context`` and ``data.max_prompt_tokens``. ``max_new_key`` names the
    setting ``data_cfg.max_new_tokens`` came from.

    Long prompts are left-truncated when ``data.truncate_prompts`` is true; otherwise SetupError names the fix.
    """
    max_new = int(data_cfg.max_new_tokens)
    limit = int(data_cfg.max_prompt_tokens) if data_cfg.get("max_prompt_tokens") else None
    if context is not None:
        if max_new >= context:
            raise SetupError(f"{max_new_key}={max_new} leaves no room for a prompt in the models' context of "
                             f"{context} positions; lower {max_new_key}")
        limit = min(limit, context - max_new) if limit else context - max_new
    if limit is None:
        return examples
    too_long = [i for i, e in enumerate(examples) if len(e["prompt_ids"]) > limit]
    if too_long and not data_cfg.get("truncate_prompts", False):
        longest = max(len(examples[i]["prompt_ids"]) for i in too_long)
        raise SetupError(
            f"{len(too_long)} of {len(examples)} prompts in {what} are longer than {limit} tokens (longest "
            f"{longest}; context {context}, {max_new_key}={max_new}, data.max_prompt_tokens="
            f"{data_cfg.get('max_prompt_tokens')}). Set data.truncate_prompts=true to keep their last {limit} "
            f"tokens, or lower {max_new_key}")
    return [dict(e, prompt_ids=e["prompt_ids"][-limit:]) for e in examples]


def epoch_order(n: int, epoch: int, seed: int, shuffle: bool = True) -> list[int]:
    """The example order of one epoch, a pure function of (n, epoch, seed): resume needs no saved iterator."""
    if not shuffle:
        return list(range(n))
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return torch.randperm(n, generator=g).tolist()


def micro_batch_indices(n: int, micro_step: int, batch_size: int, seed: int, shuffle: bool = True) -> list[int]:
    """Example indices of global micro-batch ``micro_step`` (epochs wrap around with a fresh order)."""
    out = []
    for k in range(micro_step * batch_size, (micro_step + 1) * batch_size):
        epoch, pos = divmod(k, n)
        out.append(epoch_order(n, epoch, seed, shuffle)[pos])
    return out


def collate_prompts(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded (B, P) input_ids and attention_mask, as the decoder and rollouts take them."""
    from decode.batch import left_pad

    return left_pad(prompts, pad_id)


def collate_sequences(examples: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded training batch of prompt + completion.

    Returns input_ids, attention_mask (B, L); labels (B, L) = next token (pad at the end); loss_mask (B, L) = 1 at
    positions whose next token is a completion token, so prompt and padding contribute nothing to the loss.
    """
    width = max(len(e["prompt_ids"]) + len(e["completion_ids"]) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    att = torch.zeros_like(ids)
    loss_mask = torch.zeros_like(ids)
    for i, e in enumerate(examples):
        seq = list(e["prompt_ids"]) + list(e["completion_ids"])
        ids[i, :len(seq)] = torch.tensor(seq, dtype=torch.long)
        att[i, :len(seq)] = 1
        p = len(e["prompt_ids"])
        loss_mask[i, p - 1:len(seq) - 1] = 1
    labels = torch.cat([ids[:, 1:], torch.full((len(examples), 1), pad_id, dtype=torch.long)], dim=1)
    return {"input_ids": ids, "attention_mask": att, "labels": labels, "loss_mask": loss_mask}



def kept_positions(loss_mask: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Where the loss is computed, found on the host (no device sync): ``(columns, flat_index)``.

    ``columns`` (C,) are the sequence positions where any row has a completion token (None when that is all L
    of them), to pass as ``logits_to_keep`` so the lm_head runs on C positions instead of L; ``flat_index`` (N,)
    picks the kept positions out of the (B·C) rows, row by row, in the order of ``loss_mask`` (B, L).
    """
    keep = loss_mask.bool()
    cols = keep.any(0).nonzero().squeeze(1)
    if len(cols) == keep.shape[1]:
        return None, keep.flatten().nonzero().squeeze(1)
    return cols, keep[:, cols].flatten().nonzero().squeeze(1)


def accepts_logits_to_keep(model: Any) -> bool:
    """True when the (unwrapped: DDP/FSDP/DeepSpeed ``.module``, peft base) model's forward takes logits_to_keep."""
    import inspect

    for _ in range(4):
        model = getattr(model, "module", model)
        if hasattr(model, "get_base_model"):
            model = model.get_base_model()
    return "logits_to_keep" in inspect.signature(model.forward).parameters


def forward_kept_logits(model: Any, batch: dict[str, torch.Tensor], where: tuple | None = None,
                        logits_to_keep: bool | None = None) -> torch.Tensor:
    """``(N, V')`` logits of ``model`` at the N kept positions of ``batch`` (:func:`collate_sequences`), row by row.

    ``where`` is :func:`kept_positions` of ``batch["loss_mask"]`` (computed when None). The lm_head runs on the C
    columns holding a completion token instead of all L (``logits_to_keep``, which Hugging Face causal LMs take;
    ``logits_to_keep=None`` checks the model's signature), which also shrinks the (B, L, V) logits: for a target
    whose lm_head is a large share of its weights (a 150k vocabulary), that is most of a prompt position's work.
    """
    cols, flat = where if where is not None else kept_positions(batch["loss_mask"])
    device = batch["input_ids"].device
    if logits_to_keep is None:
        logits_to_keep = accepts_logits_to_keep(model)
    kw = {"logits_to_keep": cols.to(device)} if cols is not None and logits_to_keep else {}
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **kw).logits
    if not kw and cols is not None:
        logits = logits[:, cols.to(logits.device)]
    return logits.flatten(0, 1).index_select(0, flat.to(logits.device))



def completion_logits(model: Any, examples: list[dict], pad_id: int, logits_to_keep: bool | None = None
                      ) -> torch.Tensor:
    """``(N, V')`` logits of ``model`` at the N completion positions of ``examples`` (:func:`collate_sequences`),
    row by row: the positions are found on the host (no device sync) and only ids and attention mask move to the
    model's device; :func:`forward_kept_logits` does the rest (``logits_to_keep`` as there)."""
    host = collate_sequences(examples, pad_id)
    device = next(model.parameters()).device
    batch = {key: host[key].to(device) for key in ("input_ids", "attention_mask")}
    return forward_kept_logits(model, batch, kept_positions(host["loss_mask"]), logits_to_keep)

# ---- target-generated completions (sequence-level KD), cached with `datasets` ------------------------------------

# What sets each field of a target-data cache's settings (meta.json), named when a cache was made with other ones.
TARGET_DATA_FIELDS = {
    "target": "+target.name_or_path",
    "target_hash": "+target.name_or_path (its weights or config changed)",
    "target_dtype": "target.dtype",
    "num_prompts": "data.* (the prompts: source, limit, prompt_tokens, holdout, ...)",
    "prompts_hash": "data.* (the prompts: source, limit, prompt_tokens, holdout, ...)",
    "max_new_tokens": "data.max_new_tokens",
    "temperature": "data.target_generated.temperature",
    "seed": "train.seed",
    "shard_size": "data.target_generated.shard_size",
}


def target_data_settings(target_name: str, target_dtype: str, examples: list[dict], gen_cfg: dict) -> dict:
    """The settings a target-data cache is made with (the keys of :data:`TARGET_DATA_FIELDS`), stored in its
    ``meta.json`` so that a changed one is named: the target by its path (a local one resolved, so relative and
    absolute spellings agree) and, for a local folder or a cached hub snapshot, by its config and weight files
    (:func:`distill.logit_cache.target_fingerprint`: a target retrained or replaced at the same path would otherwise
    reuse the old one's completions), its load dtype (``"bfloat16"``: greedy completions can differ by dtype), the
    prompts (count and hash of their ids) and ``gen_cfg`` (``max_new_tokens``, ``temperature``, ``seed``,
    ``shard_size``: each shard's sampling generator is seeded from its index, so the shard size shapes sampled data).
    """
    from decode.loading import recorded_name
    from distill.logit_cache import target_fingerprint

    name = recorded_name(target_name)
    h = hashlib.sha256()
    for e in examples:
        h.update(json.dumps(e["prompt_ids"]).encode())
    return {"target": name, "target_hash": target_fingerprint(name), "target_dtype": str(target_dtype),
            "num_prompts": len(examples), "prompts_hash": h.hexdigest()[:16], **gen_cfg}


def cache_key(settings: dict) -> str:
    """A short hash of :func:`target_data_settings`: a changed input never reuses a stale cache."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def _settings_diff(cached: Any, settings: dict | None) -> str:
    """What differs between a cache's stored settings and this run's, naming the setting that sets each field."""
    if not isinstance(cached, dict) or settings is None:
        return ("it records no settings (made by a draftkit before 2026-12-05, or damaged), so they cannot be "
                "checked")
    diffs = [f"{k} (cache {cached.get(k)!r}, config {v!r}; set by {TARGET_DATA_FIELDS.get(k, k)})"
             for k, v in settings.items() if cached.get(k) != v]
    return "; ".join(diffs) or "the same settings, another key"


def check_target_data_dir(cache_dir: str | Path) -> None:
    """The sequence-level KD cache folder (``data.target_generated.path``): missing, empty, or a cache of its own
    (``meta.json``). A folder holding anything else (a model, a user's ``save_to_disk`` dataset) is refused before
    anything is written, since the cache saves ``shards/`` and ``dataset/`` into it.

    Raises:
        SetupError: naming the setting, what the folder holds and the fix.
    """
    from distill.checkpoint import name_list, other_entries

    cache_dir = Path(cache_dir).expanduser().resolve()  # (a/missing/.. is a, which exists)
    if not cache_dir.is_dir() or (cache_dir / "meta.json").is_file():
        return
    others = other_entries(cache_dir, ("meta.json.tmp",))  # (a kill before the first meta.json)
    if others:
        raise SetupError(f"data.target_generated.path={str(cache_dir)!r} is a folder that holds other files "
                         f"({name_list(others)}) and no target-data cache (meta.json); nothing was written. "
                         "Give a new or empty folder, or null (<train.output_dir>/target_data)")


def generate_target_data(target: Any, tokenizer: Any, examples: list[dict], cache_dir: str | Path, key: str,
                         temperature: float, max_new_tokens: int, batch_size: int, shard_size: int, seed: int,
                         draft: Any = None, num_draft_tokens: int = 4, progress: Any = None,
                         settings: dict | None = None) -> Any:
    """Generate one target completion per prompt with the decoder and cache it as a ``datasets`` dataset.

    Shards of ``shard_size`` prompts are saved as they finish (``cache_dir/shards/NNNNN``), so an interrupted run
    resumes at the first missing shard. With a ``draft`` the decoder drafts γ tokens per step; its output follows the
    target's distribution exactly (lossless), it is only faster. Each shard's sampling generator is seeded from
    (seed, shard index), so resumed and straight runs give the same data.

    Returns the concatenated ``datasets.Dataset`` (columns prompt_ids, completion_ids); also saved at
    ``cache_dir/dataset`` with ``meta.json`` naming ``key`` (and ``settings``, :func:`target_data_settings`, whose
    fields are named when a cache made for another ``key`` is refused).

    Raises:
        SetupError: the folder holds something else, the cache was made with other settings (each differing one
            named with the setting that sets it), or it is damaged (wrong row count, ids outside the vocabulary).
    """
    import datasets

    cache_dir = Path(cache_dir)
    meta_path = cache_dir / "meta.json"
    check_target_data_dir(cache_dir)
    vocab = max(len(tokenizer), target.get_output_embeddings().weight.shape[0])
    if meta_path.exists():
        try:
            meta = json.loads(meta_path.read_text())
        except (ValueError, UnicodeDecodeError):
            meta = None
        if not isinstance(meta, dict):
            raise SetupError(f"{meta_path} is not a JSON object: the target-data cache is damaged; delete {cache_dir} "
                             "to regenerate it, or set data.target_generated.path elsewhere")
        if meta.get("key") != key:
            recorded = isinstance(meta.get("settings"), dict)  # (without them no config can match it again)
            fix = "Use the settings it was made with, delete it" if recorded else "Delete it"
            raise SetupError(f"target-data cache {cache_dir} was made for other settings (key {meta.get('key')} != "
                             f"{key}): {_settings_diff(meta.get('settings'), settings)}. {fix} to regenerate, or set "
                             "data.target_generated.path elsewhere")
        if meta.get("complete"):
            return _check_target_data(datasets.load_from_disk(str(cache_dir / "dataset")), cache_dir,
                                      len(examples), vocab)
    from distill.checkpoint import replace_text  # meta.json whole or not at all: a cut one reads as a damaged cache

    cache_dir.mkdir(parents=True, exist_ok=True)
    meta = {"key": key, "settings": settings, "num_prompts": len(examples)}
    replace_text(meta_path, json.dumps({**meta, "complete": False}))
    was_training = draft is not None and draft.training
    if was_training:  # the recipe's draft is in train mode: no dropout in the proposals (restored below)
        draft.eval()
    try:
        full = _generate_shards(target, tokenizer, examples, cache_dir, temperature, max_new_tokens, batch_size,
                                shard_size, seed, draft, num_draft_tokens, progress)
    finally:
        if was_training:
            draft.train()
    full = _check_target_data(full, cache_dir, len(examples), vocab)  # (shards of another run: refused, not marked)
    full.save_to_disk(str(cache_dir / "dataset"))
    replace_text(meta_path, json.dumps({**meta, "complete": True}))
    return full


def _check_target_data(ds: Any, cache_dir: Path, num_prompts: int, vocab: int) -> Any:
    """``ds`` if it holds one row per prompt and only token ids in ``[0, vocab)``; raises SetupError naming the
    cache otherwise (an edited or damaged cache would train on fewer examples without a word, or fail mid-step with
    an index error). Vectorized (Arrow)."""
    fix = f"delete {cache_dir} to regenerate it, or set data.target_generated.path elsewhere"
    if len(ds) != num_prompts or not {"prompt_ids", "completion_ids"} <= set(ds.column_names):
        raise SetupError(f"target-data cache {cache_dir} holds {len(ds)} rows with columns {ds.column_names} for "
                         f"{num_prompts} prompts (prompt_ids, completion_ids): it is damaged; {fix}")
    for name in ("prompt_ids", "completion_ids"):
        outside = ids_outside_vocab(ds.data.column(name), vocab)
        if outside is not None:
            raise SetupError(f"target-data cache {cache_dir}: {name!r} holds ids {outside[0]}..{outside[1]}, "
                             f"outside the vocabulary [0, {vocab}); it is damaged or made with another tokenizer; {fix}")
    return ds


def ids_outside_vocab(column: Any, vocab: int) -> tuple[int, int] | None:
    """``(min, max)`` of the token ids in an Arrow list column when any lies outside ``[0, vocab)``, else None (an
    empty column too). One vectorized pass (``pyarrow.compute.min_max``): how the target-data and logit caches check
    that their stored ids fit the vocabulary before training indexes with them."""
    import pyarrow.compute as pc

    bounds = pc.min_max(pc.list_flatten(column)).as_py()
    if bounds["min"] is None or 0 <= bounds["min"] <= bounds["max"] < vocab:
        return None
    return bounds["min"], bounds["max"]


def _generate_shards(target: Any, tokenizer: Any, examples: list[dict], cache_dir: Path, temperature: float,
                     max_new_tokens: int, batch_size: int, shard_size: int, seed: int, draft: Any,
                     num_draft_tokens: int, progress: Any) -> Any:
    """The shards of :func:`generate_target_data` (the missing ones generated and saved), concatenated."""
    import datasets

    from decode import SpeculativeDecoder

    dec = SpeculativeDecoder(target, draft, num_draft_tokens=num_draft_tokens if draft is not None else 0)
    device = next(target.parameters()).device
    n_shards = (len(examples) + shard_size - 1) // shard_size
    shard_dirs = []
    for s in range(n_shards):
        shard_dir = cache_dir / "shards" / f"{s:05d}"
        shard_dirs.append(shard_dir)
        if (shard_dir / "dataset_info.json").exists():
            continue
        rows = examples[s * shard_size:(s + 1) * shard_size]
        gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + s)
        completions = []
        for b in range(0, len(rows), batch_size):
            ids, att = collate_prompts([r["prompt_ids"] for r in rows[b:b + batch_size]], tokenizer.pad_token_id)
            out = dec.generate(ids.to(device), attention_mask=att.to(device), max_new_tokens=max_new_tokens,
                               temperature=temperature, eos_token_id=tokenizer.eos_token_id, generator=gen,
                               num_draft_tokens=num_draft_tokens if draft is not None else 0)
            completions.extend(t.tolist() for t in out.new_tokens)
        part = datasets.Dataset.from_dict({"prompt_ids": [r["prompt_ids"] for r in rows],
                                           "completion_ids": completions})
        tmp = shard_dir.with_name(shard_dir.name + ".tmp")
        part.save_to_disk(str(tmp))
        tmp.rename(shard_dir)  # atomic: a killed run never leaves a half shard that looks done
        if progress is not None:
            progress(s + 1, n_shards)
    return datasets.concatenate_datasets([datasets.load_from_disk(str(d)) for d in shard_dirs])


def as_examples(ds: Any) -> list[dict[str, list[int]]]:
    """A cached ``datasets.Dataset`` (prompt_ids, completion_ids) back to example dicts."""
    return [{"prompt_ids": list(r["prompt_ids"]), "completion_ids": list(r["completion_ids"])} for r in ds]
