"""Checkpoints are data: a crafted pickle in any file a loader reads is refused with an error naming the file, and its
payload never runs (a marker file it would create stays absent). Covers training checkpoints, the earlier pickle
layout and its converter (the pretrain snapshot and token cache: tests/quickstart/test_pretrain_snapshot.py)."""
import pickle
import shutil

import pytest
import torch

from distill import checkpoint as ckpt
from tests.pickle_payload import Payload, fix_manifest as _fix_manifest, plant as _plant
from distill.config import SetupError
from distill.recipe import train
from distill_helpers import compose, overrides

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
    import json

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

def _legacy(pair, run, dst):
    """A checkpoint in the earlier layout, written by the earlier writer's calls (accelerate.save_state +
    torch.save of the scheduler), holding the same state as ``run/step_000002``."""
    from distill.recipe import setup

    cfg = compose(overrides(pair, dst.parent / "unused", "train.max_steps=2"))
    r = setup(cfg, log=lambda *_: None)
    ckpt.load_checkpoint(r.accelerator, r.draft, r.optimizer, r.scheduler, run / "step_000002")
    dst.mkdir(parents=True)
    r.accelerator.save_state(str(dst / "accelerate"))
    torch.save(r.scheduler.state_dict(), dst / "scheduler.pt")
    for name in ("trainer_state.json", "config.yaml"):
        shutil.copy(run / "step_000002" / name, dst / name)
    shutil.copytree(run / "step_000002" / "draft", dst / "draft")
    return dst


@pytest.fixture(scope="module")
def legacy(pair, run, tmp_path_factory):
    return _legacy(pair, run, tmp_path_factory.mktemp("legacy") / "run" / "step_000002")


def test_earlier_layout_is_refused_with_the_convert_command(pair, legacy, tmp_path, capsys):
    with pytest.raises(SetupError, match="python -m distill convert-checkpoint"):
        train(compose(overrides(pair, tmp_path / "r", f"train.resume={legacy}")), log=lambda *_: None)
    # train.resume=true in its run folder said "incomplete ... add train.overwrite=true", which deletes them
    with pytest.raises(SetupError, match=f"were written by an earlier draftkit layout.*convert-checkpoint {legacy}"):
        train(compose(overrides(pair, legacy.parent, "train.resume=true")), log=lambda *_: None)
    from distill.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["convert-checkpoint", str(tmp_path / "nope")])
    assert e.value.code == 2 and f"{tmp_path / 'nope'} does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["scheduler.pt", "accelerate/optimizer.bin", "accelerate/random_states_0.pkl"])
def test_convert_refuses_a_pickle_payload(legacy, tmp_path, capsys, name):
    from distill.__main__ import main

    bad = tmp_path / "step_000002"
    shutil.copytree(legacy, bad)
    marker = tmp_path / "marker"
    _plant(bad / name, marker)
    with pytest.raises(SystemExit) as e:
        main(["convert-checkpoint", str(bad)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and name.split("/")[-1] in err and "not loaded" in err
    assert not marker.exists() and (bad / "scheduler.pt").exists()  # nothing converted half-way


def test_converted_checkpoint_resumes_like_the_original(pair, run, legacy, tmp_path):
    from distill.__main__ import main
    from safetensors.torch import load_file

    conv = tmp_path / "conv" / "step_000002"
    shutil.copytree(legacy, conv)
    (conv / "accelerate" / "NOTES.txt").write_text("mine")  # a file the conversion does not read
    main(["convert-checkpoint", str(conv)])
    assert ckpt.is_complete(conv) and not (conv / "scheduler.pt").exists() and not (conv / "accelerate").exists()
    kept = conv / ckpt.LEGACY_DIR  # the originals, every file, moved out of the loader's way and never deleted
    assert sorted(p.relative_to(kept).as_posix() for p in kept.rglob("*") if p.is_file()) == sorted(
        ["scheduler.pt"] + [f"accelerate/{p.relative_to(legacy / 'accelerate').as_posix()}"
                            for p in (legacy / "accelerate").rglob("*") if p.is_file()] + ["accelerate/NOTES.txt"])
    a, b = tmp_path / "a", tmp_path / "b"
    for src, out in ((run / "step_000002", a), (conv, b)):
        train(compose(overrides(pair, out, f"train.resume={src}", "train.max_steps=4", "eval.temperatures=[0.0]")),
              log=lambda *_: None)
    wa, wb = load_file(str(a / "step_000004" / "model.safetensors")), load_file(str(b / "step_000004" /
                                                                                   "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_an_interrupted_conversion_is_finished_by_running_it_again(legacy, tmp_path, monkeypatch):
    """Found by a new user's trial: a conversion cut between deleting the pickles and writing the manifest left a
    checkpoint that neither converted nor loaded (each command named the other)."""
    from distill.__main__ import main

    conv = tmp_path / "step_000002"
    shutil.copytree(legacy, conv)
    monkeypatch.setattr(ckpt, "write_manifest", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(SystemExit):  # main turns the interrupt into "run the same command again"
        main(["convert-checkpoint", str(conv)])
    assert not ckpt.is_complete(conv) and (conv / ckpt.LEGACY_DIR / "scheduler.pt").is_file()
    assert ckpt.is_legacy(conv)  # so a resume from it names convert-checkpoint, which finishes it
    monkeypatch.undo()
    main(["convert-checkpoint", str(conv)])
    assert ckpt.is_complete(conv) and (conv / ckpt.LEGACY_DIR / "accelerate" / "optimizer.bin").is_file()


def test_convert_names_a_missing_file_and_the_resume_pt_form(legacy, tmp_path, capsys):
    from distill.__main__ import main

    bad = tmp_path / "step_000002"
    shutil.copytree(legacy, bad)
    (bad / "accelerate" / "optimizer.bin").unlink()
    with pytest.raises(SystemExit) as e:
        main(["convert-checkpoint", str(bad)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "optimizer.bin is missing" in err and "tensors and plain types" not in err
    (tmp_path / "pre").mkdir()
    torch.save({"state": {}}, tmp_path / "pre" / "resume.pt")
    with pytest.raises(SystemExit) as e:
        main(["convert-checkpoint", str(tmp_path / "pre")])
    assert e.value.code == 2 and f"convert-checkpoint {tmp_path / 'pre' / 'resume.pt'}" in capsys.readouterr().err


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
