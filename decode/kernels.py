"""Kernel choice for the few-row linear layers of decoding on CPU.

A decode step runs every linear layer on B rows (plain decoding, the draft) or B(γ+1) rows (a verify forward).
For such few-row inputs the CPU GEMM that ``torch.nn.functional.linear`` reaches (``x @ Wᵀ``, MKL) can be far
slower than the same product taken as ``(W @ xᵀ)ᵀ``, and a one-row product (dispatched to GEMV) slower than that
product over two copies of the row. On a 2-core AMD EPYC (AVX-512, torch 2.13 CPU build, MKL 2024.2) the
quickstart target's engine-path forward took 14.9 -> 8.6 ms over one token, 23.1 -> 8.5 ms over two and
19.5 -> 14.4 ms over eight (docs/decode.md, "Few-row linear layers").

:func:`few_row_linear` routes ``F.linear`` calls with 1..:data:`MAX_ROWS` rows of float32 CPU inference through
the transposed product while the block runs. It changes the summation order only (results agree to float32
round-off, ~1e-6 on logits), not the function computed; everything else (prefill-sized inputs, training,
autocast, other dtypes and devices, tensor subclasses) goes to the original ``F.linear`` untouched.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import torch
import torch.nn.functional as F

MIN_ROWS = 1
MAX_ROWS = 64  # covers verify forwards up to batch 8 × γ 7; prefill-sized inputs keep F.linear (not measured)

_lock = threading.Lock()
_depth = 0
_original = F.linear  # what ineligible calls go to
_saved = F.linear     # what the last exit restores (F.linear as found at the first entry)


def _eligible(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``F.linear(x, weight)`` takes the transposed product: float32 CPU inference on 1..MAX_ROWS rows."""
    if type(x) is not torch.Tensor or type(weight) not in (torch.Tensor, torch.nn.Parameter):
        return False  # tensor subclasses (DTensor, quantized, fake) keep their own dispatch
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or weight.dim() != 2 or x.dim() < 2:
        return False
    if x.device.type != "cpu" or weight.device.type != "cpu" or torch.is_autocast_enabled("cpu"):
        return False
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return False
    k = x.shape[-1]
    return k > 0 and k == weight.shape[1] and MIN_ROWS <= x.numel() // k <= MAX_ROWS


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` = ``x Wᵀ + b``, taken as ``(W xᵀ)ᵀ`` for few-row float32 CPU inference (one
    row as two copies of it).

    Args:
        x: ``(..., K)``; weight: ``(N, K)``; bias: ``(N,)`` or None.

    Returns:
        ``(..., N)``, contiguous, equal to ``F.linear`` up to float32 round-off (the original ``F.linear`` result,
        bit for bit, where the input is not eligible: see the module docstring).
    """
    if not _eligible(x, weight):
        return _original(x, weight, bias)
    flat = x.reshape(-1, x.shape[-1])  # (n, K)
    n = flat.shape[0]
    if n == 1:  # a one-column product goes to GEMV, slower here than the GEMM of two: take two copies, keep one
        flat = flat.expand(2, -1).contiguous()
    if bias is None:
        out = torch.mm(weight, flat.t())
    else:
        out = torch.addmm(bias.unsqueeze(1), weight, flat.t())  # (N, n)
    return out[:, :n].t().contiguous().view(*x.shape[:-1], weight.shape[0])


@contextlib.contextmanager
def few_row_linear(enabled: bool = True) -> Iterator[None]:
    """Within the block, ``torch.nn.functional.linear`` (what ``nn.Linear`` calls) is :func:`linear`.

    Process-wide while any such block runs (Python modules are shared by threads); blocks nest and may run in
    several threads at once: a counter under a lock installs :func:`linear` on the first entry and restores the
    original on the last exit, also when the block raises. As :func:`linear` computes the same function, a thread
    that calls ``F.linear`` meanwhile gets the same values up to round-off, and training, autocast and other
    dtypes are passed to the original.

    Args:
        enabled: False makes the block a no-op (so callers need no branch).
    """
    global _depth, _saved
    if not enabled:
        yield
        return
    with _lock:
        if _depth == 0:
            _saved, F.linear = F.linear, linear
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                F.linear = _saved


def default_for(*models: Any) -> bool:
    """The engine's default: on when every given model has float32 weights on the CPU (where it was measured)."""
    for model in models:
        if model is None:
            continue
        p = next(model.parameters(), None)
        if p is None or p.device.type != "cpu" or p.dtype != torch.float32:
            return False
    return True
