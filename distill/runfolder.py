"""Run folders: what a training run writes into ``train.output_dir``, the lock that keeps a second run out, and
``train.overwrite=true``'s set-aside of an earlier run (put back when the new run stops before its first write).

:func:`prepare_run_folder` checks the folder against ``train.resume``/``train.overwrite`` before anything loads and
returns the checkpoint to resume from; :func:`start_writing` is the new run's first write. The checkpoints inside
the folder are distill/checkpoint.py's.
"""
from __future__ import annotations

import json
import os
import platform
import re
import shutil
import time
from pathlib import Path
from typing import Any, Iterable

import yaml
from omegaconf import DictConfig, OmegaConf

from decode.outputs import WRITE_PROBE, replace_text, write_results as write_results_file
from distill.checkpoint import (LATEST_FILE, MANIFEST_FILE, STATE_FILE, CheckpointError, check_complete,
                                find_latest, in_run_folder, is_complete, is_old_layout, list_checkpoints, mark_latest,
                                name_list, read_json, recover_replaced_dir)
from distill.config import SetupError

# What a training run writes into its output_dir (train.overwrite=true removes these, and only these): names only
# a run writes (with the .tmp/.old of a save in progress), ...
RUN_OWN = re.compile(r"(step_\d+|best|" + re.escape(LATEST_FILE) +
                     r"|metrics\.jsonl|summary\.json|wandb_run_id|draft_base|eval_heldout\.json)(\.tmp|\.old)?")
# ... and names a run writes that a user's own folder may hold too: the run's only in a folder that holds a run.
RUN_SHARED = ("config.yaml", "wandb")
# Held (flock) by the run that trains into the folder: a second `distill train` into it is refused while it lives.
RUN_LOCK = ".distill-train.lock"
# Kept by a fresh run: the sequence-level KD cache that `distill generate-data` writes before `distill train`.
REUSABLE = ("target_data", RUN_LOCK)
# train.overwrite=true moves the earlier run here; it is deleted once the new run has passed every check and loaded
# its models (right before its first write), and put back if the new run stops before that.
SET_ASIDE = ".overwritten"


class FolderBusy(RuntimeError):
    """Another live process holds the folder's lock (:func:`lock_folder`); ``holder`` is what it wrote there."""

    def __init__(self, folder: Path, holder: str):
        super().__init__(f"{folder} is in use by another process ({holder or 'its process is not named'})")
        self.folder, self.holder = folder, holder


