"""KV-cache handling for ragged speculative decoding: forward with explicit positions, roll back, compact.

Layout. Each model keeps one Hugging Face ``DynamicCache`` of physical width W for the whole batch and a
``(B, W)`` mask of which slots hold committed tokens. Rows are right-aligned (left padding). Keys are stored
already rotated by their own position ids, so a slot's meaning does not depend on its physical column: slots
can be masked out (rollback) or moved (compaction) without recomputing anything.

Rollback after a rejection only clears mask bits of the rejected slots (no copy). :func:`compact` then drops
those holes: a crop when every row's holes are trailing (always so at batch size 1), otherwise one gather per
layer that right-aligns each row's valid slots. Its cost is one read and write of the cache per step, about the
attention traffic of one extra forward; it keeps every row's cache exactly as long as its committed prefix.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any

import torch


def _layers(cache: Any) -> list[Any]:
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise TypeError(
            f"unsupported KV cache type {type(cache).__name__}: the decoder needs a transformers DynamicCache "
            "(transformers >= 4.56) whose layers expose .keys/.values"
        )
    return layers


def new_cache(model: Any) -> Any:
    """An empty ``DynamicCache`` for ``model``."""
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:  # older signature
        return DynamicCache()


@functools.lru_cache(maxsize=None)
def _cache_kwarg_for(cls: type) -> str:
    params = inspect.signature(cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _cache_kwarg(model: Any) -> str:
    # transformers 5.x renamed past_key_values to cache; peft wrappers forward **kwargs to the base model.
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return _cache_kwarg_for(type(base))


def cache_width(cache: Any) -> int:
    """Physical number of slots W held by the cache (0 when empty)."""
    return int(cache.get_seq_length()) if cache is not None else 0


def forward(model: Any, cache: Any, mask: torch.Tensor, input_ids: torch.Tensor, input_mask: torch.Tensor,
            logits_to_keep: int | None = None, max_position: int | None = None,
            call: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``model`` on new tokens appended to ``cache``, with explicit per-row positions.

    Args:
        cache: a DynamicCache of width W (updated in place).
        mask: ``(B, W)`` int64, 1 where the slot holds a committed token.
        input_ids: ``(B, k)`` new tokens; input_mask: ``(B, k)`` 1 for real tokens, 0 for holes.
        logits_to_keep: if given, only the last this-many positions' logits are computed.
        max_position: the model's largest position id; larger positions are clamped to it. Only slots that are
            discarded anyway get there (drafts past a row's own γ in a ragged batch), and it keeps models with
            learned position tables from indexing past them.
        call: what to run instead of ``model(...)`` with the same keyword arguments (e.g. a compiled forward).

    Returns:
        ``(logits (B, k or logits_to_keep, V), mask (B, W + k))``. The position of a new token is the number of
        valid slots before it, as in Hugging Face ``generate`` (``cumsum(mask) - 1``).
    """
    full_mask = torch.cat([mask, input_mask], dim=-1)
    positions = (mask.sum(-1, keepdim=True) + input_mask.cumsum(-1) - 1).clamp(0, max_position)
    # Always the same keyword set (0 keeps every position), so a compiled forward sees one signature.
    kwargs = {_cache_kwarg(model): cache, "logits_to_keep": logits_to_keep or 0}
    out = (call or model)(input_ids=input_ids, attention_mask=full_mask, position_ids=positions, use_cache=True,
                          **kwargs)
    return out.logits, full_mask


def select_rows(cache: Any, rows: torch.Tensor) -> None:
    """Keep only batch rows ``rows`` ``(B',)`` in every layer (in place)."""
    for layer in _layers(cache):
        if getattr(layer, "keys", None) is not None and layer.keys.numel():
            layer.keys = layer.keys.index_select(0, rows)
            layer.values = layer.values.index_select(0, rows)


