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


def load_script(name: str):
    """``scripts/<name>.py`` imported as a module (the scripts are not a package), for tests of their logic."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


@pytest.fixture(scope="module")
def float32_pair():
    """``(target, draft, tokenizer)``: a tiny float32 Llama target, a perturbed copy as its draft, a word tokenizer
    (the measurement scripts' tests: float32 is what the CPU kernels and timings see)."""
    target = tiny_llama(seed=0, layers=2, dtype=torch.float32)
    return target, perturbed_copy(target, 0.5), make_tokenizer()


def script_refuses_before_writing(main, cases, pair_dir: Path, out: Path, capsys) -> None:
    """A measurement script's CLI contract: each ``(argv, message)`` case exits 2 naming the problem and creates no
    ``out``; a second ``out`` that already holds a results.json is refused and left as it was."""
    for argv, message in cases:
        with pytest.raises(SystemExit) as e:
            main([*argv, "--out", str(out)])
        assert e.value.code == 2 and message in capsys.readouterr().err, (argv, message)
        assert not out.exists()
    out.mkdir()
    (out / "results.json").write_text("{}")
    with pytest.raises(SystemExit) as e:
        main(["--pair", str(pair_dir), "--out", str(out)])
    assert e.value.code == 2 and "exists" in capsys.readouterr().err
    assert (out / "results.json").read_text() == "{}"


def quickstart_pair_dir(root: Path, drafts=("draft-distilled",)) -> Path:
    """An empty quickstart-like pair folder (target/, tokenizer/ and the given draft folders) for CLI checks."""
    for d in ("target", "tokenizer", *drafts):
        (root / d).mkdir(parents=True, exist_ok=True)
    return root


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
