"""Checkpoints of a training run: draft weights (or adapter), optimizer, scheduler, RNG states, data position, config.

Layout of ``<output_dir>/step_000100/`` (and ``best/``)::

    draft/               Hugging Face save_pretrained of the draft (the LoRA adapter only, when LoRA is on) + tokenizer
    accelerate/          accelerator.save_state: model, optimizer, RNG states of every process
    scheduler.pt         LR scheduler state
    trainer_state.json   step, micro-step (= data position), tokens seen, best metric, last evaluation, draft base
    config.yaml          the resolved training config

Saves go to ``NAME.tmp`` and are renamed when complete, and ``<output_dir>/latest`` names the newest complete
checkpoint, so a run killed mid-save resumes from the previous one and loses at most the steps since it.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

STATE_FILE = "trainer_state.json"
LATEST_FILE = "latest"


def step_dir(output_dir: str | Path, step: int) -> Path:
    """``<output_dir>/step_000123``."""
    return Path(output_dir) / f"step_{step:06d}"


def save_checkpoint(accelerator: Any, draft: Any, tokenizer: Any, scheduler: Any, state: dict, config_yaml: str,
                    path: str | Path) -> Path:
    """Write a complete checkpoint at ``path`` (atomically replacing an existing one). Call on every process."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    if accelerator.is_main_process and tmp.exists():
        shutil.rmtree(tmp)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp / "accelerate"))
    unwrapped = accelerator.unwrap_model(draft)
    state_dict = accelerator.get_state_dict(draft)
    if accelerator.is_main_process:
        if hasattr(unwrapped, "peft_config"):  # adapter weights only; the base is named in trainer_state.json
            unwrapped.save_pretrained(str(tmp / "draft"))
        else:
            unwrapped.save_pretrained(str(tmp / "draft"), state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(str(tmp / "draft"))
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=2))
        (tmp / "config.yaml").write_text(config_yaml)
        if path.exists():
            shutil.rmtree(path)
        tmp.rename(path)
    accelerator.wait_for_everyone()
    return path


def mark_latest(output_dir: str | Path, path: str | Path) -> None:
    """Point ``<output_dir>/latest`` at a complete checkpoint (written last, so it never names a partial one)."""
    latest = Path(output_dir) / LATEST_FILE
    tmp = latest.with_name(LATEST_FILE + ".tmp")
    tmp.write_text(Path(path).name)
    tmp.replace(latest)


def find_latest(output_dir: str | Path) -> Path | None:
    """The checkpoint named by ``<output_dir>/latest``, or None when the run has none yet."""
    latest = Path(output_dir) / LATEST_FILE
    if not latest.exists():
        return None
    path = Path(output_dir) / latest.read_text().strip()
    return path if (path / STATE_FILE).exists() else None


def prune(output_dir: str | Path, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` ``step_*`` checkpoints (``best/`` is never touched)."""
    steps = sorted(p for p in Path(output_dir).glob("step_*") if p.is_dir() and not p.name.endswith(".tmp"))
    for p in steps[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(p, ignore_errors=True)


def read_state(path: str | Path) -> dict:
    """trainer_state.json of a checkpoint; raises FileNotFoundError naming the expected layout."""
    f = Path(path) / STATE_FILE
    if not f.exists():
        raise FileNotFoundError(f"{path} is not a distill checkpoint (no {STATE_FILE}); give a step_N or best "
                                "folder of a training run's output_dir")
    return json.loads(f.read_text())


def load_checkpoint(accelerator: Any, scheduler: Any, path: str | Path) -> dict:
    """Restore model, optimizer and RNG states (accelerate) and the scheduler; return trainer_state.json."""
    path = Path(path)
    state = read_state(path)
    accelerator.load_state(str(path / "accelerate"))
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=False))
    return state
