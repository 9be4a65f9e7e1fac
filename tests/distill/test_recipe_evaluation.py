"""The recipe's evaluation: teacher-forced by default on held-out target responses generated once per run, its wall
time logged and summed, and a pruned draft's coverage measured on that held-out text."""
import json

import pytest

from distill import evaluate
from distill.config import SetupError
from distill.export import export
from distill.recipe import train
from distill_helpers import compose, overrides

KEEP = 60


def _rows(out):
    return [json.loads(line) for line in open(out / "metrics.jsonl")]


def test_a_run_evaluates_teacher_forced_on_heldout_responses_and_times_it(pair, tmp_path, monkeypatch):
    out, lines = tmp_path / "run", []
    s = train(compose(overrides(pair, out, "eval.every=2")), log=lines.append)
    evals = [r for r in _rows(out) if "eval/acceptance_rate" in r]
    assert [r["step"] for r in evals] == [0, 2, 4]
    for r in evals:
        assert r["eval"]["method"] == "teacher_forced" and r["eval/eval_s"] == r["eval"]["eval_s"] > 0
        for row in r["eval"]["per_temperature"].values():
            assert 0.0 <= row["alpha"] <= 1.0 and row["num_positions"] > 0
            assert row["mean_accepted_length"] == pytest.approx((1 - row["alpha"] ** 5) / (1 - row["alpha"]))
    saved = json.loads((out / "eval_heldout.json").read_text())
    assert len(saved["completions"]) == 4 and saved["settings"]["max_new_tokens"] == 8
    ev = s["evaluation"]
    spent = ev["eval_s"] + ev["heldout_s"] + ev["costs_s"]
    assert ev["eval_s"] == pytest.approx(sum(r["eval/eval_s"] for r in evals))
    assert ev["share"] == pytest.approx(spent / ev["wall_s"]) and 0 < ev["share"] < 1
    assert any(m.startswith("evaluation: ") and f"({ev['share']:.1%})" in m for m in lines)
    assert any(m.startswith("step 2: ") and "teacher_forced" in m for m in lines)

    # a resumed run scores the same text without generating it again, and refuses other settings
    monkeypatch.setattr(evaluate, "greedy_completions", lambda *a, **k: pytest.fail("generated again"))
    more = train(compose(overrides(pair, out, "eval.every=2", "train.resume=true", "train.max_steps=6")),
                 log=lambda *_: None)
    assert more["steps"] == 6 and json.loads((out / "eval_heldout.json").read_text()) == saved
    lines.clear()
    train(compose(overrides(pair, out, "eval.method=generate", "train.resume=true", "train.max_steps=7")),
          log=lines.append)
    assert ("warning: eval.method=generate but this run evaluated with teacher_forced so far: best/ will compare "
            "numbers measured both ways; resume with eval.method=teacher_forced to keep them comparable") in lines
    with pytest.raises(SetupError, match=r"eval_heldout.json holds the held-out responses of other settings: "
                                         r"max_new_tokens \(file 8, config 6; set by eval.max_new_tokens\)"):
        train(compose(overrides(pair, out, "eval.max_new_tokens=6", "train.resume=true", "train.max_steps=9")),
              log=lambda *_: None)


def test_generate_keeps_the_decoders_measurement_and_needs_no_heldout_responses(pair, tmp_path):
    out = tmp_path / "run"
    s = train(compose(overrides(pair, out, "eval.method=generate", "train.max_steps=1")), log=lambda *_: None)
    assert s["last_eval"]["method"] == "generate" and s["last_eval"]["eval_s"] > 0
    assert s["evaluation"]["heldout_s"] < 0.01 and not (out / "eval_heldout.json").exists()


def test_a_pruned_draft_reports_its_coverage_on_heldout_text_and_warns_on_small_data(pair, tmp_path):
    out, lines = tmp_path / "run", []
    s = train(compose(overrides(pair, out, f"draft.vocab.keep={KEEP}", "loss=tvd", "eval.method=generate",
                                "train.max_steps=1")), log=lines.append)
    v = s["vocab"]
    assert v["keep"] == KEEP and 0 < v["heldout_mass"] <= 1 and 0 <= v["heldout_token_share"] <= 1
    assert v["heldout_positions"] == sum(len(c) for c in
                                         json.loads((out / "eval_heldout.json").read_text())["completions"])
    assert 0 < v["selection_mass"] <= 1 and v["selection_positions"] > 0
    assert any(f"on {v['heldout_positions']} held-out target tokens the kept ids carry" in m for m in lines)
    vocab_row = next(r for r in _rows(out) if "vocab/heldout_mass" in r)
    assert vocab_row["step"] == 0 and vocab_row["vocab/heldout_token_share"] == v["heldout_token_share"]
    # the tiny data scores far fewer than 20 positions per kept id: said, naming the keys to change
    assert v["selection_positions"] < 20 * KEEP
    assert any(m.startswith(f"warning: draft.vocab.keep={KEEP} ids were chosen from {v['selection_positions']} "
                            "scored positions") and "data.source.limit" in m for m in lines)
    state = json.loads((out / "step_000001" / "trainer_state.json").read_text())
    assert state["vocab"] == v
    card = export(out / "step_000001", tmp_path / "export")
    assert card["draft_vocab"]["heldout_mass"] == v["heldout_mass"]
    assert card["draft_vocab"]["heldout_token_share"] == v["heldout_token_share"]
    readme = (tmp_path / "export" / "README.md").read_text()
    assert f"on {v['heldout_positions']} held-out target tokens they carry {v['heldout_mass']:.1%}" in readme


def test_cached_mode_loads_the_target_to_evaluate_only_when_asked(pair, tmp_path):
    from distill.cache_logits import build_cache
    from distill_helpers import cache_overrides

    cache, V = tmp_path / "cache", pair["vocab"]
    build_cache(compose(cache_overrides(pair, tmp_path / "c", cache, V, "loss=fkl")), log=lambda *_: None)
    ov = ("loss=fkl", "train.max_steps=2", "data.target_logits=cached")
    plain = train(compose(cache_overrides(pair, tmp_path / "plain", cache, V, *ov)), log=lambda *_: None)
    assert plain["last_eval"] is None and plain["initial_eval"] is None
    lines = []
    s = train(compose(cache_overrides(pair, tmp_path / "eval", cache, V, *ov, "eval.with_cached_logits=true")),
              log=lines.append)
    assert s["initial_eval"]["method"] == s["last_eval"]["method"] == "teacher_forced"
    assert s["last_eval"]["per_temperature"]["1.0"]["num_positions"] > 0
    # training read the cache all the same: the same losses as the run without a target
    losses = [[r["train/loss"] for r in _rows(tmp_path / d) if "train/loss" in r] for d in ("plain", "eval")]
    assert losses[0] == losses[1]
    export(tmp_path / "eval" / "best", tmp_path / "export")  # the card says how α was measured
    assert "α is teacher-forced" in (tmp_path / "export" / "README.md").read_text()
