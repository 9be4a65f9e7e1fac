"""scripts/measure_pruned_vocab.py --tiny: the whole measurement path (prune by target mass, equal-compute
fine-tuning, one interleaved decode run) on a tiny pair it builds; the pruned drafts decode losslessly."""
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_tiny_measurement_writes_a_table_and_json_and_never_overwrites(tmp_path):
    out = tmp_path / "pv"
    cmd = [sys.executable, str(REPO / "scripts" / "measure_pruned_vocab.py"), "--tiny", "--steps", "2", "--out",
           str(out)]
    env = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PATH": "/usr/bin:/bin"}
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "| keep_16 | 16 |" in r.stdout and "| full_64 | 64 |" in r.stdout
    res = json.loads((out / "results.json").read_text())
    assert [d["keep"] for d in res["drafts"]] == [16, 32, 64] and res["steps"] == 2
    for d in res["drafts"]:
        assert d["lm_head_rows"] == d["keep"]
        assert Path(d["path"]).parent.name == "drafts_tuned"  # every draft, the control too, was fine-tuned
        assert d["draft_forward_ms"] > 0 and d["cost_ratio"] > 0 and 0 < d["mass_kept"] <= 1
        assert d["per_temperature"]["0.0"]["greedy_equal"] is True
        for t in ("0.0", "1.0"):
            row = d["per_temperature"][t]
            assert 0 <= row["alpha"] <= 1 and row["mean_accepted_length"] >= 1 and row["speedup"] > 0
    before = (out / "results.json").read_text()
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 2 and "exists" in r.stderr
    assert (out / "results.json").read_text() == before
