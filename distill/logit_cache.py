"""A compact cache of the target's next-token distribution: top-k log-probabilities, their ids and the tail mass.

``python -m distill cache-logits`` (same config as ``train``; :mod:`distill.cache_logits`) runs the frozen target
once over the training data and stores, for every completion position, the k most probable ids (int32), their
log-probabilities (fp16) and the log of the remaining tail mass (float32), all at ``loss.temperature``. ``train`` with
``data.target_logits=cached data.logit_cache=PATH`` then trains the draft on these k+1 "buckets" without loading
the target (``distill.losses.cached_divergence``: an exact divergence between the two coarse-grained
distributions, equal to the full-vocabulary one when k = V). Size per completion token: 6k + 4 bytes (k = 32:
196 bytes) instead of 2V for a full bf16 row (V = 128k: 256 kB).

Layout of ``PATH``::

    manifest.json     what the cache was made from (target path + weights hash, tokenizer hash, k, temperature,
                      vocabulary, data fingerprint, shard count) and ``complete``; ``train`` compares it with its
                      own config and names every field that differs
    shards/NNNNN/     ``datasets`` Arrow shards (``save_to_disk``) of ``shard_size`` examples each, rows in example
                      order: prompt_ids, completion_ids (the exact tokens scored), top_log_probs (n·k fp16,
                      flattened), top_ids (n·k int32), log_tail (n float32), n = len(completion_ids); with
                      ``data.logit_cache_tail_samples=s > 0`` also tail_ids (n·s int32): s ids per position drawn
                      with replacement from the target's tail (its distribution outside the top k), which
                      ``loss=fkl`` uses for an unbiased gradient over the whole vocabulary
                      (``distill.losses.sampled_tail_fkl``)

A shard is written to ``NNNNN.tmp`` and renamed when complete, so a rerun skips finished shards (resumable).
Under ``accelerate launch`` process p builds shards p, p + P, p + 2P, ... and the main process writes the
completed manifest after all are done. Everything is data (Arrow + JSON), nothing is unpickled.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow.compute as pc
import torch

# tokenizer_fingerprint: the cache's tokenizer_hash (pruned drafts record vocab_fingerprint)
from decode.compat import IncompatibleModelsError, check_tokenizers, tokenizer_fingerprint
from decode.loading import TARGET_HASH_PREFIX, hub_revision, looks_local, target_fingerprint
from distill.checkpoint import name_list
from distill.config import SetupError
from distill.data import ids_outside_vocab, load_data
from distill.losses import topk_buckets
from distill.rollout import accepts_logits_to_keep, completion_logits
from distill.runfolder import other_entries

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
# Manifest fields that must match between the cache and a training config, with the setting that decides each.
CHECKED = {"target": "+target.name_or_path", "target_hash": "+target.name_or_path (its weights or config changed)",
           "tokenizer_hash": "+target.tokenizer", "k": "data.logit_cache_k", "temperature": "loss.temperature",
           "tail_samples": "data.logit_cache_tail_samples",
           "data_fingerprint": "data.* (source, completions, max_new_tokens, holdout, ...)"}
# Fields added after format 1 was written, with the value a cache without them has.
DEFAULTS = {"tail_samples": 0}


# ------------------------------------------------------------------------------------------------ fingerprints

def data_fingerprint(examples: list[dict], cfg: Any) -> str:
    """A hash of the training examples as ``load_data`` makes them (before target generation) and of the settings
    that turn them into the scored sequences (``data.completions``, target-generation temperature and seed)."""
    gen = {"completions": str(cfg.data.completions), "max_new_tokens": int(cfg.data.max_new_tokens)}
    if cfg.data.completions != "data":
        gen.update(temperature=float(cfg.data.target_generated.temperature), seed=int(cfg.train.seed))
    h = hashlib.sha256(json.dumps(gen, sort_keys=True).encode())
    for e in examples:
        h.update(json.dumps([e["prompt_ids"], e["completion_ids"]]).encode())
    return h.hexdigest()[:16]


def expected_manifest(cfg: Any, tokenizer: Any, examples: list[dict], k: int | None = None,
                      tail_samples: int | None = None) -> dict:
    """The manifest fields a config implies (cheap: no model is loaded); ``examples`` as ``load_data`` returns
    them without a context limit; ``k`` and ``tail_samples`` override ``data.logit_cache_k`` and
    ``data.logit_cache_tail_samples`` (train reads a null value from the cache)."""
    name = str(cfg.target.name_or_path)
    name = str(Path(name).expanduser().resolve()) if looks_local(name) else name  # relative vs absolute: same
    return {"target": name, "target_revision": hub_revision(name), "target_hash": target_fingerprint(name),
            "tokenizer_hash": tokenizer_fingerprint(tokenizer), "k": int(k or cfg.data.logit_cache_k),
            "temperature": float(cfg.loss.get("temperature", 1.0)), "data_fingerprint": data_fingerprint(examples, cfg),
            "tail_samples": int(tail_samples if tail_samples is not None else
                                (cfg.data.get("logit_cache_tail_samples") or 0))}


def check_manifest(manifest: dict, expected: dict, path: str | Path, training: bool = False) -> None:
    """Raise SetupError naming every field of ``manifest`` that differs from ``expected`` and the setting to fix
    (``training``: also that null k / tail samples take the cache's own, which only ``train`` does). A target_hash
    without the current scheme's prefix is refused: rebuild the cache. A target at another path whose hash is the
    recorded one is the same target."""
    if manifest.get("format") != FORMAT_VERSION:
        raise SetupError(f"logit cache {path} has format {manifest.get('format')!r}, this draftkit reads "
                         f"{FORMAT_VERSION}; rebuild it with python -m distill cache-logits")
    if "target_hash" in expected and not str(manifest.get("target_hash")).startswith(TARGET_HASH_PREFIX):
        raise SetupError(f"logit cache {path} records target hash {manifest.get('target_hash')!r}, not one of the "
                         f"form {TARGET_HASH_PREFIX}<16 hex digits> that hashes every byte of the target's weights, so "
                         "it cannot show the cache was made from this target; rebuild it with python -m distill "
                         "cache-logits")
    if "target_hash" in expected and manifest.get("target_hash") == expected["target_hash"]:
        expected = {k: v for k, v in expected.items() if k != "target"}  # the same bytes, moved or copied elsewhere
    diffs = [f"{key} (cache {manifest.get(key, DEFAULTS.get(key))!r}, config {expected[key]!r}; set by {CHECKED[key]})"
             for key in CHECKED if key in expected and manifest.get(key, DEFAULTS.get(key)) != expected[key]]
    if diffs:
        own = [CHECKED[k] for k in ("k", "tail_samples") if training and k in expected
               and manifest.get(k, DEFAULTS.get(k)) != expected[k]]
        null = f" ({' / '.join(f'{s}=null' for s in own)} takes the cache's own value)" if own else ""
        raise SetupError(f"logit cache {path} was made for another setup: " + "; ".join(diffs) +
                         f". Use the same settings as cache-logits{null}, or build a new cache at another "
                         "data.logit_cache")


# Keys every manifest written by ``cache-logits`` has (complete or not); a folder whose manifest.json lacks them
# holds something else (a distill checkpoint's manifest, another program's file) and is never read or written.
CACHE_KEYS = ("format", "k", "num_shards", "num_examples")


def load_manifest(file: Path) -> dict:
    try:
        manifest = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise SetupError(f"{file} is not valid JSON ({err}); the logit cache is damaged: delete "
                         f"{file.parent} and rebuild it with python -m distill cache-logits") from None
    if not isinstance(manifest, dict) or not all(key in manifest for key in CACHE_KEYS):
        raise SetupError(f"data.logit_cache={str(file.parent)!r} is not a logit cache: its {MANIFEST} was not written "
                         "by python -m distill cache-logits (a distill checkpoint's, or another program's); nothing "
                         "was changed. Give the folder cache-logits made, or a new or empty folder to build one in")
    return manifest


def check_cache_dir(out: Path) -> None:
    """``cache-logits``' output folder: missing, empty, or a logit cache (its manifest.json, complete or not).
    A folder holding anything else (a run folder, a model, a checkpoint) is refused before anything is written.

    Raises:
        SetupError: naming ``data.logit_cache``, what the folder holds and the fix.
    """
    out = Path(out).expanduser().resolve()  # (a/missing/.. is a, which exists)
    if (out / MANIFEST).is_file():
        load_manifest(out / MANIFEST)  # a manifest that is not a cache's is refused
        return
    if not out.is_dir():
        return
    others = other_entries(out, ("shards", MANIFEST + ".tmp"))
    if others:
        raise SetupError(f"data.logit_cache={str(out)!r} is a folder that holds other files ({name_list(others)}) "
                         f"and no logit cache ({MANIFEST}); nothing was written. Give a new or empty folder, "
                         "e.g. data.logit_cache=checkpoints/cache")


def read_manifest(path: str | Path) -> dict:
    """The manifest of a cache folder; SetupError if there is none or the cache is incomplete."""
    file = Path(path) / MANIFEST
    if not file.exists():
        raise SetupError(f"data.logit_cache={str(path)!r} has no {MANIFEST}; build it first with "
                         "python -m distill cache-logits (same overrides as train)")
    manifest = load_manifest(file)
    if not manifest.get("complete"):
        total = int(manifest.get("num_shards") or 0)
        raise SetupError(f"logit cache {path} is incomplete ({total - len(missing_shards(path, manifest))} of "
                         f"{total} shards); rerun python -m distill cache-logits to finish it")
    return manifest


# ------------------------------------------------------------------------------------------------ building

def shard_rows(target: Any, examples: list[dict], k: int, vocab: int, temperature: float, pad_id: int,
               batch_size: int, autocast: Any = None, tail_samples: int = 0,
               generator: torch.Generator | None = None) -> dict[str, list]:
    """The cache columns of ``examples``: one target forward per batch of ``batch_size`` sequences, its lm_head
    run only on the completion positions (:func:`distill.rollout.completion_logits`).

    Returns column lists (see module doc); position j of example i is the target's distribution of the j-th
    completion token given the prompt and the completion before it (the positions ``collate_sequences`` marks).
    ``tail_samples`` s > 0 adds ``tail_ids``: s draws per position from the target's tail (:func:`sample_tail`,
    from ``generator``, on the CPU so the draws do not depend on the device).
    """
    to_keep = accepts_logits_to_keep(target)
    cols: dict[str, list] = {"prompt_ids": [], "completion_ids": [], "top_log_probs": [], "top_ids": [],
                             "log_tail": [], **({"tail_ids": []} if tail_samples else {})}
    for b in range(0, len(examples), batch_size):
        rows = examples[b:b + batch_size]
        with torch.no_grad(), (autocast() if autocast is not None else torch.autocast("cpu", enabled=False)):
            kept = completion_logits(target, rows, pad_id, to_keep)[..., :vocab]  # (N, V)
        top, ids, tail = topk_buckets(kept, k, temperature)  # (N, k), (N, k), (N,)
        drawn = (sample_tail(kept.float().cpu(), ids.cpu(), tail_samples, temperature, generator).int()
                 if tail_samples else None)  # (N, s)
        top, ids, tail = top.half().cpu(), ids.int().cpu(), tail.float().cpu()
        start = 0
        for e in rows:
            n = len(e["completion_ids"])
            cols["prompt_ids"].append(list(e["prompt_ids"]))
            cols["completion_ids"].append(list(e["completion_ids"]))
            cols["top_log_probs"].append(top[start:start + n].flatten().numpy())
            cols["top_ids"].append(ids[start:start + n].flatten().numpy())
            cols["log_tail"].append(tail[start:start + n].numpy())
            if drawn is not None:
                cols["tail_ids"].append(drawn[start:start + n].flatten().numpy())
            start += n
    return cols


def sample_tail(logits: torch.Tensor, top_ids: torch.Tensor, s: int, temperature: float = 1.0,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """``(N, s)`` int64 ids drawn with replacement from ``softmax(logits / temperature)`` restricted to the ids
    outside ``top_ids`` (N, k) and renormalized. A row whose tail has no mass (k = V) draws its top-1 id, whose
    weight P_tail / s is then 0 (:func:`distill.losses.sampled_tail_target`)."""
    probs = torch.softmax(logits.float() / temperature, dim=-1).scatter(-1, top_ids.long(), 0.0)
    empty = probs.sum(-1, keepdim=True) <= 0
    probs = torch.where(empty, torch.zeros_like(probs).scatter(-1, top_ids[:, :1].long(), 1.0), probs)
    return torch.multinomial(probs, s, replacement=True, generator=generator)


def _features(tail_samples: int = 0):
    cols = {"prompt_ids": datasets.Sequence(datasets.Value("int32")),
            "completion_ids": datasets.Sequence(datasets.Value("int32")),
            "top_log_probs": datasets.Sequence(datasets.Value("float16")),
            "top_ids": datasets.Sequence(datasets.Value("int32")),
            "log_tail": datasets.Sequence(datasets.Value("float32"))}
    if tail_samples:
        cols["tail_ids"] = datasets.Sequence(datasets.Value("int32"))
    return datasets.Features(cols)


def write_shards(target: Any, examples: list[dict], out_dir: str | Path, k: int, vocab: int, temperature: float,
                 pad_id: int, shard_size: int, batch_size: int, process_index: int = 0, num_processes: int = 1,
                 autocast: Any = None, log: Any = print, tail_samples: int = 0, seed: int = 0) -> list[int]:
    """Write this process's missing shards (``s % num_processes == process_index``); returns the shard ids written.

    Each shard goes to ``shards/NNNNN.tmp`` and is renamed when complete (a killed run leaves no half shard).
    Tail samples of shard ``s`` come from a generator seeded with ``(seed, s)``: the same cache whatever the
    number of processes or the order in which an interrupted build is resumed.
    """
    shards = Path(out_dir) / "shards"
    shards.mkdir(parents=True, exist_ok=True)
    n_shards = (len(examples) + shard_size - 1) // shard_size
    written = []
    for s in range(process_index, n_shards, num_processes):
        final = shards / f"{s:05d}"
        if (final / "dataset_info.json").exists():
            continue
        gen = torch.Generator().manual_seed(seed * 1_000_003 + s) if tail_samples else None
        cols = shard_rows(target, examples[s * shard_size:(s + 1) * shard_size], k, vocab, temperature, pad_id,
                          batch_size, autocast, tail_samples, gen)
        tmp = shards / f"{s:05d}.tmp"
        if tmp.exists():
            shutil.rmtree(tmp)
        try:
            datasets.Dataset.from_dict(cols, features=_features(tail_samples)).save_to_disk(str(tmp))
        except OSError as err:  # a full disk or a quota: the finished shards stay, the partial one goes
            shutil.rmtree(tmp, ignore_errors=True)
            raise SetupError(f"could not write logit cache shard {final} ({err}); the shards finished before it are "
                             "kept. Free space on that disk, then rerun python -m distill cache-logits with the same "
                             "overrides to finish the cache") from err
        tmp.rename(final)
        written.append(s)
        log(f"  logit cache shard {s + 1}/{n_shards} written")
    return written


def missing_shards(path: str | Path, manifest: dict) -> list[str]:
    """Names of the shards a cache's manifest counts that are not (complete) in ``path/shards``."""
    dirs = [Path(path) / "shards" / f"{s:05d}" for s in range(int(manifest.get("num_shards") or 0))]
    return [d.name for d in dirs if not (d / "dataset_info.json").exists()]


