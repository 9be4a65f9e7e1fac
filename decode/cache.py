"""KV-cache handling for ragged speculative decoding: forward with explicit positions, roll back, compact.

Two cache classes with one interface (``forward``, ``roll_back``, ``merge``, ``select_rows``, ``ensure_room``,
``lens``), so the engine's step does not ask which one it holds. :class:`StaticKV` (the engine's default where the
architecture allows it) keeps preallocated buffers written by column; see its docstring. :class:`DynamicKV` wraps
the DynamicCache path (the fallback) built from the functions below:

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
import warnings
from typing import Any, NamedTuple

import torch

from decode.compat import base_model, probe_logits, probe_tolerance


def _layers(cache: Any) -> list[Any]:
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise TypeError(
            f"unsupported KV cache type {type(cache).__name__}: the decoder needs a transformers DynamicCache "
            "(transformers >= 4.56) whose layers expose .keys/.values"
        )
    return layers


def new_cache(model: Any) -> Any:
    """An empty ``DynamicCache`` of full layers for ``model``: every slot is kept, also for sliding-window layers
    (a sliding layer would drop slots by physical column, which holes and rollback make wrong); the model's own
    mask applies its window."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    try:
        cache = DynamicCache(config=model.config)
    except TypeError:  # older signature
        return DynamicCache()
    cache.layers = [layer if type(layer) is DynamicLayer else DynamicLayer() for layer in cache.layers]
    return cache


