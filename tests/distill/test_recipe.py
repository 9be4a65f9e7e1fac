"""The training recipe on a tiny target/draft pair: it trains, logs, evaluates α/τ, keeps the best checkpoint,
accumulates gradients exactly, resumes exactly, rolls out on-policy, and writes an offline W&B run."""
import glob
import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from distill.config import SetupError
from distill.recipe import lr_lambda, train
from distill_helpers import compose, overrides


def _metrics(out):
    return [json.loads(line) for line in open(out / "metrics.jsonl")]


def _losses(out):
    return {m["step"]: m["train/loss"] for m in _metrics(out) if "train/loss" in m}


def _weights(path):
    return load_file(str(path / "model.safetensors"))


def test_train_logs_evaluates_and_keeps_best(pair, tmp_path):
    out = tmp_path / "run"
    summary = train(compose(overrides(pair, out, "eval.every=2", "optim.lr=3e-3")), log=lambda *_: None)
    assert summary["steps"] == 4 and summary["num_processes"] == 1
    losses = _losses(out)
    assert sorted(losses) == [1, 2, 3, 4] and all(torch.isfinite(torch.tensor(v)) for v in losses.values())
    evals = [m for m in _metrics(out) if "eval/acceptance_rate" in m]
    assert [m["step"] for m in evals] == [0, 2, 4]  # baseline, every 2 steps, end
    for m in evals:
        per_t = m["eval"]["per_temperature"]
        assert set(per_t) == {"0.0", "1.0"}
        for v in per_t.values():
            assert 0.0 <= v["acceptance_rate"] <= 1.0 and 1.0 <= v["mean_accepted_length"] <= 5.0
            assert sum(v["accepted_length_histogram"]) > 0 and len(v["accepted_length_histogram"]) == 5
    best = summary["best"]
    trained = [m for m in evals if m["step"] > 0]
    assert best["value"] == max(m["eval/acceptance_rate"] for m in trained)
    state = json.loads((out / "best" / "trainer_state.json").read_text())
    assert state["best"]["step"] == best["step"] and state["last_eval"]["step"] == best["step"]
    assert (out / "latest").read_text() == "step_000004"
    assert sorted(p.name for p in out.glob("step_*")) == ["step_000002", "step_000004"]  # keep_last=2
    for key in ("train/lr", "train/tokens_per_s", "train/grad_norm"):
        assert key in _metrics(out)[1]


def test_best_by_predicted_speedup(pair, tmp_path):
    out = tmp_path / "run"
    summary = train(compose(overrides(pair, out, "eval.every=1", "eval.select_by=predicted_speedup", "optim.lr=3e-3",
                                      "eval.temperatures=[1.0]")), log=lambda *_: None)
    evals = [m for m in _metrics(out) if "eval/predicted_speedup" in m and m["step"] > 0]
    assert summary["best"]["metric"] == "predicted_speedup"
    assert summary["best"]["value"] == max(m["eval/predicted_speedup"] for m in evals)


def test_distillation_raises_acceptance(pair, tmp_path):
    """The point of the recipe: α of the draft goes up when it is trained on the target's distribution."""
    out = tmp_path / "run"
    summary = train(compose(overrides(pair, out, "train.max_steps=30", "optim.lr=1e-2", "optim.warmup_steps=2",
                                      "eval.temperatures=[1.0]", "eval.max_new_tokens=96", "data.holdout=16",
                                      "eval.num_prompts=16", "loss=fkl", "train.save_every=0")),
                    log=lambda *_: None)
    # Random target, so only sampled acceptance has room to move. 4 prompts x 8 tokens gave α swings of ±0.15 between
    # random streams; 16 x 96 measured 0.24 -> 0.33 (other eval seeds: +0.06 .. +0.09).
    assert summary["last_eval"]["acceptance_rate"] > summary["initial_eval"]["acceptance_rate"] + 0.05
    losses = _losses(out)
    assert losses[30] < losses[1]


