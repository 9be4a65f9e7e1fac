"""bench-step: the recipe's step against its bound, written as JSON, never into the run folder."""
import json
import subprocess

import pytest

from distill.bench_step import bench_step
from distill.recipe import train
from distill_helpers import PY, REPO, compose, overrides, subprocess_env


def test_bench_step_cli_writes_json_and_never_overwrites(pair, tmp_path):
    out = tmp_path / "bench.json"
    cmd = [PY, "-m", "distill", "bench-step", "--steps", "1", "--warmup", "0", "--out", str(out),
           *overrides(pair, tmp_path / "run")]
    r = subprocess.run(cmd, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(out.read_text())
    assert {"recipe_step", "target_forward", "draft_forward_backward_optimizer", "collate",
            "divergence_forward_backward", "recipe_step_full_logits", "recipe_step_other_loss_form"} <= set(
        result["median_ms"])
    assert result["loss_form"] == "fused" and result["other_loss_form"] == "autograd"
    assert result["efficiency_other_loss_form"] > 0 and "with the autograd loss" in r.stdout
    assert result["bound_ms"] == pytest.approx(result["median_ms"]["target_forward"] +
                                               result["median_ms"]["draft_forward_backward_optimizer"])
    assert "bound / recipe step" in r.stdout
    again = subprocess.run(cmd, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "exists" in again.stderr


def test_bench_step_writes_nothing_into_the_run_folder(pair, tmp_path):
    """bench-step of a LoRA run on a built draft (whose base setup saves) leaves train.output_dir alone, so the
    train that follows with the same overrides is not refused."""
    run = tmp_path / "run"
    ov = overrides(pair, run, "draft.name_or_path=null", "draft.num_hidden_layers=1", "train.lora.enabled=true",
                   "train.lora.target_modules=[q_proj,v_proj]")
    bench_step(compose(ov), steps=1, warmup=0, log=lambda *_: None)
    assert not run.exists()
    assert train(compose(ov), log=lambda *_: None)["steps"] == 4