def _gather_slots(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    B, H, _, D = x.shape
    return x.gather(2, order[:, None, :, None].expand(B, H, order.shape[-1], D))


def crop(cache: Any, width: int) -> None:
    """Keep the first ``width`` slots of every layer (drop trailing slots, in place)."""
    for layer in _layers(cache):
        if getattr(layer, "keys", None) is not None and layer.keys.numel():
            layer.keys = layer.keys[..., :width, :]
            layer.values = layer.values[..., :width, :]


def compact(cache: Any, mask: torch.Tensor, counts: list[int], trailing_holes: int | None = None) -> torch.Tensor:
    """Remove the holes from the cache and return the new mask; slot order within a row is kept, so attention
    results are unchanged.

    Args:
        cache: DynamicCache of width W; mask: ``(B, W)`` its valid slots.
        counts: valid slots per row, known on the host (so this makes no device-to-host sync).
        trailing_holes: if given, every row's holes are these last columns (always so at batch size 1) and
            rows were right-aligned before them: a crop suffices.

    Returns:
        the ``(B, W')`` mask; rows right-aligned. Cost: nothing without holes; a crop for ``trailing_holes``;
        else one gather of every layer, giving ``W' = max(counts)``.
    """
    W = mask.shape[-1]
    width = max(counts) if counts else 0
    if trailing_holes is not None:
        if trailing_holes > 0:
            crop(cache, W - trailing_holes)
            return mask[:, : W - trailing_holes]
        return mask
    if width == W and min(counts) == W:
        return mask
    # Stable sort puts holes first and keeps the order of valid slots.
    order = torch.sort(mask, dim=-1, stable=True).indices[:, W - width:]  # (B, W')
    for layer in _layers(cache):
        if getattr(layer, "keys", None) is not None and layer.keys.numel():
            layer.keys = _gather_slots(layer.keys, order)
            layer.values = _gather_slots(layer.values, order)
    counts_t = torch.tensor(counts, device=mask.device)
    return (torch.arange(width, device=mask.device) >= width - counts_t[:, None]).long()


def _pad_left(x: torch.Tensor, width: int) -> torch.Tensor:
    if x.shape[-2] == width:
        return x
    pad = x.new_zeros(*x.shape[:-2], width - x.shape[-2], x.shape[-1])
    return torch.cat([pad, x], dim=-2)


def concat_rows(cache: Any, mask: torch.Tensor, other: Any, other_mask: torch.Tensor) -> torch.Tensor:
    """Append the rows of ``other`` (a cache of the same model) to ``cache`` in place; returns the joint mask.

    Both stay right-aligned: the narrower one is left-padded with empty (masked) slots to the wider width.
    A layer that one side never initialised (a width-0 cache) is taken as empty rows of the other's shape.

    Args:
        cache, mask: ``(B1, W1)``; other, other_mask: ``(B2, W2)``. Returns the ``(B1 + B2, max(W1, W2))`` mask.
    """
    width = max(mask.shape[1], other_mask.shape[1])
    for layer, layer_o in zip(_layers(cache), _layers(other)):
        a = layer.keys if getattr(layer, "keys", None) is not None and layer.keys.numel() else None
        b = layer_o.keys if getattr(layer_o, "keys", None) is not None and layer_o.keys.numel() else None
        if a is None and b is None:
            continue
        ref = a if a is not None else b
        empty = lambda n: ref.new_zeros(n, ref.shape[1], 0, ref.shape[3])  # noqa: E731
        ka, va = (layer.keys, layer.values) if a is not None else (empty(mask.shape[0]), empty(mask.shape[0]))
        kb, vb = (layer_o.keys, layer_o.values) if b is not None else (empty(other_mask.shape[0]),) * 2
        keys = torch.cat([_pad_left(ka, width), _pad_left(kb, width)], dim=0)
        values = torch.cat([_pad_left(va, width), _pad_left(vb, width)], dim=0)
        if not getattr(layer, "is_initialized", True):
            layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
    pad = lambda m: torch.cat([m.new_zeros(m.shape[0], width - m.shape[1]), m], dim=1)  # noqa: E731
    return torch.cat([pad(mask), pad(other_mask)], dim=0)
