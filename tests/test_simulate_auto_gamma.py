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
