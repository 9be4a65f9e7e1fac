"""scripts/gpu_bench.sh as a user runs it from another folder: a relative OUT is that folder's, and an earlier
run's results there are never replaced."""
import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_a_relative_out_is_taken_from_the_current_folder(tmp_path):
    (tmp_path / "rel").mkdir()
    (tmp_path / "rel" / "gpu_bench.json").write_text("{}")
    env = dict(os.environ, OUT="rel", GPU_BENCH_TINY="1", GPU_BENCH_SKIP_TESTS="1", OMP_NUM_THREADS="1",
               GPU_BENCH_TIMEOUT="60")
    r = subprocess.run(["bash", str(REPO / "scripts" / "gpu_bench.sh")], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and f"OUT={tmp_path / 'rel'} already holds gpu_bench.json" in r.stderr, r.stderr
    assert [p.name for p in (tmp_path / "rel").iterdir()] == ["gpu_bench.json"]
