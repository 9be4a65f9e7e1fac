"""Bootstrap a target (and a baseline draft) from scratch on a real corpus, offline, in a wall-clock budget.

    python -m quickstart pretrain --size target --tokenizer checkpoints/quickstart/tokenizer \\
        --out checkpoints/quickstart/target --budget-s 480
    python -m quickstart pretrain --size draft --tokenizer checkpoints/quickstart/tokenizer \\
        --out checkpoints/quickstart/draft-baseline --budget-s 120

Steps: (1) train a byte-level BPE tokenizer with the ``tokenizers`` library on the corpus's train split (once;
reused when ``--tokenizer`` already holds one), saved so ``AutoTokenizer.from_pretrained`` loads it with
bos/eos/pad set and bos prepended; (2) train a ``LlamaForCausalLM`` from a size preset with plain next-token
cross-entropy on random windows of the tokenized train split; (3) save a Hugging Face checkpoint (safetensors +
tokenizer) and ``pretrain.json`` with the validation loss, parameter counts and tokens seen.

The learning rate follows the budget, not a step count: progress = elapsed / budget drives a linear warmup and a
cosine decay (as in nanoGPT's schedule, with wall-clock time in place of iterations), so a run of any budget ends
annealed. The forward/backward runs under bf16 autocast with fp32 master weights where the hardware computes bf16
natively (``--bf16``/``--no-bf16`` force it; the default asks ``distill.precision``): measured 1.5-1.8x faster than
fp32 on a 2-core AMD EPYC with AVX512-BF16, but 3.7x *slower* (285 vs 1,070 tokens/s) on a 2-core Xeon without it. Interrupted runs resume from ``<out>/resume/``
(safetensors + JSON, complete only with its manifest, see distill/checkpoint.py); finished runs are reused. Token
streams are cached as safetensors. Nothing is unpickled: a ``resume.pt`` of an earlier version is refused, and an
old ``tokens-*.pt`` cache is ignored (rebuilt).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from safetensors import SafetensorError
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from tqdm.auto import tqdm
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from decode.compat import tokenizer_fingerprint
from decode.outputs import replace_dir, replace_text, write_json
from distill.checkpoint import (CheckpointError, check_complete, load_optimizer, load_tensors, optimizer_to_data,
                                read_json, recover_replaced_dir, save_tensors, write_manifest)
from distill.corpus import CORPORA, check_corpus, load_corpus
from distill.logging import StopFlag
from distill.precision import resolve_mixed_precision
from quickstart import INTERRUPTED_EXIT

# Model shapes. target: ~27M parameters, enough that a verify forward costs ~10x a draft forward on CPU, small
# enough to learn Python structure in minutes on 2 cores. draft: < 1/10 of the target (what a user would have as
# an off-the-shelf small model). smoke_*: seconds, for the end-to-end test; head size 32, the smallest vLLM's CPU
# attention takes, so the smoke pair also runs in vLLM (python -m decode vllm-check).
SIZES: dict[str, dict] = {
    "target": dict(hidden_size=512, num_hidden_layers=7, intermediate_size=1408, num_attention_heads=8),
    "draft": dict(hidden_size=192, num_hidden_layers=2, intermediate_size=512, num_attention_heads=3),
    "smoke_target": dict(hidden_size=64, num_hidden_layers=2, intermediate_size=160, num_attention_heads=2),
    "smoke_draft": dict(hidden_size=32, num_hidden_layers=1, intermediate_size=64, num_attention_heads=1),
}
SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>"}
RESULT_FILE = "pretrain.json"
RESUME_DIR = "resume"          # the resume snapshot: model/optimizer/generator tensors + JSON state + manifest
LEGACY_RESUME_FILE = "resume.pt"  # an earlier version's pickle snapshot: refused, never read


@dataclass
class PretrainConfig:
    """Everything that defines a pretraining run (saved in ``pretrain.json``; a cached run is reused only when
    the fields in ``IDENTITY`` match)."""

    out: str                                  # output folder: HF checkpoint + pretrain.json
    tokenizer: str                            # tokenizer folder; trained there first if it holds none
    size: str = "target"                      # a key of SIZES
    corpus: str = "stdlib"                    # a corpus of distill.corpus.load_corpus
    vocab_size: int = 8192                    # BPE vocabulary, special tokens included (tokenizer training only)
    seq_len: int = 256                        # training window, tokens; also the trained context
    max_position_embeddings: int = 1024       # RoPE has no position parameters; room for prompt + generation
    batch_size: int = 8                       # windows per optimizer step
    budget_s: float = 480.0                   # wall-clock training budget, seconds (the LR schedule follows it)
    max_steps: int | None = None              # optional step cap (tests); progress = max(time, step) fraction
    lr: float = 2e-3                          # peak learning rate (AdamW)
    min_lr_ratio: float = 0.1                 # final LR as a fraction of the peak
    warmup_frac: float = 0.05                 # fraction of the budget spent warming up
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    bf16: bool | None = None                  # bf16 autocast for forward/backward (weights stay fp32); None: where native
    val_tokens: int = 32768                   # validation tokens scored at the end
    save_every_s: float = 60.0                # resume snapshot period, seconds
    seed: int = 0
    device: str = "auto"                      # "auto": cuda if available, else cpu
    force: bool = False                       # retrain even if a finished run exists
    tokenizer_only: bool = False              # stop after the tokenizer
    extra: dict = field(default_factory=dict)

    IDENTITY = ("size", "corpus", "seq_len", "max_position_embeddings")


# ------------------------------------------------------------------------------------------------ tokenizer

TOKENIZER_RECORD = "quickstart_tokenizer.json"  # beside the tokenizer: the vocab_size and corpus it was trained for


def tokenizer_record(folder: str | os.PathLike) -> dict | None:
    """What a tokenizer folder was trained for (``{"vocab_size", "corpus"}``), or None (not recorded: older runs)."""
    try:
        return json.loads((Path(folder) / TOKENIZER_RECORD).read_text())
    except (OSError, ValueError):
        return None


def train_tokenizer(texts, vocab_size: int, out_dir: str | os.PathLike, record: dict | None = None):
    """Train a byte-level BPE tokenizer and save it as a Hugging Face fast tokenizer.

    Byte-level (GPT-2 style) so any text, including unseen characters, encodes without unknown tokens. ids 0, 1, 2
    are ``<pad>``, ``<s>`` (bos, prepended by the post-processor) and ``</s>`` (eos, appended between documents).

    Args:
        texts: an iterable of training strings.
        vocab_size: total vocabulary size, special tokens included (>= 259: 256 bytes + 3 specials).
        out_dir: folder to write ``tokenizer.json`` and ``tokenizer_config.json`` into.

    Returns:
        the loaded ``PreTrainedTokenizerFast``.

    Raises:
        ValueError: ``vocab_size`` too small to hold the byte alphabet and special tokens.
    """
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size={vocab_size} is below 259 (256 bytes + 3 special tokens); raise it")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS.values()),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2,
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    bos = SPECIAL_TOKENS["bos_token"]
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                       special_tokens=[(bos, tok.token_to_id(bos))])
    # Saved into a sibling folder and renamed into place whole: tokenizer.json is the phase's "done" marker, and a
    # save cut short in place (a full disk, a kill) left a truncated one that every rerun reused and failed on.
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    if tmp.exists():  # a save of ours cut short before (never renamed into place)
        shutil.rmtree(tmp)
    try:
        PreTrainedTokenizerFast(tokenizer_object=tok, **SPECIAL_TOKENS).save_pretrained(str(tmp))
        if record is not None:
            (tmp / TOKENIZER_RECORD).write_text(json.dumps(record))
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out_dir.is_dir() and not any(out_dir.iterdir()):
        out_dir.rmdir()
    tmp.rename(out_dir)
    return AutoTokenizer.from_pretrained(str(out_dir))


def load_or_train_tokenizer(cfg: PretrainConfig, log=print):
    """The tokenizer in ``cfg.tokenizer``, trained on ``cfg.corpus``'s train split first if absent."""
    path = Path(cfg.tokenizer)
    if (path / "tokenizer.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(path))
        except (OSError, ValueError) as err:  # e.g. a tokenizer.json cut short by an earlier version's save
            raise ValueError(f"{path} holds a tokenizer that does not load ({type(err).__name__}: "
                             f"{str(err).splitlines()[0] if str(err) else ''}); delete that folder to train the "
                             "tokenizer again (the phases after it must be redone too)") from err
    t0 = time.time()
    texts = list(load_corpus(cfg.corpus, "train")["text"])
    tok = train_tokenizer(texts, cfg.vocab_size, path, {"vocab_size": cfg.vocab_size, "corpus": cfg.corpus})
    log(f"tokenizer: trained byte-level BPE, vocab {len(tok)}, on {len(texts)} {cfg.corpus} train documents "
        f"in {time.time() - t0:.1f}s -> {path}")
    return tok


def token_stream(tokenizer, corpus: str, split: str, cache_dir: str | os.PathLike | None = None) -> torch.Tensor:
    """One split of a corpus as a flat id stream: ``<s> doc </s> <s> doc </s> ...``, cached in ``cache_dir``.

    Returns:
        (N,) int32 tensor of token ids.

    Raises:
        ValueError: the cache file is not a safetensors file with an ``ids`` tensor (it is never unpickled).
    """
    cache = Path(cache_dir) / f"tokens-{corpus}-{split}.safetensors" if cache_dir is not None else None
    if cache is not None and cache.is_file():
        try:
            return load_tensors(cache)["ids"]
        except (CheckpointError, KeyError) as e:
            raise ValueError(f"token cache {cache} is not a safetensors file with an 'ids' tensor; it is not "
                             "loaded. Delete it and it is rebuilt from the corpus") from e
    texts = list(load_corpus(corpus, split)["text"])
    ids = tokenizer(texts, add_special_tokens=True)["input_ids"]  # bos prepended by the post-processor
    eos = tokenizer.eos_token_id
    stream = torch.tensor([t for doc in ids for t in (*doc, eos)], dtype=torch.int32)
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(cache.name + ".tmp")
        save_tensors({"ids": stream}, tmp)
        os.replace(tmp, cache)
    return stream


# ---------------------------------------------------------------------------------------------------- model

def build_model(size: str, tokenizer, max_position_embeddings: int = 1024):
    """A randomly initialised ``LlamaForCausalLM`` of preset ``size`` over ``tokenizer``'s vocabulary.

    Embeddings are tied to the output head: at these sizes the embedding is a large share of the parameters.

    Raises:
        ValueError: unknown size.
    """
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}: use one of {', '.join(SIZES)}")
    shape = dict(SIZES[size])
    shape.setdefault("num_key_value_heads", shape["num_attention_heads"])
    config = LlamaConfig(vocab_size=len(tokenizer), max_position_embeddings=max_position_embeddings,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True, **shape)
    return LlamaForCausalLM(config)


