"""scripts/gpu_train_check.sh runs its whole Python part on CPU with tiny models (DRAFTKIT_GPU_CHECK_TINY=1):
reference runs, the two-process launcher and the cached mode, each compared with its float32 reference; without
a GPU and without the variable it refuses to start."""
import json
import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _env(**extra):
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=str(REPO), **extra)
    env.pop("DRAFTKIT_GPU_CHECK_TINY", None)
    env.update(extra)
    return env


def test_tiny_cpu_run_of_the_gpu_check(tmp_path):
    out = tmp_path / "check"
    r = subprocess.run(["bash", "scripts/gpu_train_check.sh", "--out", str(out), "--steps", "2", "--k", "16"],
                       cwd=REPO, env=_env(DRAFTKIT_GPU_CHECK_TINY="1"), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads((out / "gpu_train_check.json").read_text())
    rows = {row["run"]: row for row in report["rows"]}
    assert report["tiny"] and len(rows) == 4 and all(row["ok"] for row in rows.values())
    ref = rows["reference: CPU fp32 online"]
    assert len(ref["losses"]) == 2 and ref["peak_memory_mb"] > 0
    # two CPU processes in fp32 reproduce the one-process reference (same data, exact token-count division)
    assert rows["cpu_2proc"]["max_rel_diff"] < 1e-4
    cached = next(row for name, row in rows.items() if name.startswith("cached"))
    assert cached["max_rel_diff"] < 1e-4 and cached["cache"]["k"] == 16 and cached["cache"]["tokens"] > 0
    assert "max rel Δloss" in r.stdout
    again = subprocess.run(["bash", "scripts/gpu_train_check.sh", "--out", str(out)], cwd=REPO,
                           env=_env(DRAFTKIT_GPU_CHECK_TINY="1"), capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "exists" in again.stderr


def test_refuses_to_start_without_a_gpu(tmp_path):
    r = subprocess.run(["bash", "scripts/gpu_train_check.sh", "--out", str(tmp_path / "x")], cwd=REPO,
                       env=_env(CUDA_VISIBLE_DEVICES=""), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "DRAFTKIT_GPU_CHECK_TINY=1" in r.stderr


def test_a_relative_out_is_taken_from_the_current_folder(tmp_path):
    (tmp_path / "rel").mkdir()
    (tmp_path / "rel" / "gpu_train_check.json").write_text("{}")  # an earlier result there: refused, kept
    r = subprocess.run(["bash", str(REPO / "scripts" / "gpu_train_check.sh"), "--out", "rel"], cwd=tmp_path,
                       env=_env(DRAFTKIT_GPU_CHECK_TINY="1"), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and str(tmp_path / "rel") in r.stderr, r.stderr[-2000:]
    assert [p.name for p in (tmp_path / "rel").iterdir()] == ["gpu_train_check.json"]