def summarize(path: str | Path, manifest: dict) -> dict:
    """Rows, completion tokens and on-disk bytes of a cache folder (bytes per token includes Arrow overhead)."""
    shards = sorted(d for d in (Path(path) / "shards").iterdir() if not d.name.endswith(".tmp"))
    tokens = sum(sum(len(r) for r in datasets.load_from_disk(str(d))["log_tail"]) for d in shards)
    size = sum(f.stat().st_size for d in shards for f in d.rglob("*") if f.is_file())
    return {"path": str(path), "rows": int(manifest.get("num_examples", 0)), "k": manifest.get("k"),
            "tokens": int(tokens), "bytes": int(size), "bytes_per_token": size / max(tokens, 1)}


# ------------------------------------------------------------------------------------------------ reading

class LogitCache:
    """A built cache opened for training: the scored examples and, per batch of rows, the target buckets.

    Raises SetupError when the folder has no complete manifest or a shard is missing.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.manifest = read_manifest(self.path)
        bad = [f"{key}={self.manifest.get(key, DEFAULTS.get(key))!r}" for key, low in
               (("k", 1), ("num_shards", 1), ("num_examples", 1), ("vocab", 1), ("tail_samples", 0))
               if not _is_int(self.manifest.get(key, DEFAULTS.get(key)), low)]
        if bad:
            raise SetupError(f"logit cache {self.path}: its {MANIFEST} has {', '.join(bad)} (integers expected); the "
                             "cache is damaged or was edited: rebuild it with python -m distill cache-logits")
        self.k = int(self.manifest["k"])
        self.tail_samples = int(self.manifest.get("tail_samples", DEFAULTS["tail_samples"]))
        dirs = [self.path / "shards" / f"{s:05d}" for s in range(int(self.manifest["num_shards"]))]
        missing = missing_shards(self.path, self.manifest)
        if missing:
            raise SetupError(f"logit cache {self.path} lacks shards {missing[:5]}; rerun python -m distill "
                             "cache-logits with the same overrides to finish it")
        try:
            self.ds = datasets.concatenate_datasets([datasets.load_from_disk(str(d)) for d in dirs])
        except (FileNotFoundError, OSError, ValueError) as err:
            raise SetupError(f"logit cache {self.path} has a damaged shard ({err}); delete that shard folder and "
                             "rerun python -m distill cache-logits with the same overrides to rebuild it") from None
        if len(self.ds) != int(self.manifest["num_examples"]):
            raise SetupError(f"logit cache {self.path} has {len(self.ds)} rows, its manifest says "
                             f"{self.manifest['num_examples']}; rebuild it")
        self.arrays = self.ds.with_format("numpy", columns=["top_log_probs", "top_ids", "log_tail"] +
                                          (["tail_ids"] if self.tail_samples else []))
        self._check_rows()

    def _check_rows(self) -> None:
        """Every row holds n·k top ids and log-probs, n tails (and n·s tail ids) for its n completion tokens, and
        every stored id lies in the manifest's vocabulary: a damaged or edited shard (or one from another cache) is
        named here, not by an index error mid-step or a batch whose rows no longer line up. Vectorized (Arrow)."""
        n = pc.list_value_length(self.ds.data.column("completion_ids"))
        widths = {"top_ids": self.k, "top_log_probs": self.k, "log_tail": 1, "tail_ids": self.tail_samples}
        for name, width in widths.items():
            if name == "tail_ids" and not width:
                continue
            if name not in self.ds.column_names:
                raise SetupError(f"logit cache {self.path} has no column {name!r} (its {MANIFEST}: k={self.k}, "
                                 f"tail_samples={self.tail_samples}); rebuild it with python -m distill cache-logits")
            col = self.ds.data.column(name)
            wrong = pc.sum(pc.not_equal(pc.list_value_length(col), pc.multiply(n, width))).as_py()
            if wrong:
                raise SetupError(f"logit cache {self.path}: {wrong} rows of {name!r} do not hold {width} values per "
                                 "completion token; a shard is damaged or comes from another cache: rebuild it with "
                                 "python -m distill cache-logits")
            outside = ids_outside_vocab(col, int(self.manifest["vocab"])) if name.endswith("_ids") else None
            if outside is not None:
                raise SetupError(f"logit cache {self.path}: {name!r} holds ids {outside[0]}..{outside[1]}, outside "
                                 f"the vocabulary [0, {self.manifest['vocab']}) of its {MANIFEST}; a shard is damaged "
                                 "or comes from another cache: rebuild it with python -m distill cache-logits")

    def examples(self) -> list[dict]:
        """The scored sequences as training examples, each with its ``cache_row``."""
        cols = self.ds.select_columns(["prompt_ids", "completion_ids"])
        return [{"prompt_ids": list(r["prompt_ids"]), "completion_ids": list(r["completion_ids"]), "cache_row": i}
                for i, r in enumerate(cols)]

    def buckets(self, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(log_probs (N, k+1) fp16-valued float32, ids (N, k) int64, tail_ids (N, s) int64 or None)`` of
        ``rows``' completion positions, in the order ``collate_sequences``' loss mask lists them (row by row,
        position by position); ``tail_ids`` only for a cache built with tail samples."""
        part = self.arrays[list(rows)]
        top = torch.from_numpy(_cat(part["top_log_probs"])).float().view(-1, self.k)
        ids = torch.from_numpy(_cat(part["top_ids"])).long().view(-1, self.k)
        tail = torch.from_numpy(_cat(part["log_tail"])).float().unsqueeze(-1)
        drawn = (torch.from_numpy(_cat(part["tail_ids"])).long().view(-1, self.tail_samples)
                 if self.tail_samples else None)
        return torch.cat([top, tail], dim=-1), ids, drawn