@functools.lru_cache(maxsize=None)
def _cache_kwarg_for(cls: type) -> str:
    params = inspect.signature(cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@functools.lru_cache(maxsize=None)
def _off_for(cls: type) -> tuple[tuple[str, bool], ...]:
    params = inspect.signature(cls.forward).parameters
    return tuple((name, False) for name in ("output_router_logits",) if name in params)


def _off(model: Any) -> dict[str, bool]:
    """Forward outputs the decoder never reads, switched off: an MoE's router logits (``output_router_logits=True``
    in a Mixtral/Qwen3-MoE config also computes the load-balancing loss, which fails on a padded batch's mask)."""
    base = base_model(model)
    return dict(_off_for(type(base)))


def _cache_kwarg(model: Any) -> str:
    # transformers 5.x renamed past_key_values to cache; peft wrappers forward **kwargs to the base model.
    base = base_model(model)
    return _cache_kwarg_for(type(base))


def context_length(model: Any) -> int | None:
    """Max positions of a causal LM from its (text) config; None when the architecture states no limit."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "max_seq_len",
                 "n_ctx"):
        value = getattr(cfg, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


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
    kwargs = {_cache_kwarg(model): cache, "logits_to_keep": logits_to_keep or 0, **_off(model)}
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


class DynamicKV:
    """The DynamicCache path behind the interface of :class:`StaticKV`: a ``DynamicCache`` of width W, its
    ``(B, W)`` int64 mask of valid slots and the valid slots per row (host list ``lens``). Rejected slots are
    masked and compacted away at each :meth:`roll_back` (see the module docstring)."""

    def __init__(self, cache: Any, mask: torch.Tensor, lens: list[int]):
        self.cache, self.mask, self.lens = cache, mask, list(lens)
        self.holey = False  # a forward since the last roll-back had holes in its input (rows of unequal pending)

    @property
    def batch_size(self) -> int:
        return len(self.lens)

    def ensure_room(self, k: int) -> None:
        """Nothing to do: a DynamicCache grows with each write."""

    def forward(self, model: Any, input_ids: torch.Tensor, input_mask: torch.Tensor | None,
                logits_to_keep: int | None = None, max_position: int | None = None, call: Any = None,
                holes: bool = False) -> torch.Tensor:
        """:func:`forward` on this cache; ``input_mask`` None means every input token is real. ``lens`` is the
        caller's to update (:meth:`roll_back`)."""
        logits, self.mask = forward(model, self.cache, self.mask, input_ids,
                                    torch.ones_like(input_ids) if input_mask is None else input_mask,
                                    logits_to_keep=logits_to_keep, max_position=max_position, call=call)
        self.holey = self.holey or holes
        return logits

    def roll_back(self, valid: torch.Tensor, kept: list[int], new_lens: list[int]) -> None:
        """After a step: ``valid`` ``(B, n)`` are the kept bits of the last n columns written, ``kept`` their count
        per row (host), ``new_lens`` the valid slots per row. The rejected slots leave the cache: a crop when every
        row kept the same number and no input had holes, else one gather (:func:`compact`)."""
        n = valid.shape[1]
        if n:
            self.mask[:, self.mask.shape[1] - n:] = valid.long()
        trailing = n - kept[0] if len(set(kept)) == 1 and not self.holey else None
        self.mask = compact(self.cache, self.mask, new_lens, trailing)
        self.lens, self.holey = list(new_lens), False

    def merge(self, other: Any, other_mask: torch.Tensor, other_lens: list[int], room: int = 0) -> None:
        """Append the rows of ``other`` (a DynamicCache, mask ``(B2, W2)``) as :func:`concat_rows` does; ``room`` is
        for :meth:`StaticKV.merge`'s signature (a DynamicCache needs none)."""
        self.mask = concat_rows(self.cache, self.mask, other, other_mask)
        self.lens = self.lens + list(other_lens)

    def select_rows(self, keep: list[int]) -> None:
        """Keep rows ``keep`` only, then drop the leading columns that only the removed rows used."""
        idx = torch.tensor(keep, device=self.mask.device)
        select_rows(self.cache, idx)
        self.mask = self.mask.index_select(0, idx)
        self.lens = [self.lens[i] for i in keep]
        if self.lens and max(self.lens) < self.mask.shape[1]:
            self.mask = compact(self.cache, self.mask, self.lens)


# ---------------------------------------------------------------------------------------------- static path
@functools.lru_cache(maxsize=None)
def _used_width_layer_class():
    """A ``StaticLayer`` that attends only over the columns in use: ``update`` writes by position as its parent
    and returns the buffers cut to ``used`` columns, and ``get_mask_sizes`` reports that width, so attention and
    the mask cover ``W + k`` columns instead of the preallocated L (and a one-token forward with no mask takes
    SDPA's unmasked path). The owner sets ``used`` before each forward. Not compileable in Hugging Face's sense
    (the width changes per call); the decoder's ``compile=True`` compiles with dynamic shapes."""
    from transformers.cache_utils import StaticLayer

    class UsedWidthStaticLayer(StaticLayer):
        is_compileable = False
        used = 0

        def update(self, key_states, value_states, *args, **kwargs):
            keys, values = super().update(key_states, value_states, *args, **kwargs)
            return keys[:, :, : self.used], values[:, :, : self.used]

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.used, 0

    return UsedWidthStaticLayer


def _static_cache(model: Any, max_cache_len: int) -> Any:
    """A transformers ``StaticCache`` for ``model`` whose layers attend over the used columns only."""
    from transformers import StaticCache

    base = base_model(model)
    cache = StaticCache(config=base.config, max_cache_len=max_cache_len)
    for layer in cache.layers:
        layer.__class__ = _used_width_layer_class()  # same state, narrower view (one class, built on first use)
    return cache


class SlotProbe(NamedTuple):
    """:func:`slot_probe`'s answer."""

    holes_ok: bool
    padding_ok: bool
    padding_nan: bool = False  # left-padded rows came back NaN/inf (transformers' eager attention in float64)


def slot_probe(model: Any, holes: int = 64) -> SlotProbe:
    """Whether ``model``'s logits depend only on its tokens, their position ids and the attention mask, not on the
    cache slots the tokens sit in.

    - ``holes_ok``: masked slots between a row's tokens change nothing. The static cache (:class:`StaticKV`)
      leaves such holes (rejected drafts in a ragged batch, rows of other lengths); a position bias taken from the
      slot index (MPT's ALiBi, sliced by key length) is not exact there, so such models take the dynamic path.
    - ``padding_ok``: masked slots before a row's first token (left padding) change nothing. False for models that
      number positions by slot and take no position ids (BART's, Marian's or TrOCR's decoder as a causal LM), and
      for models that return NaN for left-padded rows (``padding_nan``: transformers' eager attention in float64);
      the engine then decodes one request at a time.

    A probe, not a list of architectures (:func:`decode.compat.probe_logits`): the same 4 tokens and position ids
    alone, with ``holes`` masked slots after the first token, and after ``holes`` masked slots; the last position's
    logits must agree with the plain run's within the dtype's rounding, of the largest logit or 1: float32/64 1e-3;
    lower precision 2e-2 for left padding and 5e-2 for holes (masked slots between tokens move bf16 attention by up
    to 0.024 in a 32-layer model, while 64 holes move a 2-layer random MPT's by 0.13). ``(True, True)`` when the
    probe cannot run or the plain run is not finite (the forward decides then).
    """
    real = [3, 5, 7, 11]
    probe = probe_logits(model, [(real, [1] * 4), (real[:1] + [1] * holes + real[1:], [1] + [0] * holes + [1] * 3),
                                 ([1] * holes + real, [0] * holes + [1] * 4)])
    if probe is None:
        return SlotProbe(True, True)
    (plain, inside, left), dtype = probe
    plain, inside, left = plain[-1], inside[-1], left[-1]
    if not bool(torch.isfinite(plain).all()):  # NaN weights, say: nothing to compare (decoding raises its own error)
        return SlotProbe(True, True)
    holes_ok = bool((inside - plain).abs().max() <= probe_tolerance(dtype, plain, low=5e-2))
    if not bool(torch.isfinite(left).all()):
        return SlotProbe(holes_ok, False, True)
    return SlotProbe(holes_ok, bool((left - plain).abs().max() <= probe_tolerance(dtype, plain)))

def cache_kinds(target: Any, draft: Any, static_cache: bool | None) -> tuple[dict[str, bool], int | None]:
    """Per model, whether it decodes on a :class:`StaticKV` (``{"target": bool, "draft": bool}``), and the most rows
    the batch may hold (None: no limit; 1 when a model cannot share a left-padded batch). ``static_cache``: None or
    True uses the static cache where the architecture allows it, False never; each model that cannot gets a
    one-line warning."""
    static, max_rows = {}, None
    for name, model in (("target", target), ("draft", draft)):
        probe = slot_probe(model) if model is not None else SlotProbe(True, True)
        if not probe.padding_ok:
            why = (f"returns NaN for left-padded rows in {next(model.parameters()).dtype} (transformers' eager "
                   "attention; attn_implementation='sdpa' batches)" if probe.padding_nan else
                   "numbers positions by cache slot (it takes no position ids), so left padding in a shared batch "
                   "would shift them")
            warnings.warn(f"decode: the {name} ({type(model).__name__}) {why}; this decoder runs one request at "
                          "a time", stacklevel=3)
            max_rows = 1
        if model is None or static_cache is False:
            static[name] = False
            continue
        reason = StaticKV.supported(model, probe)
        if reason is not None:
            warnings.warn(f"decode: the {name} ({type(model).__name__}) cannot use the static KV cache "
                          f"({reason}); using the DynamicCache path", stacklevel=3)
        static[name] = reason is None
    return static, max_rows


class StaticKV:
    """A preallocated Hugging Face ``StaticCache`` of physical width L for B rows, written by column.

    Layout. All rows share the write column W (``cumulative_length`` of every ``StaticLayer``); each row has its
    own positions (number of valid slots before a token), and a ``(B, L)`` bool mask marks which columns hold
    valid slots of that row. The causal mask HF builds compares physical columns, so columns >= W (stale) are
    never seen. Rollback sets W back to the end of the longest accepted row: a rejection costs no copy, later
    writes overwrite the rejected slots; a row that accepted fewer tokens than another keeps masked holes until
    the cache is full, when one gather right-aligns every row (:meth:`ensure_room`).

    Rows. The buffers have room for more rows than are in use (their row capacity, never shrunk while the cache
    lives: it is the batch's peak), and each layer's ``keys`` / ``values`` are the first B rows of them. A row that
    leaves costs a copy of each row after it, one place down (:meth:`select_rows`); rows that join are written
    into the free rows when they fit the capacity, the length L and the write column (their prompts no wider than
    W), with no new buffers (:meth:`merge`); else, as a fresh cache, everything is copied into new buffers (a
    re-layout). In a continuous batch a row leaves and another joins at almost every step, and a re-layout of both
    caches per join cost about 20 ms of a 30-45 ms step (quickstart pair, batch 8, 2-core CPU).

    Attributes:
        W: write column (host int); lens: valid slots per row (host list); holey: some valid region has a hole,
        so forwards must pass the mask (else none is passed: the causal fast path).
    """

    def __init__(self, model: Any, device: Any):
        self.model, self.device = model, device
        self.cache = None
        self._buffers: tuple[list, list] = ([], [])  # per layer: keys and values with room for capacity rows
        self.L = 0
        self.W = 0
        self.lens: list[int] = []
        self.mask = torch.zeros(0, 0, dtype=torch.bool, device=device)
        self.holey = False
        self._pos = torch.zeros(0, dtype=torch.long, device=device)  # valid slots per row incl. unconfirmed writes

    def _sync_pos(self) -> None:
        self._pos = torch.tensor(self.lens, dtype=torch.long, device=self.device)

    @staticmethod
    def supported(model: Any, probe: SlotProbe | None = None) -> str | None:
        """None if ``model`` can use a static cache, else the reason (one line). ``probe``: :func:`slot_probe`'s
        result for ``model`` if already run."""
        from transformers import StaticCache
        from transformers.cache_utils import StaticLayer

        base = base_model(model)
        cfg = base.config
        if getattr(cfg, "is_encoder_decoder", False):
            return "encoder-decoder model"
        try:
            cache = StaticCache(config=cfg, max_cache_len=8)
        except Exception as e:  # noqa: BLE001 - any failure means: not supported
            return f"StaticCache cannot be built ({type(e).__name__}: {e})"
        kinds = {type(layer).__name__ for layer in cache.layers}
        if any(type(layer) is not StaticLayer for layer in cache.layers):
            return f"layers of kind {sorted(kinds)} (sliding-window/linear/other)"
        if _cache_kwarg(model) != "cache" and "past_key_values" not in inspect.signature(type(base).forward).parameters:
            return "forward takes no cache argument"
        if not (probe or slot_probe(model)).holes_ok:
            return ("its attention depends on where tokens sit in the cache, not only on their positions and the "
                    "mask, e.g. an ALiBi bias by slot index as in MPT; the static cache leaves masked holes")
        return None

    @property
    def batch_size(self) -> int:
        return len(self.lens)

    @property
    def capacity(self) -> int:
        """Rows the buffers hold (>= :attr:`batch_size` once allocated; 0 before)."""
        keys = self._buffers[0]
        return keys[0].shape[0] if keys else 0

    def _set_width(self, w: int) -> None:
        self.W = w
        for layer in self.cache.layers:
            layer.cumulative_length.fill_(w)

    def _alloc(self, B: int, L: int, like: torch.Tensor, like_v: torch.Tensor) -> tuple[list, list]:
        if self.cache is None:
            self.cache = _static_cache(self.model, L)
        keys, values = [], []
        for layer in self.cache.layers:
            k = like.new_zeros(B, like.shape[1], L, like.shape[3])
            v = like_v.new_zeros(B, like_v.shape[1], L, like_v.shape[3])
            keys.append(k)
            values.append(v)
        return keys, values

    def _install(self, keys: list, values: list, L: int, rows: int) -> None:
        """Make ``keys`` / ``values`` (per layer, ``(capacity, H, L, D)``) the buffers; the layers see ``rows``."""
        self._buffers = (keys, values)
        for layer, k, v in zip(self.cache.layers, keys, values):
            if not layer.is_initialized:
                layer.lazy_initialization(k[:, :, :1], v[:, :, :1])
            layer.max_cache_len = L
        self.L = L
        self._use_rows(rows)

    def _use_rows(self, rows: int) -> None:
        """Point every layer at the first ``rows`` rows of the buffers (views: writes land in the buffers)."""
        for layer, k, v in zip(self.cache.layers, *self._buffers):
            layer.keys, layer.values, layer.batch_size = k[:rows], v[:rows], rows

    @staticmethod
    def _size(need: int) -> int:
        return max(64, 1 << (need - 1).bit_length())

    def merge(self, other: Any, other_mask: torch.Tensor, other_lens: list[int], room: int) -> None:
        """Append the rows of ``other`` (a DynamicCache of width W2, right-aligned, mask ``(B2, W2)``) as new rows,
        right-aligned to the current write column (shifting the old rows right if W2 > W). ``room``: columns that
        must stay free after it."""
        B1, B2, W2 = self.batch_size, other_mask.shape[0], other_mask.shape[1]
        olayers = [lay for lay in _layers(other)]
        ref = next((lay for lay in olayers if getattr(lay, "keys", None) is not None and lay.keys.numel()), None)
        if ref is None and self.cache is not None and self.cache.layers[0].is_initialized:
            ref = self.cache.layers[0]
        newW = max(self.W, W2)
        if ref is None:  # nothing cached yet (1-token prompts only, so W == W2 == 0): shapes still unknown
            self.mask = torch.zeros(B1 + B2, self.L, dtype=torch.bool, device=self.device)
            self.lens = self.lens + list(other_lens)
            self._sync_pos()
            return
        L = max(self.L, self._size(newW + room + 1))  # + 1: see ensure_room
        if self.cache is not None and self.cache.layers[0].is_initialized and B1 and newW == self.W \
                and L == self.L and B1 + B2 <= self.capacity:
            self._merge_in_place(olayers, other_mask, other_lens)
            return
        keys, values = self._alloc(max(B1 + B2, self.capacity), L, ref.keys, ref.values)
        sh = newW - self.W
        for i in range(len(keys)):
            if B1 and self.cache.layers[i].is_initialized and self.W:
                keys[i][:B1, :, sh:newW] = self.cache.layers[i].keys[:, :, : self.W]
                values[i][:B1, :, sh:newW] = self.cache.layers[i].values[:, :, : self.W]
            lo = olayers[i]
            if W2 and getattr(lo, "keys", None) is not None and lo.keys.numel():
                keys[i][B1:B1 + B2, :, newW - W2:newW] = lo.keys
                values[i][B1:B1 + B2, :, newW - W2:newW] = lo.values
        mask = torch.zeros(B1 + B2, L, dtype=torch.bool, device=self.device)
        if B1 and self.W:
            mask[:B1, sh:newW] = self.mask[:, : self.W]
        if W2:
            mask[B1:, newW - W2:newW] = other_mask.bool()
        self._install(keys, values, L, B1 + B2)
        self.mask = mask
        self.lens = self.lens + list(other_lens)
        self._sync_pos()
        self._set_width(newW)
        self.holey = self.holey or min(self.lens) != newW or max(self.lens) != newW

    def _merge_in_place(self, olayers: list, other_mask: torch.Tensor, other_lens: list[int]) -> None:
        """:meth:`merge` into the free rows of the buffers: the new rows' W2 columns end at the write column W;
        their columns before those are zeroed (a stale non-finite value would reach attention through the mask's
        zero weight as NaN)."""
        B1, B2, W2, W = self.batch_size, other_mask.shape[0], other_mask.shape[1], self.W
        for k, v, lo in zip(*self._buffers, olayers):
            k[B1:B1 + B2, :, : W - W2].zero_()
            v[B1:B1 + B2, :, : W - W2].zero_()
            if W2:  # (1-token prompts: nothing cached, all W columns zeroed above)
                k[B1:B1 + B2, :, W - W2:W] = lo.keys
                v[B1:B1 + B2, :, W - W2:W] = lo.values
        mask = torch.zeros(B2, self.L, dtype=torch.bool, device=self.device)
        if W2:
            mask[:, W - W2:W] = other_mask.bool()
        self.mask = torch.cat([self.mask, mask])
        self._use_rows(B1 + B2)
        self.lens = self.lens + list(other_lens)
        self._sync_pos()
        self.holey = self.holey or min(self.lens) != W or max(self.lens) != W

    def select_rows(self, keep: list[int]) -> None:
        """Keep rows ``keep`` (indices, increasing) only, in place: row ``keep[j]`` moves to row j (a copy of the
        used columns of each row that moves); the buffers keep their capacity."""
        if any(b <= a for a, b in zip(keep, keep[1:])):
            raise ValueError(f"select_rows needs increasing row indices, got {keep}")
        idx = torch.tensor(keep, device=self.device)
        self.lens = [self.lens[i] for i in keep]
        self._pos = self._pos.index_select(0, idx)
        self.mask = self.mask.index_select(0, idx)
        if self.cache is not None and self.cache.layers[0].is_initialized:
            for k, v in zip(*self._buffers):
                for j, i in enumerate(keep):
                    if i != j:  # i > j: the source row is read before a later move overwrites it
                        k[j, :, : self.W] = k[i, :, : self.W]
                        v[j, :, : self.W] = v[i, :, : self.W]
            self._use_rows(len(keep))
        if all(n == self.W for n in self.lens):  # W valid slots in W columns: no hole
            self.holey = False

    def ensure_room(self, k: int) -> None:
        """Make ``k`` free columns after W, and one more: compact (one gather right-aligning every row) and, if still
        short, grow the buffers (a re-layout). A write never fills a buffer to its last column: a compiled forward
        specialises on a full buffer (attention over all of it), and that rare state cost one more graph."""
        if self.cache is None or not self.cache.layers[0].is_initialized:
            return
        if self.W + k < self.L:
            return
        width = max(self.lens)
        if width < self.W:
            order = torch.sort(self.mask[:, : self.W].long(), dim=-1, stable=True).indices[:, self.W - width:]
            for layer in self.cache.layers:
                layer.keys[:, :, :width] = _gather_slots(layer.keys[:, :, : self.W], order)
                layer.values[:, :, :width] = _gather_slots(layer.values[:, :, : self.W], order)
            lens = torch.tensor(self.lens, device=self.device)
            self.mask.zero_()
            self.mask[:, :width] = torch.arange(width, device=self.device) >= width - lens[:, None]
            self._set_width(width)
            self.holey = min(self.lens) != width
        if self.W + k >= self.L:
            L = self._size(self.W + k + self.L)
            first = self.cache.layers[0]
            keys, values = self._alloc(self.capacity, L, first.keys, first.values)
            for i, layer in enumerate(self.cache.layers):
                keys[i][: self.batch_size, :, : self.W] = layer.keys[:, :, : self.W]
                values[i][: self.batch_size, :, : self.W] = layer.values[:, :, : self.W]
            mask = torch.zeros(self.batch_size, L, dtype=torch.bool, device=self.device)
            mask[:, : self.W] = self.mask[:, : self.W]
            self._install(keys, values, L, self.batch_size)
            self.mask = mask

    def forward(self, model: Any, input_ids: torch.Tensor, input_mask: torch.Tensor | None,
                logits_to_keep: int | None = None, max_position: int | None = None, call: Any = None,
                holes: bool = False) -> torch.Tensor:
        """Write ``(B, k)`` new tokens at columns [W, W + k) and return their logits.

        ``input_mask`` ``(B, k)``: 1 for real tokens, 0 for holes (None: all real); ``holes``: whether it has a 0
        (known on the host). Positions are per row: ``lens + cumsum(input_mask) - 1``, clamped to
        ``max_position``. Updates W and the mask; ``lens`` is the caller's to update (:meth:`roll_back`).
        """
        k = input_ids.shape[1]
        if self.cache is None:
            L = self._size(k + 64)
            self.cache = _static_cache(model, L)
            self.L = L
            self.mask = torch.zeros(self.batch_size, L, dtype=torch.bool, device=self.device)
        self.ensure_room(k)
        W = self.W
        base_pos = self._pos[:, None]
        if input_mask is None:
            positions = base_pos + torch.arange(k, device=self.device)
            self.mask[:, W:W + k] = True
            self._pos = self._pos + k
        else:
            positions = base_pos + input_mask.cumsum(-1) - 1
            self.mask[:, W:W + k] = input_mask.bool()
            self._pos = self._pos + input_mask.sum(-1)
        positions = positions.clamp(0, max_position)
        self.holey = self.holey or holes
        attn = self.mask[:, : W + k] if self.holey else None
        for layer in self.cache.layers:
            layer.used = W + k
        kwargs = {_cache_kwarg(model): self.cache, "logits_to_keep": logits_to_keep or 0, **_off(model)}
        # The first write into a cache no prefill filled (1-token prompts only) allocates its buffers inside the
        # forward: run it eagerly, so a compiled call never traces that (one more graph, rare in serving).
        if call is None or not self.cache.layers[0].is_initialized:
            call = model
        out = call(input_ids=input_ids, attention_mask=attn, position_ids=positions, use_cache=True, **kwargs)
        if not self._buffers[0]:  # the layers allocated their buffers inside this first write: adopt them, and
            # hand the layers views of them as everywhere else (a compiled forward guards on whether keys are a view)
            self._buffers = ([layer.keys for layer in self.cache.layers], [layer.values for layer in self.cache.layers])
            self._use_rows(self.batch_size)
        self.W = W + k
        return out.logits

    def roll_back(self, valid: torch.Tensor, kept: list[int], new_lens: list[int]) -> None:
        """After a step: ``valid`` ``(B, n)`` are the kept bits of the last n columns written, ``kept`` their count
        per row (host), ``new_lens`` the valid slots per row. No copy: W moves back to the end of the longest row's
        kept columns, so later writes overwrite the rejected columns past it; a row that kept fewer than another
        keeps its rejected columns below the new W masked (a hole)."""
        start = self.W - valid.shape[1]
        self.mask[:, start:start + valid.shape[1]] = valid
        self.lens = list(new_lens)
        self._sync_pos()
        self.holey = self.holey or len(set(kept)) > 1
        self._set_width(start + max(kept, default=0))