def test_gradient_accumulation_matches_bigger_batch(pair, tmp_path):
    """batch 4 x accum 1 and batch 2 x accum 2 see the same examples per step and give the same update."""
    a = train(compose(overrides(pair, tmp_path / "a", "train.batch_size=4", "train.grad_accum=1")), log=lambda *_: None)
    b = train(compose(overrides(pair, tmp_path / "b", "train.batch_size=2", "train.grad_accum=2")), log=lambda *_: None)
    la, lb = _losses(tmp_path / "a"), _losses(tmp_path / "b")
    for step in la:
        assert la[step] == pytest.approx(lb[step], rel=1e-5)
    wa, wb = _weights(tmp_path / "a" / "step_000004"), _weights(tmp_path / "b" / "step_000004")
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-5, atol=1e-6)
    assert a["tokens_seen"] == b["tokens_seen"]


@pytest.mark.parametrize("extra", [("data.on_policy_fraction=0.5",),
                                   ("train.lora.enabled=true", "train.lora.dropout=0.2", "optim.lr=1e-2")],
                         ids=["full_on_policy", "lora_dropout"])
def test_resume_is_exact(pair, tmp_path, extra):
    """N steps straight == N/2, stop, resume, N/2: identical losses and identical weights."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    train(compose(overrides(pair, straight, *extra)), log=lambda *_: None)
    first = train(compose(overrides(pair, split, "train.stop_at=2", *extra)), log=lambda *_: None)
    assert first["steps"] == 2 and not (split / "step_000004").exists()
    second = train(compose(overrides(pair, split, "train.resume=true", *extra)), log=lambda *_: None)
    assert second["steps"] == 4
    assert _losses(straight) == _losses(split)
    ws, wr = _weights(straight / "step_000004"), _weights(split / "step_000004")
    assert ws.keys() == wr.keys()
    for k in ws:
        assert torch.equal(ws[k], wr[k]), k


def test_resume_from_explicit_path_and_bad_path(pair, tmp_path):
    out = tmp_path / "run"
    train(compose(overrides(pair, out, "train.stop_at=2")), log=lambda *_: None)
    s = train(compose(overrides(pair, out, f"train.resume={out / 'step_000002'}")), log=lambda *_: None)
    assert s["steps"] == 4
    with pytest.raises(SetupError, match="not a complete distill checkpoint"):
        train(compose(overrides(pair, tmp_path / "x", f"train.resume={tmp_path}")), log=lambda *_: None)


def test_on_policy_batches_are_draft_rollouts(pair, tmp_path, monkeypatch):
    """λ=1: every micro-batch is rolled out by the draft (one visible branch in the recipe); λ=0: none is."""
    import distill.recipe as recipe

    calls = []
    real = recipe.rollout

    def spy(draft, examples, *a, **kw):
        out = real(draft, examples, *a, **kw)
        calls.append(out)
        return out

    monkeypatch.setattr(recipe, "rollout", spy)
    train(compose(overrides(pair, tmp_path / "on", "data.on_policy_fraction=1.0", "train.max_steps=2")),
          log=lambda *_: None)
    assert len(calls) == 2
    for batch in calls:
        for ex in batch:
            assert 1 <= len(ex["completion_ids"]) <= 12
            if 2 in ex["completion_ids"]:  # nothing is sampled after eos
                assert ex["completion_ids"].index(2) == len(ex["completion_ids"]) - 1
    assert all(m["train/on_policy_fraction_batch"] == 1.0 for m in _metrics(tmp_path / "on") if "train/loss" in m)
    calls.clear()
    train(compose(overrides(pair, tmp_path / "off", "train.max_steps=2")), log=lambda *_: None)
    assert calls == []


def _wandb_history(run_file):
    """History rows of an offline .wandb file (LevelDB-style log of protobuf Records)."""
    from wandb.proto import wandb_internal_pb2 as pb

    raw, block, pos, buf, rows = open(run_file, "rb").read(), 32768, 7, b"", []
    while pos + 7 <= len(raw):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        data, pos = raw[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(buf + data if kind == 4 else data)
            if record.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
        elif kind in (2, 3):
            buf = data if kind == 2 else buf + data
    return rows


def test_wandb_offline_run_dir_has_metrics(pair, tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)  # mode=auto must choose offline by itself
    out = tmp_path / "run"
    train(compose(overrides(pair, out, "logger=wandb", "train.max_steps=2")), log=lambda *_: None)
    # run.finish() only tells W&B's service process that the run is over (ServerInformFinishRequest, not awaited);
    # the service writes and closes the run's .wandb log after that. wandb.teardown() waits for the service to exit,
    # as the atexit hook of a `python -m distill train` process does, so the file is complete when read below.
    import wandb

    wandb.teardown()
    runs = glob.glob(str(out / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(runs) == 1
    rows = _wandb_history(runs[0])
    logged = {k for r in rows for k in r}
    assert {"train/loss", "train/lr", "train/tokens_per_s", "eval/acceptance_rate", "eval/mean_accepted_length",
            "eval/T1.0/mean_accepted_length"} <= logged
    assert any(k.startswith("eval/T0.0/accepted_length_hist") for k in logged)  # a wandb.Histogram (bins, values)
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    assert losses == [_losses(out)[1], _losses(out)[2]]
    run_id = (out / "wandb_run_id").read_text()
    assert runs[0].endswith(f"run-{run_id}.wandb")
    train(compose(overrides(pair, out, "logger=wandb", "train.max_steps=3", "train.resume=true")),
          log=lambda *_: None)
    assert (out / "wandb_run_id").read_text() == run_id  # the resumed run logs into the same W&B run id


def test_a_train_that_fails_finishes_its_wandb_run(pair, tmp_path, monkeypatch):
    """Found by a new user's library trial: a train() that raised left its W&B run open, and the next train() in the
    process logged into it (wandb.init returns the active run), so its wandb_run_id named the failed run's."""
    import wandb

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")

    def fail_at_start(line):
        if line.startswith("distill: "):  # logged once the W&B run is open, before the first step
            raise RuntimeError("stop here")

    with pytest.raises(RuntimeError, match="stop here"):
        train(compose(overrides(pair, tmp_path / "a", "logger=wandb", "train.max_steps=2")), log=fail_at_start)
    assert wandb.run is None
    train(compose(overrides(pair, tmp_path / "b", "logger=wandb", "train.max_steps=1")), log=lambda *_: None)
    assert (tmp_path / "a" / "wandb_run_id").read_text() != (tmp_path / "b" / "wandb_run_id").read_text()


