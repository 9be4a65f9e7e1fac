"""Checkpoints are data: a crafted pickle in any file a loader reads is refused with an error naming the file, and its
payload never runs (a marker file it would create stays absent); a folder of the earlier pickle layout is refused
as not a checkpoint of this version, unread (the pretrain snapshot and token cache:
tests/quickstart/test_pretrain_snapshot.py). Resuming: what a changed config is warned about."""
import json
import pickle
import shutil

import pytest
import torch

from distill import checkpoint as ckpt
from distill.config import SetupError
from distill.recipe import train
from distill_helpers import compose, overrides
from tests.pickle_payload import Payload, fix_manifest as _fix_manifest, plant as _plant

NEW_FILES = ["model.safetensors", "optimizer.safetensors", "optimizer.json", "scheduler.json",
             "rng_state_0.safetensors", "rng_state_0.json", "trainer_state.json", "eval.json", "manifest.json",
             "config.yaml"]


@pytest.fixture(scope="module")
def run(pair, tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "run"
    train(compose(overrides(pair, out, "train.max_steps=2", "eval.every=2", "eval.temperatures=[0.0]")),
          log=lambda *_: None)
    assert (out / "step_000002" / "eval.json").is_file()
    return out


def test_the_payload_runs_when_unpickled(tmp_path):
    """The test pickle is live: plain unpickling creates the marker (so the tests below can fail)."""
    marker = tmp_path / "marker"
    pickle.loads(pickle.dumps(Payload(marker)))
    assert marker.exists()
    marker.unlink()
    _plant(tmp_path / "x.pt", marker)
    torch.load(tmp_path / "x.pt", weights_only=False)
    assert marker.exists()


@pytest.mark.parametrize("name", NEW_FILES)
def test_resume_refuses_a_pickle_in_every_file(pair, run, tmp_path, name):
    bad = tmp_path / "step_000002"
    shutil.copytree(run / "step_000002", bad)
    marker = tmp_path / "marker"
    _plant(bad / name, marker)
    _fix_manifest(bad)
    with pytest.raises(SetupError) as e:
        train(compose(overrides(pair, tmp_path / "resumed", f"train.resume={bad}", "train.max_steps=3")),
              log=lambda *_: None)
    assert name in str(e.value) and "is not a valid" in str(e.value)
    assert not marker.exists()


@pytest.mark.parametrize("name", ["draft/model.safetensors", "draft/config.json", "draft/pytorch_model.bin"])
def test_export_refuses_a_pickle_in_the_draft_folder(run, tmp_path, name):
    bad = tmp_path / "step_000002"
    shutil.copytree(run / "step_000002", bad)
    marker = tmp_path / "marker"
    if name.endswith(".bin"):  # a pickle checkpoint in place of the safetensors one
        (bad / "draft" / "model.safetensors").unlink()
    _plant(bad / name, marker)
    _fix_manifest(bad)
    from distill.export import export

    with pytest.raises(Exception):  # noqa: B017  (transformers' own error; what matters is the payload)
        export(bad, tmp_path / "out")
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_truncated_or_incomplete_checkpoints_are_named(run, tmp_path):
    bad = tmp_path / "step_000002"
    shutil.copytree(run / "step_000002", bad)
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ckpt.CheckpointError, match="model.safetensors is missing or has the wrong size"):
        ckpt.read_state(bad)
    (bad / "manifest.json").unlink()
    with pytest.raises(ckpt.CheckpointError, match="not a complete distill checkpoint"):
        ckpt.read_state(bad)