def count_params(model) -> dict[str, int]:
    """Total parameters (tied weights once) and those outside the token embedding."""
    total = sum(p.numel() for p in model.parameters())
    emb = model.get_input_embeddings().weight.numel()
    return {"params": total, "params_non_embedding": total - emb}


def lr_at(progress: float, cfg: PretrainConfig) -> float:
    """Learning rate at ``progress`` in [0, 1] of the budget: linear warmup, then cosine to ``min_lr_ratio``."""
    if progress < cfg.warmup_frac:
        return cfg.lr * max(progress, 1e-3) / cfg.warmup_frac
    t = min(1.0, (progress - cfg.warmup_frac) / max(1e-9, 1.0 - cfg.warmup_frac))
    return cfg.lr * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * t)))


def _autocast(device: torch.device, enabled: bool):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)


def sample_batch(stream: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
    """(batch_size, seq_len + 1) int64 windows at uniformly random offsets of ``stream`` (drawn from
    ``generator``)."""
    starts = torch.randint(0, len(stream) - seq_len - 1, (batch_size,), generator=generator)
    return torch.stack([stream[s: s + seq_len + 1] for s in starts.tolist()]).long()


@torch.no_grad()
def evaluate_loss(model, stream: torch.Tensor, seq_len: int, max_tokens: int, device: torch.device,
                  bf16: bool, batch_size: int = 8) -> float:
    """Mean next-token cross-entropy (nats/token) over consecutive non-overlapping windows of ``stream``,
    up to ``max_tokens`` predicted tokens."""
    n_win = max(1, min(max_tokens // seq_len, (len(stream) - 1) // seq_len))
    windows = torch.stack([stream[i * seq_len: i * seq_len + seq_len + 1] for i in range(n_win)]).long()
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for chunk in windows.split(batch_size):
        chunk = chunk.to(device)
        with _autocast(device, bf16):
            logits = model(input_ids=chunk[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum")
        total, count = total + loss.item(), count + chunk[:, 1:].numel()
    model.train(was_training)
    return total / count


# ------------------------------------------------------------------------------------------------ the run

def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _check_config(cfg: PretrainConfig) -> None:
    if cfg.size not in SIZES:
        raise ValueError(f"unknown size {cfg.size!r}: use one of {', '.join(SIZES)}")
    if cfg.corpus not in CORPORA:
        raise ValueError(f"unknown corpus {cfg.corpus!r}: use one of {', '.join(CORPORA)}")
    try:
        check_corpus(cfg.corpus)
    except FileNotFoundError as err:
        raise ValueError(f"--corpus {cfg.corpus}: {err}") from None
    if not math.isfinite(cfg.budget_s) or (cfg.budget_s <= 0 and not cfg.max_steps):
        raise ValueError(f"budget_s={cfg.budget_s}: give a positive time budget (--budget-s) or --max-steps")
    for name, value, low in (("vocab_size", cfg.vocab_size, 256 + len(SPECIAL_TOKENS)), ("seq_len", cfg.seq_len, 1),
                             ("batch_size", cfg.batch_size, 1), ("val_tokens", cfg.val_tokens, 1),
                             ("max_steps", 1 if cfg.max_steps is None else cfg.max_steps, 1)):
        if value < low:
            raise ValueError(f"--{name.replace('_', '-')} {value}: must be >= {low}")
    if not (math.isfinite(cfg.lr) and cfg.lr > 0):
        raise ValueError(f"--lr {cfg.lr}: the peak learning rate must be a number > 0, e.g. --lr 2e-3")
    if not cfg.save_every_s >= 0:
        raise ValueError(f"--save-every-s {cfg.save_every_s}: must be >= 0 seconds (0: a snapshot every step)")
    if not 0 <= cfg.warmup_frac < 1:
        raise ValueError(f"--warmup-frac {cfg.warmup_frac}: must be >= 0 and < 1 (a fraction of the budget)")
    for name, path in (("--tokenizer", cfg.tokenizer), ("--out", cfg.out)):
        if path and Path(path).exists() and not Path(path).is_dir():
            raise ValueError(f"{name} {path} is a file, not a folder: give a folder")
    if cfg.seq_len > cfg.max_position_embeddings:
        raise ValueError(f"seq_len={cfg.seq_len} exceeds max_position_embeddings={cfg.max_position_embeddings}; "
                         "raise --max-position-embeddings or lower --seq-len")


def cached_result(cfg: PretrainConfig) -> dict | None:
    """The finished run's ``pretrain.json`` in ``cfg.out``, or None.

    Raises:
        ValueError: the folder holds a finished run with different ``IDENTITY`` fields (reusing it would silently
            give another model); pass ``--force`` or another ``--out``.
    """
    path = Path(cfg.out) / RESULT_FILE
    if cfg.force or not path.is_file() or not (Path(cfg.out) / "config.json").is_file():
        return None
    result = json.loads(path.read_text())
    old = result.get("config", {})
    diff = {k: (old.get(k), getattr(cfg, k)) for k in PretrainConfig.IDENTITY if old.get(k) != getattr(cfg, k)}
    if diff:
        raise ValueError(f"{cfg.out} holds a finished run with different settings {diff} (old, new); "
                         "pass --force to retrain or choose another --out")
    if (Path(cfg.tokenizer) / "tokenizer.json").is_file() and (Path(cfg.out) / "tokenizer.json").is_file():
        given, saved = (tokenizer_fingerprint(AutoTokenizer.from_pretrained(str(p))) for p in (cfg.tokenizer, cfg.out))
        if given != saved:
            raise ValueError(f"{cfg.out} holds a finished run trained with another tokenizer than --tokenizer "
                             f"{cfg.tokenizer} (vocabulary fingerprint {saved}, given {given}); pass --force to "
                             "retrain or choose another --out")
    return result


def pretrain(cfg: PretrainConfig, log=print) -> dict:
    """Train (or reuse) a tokenizer and a model as described in the module docstring.

    Returns:
        the ``pretrain.json`` dict: val_loss (nats/token), val_bits_per_byte, params, params_non_embedding,
        tokens_seen, steps, train_s, tokens_per_s, config.

    Raises:
        ValueError: bad size/corpus/budget, or ``cfg.out`` holds a different finished run.
    """
    _check_config(cfg)
    tokenizer = load_or_train_tokenizer(cfg, log)
    if cfg.tokenizer_only:
        return {"tokenizer": cfg.tokenizer, "vocab_size": len(tokenizer)}
    cached = cached_result(cfg)
    if cached is not None:
        log(f"pretrain: reusing {cfg.out} (val loss {cached['val_loss']:.3f}, {cached['params'] / 1e6:.2f}M params)")
        return cached

    device = _resolve_device(cfg.device)
    if cfg.bf16 is None:  # bf16 autocast only where the hardware computes bf16 (distill/precision.py)
        cfg = replace(cfg, bf16=resolve_mixed_precision("auto", device.type) == "bf16")
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    cache_dir = Path(cfg.tokenizer) / "cache"
    train_ids = token_stream(tokenizer, cfg.corpus, "train", cache_dir)
    val_ids = token_stream(tokenizer, cfg.corpus, "validation", cache_dir)
    if len(train_ids) <= cfg.seq_len + 1:
        raise ValueError(f"train split has {len(train_ids)} tokens, fewer than seq_len+1={cfg.seq_len + 1}")

    torch.manual_seed(cfg.seed)
    model = build_model(cfg.size, tokenizer, cfg.max_position_embeddings).to(device).train()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(cfg.seed)
    identity = {**{k: getattr(cfg, k) for k in PretrainConfig.IDENTITY}, "vocab": len(tokenizer)}
    state = {"step": 0, "elapsed_s": 0.0, "tokens_seen": 0, "identity": identity}
    resume = out / RESUME_DIR
    if (out / LEGACY_RESUME_FILE).is_file() and not resume.is_dir():
        raise ValueError(f"{out / LEGACY_RESUME_FILE} is not a resume snapshot of this draftkit version: an earlier "
                         "version stored it as a pickle, which is never unpickled (unpickling can run code). Delete "
                         "it to start this run over, or choose another --out")
    recovered = recover_replaced_dir(resume)  # a crash between replace_dir's two renames
    if recovered is not None:
        log(f"pretrain: {resume} was missing after an interrupted save; restored it from {recovered}")
    if resume.is_dir():
        state = {**load_resume(resume, model, optimizer, gen, identity), "identity": identity}
        log(f"pretrain: resuming {cfg.size} at step {state['step']} ({state['elapsed_s']:.0f}s of {cfg.budget_s:.0f}s)")

    sizes = count_params(model)
    log(f"pretrain: {cfg.size} LlamaForCausalLM, {sizes['params'] / 1e6:.2f}M params "
        f"({sizes['params_non_embedding'] / 1e6:.2f}M non-embedding), {len(train_ids) / 1e6:.2f}M train tokens, "
        f"budget {cfg.budget_s:.0f}s on {device}{' bf16 autocast' if cfg.bf16 else ''}")
    _train_loop(model, optimizer, train_ids, gen, state, cfg, device, resume)
    save_resume(resume, model, optimizer, gen, state)  # the trained steps are kept if evaluation or saving fails

    val_loss = evaluate_loss(model, val_ids, cfg.seq_len, cfg.val_tokens, device, cfg.bf16)
    bytes_per_token = sum(len(t.encode("utf-8")) for t in _corpus_texts(cfg.corpus, "validation")) / len(val_ids)
    result = {
        "val_loss": val_loss,
        "val_bits_per_byte": val_loss / math.log(2) / bytes_per_token,
        **sizes,
        "tokens_seen": state["tokens_seen"],
        "steps": state["step"],
        "train_s": state["elapsed_s"],
        "tokens_per_s": state["tokens_seen"] / max(state["elapsed_s"], 1e-9),
        "train_tokens": len(train_ids),
        "model_config": SIZES[cfg.size],
        "config": {k: v for k, v in asdict(cfg).items() if k not in ("force", "tokenizer_only")},
    }
    try:
        model.save_pretrained(str(out), safe_serialization=True)
        tokenizer.save_pretrained(str(out))
        # whole or not at all: a cut pretrain.json would read as a finished, damaged run
        replace_text(out / RESULT_FILE, json.dumps(result, indent=2) + "\n")
    except (OSError, SafetensorError) as err:  # (safetensors reports a full disk as its own error type)
        raise _not_saved(f"the model to {out}", err, f"the trained steps are kept in {resume}") from err
    shutil.rmtree(resume, ignore_errors=True)
    log(f"pretrain: {cfg.size} done: val loss {val_loss:.3f} nats/token ({result['val_bits_per_byte']:.3f} bits/byte), "
        f"{state['tokens_seen'] / 1e6:.2f}M tokens in {state['step']} steps, {result['tokens_per_s']:.0f} tokens/s "
        f"-> {out}")
    return result


def save_resume(path: Path, model, optimizer, gen: torch.Generator, state: dict) -> None:
    """Write the resume snapshot folder ``path`` (via ``path.tmp``, manifest last, then renamed)."""
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        save_tensors(model.state_dict(), tmp / "model.safetensors")
        tensors, rest = optimizer_to_data(optimizer.state_dict())
        save_tensors(tensors, tmp / "optimizer.safetensors")
        write_json(tmp / "optimizer.json", rest)
        save_tensors({"generator": gen.get_state()}, tmp / "generator.safetensors")
        write_json(tmp / "state.json", state)
        write_manifest(tmp, int(state["step"]))
    except (OSError, SafetensorError) as err:  # (safetensors reports a full disk as its own error type)
        shutil.rmtree(tmp, ignore_errors=True)  # a partial snapshot only holds the space the next try needs
        kept = f"the previous snapshot {path} is intact" if path.is_dir() else "no snapshot was saved before"
        raise _not_saved(f"the resume snapshot {path}", err, kept) from err
    replace_dir(tmp, path)


def _not_saved(what: str, err: Exception, kept: str):
    """The CheckpointError (exit 2) for a write the file system refused (a full disk, a quota)."""
    return CheckpointError(f"could not save {what} ({type(err).__name__}: {err}); {kept}. Free space on that disk, "
                           "then run the same command again to continue")


def load_resume(path: Path, model, optimizer, gen: torch.Generator, identity: dict | None = None) -> dict:
    """Restore model, optimizer and data generator from the snapshot folder ``path``; returns its state dict.

    ``identity`` (this run's ``PretrainConfig.IDENTITY`` fields and tokenizer size) must match the snapshot's:
    continuing another run's snapshot would silently train a different model.

    Raises:
        ValueError (CheckpointError): incomplete snapshot, a file that is not safetensors/JSON, or a snapshot of a
            run with other settings (another size, window, corpus or tokenizer).
    """
    check_complete(path)
    state = read_json(path / "state.json")
    fix = (f"rerun with that run's settings to continue it, or delete {path} (or choose another --out) to start "
           "this run over")
    old = state.get("identity") or {}
    diff = {k: (old[k], v) for k, v in (identity or {}).items() if k in old and old[k] != v}
    if diff:
        raise ValueError(f"{path} is the resume snapshot of a run with other settings {diff} (snapshot, this run): "
                         + fix)
    try:
        model.load_state_dict(load_tensors(path / "model.safetensors"))
    except RuntimeError as err:  # a snapshot without its settings (earlier version) of another model shape
        raise ValueError(f"{path} is the resume snapshot of a model of another shape or tokenizer "
                         f"({str(err).splitlines()[-1].strip()}): {fix}") from None
    load_optimizer(optimizer, path)
    gen.set_state(load_tensors(path / "generator.safetensors")["generator"])
    return state


def _corpus_texts(corpus: str, split: str) -> list[str]:
    return list(load_corpus(corpus, split)["text"])


def _train_loop(model, optimizer, train_ids, gen, state, cfg: PretrainConfig, device, resume: Path) -> None:
    """Steps until the budget (or max_steps) is spent; the LR at each step follows the fraction spent."""
    bar = tqdm(total=int(cfg.budget_s) if cfg.budget_s > 0 else cfg.max_steps, initial=0, unit="s",
               desc=f"pretrain {cfg.size}", mininterval=2.0, dynamic_ncols=True, file=sys.stderr)
    last_save, ema = time.time(), None
    try:
        with StopFlag() as flag:  # Ctrl-C / SIGTERM: finish the step, save the snapshot, stop (a second one: now)
            _steps(model, optimizer, train_ids, gen, state, cfg, device, resume, bar, flag, last_save, ema)
    finally:
        bar.close()


class Interrupted(Exception):
    """Ctrl-C / SIGTERM stopped the training loop after saving its resume snapshot (``args[0]``: the message)."""


def _steps(model, optimizer, train_ids, gen, state, cfg: PretrainConfig, device, resume: Path, bar, flag,
           last_save: float, ema: float | None) -> None:
    while True:
        if flag.stop:
            save_resume(resume, model, optimizer, gen, state)
            raise Interrupted(f"interrupted at step {state['step']} ({state['elapsed_s']:.0f}s of the "
                              f"{cfg.budget_s:.0f}s budget); the snapshot is saved in {resume}: run the same command "
                              "again to resume")
        progress = state["elapsed_s"] / cfg.budget_s if cfg.budget_s > 0 else 0.0
        if cfg.max_steps:
            progress = max(progress, state["step"] / cfg.max_steps)
        if progress >= 1.0:
            break
        t0 = time.time()
        lr = lr_at(progress, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = sample_batch(train_ids, cfg.batch_size, cfg.seq_len, gen).to(device)  # (B, T+1)
        with _autocast(device, cfg.bf16):
            logits = model(input_ids=batch[:, :-1]).logits  # (B, T, V)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dt = time.time() - t0
        state["step"] += 1
        state["elapsed_s"] += dt
        state["tokens_seen"] += batch[:, 1:].numel()
        ema = loss.item() if ema is None else 0.9 * ema + 0.1 * loss.item()
        bar.n = int(state["elapsed_s"]) if cfg.budget_s > 0 else state["step"]
        bar.set_postfix(loss=f"{ema:.3f}", lr=f"{lr:.1e}", tok_s=f"{batch[:, 1:].numel() / dt:.0f}",
                        step=state["step"], refresh=False)
        bar.update(0)
        if time.time() - last_save > cfg.save_every_s:
            save_resume(resume, model, optimizer, gen, state)
            last_save = time.time()


# ---------------------------------------------------------------------------------------------------- CLI

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m quickstart pretrain",
        description="Train a byte-level BPE tokenizer and a Llama model from scratch on a real corpus in a "
                    "wall-clock budget; save a Hugging Face checkpoint. Finished runs are reused, interrupted "
                    "ones resumed.")
    d = PretrainConfig(out="", tokenizer="")
    p.add_argument("--out", help="output folder for the checkpoint (required unless --tokenizer-only)")
    p.add_argument("--tokenizer", required=True, help="tokenizer folder; trained there first if it holds none")
    p.add_argument("--size", default=d.size, choices=sorted(SIZES), help="model size preset")
    p.add_argument("--corpus", default=d.corpus, help="stdlib, tinystories or tinyshakespeare")
    p.add_argument("--vocab-size", type=int, default=d.vocab_size, help="BPE vocabulary (tokenizer training)")
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="training window in tokens")
    p.add_argument("--max-position-embeddings", type=int, default=d.max_position_embeddings)
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="windows per step")
    p.add_argument("--budget-s", type=float, default=d.budget_s, help="training wall-clock budget, seconds")
    p.add_argument("--max-steps", type=int, default=None, help="optional step cap")
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate")
    p.add_argument("--warmup-frac", type=float, default=d.warmup_frac)
    p.add_argument("--val-tokens", type=int, default=d.val_tokens, help="validation tokens scored at the end")
    p.add_argument("--save-every-s", type=float, default=d.save_every_s, help="resume snapshot period")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--device", default=d.device, help="auto, cpu or cuda")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--bf16", dest="bf16", action="store_true", default=None,
                   help="bf16 autocast (default: only where the CPU/GPU computes bf16 natively)")
    p.add_argument("--no-bf16", dest="bf16", action="store_false", help="train in fp32")
    p.add_argument("--force", action="store_true", help="retrain even if --out holds a finished run")
    p.add_argument("--tokenizer-only", action="store_true", help="only train/load the tokenizer")
    return p


def main(argv: list[str] | None = None) -> dict:
    """Entry point of ``python -m quickstart pretrain`` (and ``python -m quickstart.pretrain``)."""
    args = build_parser().parse_args(argv)
    if not args.tokenizer_only and not args.out:
        build_parser().error("--out is required (unless --tokenizer-only)")
    if args.threads is not None and args.threads < 0:
        build_parser().error(f"--threads {args.threads}: give a number of threads >= 1 (0: torch's default)")
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    kw = {k: v for k, v in vars(args).items() if k != "threads"}
    kw["out"] = kw["out"] or ""
    cfg = PretrainConfig(**kw)
    if cfg.budget_s < 0:
        build_parser().error(f"--budget-s {cfg.budget_s:g}: the training budget must be >= 0 seconds (0 needs "
                             "--max-steps), e.g. --budget-s 480")
    try:
        _check_config(cfg)  # before the tokenizer or any model is made
    except ValueError as e:
        build_parser().error(str(e))
    try:
        return pretrain(cfg)
    except (ValueError, CheckpointError) as e:  # what is in --out / --tokenizer: refused before any training
        print(f"python -m quickstart pretrain: error: {e}", file=sys.stderr)
        sys.exit(2)
    except Interrupted as e:
        print(f"python -m quickstart pretrain: {e}", file=sys.stderr)
        sys.exit(INTERRUPTED_EXIT)


if __name__ == "__main__":
    main()
