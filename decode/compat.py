"""Vocabulary and tokenizer compatibility of a target/draft pair: one rule for the decoder and the recipe.

Limits in which a draft may be smaller than its target, and what the decoder does (all lossless, all tested):
- output: fewer lm_head rows than the shared vocabulary -> q is 0 on the missing ids (below);
- input: fewer input-embedding rows -> ids it cannot embed are fed to it as a substitute id
  (:func:`draft_input_substitute`), which only changes its proposals, never the output distribution;
- positions: a shorter context -> a row that reaches it stops drafting (γ_r = 0, plain target steps);
- a vocabulary-pruned draft (:mod:`decode.vocab_map`): its N lm_head rows score the target ids of its map, q is 0
  on every other id; the map is checked here against the vocabulary and the tokenizer (:func:`check_draft_vocab_map`).
A *target* smaller than the shared vocabulary on either side is an error naming both sizes.

The shared vocabulary is the tokenizer's (``len(tokenizer)``). lm_head rows beyond it are padding (e.g. a
32000-token tokenizer with 32064 rows) and get probability 0 in both p and q (see
:func:`decode.sampling.logits_to_probs`). A draft whose lm_head covers fewer ids than the shared vocabulary
stays lossless: its q is 0 on the missing ids, so they are reachable only through the residual
``max(p - q, 0)``, which gives them exactly the target's probability. A *target* that covers fewer ids than the
tokenizer is an error (it could never produce them).
"""
from __future__ import annotations

import hashlib
import inspect
import json
import warnings
from typing import Any

from decode.vocab_map import HASH_FIELD, check_map, draft_vocab_map


class IncompatibleModelsError(ValueError):
    """Target and draft (or their tokenizers) cannot be used as a speculative pair."""


def output_vocab_size(model: Any) -> int:
    """Number of lm_head rows (logit columns) of a Hugging Face causal LM (peft-wrapped models too)."""
    emb = model.get_output_embeddings()
    if emb is not None and hasattr(emb, "weight"):
        return int(emb.weight.shape[0])
    return int(model.config.get_text_config().vocab_size if hasattr(model.config, "get_text_config")
               else model.config.vocab_size)


