"""Vocabulary-pruned drafts: an lm_head over N of the target's V ids, plus the draft-to-target id map.

Most of a small draft's work is its output layer (the quickstart draft: 1.57M of 2.46M parameters are its tied
8192 × 192 embedding / head). A pruned draft keeps only the N ids that carry the most target probability on the
training data (EAGLE-3's draft-to-target map, Li et al. 2025, applied to an independent draft model):

- its lm_head has N rows; row i scores target id ``map[i]``. The input embedding keeps all V rows (untied from
  the head), so the draft can still be fed any id;
- the map is an int64 buffer ``draft_vocab_map`` (N,) of the model, sorted and unique, saved in its safetensors
  next to the weights, and ``config.draft_vocab_map_size`` / ``config.draft_vocab_tokenizer_hash`` say that the
  checkpoint is pruned and for which vocabulary (:func:`decode.compat.vocab_fingerprint`);
- the decoder stays lossless: the draft's N logits are placed into a V-wide row of -inf
  (:func:`scatter_to_vocab`), so q = 0 outside the map and the residual ``max(p − q, 0)`` gives the other ids
  exactly their target probability (:func:`decode.compat.check_compatibility` checks the map against the pair).

A pruned checkpoint loads through the ordinary ``from_pretrained`` path (:func:`load_pretrained`): the architecture
is built with its usual V-row head, every other weight is loaded as usual, and the head is then replaced by the
stored N rows (no remote code).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable

import torch
from safetensors import safe_open

MAP_KEY = "draft_vocab_map"                    # the buffer (and safetensors key) holding the (N,) int64 map
SIZE_FIELD = "draft_vocab_map_size"            # config field: N (absent or None: a full-vocabulary model)
HASH_FIELD = "draft_vocab_tokenizer_hash"      # config field: the tokenizer the map was chosen with


def select_kept_ids(mass: torch.Tensor, keep: int, special_ids: Iterable[int | None] = ()) -> torch.Tensor:
    """The ``keep`` ids with the most target probability mass, always including ``special_ids``.

    Args:
        mass: ``(V,)`` non-negative float, the target probability summed per id over the training positions.
        keep: N, the number of ids to keep; ``len(specials) <= N <= V``.
        special_ids: ids kept whatever their mass (eos/bos/pad/unk, so the draft can propose an end of
            sequence); None entries are ignored.

    Returns:
        ``(N,)`` int64, sorted ascending. Ties in mass go to the lower id, so the choice is deterministic.

    Raises:
        ValueError: ``keep`` outside ``[number of special ids, V]`` or a special id outside ``[0, V)``.
    """
    vocab = int(mass.shape[-1])
    specials = sorted({int(i) for i in special_ids if i is not None})
    if any(not 0 <= i < vocab for i in specials):
        raise ValueError(f"special ids {specials} must lie in [0, {vocab}) (the target's vocabulary)")
    if isinstance(keep, bool) or not isinstance(keep, int) or not max(len(specials), 1) <= keep <= vocab:
        raise ValueError(f"draft.vocab.keep={keep!r} must be an integer in [{max(len(specials), 1)}, {vocab}] "
                         f"(at least the {len(specials)} special ids, at most the vocabulary)")
    score = mass.detach().double().cpu().clone()
    score[specials] = float("inf")
    # Stable sort on -score: equal masses keep ascending id order.
    order = torch.sort(-score, stable=True).indices[:keep]
    return torch.sort(order).values.long()


def draft_vocab_map(model: Any) -> torch.Tensor | None:
    """The ``(N,)`` int64 draft-to-target id map of a pruned draft, or None for a full one. Looks through peft
    (``get_base_model``) and DDP/FSDP-style wrappers (``.module``)."""
    for _ in range(4):
        value = getattr(model, MAP_KEY, None)
        if isinstance(value, torch.Tensor):
            return value
        inner = getattr(model, "module", None)
        if inner is None and hasattr(model, "get_base_model"):
            inner = model.get_base_model()
        if inner is None or inner is model:
            return None
        model = inner
    return None


def _configs(model: Any) -> list[Any]:
    cfgs = {id(model.config): model.config}
    if hasattr(model.config, "get_text_config"):
        text = model.config.get_text_config()
        cfgs[id(text)] = text
    return list(cfgs.values())


def prune_draft_head(model: Any, kept_ids: torch.Tensor, tokenizer_hash: str | None = None) -> Any:
    """Give ``model`` an N-row lm_head over ``kept_ids`` and store the map (in place; returns the model).

    The new head's rows are copies of the current head's rows ``kept_ids`` (of the tied embedding when tied), so a
    trained draft starts pruned from its own weights. The head is untied from the input embedding, which keeps
    all its rows. Pruning a pruned draft again is refused (its rows no longer index target ids).

    Args:
        model: a Hugging Face causal LM whose lm_head covers the target's vocabulary.
        kept_ids: ``(N,)`` int target ids, sorted and unique (:func:`select_kept_ids`).
        tokenizer_hash: :func:`decode.compat.vocab_fingerprint` of the tokenizer, stored in the config.

    Raises:
        ValueError: the model is already pruned, or ``kept_ids`` is not sorted/unique or exceeds the head.
    """
    if draft_vocab_map(model) is not None:
        raise ValueError("this draft is already vocabulary-pruned; prune its full-vocabulary checkpoint instead")
    head = model.get_output_embeddings()
    ids = torch.as_tensor(kept_ids, dtype=torch.long).cpu()
    check_map(ids, int(head.weight.shape[0]), "kept_ids")
    new = torch.nn.Linear(head.weight.shape[1], len(ids), bias=getattr(head, "bias", None) is not None,
                          device=head.weight.device, dtype=head.weight.dtype)
    with torch.no_grad():
        new.weight.copy_(head.weight[ids.to(head.weight.device)])
        if new.bias is not None:
            new.bias.copy_(head.bias[ids.to(head.bias.device)])
    new.weight.requires_grad_(head.weight.requires_grad)
    model.set_output_embeddings(new)
    for cfg in _configs(model):
        cfg.tie_word_embeddings = False
    model.config.update({SIZE_FIELD: len(ids), HASH_FIELD: tokenizer_hash})
    model.register_buffer(MAP_KEY, ids.to(head.weight.device), persistent=True)
    return model


def expand_draft_head(model: Any, vocab_size: int) -> Any:
    """Give a pruned draft back a ``vocab_size``-row lm_head (in place; returns the model), for engines that cannot
    read the id map (vLLM, SGLang, transformers' assisted generation).

    Row ``map[i]`` of the new head is row i of the pruned head; every other row is zero, so those ids get logit 0
    (a bias-free head cannot give them -inf). Greedy drafting proposes the same ids wherever the best kept logit is
    positive; a sampled draft puts some probability on the other ids, so its acceptance can differ from the pruned
    draft's (``python -m decode vllm-check`` measures it). Drops the map and the config's pruning fields; the head
    stays untied from the input embedding.

    Raises:
        ValueError: the model is not pruned, or its map reaches past ``vocab_size``.
    """
    ids = draft_vocab_map(model)
    if ids is None:
        raise ValueError("this draft's head already covers the full vocabulary (no vocabulary map)")
    check_map(ids.cpu(), vocab_size, "the draft's vocabulary map")
    head = model.get_output_embeddings()
    new = torch.nn.Linear(head.weight.shape[1], vocab_size, bias=getattr(head, "bias", None) is not None,
                          device=head.weight.device, dtype=head.weight.dtype)
    with torch.no_grad():
        new.weight.zero_()
        new.weight.index_copy_(0, ids.to(head.weight.device), head.weight)
        if new.bias is not None:
            new.bias.zero_()
            new.bias.index_copy_(0, ids.to(head.bias.device), head.bias)
    model.set_output_embeddings(new)
    owner = model
    while not hasattr(owner, "_buffers") or MAP_KEY not in owner._buffers:  # the pruned model itself, or inside a wrapper
        owner = getattr(owner, "module", None) or owner.get_base_model()
    del owner._buffers[MAP_KEY]
    for cfg in _configs(model):
        cfg.tie_word_embeddings = False
        for name in (SIZE_FIELD, HASH_FIELD):
            if hasattr(cfg, name):
                delattr(cfg, name)
    return model


def check_map(ids: torch.Tensor, vocab_size: int, what: str = "the draft's vocabulary map") -> None:
    """Raise ValueError unless ``ids`` is a non-empty 1-D int tensor, sorted, unique, within ``[0, vocab_size)``."""
    if ids.dim() != 1 or ids.numel() == 0 or ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{what} must be a non-empty 1-D integer tensor, got {tuple(ids.shape)} {ids.dtype}")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(f"{what} has ids outside [0, {vocab_size}): min {int(ids.min())}, max {int(ids.max())}")
    if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
        raise ValueError(f"{what} must be sorted ascending without repeats")


def scatter_to_vocab(logits: torch.Tensor, vocab_map: torch.Tensor, vocab_size: int,
                     columns: torch.Tensor | None = None) -> torch.Tensor:
    """``(..., N)`` logits over the kept ids -> ``(..., vocab_size)`` with ``-inf`` on every other id (q = 0 there).

    Differentiable in ``logits``; ``vocab_map`` (N,) int64 on the logits' device. ``columns`` (N,) int64: take
    those columns of ``logits`` first (a draft of another vocabulary, :mod:`decode.cross_vocab`).
    """
    if columns is not None:
        logits = logits.index_select(-1, columns)
    full = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
    return full.index_copy(-1, vocab_map, logits)


# ------------------------------------------------------------------------------------------------ loading

def pruned_size(folder: str | os.PathLike) -> int | None:
    """N from a local checkpoint folder's config.json (None: not a pruned draft, or not a local folder).

    Raises:
        ValueError: ``draft_vocab_map_size`` is not a positive integer, or is absent while the folder's safetensors
            hold a ``draft_vocab_map`` (an edited config.json: the N-row head would otherwise fail to load with a
            bare size-mismatch error, or be replaced by a random V-row head).
    """
    folder = Path(os.path.expanduser(str(folder)))
    cfg = folder / "config.json"
    if not cfg.is_file():
        return None
    value = json.loads(cfg.read_text()).get(SIZE_FIELD)
    if value is None:
        stored = _stored_map_shape(folder)
        if stored is not None:
            raise ValueError(f"{folder}: its safetensors hold a vocabulary map {MAP_KEY!r} of shape {stored} but "
                             f"config.json has no {SIZE_FIELD}; add \"{SIZE_FIELD}\": {stored[0] if stored else '?'} "
                             "to config.json, or export the draft again with draftkit")
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{folder}: config.json has {SIZE_FIELD}={value!r}; it must be a positive integer, the "
                         "number of ids in the draft's vocabulary map (export the draft again with draftkit)")
    return value


def _stored_map_shape(folder: Path) -> tuple[int, ...] | None:
    """The shape of the ``draft_vocab_map`` tensor in the folder's safetensors (header only), or None."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        path = json.loads(index.read_text()).get("weight_map", {}).get(MAP_KEY)
        path = folder / path if path else None
    else:
        path = folder / "model.safetensors"
    if path is None or not path.is_file():
        return None
    with safe_open(str(path), framework="pt") as f:
        return tuple(f.get_slice(MAP_KEY).get_shape()) if MAP_KEY in f.keys() else None


def _weight_files(folder: Path) -> dict[str, Path]:
    """Every tensor name stored in the folder's ``model.safetensors`` (or its sharded index) -> its file."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return {n: folder / f for n, f in json.loads(index.read_text())["weight_map"].items()}
    single = folder / "model.safetensors"
    if not single.is_file():
        return {}
    with safe_open(str(single), framework="pt") as f:
        return {n: single for n in f.keys()}


def _stored_head_keys(folder: Path, model: Any, head_name: str) -> dict[str, str]:
    """Module parameter name -> the name the files store it under, for the head's weight and bias. Usually the
    same; some architectures are saved under their original checkpoint names by transformers (GPT-NeoX's module
    ``lm_head`` is stored as ``embed_out``): then the head is the one stored tensor that no parameter of the model
    is named after with the head's parameter suffix and the pruned head's first dimension."""
    stored = _weight_files(folder)
    own = set(model.state_dict())
    size = int(getattr(model.config, SIZE_FIELD))
    out = {}
    for suffix in ("weight", "bias"):
        key = f"{head_name}.{suffix}"
        if key in stored:
            out[key] = key
            continue
        candidates = [n for n in stored if n.endswith("." + suffix) and n not in own and n != MAP_KEY
                      and _stored_shape(stored[n], n)[:1] == (size,)]
        if len(candidates) == 1:
            out[key] = candidates[0]
    return out


def _stored_shape(path: Path, name: str) -> tuple[int, ...]:
    with safe_open(str(path), framework="pt") as f:
        return tuple(f.get_slice(name).get_shape())


def _read_tensors(folder: Path, names: list[str]) -> dict[str, torch.Tensor]:
    """The named tensors from the folder's ``model.safetensors`` (or its sharded index)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = {n: folder / weight_map[n] for n in names if n in weight_map}
    else:
        files = {n: folder / "model.safetensors" for n in names}
    out = {}
    for name, path in files.items():
        if path.is_file():
            with safe_open(str(path), framework="pt") as f:
                if name in f.keys():
                    out[name] = f.get_tensor(name)
    return out


def restore_pruned_head(model: Any, folder: str | os.PathLike) -> Any:
    """Replace the V-row head that ``from_pretrained`` built by the stored N-row head and register the map.

    Raises:
        ValueError: the folder lacks the head or the map, the map is not an integer tensor, or their sizes disagree
            with ``config.draft_vocab_map_size``.
    """
    folder = Path(os.path.expanduser(str(folder)))
    head = model.get_output_embeddings()
    head_name = next(n for n, m in model.named_modules() if m is head)
    keys = [MAP_KEY, f"{head_name}.weight"] + ([f"{head_name}.bias"] if getattr(head, "bias", None) is not None else [])
    renamed = _stored_head_keys(folder, model, head_name)  # module name -> file name (usually the same)
    files = _read_tensors(folder, [renamed.get(k, k) for k in keys])
    stored = {k: files[renamed.get(k, k)] for k in keys if renamed.get(k, k) in files}
    size = int(getattr(model.config, SIZE_FIELD))
    missing = [k for k in keys if k not in stored]
    if missing:
        raise ValueError(f"{folder} says it is a vocabulary-pruned draft ({SIZE_FIELD}={size} in config.json) but "
                         f"its safetensors lack {missing}; export it again with draftkit")
    map_dtype = stored[MAP_KEY].dtype
    if map_dtype.is_floating_point or map_dtype.is_complex or map_dtype == torch.bool:  # .long() would truncate
        raise ValueError(f"{folder}: the vocabulary map {MAP_KEY!r} is {map_dtype}; it must hold integer "
                         "target ids (int64). The checkpoint was edited or is corrupt: export it again")
    ids, weight = stored[MAP_KEY].long(), stored[f"{head_name}.weight"]
    if ids.shape != (size,) or weight.shape != (size, head.weight.shape[1]):  # (a narrower head: a mid-decode error)
        raise ValueError(f"{folder}: {SIZE_FIELD}={size} but the map has shape {tuple(ids.shape)} and the head "
                         f"{tuple(weight.shape)} (expected ({size}, {head.weight.shape[1]}), the model's hidden size); "
                         "the checkpoint is inconsistent, export it again")
    new = torch.nn.Linear(weight.shape[1], size, bias=f"{head_name}.bias" in stored,
                          device=head.weight.device, dtype=head.weight.dtype)
    with torch.no_grad():
        new.weight.copy_(weight)
        if new.bias is not None:
            new.bias.copy_(stored[f"{head_name}.bias"])
    new.requires_grad_(head.weight.requires_grad)
    model.set_output_embeddings(new)
    for cfg in _configs(model):
        cfg.tie_word_embeddings = False
    model.register_buffer(MAP_KEY, ids.to(head.weight.device), persistent=True)
    return model


def load_pretrained(name_or_path: str, **kwargs: Any) -> Any:
    """``AutoModelForCausalLM.from_pretrained(name_or_path, **kwargs)``, restoring the N-row head and the map of a
    pruned draft (see module doc). Any mismatch other than the pruned head is an error, as in plain loading.

    Raises:
        ValueError: a pruned folder whose other weights do not fit its config, or that lacks its head/map.
    """
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    if pruned_size(name_or_path) is None:
        return AutoModelForCausalLM.from_pretrained(name_or_path, **kwargs)
    cfg = json.loads((Path(os.path.expanduser(str(name_or_path))) / "config.json").read_text())
    if cfg.get("tie_word_embeddings") or (cfg.get("text_config") or {}).get("tie_word_embeddings"):
        raise ValueError(f"{name_or_path}: config.json has tie_word_embeddings=true, but a vocabulary-pruned draft's "
                         "N-row head is untied from its V-row input embedding; set \"tie_word_embeddings\": false "
                         "in config.json, or export the draft again with draftkit")
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the load report would list the expected head mismatch as a problem
    try:
        model, info = AutoModelForCausalLM.from_pretrained(name_or_path, ignore_mismatched_sizes=True,
                                                           output_loading_info=True, **kwargs)
    finally:
        hf_logging.set_verbosity(level)
    head = model.get_output_embeddings()
    head_name = next(n for n, m in model.named_modules() if m is head)
    others = [k[0] if isinstance(k, tuple) else k for k in info.get("mismatched_keys", ())]
    others = [k for k in others if not k.startswith(f"{head_name}.")]
    unexpected = [k for k in info.get("unexpected_keys", ()) if k != MAP_KEY]
    if others or unexpected or info.get("missing_keys"):
        raise ValueError(f"{name_or_path}: weights do not fit its config (mismatched {others}, unexpected "
                         f"{unexpected}, missing {sorted(info.get('missing_keys') or [])})")
    restore_pruned_head(model, name_or_path)
    model.eval()
    return model
