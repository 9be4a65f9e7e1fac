"""Data: sources -> tokenized (prompt, completion) examples -> padded training batches. No model runs here.

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
Target-generated completions are made in :mod:`distill.target_data`; the forwards over a batch in
:mod:`distill.rollout`; the checks of a source before anything loads in :mod:`distill.checks`.
"""
from __future__ import annotations

import csv
import math
from itertools import islice
from pathlib import Path
from typing import Any

import datasets
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from omegaconf import DictConfig, OmegaConf

from decode.batch import left_pad
from decode.loading import chat_prompt_ids
from decode.prompts import shared_data_dir
from distill import corpus
from distill.config import SetupError, eval_prompts_source

SHARED_PREFIX = "../shared/data/"
BUILDERS = {".jsonl": "json", ".json": "json", ".gz": "json", ".parquet": "parquet", ".txt": "text",
            ".csv": "csv"}


def resolve_path(path: str) -> Path:
    """A data path: ``../shared/data/...`` lives in :func:`decode.prompts.shared_data_dir` (the one resolver of
    the shared data folder, honouring ``$DRAFTKIT_SHARED_DATA``); other paths are taken as given."""
    p = str(path)
    if p.startswith(SHARED_PREFIX):
        return shared_data_dir() / p[len(SHARED_PREFIX):]
    return Path(p).expanduser()


def load_rows(src: Any) -> Any:
    """The raw ``datasets.Dataset`` of a source config (``path`` or ``corpus``), limited to ``src.limit`` rows.

    Raises SetupError for a missing file, an unknown suffix, or no rows.
    """
    if src.get("corpus") and src.get("path"):
        raise SetupError(f"the data source names both a corpus ({src.corpus!r}) and a file ({src.path!r}); keep one: "
                         "data.source.corpus=null to use the file (an experiment may have set the corpus), or "
                         "data.source.path=null to use the corpus")
    if src.get("corpus"):
        ds = corpus.load_corpus(src.corpus, src.get("split") or "train", **dict(src.get("corpus_kwargs") or {}))
        where = f"corpus {src.corpus!r}"
    elif src.get("path"):
        path = resolve_path(src.path)
        if not path.exists():
            raise SetupError(f"data file {path} does not exist (from path={src.path!r}); fix the path, or set "
                             "DRAFTKIT_SHARED_DATA to the shared data folder")
        suffix = suffix_of(path)
        builder = BUILDERS.get(suffix)
        if builder is None:
            raise SetupError(f"data file {path}: unknown format {suffix!r}; use one of {sorted(BUILDERS)}")
        if path.stat().st_size == 0:
            raise SetupError(f"data file {path} is empty; point the source at a file with rows")
        kw = {"sample_by": src.get("sample_by") or "paragraph"} if builder == "text" else {}
        if builder == "csv":  # cells are text as written: no "0070" -> 70, no "None"/"NA" -> null (only empty is)
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
            return pq.read_metadata(path).num_rows == 0
        if builder == "csv":
            with open(path, newline="", encoding="utf-8-sig") as f:
                return len(list(islice(csv.reader(f), 2))) < 2
    except Exception:
        return False
    return False


def suffix_of(path: Path) -> str:
    return path.suffixes[-2] if path.suffix == ".gz" and len(path.suffixes) > 1 else path.suffix


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


def not_text(value: Any) -> str:
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
        raise SetupError(f"{at}: field {field!r} {not_text(value)}; give every row a string there")
    return text


def encode_prompt(tokenizer: Any, text: str, chat_template: bool) -> list[int]:
    """Token ids of a prompt: the tokenizer's chat template (one user turn + generation prompt) when it has one."""
    if chat_template and getattr(tokenizer, "chat_template", None):
        return chat_prompt_ids(tokenizer, [{"role": "user", "content": text}])
    return [int(t) for t in tokenizer(text)["input_ids"]]


def source_kind(src: Any) -> str:
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
    if source_kind(src) == "text":
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


def load_data(cfg: DictConfig, tokenizer: Any, context: int | None,
              training: bool = True) -> tuple[list[dict], list[list[int]]]:
    """Training examples and eval prompts (held out of training when ``eval.prompts`` names no file or corpus),
    length-checked. ``training=False`` (``distill eval``): no training examples when ``eval.prompts`` gives the
    prompts, so ``data.source`` is not read."""
    if not training and eval_prompts_source(cfg) is not None:
        examples = []
    else:
        examples = build_examples(cfg.data.source, tokenizer, cfg.data)
    if eval_prompts_source(cfg) is not None:
        ev_src = OmegaConf.merge({"kind": "auto", "completion_field": None}, cfg.eval.prompts)
        eval_examples = build_examples(ev_src, tokenizer, cfg.data)
    else:
        n_hold = int(cfg.data.holdout)
        if n_hold < 1:
            raise SetupError("eval.prompts names no file and data.holdout < 1: nothing to evaluate on; set "
                             "data.holdout=N or eval.prompts.path=FILE")
        if len(examples) <= n_hold:
            raise SetupError(f"the data has {len(examples)} examples, not more than data.holdout={n_hold} held out "
                             "for evaluation; lower data.holdout or give eval.prompts.path=FILE")
        examples, eval_examples = examples[:-n_hold], examples[-n_hold:]
    examples = check_lengths(examples, context, cfg.data)
    eval_cfg = OmegaConf.merge(cfg.data, {"max_new_tokens": int(cfg.eval.max_new_tokens)})
    eval_examples = check_lengths(eval_examples[: int(cfg.eval.num_prompts)], context, eval_cfg, "eval prompts",
                                  "eval.max_new_tokens")
    return examples, [e["prompt_ids"] for e in eval_examples]


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


def ids_outside_vocab(column: Any, vocab: int) -> tuple[int, int] | None:
    """``(min, max)`` of the token ids in an Arrow list column when any lies outside ``[0, vocab)``, else None (an
    empty column too). One vectorized pass (``pyarrow.compute.min_max``): how the target-data and logit caches check
    that their stored ids fit the vocabulary before training indexes with them."""
    bounds = pc.min_max(pc.list_flatten(column)).as_py()
    if bounds["min"] is None or 0 <= bounds["min"] <= bounds["max"] < vocab:
        return None
    return bounds["min"], bounds["max"]


