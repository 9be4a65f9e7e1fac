"""scripts/measure_auto_batch.py: the interleaved static-batch run on a tiny float32 pair (every method decodes
losslessly, the planned and the pooled controller share one cost model), integer parsing, and bad input refused
with exit status 2 before anything is written."""
import pytest

from tests.conftest import load_script, quickstart_pair_dir, script_refuses_before_writing

script = load_script("measure_auto_batch")


def test_measure_rows_and_greedy_equality(float32_pair):
    target, draft, tok = float32_pair
    prompts = [[5, 9, 14], [20, 7, 3, 11], [30], [8, 8, 2], [17, 4]]
    res = script.measure(target, draft, tok, prompts, batch_sizes=[2, 4], gammas=[2], temperatures=[0.0, 1.0],
                         max_new_tokens=6, rounds=2, max_auto=3)
    assert res["methods"] == ["plain", "g2", "auto", "auto_pooled"]
    assert sorted(res["auto_costs"]) == ["1", "2", "4"]  # measured once, shared by both auto decoders
    # T = 0: (2 groups of 2 + 1 group of 4) x 2 rounds x 3 methods beside plain
    assert res["greedy_equal"] == [18, 18]
    assert [(r["temperature"], r["batch_size"]) for r in res["rows"]] == [(0.0, 2), (0.0, 4), (1.0, 2), (1.0, 4)]
    for r in res["rows"]:
        assert r["new_tokens"] == 4 * 2 * 6  # 4 rows per batch size (2 groups of 2, 1 of 4), 2 rounds
        assert r["plain"]["speedup"] == 1.0 and r["plain"]["draft_forwards"] == 0
        for m in res["methods"][1:]:
            assert r[m]["wall_s"] > 0 and r[m]["speedup"] > 0 and 0 <= r[m]["alpha"] <= 1


def test_parse_ints():
    assert script.parse_ints("8,4,4", "--batch-sizes", 2) == [4, 8]
    for bad, message in (("1", "must be >= 2"), ("2,x", "not an integer")):
        with pytest.raises(ValueError, match=message):
            script.parse_ints(bad, "--batch-sizes", 2)


def test_bad_input_exits_2_before_writing(tmp_path, capsys):
    pair_dir = quickstart_pair_dir(tmp_path / "pair")
    cases = [
        (["--pair", str(tmp_path / "missing")], "lacks target, tokenizer"),
        (["--pair", str(pair_dir), "--gammas", "0"], "--gammas: 0 must be >= 1"),
        (["--pair", str(pair_dir), "--draft", "draft-baseline"], "--draft draft-baseline: no such folder"),
        (["--pair", str(pair_dir), "--batch-sizes", "1,4"], "--batch-sizes: 1 must be >= 2"),
        (["--pair", str(pair_dir), "--rounds", "0"], "--rounds must be >= 1"),
        (["--pair", str(pair_dir), "--temperatures", "-1"], "--temperatures must be >= 0"),
        (["--pair", str(pair_dir), "--temperatures", "0,x"], "--temperatures: 'x' is not a number"),
        (["--pair", str(pair_dir), "--limit", "2", "--batch-sizes", "8"], "fewer than batch size 8"),
    ]
    script_refuses_before_writing(script.main, cases, pair_dir, tmp_path / "out", capsys)


@pytest.mark.parametrize("name, args", [
    ("measure_auto_batch", ["--limit", "1", "--max-new-tokens", "6", "--rounds", "1", "--batch-sizes", "2",
                            "--gammas", "2", "--temperatures", "0"]),
    ("measure_few_row_linear", ["--limit", "1", "--rounds", "1"]),
])
def test_the_script_runs_end_to_end_and_writes_its_results(float32_pair, tmp_path, name, args):
    """A check of --out once dropped the name of the results file that main() writes at the end (a NameError after
    the whole measurement); main() is run through to its results.json here."""
    target, draft, tok = float32_pair
    pair = tmp_path / "pair"
    for sub, obj in (("target", target), ("draft-distilled", draft), ("tokenizer", tok)):
        obj.save_pretrained(pair / sub)
    assert load_script(name).main(["--pair", str(pair), *args, "--out", str(tmp_path / "out")]) in (0, None)
    assert (tmp_path / "out" / "results.json").is_file()
