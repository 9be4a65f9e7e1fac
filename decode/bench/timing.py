"""Wall-clock and memory measurement shared by every method of the benchmark (ours and HF alike)."""
from __future__ import annotations

import torch

from decode.metrics import peak_memory_bytes


def sync(device: torch.device) -> None:
    """Wait for queued device work, so wall-clock time covers it (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device: torch.device) -> None:
    """Reset the CUDA allocator's peak before a timed call (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_bytes(device: torch.device) -> int:
    """Same definition for every method (``decode.metrics.peak_memory_bytes``): the CUDA allocator's peak since the
    reset before the call; on CPU the process's RSS high-water mark, which only ever grows (a coarse upper bound)."""
    return peak_memory_bytes(device)
