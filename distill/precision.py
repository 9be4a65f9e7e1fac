"""``mixed_precision: auto``: bf16 autocast only where the hardware computes in bf16.

On a CPU, bf16 autocast pays only with native bf16 instructions (AVX512-BF16 or AMX on x86; measured 2.3-2.5x
faster than fp32 for the quickstart's shapes on such a CPU). Without them oneDNN emulates bf16 through fp32 and
the same training step is slower than fp32 (measured on a 2-core Xeon without ``avx512_bf16``: a 1024x512x2048
matmul 38.9 ms in bf16 against 13.1 ms in fp32, and the quickstart target's pretraining 285 against 1,070
tokens/s). ``torch.ops.mkldnn._is_mkldnn_bf16_supported()`` answers True on such a CPU (it checks AVX512 only),
so the CPU's own flags decide. On CUDA, bf16 where the GPU supports it (Ampere and newer), else fp16.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from distill.config import SetupError

# x86 CPU flags (as /proc/cpuinfo spells them) that mean bf16 matmuls run natively.
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The ``flags`` of the first CPU in ``cpuinfo`` (the text of /proc/cpuinfo; read when None, empty set where
    there is none, e.g. on macOS). ARM's ``Features`` line is read the same way."""
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        cpuinfo = path.read_text(errors="replace") if path.exists() else ""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            return set(value.split())
    return set()


def cpu_has_native_bf16(flags: set[str] | None = None) -> bool:
    """True if the CPU computes bf16 natively: x86 ``avx512_bf16``/``amx_bf16`` or ARM ``bf16`` (SVE/NEON BF16)."""
    flags = cpu_flags() if flags is None else flags
    return any(f in flags for f in NATIVE_BF16_FLAGS) or "bf16" in flags


def resolve_mixed_precision(setting: str, device_type: str, cuda_bf16: bool | None = None,
                            cpu_bf16: bool | None = None) -> str:
    """The precision accelerate gets for ``train.mixed_precision=setting``: ``no``, ``bf16`` or ``fp16``.

    ``auto`` becomes ``bf16`` on a CUDA device that supports it (``torch.cuda.is_bf16_supported()``; else
    ``fp16``), and on a CPU ``bf16`` only with native bf16 (:func:`cpu_has_native_bf16`), else ``no`` (fp32).
    Any other setting is returned unchanged. ``cuda_bf16``/``cpu_bf16`` override the hardware checks (tests).
    """
    if setting != "auto":
        return setting
    if device_type == "cuda":
        if cuda_bf16 is None:
            cuda_bf16 = bool(torch.cuda.is_bf16_supported())
        return "bf16" if cuda_bf16 else "fp16"
    if cpu_bf16 is None:
        cpu_bf16 = cpu_has_native_bf16()
    return "bf16" if cpu_bf16 else "no"


def accelerator_precision(train: Any) -> tuple[str, bool]:
    """``(precision, cpu)`` for ``Accelerator(mixed_precision=precision, cpu=cpu)`` from a ``train`` config section:
    ``cpu`` when ``train.cpu`` is set or no CUDA GPU is available, ``precision`` from
    :func:`resolve_mixed_precision`. The one place ``train``, ``cache-logits`` and the config checks decide it.

    Raises SetupError for ``train.mixed_precision=fp16`` on a CPU (fp16 autocast with a gradient scaler is GPU-only).
    """
    cpu = bool(train.get("cpu", False)) or not torch.cuda.is_available()
    if str(train.mixed_precision) == "fp16" and cpu:
        raise SetupError("train.mixed_precision=fp16 needs a CUDA GPU (fp16 autocast with a gradient scaler is "
                         "GPU-only); on CPU use train.mixed_precision=bf16 or train.mixed_precision=no")
    return resolve_mixed_precision(str(train.mixed_precision), "cpu" if cpu else "cuda"), cpu


# ``accelerate launch`` passes its config to the processes as these variables; the engine each one asks for.
LAUNCHER_ENGINES = {"ACCELERATE_USE_FSDP": "FSDP", "ACCELERATE_USE_DEEPSPEED": "DEEPSPEED"}


def launcher_notes(precision: str, train_setting: str, distributed_type: str,
                   env: dict[str, str] | None = None) -> list[str]:
    """What the ``accelerate launch`` config (``env``: its variables, ``os.environ`` when None) asked for that this
    run does not do, one sentence each: a launcher ``mixed_precision`` other than the ``precision`` that
    ``train.mixed_precision=train_setting`` chose (the recipe passes its own to accelerate, so the launcher's is not
    used), and an FSDP/DeepSpeed config on a run whose ``distributed_type`` is another (on CPU accelerate runs
    plain data parallelism: every process holds the whole draft and its optimizer state)."""
    env = os.environ if env is None else env
    notes = []
    launcher = env.get("ACCELERATE_MIXED_PRECISION", "no")
    if launcher not in ("", "no") and launcher != precision:
        notes.append(f"the launcher's mixed_precision={launcher} is not used: train.mixed_precision={train_setting} "
                     f"decides ({precision}); set train.mixed_precision={launcher} to train in {launcher}")
    for key, engine in LAUNCHER_ENGINES.items():
        if env.get(key, "false").lower() == "true" and distributed_type != engine:
            notes.append(f"the launcher config asks for {engine}, but this run is {distributed_type} (accelerate "
                         f"uses {engine} only on GPUs; on CPU it runs plain data parallelism over gloo, every "
                         "process holding the whole draft and optimizer state)")
    return notes


@contextlib.contextmanager
def plain_forward(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """``model`` with accelerate's mixed-precision wrapper taken off its ``forward`` for the ``with`` block.

    ``Accelerator.prepare`` wraps a model's ``forward`` in autocast (``train.mixed_precision``) and keeps the
    original as ``model._original_forward``; ``unwrap_model`` keeps the wrapper. The evaluation during training
    measures the draft as it is saved and exported (its weights' own dtype, as ``distill eval`` and the decoder run
    it), so it runs inside this block: under bf16 autocast the same checkpoint measured another acceptance rate
    (0.364 against 0.289 at T = 1 in a new user's run) than the card promised. A model without the wrapper is
    returned as it is; the wrapper is put back afterwards, also on an error.
    """
    original = model.__dict__.get("_original_forward")
    wrapped = model.__dict__.get("forward")
    if original is None or wrapped is None:
        yield model
        return
    model.forward = original
    try:
        yield model
    finally:
        model.forward = wrapped
