"""Shared fixtures: tiny real Hugging Face models built from configs (no hub access) and a real tokenizer."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

# CI has 2 cores; more threads than cores thrash.
torch.set_num_threads(1)


def _test_device() -> torch.device:
    """DRAFTKIT_TEST_DEVICE (cpu | cuda | cuda:N; default cpu): where tests that opt in (``TEST_DEVICE``) put their
    models, so ``DRAFTKIT_TEST_DEVICE=cuda pytest tests/decode`` runs them on a GPU (scripts/gpu_bench.sh)."""
    name = os.environ.get("DRAFTKIT_TEST_DEVICE", "cpu").strip() or "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise RuntimeError(f"DRAFTKIT_TEST_DEVICE={name!r} is not a torch device; use cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"DRAFTKIT_TEST_DEVICE={name!r} but this torch build sees no CUDA device; unset it or "
                           "use cpu")
    if device.type not in ("cpu", "cuda"):
        raise RuntimeError(f"DRAFTKIT_TEST_DEVICE={name!r}: only cpu and cuda are supported")
    return device


TEST_DEVICE = _test_device()

VOCAB = 96


def tiny_llama(vocab_size: int = VOCAB, layers: int = 2, hidden: int = 32, seed: int = 0, dtype=torch.float64, **kw):
    """A randomly initialised LlamaForCausalLM small enough to run in milliseconds on CPU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=kw.pop("max_position_embeddings", 256),
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        **kw,
    )
    model = LlamaForCausalLM(cfg).to(dtype).eval()
    # Random init gives near-uniform logits; sharpen them so sampled text has structure and greedy ties are rare.
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    return model


def tiny_gpt2(vocab_size: int = VOCAB, layers: int = 2, hidden: int = 32, seed: int = 0, dtype=torch.float64):
    """A randomly initialised GPT2LMHeadModel (learned absolute positions, fused qkv)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=vocab_size, n_embd=hidden, n_layer=layers, n_head=4, n_positions=256,
                     bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    model = GPT2LMHeadModel(cfg).to(dtype).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    return model


@pytest.fixture
def target():
    return tiny_llama(seed=0, layers=2)


@pytest.fixture
def draft():
    return tiny_llama(seed=1, layers=1)


def perturbed_copy(model, noise: float = 0.5, seed: int = 0):
    """A draft that agrees with ``model`` often but not always: a copy with Gaussian noise on the lm_head."""
    import copy

    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        w = draft.lm_head.weight
        w.add_(noise * w.std() * torch.randn(w.shape, generator=g, dtype=w.dtype))
    return draft


def make_tokenizer(words: list[str] | None = None, **special):
    """A real ``PreTrainedTokenizerFast`` (word-level, whitespace split) built in memory with the tokenizers
    library; ids 0-3 are <pad>, <s>, </s>, <unk> unless ``special`` overrides the special tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = words if words is not None else [f"w{i}" for i in range(VOCAB - 4)]
    vocab = {t: i for i, t in enumerate(["<pad>", "<s>", "</s>", "<unk>"] + words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    kw = dict(pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    kw.update(special)
    return PreTrainedTokenizerFast(tokenizer_object=tok, **kw)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty private hub cache that huggingface_hub and transformers read instead of ~/.cache."""
    import huggingface_hub.constants

    cache = tmp_path / "hf_home" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    return cache


def put_snapshot(cache: Path, repo: str, commit: str, folder: Path) -> Path:
    """Copy ``folder`` (a save_pretrained output) in as ``repo``'s snapshot ``commit`` and point refs/main at it,
    as ``hf download`` of a new revision does."""
    root = cache / f"models--{repo.replace('/', '--')}"
    snap = root / "snapshots" / commit
    shutil.copytree(folder, snap)
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(commit)
    return snap


def full_disk_for(monkeypatch, marker: str):
    """Make ``Path.write_text`` fail like a real full disk (the file is opened and truncated, then ENOSPC) for texts
    that contain ``marker``; other writes go through. Returns a function that restores the real ``write_text``."""
    import errno
    import pathlib

    real = pathlib.Path.write_text

    def write_text(self, text, *args, **kwargs):
        if marker in text:
            real(self, "", *args, **kwargs)
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return real(self, text, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "write_text", write_text)
    return lambda: monkeypatch.setattr(pathlib.Path, "write_text", real)