def input_vocab_size(model: Any) -> int | None:
    """Number of input-embedding rows (ids the model can read), or None when the model exposes none."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    weight = getattr(emb, "weight", None)
    return int(weight.shape[0]) if weight is not None else None


def draft_input_substitute(draft: Any, vocab_size: int, tokenizer: Any = None) -> tuple[int, int] | None:
    """``(limit, substitute)`` when the draft cannot embed every id of the shared vocabulary, else None.

    Ids ``>= limit`` are fed to the draft as ``substitute``: the tokenizer's unk id when the draft can embed it,
    else 0. Its q then conditions on a slightly different prefix, which lowers acceptance on such contexts but
    keeps the output exact (the verify rule needs only that each draft token was drawn from its q).
    """
    limit = input_vocab_size(draft)
    if limit is None or limit >= vocab_size:
        return None
    unk = getattr(tokenizer, "unk_token_id", None) if tokenizer is not None else None
    return limit, unk if isinstance(unk, int) and 0 <= unk < limit else 0


def substitute_draft_inputs(ids: Any, substitute: tuple[int, int] | None) -> Any:
    """``ids`` (a LongTensor of any shape) with every id ``>= limit`` replaced by the substitute id, for
    ``substitute = (limit, id)`` from :func:`draft_input_substitute`; ``ids`` itself when it is None."""
    if substitute is None:
        return ids
    import torch

    limit, sub = substitute
    return torch.where(ids < limit, ids, sub)


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A 16-hex-digit hash of the vocabulary (token -> id), the special tokens and the chat template: two
    tokenizers with the same fingerprint turn text and chats into the same ids (the logit cache stores it)."""
    special = tokenizer.special_tokens_map
    h = hashlib.sha256(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(json.dumps({"special": {k: str(v) for k, v in sorted(special.items())},
                         "chat_template": getattr(tokenizer, "chat_template", None)}, sort_keys=True).encode())
    return h.hexdigest()[:16]


def vocab_fingerprint(tokenizer: Any) -> str:
    """``"v:"`` + a 16-hex-digit hash of the vocabulary alone (token -> id, added tokens included): what a pruned
    draft's id map depends on, recorded in its config (``draft_vocab_tokenizer_hash``). A chat template or another
    pad token changes no id, so it changes no map (unlike :func:`tokenizer_fingerprint`, which hashes those too)."""
    return "v:" + hashlib.sha256(json.dumps(sorted(tokenizer.get_vocab().items())).encode()).hexdigest()[:16]


def check_draft_vocab_map(draft: Any, vocab_size: int, tokenizer: Any = None) -> None:
    """Check a vocabulary-pruned draft's id map (:mod:`decode.vocab_map`) against the pair; a full draft passes.

    The map must have one id per lm_head row, lie in the shared vocabulary ``[0, vocab_size)``, be sorted and
    unique, and (when ``tokenizer`` is given and the draft recorded one) come from the same vocabulary
    (:func:`vocab_fingerprint`, ``"v:"`` + 16 hex digits; a hash in any other form is refused: prune again).

    Raises:
        IncompatibleModelsError: naming the draft's map and the target's vocabulary or tokenizer.
    """
    ids = draft_vocab_map(draft)
    if ids is None:
        return
    rows = output_vocab_size(draft)
    if ids.shape != (rows,):
        raise IncompatibleModelsError(f"the draft's vocabulary map has shape {tuple(ids.shape)} but its lm_head has "
                                      f"{rows} rows; the pruned draft is corrupt, export it again")
    try:
        check_map(ids, vocab_size, f"the draft's vocabulary map ({rows} ids)")
    except ValueError as err:
        raise IncompatibleModelsError(f"{err}; the target's vocabulary has {vocab_size} ids. The draft was pruned "
                                      "for another target or tokenizer: prune it again for this one") from None
    stored = getattr(draft.config, HASH_FIELD, None)
    if tokenizer is None or not stored:
        return
    current = vocab_fingerprint(tokenizer)
    if not str(stored).startswith("v:"):
        raise IncompatibleModelsError(
            f"the draft's vocabulary map records tokenizer hash {stored!r}, not a vocabulary hash (\"v:\" + 16 hex "
            f"digits), so it cannot be checked against the target's tokenizer ({current}). Prune the full-vocabulary "
            "draft again with this tokenizer (draft.vocab.keep=N)")
    if stored != current:
        raise IncompatibleModelsError(
            f"the draft's vocabulary map was chosen with tokenizer {stored} but the target's tokenizer is "
            f"{current} (another vocabulary); its ids would name other tokens. Prune the full-vocabulary draft "
            "again with this tokenizer (draft.vocab.keep=N)")


def _special_ids(tok: Any) -> dict[str, Any]:
    return {name: getattr(tok, f"{name}_token_id", None) for name in ("bos", "eos", "unk")}


DRAFT_TOKENIZER_FIX = ("a draft of another vocabulary drafts through the tokens both share when it is given as one "
                       "(check_compatibility(..., cross_vocab=True); SpeculativeDecoder does so by itself, "
                       "decode.cross_vocab), else it needs the target's tokenizer (a draft whose head is pruned to "
                       "fewer ids keeps it and lists the ids it scores in its config's draft_vocab_map)")


def check_tokenizers(target_tokenizer: Any, draft_tokenizer: Any,
                     names: tuple[str, str] = ("the target's tokenizer", "the draft's tokenizer"),
                     fix: str = DRAFT_TOKENIZER_FIX) -> None:
    """Raise :class:`IncompatibleModelsError` if the two tokenizers map any shared id to a different token or
    disagree on bos/eos/unk ids. Ids present in only one tokenizer are allowed (the sizes may differ), and so are
    different pad tokens (none, eos as pad, or a ``<pad>`` of its own): pad only fills batch rows, which the
    attention mask and the loss leave out, so it changes no token either model sees.

    The vocabularies are compared first, and a message names both sizes when they differ, so a draft of another
    vocabulary is named as such rather than by the first special token that happens to differ. ``names`` (the two
    tokenizers as the message calls them) and ``fix`` (what to do, after a colon) word the message for other pairs
    of tokenizers (a ``--tokenizer`` against the target's own)."""
    if target_tokenizer is None or draft_tokenizer is None or target_tokenizer is draft_tokenizer:
        return
    a, b = names
    sizes = _sizes(names, len(target_tokenizer), len(draft_tokenizer))
    t_vocab = {i: t for t, i in target_tokenizer.get_vocab().items()}
    d_vocab = {i: t for t, i in draft_tokenizer.get_vocab().items()}
    diffs = [i for i in sorted(t_vocab.keys() & d_vocab.keys()) if t_vocab[i] != d_vocab[i]]
    if diffs:
        shown = f"{a} vs {b}: " + ", ".join(f"id {i} {t_vocab[i]!r} vs {d_vocab[i]!r}" for i in diffs[:3])
        raise IncompatibleModelsError(
            f"{sizes} map {len(diffs):,} shared ids to different tokens ({shown}): {fix}")
    t_special, d_special = _special_ids(target_tokenizer), _special_ids(draft_tokenizer)
    for name in t_special:
        if t_special[name] != d_special[name]:
            raise IncompatibleModelsError(
                f"{sizes} disagree on the {name} token id ({a} {t_special[name]!r}, {b} "
                f"{d_special[name]!r}): {fix}")


def _sizes(names: tuple[str, str], target_size: int, draft_size: int) -> str:
    """The subject of a mismatch message, with both sizes: "B has N ids and A M, and they", or "A and B (both N
    ids)"."""
    a, b = names
    if target_size == draft_size:
        return f"{a} and {b} (both {target_size:,} ids)"
    return f"{b} has {draft_size:,} ids and {a} {target_size:,}, and they"


def check_cache_support(model: Any, role: str) -> None:
    """Raise :class:`IncompatibleModelsError` if ``model`` (the ``role``: "target" or "draft") keeps state the decoder
    cannot roll back: a recurrent or convolution state (Mamba and hybrids, transformers' linear-attention cache
    layers, a cache class of the model's own as in RWKV and xLSTM) or a sparse-attention indexer cache. The decoder
    undoes a rejected draft by masking and dropping KV slots, which needs every cached layer to be a plain per-token
    key/value cache (full or sliding-window)."""
    try:
        from transformers import DynamicCache
        from transformers.cache_utils import DummyLayer, DynamicLayer, DynamicSlidingWindowLayer
    except ImportError:  # older transformers: no per-layer cache kinds to inspect
        return
    base = base_model(model)
    default_cache = getattr(type(base), "_supports_default_dynamic_cache", None)  # transformers' own test
    if callable(default_cache) and not default_cache():
        raise IncompatibleModelsError(
            f"the {role} ({type(base).__name__}) keeps its state in a cache of its own (a recurrent state, as in "
            "RWKV or xLSTM), not a per-token key/value cache, so the speculative decoder cannot roll back a "
            f"rejected draft; only attention models with a per-token KV cache are supported. Use an attention-only "
            f"model as the {role}.")
    params = inspect.signature(type(base).forward).parameters
    named = bool({"cache", "past_key_values"} & set(params))
    if not named and not (any(p.kind is p.VAR_KEYWORD for p in params.values()) and _fills_a_cache(model)):
        raise IncompatibleModelsError(  # e.g. OpenAI GPT: every forward recomputes the prefix
            f"the {role} ({type(base).__name__}) takes no key/value cache (its forward has no cache argument, or "
            "leaves the cache it is given empty), so it cannot continue from a cached prefix; only models with a "
            f"per-token KV cache are supported. Use another model as the {role}.")
    try:
        layers = DynamicCache(config=base.config).layers
    except Exception:  # noqa: BLE001 - a config the cache cannot read: leave the decision to the forward
        return
    kv_only = (DynamicLayer, DynamicSlidingWindowLayer, DummyLayer)  # per-token KV slots, or no cache at all
    bad = sorted({type(layer).__name__ for layer in layers if type(layer) not in kv_only})
    if bad:
        raise IncompatibleModelsError(
            f"the {role} ({type(base).__name__}) keeps state the speculative decoder cannot roll back after a "
            f"rejected draft (cache layers {bad}: a recurrent/convolution state or an indexer cache); only "
            "attention models with a per-token KV cache are supported. Use an attention-only model as the "
            f"{role}.")


def base_model(model: Any) -> Any:
    """The model a peft wrapper (``get_base_model``) holds, or ``model`` itself: whose class and config to inspect."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


class NotCausalError(ValueError):
    """A model's logits at a position depend on later tokens: it is not a causal (left-to-right) language model."""


def probe_logits(model: Any, runs: list[tuple[list[int], list[int]]], **kwargs: Any) -> tuple[list[Any], Any] | None:
    """Eager forwards for the behavioural probes (:func:`check_causal`, :func:`decode.cache.slot_probe`,
    :func:`check_cache_support`): ``model`` runs on each ``(ids, mask)`` of ``runs`` (one row each; ids modulo the
    input embedding's rows; position ids from the mask as the decoder computes them, ``cumsum(mask) - 1``), in eval
    mode (its mode is restored), without a cache unless ``kwargs`` (passed to the forward) give one. Returns the
    float32 logits ``(T, V)`` of each run and the parameters' dtype; None when the model cannot be probed (no
    parameters or input embedding, or the forward raises: the real forward will raise its own)."""
    import torch

    try:
        param = next(model.parameters())
        rows = model.get_input_embeddings().weight.shape[0]
    except Exception:  # noqa: BLE001 - nothing to probe
        return None
    was_training = model.training
    try:
        model.eval()
        logits = []
        # autocast off: the probes ask what the architecture does with slots, masks and later tokens, which a
        # caller's bf16 autocast (distill's generate-data) would blur past the float32 tolerances
        with torch.no_grad(), torch.autocast(param.device.type, enabled=False):
            for ids, mask in runs:
                ids = torch.tensor([ids], device=param.device) % rows
                mask = torch.tensor([mask], device=param.device)
                out = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                            **{"use_cache": False, **kwargs})
                logits.append(out.logits[0].float())
    except Exception:  # noqa: BLE001 - the real forward will raise its own error
        return None
    finally:
        model.train(was_training)
    return logits, param.dtype


