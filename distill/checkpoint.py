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

A folder of an earlier draftkit layout (``scheduler.pt`` and ``accelerate/*.bin``/``*.pkl`` pickles, no manifest)
is refused as not a checkpoint of this version, without being read.

Resuming is a function of this module too: :func:`check_resume_settings` and :func:`kept_costs` read the
checkpoint before any model loads, :func:`resume_state` restores it into the live draft, optimizer and schedule,
:func:`data_position` says where the data stream continues and :func:`resume_warnings` what a changed config changes.
"""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from omegaconf import DictConfig, OmegaConf
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from decode.outputs import replace_dir, replace_text, write_json
from distill.config import SetupError

STATE_FILE = "trainer_state.json"
LATEST_FILE = "latest"
MANIFEST_FILE = "manifest.json"
EVAL_FILE = "eval.json"
FORMAT_VERSION = 2
# what an earlier draftkit layout stored as pickles: a folder holding one and no manifest is refused, never read
OLD_LAYOUT_FILES = ("scheduler.pt", "accelerate/optimizer.bin", "accelerate/pytorch_model.bin",
                    "accelerate/random_states_0.pkl", "accelerate/scheduler.bin", "accelerate/scaler.pt")


class CheckpointError(SetupError):
    """A checkpoint or output folder that cannot be used: incomplete, corrupt, from an unsafe layout, not a checkpoint,
    or holding work that would be overwritten. A SetupError (ValueError), so the CLIs exit 2 with the message."""


def step_dir(output_dir: str | Path, step: int) -> Path:
    """``<output_dir>/step_000123``."""
    return Path(output_dir) / f"step_{step:06d}"


# ------------------------------------------------------------------------------------------------ writing

def save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors file of ``tensors``; tensors sharing storage (tied weights) are stored as separate copies."""
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
    """``folder/manifest.json`` listing every file's size; written last, it marks the folder complete."""
    files = {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*"))
             if p.is_file() and p.name not in (MANIFEST_FILE, EVAL_FILE)}
    write_json(folder / MANIFEST_FILE, {"format": FORMAT_VERSION, "complete": True, "step": step, "files": files})


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
    replace_text(Path(output_dir) / LATEST_FILE, Path(path).name)


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


def is_old_layout(path: str | Path) -> bool:
    """Whether ``path`` is a checkpoint of an earlier draftkit layout that stored state as pickles (a state file and
    pickles, no manifest); such a folder is refused without being read."""
    path = Path(path)
    return (not (path / MANIFEST_FILE).is_file() and (path / STATE_FILE).is_file()
            and any((path / f).exists() for f in OLD_LAYOUT_FILES))


def check_complete(path: str | Path) -> dict:
    """The manifest of a complete checkpoint; raises CheckpointError saying what is missing or wrong."""
    path = Path(path)
    manifest_file = path / MANIFEST_FILE
    if not manifest_file.is_file():
        if is_old_layout(path):
            raise CheckpointError(
                f"{path} is not a draftkit checkpoint of this version: an earlier draftkit stored its state as pickles "
                "(scheduler.pt, accelerate/*.bin, *.pkl), which are never unpickled (unpickling can run code). "
                "Re-run the training with this version (or re-export the draft from a run of this version)")
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


def in_run_folder(path: str | Path, output_dir: str | Path) -> bool:
    """Whether the checkpoint ``path`` is one of ``output_dir``'s own (its ``step_N`` or ``best``), not another
    run's: a resume from it continues that run rather than forking a new one."""
    return Path(path).resolve().parent == Path(output_dir).resolve()


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """``step_*`` folders of a run, oldest first (complete or not; ``*.tmp`` and ``*.old`` leftovers excluded)."""
    out = [p for p in Path(output_dir).glob("step_*") if p.is_dir() and p.name[5:].isdigit()]
    return sorted(out, key=lambda p: int(p.name[5:]))


def find_latest(output_dir: str | Path) -> Path | None:
    """The newest complete step checkpoint of a run (by step number, whatever ``latest`` says), or None."""
    complete = [p for p in list_checkpoints(output_dir) if is_complete(p)]
    return complete[-1] if complete else None


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


def name_list(names: list[str], most: int = 5) -> str:
    """``"a, b, c"``, or the first ``most`` names and ``"and N more"``: names in an error message."""
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(names[:most]) + more


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
            layout, or a file that is not valid JSON.
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


def load_weights(model: Any, weights: dict[str, torch.Tensor], path: Path) -> None:
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
        load_weights(accelerator.unwrap_model(draft), load_tensors(path / "model.safetensors"), path)
        load_optimizer(optimizer, path)
        if (path / "scaler.json").is_file() and getattr(accelerator, "scaler", None) is not None:
            accelerator.scaler.load_state_dict(read_json(path / "scaler.json"))
        if not _load_rng(path, accelerator.process_index):
            log(f"warning: {path} has no RNG state for process {accelerator.process_index} (it was saved by fewer "
                "processes); this process keeps its seeded generators")
    _load_scheduler(scheduler, path)
    return state


# ------------------------------------------------------------------------------------------------ resuming

def check_resume_settings(saved: dict, cfg: DictConfig, resume_from: Path | None) -> None:
    """Settings a resume cannot honour, checked against the checkpoint's trainer_state.json (``saved``; empty for
    a fresh run) before any model loads. Raises SetupError naming the setting and the fix."""
    asked_stop, at = cfg.train.get("stop_at"), int(saved.get("step", 0))
    if asked_stop is not None and asked_stop < at:
        raise SetupError(f"train.stop_at={asked_stop} is before step {at}, where the checkpoint it resumes stops "
                         f"({resume_from}); a run cannot go back: set train.stop_at above {at} (or drop it to go on "
                         "to train.max_steps), or resume an earlier checkpoint with train.resume=<its step_N folder>")
    best_by = (saved.get("best") or {}).get("metric")
    same_folder = resume_from is not None and in_run_folder(resume_from, cfg.train.output_dir)  # (not a fork)
    if same_folder and best_by is not None and best_by != cfg.eval.select_by:
        raise SetupError(f"eval.select_by={cfg.eval.select_by} differs from the run's {best_by}, by which its best/ "
                         f"(step {saved['best'].get('step')}) was chosen: the two values are not comparable. Resume "
                         f"with eval.select_by={best_by}, or fork into a new folder with train.resume={resume_from} "
                         "train.output_dir=NEW (its best/ starts over)")
    if "lora" in saved and bool(saved["lora"]) != bool(cfg.train.lora.enabled):
        lora = bool(saved["lora"])
        raise SetupError(f"the checkpoint {resume_from} was trained {'with' if lora else 'without'} LoRA; resume it "
                         f"with train.lora.enabled={str(lora).lower()}"
                         + (" and the run's other train.lora settings" if lora else ""))
    if saved.get("lora") and cfg.train.lora.enabled:  # these shape the adapter the checkpoint's weights belong to
        old_lora = ((resume_from and read_config(resume_from)) or {}).get("train", {}).get("lora") or {}
        lora = OmegaConf.to_container(cfg.train.lora)
        for key in ("r", "alpha", "target_modules", "modules_to_save"):
            if key in old_lora and _lora_value(old_lora[key]) != _lora_value(lora[key]):
                was, now = _override_form(old_lora[key]), _override_form(lora[key])
                raise SetupError(
                    f"train.lora.{key}={now} differs from the checkpoint's {was} ({resume_from}): its adapter weights "
                    f"were trained {'at the scale alpha / r' if key in ('r', 'alpha') else 'on those modules'} and "
                    f"would be restored into another adapter. Resume with train.lora.{key}={was}, or start a new run "
                    "from an export of this one")


def kept_costs(saved: dict, cfg: DictConfig) -> tuple[float | None, list[float] | None]:
    """The cost ratio c and verify costs v_γ a resumed run keeps from its checkpoint's trainer_state.json
    (``saved``): c unless ``eval.cost_ratio`` sets one, and v_γ with it (a checkpoint from before verify costs were
    kept has none: it goes on with v = 1, as it started). (None, None) for a fresh run or a set c."""
    kept_c = saved.get("cost_ratio") if cfg.eval.get("cost_ratio") is None else None
    return kept_c, saved.get("verify_costs") if kept_c is not None else None


def resume_state(fresh: dict, path: Path, cfg: DictConfig, accelerator: Any, draft: Any, optimizer: Any,
                 scheduler: Any, kept: tuple, log: Any) -> dict:
    """Restore the checkpoint ``path`` into the live draft, optimizer, scheduler and generators, and return the
    trainer state the loop goes on with: the checkpoint's, with what belongs to this run taken from ``fresh`` (the
    state a new run would start with): the costs it uses, its own ``draft_base`` (in a moved run folder, not the
    old path) and the target's revision now (the earlier ones are listed). ``kept`` is :func:`kept_costs`."""
    state = {**fresh, **load_checkpoint(accelerator, draft, optimizer, scheduler, path, log)}
    for note in apply_optim_settings(optimizer, scheduler, cfg):  # the checkpoint's were loaded
        log(f"resume: {note}")
    for key in ("cost_ratio", "verify_costs", "draft_base"):
        state[key] = fresh[key]
    _follow_target_revision(state, fresh["target_revision"], cfg, log)
    log(f"resumed from {path} at step {state['step']}")
    if state.get("best") and not in_run_folder(path, cfg.train.output_dir):
        # a fork into a new run folder: its best/ would be missing though the state names one
        old = state["best"]
        log(f"resume into another run folder: its best checkpoint starts over (the earlier run's best, "
            f"{old['metric']} {old['value']:.4f} at step {old['step']}, stays in {Path(path).parent / 'best'})")
        state["best"] = None
    kept_c, kept_v = kept
    if kept_c is not None:
        verify = ("set by eval.verify_costs" if cfg.eval.get("verify_costs") is not None else
                  "kept" if kept_v is not None else "none recorded, so v = 1 as the run started")
        log(f"resume: keeping the checkpoint's cost ratio c={kept_c:.3f} (measured when the run started; "
            f"set eval.cost_ratio to use another); verify costs: {verify}")
    return state


def _follow_target_revision(state: dict, revision: str | None, cfg: DictConfig, log: Any) -> None:
    """Record in ``state`` that the run goes on against the target at ``revision``; a checkpoint trained against
    another one is warned about, and that revision is listed with the step it reached."""
    if state.get("target_revision") != revision:
        log(f"warning: target {cfg.target.name_or_path} is at revision {revision} (the cache's refs/main); "
            f"the checkpoint was trained against {state.get('target_revision')}: the run goes on against "
            f"{revision} (trainer_state.json and the export card list both)")
        earlier = list(state.get("earlier_target_revisions") or [])
        state["earlier_target_revisions"] = [*earlier, {"target_revision": state.get("target_revision"),
                                                        "through_step": int(state["step"])}]
    state["target_revision"] = revision


def apply_optim_settings(optimizer: Any, scheduler: Any, cfg: DictConfig) -> list[str]:
    """Set ``optim.lr``, ``optim.weight_decay``, ``optim.betas`` and ``optim.eps`` of ``cfg`` on an optimizer and
    LambdaLR schedule that a resume loaded from a checkpoint (their state dicts carry the values the run started
    with, which a changed config would otherwise leave in force while config.yaml recorded the new ones). The
    schedule keeps its step: the learning rate becomes ``optim.lr`` × the schedule's factor there. Returns one line
    per value that changed."""
    lr, betas, eps = float(cfg.optim.lr), tuple(float(b) for b in cfg.optim.betas), float(cfg.optim.eps)
    notes = []
    for i, group in enumerate(optimizer.param_groups):
        decay = any(p.ndim >= 2 for p in group["params"])  # build_optimizer's groups: weights, then biases/norms
        want = {"initial_lr": lr, "betas": betas, "eps": eps, "weight_decay": float(cfg.optim.weight_decay) if decay
                else 0.0}
        for key, value in want.items():
            old = group.get(key)
            if old is not None and (tuple(old) if key == "betas" else old) != value:
                name = "lr" if key == "initial_lr" else key
                shown = list(value) if key == "betas" else value
                note = f"optim.{name}={shown} (the checkpoint's {old}) applies from here"
                if note not in notes:
                    notes.append(note)
            group[key] = value
        scheduler.base_lrs[i] = lr
        group["lr"] = lr * scheduler.lr_lambdas[i](scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]  # what get_last_lr() and its state say
    return notes


def data_position(state: dict, cfg: DictConfig, world: int, log: Any) -> int:
    """Micro-batches consumed by the checkpoint's steps; another world size continues at the same example."""
    batch = int(cfg.train.batch_size)
    consumed = int(state.get("examples_consumed", 0))
    if consumed % batch:
        raise SetupError(f"the checkpoint stopped at example {consumed}, which is not a multiple of "
                         f"train.batch_size={batch} (it was trained with batch_size={state.get('batch_size')}); "
                         f"resume with train.batch_size={state.get('batch_size')}")
    saved_world = state.get("num_processes")
    if saved_world is not None and saved_world != world:
        log(f"resume: the checkpoint was trained by {saved_world} process(es), this run has {world}; continuing at "
            f"example {consumed} ({world * int(cfg.train.grad_accum) * batch} examples per step from here)")
    return consumed // batch


def changed_keys(checkpoint: Path, cfg: DictConfig) -> list[str]:
    """Config keys that decide the data stream and the update, whose values differ from the checkpoint's."""
    saved = read_config(checkpoint)
    if saved is None:
        return []
    saved = OmegaConf.create(saved)
    if OmegaConf.select(saved, "loss.ce_labels") is None:  # a config from before loss.ce_labels: data labels
        OmegaConf.update(saved, "loss.ce_labels", "data", force_add=True)
    keys = ["train.seed", "train.batch_size", "train.grad_accum", "train.max_steps", "data.source", "data.holdout",
            "data.completions", "data.target_logits", "data.logit_cache", "data.logit_cache_k",
            "data.logit_cache_tail_samples", "data.on_policy_fraction", "data.rollout_temperature", "loss.name",
            "loss.beta", "loss.temperature", "loss.ce_weight", "loss.ce_labels", "loss.gamma", "optim",
            "target.name_or_path", "train.lora.dropout"]  # not loss.fused: same update
    absent = object()  # a key the checkpoint's config predates is not a change
    return [k for k in keys if OmegaConf.select(saved, k, default=absent) not in (absent, OmegaConf.select(cfg, k))]


def resume_warnings(checkpoint: Path, cfg: DictConfig, state: dict, world: int) -> list[str]:
    """What a resume changes: each key of :func:`changed_keys`, except ``train.batch_size`` where only the split
    of the same global micro-batch over processes changed and λ = 0 (the data stream and the update are the same);
    with λ > 0 a changed split is named: the λ coin is tossed per process micro-batch, so which rows are on-policy
    changes from there on."""
    split, now = (state.get("num_processes"), state.get("batch_size")), (world, int(cfg.train.batch_size))
    same_global = None not in split and split[0] * split[1] == now[0] * now[1]
    on_policy = float(cfg.data.on_policy_fraction) > 0
    notes = [f"{key} differs from the checkpoint's config; the resumed run is not the same experiment"
             for key in changed_keys(checkpoint, cfg) if not (key == "train.batch_size" and same_global and
                                                               not on_policy)]
    saved = read_config(checkpoint) or {}
    was = (saved.get("logger") or {}).get("project") or "draftkit"
    project = cfg.logger.get("project") or "draftkit"
    if cfg.logger.name == "wandb" and (saved.get("logger") or {}).get("name") == "wandb" and was != project:
        notes.append(f"logger.project={project} differs from the checkpoint's {was}: W&B keeps run ids per project, "
                     f"so the metrics go to a new W&B run in {project}, not on with the one in {was}")
    if on_policy and None not in split and split != now:
        notes.append(f"data.on_policy_fraction={cfg.data.on_policy_fraction}: the checkpoint's micro-batches were "
                     f"{split[0]} process(es) x {split[1]} rows, this run's are {now[0]} x {now[1]}; the λ coin is "
                     "tossed per micro-batch, so which rows are on-policy differs from a run that kept the split "
                     "(the data order does not)")
    return notes


def _override_form(value: Any) -> str:
    """A config value as a Hydra override writes it: 32.0 -> 32, ['q_proj', 'v_proj'] -> [q_proj,v_proj],
    None -> null."""
    if value is None:
        return "null"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(map(str, value)) + "]"
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def _lora_value(value: Any) -> Any:
    """A train.lora value in a comparable form: module lists as sets (null as none), numbers as floats (alpha 32 ==
    32.0)."""
    if value is None or isinstance(value, (list, tuple)):  # modules_to_save: null and [] both save none
        return frozenset(value or ())
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value