@pytest.mark.parametrize("name", ["trainer_state.json", "model.safetensors", "scheduler.json", "optimizer.safetensors"])
def test_resume_from_a_truncated_file_exits_2_naming_it(pair, run, tmp_path, capsys, monkeypatch, name):
    """`train.resume=PATH` with a truncated file (a copy cut short, a full disk): one error naming the file, exit 2,
    before any model loads (these gave raw JSON/safetensors/pickle decoder tracebacks)."""
    from distill.__main__ import main

    bad = tmp_path / "step_000002"
    shutil.copytree(run / "step_000002", bad)
    data = (bad / name).read_bytes()
    (bad / name).write_bytes(data[: len(data) // 2])
    monkeypatch.setattr("distill.models.load_target", lambda *a: pytest.fail("a model was loaded"))
    with pytest.raises(SystemExit) as e:
        main(["train", *overrides(pair, tmp_path / "resumed", f"train.resume={bad}")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"{name} is missing or has the wrong size" in err and "Traceback" not in err
    assert not (tmp_path / "resumed").exists()


def _edit_json(path, change):
    path.write_text(json.dumps(change(json.loads(path.read_text()))))


def _edit_tensors(path, change):
    from safetensors.torch import load_file, save_file

    save_file(change(load_file(str(path))), str(path))


def _wrong_exp_avg(tensors):
    key = next(k for k in tensors if k.endswith(".exp_avg"))
    return {**tensors, key: torch.zeros(3)}


EDITS = {  # file -> an edit that keeps it valid JSON / safetensors but not the state a resume restores
    "rng_state_0.json": lambda f: _edit_json(f, lambda d: {"numpy": d["numpy"]}),
    "rng_state_0.safetensors": lambda f: _edit_tensors(f, lambda t: {"torch_cpu": torch.zeros(5)}),
    "optimizer.json": lambda f: _edit_json(f, lambda d: {"scalars": {}}),
    "optimizer.safetensors": lambda f: _edit_tensors(f, _wrong_exp_avg),
    "scheduler.json": lambda f: _edit_json(f, lambda d: {**d, "last_epoch": "abc"}),
    "trainer_state.json": lambda f: _edit_json(f, lambda d: {**d, "step": "two"}),
}


@pytest.mark.parametrize("name", sorted(EDITS))
def test_resume_from_an_edited_file_exits_2_naming_it(pair, run, tmp_path, capsys, name):
    """A checkpoint file that parses but does not hold the state it should (a damaged or hand-edited copy from
    someone else): one error naming the file, exit 2 (these gave KeyError/TypeError tracebacks, some mid-step)."""
    from distill.__main__ import main

    bad = tmp_path / "step_000002"
    shutil.copytree(run / "step_000002", bad)
    EDITS[name](bad / name)
    _fix_manifest(bad)
    with pytest.raises(SystemExit) as e:
        main(["train", *overrides(pair, tmp_path / "resumed", f"train.resume={bad}", "train.max_steps=3")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and name in err and "Traceback" not in err


# ------------------------------------------------------------------------------------------------ earlier layout

@pytest.fixture(scope="module")
def old_layout(run, tmp_path_factory):
    """A checkpoint folder of the earlier pickle layout (its state file, config and draft, with scheduler.pt and
    accelerate/*.bin, *.pkl pickles in place of safetensors and JSON), each pickle a payload."""
    dst = tmp_path_factory.mktemp("old") / "run" / "step_000002"
    dst.mkdir(parents=True)
    for name in ("trainer_state.json", "config.yaml"):
        shutil.copy(run / "step_000002" / name, dst / name)
    shutil.copytree(run / "step_000002" / "draft", dst / "draft")
    for name in ("scheduler.pt", "accelerate/optimizer.bin", "accelerate/random_states_0.pkl"):
        _plant(dst / name, dst.parent.parent / "marker")
    return dst


def test_an_earlier_pickle_layout_is_refused_unread(pair, old_layout, tmp_path, capsys):
    marker = old_layout.parent.parent / "marker"
    with pytest.raises(SetupError, match="is not a draftkit checkpoint of this version.*never unpickled.*Re-run the "
                                         "training"):
        train(compose(overrides(pair, tmp_path / "r", f"train.resume={old_layout}")), log=lambda *_: None)
    # train.resume=true in its run folder names them as of the earlier layout, not as incomplete or damaged
    with pytest.raises(SetupError, match=r"\(step_000002\) are not draftkit checkpoints of this version"):
        train(compose(overrides(pair, old_layout.parent, "train.resume=true")), log=lambda *_: None)
    from distill.export import export

    with pytest.raises(SetupError, match="is not a draftkit checkpoint of this version"):
        export(old_layout, tmp_path / "out")
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_a_full_disk_during_a_save_is_named_and_the_run_resumes_from_the_previous_checkpoint(pair, tmp_path,
                                                                                               monkeypatch):
    """A full disk mid-save was a traceback (safetensors' own error type, exit 1) that left the half-written
    step_N.tmp holding the space the next try needed."""
    import errno

    from safetensors.torch import load_file

    fast = ("eval.temperatures=[0.0]", "eval.at_start=false", "train.max_steps=4")
    straight = tmp_path / "straight"
    train(compose(overrides(pair, straight, *fast)), log=lambda *_: None)
    out = tmp_path / "run"
    real = ckpt.save_tensors

    def disk_full(tensors, path):
        if path.parent.name == "step_000004.tmp" and path.name == "optimizer.safetensors":
            path.write_bytes(b"\0" * 64)  # what fitted before the disk filled
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(tensors, path)

    monkeypatch.setattr(ckpt, "save_tensors", disk_full)
    with pytest.raises(SetupError, match=r"could not save the checkpoint .*step_000004 .*No space left on device.*"
                                         r"step_000004.tmp was removed.*step_000002, is intact.*train.resume=true"):
        train(compose(overrides(pair, out, *fast)), log=lambda *_: None)
    assert not (out / "step_000004.tmp").exists() and ckpt.find_latest(out) == out / "step_000002"
    monkeypatch.setattr(ckpt, "save_tensors", real)
    s = train(compose(overrides(pair, out, *fast, "train.resume=true")), log=lambda *_: None)
    assert s["steps"] == 4
    a, b = (load_file(str(p / "step_000004" / "model.safetensors")) for p in (straight, out))
    assert all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------------------------------------ resuming

def test_a_resume_that_splits_the_global_batch_differently_warns_only_where_the_data_changes(pair, tmp_path):
    """A 2-process run (2 rows each) resumed with 1 process (4 rows) is exact at λ = 0, yet warned that
    train.batch_size changed "the experiment"; at λ > 0 it puts other rows on-policy, and the same generic line was
    all it said."""
    from omegaconf import OmegaConf

    def cfg(*extra):
        return compose(overrides(pair, tmp_path / "run", *extra))

    saved = tmp_path / "step_000002"
    saved.mkdir()
    state = {"num_processes": 2, "batch_size": 2}
    (saved / "config.yaml").write_text(OmegaConf.to_yaml(cfg("train.batch_size=2")))
    assert ckpt.resume_warnings(saved, cfg("train.batch_size=4"), state, world=1) == []
    assert ckpt.resume_warnings(saved, cfg("train.batch_size=3"), state, world=1) == [
        "train.batch_size differs from the checkpoint's config; the resumed run is not the same experiment"]
    (saved / "config.yaml").write_text(OmegaConf.to_yaml(cfg("train.batch_size=2", "data.on_policy_fraction=0.5")))
    notes = ckpt.resume_warnings(saved, cfg("train.batch_size=4", "data.on_policy_fraction=0.5"), state, world=1)
    assert notes[0].startswith("train.batch_size differs")
    assert "2 process(es) x 2 rows, this run's are 1 x 4" in notes[1]
    assert ckpt.resume_warnings(saved, cfg("train.batch_size=2", "data.on_policy_fraction=0.5"), state, world=2) == []
