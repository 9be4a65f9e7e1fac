"""Fixtures of the distill tests (helpers in distill_helpers.py)."""
from __future__ import annotations

import json

import pytest

from distill_helpers import corpus_lines, make_llama, make_tokenizer


@pytest.fixture(scope="session")
def pair(tmp_path_factory) -> dict:
    """Paths of a tiny tokenizer, a 2-layer target, a 1-layer draft and a prompt/completion jsonl."""
    root = tmp_path_factory.mktemp("pair")
    tok = make_tokenizer(root / "tokenizer")
    vocab = len(tok)
    make_llama(root / "target", vocab, layers=2, seed=0)
    tok.save_pretrained(str(root / "target"))
    make_llama(root / "draft", vocab, layers=1, seed=1)
    tok.save_pretrained(str(root / "draft"))
    lines = corpus_lines(80, seed=1)
    data = root / "data.jsonl"
    with open(data, "w") as f:
        for line in lines:
            words = line.split()
            cut = max(2, len(words) // 2)
            f.write(json.dumps({"prompt": " ".join(words[:cut]), "completion": " " + " ".join(words[cut:])}) + "\n")
    text = root / "docs.txt"
    text.write_text("\n\n".join(" ".join(corpus_lines(6, seed=s)) for s in range(10)))
    return {"root": root, "tokenizer": root / "tokenizer", "target": root / "target", "draft": root / "draft",
            "data": data, "text": text, "vocab": vocab}


@pytest.fixture
def tok(pair):
    """The pair's tokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(pair["tokenizer"]))
