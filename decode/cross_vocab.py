"""Drafts with their own tokenizer: the token-level intersection of two vocabularies.

A draft whose tokenizer differs from the target's drafts through the tokens both vocabularies share (token-level
intersection, TLI: Timor et al., ICML 2025, "Accelerating LLM Inference with Lossless Speculative Decoding
Algorithms for Heterogeneous Vocabularies"; vLLM's heterogeneous-vocabulary drafting works the same way):

- a token is the same in both vocabularies when it stands for the same bytes (:func:`token_keys`: byte-level BPE
  symbols such as ``Ġ``/``Ċ`` and SentencePiece's ``▁`` and ``<0x0A>`` are read back to the bytes they encode;
  special tokens match by their text only, and the bos/eos/unk/pad ids of the two tokenizers are paired by role);
- the draft reads the context as the target's tokens, one draft id per target id (:attr:`VocabIntersection.
  draft_input`): the paired draft id, or for a target token outside the intersection the last piece of the draft
  tokenizer's encoding of its text (the draft's unk when it has no encoding). Positions stay one to one, so the
  draft's KV cache rolls back exactly as for a draft of the target's vocabulary;
- the draft proposes only shared tokens: its logits at the N paired columns go to their target ids and every other
  target id gets -inf (:meth:`VocabIntersection.target_logits`), so q is a distribution over the target's ids with
  q = 0 outside the intersection. Verification is the ordinary rule on the target's tokens, and the residual
  ``max(p − q, 0)`` gives every other id exactly its target probability: the output is the target's distribution
  whatever the two tokenizers are. How much the draft helps depends on the intersection (its size and the target
  probability it carries) and on how well the draft reads the target's segmentation; distillation
  (``distill train`` with a draft of another tokenizer) trains it on exactly this view.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Hashable

import torch

from decode.compat import input_vocab_size, output_vocab_size, shares_vocabulary
from decode.vocab_map import scatter_to_vocab

SPECIAL_ROLES = ("bos", "eos", "unk", "pad")
_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet read back: the printable character standing for each of the 256 bytes."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _decoder_kinds(tokenizer: Any) -> set[str]:
    """The types of a fast tokenizer's decoder and its parts (``{"ByteLevel"}``, ``{"Sequence", "Replace",
    "ByteFallback", ...}``); empty when the tokenizer has no backend to read."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if decoder is None:
        return set()
    # the decoder's own JSON (what pickling it stores), not the whole tokenizer's: 1 s for a 262k vocabulary
    kinds, todo = set(), [json.loads(decoder.__getstate__())]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            kinds.add(node.get("type"))
            todo.extend(node.get("decoders") or [])
    return kinds


def token_keys(tokenizer: Any) -> dict[int, Hashable]:
    """id -> what the token stands for, comparable across tokenizers: the bytes it adds to the text, or
    ``("special", text)`` for a special token (which adds no text of its own).

    Byte-level BPE tokens (a ``ByteLevel`` decoder) are read through GPT-2's byte alphabet; otherwise ``<0xNN>``
    byte-fallback tokens are that byte, ``▁`` is a space and the rest is the token's UTF-8 text. A ``<0xNN>`` token
    is that byte in either kind of vocabulary."""
    byte_level = "ByteLevel" in _decoder_kinds(tokenizer)
    alphabet = _byte_decoder()
    special = {str(t) for t in getattr(tokenizer, "all_special_tokens", [])}
    added = {int(i): t for i, t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()}
    keys: dict[int, Hashable] = {}
    for token, i in tokenizer.get_vocab().items():
        if (fallback := _BYTE_FALLBACK.match(token)) is not None:
            keys[i] = bytes([int(fallback.group(1), 16)])
        elif token in special or getattr(added.get(i), "special", False):
            keys[i] = ("special", token)
        elif i in added:  # an added token is matched as the literal text it is
            keys[i] = token.encode()
        elif byte_level and all(c in alphabet for c in token):
            keys[i] = bytes(alphabet[c] for c in token)
        else:
            keys[i] = token.replace("▁", " ").encode()
    return keys


def _role_ids(tokenizer: Any) -> dict[str, int]:
    ids = {role: getattr(tokenizer, f"{role}_token_id", None) for role in SPECIAL_ROLES}
    return {role: i for role, i in ids.items() if isinstance(i, int)}