def probe_tolerance(dtype: Any, reference: Any, full: float = 1e-3, low: float = 2e-2) -> float:
    """How far two probe logits may differ by rounding: ``full`` (float32/64) or ``low`` (lower precision) times the
    largest reference logit, or 1 when that is smaller."""
    import torch

    return (full if dtype in (torch.float32, torch.float64) else low) * max(1.0, float(reference.abs().max()))


def check_causal(model: Any, role: str) -> None:
    """Raise :class:`NotCausalError` if ``model`` (the ``role``) is not causal: a masked LM loaded as a causal-LM
    class (BERT's ``BertLMHeadModel`` without ``is_decoder=True``) attends to the tokens it should predict, so its
    "next-token" distributions, every acceptance measured against them and every draft trained on them mean nothing.

    A probe, not a config flag (``is_decoder`` is False for Llama too): two forwards of 4 tokens that differ in the
    last one (:func:`probe_logits`); the logits of the first three positions must agree within 1e-5 (float32/64) or
    2e-2 (lower precision) of the largest logit (the shapes are equal, so only an MoE's routing moves them, by
    float32 summation order). Nothing is raised when the probe cannot run."""
    probe = probe_logits(model, [([3, 5, 7, 11], [1] * 4), ([3, 5, 7, 13], [1] * 4)])
    if probe is None:
        return
    (a, b), dtype = probe
    if float((a[:3] - b[:3]).abs().max()) > probe_tolerance(dtype, a[:3], full=1e-5):
        base = base_model(model)
        raise NotCausalError(
            f"the {role} ({type(base).__name__}) is not a causal language model: its logits at a position change "
            "when a later token changes (a masked LM such as BERT loaded as a causal LM; for BERT-style decoders set "
            f"is_decoder=True in its config). Speculative decoding and distillation need a left-to-right model as "
            f"the {role}.")


