"""scripts/simulate_auto_gamma.py: the auto-γ controller against every fixed γ by simulation (no model)."""
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(*args):
    return subprocess.run([sys.executable, str(REPO / "scripts" / "simulate_auto_gamma.py"), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


def test_simulation_writes_a_table_and_json_and_never_overwrites(tmp_path):
    out = tmp_path / "sim.json"
    r = run("--alphas", "0.5", "1.0", "--max-new-tokens", "64", "--runs", "20", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "| 64 | 1.00 | 8 |" in r.stdout  # at α = 1 the longest γ wins
    res = json.loads(out.read_text())
    assert [row["alpha"] for row in res["rows"]] == [0.5, 1.0]
    for row in res["rows"]:
        assert set(row["fixed_speedup"]) == {str(g) for g in range(9)}
        assert row["best_speedup"] == max(row["fixed_speedup"].values())
        assert 0 < row["auto_vs_best_fixed"] <= 1.0 + 1e-9
    before = out.read_text()
    again = run("--runs", "2", "--out", str(out))
    assert again.returncode == 2 and "exists" in again.stderr and out.read_text() == before


def test_bad_settings_are_refused_naming_the_flag():
    r = run("--verify-costs", "1,x")
    assert r.returncode == 2 and "--verify-costs" in r.stderr
    r = run("--alphas", "1.5")
    assert r.returncode == 2 and "--alphas" in r.stderr
    r = run("--runs", "0")  # the range is said, not "(see --help)"
    assert r.returncode == 2 and "--runs=0 is out of range: it must be >= 1" in r.stderr


def test_static_batch_simulation_compares_the_planner_with_the_pooled_choice(tmp_path):
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"auto_costs": {str(b): {
        "cost_ratio": 0.2, "target_forward_s": 0.008 + 0.001 * (b - 1),
        "verify": [1.0] + [1.0 + (0.02 + 0.025 * b) * (g + 1) for g in range(1, 9)]} for b in (1, 2, 4)}}))
    negative = tmp_path / "negative.json"
    negative.write_text(json.dumps({"auto_costs": {**json.loads(costs.read_text())["auto_costs"],
                                                   "2": {"cost_ratio": -1.0, "target_forward_s": 0.01,
                                                         "verify": [1.0]}}}))
    bench = tmp_path / "bench.json"  # a python -m decode bench results.json keeps the model under cost.auto_costs
    bench.write_text(json.dumps({"cost": json.loads(costs.read_text())}))
    r = run("--batch-alphas", "0.5,0.9", "--auto-costs", str(bench), "--runs", "5")
    assert r.returncode == 0, r.stderr
    out = tmp_path / "batch.json"
    r = run("--batch-alphas", "0.2,0.9,0.9,1", "--auto-costs", str(costs), "--max-new-tokens", "48", "--runs", "20",
            "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "| 48 |" in r.stdout and "planned / pooled" in r.stdout
    res = json.loads(out.read_text())
    row = res["rows"][0]
    assert res["alphas"] == [0.2, 0.9, 0.9, 1.0] and set(row["fixed_speedup"]) == {str(g) for g in range(9)}
    assert abs(row["fixed_speedup"]["0"] - 1.0) < 1e-9 and row["auto_pooled"] > 0 and row["auto_planned"] > 0
    for args, message in ((["--batch-alphas", "0.5"], "go together"),
                          (["--batch-alphas", "0.5,x", "--auto-costs", str(costs)], "--batch-alphas"),
                          (["--batch-alphas", "0.5,0.5,0.5,0.5,0.5", "--auto-costs", str(costs)], "batch size 8"),
                          (["--batch-alphas", "0.5", "--auto-costs", str(tmp_path / "none.json")], "--auto-costs"),
                          (["--batch-alphas", "0.5,0.5", "--auto-costs", str(negative)], "cost_ratio")):
        r = run(*args, "--runs", "2")
        assert r.returncode == 2 and message in r.stderr, (args, r.stderr)