def open_for_training(cfg: Any, tokenizer: Any, log: Any = print) -> LogitCache:
    """The cache of ``data.logit_cache``, checked against the config (before any model loads).

    Also sets ``cache.eval_prompts`` (the held-out prompts of ``load_data``). Raises SetupError for a missing or
    incomplete cache, or a manifest that differs from the config (every differing field named). ``cfg`` is a
    normalized config: on-policy batches with a cache (λ > 0) were refused there (:func:`distill.checks.validate`).
    """
    if not cfg.data.get("logit_cache"):
        raise SetupError("data.target_logits=cached needs data.logit_cache=PATH (a folder made by "
                         "python -m distill cache-logits)")
    if not cfg.draft.get("name_or_path"):
        raise SetupError("data.target_logits=cached does not load the target, so the draft cannot be built from "
                         "the target's config: set draft.name_or_path=/path (or data.target_logits=online)")
    cache = LogitCache(cfg.data.logit_cache)
    base_examples, cache.eval_prompts = load_data(cfg, tokenizer, None)
    tail = cfg.data.get("logit_cache_tail_samples")
    expected = expected_manifest(cfg, tokenizer, base_examples, k=cfg.data.get("logit_cache_k") or cache.k,
                                 tail_samples=cache.tail_samples if tail is None else tail)
    check_manifest(cache.manifest, expected, cache.path, training=True)
    if cache.tail_samples and str(cfg.loss.name) != "fkl":
        raise SetupError(f"logit cache {cache.path} holds {cache.tail_samples} sampled tail ids per position, which "
                         f"give an unbiased gradient for loss=fkl only (loss={cfg.loss.name}): use loss=fkl, or a "
                         "cache built with data.logit_cache_tail_samples=0")
    loaded = ("loaded to evaluate only (eval.with_cached_logits)" if cfg.get("eval") is not None
              and cfg.eval.get("with_cached_logits") else "not loaded")
    log(f"cached target logits: {cache.path} (k={cache.k}, tail samples={cache.tail_samples}, {len(cache.ds)} "
        f"examples); the target is {loaded}")
    return cache


