"""Checkpoints of a training run, stored as data: tensors in safetensors, everything else in JSON or YAML.

Layout of ``<output_dir>/step_000100/`` (and ``best/``)::

    draft/                        Hugging Face save_pretrained of the draft (the LoRA adapter only, when LoRA is on)
                                  + tokenizer: what export and ``draft.name_or_path=<run>/best`` read
    model.safetensors             the full draft state dict as the training loop holds it (shared tensors stored once)
    optimizer.safetensors         optimizer tensors (AdamW moments and step counts), keys ``state.<param>.<name>``
    optimizer.json                the optimizer's param groups and its non-tensor per-parameter values
    scheduler.json                LR scheduler state_dict (plain numbers)
    scaler.json                   the fp16 GradScaler state (only with train.mixed_precision=fp16)
    rng_state_<rank>.safetensors  torch CPU (and CUDA) generator states of process <rank>
    rng_state_<rank>.json         Python ``random`` and NumPy generator states of process <rank>
    trainer_state.json            step, data position, tokens seen, best metric, last evaluation, draft base, c
    config.yaml                   the resolved training config
    eval.json                     (optional, written after the save) the evaluation of this step and the best so far
    manifest.json                 written last: format version, step and the size of every file above

Nothing here is unpickled: loading a checkpoint reads safetensors, JSON and YAML only, so a checkpoint from
someone else cannot run code (PyTorch's own advice since ``weights_only=True`` became the default; Hugging Face
moved to safetensors for the same reason). A checkpoint is *complete* only when ``manifest.json`` exists and every
file it lists has the recorded size. Saves are written to ``NAME.tmp`` with the manifest last and then renamed, so a
run killed at any point leaves the previous checkpoints complete; resume takes the newest complete one.
``<output_dir>/latest`` names it too, for people; resume does not depend on it.

Runs under DeepSpeed or FSDP hold sharded optimizer state that only ``accelerator.save_state`` can gather; there the
model/optimizer/RNG part goes to ``accelerate/`` through accelerate (safetensors for the model; its loader uses
``torch.load(weights_only=True)`` for the rest, and DeepSpeed's own loader for DeepSpeed engines).

Checkpoints of the earlier layout (``scheduler.pt`` and ``accelerate/*.bin``/``*.pkl`` pickles) are refused with a
message naming :func:`convert_legacy` (``python -m distill convert-checkpoint PATH``), which reads them once with
``torch.load(weights_only=True)`` and an allowlist of NumPy array types, and writes this layout.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
from pathlib import Path
from typing import Any, Iterable

import torch

from distill.config import SetupError

STATE_FILE = "trainer_state.json"
LATEST_FILE = "latest"
MANIFEST_FILE = "manifest.json"
EVAL_FILE = "eval.json"
FORMAT_VERSION = 2
FAULT_ENV = "DRAFTKIT_FAULT"  # test hook: "point:step" kills the process (SIGKILL) at that point, see fault_point
LEGACY_FILES = ("scheduler.pt", "accelerate/optimizer.bin", "accelerate/pytorch_model.bin",
                "accelerate/random_states_0.pkl", "accelerate/scheduler.bin", "accelerate/scaler.pt")


class CheckpointError(SetupError):
    """A checkpoint or output folder that cannot be used: incomplete, corrupt, from an unsafe layout, not a checkpoint,
    or holding work that would be overwritten. A SetupError (ValueError), so the CLIs exit 2 with the message."""


def step_dir(output_dir: str | Path, step: int) -> Path:
    """``<output_dir>/step_000123``."""
    return Path(output_dir) / f"step_{step:06d}"


def fault_point(name: str, step: int) -> None:
    """Kill this process with SIGKILL when ``$DRAFTKIT_FAULT`` is ``name:step`` (crash tests; no effect otherwise).

    Points: ``step`` (mid optimizer step, after backward), ``save`` (mid save, some files written, no manifest),
    ``pointer`` (after a complete save, before ``latest`` is updated and old checkpoints are pruned).
    """
    if os.environ.get(FAULT_ENV) == f"{name}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)


# ------------------------------------------------------------------------------------------------ writing

def replace_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all: into ``path.tmp``, then renamed over ``path``. A kill or a
    full disk mid-write leaves the previous file (or none), never a cut one that reads as damaged; a ``.tmp`` whose
    write failed is removed. Raises what the file system raises."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)


def write_json(path: Path, obj: Any) -> None:
    """``obj`` as indented JSON, written whole or not at all (:func:`replace_text`; raises TypeError for anything
    JSON cannot hold: state must be plain data)."""
    replace_text(path, json.dumps(obj, indent=2, allow_nan=True))


def save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors file of ``tensors``; tensors sharing storage (tied weights) are stored as separate copies."""
    from safetensors.torch import save_file

    seen, out = set(), {}
    for key, t in tensors.items():
        t = t.detach().to("cpu")
        ptr = t.untyped_storage().data_ptr() if t.numel() else None  # any two views of one storage: copy the later
        out[key] = t.clone().contiguous() if ptr in seen else t.contiguous()
        if ptr is not None:
            seen.add(ptr)
    save_file(out, str(path))