CHUNK_DEPENDENT_ROPE = ("dynamic", "longrope")  # rope types whose frequencies follow the largest position in a forward


def chunk_dependent_rope(model: Any) -> tuple[str, int | None] | None:
    """``(rope_type, position)`` when ``model``'s rotary frequencies are chosen per forward from its largest position
    id (transformers' ``dynamic`` NTK scaling past ``max_position_embeddings``; ``longrope``, as in Phi-3 128k, past
    ``original_max_position_embeddings``), else None. Past that position such a model's logits depend on how many
    tokens one forward holds (a verify of γ + 1 tokens, a padded batch), so no decoder that verifies several tokens
    at once can equal one-token-at-a-time decoding there exactly; the engine says so once at construction."""
    base = base_model(model)
    cfg = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None)
    if not isinstance(params, dict) or not params:
        return None
    groups = list(params.values()) if all(isinstance(v, dict) for v in params.values()) else [params]
    for group in groups:  # per layer type (Gemma3's sliding/full attention) or one for all layers
        kind = group.get("rope_type", group.get("type"))
        if kind in CHUNK_DEPENDENT_ROPE:
            name = "original_max_position_embeddings" if kind == "longrope" else "max_position_embeddings"
            start = group.get(name, getattr(cfg, name, None))
            return kind, start if isinstance(start, int) else None
    return None


