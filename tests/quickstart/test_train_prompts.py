"""Training prompts for the real quickstart: every kind, from training corpora only, deterministic, no eval text."""
from __future__ import annotations

import json

import pytest

from decode.prompts import load_prompts
from quickstart import train_prompts as tp


def test_every_kind_grouped_then_an_interleaved_tail_and_deterministic():
    rows = tp.build_prompts(4, seed=1)
    assert len(rows) == 4 * len(tp.KINDS)
    assert [r["kind"] for r in rows[:4]] == ["conversation"] * 4  # grouped: similar lengths batch together
    tailed = tp.build_prompts(4, seed=1, tail_per_kind=1)
    assert [r["kind"] for r in tailed[-len(tp.KINDS):]] == list(tp.KINDS)  # a held-out tail covers every kind
    assert sorted(map(str, tailed)) == sorted(map(str, rows))
    with pytest.raises(ValueError, match="data.holdout"):
        tp.build_prompts(2, tail_per_kind=3)
    assert rows == tp.build_prompts(4, seed=1)
    assert rows != tp.build_prompts(4, seed=2)
    assert all(r["prompt"].strip() for r in rows)
    by = {k: [r["prompt"] for r in rows if r["kind"] == k] for k in tp.KINDS}
    assert all(p.startswith("Translate English to ") for p in by["translation"])
    assert all(p.startswith("Summarize: ") and len(p) > 800 for p in by["summarization"])
    assert all(p.count("\n") >= 3 and p.endswith("?") for p in by["rag"])


def test_no_evaluation_prompt_is_a_training_prompt():
    rows = tp.build_prompts(40, seed=0)
    train = {" ".join(r["prompt"].lower().split()) for r in rows}
    for name in ("spec_bench", "mt_bench", "gsm8k", "humaneval", "mbpp"):
        for p in (q.text for q in load_prompts(name)):
            assert " ".join(p.lower().split()) not in train, (name, p[:80])
    gsm8k_test = {" ".join(p.text.lower().split()) for p in load_prompts("gsm8k")}
    maths = [" ".join(r["prompt"].lower().split()) for r in rows if r["kind"] == "math_reasoning"]
    assert maths and not gsm8k_test.intersection(maths)


def test_mojibake_is_repaired():
    assert tp.fix_mojibake("â€œHi,â€ she said. Itâ€™s") == "“Hi,” she said. It’s"
    assert not any("â€" in s for s in tp.stories()[:500])


def test_bad_settings_and_write(tmp_path):
    with pytest.raises(ValueError, match="per_kind"):
        tp.build_prompts(0)
    with pytest.raises(ValueError, match="unknown kind"):
        tp.build_prompts(1, kinds=("poetry",))
    path = tp.write_prompts(tmp_path / "p" / "train.jsonl", tp.build_prompts(1, kinds=("qa", "translation")))
    assert [json.loads(line)["kind"] for line in path.read_text().splitlines()] == ["qa", "translation"]
    assert not list(path.parent.glob("*.tmp"))


def test_missing_corpus_names_the_setting(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTKIT_SHARED_DATA", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="DRAFTKIT_SHARED_DATA"):
        tp.build_prompts(1, kinds=("math_reasoning",))