def optimizer_to_data(state_dict: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """An optimizer state_dict as (tensors ``state.<param>.<name>``, JSON part: param groups and other values)."""
    tensors, rest = {}, {}
    for pid, values in state_dict["state"].items():
        for name, v in values.items():
            if isinstance(v, torch.Tensor):
                tensors[f"state.{pid}.{name}"] = v
            else:
                rest.setdefault(str(pid), {})[name] = v
    return tensors, {"param_groups": state_dict["param_groups"], "scalars": rest}


def _rng_to_data() -> tuple[dict[str, torch.Tensor], dict]:
    import numpy as np

    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda.{i}"] = s
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return tensors, {"python": [version, list(internal), gauss],
                     "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]}


def _is_sharded(accelerator: Any) -> bool:
    from accelerate.utils import DistributedType

    return accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP)


def write_manifest(folder: Path, step: int) -> None:
    """``folder/manifest.json`` listing every file's size (but the originals a conversion kept in
    ``LEGACY_DIR``); written last, it marks the folder complete."""
    files = {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*"))
             if p.is_file() and p.name not in (MANIFEST_FILE, EVAL_FILE)
             and p.relative_to(folder).parts[0] != LEGACY_DIR}
    write_json(folder / MANIFEST_FILE, {"format": FORMAT_VERSION, "complete": True, "step": step, "files": files})


def write_results(text: str, out: str, overwrite: bool) -> None:
    """:func:`decode.outputs.write_results` for an ``--out`` of ``distill eval`` / ``bench-step``, with a full disk
    as a SetupError naming ``--out`` (exit 2; the results were printed before)."""
    from decode.outputs import write_results as write
    from distill.config import SetupError

    try:
        write(text, out, overwrite)
    except ValueError as err:
        raise SetupError(f"--out: {err}") from err


def replace_dir(tmp: Path, path: Path) -> None:
    """Move the finished ``tmp`` to ``path``; an existing ``path`` is moved aside first and deleted last, so a
    crash at any point leaves a complete copy under ``path``, ``path.old`` or ``tmp``."""
    old = path.with_name(path.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if path.exists():
        path.rename(old)
    tmp.rename(path)
    if old.exists():
        shutil.rmtree(old)


def complete_copy_aside(path: Path) -> Path | None:
    """The complete copy that a crash inside :func:`replace_dir` left beside a missing ``path``: ``path.tmp`` (the
    one being installed) if its manifest says complete, else ``path.old``; None when there is none."""
    path = Path(path)
    return next((p for p in (path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old"))
                 if p.is_dir() and is_complete(p)), None)


def recover_replaced_dir(path: Path) -> Path | None:
    """After a crash inside :func:`replace_dir` (``path`` moved aside, the new copy not yet in place), put the newest
    complete copy (:func:`complete_copy_aside`) back at ``path``. Returns the folder it came from, or None when
    ``path`` exists or no complete copy is found. Without this a reader that looks only at ``path`` would start
    over, and the next save would delete both. (A run's ``best/`` is restored on resume; a ``step_N`` left that way
    is not: the main process would rename it while the other processes choose their checkpoint, so resume takes
    the step before it, and reaching step N again rewrites it.)"""
    path = Path(path)
    source = None if path.exists() else complete_copy_aside(path)
    if source is not None:
        source.rename(path)
    return source


def save_checkpoint(accelerator: Any, draft: Any, tokenizer: Any, scheduler: Any, optimizer: Any, state: dict,
                    config_yaml: str, path: str | Path) -> Path:
    """Write a complete checkpoint at ``path`` (atomically replacing an existing one). Call on every process.

    Every process writes its RNG state; the main process writes the rest, then ``manifest.json``, then renames
    ``path.tmp`` to ``path``.

    Raises:
        CheckpointError: the file system refused a write (a full disk, a quota): the half-written ``path.tmp`` is
            removed (freeing its space), the previous checkpoints stay complete, and the message says how to go on.
    """
    from safetensors import SafetensorError

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        return _save_checkpoint(accelerator, draft, tokenizer, scheduler, optimizer, state, config_yaml, path, tmp)
    except (OSError, SafetensorError) as err:  # (safetensors reports a full disk as its own error type)
        if accelerator.is_main_process and not is_complete(tmp):  # (a complete one is what resume may restore)
            shutil.rmtree(tmp, ignore_errors=True)
        newest = find_latest(path.parent)
        kept = f"the newest complete checkpoint, {newest}, is intact" if newest else "no complete checkpoint exists yet"
        raise CheckpointError(f"could not save the checkpoint {path} ({type(err).__name__}: {err}); the partial "
                              f"{tmp.name} was removed and {kept}. Free space on that disk (e.g. delete "
                              "older step_N folders of the run; train.keep_last=N keeps fewer), then continue with "
                              "train.resume=true") from err


def _save_checkpoint(accelerator: Any, draft: Any, tokenizer: Any, scheduler: Any, optimizer: Any, state: dict,
                     config_yaml: str, path: Path, tmp: Path) -> Path:
    """:func:`save_checkpoint`'s writes into ``tmp``, then the rename to ``path``."""
    if accelerator.is_main_process and tmp.exists():
        shutil.rmtree(tmp)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    rank = accelerator.process_index
    if _is_sharded(accelerator):
        accelerator.save_state(str(tmp / "accelerate"), safe_serialization=True)
    else:
        rng_tensors, rng_rest = _rng_to_data()
        save_tensors(rng_tensors, tmp / f"rng_state_{rank}.safetensors")
        write_json(tmp / f"rng_state_{rank}.json", rng_rest)
    unwrapped = accelerator.unwrap_model(draft)
    state_dict = accelerator.get_state_dict(draft)
    if accelerator.is_main_process:
        if not _is_sharded(accelerator):
            save_tensors(state_dict, tmp / "model.safetensors")
            fault_point("save", int(state.get("step", -1)))
            opt_tensors, opt_rest = optimizer_to_data(optimizer.state_dict())
            save_tensors(opt_tensors, tmp / "optimizer.safetensors")
            write_json(tmp / "optimizer.json", opt_rest)
            if getattr(accelerator, "scaler", None) is not None:
                write_json(tmp / "scaler.json", accelerator.scaler.state_dict())
        if hasattr(unwrapped, "peft_config"):  # adapter weights only; the base is named in trainer_state.json
            unwrapped.save_pretrained(str(tmp / "draft"))
        else:
            unwrapped.save_pretrained(str(tmp / "draft"), state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(str(tmp / "draft"))
        write_json(tmp / "scheduler.json", scheduler.state_dict())
        write_json(tmp / STATE_FILE, state)
        (tmp / "config.yaml").write_text(config_yaml)
    accelerator.wait_for_everyone()  # every process's RNG file is written before the manifest lists them
    if accelerator.is_main_process:
        write_manifest(tmp, int(state.get("step", -1)))
        replace_dir(tmp, path)
    accelerator.wait_for_everyone()
    return path


def write_eval(path: str | Path, last_eval: dict | None, best: dict | None) -> None:
    """Record the evaluation made after saving ``path`` (``eval.json``; :func:`read_state` merges it)."""
    path = Path(path)
    write_json(path / EVAL_FILE, {"last_eval": last_eval, "best": best})


def mark_latest(output_dir: str | Path, path: str | Path) -> None:
    """Point ``<output_dir>/latest`` at a complete checkpoint (written after it, for people and scripts)."""
    latest = Path(output_dir) / LATEST_FILE
    tmp = latest.with_name(LATEST_FILE + ".tmp")
    tmp.write_text(Path(path).name)
    tmp.replace(latest)


# ------------------------------------------------------------------------------------------------ finding

def is_complete(path: str | Path) -> bool:
    """True when ``path/manifest.json`` says complete and every listed file exists with its recorded size."""
    try:
        check_complete(path)
        return True
    except CheckpointError:
        return False


def run_folder_hint(path: str | Path) -> str | None:
    """When ``path`` is a run folder (``train.output_dir``) given where a checkpoint is needed, the sentence that
    says so and names its newest complete ``step_N`` (and ``best/``); None for any other folder."""
    path = Path(path)
    if path.name == LATEST_FILE and path.is_file():  # the run's pointer file, not a folder
        return (f"{path} is the run's pointer to its newest checkpoint, not a checkpoint; give the folder it names: "
                f"{path.parent / path.read_text().strip()}")
    if not ((path / LATEST_FILE).is_file() or list_checkpoints(path)):
        return None
    newest = find_latest(path)
    if newest is None:
        return (f"{path} is a run folder, not a checkpoint, and it has no complete step_N checkpoint; give a step_N "
                "or best folder of a run")
    best = " (or its best/ folder)" if (path / "best").is_dir() else ""
    return f"{path} is a run folder, not a checkpoint; give one of its checkpoints, e.g. its newest: {newest}{best}"


def is_legacy(path: str | Path) -> bool:
    """Whether ``path`` is a checkpoint of the earlier pickle layout (state file and pickles, no manifest), which
    :func:`convert_legacy` converts."""
    path = Path(path)
    return (not (path / MANIFEST_FILE).is_file() and (path / STATE_FILE).is_file()
            and any((path / f).exists() for f in (*LEGACY_FILES, LEGACY_DIR)))  # (LEGACY_DIR: a conversion cut short)


def check_complete(path: str | Path) -> dict:
    """The manifest of a complete checkpoint; raises CheckpointError saying what is missing or wrong."""
    path = Path(path)
    manifest_file = path / MANIFEST_FILE
    if not manifest_file.is_file():
        if is_legacy(path):
            raise CheckpointError(
                f"{path} was written by an earlier draftkit layout that stores state as pickles (scheduler.pt, "
                "accelerate/*.bin, *.pkl); unpickling can run code, so it is not read. If you trust where it came "
                f"from, convert it once: python -m distill convert-checkpoint {path} (reads the pickles with "
                "torch.load(weights_only=True), which rebuilds only tensors and plain types, and writes safetensors "
                "and JSON)")
        hint = run_folder_hint(path)
        if hint is not None:
            raise CheckpointError(hint)
        if not path.exists():
            aside = complete_copy_aside(path)
            if aside is not None:
                raise CheckpointError(f"{path} does not exist, but {aside} is a complete copy of it (a save was "
                                      f"interrupted between two renames): rename it back (mv {aside} {path}), "
                                      "or resume the run with train.resume=true, which does that")
            newest = find_latest(path.parent)
            why = ""
            if newest is not None:  # a folder of a run: name what it has (step folders are step_000100, 6 digits)
                why = " (a run writes best/ only when it evaluates)" if path.name == "best" else ""
                steps = [p.name for p in list_checkpoints(path.parent)]
                why += f"; its run has {name_list(steps)}, the newest complete one {newest}"
            raise CheckpointError(f"{path} does not exist{why}; give a step_N or best folder of a run")
        raise CheckpointError(f"{path} is not a complete distill checkpoint (no {MANIFEST_FILE}: its save was "
                              "interrupted, or it is not a checkpoint); give a step_N or best folder of a run")
    manifest = read_json(manifest_file)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_VERSION or not manifest.get("complete"):
        raise CheckpointError(f"{manifest_file} is not a format-{FORMAT_VERSION} manifest of a complete checkpoint")
    for name, size in manifest.get("files", {}).items():
        f = path / name
        if not f.is_file() or f.stat().st_size != size:
            raise CheckpointError(f"{path} is incomplete or damaged: {name} is missing or has the wrong size "
                                  f"(manifest: {size} bytes); use another checkpoint of the run")
    return manifest


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """``step_*`` folders of a run, oldest first (complete or not; ``*.tmp`` and ``*.old`` leftovers excluded)."""
    out = [p for p in Path(output_dir).glob("step_*") if p.is_dir() and p.name[5:].isdigit()]
    return sorted(out, key=lambda p: int(p.name[5:]))


def find_latest(output_dir: str | Path) -> Path | None:
    """The newest complete step checkpoint of a run (by step number, whatever ``latest`` says), or None."""
    complete = [p for p in list_checkpoints(output_dir) if is_complete(p)]
    return complete[-1] if complete else None


def rerun_overrides(output_dir: str | Path) -> list[str]:
    """The overrides with which a tool that owns ``output_dir`` reruns ``distill train`` after an interruption:
    ``train.resume=true`` when the run has a checkpoint folder (it continues where it stopped; one that is damaged,
    since saves are renamed into place whole, is then named by the resume instead of deleted),
    ``train.overwrite=true`` when it was killed before its first save (nothing to continue), none for a new run."""
    out = Path(output_dir)
    if out.is_dir() and (list_checkpoints(out) or (out / "best").is_dir()):
        return ["train.resume=true"]
    return ["train.overwrite=true"] if out.is_dir() and any(out.iterdir()) else []


def prune(output_dir: str | Path, keep_last: int) -> list[Path]:
    """Delete complete ``step_*`` checkpoints older than the newest ``keep_last`` complete ones; returns them.

    Never deletes the newest complete checkpoint (the one resume takes), an incomplete folder (not ours to judge), or
    ``best/``. ``keep_last`` <= 0 keeps everything.
    """
    if keep_last <= 0:
        return []
    complete = [p for p in list_checkpoints(output_dir) if is_complete(p)]
    doomed = complete[:-keep_last]
    for p in doomed:
        shutil.rmtree(p)
    return doomed


# ------------------------------------------------------------------------------------------------ reading

def read_json(path: Path) -> Any:
    """Parsed JSON; raises CheckpointError naming the file when it is not JSON (e.g. a pickle)."""
    try:
        return json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} is not a valid JSON file ({type(e).__name__}: {e}); the checkpoint is damaged or "
                              "was not written by draftkit") from e


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file as CPU tensors; raises CheckpointError naming the file when it is not safetensors."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise not_safetensors(path, e) from e


def not_safetensors(path: Path, err: Exception) -> CheckpointError:
    """The error for a checkpoint file that safetensors cannot read (a pickle, a truncated or damaged file)."""
    return CheckpointError(f"{path} is not a valid safetensors file ({type(err).__name__}: {err}); the checkpoint is "
                           "damaged or was not written by draftkit")


def read_state(path: str | Path) -> dict:
    """trainer_state.json of a complete checkpoint, with its ``eval.json`` merged in.

    Raises:
        CheckpointError: not a checkpoint, incomplete (no manifest, files missing or truncated), an earlier pickle
            layout (the message names the conversion command), or a file that is not valid JSON.
    """
    path = Path(path)
    check_complete(path)
    state = read_json(path / STATE_FILE)
    if not isinstance(state, dict):
        raise CheckpointError(f"{path / STATE_FILE} does not hold a JSON object")
    bad = [k for k in ("step", "examples_consumed", "tokens_seen") if (k == "step" or k in state) and
           (isinstance(state.get(k), bool) or not isinstance(state.get(k), int) or state[k] < 0)]
    if bad:  # a resume would fail later with a bare int() traceback, or silently start at step 0
        raise CheckpointError(f"{path / STATE_FILE} has {', '.join(f'{k}={state.get(k)!r}' for k in bad)}; each must "
                              "be an integer >= 0. The checkpoint is damaged or was not written by draftkit")
    if (path / EVAL_FILE).is_file():
        state.update({k: v for k, v in read_json(path / EVAL_FILE).items() if v is not None})
    return state


def read_config(path: str | Path) -> dict | None:
    """The checkpoint's ``config.yaml`` (YAML safe_load: plain data only), or None if it has none.

    Raises CheckpointError naming the file when it is not YAML.
    """
    import yaml

    f = Path(path) / "config.yaml"
    if not f.is_file():
        return None
    try:
        config = yaml.safe_load(f.read_text())
    except (UnicodeDecodeError, yaml.YAMLError) as e:
        raise CheckpointError(f"{f} is not a valid YAML file ({type(e).__name__}); the checkpoint is damaged or was not "
                              "written by draftkit") from e
    if not isinstance(config, dict):
        raise CheckpointError(f"{f} does not hold a YAML mapping (the training config)")
    return config


def _restore(pieces: dict, like: Any) -> Any:
    """JSON lists back to tuples where the live optimizer holds a tuple (AdamW's betas)."""
    if isinstance(like, tuple) and isinstance(pieces, list):
        return tuple(pieces)
    return pieces


def load_optimizer(optimizer: Any, path: Path) -> None:
    """Load ``path/optimizer.safetensors`` + ``path/optimizer.json`` (see :func:`optimizer_to_data`).

    Raises CheckpointError naming the file when its contents do not fit the optimizer (a damaged or edited file: a
    missing key, a tensor of another shape), which would otherwise fail later, mid-step, with a bare traceback.
    """
    tensors = load_tensors(path / "optimizer.safetensors")
    meta = read_json(path / "optimizer.json")
    live_groups = optimizer.state_dict()["param_groups"]
    groups = meta.get("param_groups") if isinstance(meta, dict) else None
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise CheckpointError(f"{path / 'optimizer.json'} has no list of param_groups; the checkpoint is damaged or "
                              "was not written by draftkit")
    if len(groups) != len(live_groups):
        raise CheckpointError(f"{path}: the optimizer has {len(live_groups)} parameter groups, the checkpoint "
                              f"{len(groups)}; resume with the model and settings (draft, train.lora) the checkpoint was made with")
    groups = [{k: _restore(v, live.get(k)) for k, v in g.items()} for g, live in zip(groups, live_groups)]
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state: dict[int, dict] = {}
    try:
        for key, t in tensors.items():
            _, pid, name = key.split(".", 2)
            if t.dim() and t.shape != params[int(pid)].shape:  # (scalars: the step count)
                raise ValueError(f"{key} has shape {tuple(t.shape)}, its parameter {tuple(params[int(pid)].shape)}")
            state.setdefault(int(pid), {})[name] = t
        for pid, values in meta.get("scalars", {}).items():
            state.setdefault(int(pid), {}).update(values)
        optimizer.load_state_dict({"state": state, "param_groups": groups})
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
        raise CheckpointError(f"{path / 'optimizer.safetensors'} / optimizer.json do not fit the draft's optimizer "
                              f"({type(e).__name__}: {e}); the checkpoint is damaged, or resume with the draft and "
                              "train.lora settings it was made with") from e


def _load_scheduler(scheduler: Any, path: Path) -> None:
    """Load ``path/scheduler.json``; its values must have the kinds the live scheduler's have, and it must hold
    base_lrs and last_epoch (a damaged or edited file would otherwise be taken as it is and fail at the next step)."""
    saved, live = read_json(path / "scheduler.json"), scheduler.state_dict()

    def kind(v: Any) -> type:
        return float if isinstance(v, (int, float)) and not isinstance(v, bool) else type(v)

    saved = saved if isinstance(saved, dict) else {}  # (keys a torch version added may be absent: not required)
    bad = [k for k in live if (k in saved and kind(saved[k]) is not kind(live[k]))
           or (k not in saved and k in ("base_lrs", "last_epoch"))]
    if bad:
        raise CheckpointError(f"{path / 'scheduler.json'} does not hold this LR scheduler's state (missing or wrong "
                              f"type: {name_list(bad)}); the checkpoint is damaged or was not written by draftkit")
    scheduler.load_state_dict(saved)


def _load_rng(path: Path, rank: int) -> bool:
    """Restore this process's generators; False when the checkpoint has no state for ``rank``."""
    import numpy as np

    if not (path / f"rng_state_{rank}.json").is_file():
        return False
    tensors = load_tensors(path / f"rng_state_{rank}.safetensors")
    rest = read_json(path / f"rng_state_{rank}.json")
    try:
        torch.set_rng_state(tensors["torch_cpu"])
        cuda = [tensors[f"torch_cuda.{i}"] for i in range(len(tensors)) if f"torch_cuda.{i}" in tensors]
        if cuda and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(cuda)
        version, internal, gauss = rest["python"]
        random.setstate((version, tuple(internal), gauss))
        kind, keys, pos, has_gauss, cached = rest["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    except (KeyError, TypeError, ValueError, RuntimeError, OverflowError) as e:
        raise CheckpointError(f"{path}/rng_state_{rank}.safetensors / rng_state_{rank}.json do not hold generator "
                              f"states ({type(e).__name__}: {e}); the checkpoint is damaged or was not written by "
                              "draftkit") from e
    return True


def _load_weights(model: Any, weights: dict[str, torch.Tensor], path: Path) -> None:
    """Load a full state dict; a key may be missing only when its tensor is tied to a loaded one (older saves
    dropped the duplicate of a tied pair)."""
    try:
        missing, unexpected = model.load_state_dict(weights, strict=False)
    except RuntimeError as e:
        raise CheckpointError(f"{path}/model.safetensors does not fit the draft being trained ({e}); resume with "
                              "the checkpoint's draft and train.lora settings") from e
    live = model.state_dict()
    loaded = {live[k].data_ptr() for k in weights if k in live}
    untied = [k for k in missing if live[k].data_ptr() not in loaded]
    if unexpected or untied:
        raise CheckpointError(f"{path}/model.safetensors does not fit the draft being trained (missing {untied}, "
                              f"unexpected {list(unexpected)}); resume with the checkpoint's draft and train.lora "
                              "settings")


def load_checkpoint(accelerator: Any, draft: Any, optimizer: Any, scheduler: Any, path: str | Path,
                    log: Any = print) -> dict:
    """Restore draft weights, optimizer, scheduler, scaler and RNG states; return trainer_state.json.

    Only safetensors, JSON and YAML are read. Raises CheckpointError (see :func:`read_state`), or when the weights
    do not fit the draft being trained.
    """
    path = Path(path)
    state = read_state(path)
    if (path / "accelerate").is_dir():
        if not _is_sharded(accelerator):
            raise CheckpointError(f"{path} was saved by a DeepSpeed/FSDP run (accelerate/); resume it with the same "
                                  "accelerate launcher config")
        accelerator.load_state(str(path / "accelerate"), load_kwargs={"weights_only": True})
    else:
        _load_weights(accelerator.unwrap_model(draft), load_tensors(path / "model.safetensors"), path)
        load_optimizer(optimizer, path)
        if (path / "scaler.json").is_file() and getattr(accelerator, "scaler", None) is not None:
            accelerator.scaler.load_state_dict(read_json(path / "scaler.json"))
        if not _load_rng(path, accelerator.process_index):
            log(f"warning: {path} has no RNG state for process {accelerator.process_index} (it was saved by fewer "
                "processes); this process keeps its seeded generators")
    _load_scheduler(scheduler, path)
    return state


# ------------------------------------------------------------------------------------------------ legacy layout

def _numpy_allowlist() -> list:
    """Globals NumPy arrays in accelerate's RNG pickle need; they rebuild arrays, nothing else."""
    import codecs

    import numpy as np

    core = getattr(np, "_core", None) or np.core
    allow = [core.multiarray._reconstruct, np.ndarray, np.dtype, codecs.encode]
    if hasattr(np, "dtypes"):
        allow.append(np.dtypes.UInt32DType)
    return allow


def load_pickle_as_data(path: str | Path) -> Any:
    """``torch.load(path, weights_only=True)`` with the NumPy array allowlist: tensors and plain types only.

    Raises CheckpointError naming the file when it holds anything else (e.g. a pickle that would call a function).
    """
    try:
        if not hasattr(torch.serialization, "safe_globals"):  # torch < 2.5: no allowlist, arrays are refused too
            return torch.load(path, map_location="cpu", weights_only=True)
        with torch.serialization.safe_globals(_numpy_allowlist()):
            return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError as e:
        raise CheckpointError(f"{path} is missing") from e
    except Exception as e:  # noqa: BLE001  (UnpicklingError, RuntimeError, EOFError...: all mean "not plain data")
        # (torch's own advice, to load with weights_only=False, is left out: that runs the pickle's code)
        raise CheckpointError(f"{path} holds more than tensors and plain types, or is damaged; it is not loaded "
                              f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from e


LEGACY_DIR = "legacy-layout"  # where convert_legacy keeps a checkpoint's original pickles (never deleted)
LEGACY_ORIGINALS = ("scheduler.pt", "accelerate")  # what convert_legacy moves into LEGACY_DIR


def convert_legacy(path: str | Path) -> Path:
    """Rewrite a checkpoint of the earlier pickle layout in place as the data layout above, keeping the originals.

    Reads ``scheduler.pt``, ``accelerate/optimizer.bin`` and ``accelerate/random_states_0.pkl`` with
    :func:`load_pickle_as_data` and ``accelerate/model.safetensors`` as safetensors, all before anything moves;
    then moves ``scheduler.pt`` and ``accelerate/`` (every file in it) into ``<path>/legacy-layout/``, writes the
    new files and the manifest last. An interrupted conversion is finished by running it again (it reads the
    originals from ``legacy-layout/``). A pretrain snapshot ``<out>/resume.pt`` becomes ``<out>/resume/`` and is
    kept as it is.

    Raises:
        CheckpointError: the path is missing, already converted, not of the earlier layout (naming the
            ``resume.pt`` form when the folder holds one), a file is missing or holds anything but data.
    """
    path = Path(path)
    if path.is_file() and path.name.endswith(".pt"):
        return _convert_pretrain_resume(path)
    if not path.exists():
        raise CheckpointError(f"{path} does not exist; give the step_N folder of the earlier layout to convert")
    if (path / MANIFEST_FILE).is_file():
        raise CheckpointError(f"{path} already has the data layout ({MANIFEST_FILE}); nothing to convert")
    legacy = path / LEGACY_DIR
    src = {name: legacy / name if (legacy / name).exists() else path / name for name in LEGACY_ORIGINALS}
    if path.is_dir() and (path / "resume.pt").is_file() and not (path / STATE_FILE).is_file():
        if (path / "resume").is_dir():
            raise CheckpointError(f"{path} holds resume.pt and resume/, its conversion; nothing to convert")
        raise CheckpointError(f"{path} holds a pretrain snapshot of the earlier layout: convert the file, "
                              f"python -m distill convert-checkpoint {path / 'resume.pt'}")
    if not (path / STATE_FILE).is_file() or not src["scheduler.pt"].is_file():
        raise CheckpointError(f"{path} is not a checkpoint of the earlier layout (needs {STATE_FILE} and "
                              "scheduler.pt)")
    acc_dir = src["accelerate"]
    for need in (acc_dir / "optimizer.bin", acc_dir / "random_states_0.pkl"):
        if not need.is_file():
            raise CheckpointError(f"{need} is missing: the checkpoint is incomplete and cannot be converted")
    scheduler = load_pickle_as_data(src["scheduler.pt"])
    optimizer = load_pickle_as_data(acc_dir / "optimizer.bin")
    rng = load_pickle_as_data(acc_dir / "random_states_0.pkl")
    if (acc_dir / "model.safetensors").is_file():
        weights = load_tensors(acc_dir / "model.safetensors")
    else:
        weights = load_pickle_as_data(acc_dir / "pytorch_model.bin")
    state = read_json(path / STATE_FILE)
    legacy.mkdir(exist_ok=True)
    for name, source in src.items():  # the originals are kept, out of the loader's way (accelerate/ means DeepSpeed)
        if source.parent != legacy:
            source.rename(legacy / name)
    tmp = path / "convert.tmp"
    if tmp.exists():  # an interrupted conversion's own output
        shutil.rmtree(tmp)
    tmp.mkdir()
    save_tensors(weights, tmp / "model.safetensors")
    opt_tensors, opt_rest = optimizer_to_data(optimizer)
    save_tensors(opt_tensors, tmp / "optimizer.safetensors")
    write_json(tmp / "optimizer.json", opt_rest)
    write_json(tmp / "scheduler.json", scheduler)
    version, internal, gauss = rng["random_state"]
    kind, keys, pos, has_gauss, cached = rng["numpy_random_seed"]
    save_tensors({"torch_cpu": rng["torch_manual_seed"]}, tmp / "rng_state_0.safetensors")
    write_json(tmp / "rng_state_0.json", {"python": [version, list(internal), gauss],
                                           "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]})
    for f in tmp.iterdir():
        f.replace(path / f.name)
    tmp.rmdir()
    write_manifest(path, int(state.get("step", -1)))
    return path


def _convert_pretrain_resume(path: Path) -> Path:
    """``<out>/resume.pt`` of ``python -m quickstart pretrain`` -> ``<out>/resume/`` (see quickstart/pretrain.py);
    ``resume.pt`` is kept, and a ``resume/`` that exists already is refused (it may be a newer snapshot)."""
    out = path.with_name("resume")
    if os.path.lexists(out):  # (a dangling link too)
        raise CheckpointError(f"{out} exists already (a snapshot of the current layout, maybe newer than {path.name})"
                              f"; nothing was changed. Move it away first if {path.name} is the one to resume from")
    snap = load_pickle_as_data(path)
    if not isinstance(snap, dict) or not {"model", "optimizer", "generator", "state"} <= set(snap):
        raise CheckpointError(f"{path} is not a pretrain resume snapshot (needs model, optimizer, generator, state)")
    tmp = path.with_name("resume.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_tensors(snap["model"], tmp / "model.safetensors")
    tensors, rest = optimizer_to_data(snap["optimizer"])
    save_tensors(tensors, tmp / "optimizer.safetensors")
    write_json(tmp / "optimizer.json", rest)
    save_tensors({"generator": snap["generator"]}, tmp / "generator.safetensors")
    write_json(tmp / "state.json", snap["state"])
    write_manifest(tmp, int(snap["state"].get("step", -1)))
    tmp.rename(out)
    return out


# ------------------------------------------------------------------------------------------------ run folders

# What a training run writes into its output_dir (train.overwrite=true removes these, and only these): names only
# a run writes (with the .tmp/.old of a save in progress), ...
RUN_OWN = re.compile(r"(step_\d+|best|" + re.escape(LATEST_FILE) +
                     r"|metrics\.jsonl|summary\.json|wandb_run_id|draft_base)(\.tmp|\.old)?")
# ... and names a run writes that a user's own folder may hold too: the run's only in a folder that holds a run.
RUN_SHARED = ("config.yaml", "wandb")
# Held (flock) by the run that trains into the folder: a second `distill train` into it is refused while it lives.
RUN_LOCK = ".distill-train.lock"
# Kept by a fresh run: the sequence-level KD cache that `distill generate-data` writes before `distill train`.
REUSABLE = ("target_data", RUN_LOCK)
# train.overwrite=true moves the earlier run here; it is deleted once the new run has passed every check and loaded
# its models (right before its first write), and put back if the new run stops before that.
SET_ASIDE = ".overwritten"
WRITE_PROBE = ".draftkit-write-probe-"  # decode.outputs.writable's short-lived file (another rank's check)


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
    import platform
    import time

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
        import yaml

        cfg = yaml.safe_load(path.read_text())
    except Exception:  # not text, not YAML: not ours
        return False
    return isinstance(cfg, dict) and {"train", "loss", "draft"} <= set(cfg) and isinstance(cfg["train"], dict) \
        and "output_dir" in cfg["train"]


def other_entries(folder: Path, ours: Iterable[str] = ()) -> list[str]:
    """Sorted names in ``folder`` other than ``ours`` and write probes: what a command must not write among."""
    ours = set(ours)
    return sorted(p.name for p in Path(folder).iterdir() if p.name not in ours and not p.name.startswith(WRITE_PROBE))


def name_list(names: list[str], most: int = 5) -> str:
    """``"a, b, c"``, or the first ``most`` names and ``"and N more"``: names in an error message."""
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(names[:most]) + more


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
    own_run = resume is True or resume == "true" or Path(str(resume)).resolve().parent == out.resolve()
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
        CheckpointError: none is complete; the message says why (old pickle layout, a run set aside, damage).
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
    legacy = [p for p in steps if is_legacy(p)]
    if legacy:  # "incomplete ... add train.overwrite=true" would have sent the user to delete them
        names = name_list([p.name for p in legacy])
        raise CheckpointError(
            f"train.resume=true but the checkpoints of train.output_dir={out} ({names}) were written by an "
            "earlier draftkit layout that stores state as pickles; they are not read. If you trust where they "
            f"came from, convert the newest once: python -m distill convert-checkpoint {legacy[-1]} (reads "
            "the pickles as data only), then resume")
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
    same_run = out.resolve() == path.resolve().parent
    if not same_run and out.is_dir() and any(p.name not in REUSABLE for p in out.iterdir()) and not overwrite:
        raise CheckpointError(f"train.output_dir={out} already holds another run; resume from {path} into an empty "
                              "train.output_dir, or pass train.overwrite=true")


def _step_of(path: Path) -> int:
    return int(read_json(path / STATE_FILE).get("step", 0))


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

