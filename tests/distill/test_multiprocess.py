"""Multi-process runs under `accelerate launch` (2 CPU processes over gloo): a signal that reaches one rank, the
logged on-policy fraction, setup lines printed once, and the launcher's mixed_precision and distributed type
against the run's. One launch serves the first three (about 30 s on 2 cores)."""
import json
import subprocess

import pytest

from distill_helpers import PY, REPO, compose, overrides, subprocess_env

LAUNCH = [PY, "-m", "accelerate.commands.launch", "--config_file", str(REPO / "conf/launcher/cpu_2proc.yaml"),
          "--num_processes", "2"]

# Rank 1 alone gets SIGTERM during step 3 (as `kill -TERM <pid of rank 1>` does); rank 0 is never signalled.
SIGNAL_RANK_1 = """
import os, signal, sys
import distill.recipe as recipe
from distill.__main__ import main

real_step = recipe.train_step
def train_step(run, step, micro_position=None):
    if step == 2 and run.accelerator.process_index == 1:
        os.kill(os.getpid(), signal.SIGTERM)
    return real_step(run, step, micro_position)

recipe.train_step = train_step
main(sys.argv[1:])
"""


def launch(args: list[str], timeout: int = 90) -> subprocess.CompletedProcess:
    """Run the launcher; on a hang it and its ranks (each in a session of its own) are killed, by process id."""
    import psutil

    with subprocess.Popen(LAUNCH + args, cwd=REPO, env=subprocess_env(), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True) as p:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            launcher = psutil.Process(p.pid)
            for proc in [*launcher.children(recursive=True), launcher]:
                proc.kill()
            out, _ = p.communicate()
            pytest.fail(f"the 2-process run hung ({timeout}s): {out[-3000:]}")
    return subprocess.CompletedProcess(p.args, p.returncode, out, "")


@pytest.fixture(scope="module")
def signalled_run(pair, tmp_path_factory) -> tuple[subprocess.CompletedProcess, object]:
    """One 2-process run (half of its micro-batches on-policy, precision auto) whose rank 1 alone is signalled
    during step 3."""
    root = tmp_path_factory.mktemp("signalled")
    script = root / "signal_rank_1.py"
    script.write_text(SIGNAL_RANK_1)
    out = root / "run"
    r = launch([str(script), "train", *overrides(pair, out, "train.max_steps=50", "train.save_every=0",
                                                   "data.on_policy_fraction=0.5", "eval.at_start=false",
                                                   "train.mixed_precision=auto")])
    return r, out


def test_a_signal_to_one_rank_stops_every_rank_at_the_same_step(signalled_run):
    """`kill -TERM` of one rank (or a launcher's signal that reaches the ranks at different steps) used to stop
    that rank alone: it entered the checkpoint's collectives while the other ran on, and both hung. Every rank
    must stop after the same step, write one complete checkpoint and exit 0, resumable from there."""
    from distill import checkpoint as ckpt

    r, out = signalled_run
    assert r.returncode == 0, r.stdout[-3000:]
    assert "stopped by signal at step 3; resume with train.resume=true" in r.stdout
    assert json.loads((out / "summary.json").read_text())["steps"] == 3
    assert ckpt.find_latest(out) == out / "step_000003"
    assert (out / "step_000003" / "rng_state_1.json").is_file()  # rank 1 took part in the save


def test_logged_on_policy_fraction_counts_every_process(signalled_run):
    """train/on_policy_fraction_batch is the share of the step's micro-batches, over both processes, that were
    on-policy (each one's λ coin is drawn from (seed, micro-batch id)); it used to count rank 0's alone."""
    import random

    r, out = signalled_run
    assert r.returncode == 0, r.stdout[-3000:]
    cfg = compose(overrides({"target": "t", "draft": "d", "data": "x"}, out))
    logged = {m["step"]: m["train/on_policy_fraction_batch"] for m in map(json.loads, open(out / "metrics.jsonl"))
              if "train/loss" in m}
    # steps 1-3 are micro-batches 0-5, two per step (one per process)
    coins = [random.Random(f"{cfg.train.seed}/{m}").random() < 0.5 for m in range(6)]
    assert logged == {k + 1: (coins[2 * k] + coins[2 * k + 1]) / 2 for k in range(3)}
    assert any(coins[2 * k] != coins[2 * k + 1] for k in range(3))  # a step where rank 0's coin alone would differ


def test_setup_lines_are_printed_once(signalled_run):
    """What setup says (here the precision `auto` chose) is the same on every process: printed by rank 0 alone."""
    r, _ = signalled_run
    assert r.returncode == 0, r.stdout[-3000:]
    assert r.stdout.count("train.mixed_precision=auto ->") == 1, r.stdout[-3000:]


def test_launcher_notes_name_what_the_launcher_asked_for_and_did_not_get():
    from distill.precision import launcher_notes

    assert launcher_notes("no", "no", "MULTI_CPU", {"ACCELERATE_MIXED_PRECISION": "no"}) == []
    assert launcher_notes("bf16", "bf16", "MULTI_GPU", {"ACCELERATE_MIXED_PRECISION": "bf16"}) == []
    assert launcher_notes("bf16", "bf16", "NO", {}) == []
    [note] = launcher_notes("no", "no", "MULTI_GPU", {"ACCELERATE_MIXED_PRECISION": "bf16"})
    assert "mixed_precision=bf16 is not used" in note and "set train.mixed_precision=bf16" in note
    [note] = launcher_notes("no", "no", "MULTI_CPU", {"ACCELERATE_USE_FSDP": "true"})
    assert "asks for FSDP, but this run is MULTI_CPU" in note
    [note] = launcher_notes("bf16", "bf16", "MULTI_CPU", {"ACCELERATE_USE_DEEPSPEED": "true"})
    assert "asks for DEEPSPEED" in note
    assert launcher_notes("bf16", "bf16", "FSDP", {"ACCELERATE_USE_FSDP": "true"}) == []


def test_setup_warns_that_the_launcher_s_mixed_precision_is_not_used(pair, tmp_path, monkeypatch):
    """conf/launcher/ddp.yaml, fsdp.yaml and deepspeed_*.yaml say mixed_precision: bf16, which accelerate launch
    hands to the processes; the recipe passes train.mixed_precision (default no) instead, so a run that looks
    like bf16 trains in float32. The log must say so and name the setting."""
    from distill.recipe import setup

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    lines = []
    run = setup(compose(overrides(pair, tmp_path / "run")), log=lines.append)
    assert run.accelerator.mixed_precision == "no"
    assert any("launcher's mixed_precision=bf16 is not used" in line and "set train.mixed_precision=bf16" in line
               for line in lines), lines
