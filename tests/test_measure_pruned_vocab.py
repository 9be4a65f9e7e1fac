"""scripts/measure_pruned_vocab.py --tiny: the whole measurement path (prune by target mass, equal-compute
fine-tuning, one interleaved decode run) on a tiny pair it builds; the pruned drafts decode losslessly."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import load_script

REPO = Path(__file__).resolve().parents[1]


def test_tiny_measurement_writes_a_table_and_json_and_never_overwrites(tmp_path):
    out = tmp_path / "pv"
    # flags given with --tiny win over its defaults (they were silently replaced); a keep >= the tiny vocabulary (64)
    # is its full-vocabulary control
    cmd = [sys.executable, str(REPO / "scripts" / "measure_pruned_vocab.py"), "--tiny", "--steps", "2", "--limit", "2",
           "--keeps", "16", "32", "100", "--out", str(out)]
    env = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PATH": "/usr/bin:/bin"}
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "| keep_16 | 16 |" in r.stdout and "| full_64 | 64 |" in r.stdout
    res = json.loads((out / "results.json").read_text())
    assert [d["keep"] for d in res["drafts"]] == [16, 32, 64] and res["steps"] == 2 and res["prompts"] == 2
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


def test_a_greedy_mismatch_is_named_not_only_written_to_the_json():
    script = load_script("measure_pruned_vocab")
    drafts = [{"name": "keep_16", "per_temperature": {"0.0": {"greedy_equal": True}, "1.0": {}}},
              {"name": "keep_32", "per_temperature": {"0.0": {"greedy_equal": False}, "1.0": {}}},
              {"name": "full_64", "per_temperature": {"1.0": {}}}]  # no T = 0 run: nothing to compare
    assert script.greedy_mismatches({"drafts": drafts}) == ["keep_32"]


def _run(*args, timeout=120):
    env = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, str(REPO / "scripts" / "measure_pruned_vocab.py"), *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=timeout)


def test_bad_numbers_and_an_incomplete_pair_are_refused_naming_the_fix(tmp_path, capsys):
    script = load_script("measure_pruned_vocab")
    for flag in (["--mass-examples", "0"], ["--rounds", "0"], ["--limit", "0"], ["--gamma", "0"],
                 ["--max-new-tokens", "1"], ["--keeps", "0"], ["--temperatures", "-1"], ["--steps", "-1"]):
        with pytest.raises(SystemExit) as stop:
            script.main(["--pair", str(tmp_path), "--out", str(tmp_path / "o"), *flag])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and flag[0] in err and "it must be" in err, flag
    for name in ("target", "draft-distilled", "tokenizer"):  # no distill/config.yaml: the training data is unknown
        (tmp_path / "pair" / name).mkdir(parents=True)
    assert script.main(["--pair", str(tmp_path / "pair"), "--out", str(tmp_path / "o")]) == 2
    assert "distill/config.yaml" in capsys.readouterr().err and not (tmp_path / "o").exists()


def test_a_rerun_after_ctrl_c_continues_the_fine_tuning(tmp_path):
    out = tmp_path / "pv"
    r = _run("--tiny", "--steps", "1", "--out", str(out), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    # as if stopped while fine-tuning: keep_16 exported, keep_32 trained but not exported, full_64 mid-training
    (out / "results.json").unlink()
    for name in ("keep_32", "full_64"):
        shutil.rmtree(out / "drafts_tuned" / name)
    for stale in ("step_000001", "best", "latest", "summary.json"):
        path = out / "runs" / "full_64" / stale
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    r = _run("--tiny", "--steps", "1", "--out", str(out), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    tuned = {d["name"]: d for d in res["drafts"]}
    assert tuned["keep_16"]["fine_tune_s"] is None  # reused
    assert tuned["keep_32"]["fine_tune_s"] > 0 and tuned["full_64"]["fine_tune_s"] > 0
    assert all((out / "drafts_tuned" / n / "draftkit_card.json").is_file() for n in tuned)
