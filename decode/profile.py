"""Where a decoder's time goes: wall time per part of its work (prefills, the first token, each draft forward, the
drafting math around them, the verify forward, the verify math over the vocabulary, the step's host sync, the
caches' roll-back, the commit), per step.

Attach a :class:`StepProfile` to a decoder (``decoder.profile = StepProfile(device)``) and its steps time their
parts; ``decoder.profile = None`` (the default) turns it off, leaving one attribute check per part. Parts are
exclusive: a part timed inside another (the draft forwards inside drafting) is not counted again in the outer one,
and ``other`` is what a step spends outside every part (Python bookkeeping, the γ choice, the uniforms). On CUDA each
part boundary synchronizes the device (so the parts are the device's time, at the cost of the overlap a step
would otherwise have); on CPU the kernels run synchronously and the profile costs a few microseconds per part.
"""
from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, ContextManager, Iterator

import torch

# The parts a step is split into, in the order a step runs them (tables list them in this order).
PARTS = ("admission", "prefill_target", "first_token", "prefill_draft", "draft_forward", "drafting",
         "verify_forward", "verify_math", "host_sync", "roll_back", "commit", "other")

_OFF = nullcontext()


def sync(device: torch.device) -> None:
    """Wait for ``device``'s queued work (CUDA; on CPU the kernels have run when they return)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepProfile:
    """Exclusive wall time per part (see :data:`PARTS`), over the steps run while it is attached to a decoder."""

    def __init__(self, device: Any = None):
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.seconds = {name: 0.0 for name in PARTS}
        self.calls = {name: 0 for name in PARTS}
        self.steps = 0
        self.step_s = 0.0
        self._stack: list[float] = []  # per open part: the time its nested parts took

    def _sync(self) -> None:
        sync(self.device)

    @contextmanager
    def _span(self, done: Callable[[float, float], None]) -> Iterator[None]:
        """Time the block; ``done(elapsed, nested)`` gets its seconds and those of the parts timed inside it."""
        self._sync()
        self._stack.append(0.0)
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            done(time.perf_counter() - start, self._stack.pop())

    def part(self, name: str) -> ContextManager[None]:
        """Time the block as part ``name`` (one of :data:`PARTS`), less the parts timed inside it."""
        if name not in self.seconds:
            raise ValueError(f"unknown profile part {name!r}; the parts are {', '.join(PARTS)}")

        def done(elapsed: float, nested: float) -> None:
            self.seconds[name] += elapsed - nested
            self.calls[name] += 1
            if self._stack:
                self._stack[-1] += elapsed

        return self._span(done)

    def step(self) -> ContextManager[None]:
        """Time one whole step; what its parts leave over is counted as ``other``."""

        def done(elapsed: float, nested: float) -> None:
            self.seconds["other"] += elapsed - nested
            self.calls["other"] += 1
            self.steps += 1
            self.step_s += elapsed

        return self._span(done)

    def summary(self) -> dict[str, Any]:
        """JSON-able: ``{"steps", "step_ms" (mean per step), "parts": {name: {"calls", "total_s", "ms_per_step",
        "ms_per_call", "share" (of the steps' time)}}}``; parts never entered are left out."""
        steps = max(self.steps, 1)
        parts = {name: {"calls": self.calls[name], "total_s": self.seconds[name],
                        "ms_per_step": 1e3 * self.seconds[name] / steps,
                        "ms_per_call": 1e3 * self.seconds[name] / self.calls[name],
                        "share": self.seconds[name] / self.step_s if self.step_s else 0.0}
                 for name in PARTS if self.calls[name]}
        return {"steps": self.steps, "step_ms": 1e3 * self.step_s / steps, "parts": parts}


def part(profile: StepProfile | None, name: str):
    """``profile.part(name)``, or a no-op context when ``profile`` is None."""
    return _OFF if profile is None else profile.part(name)


def step(profile: StepProfile | None):
    """``profile.step()``, or a no-op context when ``profile`` is None."""
    return _OFF if profile is None else profile.step()
