"""``python -m distill cache-logits``: score the training data with the target once and store top-k + tail.

The command builds what :mod:`distill.logit_cache` reads: it takes the same examples as ``train``
(``data.completions=target|both`` generates them first, :mod:`distill.target_data`), writes the shards of
``data.logit_cache`` (under ``accelerate launch``, process p writes shards p, p + P, ...), resumes an interrupted
build and refuses a folder made for another setup, before the target loads where it can.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from omegaconf import DictConfig

from decode.cache import context_length
from decode.outputs import write_json
from distill.checks import check_output_dir, normalize_config
from distill.config import SetupError, check_tail_samples_loss
from distill.cross_vocab import is_cross_vocab
from distill.data import load_data
from distill.logit_cache import (FORMAT_VERSION, MANIFEST, check_cache_dir, check_manifest, expected_manifest,
                                 load_manifest, missing_shards, summarize, write_shards)
from distill.models import check_pair, load_draft, load_draft_tokenizer, load_target, load_tokenizer
from distill.precision import accelerator_precision
from distill.target_data import prepare_target_data


def build_cache(cfg: Any, log: Any = print) -> dict:
    """Build (or finish) the logit cache of ``data.logit_cache`` for a composed config.

    Returns a summary: rows, completion tokens, bytes, bytes per token, seconds, path.

    Raises SetupError (before loading the target where possible) for a missing ``data.logit_cache``, k < 1, a
    cache folder made for another setup, or any of ``train``'s own setup errors.
    """
    cfg = normalize_config(cfg)
    out = _check_cache_settings(cfg)
    t_start = time.perf_counter()
    if not torch.distributed.is_initialized():
        AcceleratorState._reset_state(reset_partial_state=True)
    precision, cpu = accelerator_precision(cfg.train)
    acc = Accelerator(mixed_precision=precision, cpu=cpu)
    tokenizer = load_tokenizer(cfg.target.tokenizer or cfg.target.name_or_path)
    # Data and fingerprints need only the tokenizer: a folder made for another setup fails before the target loads.
    base_examples, _ = load_data(cfg, tokenizer, None)
    expected = expected_manifest(cfg, tokenizer, base_examples)
    shard_size = int(cfg.data.get("logit_cache_shard_size") or 256)
    if (out / MANIFEST).exists():
        old = load_manifest(out / MANIFEST)
        if _check_earlier_build(old, expected, out, cfg, str(acc.mixed_precision), shard_size, log):
            log(f"logit cache {out} is complete; nothing to do")
            return {**summarize(out, old), "seconds": 0.0}
    target = load_target(cfg.target)
    target.to(acc.device)
    vocab = check_pair(target, None, tokenizer)
    if expected["k"] > vocab:
        raise SetupError(f"data.logit_cache_k={expected['k']} is larger than the vocabulary ({vocab} ids); use at most "
                         f"{vocab}, e.g. data.logit_cache_k=32")
    examples = _scored_examples(cfg, target, tokenizer, acc, log)
    n_shards = (len(examples) + shard_size - 1) // shard_size
    manifest = {"format": FORMAT_VERSION, **expected, "vocab": int(vocab), "num_examples": len(examples),
                "tail_seed": int(cfg.train.seed),
                "shard_size": shard_size, "num_shards": n_shards, "mixed_precision": str(acc.mixed_precision),
                "target_dtype": str(cfg.target.get("dtype")), "complete": False}
    if acc.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / MANIFEST, manifest)
    acc.wait_for_everyone()
    log(f"cache-logits: {len(examples)} examples, k={manifest['k']}, tail samples={manifest['tail_samples']}, "
        f"T={manifest['temperature']}, {n_shards} shards "
        f"-> {out} ({acc.num_processes} process(es))")
    write_shards(target, examples, out, manifest["k"], vocab, manifest["temperature"], tokenizer.pad_token_id,
                 shard_size, int(cfg.train.batch_size), acc.process_index, acc.num_processes, acc.autocast, log,
                 manifest["tail_samples"], int(cfg.train.seed))
    acc.wait_for_everyone()
    seconds = time.perf_counter() - t_start
    if acc.is_main_process:
        manifest.update(complete=True, build_seconds=round(seconds, 3))
        write_json(out / MANIFEST, manifest)
    acc.wait_for_everyone()
    return {**summarize(out, manifest), "seconds": seconds}


def _check_cache_settings(cfg: DictConfig) -> Path:
    """The cache folder ``data.logit_cache``, checked with k and the tail samples before anything loads.

    Raises:
        SetupError: it is not set, cannot be written or holds something else (a run, a model), k < 1, or tail
            samples with a loss other than fkl.
    """
    if not cfg.data.get("logit_cache"):
        raise SetupError("data.logit_cache is not set: give the cache folder, e.g. data.logit_cache=checkpoints/cache")
    if int(cfg.data.get("logit_cache_k") or 0) < 1:
        raise SetupError(f"data.logit_cache_k={cfg.data.get('logit_cache_k')!r} must be an integer >= 1, e.g. 32")
    tail_samples = cfg.data.get("logit_cache_tail_samples") or 0  # an integer >= 0: normalize_config checked it
    check_tail_samples_loss(tail_samples, cfg.loss.name)  # (normalize_config checks it too when training cached)
    out = Path(cfg.data.logit_cache)
    check_output_dir(out, "data.logit_cache")  # a file, under a file, or not writable: before the target loads
    check_cache_dir(out)  # a folder holding something else (a run, a model) is never written into
    return out


def _check_earlier_build(old: dict, expected: dict, out: Path, cfg: DictConfig, mixed_precision: str,
                         shard_size: int, log: Any) -> bool:
    """True when the cache ``out`` (its manifest ``old``) is complete; else whether this config may finish it.

    Raises:
        SetupError: the cache was made for another setup, or started with another shard size, seed, precision or
            target dtype (the shards already written keep theirs).
    """
    check_manifest(old, expected, out)
    lost = missing_shards(out, old) if old.get("complete") else []
    if old.get("complete") and not lost:
        return True
    if lost:  # a shard deleted after the build (as train's message on a damaged shard says): write it again
        log(f"logit cache {out} lacks shards {lost[:5]}; writing them again, the others are kept")
    if int(old.get("shard_size", shard_size)) != shard_size:
        raise SetupError(f"the unfinished logit cache {out} uses data.logit_cache_shard_size="
                         f"{old['shard_size']}; resume it with that value (shards would not line up)")
    # Shards already written keep their draws and precision: a resume must make the rest the same way.
    resumed = {"tail_seed": ("train.seed", int(cfg.train.seed) if expected["tail_samples"] else None),
               "mixed_precision": ("train.mixed_precision", mixed_precision),
               "target_dtype": ("target.dtype", str(cfg.target.get("dtype")))}  # (an older cache may lack it)
    for key, (setting, value) in resumed.items():
        if value is not None and old.get(key) is not None and old[key] != value:
            raise SetupError(f"the unfinished logit cache {out} was started with {key}={old[key]!r} "
                             f"({setting}); resume it with that value, or build a new cache elsewhere")
    return False


def _scored_examples(cfg: DictConfig, target: Any, tokenizer: Any, acc: Any, log: Any) -> list[dict]:
    """The sequences the target scores: the training examples within its context, with target-generated
    completions for ``data.completions=target|both`` (as ``train`` makes them)."""
    examples, _ = load_data(cfg, tokenizer, context_length(target))
    if cfg.data.completions in ("target", "both"):
        # a draft with a tokenizer of its own would need that tokenizer to draft; the target's text is the same
        own = cfg.draft.get("name_or_path") and not is_cross_vocab(tokenizer, load_draft_tokenizer(cfg.draft))
        draft = load_draft(cfg.draft, target).eval().to(acc.device) if own else None
        generated = prepare_target_data(cfg, target, draft, tokenizer, examples, acc, log)
        examples = generated if cfg.data.completions == "target" else examples + generated
    return examples
