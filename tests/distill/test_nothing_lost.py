"""Nothing a user made is lost: run folders are not clobbered, resume never silently restarts, pruning keeps what
resume needs, metrics have one row per step, a kill -9 at any point resumes to the uninterrupted weights, export
never overwrites a folder it was not asked to, and evaluation errors come after the save."""
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import distill.recipe as recipe
from distill import checkpoint as ckpt, runfolder
from distill.config import SetupError
from distill.recipe import train
from distill_helpers import PY, REPO, compose, overrides, subprocess_env
from tests.conftest import full_disk_for

QUIET = lambda *_: None  # noqa: E731
FAST = ("eval.temperatures=[0.0]", "eval.at_start=false")


def _weights(path):
    return load_file(str(path / "model.safetensors"))


def _assert_same_weights(a, b):
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


def _mtimes(folder):
    """path -> mtime of everything under a run folder but its lock file (each run rewrites its holder line)."""
    return {p: p.stat().st_mtime_ns for p in folder.rglob("*") if p.name != runfolder.RUN_LOCK}


def _contents(folder):
    """relative path -> bytes of every file under a run folder but its lock file."""
    return {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*")
            if p.is_file() and p.name != runfolder.RUN_LOCK}


def _train_steps(out):
    """Steps of the metrics.jsonl train rows, in file order."""
    return [json.loads(line)["step"] for line in open(out / "metrics.jsonl") if "train/loss" in line]


@pytest.fixture(scope="module")
def straight(pair, tmp_path_factory):
    """4 uninterrupted steps (1 CPU thread, as the subprocess runs), checkpoints at 2 and 4."""
    out = tmp_path_factory.mktemp("straight") / "run"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train(compose(overrides(pair, out, *FAST)), log=QUIET)
    finally:
        torch.set_num_threads(threads)
    return out


# ------------------------------------------------------------------------------------------------ run folders

def test_rerun_without_resume_is_refused_before_loading_and_changes_nothing(pair, straight, monkeypatch):
    before = _mtimes(straight)
    monkeypatch.setattr(recipe, "load_target", lambda *a: pytest.fail("a model was loaded"))
    with pytest.raises(SetupError, match="already holds a run.*train.resume=true.*train.overwrite=true"):
        train(compose(overrides(pair, straight, *FAST)), log=QUIET)
    assert _mtimes(straight) == before


@pytest.mark.parametrize("settings", [(), ("train.resume=true",), ("train.overwrite=true",)])
def test_a_second_run_into_a_folder_another_run_is_training_into_is_refused(pair, straight, tmp_path, monkeypatch,
                                                                           settings):
    """Two `distill train` into one output_dir saved over each other's checkpoints (resume), and the second's
    overwrite set aside and deleted the first's running files."""
    out = tmp_path / "run"
    shutil.copytree(straight, out)
    before = _mtimes(out)
    held = runfolder.lock_run_folder(out)  # the first run, still going (another process in real life)
    monkeypatch.setattr(recipe, "load_target", lambda *a: pytest.fail("a model was loaded"))
    try:
        with pytest.raises(SetupError, match=f"another distill train is running into train.output_dir={out} "
                                             f"\\(pid {os.getpid()} on .*choose another train.output_dir"):
            train(compose(overrides(pair, out, *FAST, *settings)), log=QUIET)
    finally:
        held.close()  # the first run ended (or was killed): the lock goes with it
    assert _mtimes(out) == before
    with pytest.raises(SetupError, match="already holds a run"):  # free again: the folder's own rules apply
        train(compose(overrides(pair, out, *FAST)), log=QUIET)


