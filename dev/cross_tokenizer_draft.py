"""Build a draft with a tokenizer of its own from a draft of the target's tokenizer: the real cross-tokenizer pair of
docs/results (a byte-level BPE trained on training corpora, with other ids and merges than the target's).

    python dev/cross_tokenizer_draft.py --target TARGET --draft DRAFT_STEP0 --corpus FILE... --vocab-size 8192 OUT

The new draft keeps DRAFT's layers and final norm. Its input embedding and lm_head rows come from DRAFT's input
embedding and TARGET's lm_head: a new token that is also a target token (the same bytes,
:func:`decode.cross_vocab.intersect_vocabularies`) takes that token's rows; another takes the mean of the rows of
the target's encoding of its text. The tokenizer keeps the target's special tokens and chat template, so the pair
reads the same chat turns.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

from decode.cross_vocab import intersect_vocabularies
from decode.loading import load_causal_lm, load_tokenizer


def corpus_texts(paths: list[str]) -> list[str]:
    """Texts from .txt (blank-line separated) and .jsonl files (every string field of every row)."""
    texts = []
    for path in paths:
        if path.endswith(".jsonl"):
            for line in Path(path).read_text().splitlines():
                texts += [v for v in json.loads(line).values() if isinstance(v, str)]
        else:
            texts += Path(path).read_text().split("\n\n")
    return texts


def train_tokenizer(texts: list[str], size: int, target_tok) -> PreTrainedTokenizerFast:
    specials = list(dict.fromkeys(str(t) for t in target_tok.all_special_tokens))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=size, special_tokens=specials, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    names = {f"{r}_token": getattr(target_tok, f"{r}_token") for r in ("bos", "eos", "unk", "pad")}
    out = PreTrainedTokenizerFast(tokenizer_object=tok, **{k: v for k, v in names.items() if v is not None})
    out.chat_template = target_tok.chat_template
    return out


@torch.no_grad()
def rows_for(new_tok, target_tok, source: torch.Tensor) -> torch.Tensor:
    """``(len(new_tok), H)``: each new token's row of ``source`` (a target-vocabulary matrix)."""
    pairs = intersect_vocabularies(new_tok, target_tok)  # here the new tokenizer plays the target
    out = torch.empty(len(new_tok), source.shape[1], dtype=source.dtype)
    done = torch.zeros(len(new_tok), dtype=torch.bool)
    out[pairs.target_ids] = source[pairs.columns]
    done[pairs.target_ids] = True
    for j in (~done).nonzero().flatten().tolist():
        ids = target_tok(new_tok.decode([j]), add_special_tokens=False)["input_ids"] or [target_tok.unk_token_id or 0]
        out[j] = source[ids].mean(0)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True, help="a draft of the target's tokenizer (pruned or full)")
    ap.add_argument("--corpus", nargs="+", required=True, help="training texts (.txt, .jsonl); no evaluation sets")
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("out")
    args = ap.parse_args(argv)
    if Path(args.out).exists():
        print(f"error: {args.out} exists; give a new folder", file=sys.stderr)
        return 2
    target_tok = load_tokenizer(args.target)
    new_tok = train_tokenizer(corpus_texts(args.corpus), args.vocab_size, target_tok)
    target = load_causal_lm(args.target, "target")
    draft = load_causal_lm(args.draft, "draft")
    cfg = AutoConfig.from_pretrained(args.draft)
    for field in ("draft_vocab_map_size", "draft_vocab_tokenizer_hash"):
        if hasattr(cfg, field):
            delattr(cfg, field)
    cfg.vocab_size, cfg.tie_word_embeddings = len(new_tok), False
    for role in ("bos", "eos", "pad"):
        setattr(cfg, f"{role}_token_id", getattr(new_tok, f"{role}_token_id"))
    model = AutoModelForCausalLM.from_config(cfg)
    state = {k: v for k, v in draft.state_dict().items() if "embed_tokens" not in k and "lm_head" not in k
             and "draft_vocab_map" not in k}
    missing = model.load_state_dict(state, strict=False).missing_keys
    assert sorted(missing) == ["lm_head.weight", "model.embed_tokens.weight"], missing
    with torch.no_grad():
        model.get_input_embeddings().weight.copy_(rows_for(new_tok, target_tok, draft.get_input_embeddings().weight))
        model.get_output_embeddings().weight.copy_(rows_for(new_tok, target_tok,
                                                            target.get_output_embeddings().weight))
    model.save_pretrained(args.out)
    new_tok.save_pretrained(args.out)
    x = intersect_vocabularies(target_tok, new_tok)
    print(f"{args.out}: {len(new_tok)} ids; with the target: {x.summary()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
