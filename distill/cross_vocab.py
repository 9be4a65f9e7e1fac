"""Training a draft whose tokenizer differs from the target's, on exactly the view the decoder gives it.

The decoder drafts through the token-level intersection of the two vocabularies (:mod:`decode.cross_vocab`; TLI,
Timor et al., ICML 2025, "Accelerating LLM Inference with Lossless Speculative Decoding Algorithms for
Heterogeneous Vocabularies"): the draft reads the target's tokens mapped one to one into its own ids
(:meth:`VocabIntersection.draft_ids`) and proposes only shared tokens, whose logits go to their target ids
(:meth:`VocabIntersection.target_logits`, -inf elsewhere). Training uses the same view: the draft's input ids are
the mapped target ids and its logits are the N shared columns over the target ids ``target_ids``, which is the
shape of a vocabulary-pruned draft (:mod:`decode.vocab_map`: N logits over a sorted map of target ids, q = 0
elsewhere). Positions stay one to one, so every loss (through the pruned-support forms of
:mod:`distill.losses`), the target-generated data and the logit cache (keyed on target tokens) apply unchanged.
"""
from __future__ import annotations

from typing import Any

import torch

from decode.compat import shares_vocabulary, tokenizer_fingerprint, vocab_fingerprint
from decode.cross_vocab import VocabIntersection, draft_intersection
from decode.vocab_map import draft_vocab_map
from distill.config import SetupError

METHOD = ("token-level intersection (TLI; Timor et al., ICML 2025): the draft reads the target's tokens mapped one "
          "to one into its vocabulary and proposes only the tokens both vocabularies share")


def is_cross_vocab(tokenizer: Any, draft_tokenizer: Any) -> bool:
    """Whether the draft has a tokenizer of its own (another vocabulary than the target's)."""
    return draft_tokenizer is not None and not shares_vocabulary(tokenizer, draft_tokenizer)


def check_cross_vocab_settings(cfg: Any) -> None:
    """Refuse the settings a draft with its own tokenizer cannot train with (before any model loads).

    Raises:
        SetupError: ``draft.vocab.keep`` (pruning chooses target ids for the draft's head, which scores draft ids),
            ``data.on_policy_fraction`` > 0 (rollouts write the draft's own ids, which the target cannot score).
    """
    keep = (cfg.draft.get("vocab") or {}).get("keep")
    if keep is not None:
        raise SetupError(f"draft.vocab.keep={keep}, but the draft has a tokenizer of its own: it proposes only the "
                         "tokens both vocabularies share, and its head is not pruned. Set draft.vocab.keep=null")
    if float(cfg.data.on_policy_fraction) > 0:
        raise SetupError(f"data.on_policy_fraction={cfg.data.on_policy_fraction}, but the draft has a tokenizer of "
                         "its own: its rollouts are in its vocabulary, which the target does not score. Set "
                         "data.on_policy_fraction=0 (data.completions=target trains on the target's own text)")


def check_resumed_pairing(saved: dict | None, draft_tokenizer: Any, resume_from: Any) -> None:
    """Refuse to resume a checkpoint with another draft tokenizer than it was trained with (before any model loads).

    Args:
        saved: the checkpoint's ``tokenizer_pairing`` (:func:`pairing_record`; None: the draft had the target's
            tokenizer).
        draft_tokenizer: this run's draft tokenizer when it differs from the target's, else None.

    Raises:
        SetupError: naming ``draft.tokenizer`` and the tokenizer the checkpoint keeps (``<checkpoint>/draft``).
    """
    was = (saved or {}).get("draft_vocab_hash")
    now = vocab_fingerprint(draft_tokenizer) if draft_tokenizer is not None else None
    if was == now:
        return
    kept, current = f"{resume_from}/draft", now or "the target's"
    if was is None:
        raise SetupError(f"the checkpoint {resume_from} was trained with the target's tokenizer, and this run's draft "
                         f"tokenizer has another vocabulary ({now}): resume with draft.tokenizer=null, or start a new "
                         "run (train.resume=false) for a draft with its own tokenizer")
    raise SetupError(f"the checkpoint {resume_from} was trained with a draft tokenizer of vocabulary {was} (kept in "
                     f"{kept}), and this run's draft tokenizer is {current}: its embedding rows would "
                     f"name other tokens. Resume with draft.tokenizer={kept}, or start a new run (train.resume=false)")


def pair_vocabularies(draft: Any, tokenizer: Any, draft_tokenizer: Any, vocab: int,
                      log: Any = print) -> VocabIntersection:
    """The intersection the run trains through (the decoder's own, :func:`decode.cross_vocab.draft_intersection`),
    with its summary logged.

    Raises:
        SetupError: the draft's head is vocabulary-pruned, or the vocabularies share no token.
    """
    if draft_vocab_map(draft) is not None:
        raise SetupError("the draft has a tokenizer of its own and a vocabulary-pruned head: train it from its "
                         "full-vocabulary checkpoint (draft.name_or_path)")
    x = draft_intersection(draft, tokenizer, draft_tokenizer, vocab)  # not None: the caller found two vocabularies
    if x.size == 0:
        raise SetupError("the draft's tokenizer and the target's share no token: give a draft whose vocabulary "
                         "overlaps the target's (draft.name_or_path)")
    log(f"the draft has a tokenizer of its own: it trains through the token-level intersection, {x.summary()}")
    return x


def draft_inputs(batch: dict[str, torch.Tensor], intersection: VocabIntersection | None) -> dict[str, torch.Tensor]:
    """``batch`` with its (target) ``input_ids`` as the draft reads them (unchanged without an intersection)."""
    if intersection is None:
        return batch
    return {**batch, "input_ids": intersection.draft_ids(batch["input_ids"])}


def shared_columns(draft_logits: torch.Tensor, intersection: VocabIntersection) -> tuple[torch.Tensor, torch.Tensor]:
    """``((..., N) logits of the shared tokens, (N,) their target ids)``: the pruned-draft form the losses and
    the teacher-forced evaluation take."""
    columns = intersection.columns.to(draft_logits.device)
    return draft_logits.index_select(-1, columns), intersection.target_ids.to(draft_logits.device)


def pairing_record(tokenizer: Any, draft_tokenizer: Any, intersection: VocabIntersection) -> dict:
    """What the trainer state and the export's card record about the pairing of the two tokenizers."""
    return {"method": METHOD, "shared_tokens": intersection.size, "coverage": intersection.coverage,
            "target_vocab_size": intersection.target_size, "draft_vocab_size": intersection.draft_size,
            "target_tokenizer_hash": tokenizer_fingerprint(tokenizer),
            "target_vocab_hash": vocab_fingerprint(tokenizer),
            "draft_tokenizer_hash": tokenizer_fingerprint(draft_tokenizer),
            "draft_vocab_hash": vocab_fingerprint(draft_tokenizer)}