def test_overwrite_starts_over_and_keeps_unrelated_files(pair, straight, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(straight, out)
    (out / "target_data").mkdir()
    (out / "notes.txt").write_text("mine")
    train(compose(overrides(pair, out, "train.overwrite=true", "train.max_steps=2", *FAST)), log=QUIET)
    assert _train_steps(out) == [1, 2]  # the old run's rows are gone, not mixed in
    assert sorted(p.name for p in ckpt.list_checkpoints(out)) == ["step_000002"]
    assert (out / "notes.txt").read_text() == "mine" and (out / "target_data").is_dir()
    assert not (out / runfolder.SET_ASIDE).exists()  # the old run went when the new one started writing


def test_a_rank_left_in_the_environment_does_not_turn_a_lone_run_s_folder_checks_off(pair, straight, tmp_path,
                                                                                       monkeypatch):
    """RANK=1 without a launch (a cluster job's environment) skipped the lock and the run-folder check, while
    accelerate still wrote as the main process: a finished run's checkpoints were overwritten, exit 0."""
    out = tmp_path / "run"
    shutil.copytree(straight, out)
    before = _contents(out)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(recipe, "load_target", lambda *a: pytest.fail("a model was loaded"))
    with pytest.raises(SetupError, match="already holds a run"):
        train(compose(overrides(pair, out, *FAST)), log=QUIET)
    assert _contents(out) == before
    monkeypatch.setenv("WORLD_SIZE", "2")  # a real launch: rank 1 leaves the checks to rank 0
    assert not runfolder.is_main_process()


def test_the_command_line_names_a_live_run_before_judging_its_folder(pair, straight, tmp_path, capsys, monkeypatch):
    """With a run training into the folder, `distill train` (fresh or train.resume=true) was told 'already holds a
    run ... train.overwrite=true' or 'no complete checkpoint ... add train.overwrite=true' by the preflight, which
    ran before the lock: advice that would delete the live run's files."""
    from distill.__main__ import main

    out = tmp_path / "run"
    shutil.copytree(straight, out)
    link = tmp_path / "link"
    link.symlink_to(out)
    held = runfolder.lock_run_folder(out)
    try:
        for folder, extra in ((out, ()), (link, ()), (out, ("train.resume=true",))):
            with pytest.raises(SystemExit) as e:
                main(["train", *overrides(pair, folder, *FAST, *extra)])
            err = capsys.readouterr().err
            assert e.value.code == 2 and f"another distill train is running into train.output_dir={folder}" in err
            assert f"pid {os.getpid()}" in err and "train.overwrite=true" not in err
        # Rank 1 of a launch whose rank 0 already holds the lock: its preflight refused its own run as "another
        # distill train" (a race the 2-process tests lost once), so only the main process checks the lock.
        from distill.__main__ import preflight

        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("RANK", "1")
        assert len(preflight("train", overrides(pair, out, *FAST, "train.resume=true"), False, {})) == 1
    finally:
        held.close()


def test_overwrite_removes_only_what_a_run_wrote_and_a_folder_without_a_run_is_not_called_one(straight, tmp_path):
    """train.overwrite=true deleted a user's step_000002_keep/step_000002.bak copies (glob step_*), and in a folder
    that never held a run the user's config.yaml and wandb/ (which the refusal had called "a run")."""
    out = tmp_path / "run"
    shutil.copytree(straight, out)
    shutil.copytree(straight / "step_000002", out / "step_000002_keep")
    shutil.copytree(straight / "step_000002", out / "step_000002.bak")
    assert runfolder.prepare_run_folder(out, False, True) is None
    runfolder.discard_set_aside(out)
    assert sorted(p.name for p in out.iterdir()) == [runfolder.RUN_LOCK, "step_000002.bak", "step_000002_keep"]

    mine = tmp_path / "project"
    (mine / "wandb").mkdir(parents=True)
    (mine / "wandb" / "my_other_project.log").write_text("x")
    (mine / "config.yaml").write_text("model: mine\n")
    (mine / "notes.txt").write_text("notes")
    before = _contents(mine)
    for overwrite in (False, True):
        with pytest.raises(SetupError, match="is not empty and holds no run .*config.yaml, notes.txt, wandb.*move "
                                             "config.yaml, wandb out of it"):
            runfolder.prepare_run_folder(mine, False, overwrite)
    assert _contents(mine) == before
    (mine / "config.yaml").unlink()
    shutil.rmtree(mine / "wandb")
    with pytest.raises(SetupError, match=r"holds no run \(notes.txt\).*train.overwrite=true to train beside them"):
        runfolder.prepare_run_folder(mine, False, False)
    assert runfolder.prepare_run_folder(mine, False, True) is None and _contents(mine) == {Path("notes.txt"): b"notes"}
    # a run killed after writing only its config.yaml is still a run: its rerun's overwrite replaces it
    (mine / "config.yaml").write_text((straight / "config.yaml").read_text())
    with pytest.raises(SetupError, match="already holds a run"):
        runfolder.prepare_run_folder(mine, False, False)
    runfolder.prepare_run_folder(mine, False, True)
    assert (mine / runfolder.SET_ASIDE / "config.yaml").is_file() and not (mine / "config.yaml").exists()


@pytest.mark.parametrize("late", ["empty_logit_cache", "vocab_keep_too_large", "interrupted", "sigterm"])
def test_an_overwrite_that_stops_before_the_new_run_writes_puts_the_old_run_back(pair, straight, tmp_path,
                                                                                 monkeypatch, late):
    """train.overwrite=true deleted the earlier run first, then a check that needs no model (an empty logit cache,
    draft.vocab.keep above the vocabulary) or a Ctrl-C while the models loaded stopped the new run: the folder was
    left empty. Now the earlier run is set aside and comes back."""
    out = tmp_path / "run"
    shutil.copytree(straight, out)
    before = _contents(out)
    extra = {"empty_logit_cache": (f"data.logit_cache={tmp_path / 'empty'}", "data.target_logits=cached"),
             "vocab_keep_too_large": ("draft.vocab.keep=99999",), "interrupted": (), "sigterm": ()}[late]
    (tmp_path / "empty").mkdir()
    if late in ("interrupted", "sigterm"):  # SIGTERM (timeout, a scheduler) killed it with the run set aside
        def stop(*a, **k):
            if late == "sigterm":
                os.kill(os.getpid(), __import__("signal").SIGTERM)
            raise KeyboardInterrupt

        monkeypatch.setattr(recipe, "load_draft", stop)
    with pytest.raises(KeyboardInterrupt if late in ("interrupted", "sigterm") else SetupError):
        train(compose(overrides(pair, out, "train.overwrite=true", *FAST, *extra)), log=QUIET)
    assert _contents(out) == before


def test_overwrite_refuses_to_delete_the_draft_the_run_starts_from(pair, straight, tmp_path, monkeypatch):
    """train.overwrite=true with draft.name_or_path=<output_dir>/best deleted that draft, then failed to load it."""
    out = tmp_path / "run"
    shutil.copytree(straight, out)
    ckpt_dir = ckpt.find_latest(out)
    before = _mtimes(out)
    monkeypatch.setattr(recipe, "load_target", lambda *a: pytest.fail("a model was loaded"))
    cfg = compose(overrides(pair, out, "train.overwrite=true", *FAST, f"draft.name_or_path={ckpt_dir}"))
    with pytest.raises(SetupError, match=f"would delete .*{ckpt_dir.name}.*draft.name_or_path"):
        train(cfg, log=QUIET)
    assert _mtimes(out) == before


def test_a_refused_resume_leaves_the_run_folder_as_it_was(pair, straight, tmp_path):
    """A resume refused for its batch size (the checkpoint's position is not a multiple of it) rewrote the run's
    config.yaml with the refused setup and truncated its metrics before refusing."""
    out = tmp_path / "run"
    shutil.copytree(straight, out)
    before = _contents(out)
    with pytest.raises(SetupError, match="resume with train.batch_size="):
        train(compose(overrides(pair, out, "train.resume=true", "train.batch_size=3", *FAST)), log=QUIET)
    assert _contents(out) == before


def test_resume_names_a_damaged_newer_checkpoint_it_skips(pair, straight, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(straight, out)
    newest = ckpt.find_latest(out)
    weights = newest / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # damaged: the manifest's size no longer matches
    lines = []
    path = runfolder.prepare_run_folder(out, True, False, log=lines.append)
    assert path is not None and path != newest
    assert len(lines) == 1 and newest.name in lines[0] and "damaged" in lines[0] and "model.safetensors" in lines[0]


@pytest.mark.parametrize("left", ["best.old", "best.tmp"])
def test_resume_restores_a_best_folder_left_aside_by_a_crash_inside_its_swap(pair, straight, tmp_path, left):
    """replace_dir moves best/ aside, then renames best.tmp into place: a crash in between left no best/, so
    `export <run>/best` failed (with no hint) until the run saved a better best."""
    out = tmp_path / "run"
    shutil.copytree(straight, out)
    (out / "best").rename(out / left)  # the state between the two renames
    with pytest.raises(ckpt.CheckpointError, match=rf"{left} is a complete copy of it.*mv .*train.resume=true"):
        ckpt.check_complete(out / "best")
    lines = []
    assert runfolder.prepare_run_folder(out, True, False, log=lines.append) == ckpt.find_latest(out)
    assert ckpt.is_complete(out / "best") and not (out / left).exists()
    assert lines == [f"best/ was missing after a save interrupted between two renames; restored it from {left}/"]


def test_resuming_a_finished_run_writes_a_valid_summary(pair, straight, tmp_path):
    """A run resumed at its last step trains nothing: its final loss is null, not NaN (which is not JSON)."""
    out = tmp_path / "run"
    shutil.copytree(straight, out)
    s = train(compose(overrides(pair, out, *FAST, "train.resume=true")), log=QUIET)
    assert s["steps"] == 4 and s["final_loss"] is None
    summary = json.loads((out / "summary.json").read_text(),
                         parse_constant=lambda c: pytest.fail(f"summary.json holds {c}"))
    assert summary["final_loss"] is None and summary["steps"] == 4


def test_a_full_disk_at_the_summary_keeps_the_earlier_summary_and_names_the_checkpoints(pair, straight, tmp_path,
                                                                                    monkeypatch):
    """summary.json was written in place after the final checkpoint: a full disk there was a traceback (exit 1) that
    left an empty summary.json, though nothing trained was lost. Now a warning that prints the summary and names the
    complete checkpoints; the earlier summary.json stays whole and no .tmp is left."""
    out = tmp_path / "run"
    shutil.copytree(straight, out)
    before = (out / "summary.json").read_text()
    full_disk_for(monkeypatch, '"final_loss"')
    lines = []
    s = train(compose(overrides(pair, out, *FAST, "train.resume=true")), log=lines.append)
    assert s["steps"] == 4
    assert (out / "summary.json").read_text() == before and not (out / "summary.json.tmp").exists()
    warning = [line for line in lines if "summary.json" in line]
    assert len(warning) == 1 and "No space left on device" in warning[0] and "are complete" in warning[0]
    assert json.loads(warning[0].split("The summary: ", 1)[1])["steps"] == 4


def test_a_missing_checkpoint_is_named_as_missing_with_the_run_s_newest(straight, tmp_path):
    """It was 'no manifest.json: its save was interrupted', which sends a user looking for a crash."""
    out = tmp_path / "run"
    shutil.copytree(straight, out)
    shutil.rmtree(out / "best")  # a run that never evaluated (e.g. the quickstart's cached distillation)
    with pytest.raises(ckpt.CheckpointError, match=r"best does not exist \(a run writes best/ only when it "
                                                   r"evaluates\); its run has step_000002, step_000004, the newest "
                                                   r"complete one .*step_000004"):
        ckpt.check_complete(out / "best")
    with pytest.raises(ckpt.CheckpointError, match=r"step_4 does not exist; its run has step_000002, step_000004"):
        ckpt.check_complete(out / "step_4")  # the docs' step_N, written without the zero padding
    with pytest.raises(ckpt.CheckpointError, match=r"nowhere does not exist; give a step_N"):
        ckpt.check_complete(tmp_path / "nowhere")


def test_rerun_overrides_continue_or_restart_a_tool_s_own_run(straight, tmp_path):
    """What the quickstart and the measuring scripts pass to `distill train` when they run a folder again."""
    assert runfolder.rerun_overrides(straight) == ["train.resume=true"]
    killed = tmp_path / "killed"
    killed.mkdir()
    (killed / "metrics.jsonl").write_text("")  # killed before its first complete checkpoint
    assert runfolder.rerun_overrides(killed) == ["train.overwrite=true"]
    assert runfolder.rerun_overrides(tmp_path / "new") == []
    assert runfolder.rerun_overrides(tmp_path / "killed" / "x") == []
    (killed / "step_000002.tmp").mkdir()  # a save cut short: never renamed into place
    assert runfolder.rerun_overrides(killed) == ["train.overwrite=true"]
    # A run whose only checkpoint is damaged (a byte cut off a file) was started over with train.overwrite=true,
    # deleting the checkpoint and the metrics; now it is resumed, which names the damage and stops.
    damaged = tmp_path / "damaged"
    shutil.copytree(straight, damaged)
    for extra in [p for p in ckpt.list_checkpoints(damaged)][:-1] + [damaged / "best"]:
        shutil.rmtree(extra, ignore_errors=True)
    only = ckpt.list_checkpoints(damaged)[-1]
    victim = next(p for p in sorted(only.iterdir()) if p.suffix == ".safetensors")
    victim.write_bytes(victim.read_bytes()[:-1])
    assert ckpt.find_latest(damaged) is None and runfolder.rerun_overrides(damaged) == ["train.resume=true"]


def test_a_folder_holding_only_the_target_data_cache_is_a_fresh_run(pair, tmp_path):
    out = tmp_path / "run"
    (out / "target_data").mkdir(parents=True)
    s = train(compose(overrides(pair, out, "train.max_steps=1", *FAST)), log=QUIET)
    assert s["steps"] == 1


@pytest.mark.parametrize("damage", ["no_manifest", "no_trainer_state", "truncated_weights", "empty_latest"])
def test_resume_takes_the_newest_complete_checkpoint(pair, straight, tmp_path, damage):
    """The newest step_N is damaged (or the pointer is empty): resume continues from step 2, prunes nothing it
    needs, logs one row per step, and ends with the uninterrupted weights."""
    out = tmp_path / "run"
    shutil.copytree(straight, out)
    newest = out / "step_000004"
    if damage == "no_manifest":
        (newest / "manifest.json").unlink()
    elif damage == "no_trainer_state":
        (newest / "trainer_state.json").unlink()
    elif damage == "truncated_weights":
        (newest / "model.safetensors").write_bytes((newest / "model.safetensors").read_bytes()[:100])
    else:
        (out / "latest").write_text("")
        shutil.rmtree(newest)
    assert ckpt.find_latest(out) == out / "step_000002"
    messages = []
    s = train(compose(overrides(pair, out, "train.resume=true", "train.keep_last=1", *FAST)), log=messages.append)
    assert any("resumed from" in m and "step_000002" in m for m in messages) and s["steps"] == 4
    assert _train_steps(out) == [1, 2, 3, 4]
    _assert_same_weights(out / "step_000004", straight / "step_000004")
    assert (out / "latest").read_text() == "step_000004"


def test_explicit_resume_without_a_complete_checkpoint_is_an_error(pair, straight, tmp_path):
    # (a re-test: the message told to 'add train.overwrite=true to replace this folder's run' of an empty folder)
    with pytest.raises(SetupError, match=r"nowhere has no complete checkpoint: it holds no run at all .*"
                                         r"train.resume=false, or give train.resume=PATH$"):
        train(compose(overrides(pair, tmp_path / "nowhere", "train.resume=true", *FAST)), log=QUIET)
    out = tmp_path / "run"
    shutil.copytree(straight, out)
    for p in ckpt.list_checkpoints(out):
        (p / "manifest.json").unlink()
    with pytest.raises(SetupError, match=r"step folders \['step_000002', 'step_000004'\] are incomplete"):
        train(compose(overrides(pair, out, "train.resume=true", *FAST)), log=QUIET)
    assert sorted(p.name for p in ckpt.list_checkpoints(out)) == ["step_000002", "step_000004"]


def test_resume_from_an_older_path_would_overwrite_newer_checkpoints(pair, straight, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(straight, out)
    with pytest.raises(SetupError, match=r"would overwrite its newer checkpoints \['step_000004'\]"):
        train(compose(overrides(pair, out, f"train.resume={out / 'step_000002'}", *FAST)), log=QUIET)
    other = tmp_path / "other"
    (other / "x").mkdir(parents=True)
    with pytest.raises(SetupError, match="already holds another run"):
        train(compose(overrides(pair, other, f"train.resume={out / 'step_000002'}", *FAST)), log=QUIET)


def test_resume_with_stop_at_before_the_checkpoint_is_refused_before_any_model_loads(pair, straight, tmp_path,
                                                                                       monkeypatch):
    """train.stop_at=2 resuming step 4 used to evaluate step 4 again and log a second metrics row for it."""
    out = tmp_path / "run"
    shutil.copytree(straight, out)
    files = _contents(out)
    monkeypatch.setattr(recipe, "setup", lambda *a, **k: pytest.fail("models were loaded"))
    with pytest.raises(SetupError, match=r"train.stop_at=2 is before step 4, where the checkpoint it resumes stops"):
        train(compose(overrides(pair, out, "train.resume=true", "train.stop_at=2", *FAST)), log=QUIET)
    assert _contents(out) == files


def test_a_resume_that_drops_or_adds_lora_is_refused_before_any_model_loads(pair, straight, tmp_path, monkeypatch):
    """It was refused only after the models loaded, with ~100 state-dict key names and no word of the setting."""
    out = tmp_path / "run"
    shutil.copytree(straight, out)
    monkeypatch.setattr(recipe, "setup", lambda *a, **k: pytest.fail("models were loaded"))
    with pytest.raises(SetupError, match="was trained without LoRA; resume it with train.lora.enabled=false$"):
        train(compose(overrides(pair, out, "train.resume=true", "train.lora.enabled=true", *FAST)), log=QUIET)


def test_a_resume_that_changes_the_adapter_is_refused_before_any_model_loads(pair, tmp_path, monkeypatch):
    """A trial resumed a LoRA run with train.lora.alpha=64 (trained at 32): accepted with no warning, and the
    restored adapter's scale doubled at the resume point; a changed r was refused only after loading, with 16 lines of
    size mismatches and no word of train.lora.r. A changed dropout is a warning (the same adapter, another
    regularisation)."""
    out, messages = tmp_path / "run", []
    train(compose(overrides(pair, out, "train.lora.enabled=true", "train.stop_at=2", *FAST)), log=QUIET)
    real_setup = recipe.setup
    monkeypatch.setattr(recipe, "setup", lambda *a, **k: pytest.fail("models were loaded"))
    for change, was in (("train.lora.alpha=64", "32"), ("train.lora.r=8", "16"),
                        ("train.lora.target_modules=[q_proj,v_proj]", "all-linear")):
        with pytest.raises(SetupError, match=rf"{re.escape(change)} differs from the checkpoint's {was} .*Resume with "
                                             rf"{re.escape(change.split('=')[0])}={was}"):
            train(compose(overrides(pair, out, "train.resume=true", "train.lora.enabled=true", change, *FAST)),
                  log=QUIET)
    with pytest.raises(SetupError, match=r"modules_to_save=\[lm_head\] differs from the checkpoint's null .*"
                                         r"Resume with train.lora.modules_to_save=null"):
        train(compose(overrides(pair, out, "train.resume=true", "train.lora.enabled=true",
                                "train.lora.modules_to_save=[lm_head]", *FAST)), log=QUIET)
    monkeypatch.setattr(recipe, "setup", real_setup)
    # the same adapter written another way: alpha 32.0, modules_to_save [] for null (a re-test found [] refused)
    train(compose(overrides(pair, out, "train.resume=true", "train.lora.enabled=true", "train.lora.alpha=32.0",
                            "train.lora.modules_to_save=[]", "train.lora.dropout=0.3", *FAST)), log=messages.append)
    assert any("train.lora.dropout differs from the checkpoint's config" in m for m in messages)


def test_the_latest_pointer_given_as_a_checkpoint_names_the_folder_it_points_to(straight):
    with pytest.raises(ckpt.CheckpointError, match=r"latest is the run's pointer .* names: .*step_000004"):
        ckpt.check_complete(straight / "latest")


def test_prune_keeps_the_checkpoint_resume_needs(tmp_path, straight):
    out = tmp_path / "run"
    shutil.copytree(straight, out)
    shutil.copytree(out / "step_000004", out / "step_000006")
    (out / "step_000006" / "manifest.json").unlink()  # a newer but incomplete folder
    assert ckpt.prune(out, keep_last=1) == [out / "step_000002"]
    assert (out / "step_000004").is_dir() and (out / "step_000006").is_dir()
    assert ckpt.find_latest(out) == out / "step_000004"


def test_resume_of_a_checkpoint_without_verify_costs_goes_on_with_v_1(pair, tmp_path, monkeypatch):
    out = tmp_path / "run"
    train(compose(overrides(pair, out, "eval.cost_ratio=null", "train.stop_at=2", *FAST)), log=QUIET)
    state_file = out / "step_000002" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    del state["verify_costs"]  # as written before verify costs were recorded
    state_file.write_text(json.dumps(state))
    manifest_file = out / "step_000002" / "manifest.json"  # keep the checkpoint complete (the manifest has sizes)
    manifest = json.loads(manifest_file.read_text())
    manifest["files"]["trainer_state.json"] = state_file.stat().st_size
    manifest_file.write_text(json.dumps(manifest))
    monkeypatch.setattr(recipe, "resolve_costs", lambda *a: pytest.fail("the costs were measured again"))
    messages = []
    s = train(compose(overrides(pair, out, "eval.cost_ratio=null", "train.resume=true", *FAST)), log=messages.append)
    assert s["last_eval"]["cost_ratio"] == state["cost_ratio"] and s["last_eval"]["verify_costs"] is None
    assert any("none recorded, so v = 1" in m for m in messages)
    from decode.speedup import predicted_speedup

    for row in s["last_eval"]["per_temperature"].values():  # Leviathan's v = 1, as the run started
        assert row["predicted_speedup"] == pytest.approx(predicted_speedup(row["alpha"], row["best_gamma"],
                                                                           state["cost_ratio"]))


def test_resume_keeps_the_checkpoints_cost_ratio(pair, tmp_path, monkeypatch):
    out = tmp_path / "run"
    train(compose(overrides(pair, out, "eval.cost_ratio=null", "train.stop_at=2", *FAST)), log=QUIET)
    first = json.loads((out / "step_000002" / "trainer_state.json").read_text())
    c, v = first["cost_ratio"], first["verify_costs"]
    assert len(v) == 9 and v[0] == 1.0  # v_0..v_8 (eval.max_gamma=8), measured beside c
    monkeypatch.setattr(recipe, "resolve_costs", lambda *a: pytest.fail("the costs were measured again"))
    messages = []
    s = train(compose(overrides(pair, out, "eval.cost_ratio=null", "train.resume=true", *FAST)), log=messages.append)
    assert any(f"keeping the checkpoint's cost ratio c={c:.3f}" in m for m in messages)
    assert s["last_eval"]["cost_ratio"] == c and s["last_eval"]["verify_costs"] == v
    last = json.loads((out / "step_000004" / "trainer_state.json").read_text())
    assert last["cost_ratio"] == c and last["verify_costs"] == v


def test_resume_with_another_world_size_continues_at_the_stored_example(pair, straight, tmp_path, monkeypatch):
    """A checkpoint of 2 processes x batch 4 at step 2 (examples 0-15) resumed by 1 process: the next micro-batch
    starts at example 16, and the log names both sizes."""
    out = tmp_path / "run"
    shutil.copytree(straight, out)
    shutil.rmtree(out / "step_000004")
    state_file = out / "step_000002" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    state.update(num_processes=2, examples_consumed=16)
    state_file.write_text(json.dumps(state))
    (out / "step_000002" / "manifest.json").unlink()
    ckpt.write_manifest(out / "step_000002", 2)
    seen, real = [], recipe.micro_batch
    monkeypatch.setattr(recipe, "micro_batch", lambda run, m: (seen.append(m), real(run, m))[1])
    messages = []
    train(compose(overrides(pair, out, "train.resume=true", *FAST)), log=messages.append)
    assert seen == [4, 5]  # micro-batches of 4 examples: 16-19, then 20-23
    assert any("trained by 2 process(es), this run has 1; continuing at example 16" in m for m in messages)
    assert json.loads((out / "step_000004" / "trainer_state.json").read_text())["examples_consumed"] == 24


def test_resume_with_a_batch_size_that_misses_the_stored_example_is_refused(pair, straight, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(straight, out)
    shutil.rmtree(out / "step_000004")
    with pytest.raises(SetupError, match="example 8, .*train.batch_size=3 .*batch_size=4"):
        train(compose(overrides(pair, out, "train.resume=true", "train.batch_size=3", *FAST)), log=QUIET)


def test_an_evaluation_error_loses_no_trained_step(pair, tmp_path, monkeypatch):
    out = tmp_path / "run"

    def broken(run):
        raise RuntimeError("evaluation failed")

    monkeypatch.setattr(recipe, "evaluate", broken)
    with pytest.raises(RuntimeError, match="evaluation failed"):
        train(compose(overrides(pair, out, "train.save_every=0", *FAST)), log=QUIET)
    assert ckpt.find_latest(out) == out / "step_000004"  # the final save came before the final evaluation


def test_a_best_checkpoint_below_the_starting_draft_is_named_in_a_warning(pair, tmp_path, monkeypatch):
    """best/ is chosen among the run's checkpoints; the starting draft is not one, so a run that only made the draft
    worse says so instead of leaving a worse best/ to be exported unawares."""
    real, calls = recipe.evaluate, []

    def scored(run):  # the real evaluation, with the selection metric set: the initial draft scores highest
        ev = real(run)
        calls.append(0.9 if not calls else 0.5)
        return {**ev, "acceptance_rate": calls[-1]}

    monkeypatch.setattr(recipe, "evaluate", scored)
    messages = []
    s = train(compose(overrides(pair, tmp_path / "run", "eval.temperatures=[0.0]", "eval.at_start=true")),
              log=messages.append)
    assert s["initial_eval"]["acceptance_rate"] == 0.9 and s["best"]["value"] == 0.5
    assert any(m.startswith("warning: best/ (step") and "below the starting draft (0.9000)" in m for m in messages)


def test_stop_at_past_max_steps_a_long_warmup_and_a_batch_larger_than_the_data_are_warned(pair, tmp_path):
    messages = []
    s = train(compose(overrides(pair, tmp_path / "run", "train.max_steps=2", "train.stop_at=5",
                                "optim.warmup_steps=4", *FAST)), log=messages.append)
    assert s["steps"] == 2
    assert "warning: train.stop_at=5 is past train.max_steps=2; the run ends at step 2" in messages
    assert any(m.startswith("warning: optim.warmup_steps=4 > train.max_steps=2") and "peaks at 50%" in m
               for m in messages)
    assert not any("training examples: each batch" in m for m in messages)
    n = int(next(m for m in messages if m.startswith("distill: ")).split()[1])  # "distill: N examples, ..."
    messages.clear()
    train(compose(overrides(pair, tmp_path / "big", "train.max_steps=1", f"train.batch_size={n + 1}", *FAST)),
          log=messages.append)  # found by a new user: a batch larger than the data repeats examples silently
    assert any(m.startswith(f"warning: train.batch_size={n + 1} > the {n} training examples") for m in messages)


def test_eval_out_is_checked_before_the_run(pair, tmp_path, capsys, monkeypatch):
    from distill.__main__ import main

    monkeypatch.setattr("distill.__main__.load_target", lambda *a: pytest.fail("a model was loaded"))
    for out, why in ((tmp_path / "missing" / "x.json", "does not exist"), (tmp_path, "is a folder")):
        with pytest.raises(SystemExit) as e:
            main(["eval", *overrides(pair, tmp_path / "r"), "--out", str(out)])
        assert e.value.code == 2 and why in capsys.readouterr().err
    existing = tmp_path / "x.json"
    existing.write_text("{}")
    with pytest.raises(SystemExit):
        main(["eval", *overrides(pair, tmp_path / "r"), "--out", str(existing)])
    assert "--overwrite" in capsys.readouterr().err and existing.read_text() == "{}"


# ------------------------------------------------------------------------------------------------ kill -9

# `python -m distill train` with one function patched to SIGKILL the process at a point, given as "point:step":
# "step" after step N's update (before the loop records it), "save" mid save of step N (every file written but the
# manifest), "pointer" after step N's complete save, before `latest` is updated and old checkpoints are pruned.
KILL_AT = """
import os, signal, sys
from pathlib import Path
from distill import checkpoint, recipe
from distill.__main__ import main

point, at = sys.argv[1].split(":")
at = int(at)


def killing(real, when):
    def wrapped(*args):
        out = real(*args)
        if when(*args):
            os.kill(os.getpid(), signal.SIGKILL)
        return out
    return wrapped


if point == "step":
    recipe.train_step = killing(recipe.train_step, lambda run, step, *rest: step + 1 == at)
elif point == "save":
    real = checkpoint.write_manifest
    def write_manifest(folder, step):
        if step == at:
            os.kill(os.getpid(), signal.SIGKILL)
        real(folder, step)
    checkpoint.write_manifest = write_manifest
else:
    real = checkpoint.mark_latest
    def mark_latest(output_dir, path):
        if Path(path) == checkpoint.step_dir(output_dir, at):
            os.kill(os.getpid(), signal.SIGKILL)
        real(output_dir, path)
    checkpoint.mark_latest = mark_latest
main(["train", *sys.argv[2:]])
"""


@pytest.mark.parametrize("point", ["step:3", "save:4", "pointer:4"],
                         ids=["during_a_step", "during_a_save", "after_save_before_pointer"])
def test_kill_9_then_resume_equals_the_uninterrupted_run(pair, straight, tmp_path, point):
    out = tmp_path / "run"
    r = subprocess.run([PY, "-c", KILL_AT, point, *overrides(pair, out, *FAST)], cwd=REPO, env=subprocess_env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == -9, r.stderr[-2000:]  # killed by SIGKILL at the named point
    for noise in ("Removed shared tensor", "Loading weights", "Writing model shards", "Generating train split"):
        assert noise not in r.stdout + r.stderr  # quiet: only the run's own lines
    expected = {"step:3": "step_000002", "save:4": "step_000002", "pointer:4": "step_000004"}[point]
    assert ckpt.find_latest(out) == out / expected
    if point == "save:4":
        assert (out / "step_000004.tmp").is_dir() and not (out / "step_000004").exists()
    if point == "pointer:4":
        assert (out / "latest").read_text() == "step_000002"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        s = train(compose(overrides(pair, out, "train.resume=true", *FAST)), log=QUIET)
    finally:
        torch.set_num_threads(threads)
    assert s["steps"] == 4 and (out / "latest").read_text() == "step_000004"
    assert s["last_eval"]["step"] == 4  # the final evaluation is made even when the kill came before it
    assert sorted(_train_steps(out)) == [1, 2, 3, 4] == _train_steps(out)
    _assert_same_weights(out / "step_000004", straight / "step_000004")
    assert not (out / "step_000004.tmp").exists()
    assert os.listdir(out / "step_000004")  # complete, with its manifest
    assert ckpt.is_complete(out / "step_000004")


def test_target_data_is_never_written_into_a_folder_that_is_not_its_cache(pair, tmp_path):
    """data.target_generated.path naming a model folder (or a user's save_to_disk dataset) is refused before any
    model loads (exit 2, nothing written), and by the cache writer itself when train is called in-process."""
    folder = tmp_path / "model"
    shutil.copytree(pair["draft"], folder)
    (folder / "dataset").mkdir()  # a user's own dataset, which the cache would save over
    (folder / "dataset" / "data.arrow").write_text("user data")
    before = sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))
    ov = overrides(pair, tmp_path / "run", "data.completions=target", f"data.target_generated.path={folder}",
                   "train.max_steps=1", *FAST)
    for cmd in ("generate-data", "train"):
        r = subprocess.run([PY, "-m", "distill", cmd, *ov], cwd=REPO, env=subprocess_env(), capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 2 and "data.target_generated.path" in r.stderr and "Traceback" not in r.stderr
    with pytest.raises(SetupError, match="no target-data cache"):
        train(compose(ov), log=QUIET)
    assert sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) == before
    assert (folder / "dataset" / "data.arrow").read_text() == "user data"


def test_generate_data_checks_its_cache_folder_whatever_data_completions_says(pair, tmp_path, capsys):
    """generate-data writes the cache even with the default data.completions=data: a file or a user's folder at
    data.target_generated.path is refused before any model loads (exit 2, not a FileExistsError traceback)."""
    from distill.__main__ import main

    afile = tmp_path / "notes.txt"
    afile.write_text("mine")
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "data.arrow").write_text("user data")
    for path, expect in ((afile, "is a file"), (folder, "no target-data cache")):
        with pytest.raises(SystemExit) as e:
            main(["generate-data", *overrides(pair, tmp_path / "run"), f"data.target_generated.path={path}"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and "data.target_generated.path" in err and expect in err, err
    assert afile.read_text() == "mine" and sorted(p.name for p in folder.iterdir()) == ["data.arrow"]


@pytest.mark.parametrize("name", ["step_000003", "best"])
def test_a_folder_named_like_a_checkpoint_but_not_one_is_never_replaced(pair, tmp_path, name):
    """Found by a new user's trial: train.overwrite=true deleted a user's step_000003/ holding only notes.txt (it
    went by the name), and a run saving step 3 would have replaced it too."""
    out = tmp_path / "run"
    train(compose(overrides(pair, out, "train.max_steps=2")), log=lambda *_: None)
    if (out / name).exists():
        shutil.rmtree(out / name)  # (best/ of the run: replaced by the user's folder of that name)
    (out / name).mkdir()
    (out / name / "notes.txt").write_text("mine")
    for extra in (["train.overwrite=true"], ["train.resume=true", "train.max_steps=4"]):
        with pytest.raises(ckpt.CheckpointError, match=rf"holds {name}, named like a checkpoint of a run but not one"):
            train(compose(overrides(pair, out, *extra)), log=lambda *_: None)
        assert (out / name / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("name, text", [("summary.json", '{"mine": 1}'), ("metrics.jsonl", "my notes\n")])
def test_a_users_own_file_named_like_a_runs_is_never_deleted(pair, tmp_path, name, text):
    """Found by a new user's re-test: train.overwrite=true deleted a user's own summary.json (or metrics.jsonl) in a
    folder holding no run, since a run was recognised by those names alone; now their content tells."""
    out = tmp_path / "run"
    out.mkdir()
    (out / name).write_text(text)
    for extra in ([], ["train.overwrite=true"]):
        with pytest.raises(ckpt.CheckpointError, match=rf"holds no run \({name}\).*move {name} out of it"):
            train(compose(overrides(pair, out, *extra)), log=lambda *_: None)
        assert (out / name).read_text() == text