def test_a_resumed_run_logs_each_step_to_wandb_once(pair, tmp_path, monkeypatch):
    """Found by a new user's trial: a run killed after its checkpoint at step N had logged steps past N; resumed, it
    logged them again into the same W&B run (W&B drops a step lower than its last, online). Now the resumed run sends
    W&B only the steps after the last one logged, and metrics.jsonl holds the resumed run's rows."""
    import wandb

    from distill import checkpoint as ckpt

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    out = tmp_path / "run"
    run = ("logger=wandb", "train.max_steps=4", "train.save_every=2")
    train(compose(overrides(pair, out, *run)), log=lambda *_: None)
    shutil.rmtree(ckpt.step_dir(out, 4))  # as if killed after logging steps 3 and 4 but before saving step 4
    ckpt.mark_latest(out, ckpt.step_dir(out, 2))
    lines = []
    train(compose(overrides(pair, out, *run, "train.resume=true")), log=lines.append)
    wandb.teardown()
    assert any("the stopped run logged steps up to 4, after its checkpoint (step 2)" in line for line in lines)
    runs = sorted(glob.glob(str(out / "wandb" / "offline-run-*" / "run-*.wandb")))
    assert len(runs) == 2 and len({Path(r).name for r in runs}) == 1  # two segments of one W&B run
    steps = [row["_step"] for r in runs for row in _wandb_history(r) if "train/loss" in row]
    assert steps == sorted(set(steps)) and steps[-1] == 4
    assert sorted(_losses(out)) == [1, 2, 3, 4]  # metrics.jsonl: the resumed run's rows replace the dropped ones


def test_logger_none_writes_no_wandb(pair, tmp_path):
    out = tmp_path / "run"
    train(compose(overrides(pair, out, "logger=none", "train.max_steps=1")), log=lambda *_: None)
    assert not (out / "wandb").exists() and (out / "metrics.jsonl").exists()


def test_lr_schedule_warmup_then_cosine():
    lrs = [lr_lambda(s, warmup=4, total=20, kind="cosine", min_ratio=0.1) for s in range(21)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:])) and lrs[-1] == pytest.approx(0.1)