def _fills_a_cache(model: Any) -> bool:
    """Whether a forward through ``**kwargs`` (a subclass's ``forward(*args, **kwargs)``) writes the DynamicCache it
    is given, as ``past_key_values``: one 2-token probe forward. True when the probe cannot run."""
    from transformers import DynamicCache

    cache = DynamicCache()
    return probe_logits(model, [([3, 5], [1, 1])], past_key_values=cache, use_cache=True) is None \
        or cache.get_seq_length() > 0


def check_argument_types(target: Any, draft: Any = None, target_tokenizer: Any = None,
                         draft_tokenizer: Any = None) -> None:
    """Raise ``TypeError`` naming the argument when a model is not a loaded causal LM (e.g. a path given where the
    model belongs) or a tokenizer is not a tokenizer object (a path string would otherwise pass ``len()`` and make
    its length the vocabulary). ``draft`` and the tokenizers may be None."""
    import os

    for name, model in (("target", target), ("draft", draft)):
        if (name == "draft" and model is None) or (callable(model) and hasattr(model, "get_output_embeddings")
                                                   and hasattr(model, "config")):
            continue
        hint = (" Load it first: decode.loading.load_causal_lm(path)" if isinstance(model, (str, os.PathLike))
                else "")
        raise TypeError(f"{name} must be a loaded Hugging Face causal LM (e.g. AutoModelForCausalLM."
                        f"from_pretrained(path)), got {type(model).__name__} {str(model)[:80]!r}.{hint}")
    for name, tok in (("tokenizer", target_tokenizer), ("draft_tokenizer", draft_tokenizer)):
        if tok is None or (hasattr(tok, "get_vocab") and hasattr(tok, "__len__") and not isinstance(tok, str)):
            continue
        hint = (" Load it first: decode.loading.load_tokenizer(path) or AutoTokenizer.from_pretrained(path)"
                if isinstance(tok, (str, os.PathLike)) else "")
        raise TypeError(f"{name} must be a tokenizer object (with get_vocab() and len()), got {type(tok).__name__} "
                        f"{str(tok)[:80]!r}.{hint}")


def shares_vocabulary(target_tokenizer: Any, draft_tokenizer: Any) -> bool:
    """Whether a draft with ``draft_tokenizer`` reads and writes the target's ids (:func:`check_tokenizers` passes;
    True when either is None); otherwise it drafts through the tokens both share (:mod:`decode.cross_vocab`)."""
    try:
        check_tokenizers(target_tokenizer, draft_tokenizer)
    except IncompatibleModelsError:
        return False
    return True


