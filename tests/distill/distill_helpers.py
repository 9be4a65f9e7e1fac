"""Helpers of the distill tests: a tiny byte-level BPE tokenizer trained here, tiny Llama checkpoints saved with
save_pretrained, Hydra overrides of a seconds-long CPU run, and the environment of subprocess tests."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf

REPO = Path(__file__).resolve().parents[2]
WORDS = ("the draft proposes tokens and the target verifies them in one forward pass so that decoding is fast "
         "def add ( a , b ) : return a + b while x < 10 : x = x + 1 print ( x ) speculative sampling accepts "
         "a token with probability min ( 1 , p / q ) otherwise it resamples from the residual").split()


def corpus_lines(n: int = 200, seed: int = 0) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        k = int(torch.randint(6, 20, (1,), generator=g))
        idx = torch.randint(0, len(WORDS), (k,), generator=g).tolist()
        out.append(" ".join(WORDS[i] for i in idx))
    return out


def make_tokenizer(path: Path, vocab_size: int = 300):
    """A byte-level BPE tokenizer trained on the toy corpus, wrapped as PreTrainedTokenizerFast with bos/eos/pad."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus_lines(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(str(path))
    return fast


def make_llama(path: Path, vocab: int, layers: int, hidden: int = 32, seed: int = 0, tie: bool = False,
               max_pos: int = 128):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_pos, bos_token_id=1,
                      eos_token_id=2, pad_token_id=0, tie_word_embeddings=tie)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # sharper than random init, so α is neither ~0 nor ~1
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(str(path))
    return model



def source(**kw):
    """A ``data.source``-like node (path or corpus, fields, kind, ...)."""
    return OmegaConf.create(kw)


def data_config(**kw):
    """A ``data`` node with the settings examples are built with (``kw`` overrides them)."""
    base = {"max_new_tokens": 8, "chat_template": True, "append_eos": True, "max_prompt_tokens": 64,
            "truncate_prompts": False}
    return OmegaConf.create({**base, **kw})

def overrides(pair: dict, out: Path, *extra: str) -> list[str]:
    """Hydra overrides of a seconds-long CPU run on the tiny pair."""
    return [f"+target.name_or_path={pair['target']}", f"draft.name_or_path={pair['draft']}", "data=jsonl",
            f"data.source.path={pair['data']}", "data.source.completion_field=completion", "data.max_new_tokens=12",
            "data.holdout=4", "eval.num_prompts=4", "eval.max_new_tokens=8", "eval.temperatures=[0.0,1.0]",
            "eval.every=0", "eval.cost_ratio=0.5", "train.batch_size=4", "train.max_steps=4", "train.save_every=2",
            "train.log_every=1", "train.progress=none", "train.cpu=true", "optim.warmup_steps=1",
            f"train.output_dir={out}", *extra]



def cache_overrides(pair: dict, out, cache, k: int = 8, *extra: str) -> list[str]:
    """:func:`overrides` with a logit cache at ``cache`` (k ids per position, shards of 16 examples)."""
    return overrides(pair, out, f"data.logit_cache={cache}", f"data.logit_cache_k={k}",
                     "data.logit_cache_shard_size=16", *extra)

def compose(ov: list[str]):
    from distill.config import compose as _compose

    return _compose(ov)


def subprocess_env() -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", WANDB_MODE="offline", WANDB_SILENT="true",
               TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(REPO))
    env.pop("WANDB_API_KEY", None)
    return env


PY = sys.executable
