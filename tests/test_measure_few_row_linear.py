"""scripts/measure_few_row_linear.py: the linear-forms pass, forward costs and the interleaved end-to-end run on a
tiny float32 pair (both sides decode losslessly), γ and row parsing, and bad input refused with exit status 2
before anything is written."""
import json

import pytest
import torch

from tests.conftest import load_script, quickstart_pair_dir, script_refuses_before_writing

script = load_script("measure_few_row_linear")


def test_linear_forms_time_every_form_over_the_models_linear_layers(float32_pair):
    target, _, _ = float32_pair
    forms = script.linear_forms(target, [1, 3, 12], repeats=2)
    assert forms["num_linear_layers"] == sum(isinstance(m, torch.nn.Linear) for m in target.modules()) > 0
    assert sorted(forms["ms"]) == ["f_linear", "packed", "transposed"]  # the CPU wheel has oneDNN
    for by_rows in forms["ms"].values():
        assert sorted(by_rows) == [1, 3, 12] and all(v > 0 for v in by_rows.values())


def test_parse_rows():
    assert script.parse_rows("1,2,64") == [1, 2, 64]
    for bad, message in (("0", "outside 1..64"), ("65", "outside 1..64"), ("2,x", "not an integer")):
        with pytest.raises(ValueError, match=message):
            script.parse_rows(bad)


def test_forward_costs_on_and_off(float32_pair):
    target, draft, _ = float32_pair
    costs = script.forward_costs(target, draft, torch.tensor([[5, 9, 14, 20, 7, 3, 11, 30]]), repeats=3,
                                 max_gamma=3, rounds=2)
    for label in ("on", "off"):
        assert len(costs[label]) == 2
        for r in costs[label]:
            assert r["target_forward_ms"] > 0 and r["draft_forward_ms"] > 0 and r["cost_ratio"] > 0
            assert sorted(r["verify_forward_ms"]) == [1, 2, 3]


def test_end_to_end_rows_and_greedy_equality(float32_pair):
    target, draft, tok = float32_pair
    prompts = [[5, 9, 14], [20, 7, 3, 11], [30]]
    e2e = script.end_to_end(target, draft, tok, prompts, {0.0: 3, 1.0: 2}, max_new_tokens=8, rounds=2)
    assert e2e["greedy_equal"] == [18, 18]  # 3 prompts x 2 rounds x (plain on, spec on, spec off) at T = 0
    assert [(r["temperature"], r["num_draft_tokens"]) for r in e2e["rows"]] == [(0.0, 3), (1.0, 2)]
    for r in e2e["rows"]:
        assert r["new_tokens"] == 3 * 2 * 8
        for m in ("plain_on", "plain_off", "spec_on", "spec_off"):
            assert r[m]["wall_s"] > 0 and r[m]["tokens_per_s"] > 0
        for m in ("spec_on", "spec_off"):
            assert r[m]["speedup"] > 0 and 0 <= r[m]["alpha"] <= 1 and r[m]["mean_accepted_length"] >= 1


def test_parse_gammas(tmp_path):
    assert script.parse_gammas("0:8,1:7", tmp_path) == {0.0: 8, 1.0: 7}
    assert script.parse_gammas(None, tmp_path) == {0.0: 4, 1.0: 4}
    (tmp_path / "results.json").write_text(json.dumps({"eval": {"gammas": {"distilled": {"0.0": 5, "1.0": 3}}}}))
    assert script.parse_gammas(None, tmp_path) == {0.0: 5, 1.0: 3}  # the pair's quickstart choice
    for bad in ("0:x", "0:0", "1"):
        with pytest.raises(ValueError, match="--gammas"):
            script.parse_gammas(bad, tmp_path)


def test_bad_input_exits_2_before_writing(tmp_path, capsys):
    pair_dir = quickstart_pair_dir(tmp_path / "pair")
    cases = [
        (["--pair", str(tmp_path / "missing")], "lacks target, draft-distilled, tokenizer"),
        (["--pair", str(pair_dir), "--gammas", "0:0"], "γ must be >= 1"),
        (["--pair", str(pair_dir), "--rounds", "0"], "--rounds must be >= 1"),
        (["--pair", str(pair_dir), "--linear-rows", "1,99"], "outside 1..64"),
    ]
    script_refuses_before_writing(script.main, cases, pair_dir, tmp_path / "out", capsys)