def cached_training_data(cache: LogitCache, draft: Any, tokenizer: Any, draft_tokenizer: Any,
                         context: int | None, cross_vocab: bool = False) -> tuple[int, list[dict], list[list[int]]]:
    """``(vocab, examples, eval_prompts)`` for training on the cache; checks the draft's tokenizer and context.

    The cache is keyed on the target's tokens: a draft with a tokenizer of its own (``cross_vocab``) reads them
    through the token-level intersection (:mod:`distill.cross_vocab`), so its tokenizer is not compared.

    Raises SetupError naming the fix when the tokenizers differ (without ``cross_vocab``) or a cached sequence
    exceeds the draft's context.
    """
    try:
        if not cross_vocab:
            check_tokenizers(tokenizer, draft_tokenizer)
    except IncompatibleModelsError as e:
        raise SetupError(f"incompatible target/draft pair: {e}") from e
    vocab = int(cache.manifest["vocab"])
    examples = cache.examples()
    longest = max(len(e["prompt_ids"]) + len(e["completion_ids"]) for e in examples)
    if context is not None and longest > context:
        raise SetupError(f"the cached sequences reach {longest} tokens, more than the draft's context of {context}; "
                         "rebuild the cache with a lower data.max_new_tokens / data.max_prompt_tokens")
    return vocab, examples, cache.eval_prompts


def peak_memory_mb(device: Any) -> float:
    """Peak memory of this process in MiB: CUDA's max allocated on a GPU, else the peak resident set size."""
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource  # (Unix only)

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def _is_int(value: Any, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _cat(arrays) -> Any:
    return np.concatenate([np.asarray(a).reshape(-1) for a in arrays]) if len(arrays) else np.zeros(0)