def test_sigterm_checkpoints_the_current_step_and_resume_continues(pair, tmp_path, monkeypatch):
    """An interrupted run loses nothing: SIGTERM during step 3 -> checkpoint at step 3 -> resume == straight run."""
    import os
    import signal

    import distill.recipe as recipe

    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    train(compose(overrides(pair, straight, "train.save_every=0")), log=lambda *_: None)
    real, calls = recipe.loss_on_batch, []

    def interrupt_on_third(run, batch, n_tokens, on_policy=False):
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(run, batch, n_tokens, on_policy)

    monkeypatch.setattr(recipe, "loss_on_batch", interrupt_on_third)
    first = train(compose(overrides(pair, interrupted, "train.save_every=0")), log=lambda *_: None)
    assert first["steps"] == 3 and (interrupted / "latest").read_text() == "step_000003"
    assert signal.getsignal(signal.SIGTERM) is not recipe._StopFlag._handle  # handlers restored
    monkeypatch.setattr(recipe, "loss_on_batch", real)
    train(compose(overrides(pair, interrupted, "train.save_every=0", "train.resume=true")), log=lambda *_: None)
    assert _losses(straight) == _losses(interrupted)
    ws, wi = _weights(straight / "step_000004"), _weights(interrupted / "step_000004")
    assert all(torch.equal(ws[k], wi[k]) for k in ws)
    # the signal saved without an unscheduled eval: best/ is the one the straight run chose (a trial found best/ at
    # the signal's step after resuming, so the export shipped an earlier draft than the uninterrupted run's)
    best = [json.loads((run / "step_000004" / "eval.json").read_text())["best"] for run in (straight, interrupted)]
    assert best[0] == best[1] and best[0]["step"] == 4
    evals = [[r["step"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
              if any(k.startswith("eval/") for k in r)] for run in (straight, interrupted)]
    assert evals[0] == evals[1]


def test_bf16_mixed_precision_and_bf16_target(pair, tmp_path):
    out = tmp_path / "run"
    s = train(compose(overrides(pair, out, "train.mixed_precision=bf16", "+target.dtype=bf16", "train.max_steps=2")),
              log=lambda *_: None)
    assert s["steps"] == 2 and all(torch.isfinite(torch.tensor(v)) for v in _losses(out).values())


def test_resume_warns_about_changed_config(pair, tmp_path):
    out, messages = tmp_path / "run", []
    train(compose(overrides(pair, out, "train.stop_at=2")), log=lambda *_: None)
    train(compose(overrides(pair, out, "train.resume=true", "loss=fkl")), log=messages.append)
    assert any("loss.name differs" in m for m in messages)
    state = json.loads((out / "step_000004" / "trainer_state.json").read_text())
    assert state["examples_consumed"] == 4 * 4 and state["step"] == 4
    from distill.checkpoint import changed_keys

    # the data regime counts too (found by a new-user trial: a switch to cached logits or to target completions
    # resumed with no warning)
    for change, key in (("data.completions=target", "data.completions"), ("data.holdout=3", "data.holdout"),
                        ("data.target_logits=cached", "data.target_logits"),
                        ("data.rollout_temperature=0.5", "data.rollout_temperature")):
        assert changed_keys(out / "step_000002", compose(overrides(pair, out, change))) == [key]


def test_resume_warns_about_changed_ce_labels_and_not_for_a_config_without_the_key(pair, tmp_path):
    """loss.ce_labels changes the update as loss.ce_weight does: a resume that switches it is warned about; a
    checkpoint config written before the key existed (data labels) resumed with the default is not."""
    out, messages = tmp_path / "run", []
    train(compose(overrides(pair, out, "train.stop_at=2", "loss.ce_weight=0.5")), log=lambda *_: None)
    train(compose(overrides(pair, out, "train.resume=true", "train.stop_at=3", "loss.ce_weight=0.5",
                            "loss.ce_labels=target")), log=messages.append)
    assert any("loss.ce_labels differs" in m for m in messages)
    from distill.checkpoint import changed_keys

    old = tmp_path / "old"  # the config of a checkpoint from before the key existed
    old.mkdir()
    text = (out / "step_000002" / "config.yaml").read_text()
    (old / "config.yaml").write_text("\n".join(line for line in text.splitlines() if "ce_labels" not in line))
    cfg = compose(overrides(pair, out, "train.stop_at=2", "loss.ce_weight=0.5"))
    assert changed_keys(old, cfg) == [] and changed_keys(old, compose(overrides(
        pair, out, "train.stop_at=2", "loss.ce_weight=0.5", "loss.ce_labels=target"))) == ["loss.ce_labels"]


def test_resume_into_another_run_folder_keeps_its_own_best(pair, tmp_path):
    """The checkpoint's best (step 2 of run A) came along into run B, so B's summary named a best whose folder was
    in A: with lr 1e-12 (below the weights' float32 resolution) the resumed evaluation could not beat it, B/best was never written and `export B/best` failed."""
    first, fork = tmp_path / "a", tmp_path / "b"
    train(compose(overrides(pair, first, "eval.every=2", "train.stop_at=2")), log=lambda *_: None)
    assert (first / "best").is_dir()
    lines = []
    summary = train(compose(overrides(pair, fork, "eval.every=2", "optim.lr=1e-12",
                                      f"train.resume={first / 'step_000002'}")), log=lines.append)
    assert summary["steps"] == 4 and summary["best"]["step"] == 4
    state = json.loads((fork / "best" / "trainer_state.json").read_text())
    assert state["best"] == summary["best"]
    assert any("its best checkpoint starts over" in str(line) for line in lines)
    assert (first / "best").is_dir()  # the earlier run's best is untouched


def test_a_run_folder_given_as_the_draft_names_its_newest_checkpoint(pair, tmp_path):
    """It said only "has no config.json"; export already named the run's newest step_N."""
    run = tmp_path / "run"
    train(compose(overrides(pair, run, "train.stop_at=2")), log=lambda *_: None)
    ov = [o if not o.startswith("draft.name_or_path=") else f"draft.name_or_path={run}"
          for o in overrides(pair, tmp_path / "next")]
    import re

    with pytest.raises(SetupError, match=rf"draft path: {re.escape(str(run))} is a run folder, not a checkpoint; .* "
                                         rf"newest: {re.escape(str(run / 'step_000002'))}.*; fix draft.name_or_path"):
        train(compose(ov), log=lambda *_: None)


def test_a_diverged_draft_is_not_saved_and_the_good_checkpoints_stay(pair, tmp_path, monkeypatch):
    """Found by a new user's trial: a run whose loss went to NaN went on, pruned its finite checkpoints for NaN ones
    (keep_last), then ended in an IndexError inside the evaluation."""
    import distill.recipe as recipe
    from distill import checkpoint as ckpt

    real = recipe.train_step

    def step_then_diverge(run, step, *args):
        out = real(run, step, *args)
        if step == 2:  # the third step's update blows up
            with torch.no_grad():
                next(run.draft.parameters()).fill_(float("nan"))
        return out

    monkeypatch.setattr(recipe, "train_step", step_then_diverge)
    out = tmp_path / "run"
    with pytest.raises(recipe.DivergedError, match=r"after step 3 the draft's weight .* is not finite"):
        train(compose(overrides(pair, out, "train.max_steps=5", "train.save_every=1", "train.keep_last=2")),
              log=lambda *_: None)
    kept = ckpt.list_checkpoints(out)
    assert [p.name for p in kept] == ["step_000001", "step_000002"]
    assert all(torch.isfinite(t).all() for p in kept for t in _weights(p).values())
    # between saves, the first logged non-finite loss stops it (the step after the weights went NaN)
    with pytest.raises(recipe.DivergedError, match=r"after step 4 the draft's weight"):
        train(compose(overrides(pair, tmp_path / "run2", "train.max_steps=8", "train.save_every=100")),
              log=lambda *_: None)


def test_a_draft_with_non_finite_weights_is_refused_at_setup(pair, tmp_path):
    from transformers import AutoModelForCausalLM

    draft = AutoModelForCausalLM.from_pretrained(pair["draft"])
    with torch.no_grad():
        draft.lm_head.weight[0, 0] = float("inf")
    draft.save_pretrained(tmp_path / "bad_draft")
    with pytest.raises(SetupError, match=r"the draft's weight .* is not finite"):
        train(compose(overrides({**pair, "draft": str(tmp_path / "bad_draft")}, tmp_path / "run")),
              log=lambda *_: None)


def test_fp16_master_weights_are_refused_before_loading(pair, tmp_path):
    from distill.checks import check_inputs

    with pytest.raises(SetupError, match="draft.dtype=fp16 trains fp16 master weights"):
        check_inputs(compose(overrides(pair, tmp_path / "run", "draft.dtype=fp16")))


def test_optimizer_settings_changed_on_resume_apply_and_select_by_may_not_change(pair, tmp_path):
    """Found by a new user's trial: optim.lr/weight_decay/betas changed on resume were silently replaced by the
    checkpoint's (config.yaml recorded the new ones), and a changed eval.select_by compared a speedup with an
    acceptance rate to pick best/."""
    import yaml

    out = tmp_path / "run"
    base = ("train.max_steps=4", "train.save_every=2", "eval.every=2", "optim.warmup_steps=0",
            "optim.scheduler=constant")
    train(compose(overrides(pair, out, *base, "train.stop_at=2", "optim.lr=1e-3")), log=lambda *_: None)
    with pytest.raises(SetupError, match=r"eval.select_by=predicted_speedup differs from the run's acceptance_rate"):
        train(compose(overrides(pair, out, *base, "train.resume=true", "eval.select_by=predicted_speedup")),
              log=lambda *_: None)
    lines = []
    train(compose(overrides(pair, out, *base, "train.resume=true", "optim.lr=1e-2", "optim.betas=[0.5,0.6]")),
          log=lines.append)
    assert any("optim.lr=0.01 (the checkpoint's 0.001) applies from here" in x for x in lines)
    assert any("optim.betas=[0.5, 0.6]" in x for x in lines)
    rows = {m["step"]: m for m in _metrics(out) if "train/lr" in m}
    assert rows[1]["train/lr"] == pytest.approx(1e-3) and rows[3]["train/lr"] == pytest.approx(1e-2)
    assert json.loads((out / "step_000004" / "scheduler.json").read_text())["base_lrs"][0] == pytest.approx(1e-2)
    assert yaml.safe_load((out / "step_000004" / "config.yaml").read_text())["optim"]["lr"] == pytest.approx(1e-2)


def test_the_logged_lr_is_the_one_the_step_applied(pair, tmp_path):
    """train/lr at step k was the rate of step k + 1 (read after the schedule advanced)."""
    out = tmp_path / "run"
    train(compose(overrides(pair, out, "train.max_steps=3", "optim.warmup_steps=2", "optim.scheduler=constant",
                            "optim.lr=1e-3")), log=lambda *_: None)
    lrs = [m["train/lr"] for m in _metrics(out) if "train/lr" in m]
    assert lrs == pytest.approx([lr_lambda(s, 2, 3, "constant", 0.0) * 1e-3 for s in range(3)]) == [5e-4, 1e-3, 1e-3]


def test_a_run_stopped_by_its_time_budget_logs_its_last_step(pair, tmp_path):
    """The stopping step was logged only if it fell on train.log_every, so final_loss was an earlier step's."""
    out = tmp_path / "run"
    summary = train(compose(overrides(pair, out, "train.max_steps=100000", "train.max_time_s=1.5",
                                      "train.log_every=1000", "train.save_every=0", "eval.at_start=false")),
                    log=lambda *_: None)
    logged = _losses(out)
    assert summary["steps"] > 1 and max(logged) == summary["steps"]
    assert summary["final_loss"] == pytest.approx(logged[summary["steps"]])


def test_a_resume_into_another_wandb_project_says_so(pair, tmp_path, monkeypatch):
    """Found by a new user's trial: the W&B run id is kept, but ids are per project: a changed logger.project went
    on as a new run silently."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    out = tmp_path / "run"
    train(compose(overrides(pair, out, "logger=wandb", "train.max_steps=2", "train.stop_at=1")), log=lambda *_: None)
    lines = []
    train(compose(overrides(pair, out, "logger=wandb", "train.max_steps=2", "train.resume=true",
                            "logger.project=other")), log=lines.append)
    assert any("logger.project=other differs from the checkpoint's draftkit" in x for x in lines)


def test_train_prompt_tokens_trims_prompts_only():
    from distill.recipe import trim_prompts

    ex = [{"prompt_ids": [1, 2, 3, 4, 5], "completion_ids": [6, 7], "cache_row": 0},
          {"prompt_ids": [8], "completion_ids": [9, 10, 11], "cache_row": 1}]
    assert trim_prompts(ex, None) is ex
    assert trim_prompts(ex, 2) == [{"prompt_ids": [4, 5], "completion_ids": [6, 7], "cache_row": 0},
                                   {"prompt_ids": [8], "completion_ids": [9, 10, 11], "cache_row": 1}]
    assert ex[0]["prompt_ids"] == [1, 2, 3, 4, 5]  # the loaded examples are left as they were
