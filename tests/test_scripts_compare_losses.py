"""scripts/compare_losses.sh as a user runs it, with a stand-in python (PYTHON=...) that records every
`python -m distill ...` call and fakes its output: no model is trained, so only the script's own logic is tested
(paths, resuming, checks before the first run)."""
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "compare_losses.sh"

FAKE = f"""#!{sys.executable}
import json, os, sys
from pathlib import Path
args = sys.argv[1:]
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(json.dumps(args) + "\\n")
if args[:3] == ["-m", "distill", "train"]:
    out = Path(next(a.split("=", 1)[1] for a in args if a.startswith("train.output_dir=")))
    (out / "step_000002").mkdir(parents=True, exist_ok=True)
elif args[:3] == ["-m", "distill", "export"]:
    Path(args[4]).mkdir(parents=True)
    (Path(args[4]) / "config.json").write_text("{{}}")
elif args[:1] == ["-"]:  # the evaluation
    Path(args[2], "results.json").write_text("{{}}")
else:  # the settings check: the real interpreter
    os.execv(sys.executable, [sys.executable, *args])
"""


def run(tmp_path: Path, cwd: Path, **env_vars) -> tuple[subprocess.CompletedProcess, list[list[str]]]:
    fake = tmp_path / "fake_python"
    fake.write_text(FAKE)
    fake.chmod(0o755)
    log = tmp_path / "calls.jsonl"
    env = {**os.environ, "PYTHON": str(fake), "FAKE_LOG": str(log), "OMP_NUM_THREADS": "1", "STEPS": "2",
           "SEEDS": "0", "LOSSES": "fkl", **env_vars}
    r = subprocess.run(["bash", str(SCRIPT)], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return r, [c for c in calls if c[:2] == ["-m", "distill"]]


def make_pair(root: Path) -> None:
    for name in ("target", "draft-baseline"):
        (root / name).mkdir(parents=True)
        (root / name / "config.json").write_text("{}")


def test_relative_pair_and_out_are_taken_from_the_current_folder(tmp_path):
    make_pair(tmp_path / "pair")
    r, calls = run(tmp_path, tmp_path, PAIR="pair", OUT="out")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "out" / "results.json").is_file()
    train = next(c for c in calls if c[2] == "train")
    assert f"train.output_dir={tmp_path / 'out' / 'fkl-s0'}" in train
    assert f"++target.name_or_path={tmp_path / 'pair' / 'target'}" in train


def test_an_interrupted_run_resumes_or_starts_over_in_its_own_folder(tmp_path):
    make_pair(tmp_path / "pair")
    stopped = tmp_path / "out" / "fkl-s0"  # Ctrl-C before its first checkpoint: metrics, no step_*
    stopped.mkdir(parents=True)
    (stopped / "metrics.jsonl").write_text('{"step": 1, "train/loss": 1.0}\n')
    r, calls = run(tmp_path, tmp_path, PAIR="pair", OUT="out")
    assert r.returncode == 0, r.stderr
    train = next(c for c in calls if c[2] == "train")
    assert "train.overwrite=true" in train and "train.resume=true" not in train

    (tmp_path / "calls.jsonl").unlink()
    (tmp_path / "out" / "results.json").unlink()
    saved = tmp_path / "out" / "fkl-s1" / "step_000001"  # Ctrl-C after a complete checkpoint
    saved.mkdir(parents=True)
    (saved / "manifest.json").write_text("{}")
    r, calls = run(tmp_path, tmp_path, PAIR="pair", OUT="out", SEEDS="0 1")
    assert r.returncode == 0, r.stderr
    trains = [c for c in calls if c[2] == "train"]
    assert len(trains) == 1  # seed 0's export is reused
    assert "train.resume=true" in trains[0] and "train.overwrite=true" not in trains[0]


def test_bad_settings_stop_the_script_before_any_training(tmp_path):
    make_pair(tmp_path / "pair")
    for setting, named in (({"GAMMA": "0"}, "GAMMA=0"), ({"STEPS": "abc"}, "STEPS=abc"), ({"SEEDS": "a"}, "SEEDS"),
                           ({"EVAL": "eval.max_new_tokens=1"}, "eval.max_new_tokens=1"),
                           ({"EVAL": "eval.nope=1"}, "nope")):
        r, calls = run(tmp_path, tmp_path, PAIR=str(tmp_path / "pair"), OUT=str(tmp_path / "out"), **setting)
        assert r.returncode == 2 and named in r.stderr and "Traceback" not in r.stderr, (setting, r.stderr)
        assert calls == [] and not (tmp_path / "out").exists(), setting


def test_help_prints_the_settings_and_an_argument_is_refused(tmp_path):
    """Found by a new user's trial: --help (like any argument) was ignored and the script went on to train."""
    env = {**os.environ, "PAIR": str(tmp_path / "none"), "OUT": str(tmp_path / "out")}
    r = subprocess.run(["bash", str(SCRIPT), "--help"], env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and "LOSSES=" in r.stdout and "OVERWRITE=1" in r.stdout and not r.stderr
    r = subprocess.run(["bash", str(SCRIPT), "loss=tvd"], env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "takes no arguments (got 'loss=tvd')" in r.stderr
    assert not (tmp_path / "out").exists()