@dataclass(frozen=True)
class VocabIntersection:
    """The pairing of a draft's vocabulary with its target's (:func:`intersect_vocabularies`).

    Attributes:
        target_ids: ``(N,)`` int64, the shared tokens' target ids, sorted ascending.
        columns: ``(N,)`` int64, the draft logit column (the draft id) that scores each of them.
        draft_input: ``(V_target,)`` int64, the draft id each target id is read as.
        target_size, draft_size: the two vocabularies (ids ``[0, V)`` of each tokenizer the models can use).
    """

    target_ids: torch.Tensor
    columns: torch.Tensor
    draft_input: torch.Tensor
    target_size: int
    draft_size: int

    @property
    def size(self) -> int:
        """N, the number of shared tokens."""
        return int(self.target_ids.numel())

    @property
    def coverage(self) -> float:
        """N / V_target: the share of the target's vocabulary the draft can propose."""
        return self.size / self.target_size

    def to(self, device: Any) -> "VocabIntersection":
        """The same pairing with its tensors on ``device``."""
        move = {name: getattr(self, name).to(device) for name in ("target_ids", "columns", "draft_input")}
        return VocabIntersection(**move, target_size=self.target_size, draft_size=self.draft_size)

    def draft_ids(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Target ids (any shape) as the draft reads them."""
        return self.draft_input.to(target_ids.device)[target_ids]

    def target_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """The draft's ``(..., columns)`` logits as a ``(..., V_target)`` row: the shared tokens' logits at their
        target ids, -inf elsewhere (q = 0 there). Differentiable in ``draft_logits``."""
        device = draft_logits.device
        return scatter_to_vocab(draft_logits, self.target_ids.to(device), self.target_size, self.columns.to(device))

    def summary(self) -> str:
        """One line: how many tokens the vocabularies share."""
        return (f"{self.size:,} tokens shared: {self.coverage:.1%} of the target's {self.target_size:,}, "
                f"{self.size / self.draft_size:.1%} of the draft's {self.draft_size:,}")


def intersect_vocabularies(target_tokenizer: Any, draft_tokenizer: Any, target_size: int | None = None,
                           draft_size: int | None = None) -> VocabIntersection:
    """Pair the tokens two tokenizers share (:func:`token_keys`) and choose how the draft reads every target id.

    Args:
        target_tokenizer, draft_tokenizer: the two tokenizers.
        target_size: ids ``[0, target_size)`` the target uses (default ``len(target_tokenizer)``).
        draft_size: ids ``[0, draft_size)`` the draft can read and score (default ``len(draft_tokenizer)``; the
            decoder passes the smaller of that and the draft's embedding rows).

    Where one vocabulary holds several ids for the same key, the lowest id is paired. Pairs are one to one, so q
    stays a distribution over distinct target ids.
    """
    target_size = len(target_tokenizer) if target_size is None else int(target_size)
    draft_size = len(draft_tokenizer) if draft_size is None else int(draft_size)
    t_keys, d_keys = token_keys(target_tokenizer), token_keys(draft_tokenizer)
    by_key: dict[Hashable, int] = {}
    for i in sorted(d_keys):
        if i < draft_size:
            by_key.setdefault(d_keys[i], i)
    pairs: dict[int, int] = {}  # target id -> draft id
    used: set[int] = set()
    for i in sorted(t_keys):
        j = by_key.get(t_keys[i])
        if i < target_size and j is not None and j not in used:
            pairs[i] = j
            used.add(j)
    t_roles, d_roles = _role_ids(target_tokenizer), _role_ids(draft_tokenizer)
    for role in SPECIAL_ROLES:  # eos is eos, whatever each tokenizer calls it
        i, j = t_roles.get(role), d_roles.get(role)
        if i is not None and j is not None and i < target_size and j < draft_size and i not in pairs and j not in used:
            pairs[i] = j
            used.add(j)
    draft_input = _draft_inputs(target_tokenizer, draft_tokenizer, t_keys, pairs, target_size, draft_size)
    target_ids = sorted(pairs)
    return VocabIntersection(torch.tensor(target_ids, dtype=torch.long),
                             torch.tensor([pairs[i] for i in target_ids], dtype=torch.long), draft_input, target_size,
                             draft_size)


def _draft_inputs(target_tokenizer: Any, draft_tokenizer: Any, t_keys: dict[int, Hashable], pairs: dict[int, int],
                  target_size: int, draft_size: int) -> torch.Tensor:
    """``(target_size,)``: the paired draft id, else the last piece of the draft's encoding of the token's text,
    else the draft's unk (or 0)."""
    unk = getattr(draft_tokenizer, "unk_token_id", None)
    unk = unk if isinstance(unk, int) and 0 <= unk < draft_size else 0
    table = torch.full((target_size,), unk, dtype=torch.long)
    for i, j in pairs.items():
        table[i] = j
    todo = [i for i in range(target_size) if i not in pairs and isinstance(t_keys.get(i), bytes)]
    texts = [t_keys[i].decode("utf-8", errors="ignore") for i in todo]
    encoded = draft_tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    for i, ids in zip(todo, encoded):
        ids = [j for j in ids if 0 <= j < draft_size]
        if ids:
            table[i] = ids[-1]
    return table


def draft_intersection(draft: Any, tokenizer: Any, draft_tokenizer: Any,
                       target_size: int | None = None) -> VocabIntersection | None:
    """The pairing a decoder drafts through when ``draft_tokenizer`` is not the target's ``tokenizer``
    (:func:`decode.compat.shares_vocabulary`), else None. The draft's usable ids are those its tokenizer, input
    embedding and lm_head all have (a vocabulary-pruned draft keeps the target's tokenizer:
    :func:`decode.compat.check_compatibility` refuses it here)."""
    if draft is None or tokenizer is None or draft_tokenizer is None or shares_vocabulary(tokenizer, draft_tokenizer):
        return None
    sizes = [len(draft_tokenizer), input_vocab_size(draft) or len(draft_tokenizer), output_vocab_size(draft)]
    return intersect_vocabularies(tokenizer, draft_tokenizer, target_size, min(sizes))
