"""Target-generated completions (sequence-level KD): the target continues each prompt once, cached on disk.

:func:`prepare_target_data` is what the recipe, ``generate-data`` and ``cache-logits`` call: it generates the
completions with the speculative decoder (lossless, a draft only makes it faster) into
``data.target_generated.path`` (default ``<train.output_dir>/target_data``), shard by shard so an interrupted run
resumes, and refuses a folder made with other settings, naming each one that differs.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import datasets
import torch
from omegaconf import DictConfig

from decode import SpeculativeDecoder
from decode.loading import recorded_name, target_fingerprint
from decode.outputs import replace_text
from distill.checkpoint import name_list
from distill.config import SetupError
from distill.data import collate_prompts, ids_outside_vocab
from distill.precision import resolve_mixed_precision
from distill.runfolder import other_entries


def target_data_dir(cfg: DictConfig) -> Path:
    """Folder of the sequence-level KD cache (``data.target_generated.path`` or ``<output_dir>/target_data``)."""
    return Path(cfg.data.target_generated.get("path") or Path(cfg.train.output_dir) / "target_data")


def prepare_target_data(cfg: DictConfig, target: Any, draft: Any, tokenizer: Any, examples: list[dict],
                        accelerator: Any = None, log: Any = print) -> list[dict]:
    """Target-generated completions for ``examples`` (cached, resumable; generated on the main process)."""
    tg = cfg.data.target_generated
    out_dir = target_data_dir(cfg)
    if accelerator is None or accelerator.is_main_process:  # (the settings hash every byte of the target: once)
        gen = {"temperature": float(tg.temperature), "max_new_tokens": int(cfg.data.max_new_tokens),
               "seed": int(cfg.train.seed), "shard_size": int(tg.shard_size)}
        device = next(target.parameters()).device
        precision = resolve_mixed_precision(str(cfg.train.mixed_precision), device.type)
        if precision != "no":  # (recorded only then: caches made in full precision keep their key)
            gen["precision"] = precision
        dtype = str(next(target.parameters()).dtype).removeprefix("torch.")
        settings = target_data_settings(str(cfg.target.name_or_path), dtype, examples, gen)
        log(f"target-generated data: {len(examples)} prompts -> {out_dir} (resumable"
            f"{', ' + precision + ' autocast' if precision != 'no' else ''})")
        # train.mixed_precision: the target generates under the autocast the recipe trains and caches logits with
        autocast = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
        with torch.autocast(device.type, dtype=autocast or torch.float32, enabled=autocast is not None):
            generate_target_data(target, tokenizer, examples, out_dir, cache_key(settings),
                                 temperature=gen["temperature"], max_new_tokens=gen["max_new_tokens"],
                                 batch_size=int(tg.batch_size), shard_size=gen["shard_size"], seed=gen["seed"],
                                 draft=draft if tg.get("use_draft", True) else None,
                                 progress=lambda i, n: log(f"  shard {i}/{n} done"), settings=settings)
    if accelerator is not None:
        accelerator.wait_for_everyone()
    return as_examples(datasets.load_from_disk(str(out_dir / "dataset")))


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
    "precision": "train.mixed_precision (the autocast the target generated under)",
}


def target_data_settings(target_name: str, target_dtype: str, examples: list[dict], gen_cfg: dict) -> dict:
    """The settings a target-data cache is made with (the keys of :data:`TARGET_DATA_FIELDS`), stored in its
    ``meta.json`` so that a changed one is named: the target by its path (a local one resolved, so relative and
    absolute spellings agree) and, for a local folder or a cached hub snapshot, by its config and weight files
    (:func:`decode.loading.target_fingerprint`: a target retrained or replaced at the same path would otherwise
    reuse the old one's completions), its load dtype (``"bfloat16"``: greedy completions can differ by dtype), the
    prompts (count and hash of their ids) and ``gen_cfg`` (``max_new_tokens``, ``temperature``, ``seed``,
    ``shard_size``: each shard's sampling generator is seeded from its index, so the shard size shapes sampled data).
    """
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
        return ("it records no settings (made by an earlier draftkit, or damaged), so they cannot be checked")
    diffs = [f"{k} (cache {cached.get(k)!r}, config {settings.get(k)!r}; set by {TARGET_DATA_FIELDS.get(k, k)})"
             for k in dict.fromkeys([*settings, *cached]) if cached.get(k) != settings.get(k)]
    return "; ".join(diffs) or "the same settings, another key"


def check_target_data_dir(cache_dir: str | Path) -> None:
    """The sequence-level KD cache folder (``data.target_generated.path``): missing, empty, or a cache of its own
    (``meta.json``). A folder holding anything else (a model, a user's ``save_to_disk`` dataset) is refused before
    anything is written, since the cache saves ``shards/`` and ``dataset/`` into it.

    Raises:
        SetupError: naming the setting, what the folder holds and the fix.
    """
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
    cache_dir.mkdir(parents=True, exist_ok=True)
    meta = {"key": key, "settings": settings, "num_prompts": len(examples)}
    replace_text(meta_path, json.dumps({**meta, "complete": False}))  # whole or not at all: a cut one reads as damaged
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


def _generate_shards(target: Any, tokenizer: Any, examples: list[dict], cache_dir: Path, temperature: float,
                     max_new_tokens: int, batch_size: int, shard_size: int, seed: int, draft: Any,
                     num_draft_tokens: int, progress: Any) -> Any:
    """The shards of :func:`generate_target_data` (the missing ones generated and saved), concatenated."""
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
