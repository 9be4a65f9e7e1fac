"""Run folders: the lock that keeps a second run out, train.overwrite=true's set-aside, and results files written
whole or not at all (the same rules end to end, through training runs: tests/distill/test_nothing_lost.py)."""
import json

import pytest

from distill import runfolder
from distill.checkpoint import CheckpointError
from distill.config import SetupError


def test_a_lock_file_that_cannot_be_opened_is_named(tmp_path):
    out = tmp_path / "run"
    (out / runfolder.RUN_LOCK).mkdir(parents=True)  # (a lock file of another user reads the same: PermissionError)
    with pytest.raises(SetupError, match=f"cannot take the run lock {out / runfolder.RUN_LOCK} .*make it a file you "
                                         "can write"):
        runfolder.lock_run_folder(out)


def test_an_earlier_overwrite_s_set_aside_run_is_never_overwritten(tmp_path):
    out = tmp_path / "run"
    (out / runfolder.SET_ASIDE / "step_000002").mkdir(parents=True)
    (out / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(CheckpointError, match="holds the run an earlier train.overwrite=true set aside"):
        runfolder.prepare_run_folder(out, False, True)
    assert (out / runfolder.SET_ASIDE / "step_000002").is_dir() and (out / "metrics.jsonl").exists()
    (out / "metrics.jsonl").unlink()  # resume said "no step_N checkpoint ... add train.overwrite=true": a circle
    with pytest.raises(CheckpointError, match="set its run aside in .*Move its entries back"):
        runfolder.prepare_run_folder(out, True, False)
    # a fresh run was told "holds no run (.overwritten) ... or pass train.overwrite=true", which is refused: a circle
    with pytest.raises(CheckpointError, match="holds the run an earlier train.overwrite=true set aside"):
        runfolder.prepare_run_folder(out, False, False)


def test_overwrite_removes_a_symlinked_artifact_not_what_it_points_to(tmp_path):
    out, shared = tmp_path / "run", tmp_path / "shared"
    out.mkdir()
    (shared / "wandb").mkdir(parents=True)
    (shared / "metrics.jsonl").write_text("{}\n")
    (out / "wandb").symlink_to(shared / "wandb")
    (out / "metrics.jsonl").symlink_to(shared / "metrics.jsonl")
    (out / "summary.json").symlink_to(tmp_path / "gone.json")  # a dangling link
    assert runfolder.prepare_run_folder(out, False, True) is None
    runfolder.discard_set_aside(out)
    assert not list(out.iterdir())  # the links are gone ...
    assert (shared / "wandb").is_dir() and (shared / "metrics.jsonl").read_text() == "{}\n"  # ... not their targets


def test_a_results_file_that_cannot_be_written_leaves_no_empty_file(tmp_path, monkeypatch, capsys):
    """eval/bench-step --out opened the file first and wrote into it: a full disk left a 0-byte file (which the
    next run refused to overwrite) and, with --overwrite, emptied the earlier results. Now the file appears whole
    or not at all, and the error names --out (the results were printed before)."""
    import errno

    import decode.outputs

    out = tmp_path / "ev.json"
    runfolder.write_results('{"a": 1}', str(out), overwrite=False)
    assert json.loads(out.read_text()) == {"a": 1}
    real = decode.outputs.os.fdopen

    class Full:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(decode.outputs.os, "fdopen", lambda fd, mode: Full(real(fd, mode)))
    with pytest.raises(SetupError, match="--out: could not write .*No space left"):
        runfolder.write_results('{"a": 2}', str(out), overwrite=True)
    with pytest.raises(SetupError, match="--out: could not write"):
        runfolder.write_results('{"b": 1}', str(tmp_path / "new.json"), overwrite=False)
    assert json.loads(out.read_text()) == {"a": 1} and sorted(p.name for p in tmp_path.iterdir()) == ["ev.json"]
    monkeypatch.setattr(decode.outputs.os, "fdopen", real)
    out.write_text("theirs")  # made while the command ran: kept, the results go beside it
    runfolder.write_results('{"a": 3}', str(out), overwrite=False)
    assert out.read_text() == "theirs" and "appeared during the run and was kept" in capsys.readouterr().err


def test_the_first_write_drops_the_set_aside_run_and_a_resumed_run_s_later_metrics(tmp_path):
    out = tmp_path / "run"
    (out / runfolder.SET_ASIDE / "step_000002").mkdir(parents=True)
    (out / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3, 4)))
    assert runfolder.start_writing(out, "train: {}\n", out / "step_000002", 2) == 4  # steps 3, 4: logged already
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert (out / "latest").read_text() == "step_000002" and (out / "config.yaml").read_text() == "train: {}\n"
    assert not (out / runfolder.SET_ASIDE).exists()
    fresh = tmp_path / "new" / "run"
    assert runfolder.start_writing(fresh, "x: 1\n", None, 0) == -1
    assert sorted(p.name for p in fresh.iterdir()) == ["config.yaml"]
