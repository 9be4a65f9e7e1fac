"""Kernel choice for the few-row linear layers of decoding on CPU.

A decode step runs every linear layer on B rows (plain decoding, the draft) or B(γ+1) rows (a verify forward).
For such few-row inputs the CPU GEMM that ``torch.nn.functional.linear`` reaches (``x @ Wᵀ``, MKL) is far slower
than the weights' memory traffic allows. Two forms do better on a 2-core AMD EPYC (AVX-512, torch 2.13 CPU build,
MKL 2024.2; docs/decode.md, "Few-row linear layers"):

- 1..:data:`TRANSPOSED_ROWS` rows: the same product taken as ``(W @ xᵀ)ᵀ``, one row as two copies of it (a
  one-column product goes to GEMV, slower still). Over the quickstart target's weights: about 11 -> 5-7 ms for one
  row.
- more rows, up to :data:`MAX_ROWS`: oneDNN's linear on a weight reordered once into its blocked layout (what
  inductor's CPU weight prepacking uses): about flat from 3 to 12 rows (5-6 ms where MKL takes 12-19 ms), 1.7x
  faster at 40 rows. It keeps one packed copy per weight it has run (about the size of the weight; made again when
  the weight changes, see :func:`_packed_weight`; :func:`clear_packed` frees them). Without
  oneDNN in the torch build, and for weights made under ``torch.inference_mode`` (no version counter tells when a
  copy is stale), the transposed product covers up to :data:`TRANSPOSED_FALLBACK_ROWS` rows and the rest goes to
  the original.

:func:`few_row_linear` routes ``F.linear`` calls with 1..:data:`MAX_ROWS` rows of float32 CPU inference through
these forms while the block runs. They change the summation order only (results agree to float32 round-off, ~1e-6
on logits), not the function computed; everything else (prefill-sized inputs, training, autocast, other dtypes and
devices, tensor subclasses) goes to the original ``F.linear`` untouched.
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Iterator

import torch
import torch.nn.functional as F

MIN_ROWS = 1
MAX_ROWS = 64  # covers verify forwards up to batch 8 × γ 7; prefill-sized inputs keep F.linear (not measured)
TRANSPOSED_ROWS = 2  # up to here the transposed product beats the packed oneDNN linear (measured)
TRANSPOSED_FALLBACK_ROWS = 8  # without oneDNN: 9..16 rows were slower transposed than through F.linear (measured)
PACK_BATCH_HINT = 16  # the batch size oneDNN picks the packed layout for (4, 16 and 64 measured alike)

_lock = threading.Lock()
_depth = 0  # open blocks in the process: F.linear is replaced while > 0
_thread = threading.local()  # .depth: open blocks in this thread
_block = 0  # entries of a thread's outermost block so far: a kept packed copy is checked once per such block
_original = F.linear  # what ineligible calls go to
_saved = F.linear     # what the last exit restores (F.linear as found at the first entry)


class _Packed:
    """A packed copy and what tells whether its weight still holds the values it was made from."""

    __slots__ = ("ref", "version", "ptr", "rows", "cols", "sample", "block", "packed")

    def __init__(self, ref: Any, weight: torch.Tensor, packed: torch.Tensor):
        n, k = weight.shape
        self.ref, self.packed, self.block = ref, packed, _block
        self.version, self.ptr = weight._version, weight.data_ptr()
        # one element in every row and one in every column, spread by two large primes
        r, c = torch.arange(n), torch.arange(k)
        self.rows = torch.cat([r, (c * 104729) % n])
        self.cols = torch.cat([(r * 7919) % k, c])
        self.sample = weight.detach()[self.rows, self.cols]


# id(weight) -> its _Packed; an entry leaves with its weight (weakref callback) or by clear_packed()
_packed: dict[int, _Packed] = {}


def onednn_available() -> bool:
    """Whether this torch build has the oneDNN linear ops the packed form uses."""
    ops = getattr(torch.ops, "mkldnn", None)
    try:
        return bool(torch.backends.mkldnn.is_available() and ops is not None
                    and hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise"))
    except (AttributeError, RuntimeError):
        return False


_ONEDNN = onednn_available()


def _reorder(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``(N, K)`` copied into oneDNN's blocked layout for :func:`packed_linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)


def _packed_weight(weight: torch.Tensor) -> torch.Tensor:
    """The oneDNN-packed copy of ``weight``.

    Inside :func:`few_row_linear` blocks a copy is made on first use and kept with the weight. It is made again when
    the weight's version counter or storage moved (in-place updates autograd tracks, reassigned ``.data``), or, at
    its first use after any thread entered its outermost block, when a sample of one element per row and per
    column changed: updates through ``weight.data`` (peft's merge writes ``weight.data += BA``) leave the version
    counter as it was. Outside any block it is made for this call only."""
    key = id(weight)
    entry = _packed.get(key)
    if (entry is not None and entry.ref() is weight and entry.version == weight._version
            and entry.ptr == weight.data_ptr()):
        if entry.block == _block:
            return entry.packed
        if torch.equal(weight.detach()[entry.rows, entry.cols], entry.sample):
            entry.block = _block
            return entry.packed
    packed = _reorder(weight.detach().contiguous())
    if _depth == 0:
        return packed
    with _lock:
        ref = entry.ref if entry is not None and entry.ref() is weight else \
            weakref.ref(weight, lambda _, k=key, kept=_packed: kept.pop(k, None))  # kept: still there at exit
        _packed[key] = _Packed(ref, weight, packed)
    return packed


def clear_packed() -> int:
    """Free the packed weight copies now (they are made again on next use). Call it after editing weights through
    ``.data`` in a way that may leave every sampled element as it was (see :func:`_packed_weight`). Returns how
    many were freed."""
    with _lock:
        n = len(_packed)
        _packed.clear()
    return n


def packed_bytes() -> int:
    """Bytes held by the packed weight copies."""
    return sum(e.packed.numel() * e.packed.element_size() for e in list(_packed.values()))


def _eligible(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
              max_rows: int = MAX_ROWS) -> bool:
    """Whether ``F.linear(x, weight, bias)`` takes a kernel of this module: float32 CPU inference on 1..``max_rows``
    rows of a weight with at least one output, and no bias or a 1-D float32 CPU bias of one value per output (any
    other bias, e.g. a broadcast (1, N) or 0-D one, goes to the original, which broadcasts it)."""
    if type(x) is not torch.Tensor or type(weight) not in (torch.Tensor, torch.nn.Parameter):
        return False  # tensor subclasses (DTensor, quantized, fake) keep their own dispatch
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or weight.dim() != 2 or x.dim() < 2:
        return False
    if x.device.type != "cpu" or weight.device.type != "cpu" or torch.is_autocast_enabled("cpu"):
        return False
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        return False
    if bias is not None and (type(bias) not in (torch.Tensor, torch.nn.Parameter) or bias.dtype != torch.float32
                             or bias.device.type != "cpu" or bias.shape != (weight.shape[0],)):
        return False
    k = x.shape[-1]
    return k > 0 and k == weight.shape[1] and weight.shape[0] > 0 and MIN_ROWS <= x.numel() // k <= max_rows


def transposed_linear(flat: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``flat Wᵀ + b`` taken as ``(W flatᵀ)ᵀ``; one row as two copies of it (a one-column product goes to GEMV).

    Args:
        flat: ``(n, K)`` float32; weight: ``(N, K)``; bias: ``(N,)`` or None.

    Returns:
        ``(n, N)``, contiguous.
    """
    n = flat.shape[0]
    if n == 1:  # a one-column product goes to GEMV, slower here than the GEMM of two: take two copies, keep one
        flat = flat.expand(2, -1).contiguous()
    out = torch.mm(weight, flat.t()) if bias is None else torch.addmm(bias.unsqueeze(1), weight, flat.t())  # (N, n)
    return out[:, :n].t().contiguous()


def packed_linear(flat: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``flat Wᵀ + b`` through oneDNN's linear on the packed copy of ``weight`` (made on first use; needs
    :func:`onednn_available`).

    Args:
        flat: ``(n, K)`` float32 CPU; weight: ``(N, K)``, not an inference tensor (its version counter keys the
            copy); bias: ``(N,)`` or None.

    Returns:
        ``(n, N)``, contiguous.
    """
    bias = bias.contiguous() if bias is not None else None  # oneDNN reads the bias as a dense (N,) array
    return torch.ops.mkldnn._linear_pointwise(flat.contiguous(), _packed_weight(weight), bias, "none", [], "")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` = ``x Wᵀ + b`` for few-row float32 CPU inference: :func:`transposed_linear` for
    1..:data:`TRANSPOSED_ROWS` rows, :func:`packed_linear` for more (see the module docstring for the measurements
    and the fallback without oneDNN).

    Args:
        x: ``(..., K)``; weight: ``(N, K)``; bias: ``(N,)`` or None.

    Returns:
        ``(..., N)``, contiguous, equal to ``F.linear`` up to float32 round-off (the original ``F.linear`` result,
        bit for bit, where the input is not eligible: see the module docstring).
    """
    # Traced code takes the transposed product only: the packed copies live in a Python dict, which dynamo cannot
    # trace, and one row bound (not two) means one shape guard, so fewer graphs for a compiled forward.
    if not _eligible(x, weight, bias, TRANSPOSED_ROWS if torch.compiler.is_compiling() else MAX_ROWS):
        return _original(x, weight, bias)
    flat = x.reshape(-1, x.shape[-1])  # (n, K)
    n = flat.shape[0]
    if n <= TRANSPOSED_ROWS:
        out = transposed_linear(flat, weight, bias)
    elif _ONEDNN and not weight.is_inference():  # an inference tensor has no version counter to key a copy on
        out = packed_linear(flat, weight, bias)
    elif n <= TRANSPOSED_FALLBACK_ROWS:
        out = transposed_linear(flat, weight, bias)
    else:
        return _original(x, weight, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


def check_packed(*models: Any) -> None:
    """Inside a :func:`few_row_linear` block, check the kept packed copies of the models' weights now: the check
    (or re-pack) each copy otherwise gets at its first use in the block (:func:`_packed_weight`), so that a forward
    timed after this call pays only its own work. Weights with no kept copy are left alone; outside a block this
    does nothing. Copies already checked in this block are not checked again (an edit through ``.data`` inside an
    open block stays unseen, as :func:`few_row_linear` says). (A timed first forward in a fresh block paid 5.5 ms
    more on pair X's target at batch 8, a third of its one-token forward: the auto-γ cost model read the verify
    forwards as that much cheaper.)

    Raises:
        TypeError: an argument that is neither a ``torch.nn.Module`` nor None.
    """
    bad = [m for m in models if m is not None and not isinstance(m, torch.nn.Module)]
    if bad:
        raise TypeError(f"check_packed takes models (torch.nn.Module) or None, got {type(bad[0]).__name__}")
    if getattr(_thread, "depth", 0) == 0:
        return
    for model in models:
        for weight in model.parameters() if model is not None else ():
            entry = _packed.get(id(weight))
            if entry is not None and entry.ref() is weight:
                _packed_weight(weight)


@contextlib.contextmanager
def few_row_linear(enabled: bool = True) -> Iterator[None]:
    """Within the block, ``torch.nn.functional.linear`` (what ``nn.Linear`` calls) is :func:`linear`.

    Process-wide while any such block runs (Python modules are shared by threads); blocks nest and may run in
    several threads at once: a counter under a lock installs :func:`linear` on the first entry and restores the
    original on the last exit, also when the block raises. As :func:`linear` computes the same function, a thread
    that calls ``F.linear`` meanwhile gets the same values up to round-off, and training, autocast and other
    dtypes are passed to the original.

    Packed weight copies (:func:`packed_linear`) are kept across blocks and checked against their weights at their
    first use after a thread enters its outermost block (see :func:`_packed_weight`): the engine holds one block
    per ``generate()`` call and the server one per busy period. Do not change weights through ``.data`` while a
    block that uses them is open.

    Args:
        enabled: False makes the block a no-op (so callers need no branch).
    """
    global _depth, _saved, _block
    if not enabled:
        yield
        return
    mine = getattr(_thread, "depth", 0)
    with _lock:
        if _depth == 0:
            _saved, F.linear = F.linear, linear
        if mine == 0:  # this thread's outermost block: kept copies are checked again (another thread's may be open)
            _block += 1
        _depth += 1
    _thread.depth = mine + 1
    try:
        yield
    finally:
        _thread.depth = mine
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