def check_compatibility(target: Any, draft: Any = None, target_tokenizer: Any = None, draft_tokenizer: Any = None,
                        cross_vocab: bool = False) -> int:
    """Check that ``draft`` can propose tokens for ``target`` and return the shared vocabulary size V.

    ``cross_vocab``: the draft has a vocabulary of its own (:mod:`decode.cross_vocab`): V is the target's, and a
    vocabulary-pruned draft is refused (its map names ids of the tokenizer it was pruned with).

    V is ``len(target_tokenizer)`` when a tokenizer is given (grown to the draft tokenizer's size where the target's
    lm_head has rows for those ids), else the target's lm_head size. Ids beyond V that only a draft's tokenizer has
    (special tokens added to the draft after training) are left out of q, which stays lossless: the target gives
    them no probability.

    Raises:
        TypeError: a model or tokenizer of the wrong kind, e.g. a path (:func:`check_argument_types`).
        IncompatibleModelsError: the target is a vocabulary-pruned draft; tokenizers disagree (see
            :func:`check_tokenizers`); the target's lm_head or input
            embedding has fewer rows than the shared vocabulary; with no tokenizer given, the draft's lm_head is larger than the
            target's (the extra draft ids have no target probability, so the pair is ambiguous); or a pruned
            draft's id map does not fit (see :func:`check_draft_vocab_map`).
    """
    check_argument_types(target, draft, target_tokenizer, draft_tokenizer)
    if draft_vocab_map(target) is not None:
        raise IncompatibleModelsError(
            f"the target is a vocabulary-pruned draft (its lm_head scores {output_vocab_size(target)} ids, listed "
            "in its draft_vocab_map): it cannot be a target. Give it as the draft, and the full model it was "
            "pruned for as the target")
    if cross_vocab:
        if target_tokenizer is None or draft_tokenizer is None:
            raise IncompatibleModelsError("a draft with a tokenizer of its own needs both tokenizers: pass "
                                          "tokenizer= (the target's) and draft_tokenizer= (the draft's)")
        if draft is not None and draft_vocab_map(draft) is not None:
            raise IncompatibleModelsError(
                "the draft is vocabulary-pruned (its lm_head scores the ids of its draft_vocab_map, ids of the "
                "tokenizer it was pruned with) and was given a tokenizer of another vocabulary than the target's: "
                "a pruned draft keeps the target's tokenizer. Drop the draft tokenizer (--draft-tokenizer, "
                "draft_tokenizer=, draft.tokenizer), or use a full-vocabulary draft with its own tokenizer")
        return check_compatibility(target, None, target_tokenizer)
    check_tokenizers(target_tokenizer, draft_tokenizer)
    v_target = output_vocab_size(target)
    if target_tokenizer is not None:
        vocab = len(target_tokenizer)
        if draft_tokenizer is not None:  # ids only the draft's tokenizer has count as far as the target scores them
            vocab = max(vocab, min(len(draft_tokenizer), v_target))
        if v_target < vocab:
            raise IncompatibleModelsError(
                f"the target's lm_head has {v_target} rows but the tokenizer has {vocab} tokens; the target could "
                "never produce the extra ids. Resize the target's embeddings (model.resize_token_embeddings) or "
                "use its own tokenizer."
            )
    else:
        vocab = v_target
        if draft is not None and output_vocab_size(draft) > v_target:
            raise IncompatibleModelsError(
                f"the draft's lm_head has {output_vocab_size(draft)} rows but the target's has {v_target}; pass the "
                "tokenizer(s) so the shared vocabulary is known, or use a draft built for this target's vocabulary."
            )
    t_in = input_vocab_size(target)
    if t_in is not None and t_in < vocab:
        raise IncompatibleModelsError(
            f"the target's input embedding has {t_in} rows but the shared vocabulary has {vocab} ids; the target "
            "could not read ids it produces. Resize its embeddings (model.resize_token_embeddings) or use a "
            "tokenizer of at most that size."
        )
    if draft is not None:
        check_draft_vocab_map(draft, vocab, target_tokenizer)
    return vocab


def check_decodable(target: Any, draft: Any, tokenizer: Any = None, draft_tokenizer: Any = None,
                    cross_vocab: bool = False) -> int:
    """The pair checked for speculative decoding (:func:`check_compatibility`: a shared vocabulary, or with
    ``cross_vocab`` the target's; each model's cache rolls back, :func:`check_cache_support`; causal attention,
    :func:`check_causal`); returns the shared vocabulary size. ``draft_tokenizer`` defaults to ``tokenizer``."""
    vocab_size = check_compatibility(target, draft, tokenizer, draft_tokenizer or tokenizer, cross_vocab)
    for name, model in (("target", target), ("draft", draft)):
        if model is not None:
            check_cache_support(model, name)
            check_causal(model, name)
    return vocab_size


def warn_chunk_dependent_rope(target: Any) -> None:
    """Warn when the target's rotary frequencies depend on how many tokens a forward holds
    (:func:`chunk_dependent_rope`)."""
    rope = chunk_dependent_rope(target)
    if rope is not None:
        warnings.warn(f"decode: the target's rope_type {rope[0]!r} picks its rotary frequencies from the largest "
                      f"position in each forward, so past position {rope[1]} its logits depend on how many tokens "
                      "a forward holds and outputs there can differ from one-token-at-a-time decoding (plain "
                      "decoding through this engine too; docs/decode.md, Limits)", stacklevel=3)