def lock_folder(folder: str | Path, name: str):
    """Hold an exclusive lock on ``folder/name`` (created, with ``folder``, if missing) for as long as the returned
    file stays open, or raise :class:`FolderBusy` at once when another process holds it. The lock is the open
    file's ``flock``: the system releases it when the process ends, also on ``kill -9``, so none is ever stale.
    The file names the holder (pid, host, start time) for the refusal. Returns None where ``fcntl`` does not exist
    (Windows: no lock)."""
    try:
        import fcntl
    except ImportError:
        return None
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    f = open(folder / name, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip()
        f.close()
        raise FolderBusy(folder, holder) from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {platform.node()}, started {time.strftime('%Y-%m-%dT%H:%M:%S%z')}\n")
    f.flush()
    return f


def is_main_process() -> bool:
    """Whether this process writes the run's files: rank 0 of a launch, or a lone process (``WORLD_SIZE`` unset or
    1: a ``RANK`` left in the environment by a cluster job must not turn a single run's folder checks off)."""
    return int(os.environ.get("WORLD_SIZE", "1")) <= 1 or int(os.environ.get("RANK", "0")) == 0


def _busy(output_dir: str | Path, holder: str) -> CheckpointError:
    return CheckpointError(f"another distill train is running into train.output_dir={output_dir} "
                           f"({holder or 'its process is not named'}); nothing was changed. Wait for it to finish "
                           "or stop it (Ctrl-C: it saves first), or choose another train.output_dir")


def lock_run_folder(output_dir: str | Path):
    """:func:`lock_folder` for a training run's ``train.output_dir`` (``RUN_LOCK``): two runs into one folder
    would save over each other's checkpoints, and one's ``train.overwrite=true`` would delete the other's running
    files. Raises CheckpointError naming the other run's process, or a lock file that cannot be opened."""
    try:
        return lock_folder(output_dir, RUN_LOCK)
    except FolderBusy as err:
        raise _busy(output_dir, err.holder) from None
    except OSError as err:  # another user's lock file, a folder of that name, ...
        raise CheckpointError(f"cannot take the run lock {Path(output_dir) / RUN_LOCK} ({err.strerror or err}); "
                              "make it a file you can write (it holds only the running run's pid), or choose "
                              "another train.output_dir") from None


def check_no_live_run(output_dir: str | Path) -> None:
    """Raise CheckpointError when a ``distill train`` holds ``output_dir``'s ``RUN_LOCK`` now, without taking the
    lock or creating anything (the command line's checks before the run, whose advice about the folder's contents
    would be wrong while another run writes them)."""
    path = Path(output_dir) / RUN_LOCK
    try:
        import fcntl

        f = open(path)
    except (ImportError, OSError):  # no lock file (no run has been here), or one lock_run_folder will name
        return
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _busy(output_dir, f.read().strip()) from None


def run_artifacts(folder: Path) -> list[Path]:
    """The entries of ``folder`` that a ``distill train`` run wrote (empty: the folder holds no run), sorted.

    A run is recognised by names only a run writes (``RUN_OWN``: ``step_N``, ``best``, ``metrics.jsonl``, ...), or
    by a ``config.yaml`` that is a recipe config; then its ``config.yaml`` and ``wandb/`` are the run's too. In a
    folder without those, ``config.yaml`` and ``wandb/`` are the user's (a user's ``step_3_keep`` or
    ``step_3.bak`` is never the run's either)."""
    entries = sorted(Path(folder).iterdir())
    own = [p for p in entries if RUN_OWN.fullmatch(p.name) and not _foreign(p)]
    run_config = _is_run_config(Path(folder) / "config.yaml")
    if own and not run_config and all(p.name in _BY_CONTENT for p in own) and not any(map(_run_file, own)):
        own = []  # only a summary.json / metrics.jsonl a run did not write: the user's, not a run
    if own or run_config:
        own = sorted(own + [p for p in entries if p.name in RUN_SHARED])
    return own


def _foreign(path: Path) -> bool:
    """A ``step_N`` or ``best`` entry that is not a checkpoint (a file, or a folder with neither trainer_state.json
    nor a manifest): named like the run's, but the user's. (``.tmp``/``.old`` ones are a save's own leftovers.)"""
    if not re.fullmatch(r"step_\d+|best", path.name):
        return False
    return not (path.is_dir() and ((path / STATE_FILE).is_file() or (path / MANIFEST_FILE).is_file()))


_BY_CONTENT = ("summary.json", "metrics.jsonl")  # run names a user's own file may have: told apart by content


def _run_file(path: Path) -> bool:
    """Whether ``path`` (``summary.json`` or ``metrics.jsonl``) is one a run wrote: a link or anything but a regular
    file counts as the run's; a summary is a JSON object with ``steps``, metrics are empty (killed before the first
    row) or start with a JSON object row."""
    if path.is_symlink() or not path.is_file():
        return True
    try:
        text = path.read_text()
        if path.name == "summary.json":
            row = json.loads(text)
            return isinstance(row, dict) and "steps" in row
        first = next((line for line in text.splitlines() if line.strip()), None)
        return first is None or isinstance(json.loads(first), dict)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False


def _is_run_config(path: Path) -> bool:
    """Whether ``path`` is the config.yaml a run writes (a mapping with the recipe's train/loss/draft sections)."""
    if not path.is_file():
        return False
    try:
        cfg = yaml.safe_load(path.read_text())
    except Exception:  # not text, not YAML: not ours
        return False
    return isinstance(cfg, dict) and {"train", "loss", "draft"} <= set(cfg) and isinstance(cfg["train"], dict) \
        and "output_dir" in cfg["train"]


def other_entries(folder: Path, ours: Iterable[str] = ()) -> list[str]:
    """Sorted names in ``folder`` other than ``ours`` and write probes: what a command must not write among."""
    ours = set(ours)
    return sorted(p.name for p in Path(folder).iterdir() if p.name not in ours and not p.name.startswith(WRITE_PROBE))


def discard_set_aside(output_dir: str | Path) -> None:
    """Delete the run ``train.overwrite=true`` set aside (:func:`prepare_run_folder`), if any. A symlink in it is
    removed, never what it points to."""
    folder = Path(output_dir) / SET_ASIDE
    if folder.is_dir():
        shutil.rmtree(folder)


def restore_set_aside(output_dir: str | Path) -> None:
    """Put the run ``train.overwrite=true`` set aside back where it was, if any: the new run stopped before its
    first write. An entry the new run made under the same name (a LoRA run's ``draft_base``) gives way."""
    out = Path(output_dir)
    folder = out / SET_ASIDE
    if not folder.is_dir():
        return
    for p in folder.iterdir():
        dest = out / p.name
        if os.path.lexists(dest):
            dest.unlink() if dest.is_symlink() or not dest.is_dir() else shutil.rmtree(dest)
        p.rename(dest)
    folder.rmdir()


def prepare_run_folder(output_dir: str | Path, resume: Any, overwrite: bool, main: bool = True,
                       inputs: dict[str, Any] | None = None, log: Any = None) -> Path | None:
    """Check ``train.output_dir`` against ``train.resume``/``train.overwrite`` before anything loads; return the
    checkpoint to resume from (None for a fresh run).

    - a fresh run (resume false) needs a missing or empty folder (a ``target_data`` cache is fine); with
      ``overwrite`` the earlier run's files (:func:`run_artifacts`) are moved into ``SET_ASIDE`` (the caller deletes
      them with :func:`discard_set_aside` once the new run starts writing, or puts them back with
      :func:`restore_set_aside` if it stops before), other files are left alone; a folder holding no run but
      other files is refused, also with ``overwrite`` when one of them has a name the run writes (``RUN_SHARED``);
    - ``resume=true`` takes the newest complete ``step_*`` checkpoint of the folder (see :func:`find_latest`);
    - ``resume=PATH`` needs a complete checkpoint at PATH, and an output folder that is PATH's own run or empty,
      holding no complete checkpoint newer than PATH (resuming would overwrite it).

    Only the main process (``main``) checks and clears the folder; the others only find the checkpoint.
    ``inputs`` (setting -> path, e.g. ``{"draft.name_or_path": ...}``) are what the run will read: ``overwrite``
    refuses to delete a folder that holds one of them (a draft started from the run's own ``best``). With
    ``resume=true``, newer step folders that are incomplete or damaged are named to ``log`` with the reason they
    were skipped (the run replaces them when it reaches their step).

    Raises:
        CheckpointError: the folder holds another run, there is no complete checkpoint to resume from,
            ``overwrite`` would delete one of ``inputs``, or an earlier overwrite's ``SET_ASIDE`` is still there.
    """
    out = Path(output_dir)
    resume = None if resume in (None, False, "false", "") else resume
    foreign = sorted(p.name for p in out.iterdir() if _foreign(p)) if main and out.is_dir() else []
    if foreign:  # a save of that step (or best/) would replace it, fresh or resumed
        raise CheckpointError(
            f"train.output_dir={out} holds {name_list(foreign)}, named like a checkpoint of a run but not one (no "
            f"{STATE_FILE}); a run saves folders of that name over what is there, so nothing was changed. Move or "
            "rename it, or choose another train.output_dir")
    if resume is None:
        if main:
            _prepare_fresh(out, overwrite, inputs or {})
        return None
    own_run = resume is True or resume == "true" or in_run_folder(str(resume), out)
    source = recover_replaced_dir(out / "best") if main and own_run else None
    if source is not None and log is not None:
        log(f"best/ was missing after a save interrupted between two renames; restored it from {source.name}/")
    if resume is True or resume == "true":
        return _latest_to_resume(out, log if main else None)
    path = Path(str(resume))
    check_complete(path)
    if main:
        _check_resume_into(out, path, overwrite)
    return path


def _prepare_fresh(out: Path, overwrite: bool, inputs: dict[str, Any]) -> None:
    """The fresh-run part of :func:`prepare_run_folder`: refuse a folder holding a run (unless ``overwrite``) or
    the user's own files, and move an overwritten run's files into ``SET_ASIDE``."""
    others = other_entries(out, REUSABLE) if out.is_dir() else []
    if not others:
        return
    if os.path.lexists(out / SET_ASIDE):  # before "holds no run ... pass train.overwrite=true"
        raise CheckpointError(
            f"{out / SET_ASIDE} holds the run an earlier train.overwrite=true set aside before it stopped; "
            f"nothing was changed. Move its entries back into {out} (or delete it if that run is not "
            "needed), then run again")
    doomed = run_artifacts(out)
    if not doomed:  # the user's own files: a run writes beside them only if asked, never over them
        clash = [name for name in others if name in RUN_SHARED or name in _BY_CONTENT]
        if clash or not overwrite:
            fix = (f"move {', '.join(clash)} out of it (the run writes files of those names)" if clash else
                   "pass train.overwrite=true to train beside them (they are kept)")
            raise CheckpointError(
                f"train.output_dir={out} is not empty and holds no run ({name_list(others)}); nothing was "
                f"changed. Choose an empty or new train.output_dir, or {fix}")
        return
    if not overwrite:
        raise CheckpointError(
            f"train.output_dir={out} already holds a run ({name_list(others)}); nothing was changed. "
            "Continue it with train.resume=true, start over with train.overwrite=true (deletes that run's "
            "checkpoints and metrics), or choose another train.output_dir")
    for setting, value in inputs.items():
        if value in (None, ""):
            continue
        path = Path(str(value)).expanduser().resolve()
        hit = next((d for d in doomed if path == d.resolve() or d.resolve() in path.parents), None)
        if hit is not None:
            raise CheckpointError(
                f"train.overwrite=true would delete {hit}, which holds {setting}={value}; nothing was "
                "changed. Copy it out of train.output_dir first, or choose another train.output_dir")
    (out / SET_ASIDE).mkdir()
    for p in doomed:  # renames in one folder: a symlink moves as itself
        p.rename(out / SET_ASIDE / p.name)


def _latest_to_resume(out: Path, log: Any) -> Path:
    """``train.resume=true``: the newest complete checkpoint of ``out``; newer incomplete ones are named to ``log``.

    Raises:
        CheckpointError: none is complete; the message says why (an earlier pickle layout, a run set aside, damage).
    """
    path = find_latest(out)
    if log is not None and path is not None:  # (with none complete, the error below lists them)
        for skipped in list_checkpoints(out):
            if int(skipped.name[5:]) <= int(path.name[5:]):
                continue
            try:
                check_complete(skipped)
            except CheckpointError as err:
                log(f"warning: resume skips {skipped.name}: {err}. The run saves over it when it reaches that "
                    "step; copy it elsewhere first if you need it")
    if path is not None:
        return path
    steps = list_checkpoints(out)
    old = [p.name for p in steps if is_old_layout(p)]
    if old:  # not "incomplete": they are whole, only of a layout this version does not read
        raise CheckpointError(
            f"train.resume=true but the checkpoints of train.output_dir={out} ({name_list(old)}) are not draftkit "
            "checkpoints of this version: an earlier draftkit stored their state as pickles, which are never "
            "unpickled (unpickling can run code). Re-run the training with this version into another "
            "train.output_dir (or with train.overwrite=true, which deletes those checkpoints)")
    if os.path.lexists(out / SET_ASIDE):  # "add train.overwrite=true" is refused while it is there
        raise CheckpointError(
            f"train.resume=true but train.output_dir={out} has no checkpoint: an earlier "
            f"train.overwrite=true set its run aside in {out / SET_ASIDE} and was stopped before it could put "
            f"it back. Move its entries back into {out} to resume that run (or delete {SET_ASIDE} if it is "
            "not needed), then run again")
    if not out.is_dir() or not other_entries(out, REUSABLE):  # a run stopped before its first save left nothing
        raise CheckpointError(f"train.resume=true but train.output_dir={out} has no complete checkpoint: it holds no "
                              "run at all (nothing was saved there). Start the run with train.resume=false, or give "
                              "train.resume=PATH")
    found = [p.name for p in steps]
    detail = (f"its step folders {found} are incomplete (no {MANIFEST_FILE}, or damaged)" if found
              else "it has no step_N checkpoint")
    raise CheckpointError(f"train.resume=true but train.output_dir={out} has no complete checkpoint: "
                          f"{detail}. Start a new run with train.resume=false (add train.overwrite=true to "
                          "replace this folder's run), or give train.resume=PATH")


def _check_resume_into(out: Path, path: Path, overwrite: bool) -> None:
    """``train.resume=PATH``: refuse an ``out`` whose newer checkpoints the resumed run would overwrite, or that
    holds another run (unless ``overwrite``)."""
    newer = [p.name for p in list_checkpoints(out) if is_complete(p) and int(p.name[5:]) > _step_of(path)]
    if newer:
        raise CheckpointError(f"resuming from {path} into train.output_dir={out} would overwrite its newer "
                              f"checkpoints {newer}; resume into another train.output_dir")
    same_run = in_run_folder(path, out)
    if not same_run and out.is_dir() and any(p.name not in REUSABLE for p in out.iterdir()) and not overwrite:
        raise CheckpointError(f"train.output_dir={out} already holds another run; resume from {path} into an empty "
                              "train.output_dir, or pass train.overwrite=true")


def _step_of(path: Path) -> int:
    return int(read_json(path / STATE_FILE).get("step", 0))


def resolve_resume(cfg: DictConfig, log: Any = None) -> Path | None:
    """The checkpoint a run of ``cfg`` resumes from (``train.resume`` true: the newest complete one in
    ``train.output_dir``; a path: that one; None for a fresh run), after :func:`prepare_run_folder` has checked that
    the run folder may be written. The run's inputs are named so that an overwrite never deletes one of them."""
    inputs = {key: OmegaConf.select(cfg, key) for key in ("draft.name_or_path", "target.name_or_path",
                                                          "target.tokenizer", "draft.tokenizer", "data.logit_cache",
                                                          "data.source.path")}
    return prepare_run_folder(cfg.train.output_dir, cfg.train.get("resume"), bool(cfg.train.get("overwrite", False)),
                              main=is_main_process(), inputs=inputs, log=log)


def start_writing(out: Path, config_yaml: str, resume_from: Path | None, step: int) -> int:
    """The run's first write (main process only): the run ``train.overwrite=true`` set aside goes, ``config.yaml``
    is written (whole or not at all: it marks the folder as a run's), and a resumed run drops the metrics rows
    logged after its checkpoint and points ``latest`` at it (a kill may have come before the pointer update).

    Returns the last step the interrupted run had logged (W&B holds those rows already); -1 for a fresh run.
    """
    discard_set_aside(out)
    out.mkdir(parents=True, exist_ok=True)
    replace_text(out / "config.yaml", config_yaml)
    if resume_from is None:
        return -1
    logged_through = truncate_metrics(out, step)
    if in_run_folder(resume_from, out):
        mark_latest(out, resume_from)
    return logged_through


def truncate_metrics(output_dir: str | Path, step: int) -> int:
    """Drop rows of ``metrics.jsonl`` logged after ``step`` (a resumed run logs them again); returns the highest
    step the file held before (``step`` when it held none later; the W&B run got the same rows)."""
    f = Path(output_dir) / "metrics.jsonl"
    if not f.is_file():
        return step
    lines = f.read_text().splitlines(keepends=True)
    keep, last = [], step
    for line in lines:
        try:
            row_step = json.loads(line).get("step", 0)
        except json.JSONDecodeError:  # a row cut by a kill mid-write
            continue
        last = max(last, row_step)
        if row_step <= step:
            keep.append(line if line.endswith("\n") else line + "\n")
    replace_text(f, "".join(keep))
    return last



def rerun_overrides(output_dir: str | Path) -> list[str]:
    """The overrides with which a tool that owns ``output_dir`` reruns ``distill train`` after an interruption:
    ``train.resume=true`` when the run has a checkpoint folder (it continues where it stopped; one that is damaged,
    since saves are renamed into place whole, is then named by the resume instead of deleted),
    ``train.overwrite=true`` when it was killed before its first save (nothing to continue), none for a new run."""
    out = Path(output_dir)
    if out.is_dir() and (list_checkpoints(out) or (out / "best").is_dir()):
        return ["train.resume=true"]
    return ["train.overwrite=true"] if out.is_dir() and any(out.iterdir()) else []



def write_results(text: str, out: str, overwrite: bool) -> None:
    """:func:`decode.outputs.write_results` for an ``--out`` of ``distill eval`` / ``bench-step``, with a full disk
    as a SetupError naming ``--out`` (exit 2; the results were printed before)."""
    try:
        write_results_file(text, out, overwrite)
    except ValueError as err:
        raise SetupError(f"--out: {err}") from err
