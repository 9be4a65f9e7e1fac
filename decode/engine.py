"""The speculative decoding engine: requests join a running batch, and each step is draft γ -> verify -> commit.

Algorithm: Leviathan et al. (2023), Algorithm 1; Chen et al. (2023). The acceptance rule is
:func:`decode.verify.verify`; p and q come from one path, :func:`decode.sampling.probs_from_logits`, applied to
the same prefix (penalty counts at window position i include the window's drafts d_1..d_{i-1}).

Requests (continuous batching). :meth:`SpeculativeDecoder.add_request` queues a prompt with its own sampling
settings and seed; :meth:`SpeculativeDecoder.step` prefills the queued requests, merges them into the running
batch, runs one speculative step for every active row, and returns the requests that finished. Each request
draws its uniforms from its own CPU ``torch.Generator``, and the number of draws per step depends only on its own
γ_r (the configured γ cut to its own token budget and context), so a seeded request's output does not depend on
the rows it shares the batch with. :meth:`SpeculativeDecoder.generate` is a loop over this API.

State between steps (per model, see :mod:`decode.cache` for the layout). Every committed token except the
last one is in both KV caches; the last committed token (``last``) is the next input of the target. The
draft may additionally lack the token before it: when all γ drafts were accepted, the γ-th draft was never fed
to the draft model (and after a step with γ = 0 it lacks that step's token too). Those pending tokens
(``draft_in``, usually 1 or 2) are fed in the first draft forward of the next step, so all-accepted steps bring
the draft's cache up to date without an extra forward.

Batching: each row accepts its own prefix; positions are per row (number of committed tokens before the slot),
finished rows leave the batch, so every row's output is what it would be decoded alone. On the static cache path
(:class:`decode.cache.StaticKV`, the default where the architecture allows it) rejected slots are overwritten or
stay masked until a rare compaction; on the DynamicCache fallback they are compacted away every step.
"""
from __future__ import annotations

import itertools
import numbers
import operator
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import torch

from decode import cache as kv
from decode import kernels
from decode.compat import (check_cache_support, check_causal, check_compatibility, chunk_dependent_rope,
                           draft_input_substitute, substitute_draft_inputs)
from decode.compiling import check_compile, compiled_forward
from decode.lookup import NgramLookup, check_prompt_lookup
from decode.metrics import DecodeStats, peak_memory_bytes
from decode.requests import Request, RequestOutput, check_eos, check_max_new_tokens, check_seed
from decode.sampling import MAX_SEED, BatchSampling, SamplingParams, greedy_ids, probs_from_logits, sample
from decode.speedup import AdaptiveGamma, check_auto_costs, cost_bucket, smooth_verify_costs
from decode.verify import verify, verify_greedy
from decode.vocab_map import draft_vocab_map, scatter_to_vocab


@dataclass
class GenerationOutput:
    """Result of :meth:`SpeculativeDecoder.generate`.

    ``sequences`` and ``new_tokens`` are lists (one per input row, in input order) of 1-D int64 CPU tensors:
    the prompt without padding followed by the new tokens, and the new tokens alone.
    """

    sequences: list[torch.Tensor]
    new_tokens: list[torch.Tensor]
    stats: DecodeStats


@dataclass
class DecodeState:
    """Device-side decoding state of the active rows (exposed for tests and tools)."""

    target_cache: Any
    target_mask: torch.Tensor            # (B, W_t) int64
    draft_cache: Any                     # None when the batch decodes without the draft
    draft_mask: torch.Tensor             # (B, W_d) int64
    last: torch.Tensor                   # (B,) last committed token, not yet in either cache
    draft_in: torch.Tensor               # (B, k) tokens to feed the draft before drafting; last column == last
    draft_in_mask: torch.Tensor          # (B, k) which of draft_in are real
    committed: list[list[int]] = field(default_factory=list)  # per active row: prompt + new tokens
    # Host-side bookkeeping, so cache maintenance needs no device-to-host sync:
    target_len: list[int] = field(default_factory=list)     # valid target-cache slots per row
    draft_len: list[int] = field(default_factory=list)      # valid draft-cache slots per row
    draft_pending: list[int] = field(default_factory=list)  # real tokens in draft_in per row (right-aligned)


class LookupDrafts(NamedTuple):
    """One step's prompt-lookup proposals (:meth:`SpeculativeDecoder._lookup_drafts`)."""

    ids: torch.Tensor  # (B, γ) int64: the proposals (0 where unused)
    use: torch.Tensor  # (B, γ) bool: the draft at this position is the proposal (a prefix of a greedy row's γ_r)
    covered: int       # leading positions where no row needs the draft's guess (a proposal, or past the row's γ_r)


def left_pad(rows: Sequence[Sequence[int]], pad_id: int = 0, device: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ``(B, T)`` int64 ``input_ids`` and ``attention_mask`` for token-id lists (T = longest row),
    the layout the decoder, rollouts and the benchmark use."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(list(r), dtype=torch.long)
        mask[i, width - len(r):] = 1
    return ids.to(device), mask.to(device)


def context_length(model: Any) -> int | None:
    """Max positions of a causal LM from its (text) config; None when the architecture states no limit."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "max_seq_len",
                 "n_ctx"):
        value = getattr(cfg, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


class SpeculativeDecoder:
    """Lossless speculative decoding of ``target`` with proposals from ``draft``, over requests that join and
    leave a running batch between steps.

    Not thread-safe: call every method from one thread (a server runs them on one scheduler thread).

    Args:
        target: a Hugging Face causal LM (``PreTrainedModel``), used frozen.
        draft: a causal LM sharing the target's tokenizer, or ``None`` for plain decoding only.
        num_draft_tokens: γ, tokens drafted per verify step (None: 4 with a draft, 0 without; 0 = plain
            decoding; ``"auto"`` = γ in
            ``[0, max_auto_draft_tokens]`` chosen each step by :class:`decode.speedup.AdaptiveGamma` from the
            acceptance so far and the cost model of the current batch size; deterministic, see ``auto_costs``; in
            :meth:`generate` over several prompts, planned for the batch's last row from each row's own acceptance,
            :meth:`decode.speedup.AdaptiveGamma.plan_batch`, unless ``plan_static_batches`` is set False).
        tokenizer, draft_tokenizer: if given, checked for compatibility and used to set the shared vocabulary
            (see :func:`decode.compat.check_compatibility`); ids beyond it never appear in the output.
        max_auto_draft_tokens: upper bound on γ in ``"auto"`` mode.
        auto_costs: the cost model of ``"auto"``, ``{batch_size: {"cost_ratio": c, "verify": [v_0, .., v_max]}}``
            (batch-size keys may be strings, as after a JSON round trip; a bad entry raises ValueError)
            for batch sizes 1, 2, 4, 8, ... (a batch of B rows uses the entry of the next power of two). Missing
            entries are measured once, at first use, by timed forwards (:func:`decode.costs.measure_cost_ratio`)
            and kept in :attr:`auto_costs`; pass that dict to another decoder to reproduce its γ schedule.
        compile: False (default), True: run both models' draft and verify forwards through
            ``torch.compile(model.forward, dynamic=True)`` (applied from outside, the models are not modified);
            ``"draft"``: the draft's forwards only, the target stays eager (on CPU it keeps the few-row kernels, the
            fastest measured setting there: docs/decode.md, "Compilation"). The first calls compile (tens of seconds
            on CPU, more as new batch sizes appear); shapes that change (cache length, γ, batch size) stay dynamic
            instead of recompiling.
        static_cache: None (default): a preallocated static KV cache (:class:`decode.cache.StaticKV`) for each model
            whose architecture allows it, the DynamicCache path with a one-line warning for the others; False:
            the DynamicCache path for both; True: as None.
        few_row_linear: run the steps and the cost measurement under :func:`decode.kernels.few_row_linear` (the
            linear layers of 1..64-row forwards, i.e. decode and verify forwards, take the faster transposed CPU
            GEMM; same function up to float32 round-off). None (default): on when the target (and the draft, if
            any) has float32 weights on the CPU and the target is not compiled (``compile`` is not True;
            ``"draft"`` keeps them); True/False: force.
        prompt_lookup_ngram: n > 0: greedy requests draft by prompt lookup (:mod:`decode.lookup`) where it has a
            match: while the last n tokens (prompt, output and the step's drafts so far) occurred earlier, a step's
            next draft is the token that followed their most recent occurrence instead of the draft's argmax (the
            draft still reads it). 0 (default): off. Sampled requests always draft from the draft model. Pays where
            the target repeats its context and a small draft fails to copy it (docs/decode.md, "Prompt lookup").

    Raises:
        decode.compat.IncompatibleModelsError: the pair cannot share a vocabulary, or a model keeps state that
            cannot be rolled back (Mamba and other recurrent/hybrid models: :func:`decode.compat.check_cache_support`).
        ValueError: a bad ``num_draft_tokens``, ``compile`` or ``prompt_lookup_ngram``.
    """

    def __init__(self, target: Any, draft: Any = None, num_draft_tokens: int | str | None = None,
                 tokenizer: Any = None, draft_tokenizer: Any = None, max_auto_draft_tokens: int = 8,
                 auto_costs: dict[int, dict] | None = None, compile: bool | str = False,
                 static_cache: bool | None = None, few_row_linear: bool | None = None,
                 prompt_lookup_ngram: int = 0):
        for name, value in (("static_cache", static_cache), ("few_row_linear", few_row_linear)):
            if not (value is None or isinstance(value, bool)):
                raise ValueError(f"{name} must be None (the default choice), True or False, got {value!r}")
        self.target = target
        self.draft = draft
        self.tokenizer = tokenizer
        self.vocab_size = check_compatibility(target, draft, tokenizer, draft_tokenizer or tokenizer)
        for name, model in (("target", target), ("draft", draft)):
            if model is not None:
                check_cache_support(model, name)
                check_causal(model, name)
        if isinstance(max_auto_draft_tokens, bool) or not isinstance(max_auto_draft_tokens, int) \
                or max_auto_draft_tokens < 1:
            raise ValueError(f"max_auto_draft_tokens must be an integer >= 1 (the largest γ of num_draft_tokens="
                             f"'auto'), got {max_auto_draft_tokens!r}")
        self.max_auto_draft_tokens = max_auto_draft_tokens
        self._num_draft_tokens = self._check_gamma((4 if draft is not None else 0) if num_draft_tokens is None
                                                   else num_draft_tokens)
        self.prompt_lookup_ngram = check_prompt_lookup(prompt_lookup_ngram, draft is not None)
        self.context_length = context_length(target)
        self.draft_context_length = context_length(draft) if draft is not None else None
        # (limit, substitute): the draft reads ids >= limit as substitute (see decode.compat); None: it reads all.
        self._draft_input = draft_input_substitute(draft, self.vocab_size, tokenizer) if draft is not None else None
        # A vocabulary-pruned draft's (N,) draft-to-target id map (checked above), None for a full-vocabulary draft.
        self._draft_map = draft_vocab_map(draft) if draft is not None else None
        self.compile = check_compile(compile, draft is not None)
        rope = chunk_dependent_rope(target)
        if rope is not None:
            warnings.warn(f"decode: the target's rope_type {rope[0]!r} picks its rotary frequencies from the largest "
                          f"position in each forward, so past position {rope[1]} its logits depend on how many tokens "
                          "a forward holds and outputs there can differ from one-token-at-a-time decoding (plain "
                          "decoding through this engine too; docs/decode.md, Limits)", stacklevel=2)
        # Per model: use the preallocated static cache (decode.cache.StaticKV) or the DynamicCache path.
        self._static = {}
        self._max_rows = None  # 1 when a model numbers positions by slot: left padding would shift them
        for name, model in (("target", target), ("draft", draft)):
            probe = kv.slot_probe(model) if model is not None else kv.SlotProbe(True, True)
            if not probe.padding_ok:
                why = (f"returns NaN for left-padded rows in {next(model.parameters()).dtype} (transformers' eager "
                       "attention; attn_implementation='sdpa' batches)" if probe.padding_nan else
                       "numbers positions by cache slot (it takes no position ids), so left padding in a shared batch "
                       "would shift them")
                warnings.warn(f"decode: the {name} ({type(model).__name__}) {why}; this decoder runs one request at "
                              "a time", stacklevel=2)
                self._max_rows = 1
            if model is None or static_cache is False:
                self._static[name] = False
                continue
            reason = kv.StaticKV.supported(model, probe)
            if reason is not None:
                warnings.warn(f"decode: the {name} ({type(model).__name__}) cannot use the static KV cache "
                              f"({reason}); using the DynamicCache path", stacklevel=2)
            self._static[name] = reason is None
        # A compiled target loses the kernels (inductor picks its own); a compiled draft keeps the traceable ones.
        self.few_row_linear = (kernels.default_for(target, draft) and self.compile is not True if few_row_linear is None
                               else bool(few_row_linear))
        self._target_call = compiled_forward(target) if self.compile is True else None
        self._draft_call = compiled_forward(draft) if self.compile and draft is not None else None
        self.num_target_forwards = 0  # batched forwards after prefill, over the decoder's life
        self.num_draft_forwards = 0
        self._step_draft_forwards = 0
        self._waiting: list[Request] = []
        self._rows: list[Request] = []  # active requests, in the batch's row order
        self._state: DecodeState | None = None
        self._sampling: BatchSampling | None = None
        self._counts: torch.Tensor | None = None  # (B, V) generated-token counts, when a row has penalties
        self._seen: torch.Tensor | None = None    # (B, V) ids in prompt or generated
        self._use_draft = False
        self._adaptive: AdaptiveGamma | None = None
        self._gamma_override: int | str | None = None
        self._static_batch = False  # True inside generate(): auto γ minimizes the time to the last row's end
        # False: auto γ keeps the pooled choice in generate() too (the planner's A/B baseline, docs/decode.md)
        self.plan_static_batches = True
        self.auto_costs: dict[int, dict] = check_auto_costs(auto_costs)
        self._costs_bucket = None
        self._next_id = 0
        self._ids: set = set()  # ids of queued and active requests
        self._undelivered: list[RequestOutput] = []  # finished in a step whose on_tokens callback raised
        self._in_step = False  # a step is running (its on_tokens callbacks may not step again)

    @property
    def num_draft_tokens(self) -> int | str:
        """γ of the requests :meth:`add_request` queues (``generate(num_draft_tokens=...)`` overrides it per call):
        an int >= 0 (0 = plain decoding) or ``"auto"``. Settable between requests (``dec.num_draft_tokens = 2``);
        raises ValueError for a bad γ (as the constructor does) and RuntimeError while requests are in flight (the
        running batch's caches and γ controller were sized for the old value)."""
        return self._num_draft_tokens

    @num_draft_tokens.setter
    def num_draft_tokens(self, gamma: int | str) -> None:
        gamma = self._check_gamma(gamma)
        if self.has_unfinished():
            raise RuntimeError("num_draft_tokens can change only between requests: step() until has_unfinished() "
                               "is False, or abort() the queued and active ones, first (generate(num_draft_tokens="
                               "...) sets it for one call)")
        self._num_draft_tokens = gamma

    def _check_gamma(self, gamma: int | str) -> int | str:
        if gamma == "auto":
            if self.draft is None:
                raise ValueError("num_draft_tokens='auto' needs a draft model")
            return gamma
        if not isinstance(gamma, int) or isinstance(gamma, bool) or gamma < 0:
            raise ValueError(f"num_draft_tokens must be an integer >= 0 or 'auto', got {gamma!r}")
        if gamma > 0 and self.draft is None:
            raise ValueError(f"num_draft_tokens={gamma} needs a draft model; pass draft=... or use num_draft_tokens=0")
        return gamma

    @property
    def state(self) -> DecodeState | None:
        """The running batch's device state (None when idle); rows follow the order of :attr:`active_ids`."""
        return self._state

    @property
    def active_ids(self) -> list[Any]:
        """Request ids of the active rows, in batch order."""
        return [r.request_id for r in self._rows]

    # ------------------------------------------------------------------ request API
    def add_request(self, prompt_ids: Sequence[int] | torch.Tensor, max_new_tokens: int = 128,
                    temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                    min_p: float | None = None, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                    repetition_penalty: float = 1.0, eos_token_id: int | Sequence[int] | None = None,
                    seed: int | None = None, on_tokens: Callable[[Any, list[int]], Any] | None = None,
                    request_id: str | int | None = None) -> str | int:
        """Queue a request; it joins the running batch (and is prefilled) at the next :meth:`step`.

        Args:
            prompt_ids: ``(T,)`` token ids (list or 1-D tensor), 1 <= T < the target's context.
            max_new_tokens: >= 1; the request also ends when it fills the target's context.
            temperature, top_k, top_p, min_p, presence_penalty, frequency_penalty, repetition_penalty: its
                sampling settings (see :mod:`decode.sampling`; temperature 0 = greedy, penalties as vLLM).
            eos_token_id: its stop id(s); the stop id is kept as the last new token.
            seed: int in [0, 2**63 - 1] seeding the request's own generator; None draws one from torch's
                global generator.
            on_tokens: ``callable(request_id, tokens)``, called inside :meth:`step` with the tokens this request
                committed in that step (after the stop/length trim), once the engine's state is consistent.
            request_id: a str or int not already queued or active; by default ``"req-N"``.

        Returns:
            the request id.

        Raises:
            ValueError: naming the bad argument.
        """
        params = SamplingParams(temperature, top_k, top_p, min_p, presence_penalty, frequency_penalty,
                                repetition_penalty)
        max_new_tokens = check_max_new_tokens(max_new_tokens)
        prompt = self._check_prompt(prompt_ids)
        eos = check_eos(eos_token_id)
        seed = check_seed(seed)
        if on_tokens is not None and not callable(on_tokens):
            raise ValueError(f"on_tokens must be callable or None, got {on_tokens!r}")
        taken = self._ids
        if request_id is None:
            while f"req-{self._next_id}" in taken:
                self._next_id += 1
            request_id = f"req-{self._next_id}"
            self._next_id += 1
        elif isinstance(request_id, bool) or not isinstance(request_id, (str, int)):
            raise ValueError(f"request_id must be a str, an int or None, got {request_id!r}")
        elif request_id in taken:
            raise ValueError(f"request_id {request_id!r} is already queued or active")
        generator = torch.Generator().manual_seed(seed)
        self._waiting.append(Request(request_id, prompt, params, max_new_tokens, eos, generator, on_tokens))
        self._ids.add(request_id)
        return request_id

    def has_unfinished(self) -> bool:
        """True while a request is queued or active (or finished but not yet returned by :meth:`step`)."""
        return bool(self._waiting or self._rows or self._undelivered)

    def num_active(self) -> int:
        """Rows decoding in the running batch (queued requests not counted)."""
        return len(self._rows)

    def abort(self, request_id: Any) -> bool:
        """Drop a queued or active request (its row leaves the batch now, and its ``on_tokens`` is not called
        again, even for tokens of a step whose callbacks are running); False if it is neither."""
        for i, r in enumerate(self._waiting):
            if r.request_id == request_id:
                del self._waiting[i]
                self._ids.discard(request_id)
                return True
        for i, r in enumerate(self._rows):
            if r.request_id == request_id:
                r.aborted = True
                self._drop_rows([j for j in range(len(self._rows)) if j != i])
                self._ids.discard(request_id)
                return True
        return False

    @torch.no_grad()
    def step(self) -> list[RequestOutput]:
        """Admit queued requests, run one draft -> verify -> commit step over all active rows, and return the
        requests that finished in it (in batch order). Returns ``[]`` when there is nothing to do.

        An exception raised by an ``on_tokens`` callback propagates after the step's tokens are committed (the
        remaining callbacks of that step are skipped); the requests that finished in that step are returned by the
        next call, before its own. A callback may add or abort requests but not step: a nested ``step()`` (or
        ``generate()``) raises RuntimeError (it would deliver tokens out of order and return the inner step's
        finished requests to the callback). :class:`NonFiniteLogitsError` (a RuntimeError) when a model's logits
        were NaN/inf at a sampled step (greedy steps take the argmax of whatever the model returned, as Hugging Face's
        greedy decoding does); the step's requests stay in flight until aborted."""
        if self._in_step:
            raise RuntimeError("step() was called while a step is running (from an on_tokens callback?); a "
                               "callback may add_request() or abort(), and the caller's loop runs the next step")
        self._in_step = True
        try:
            return self._step()
        except IndexError as err:  # a NaN-drawn id (= V) reached an embedding before the step's host sync
            if "index out of range in self" not in str(err):  # torch's embedding message, not a list index
                raise
            raise NonFiniteLogitsError(NON_FINITE) from err
        finally:
            self._in_step = False

    def _step(self) -> list[RequestOutput]:
        with kernels.few_row_linear(self.few_row_linear):
            if self._waiting:
                self._admit()
            if not self._rows:
                late, self._undelivered = self._undelivered, []  # finished in a step whose on_tokens raised
                return late
            gammas = self._row_gammas()
            n_acc, new = self._speculative_step(max(gammas), gammas)
        if self._adaptive is not None and max(gammas) > 0:
            self._adaptive.update(sum(gammas), sum(n_acc),
                                  num_rejected=sum(1 for g, n in zip(gammas, n_acc) if 0 < g and n < g),
                                  num_draft_forwards=self._step_draft_forwards, step_gamma=max(gammas))
            for row, g, n in zip(self._rows, gammas, n_acc):
                row.acceptance.update(g, n)
        return self._commit(gammas, n_acc, new)

    # ------------------------------------------------------------------ admission
    def _check_prompt(self, prompt_ids: Any, name: str = "prompt_ids") -> list[int]:
        if isinstance(prompt_ids, torch.Tensor):
            if prompt_ids.dim() != 1:
                raise ValueError(f"{name} must be 1-D, got shape {tuple(prompt_ids.shape)}")
            prompt_ids = prompt_ids.tolist()
        try:
            if isinstance(prompt_ids, (str, bytes)):
                raise TypeError
            prompt_ids = list(prompt_ids)
            if any(isinstance(t, bool) for t in prompt_ids):  # a mask passed as ids?
                raise TypeError
            prompt = [operator.index(t) for t in prompt_ids]  # ints only: a float or a string is not an id
        except TypeError:
            raise ValueError(f"{name} must be a sequence of integer token ids (tokenize text first), got "
                             f"{prompt_ids!r:.80}") from None
        if not prompt:
            raise ValueError(f"{name} has no tokens; give at least one (e.g. the tokenizer's bos token)")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"{name} has ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        if self.context_length is not None and len(prompt) >= self.context_length:
            raise ValueError(
                f"{name} has {len(prompt)} tokens but the target's context is {self.context_length}; "
                "truncate the prompt (keep its last tokens) so at least one new token fits"
            )
        return prompt

    def _gamma_config(self) -> int | str:
        return self.num_draft_tokens if self._gamma_override is None else self._gamma_override

    def _admit(self) -> None:
        room = len(self._waiting) if self._max_rows is None else self._max_rows - len(self._rows)
        if room <= 0:
            return
        new, self._waiting = self._waiting[:room], self._waiting[room:]
        fresh = self._state is None
        if fresh:
            for name, model, harm in (("target", self.target, "the output is not the target's"),
                                      ("draft", self.draft, "its proposals are noisier (still lossless)")):
                if model is not None and model.training:  # dropout, if any, makes every forward random
                    warnings.warn(f"decode: the {name} is in training mode (dropout, if any, is active: {harm}); "
                                  f"call {name}.eval() before decoding", stacklevel=3)
            self._use_draft = self.draft is not None and self._gamma_config() != 0
            self._adaptive = AdaptiveGamma(self.max_auto_draft_tokens) if self._gamma_config() == "auto" else None
            self._costs_bucket = None
        try:
            if fresh:
                state = self.prefill([r.prompt for r in new], use_draft=self._use_draft)
                self._to_static(state)
                self._state = state
            else:
                self._merge(self.prefill([r.prompt for r in new], use_draft=self._use_draft))
        except BaseException:  # (out of memory, Ctrl-C): they wait again, so abort() and generate()'s cleanup see them
            self._waiting = new + self._waiting
            raise
        self._rows += new
        self._rebatch()

    def _room(self) -> int:
        """Columns one step may write into a cache: γ + 1 for the target, up to 2 + γ - 1 for the draft."""
        gamma = self.max_auto_draft_tokens if self._gamma_config() == "auto" else self._gamma_config()
        return int(gamma) + 2

    def _to_static(self, state: DecodeState) -> None:
        """Move a fresh prefill's DynamicCaches into new static caches (for the models on the static path)."""
        device = self.target.device
        for name in ("target", "draft"):
            cache = getattr(state, f"{name}_cache")
            if cache is not None and self._static[name]:
                skv = kv.StaticKV(self.target if name == "target" else self.draft, device)
                skv.merge(cache, getattr(state, f"{name}_mask"), getattr(state, f"{name}_len"), self._room())
                setattr(state, f"{name}_cache", skv)
                setattr(state, f"{name}_mask", None)

    def _merge(self, other: DecodeState) -> None:
        s = self._state
        rows, merged = len(s.committed), []
        try:
            for name in ("target", "draft"):
                self._merge_cache(s, other, name)
                merged.append(name)
        except BaseException:  # (out of memory, Ctrl-C) in the draft's merge: the target's gave back its new rows
            for name in merged:
                self._keep_cache_rows(s, name, list(range(rows)))
            raise
        s.last = torch.cat([s.last, other.last])
        width = max(s.draft_in.shape[1], other.draft_in.shape[1])
        pad = lambda x: torch.cat([x.new_zeros(x.shape[0], width - x.shape[1]), x], dim=1)  # noqa: E731
        s.draft_in = torch.cat([pad(s.draft_in), pad(other.draft_in)])
        s.draft_in_mask = torch.cat([pad(s.draft_in_mask), pad(other.draft_in_mask)])
        for name in ("committed", "target_len", "draft_len", "draft_pending"):
            getattr(s, name).extend(getattr(other, name))

    def _merge_cache(self, s: DecodeState, other: DecodeState, name: str) -> None:
        """Append ``other``'s rows to the ``name`` ("target" or "draft") cache and mask of ``s``."""
        cache = getattr(s, f"{name}_cache")
        if cache is None:  # no draft: its (B, 0) mask placeholder still needs a row per request
            mask, o_mask = getattr(s, f"{name}_mask"), getattr(other, f"{name}_mask")
            if mask is not None and o_mask is not None:
                setattr(s, f"{name}_mask", torch.cat([mask, o_mask]))
            return
        o_cache, o_mask = getattr(other, f"{name}_cache"), getattr(other, f"{name}_mask")
        if isinstance(cache, kv.StaticKV):
            cache.merge(o_cache, o_mask, getattr(other, f"{name}_len"), self._room())
        else:
            setattr(s, f"{name}_mask", kv.concat_rows(cache, getattr(s, f"{name}_mask"), o_cache, o_mask))

    @staticmethod
    def _keep_cache_rows(s: DecodeState, name: str, keep: list[int]) -> None:
        """Keep rows ``keep`` of the ``name`` cache and mask of ``s`` only."""
        cache, mask = getattr(s, f"{name}_cache"), getattr(s, f"{name}_mask")
        idx = torch.tensor(keep, device=s.last.device)
        if isinstance(cache, kv.StaticKV):
            cache.select_rows(keep)
        elif cache is not None:
            kv.select_rows(cache, idx)
        if mask is not None:
            setattr(s, f"{name}_mask", mask.index_select(0, idx))

    def _rebatch(self) -> None:
        """Per-row sampling tensors (and penalty counts) for the current rows."""
        device = self.target.device
        self._sampling = BatchSampling([r.params for r in self._rows], device)
        self._counts = self._seen = None
        if self._sampling.penalized:
            B, V = len(self._rows), self.vocab_size
            counts, seen = torch.zeros(B, V), torch.zeros(B, V, dtype=torch.bool)
            for i, r in enumerate(self._rows):
                if r.new_tokens:
                    counts[i].index_put_((torch.tensor(r.new_tokens),), torch.ones(len(r.new_tokens)), accumulate=True)
                seen[i, torch.tensor(r.prompt + r.new_tokens)] = True
            self._counts, self._seen = counts.to(device), seen.to(device)

    @torch.no_grad()
    def prefill(self, prompts: list[list[int]], use_draft: bool = True) -> DecodeState:
        """Left-pad the prompts and run both models (the target only if ``use_draft`` is false) on all but each
        prompt's last token."""
        device = self.target.device
        B = len(prompts)
        ids, mask = left_pad(prompts, 0, device)
        T = ids.shape[1]
        # Everything but each prompt's last token (the longest prompt fills the width, so no column is all padding).
        pre_ids, pre_mask = ids[:, :-1], mask[:, :-1]
        models = [(self.target, "target")] + ([(self.draft, "draft")] if self.draft is not None and use_draft else [])
        caches, masks = {}, {}
        for model, name in models:
            caches[name] = kv.new_cache(model)
            masks[name] = pre_mask[:, :0]
            if T > 1:
                ctx = self.context_length if name == "target" else self.draft_context_length
                inp = pre_ids if name == "target" else self.draft_input_ids(pre_ids)
                # Prefill runs eager: its shapes vary with every admission (compiling it only adds recompiles).
                _, masks[name] = kv.forward(model, caches[name], masks[name], inp, pre_mask, logits_to_keep=1,
                                            max_position=ctx - 1 if ctx else None)
        last = ids[:, -1]
        draft_in = torch.stack([torch.zeros_like(last), last], dim=-1)
        draft_in_mask = torch.tensor([[0, 1]], device=device).expand(B, 2).clone()
        return DecodeState(
            target_cache=caches["target"], target_mask=masks["target"], draft_cache=caches.get("draft"),
            draft_mask=masks.get("draft", pre_mask[:, :0]), last=last, draft_in=draft_in,
            draft_in_mask=draft_in_mask, committed=[list(p) for p in prompts],
            target_len=[len(p) - 1 for p in prompts], draft_len=[len(p) - 1 for p in prompts], draft_pending=[1] * B,
        )

    # ------------------------------------------------------------------ one step
    def _remaining(self, row: Request, length: int) -> int:
        """Tokens the row may still commit: its budget, and the target's context."""
        left = row.max_new_tokens - len(row.new_tokens)
        return min(left, self.context_length - length) if self.context_length is not None else left

    def _row_gammas(self) -> list[int]:
        """γ_r per row: the configured γ cut so that the row cannot overshoot its budget or either context."""
        cfg = self._gamma_config()
        if cfg == "auto" and self._use_draft:
            self._set_auto_costs()
            if self._static_batch and self.plan_static_batches and len(self._rows) > 1:  # ends with its last row
                self._adaptive.plan_batch([row.acceptance for row in self._rows],
                                          [max(1, self._remaining(row, len(seq)))
                                           for row, seq in zip(self._rows, self._state.committed)])
            gamma = self._adaptive.next_gamma()
        else:
            gamma = cfg if self._use_draft else 0
        out = []
        for row, seq in zip(self._rows, self._state.committed):
            g = min(gamma, self._remaining(row, len(seq)) - 1)
            for ctx in (self.context_length, self.draft_context_length):
                if ctx is not None:  # the models see positions up to len - 1 + γ
                    g = min(g, ctx - len(seq))
            out.append(max(g, 0))
        return out

    def _set_auto_costs(self) -> None:
        """Give the γ controller the cost model of the current batch size (measured once per power of two)."""
        bucket = cost_bucket(len(self._rows))
        if bucket == self._costs_bucket:
            return
        if bucket not in self.auto_costs:
            self.calibrate(self._state.committed[0], [bucket])
        self._adaptive.set_costs(self.auto_costs[bucket]["cost_ratio"], self.auto_costs[bucket]["verify"])
        self._costs_bucket = bucket

    @torch.no_grad()
    def calibrate(self, context_ids: Sequence[int], batch_sizes: Sequence[int] = (1, 2, 4, 8),
                  repeats: int = 5) -> dict[int, dict]:
        """Measure the ``"auto"`` cost model now (else it is measured at first use, inside a step).

        Args:
            context_ids: a real token sequence (repeated or cut to at most 64 tokens); only its length matters.
            batch_sizes: batch sizes to measure; each is rounded up to a power of two.
            repeats: timed forwards per measurement (median).

        The forwards are timed as the steps run them: on each model's cache kind (static or dynamic) and, with
        ``compile``, through the compiled forwards (so a compiled draft's lower c reaches the γ choice; the first
        calibration compiles the one-token shapes, tens of seconds on CPU).

        Returns:
            :attr:`auto_costs`, ``{batch_size: {"cost_ratio": c, "verify": [v_0 = 1, v_1, .., v_max],
            "target_forward_s": t}}``; the measured v_γ are made non-decreasing in γ and >= 1
            (:func:`decode.speedup.smooth_verify_costs`); t (the target's one-token forward, seconds) is kept for
            :func:`decode.speedup.simulate_batch_speedup` and not used by the controller.

        Raises:
            ValueError: no draft, ids of ``context_ids`` outside the vocabulary, or a batch size < 1.
        """
        if self.draft is None:
            raise ValueError("calibrate() measures the draft/target cost model; this decoder has no draft")
        if any(isinstance(b, bool) or not isinstance(b, numbers.Integral) or b < 1 for b in batch_sizes):
            raise ValueError(f"batch_sizes must be integers >= 1, got {list(batch_sizes)!r}")
        width = max(2, min(64, self._shared_context() - self.max_auto_draft_tokens - 2))
        seq = list(context_ids)[-width:]
        seq = self._check_prompt(seq, "context_ids") if seq else [0]
        seq = (seq * (width // len(seq) + 1))[-width:]
        for b in sorted({cost_bucket(b) for b in batch_sizes}):
            context = torch.tensor([seq] * b, device=self.target.device)
            m = self.measure_costs(context, repeats=repeats, verify_gammas=range(1, self.max_auto_draft_tokens + 1))
            self.auto_costs[b] = {"cost_ratio": m["cost_ratio"],
                                  "verify": smooth_verify_costs([v["relative_cost"] for v in m["verify"]]),
                                  "target_forward_s": m["target_forward_s"]}  # for simulate_batch_speedup
        return self.auto_costs

    @torch.no_grad()
    def measure_costs(self, context_ids: torch.Tensor, repeats: int = 21, verify_gammas: Sequence[int] = (),
                      progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
        """:func:`decode.costs.measure_cost_ratio` on this decoder's own forward path: its few-row kernels
        setting, each model's cache kind (static or dynamic) and, with ``compile``, the compiled forwards; ids the
        draft cannot embed are replaced by its substitute id in both models' input (only the shapes matter).

        Args:
            context_ids: ``(B, L)`` LongTensor of target ids on the models' device (B rows: costs at batch size B).
            repeats, verify_gammas, progress: as in :func:`decode.costs.measure_cost_ratio`.

        Returns:
            the dict of :func:`decode.costs.measure_cost_ratio` (seconds; ``cost_ratio`` = c).

        Raises:
            ValueError: this decoder has no draft, or a bad argument (as :func:`decode.costs.measure_cost_ratio`
                raises; ids are checked against the target before the draft's substitution).
        """
        from decode.costs import measure_cost_ratio

        return measure_cost_ratio(self.target, self.draft, self._cost_context(context_ids, "measure_costs"),
                                  repeats=repeats, verify_gammas=verify_gammas, progress=progress,
                                  static_cache=self._static, target_call=self._target_call,
                                  draft_call=self._draft_call, few_row_linear=self.few_row_linear)

    def cost_timer(self, context_ids: torch.Tensor, verify_gammas: Sequence[int] = ()):
        """:meth:`measure_costs` one round at a time: a :class:`decode.costs.CostTimer` on this decoder's forward
        path (call ``round()`` as often as wanted, then ``result()``), e.g. to spread the timing over a benchmark's
        run. Arguments and errors as :meth:`measure_costs`."""
        from decode.costs import CostTimer

        return CostTimer(self.target, self.draft, self._cost_context(context_ids, "cost_timer"), verify_gammas,
                         static_cache=self._static, target_call=self._target_call, draft_call=self._draft_call,
                         few_row_linear=self.few_row_linear)

    def _cost_context(self, context_ids: torch.Tensor, caller: str) -> torch.Tensor:
        """The cost measurement's context as the models read it, checked against the target first (the draft's
        substitution would hide an id too large for it)."""
        from decode.costs import check_context_ids

        if self.draft is None:
            raise ValueError(f"{caller}() times the draft against the target; this decoder has no draft")
        check_context_ids(context_ids, {"target": self.target}, hint=" (calibrate() takes a list of ids)")
        return self.draft_input_ids(context_ids)

    @torch.no_grad()
    def warm_up(self, max_batch_size: int = 16) -> float:
        """Do, before the first request, the one-time work that steps would otherwise do in the middle of serving,
        stalling every running request: compile the compiled forwards' graphs (with ``compile``) and, with
        ``num_draft_tokens="auto"``, measure the cost model of every batch size up to ``max_batch_size``. Returns
        the seconds it took (0 when there is nothing to do).

        A compiled forward (``torch.compile(..., dynamic=True)``) specialises on sizes 0 and 1, on whether an
        attention mask is passed and, through the few-row kernels, on whether rows × new tokens is at most 2. So a
        step's forward falls into one of 12 shape classes per compiled model: 1, 2 or more rows; 1, 2 or more new
        tokens (the draft's pending input is usually 1 or 2 tokens, more after auto γ chose 0; the verify window is
        γ + 1; with prompt lookup the draft's input is 3 or more tokens wherever a step's leading drafts came from
        it); without or with a mask (rows of unequal length). Each class compiles the first time a step meets
        it (seconds to tens of seconds on CPU). This runs each class once: for 1, 2 and 3 rows, a prefill of
        equal-length dummy prompts, then the forward helpers the steps use (:meth:`_draft_forward`,
        :meth:`_verify_forward`) with 1, 2 and 3 new tokens (3 stands for more), first without and then with a
        mask, on a scratch state (the decoder's requests are untouched); with ``max_batch_size=1`` the mask classes
        are left out (one row has no holes: 3 classes per compiled model). Dynamo also keeps a static buffer's length
        static until it sees it change, so one class runs first on a 64-column buffer and then every class on a
        128-column one (72-token prompts; a model whose context is too short for that stays at 64). Auto γ measures
        its cost model once per power-of-two batch size (:func:`decode.speedup.cost_bucket`), here for all of them
        at once (:meth:`calibrate` on a dummy 64-token context) unless ``auto_costs`` were given.
        ``python -m decode serve`` calls it before it listens. Tested: afterwards long prompts, requests joining and
        leaving, ragged, greedy and sampled rows and 1-token prompts compile nothing more
        (tests/decode/test_engine.py); docs/decode.md, "Warm-up before serving".

        Args:
            max_batch_size: the most requests that will run together (the server's ``--max-batch-size``).

        Raises:
            ValueError: ``max_batch_size`` < 1.
        """
        from decode.speedup import cost_buckets

        if not isinstance(max_batch_size, int) or isinstance(max_batch_size, bool) or max_batch_size < 1:
            raise ValueError(f"warm_up(max_batch_size=...) takes an integer >= 1, got {max_batch_size!r}")
        auto = self.draft is not None and self.num_draft_tokens == "auto"
        if not self.compile and not auto:
            return 0.0
        start = time.perf_counter()
        if self.compile:
            # A single row never has holes (they come from rows of unequal length): no mask class at batch 1.
            masks = (False, True) if max_batch_size > 1 else (False,)
            every = list(itertools.product([b for b in (1, 2, 3) if b <= max_batch_size], masks, (1, 2, 3)))
            with kernels.few_row_linear(self.few_row_linear):
                # A static cache's buffer length is a size dynamo keeps static until it sees it change: one class
                # runs first on a 64-column buffer (a short prompt), then every class on a 128-column one.
                if self._shared_context() >= 72 + self._room() + 4:
                    self._run_shape_classes(4, [(1, False, 1)])
                    self._run_shape_classes(72, every)
                else:
                    self._run_shape_classes(4, every)
        missing = [b for b in cost_buckets(max_batch_size) if b not in self.auto_costs] if auto else []
        if missing:
            self.calibrate([i % self.vocab_size for i in range(1, 65)], missing)
        return time.perf_counter() - start

    def _shared_context(self) -> int:
        """The shorter of the two models' contexts (2**30 when neither states one)."""
        return min(c for c in (self.context_length, self.draft_context_length, 1 << 30) if c)

    def _run_shape_classes(self, prompt_length: int, classes: list[tuple[int, bool, int]]) -> None:
        """For :meth:`warm_up`: each ``(rows, holes, k)`` runs the compiled forwards once on a scratch state of
        ``rows`` dummy prompts of ``prompt_length`` ids, with k new tokens and a mask if ``holes``."""
        prompt = [i % self.vocab_size for i in range(1, prompt_length + 1)]
        for batch in sorted({c[0] for c in classes}):
            state = self.prefill([prompt] * batch, use_draft=self._draft_call is not None)
            self._to_static(state)
            for _, holes, k in [c for c in classes if c[0] == batch]:
                ids = state.last[:, None].repeat(1, k)
                if self._draft_call is not None:
                    self._draft_forward(state, ids, torch.ones_like(ids), holes)
                if self._target_call is not None:
                    if holes and isinstance(state.target_cache, kv.StaticKV):
                        state.target_cache.holey = True  # what a ragged batch's roll-back leaves
                    self._verify_forward(state, ids)

    def _draw_uniforms(self, gammas: list[int], gamma: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each sampled row draws 2γ_r + 1 uniforms from its own generator: γ_r for its drafts, γ_r for the
        acceptance tests, one for the residual/bonus token. Greedy rows draw none (their choices are argmaxes).

        Returns ``(draft_u (B, γ), accept_u (B, γ), sample_u (B,))`` on the models' device."""
        buf = torch.zeros(len(gammas), 2 * gamma + 1)
        for i, (row, g) in enumerate(zip(self._rows, gammas)):
            if not row.params.greedy:
                u = torch.rand(2 * g + 1, generator=row.generator)
                buf[i, :g], buf[i, gamma:gamma + g], buf[i, 2 * gamma] = u[:g], u[g:2 * g], u[2 * g]
        buf = buf.to(self.target.device, non_blocking=True)
        return buf[:, :gamma], buf[:, gamma:2 * gamma], buf[:, 2 * gamma]

    def draft_input_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids`` (LongTensor, any shape) as the draft reads them: ids its input embedding lacks replaced by the
        substitute id (:mod:`decode.compat`); ``ids`` itself for a draft that reads every id."""
        return substitute_draft_inputs(ids, self._draft_input)

    def _draft_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The draft's ``(B, 1, N)`` logits as a row over the target's ids: a pruned draft's N logits go to the ids
        of its map and every other id gets -inf, so q = 0 there and the residual max(p − q, 0) gives those ids
        exactly their target probability. A full-vocabulary draft's logits pass through unchanged."""
        if self._draft_map is None:
            return logits
        return scatter_to_vocab(logits, self._draft_map.to(logits.device), self.vocab_size)

    def _lookup_drafts(self, gammas: list[int], gamma: int) -> LookupDrafts | None:
        """Prompt-lookup proposals of the greedy rows (:class:`decode.lookup.NgramLookup`, host-side, from each
        row's committed tokens); None when prompt lookup is off or no row has a match."""
        if not self.prompt_lookup_ngram:
            return None
        chains = []
        for row, seq, g in zip(self._rows, self._state.committed, gammas):
            if row.params.greedy and g > 0:
                if row.lookup is None:
                    row.lookup = NgramLookup(self.prompt_lookup_ngram)
                chains.append(row.lookup.propose(seq, g))
            else:
                chains.append([])
        if not any(chains):
            return None
        covered = min(gamma if len(chain) >= g else len(chain) for chain, g in zip(chains, gammas))
        ids = torch.zeros(len(chains), gamma, dtype=torch.long)
        use = torch.zeros(len(chains), gamma, dtype=torch.bool)
        for i, chain in enumerate(chains):
            ids[i, :len(chain)] = torch.tensor(chain, dtype=torch.long)
            use[i, :len(chain)] = True
        device = self.target.device
        return LookupDrafts(ids.to(device, non_blocking=True), use.to(device, non_blocking=True), covered)

    def _draft(self, state: DecodeState, gamma: int, draft_u: torch.Tensor,
               lookup: LookupDrafts | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft γ tokens per row; returns tokens ``(B, γ)`` and the distributions they were drawn from ``(B, γ, V)``
        (None when every row is greedy: the drafts are argmaxes and :func:`decode.verify.verify_greedy` needs no q).

        ``lookup`` (:meth:`_lookup_drafts`): proposals that replace the draft's where marked (q one-hot on them).
        Its first ``covered`` positions need no guess from the draft, so they run no draft forward: their tokens
        join the next forward's input (one forward of several tokens costs about one of a single token here), and
        when every position is covered one forward feeds them at the end, so the draft's cache holds the same
        tokens as after γ one-token forwards (the roll-back is unchanged)."""
        # Feed the pending tokens, skipping leading columns that no row needs (usually 1 or 2 columns).
        width = max(state.draft_pending)
        inp, inp_mask = state.draft_in[:, -width:], state.draft_in_mask[:, -width:]
        counts, seen = self._counts, self._seen
        tokens, probs = [], []
        if isinstance(state.draft_cache, kv.StaticKV):
            state.draft_cache.ensure_room(width + gamma)
            self._draft_start = state.draft_cache.W
        holes = min(state.draft_pending) < width
        covered = lookup.covered if lookup is not None else 0
        for i in range(gamma):
            if i < covered:  # every row's draft here is its proposal (or unused): no draft forward
                tok = lookup.ids[:, i]
                q = None if self._sampling.all_greedy else \
                    torch.nn.functional.one_hot(tok, self.vocab_size).float()  # as probs_from_logits' rows
            else:
                logits = self._draft_forward(state, inp, inp_mask, holes)
                holes = False
                args = (self._draft_logits(logits[:, -1:]), self._sampling, self.vocab_size,
                        counts[:, None] if counts is not None else None, seen[:, None] if seen is not None else None)
                if self._sampling.all_greedy:  # q is one-hot: keep only its argmax (verify_greedy needs no q)
                    tok, q = greedy_ids(*args)[:, 0], None
                else:
                    q = probs_from_logits(*args)[:, 0]
                    tok = sample(q, u=draft_u[:, i])
                if lookup is not None:  # greedy rows only: their q is one-hot wherever their draft comes from
                    tok = torch.where(lookup.use[:, i], lookup.ids[:, i], tok)
                    if q is not None:
                        hot = torch.nn.functional.one_hot(tok, self.vocab_size).float()
                        q = torch.where(lookup.use[:, i, None], hot, q)
            if q is not None:
                probs.append(q)
            tokens.append(tok)
            if counts is not None and i + 1 < gamma:  # the next position's prefix includes this draft
                counts = counts.scatter_add(-1, tok[:, None], torch.ones_like(counts[:, :1]))
                seen = seen.scatter(-1, tok[:, None], True)
            new, new_mask = tok[:, None], torch.ones_like(tok)[:, None]
            if i < covered:  # not fed yet: it joins the pending input of the next forward
                new, new_mask = torch.cat([inp, new], dim=1), torch.cat([inp_mask, new_mask], dim=1)
            inp, inp_mask = new, new_mask
        if covered == gamma:  # no forward ran: feed what the γ forwards would have (all but the γ-th draft)
            self._draft_forward(state, inp[:, :-1], inp_mask[:, :-1], holes)
        return torch.stack(tokens, dim=1), (torch.stack(probs, dim=1) if probs else None)

    def _draft_forward(self, state: DecodeState, inp: torch.Tensor, inp_mask: torch.Tensor, holes: bool) -> torch.Tensor:
        """One draft forward on ``inp`` ``(B, k)`` (``inp_mask`` ``(B, k)``: 0 for the holes of rows with fewer
        pending tokens; ``holes``: whether it has a 0) appended to the draft's cache; returns logits ``(B, 1, N)``."""
        max_pos = self.draft_context_length - 1 if self.draft_context_length else None
        if isinstance(state.draft_cache, kv.StaticKV):
            return state.draft_cache.forward(self.draft, self.draft_input_ids(inp), inp_mask if holes else None,
                                             logits_to_keep=1, max_position=max_pos, call=self._draft_call,
                                             holes=holes)
        logits, state.draft_mask = kv.forward(self.draft, state.draft_cache, state.draft_mask,
                                              self.draft_input_ids(inp),
                                              inp_mask, logits_to_keep=1, max_position=max_pos,
                                              call=self._draft_call)
        return logits

    def _verify_forward(self, state: DecodeState, target_in: torch.Tensor) -> torch.Tensor:
        """The target's forward on ``target_in`` ``(B, γ+1)`` (the last committed token and the drafts) appended to
        its cache; returns logits ``(B, γ+1, V)``."""
        max_pos = self.context_length - 1 if self.context_length else None
        if isinstance(state.target_cache, kv.StaticKV):
            state.target_cache.ensure_room(target_in.shape[1])
            self._target_start = state.target_cache.W
            return state.target_cache.forward(self.target, target_in, None, max_position=max_pos,
                                              call=self._target_call)
        logits, state.target_mask = kv.forward(self.target, state.target_cache, state.target_mask, target_in,
                                               torch.ones_like(target_in), max_position=max_pos,
                                               call=self._target_call)
        return logits

    def _window_counts(self, drafts: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Penalty counts of the verify window's γ+1 prefixes: ``(B, γ+1, V)``; position j includes d_1..d_j."""
        if self._counts is None:
            return None, None
        added = torch.nn.functional.one_hot(drafts, self.vocab_size).float().cumsum(1)  # (B, γ, V)
        added = torch.cat([torch.zeros_like(added[:, :1]) if added.shape[1] else
                           self._counts.new_zeros(drafts.shape[0], 1, self.vocab_size), added], dim=1)
        return self._counts[:, None] + added, self._seen[:, None] | (added > 0)

    def _speculative_step(self, gamma: int, gammas: list[int]) -> tuple[list[int], list[list[int]]]:
        """Draft -> verify -> roll back, for every active row. Returns ``(n_accepted per row, committed new tokens
        per row before the eos/length trim)``."""
        state = self._state
        B = len(gammas)
        draft_u, accept_u, sample_u = self._draw_uniforms(gammas, gamma)
        if gamma > 0:
            lookup = self._lookup_drafts(gammas, gamma)
            drafts, q = self._draft(state, gamma, draft_u, lookup)
            covered = lookup.covered if lookup is not None else 0
            # the forwards _draft ran: one per position after the covered ones, or one when all were covered
            self._step_draft_forwards = 1 if covered == gamma else gamma - covered
        else:
            self._step_draft_forwards = 0
            drafts = state.last.new_zeros(B, 0)
            q = torch.zeros(B, 0, self.vocab_size, device=state.last.device)
        target_in = torch.cat([state.last[:, None], drafts], dim=1)  # (B, γ+1)
        logits = self._verify_forward(state, target_in)
        counts, seen = self._window_counts(drafts)
        num_draft = None if len(set(gammas)) == 1 else torch.tensor(gammas, device=drafts.device)
        if self._sampling.all_greedy:  # ids only: no (B, γ+1, V) one-hots
            target_ids = greedy_ids(logits, self._sampling, self.vocab_size, counts, seen)
            n_acc, nxt = verify_greedy(target_ids, drafts, num_draft)
        else:
            p = probs_from_logits(logits, self._sampling, self.vocab_size, counts, seen)  # (B, γ+1, V)
            n_acc, nxt = verify(q, p, drafts, accept_u=accept_u, sample_u=sample_u, num_draft=num_draft)
        host = torch.cat([drafts, n_acc[:, None], nxt[:, None]], dim=1).tolist()  # the step's one host sync
        if any(row[gamma + 1] >= self.vocab_size or max(row[:gamma], default=0) >= self.vocab_size for row in host):
            raise NonFiniteLogitsError(NON_FINITE)  # inverse-CDF sampling of NaN probabilities returns id V
        n_list = [row[gamma] for row in host]
        self._roll_back(state, gamma, drafts, n_acc, nxt, n_list)
        self.num_target_forwards += 1
        self.num_draft_forwards += self._step_draft_forwards
        return n_list, [row[:n] + [row[gamma + 1]] for row, n in zip(host, n_list)]

    def _roll_back(self, state: DecodeState, gamma: int, drafts: torch.Tensor, n_acc: torch.Tensor,
                   nxt: torch.Tensor, n_list: list[int]) -> None:
        """Rejected slots leave both caches; the draft's pending input becomes what it has not yet seen."""
        if isinstance(state.target_cache, kv.StaticKV) or isinstance(state.draft_cache, kv.StaticKV):
            return self._roll_back_static(state, gamma, drafts, n_acc, nxt, n_list)
        if gamma > 0:
            pos = torch.arange(gamma, device=drafts.device)
            state.target_mask[:, state.target_mask.shape[1] - gamma:] = (pos < n_acc[:, None]).long()
            fed = gamma - 1  # drafts d1..d_{γ-1} went into the draft cache
            if fed > 0:
                state.draft_mask[:, state.draft_mask.shape[1] - fed:] = (pos[:fed] < n_acc[:, None]).long()
            all_acc = n_acc == gamma
            state.draft_in = torch.stack([torch.where(all_acc, drafts[:, -1], 0), nxt], dim=-1)
            state.draft_in_mask = torch.stack([all_acc.long(), torch.ones_like(n_acc)], dim=-1)
            fed_pending = state.draft_pending
            state.target_len = [t + 1 + n for t, n in zip(state.target_len, n_list)]
            state.draft_len = [d + p + min(n, fed) for d, p, n in zip(state.draft_len, fed_pending, n_list)]
            state.draft_pending = [2 if n == gamma else 1 for n in n_list]
            same = len(set(n_list)) == 1
            t_holes = gamma - n_list[0] if same else None
            d_holes = fed - min(n_list[0], fed) if same and len(set(fed_pending)) == 1 else None
            state.target_mask = kv.compact(state.target_cache, state.target_mask, state.target_len, t_holes)
            state.draft_mask = kv.compact(state.draft_cache, state.draft_mask, state.draft_len, d_holes)
        else:
            # Plain step: the draft did not see this token either; it catches up in its next forward.
            state.draft_in = torch.cat([state.draft_in, nxt[:, None]], dim=-1)
            state.draft_in_mask = torch.cat([state.draft_in_mask, torch.ones_like(nxt)[:, None]], dim=-1)
            state.draft_pending = [p + 1 for p in state.draft_pending]
            state.target_len = [t + 1 for t in state.target_len]
        state.last = nxt

    def _roll_back_static(self, state: DecodeState, gamma: int, drafts: torch.Tensor, n_acc: torch.Tensor,
                          nxt: torch.Tensor, n_list: list[int]) -> None:
        """:meth:`_roll_back` when a cache is static (the other one may be a DynamicCache): no copy, the write
        column moves back to the end of the longest row's kept slots (see :class:`decode.cache.StaticKV`)."""
        t_cache, d_cache = state.target_cache, state.draft_cache
        fed = max(gamma - 1, 0)  # drafts d1..d_{γ-1} went into the draft cache
        pos = torch.arange(gamma, device=drafts.device)
        kept_t = pos < n_acc[:, None]  # (B, γ)
        # target: columns [start, start + γ + 1) hold last, d1..dγ; last and the accepted drafts stay
        new_t_len = [t + 1 + n for t, n in zip(state.target_len, n_list)]
        if isinstance(t_cache, kv.StaticKV):
            start = self._target_start
            t_cache.roll_back(start + 1, kept_t, start + 1 + max(n_list), new_t_len, len(set(n_list)) > 1)
        elif gamma > 0:
            state.target_mask[:, state.target_mask.shape[1] - gamma:] = kept_t.long()
            state.target_mask = kv.compact(t_cache, state.target_mask, new_t_len,
                                           gamma - n_list[0] if len(set(n_list)) == 1 else None)
        state.target_len = new_t_len
        if gamma > 0:
            width = max(state.draft_pending)
            new_d_len = [d + p + min(n, fed) for d, p, n in zip(state.draft_len, state.draft_pending, n_list)]
            if isinstance(d_cache, kv.StaticKV):
                start = self._draft_start + width
                kept = [min(n, fed) for n in n_list]
                d_cache.roll_back(start, kept_t[:, :fed], start + max(kept), new_d_len, len(set(kept)) > 1)
            else:
                if fed > 0:
                    state.draft_mask[:, state.draft_mask.shape[1] - fed:] = kept_t[:, :fed].long()
                same = len(set(n_list)) == 1 and len(set(state.draft_pending)) == 1
                state.draft_mask = kv.compact(d_cache, state.draft_mask, new_d_len,
                                              fed - min(n_list[0], fed) if same else None)
            state.draft_len = new_d_len
            all_acc = n_acc == gamma
            state.draft_in = torch.stack([torch.where(all_acc, drafts[:, -1], 0), nxt], dim=-1)
            state.draft_in_mask = torch.stack([all_acc.long(), torch.ones_like(n_acc)], dim=-1)
            state.draft_pending = [2 if n == gamma else 1 for n in n_list]
        else:
            state.draft_in = torch.cat([state.draft_in, nxt[:, None]], dim=-1)
            state.draft_in_mask = torch.cat([state.draft_in_mask, torch.ones_like(nxt)[:, None]], dim=-1)
            state.draft_pending = [p + 1 for p in state.draft_pending]
        state.last = nxt

    def _trim(self, row: Request, tokens: list[int], length: int) -> tuple[list[int], bool]:
        """Cut a step's tokens at the row's budget/context and after its first stop id; returns (kept, stopped)."""
        tokens = tokens[: self._remaining(row, length)]
        hit = next((j for j, t in enumerate(tokens) if t in row.eos), None)
        return (tokens[: hit + 1], True) if hit is not None else (tokens, False)

    def _commit(self, gammas: list[int], n_acc: list[int], new: list[list[int]]) -> list[RequestOutput]:
        """Append each row's kept tokens, record its stats, retire finished rows, then call ``on_tokens``."""
        state, now = self._state, time.perf_counter()
        finished, keep, calls, count_rows, count_ids = [], [], [], [], []
        for i, (row, g, n, tokens) in enumerate(zip(self._rows, gammas, n_acc, new)):
            tokens, stopped = self._trim(row, tokens, len(state.committed[i]))
            if g > 0:
                row.stats.record_row_step(g, n, len(tokens))
            row.stats.num_target_forwards += 1
            row.stats.num_draft_forwards += min(g, self._step_draft_forwards)
            if not row.new_tokens:
                row.stats.ttft_s = now - row.added_at
                row.stats.num_first_step_tokens = len(tokens)
            state.committed[i].extend(tokens)
            row.new_tokens.extend(tokens)
            calls.append((row, tokens))
            if stopped or self._remaining(row, len(state.committed[i])) <= 0:
                finished.append(row.output("stop" if stopped else "length"))
                self._ids.discard(row.request_id)
            else:
                keep.append(i)
                count_rows += [len(keep) - 1] * len(tokens)
                count_ids += tokens
        if len(keep) < len(self._rows):
            self._drop_rows(keep)
        elif self._counts is not None and count_ids:
            idx = (torch.tensor(count_rows, device=self._counts.device), torch.tensor(count_ids, device=self._counts.device))
            self._counts.index_put_(idx, torch.ones(len(count_ids), device=self._counts.device), accumulate=True)
            self._seen[idx] = True
        # Kept (with those of earlier steps whose callbacks raised) for the next step() if a callback raises below.
        finished = self._undelivered = self._undelivered + finished
        for row, tokens in calls:
            if row.on_tokens is not None and tokens and not row.aborted:  # aborted by an earlier callback
                row.on_tokens(row.request_id, list(tokens))
        self._undelivered = []
        return finished

    def _drop_rows(self, keep: list[int]) -> None:
        """Keep only rows ``keep`` (indices into the batch); the rest leave the caches."""
        if not keep:
            self._state, self._rows, self._sampling, self._counts, self._seen = None, [], None, None, None
            return
        state = self._state
        idx = torch.tensor(keep, device=state.last.device)
        for name in ("last", "draft_in", "draft_in_mask"):
            setattr(state, name, getattr(state, name).index_select(0, idx))
        for name in ("target", "draft"):
            self._keep_cache_rows(state, name, keep)
        self._rows = [self._rows[i] for i in keep]
        for name in ("committed", "target_len", "draft_len", "draft_pending"):
            setattr(state, name, [getattr(state, name)[i] for i in keep])
        # Drop the leading columns that only the removed rows used.
        if state.target_mask is not None and max(state.target_len) < state.target_mask.shape[1]:
            state.target_mask = kv.compact(state.target_cache, state.target_mask, state.target_len)
        if state.draft_mask is not None and state.draft_cache is not None and \
                max(state.draft_len) < state.draft_mask.shape[1]:
            state.draft_mask = kv.compact(state.draft_cache, state.draft_mask, state.draft_len)
        self._rebatch()

    # ------------------------------------------------------------------ generate
    def _pack_prompts(self, input_ids: Any, attention_mask: Any) -> list[list[int]]:
        if not isinstance(input_ids, torch.Tensor) and attention_mask is not None:
            try:  # a list with a mask: the mask must apply to it, so both become (B, T) tensors
                input_ids = torch.as_tensor(input_ids)
            except (TypeError, ValueError, RuntimeError):
                raise ValueError("input_ids given with attention_mask must be a (B, T) or (T,) array of ids "
                                 "(rows of equal length)") from None
        if isinstance(input_ids, torch.Tensor):
            if input_ids.dim() not in (1, 2):
                raise ValueError(f"input_ids must be (B, T) or (T,), got shape {tuple(input_ids.shape)}")
            ids = input_ids if input_ids.dim() == 2 else input_ids.unsqueeze(0)
            if attention_mask is None:
                prompts = ids.tolist()
            else:
                m = torch.as_tensor(attention_mask)
                m = m if m.dim() == 2 else m.unsqueeze(0)
                if not ((m == 0) | (m == 1)).all():
                    raise ValueError("attention_mask must hold only 0 (padding) and 1 (prompt token), got values "
                                     f"{sorted(set(m[(m != 0) & (m != 1)].flatten().tolist()))[:5]}")
                if m.shape != ids.shape:
                    raise ValueError(f"attention_mask shape {tuple(m.shape)} != input_ids shape {tuple(ids.shape)}")
                for i, mask in enumerate(m.cpu().bool()):
                    kept = mask.nonzero().flatten()
                    if len(kept) and int(kept[-1] - kept[0]) + 1 != len(kept):
                        raise ValueError(f"attention_mask row {i} has padding between prompt tokens; a prompt is one "
                                         "run of 1s (padding on the left or the right only)")
                prompts = [row[mask.bool()].tolist() for row, mask in zip(ids.cpu(), m.cpu())]
        elif isinstance(input_ids, (str, bytes)):
            raise ValueError("input_ids must be token ids, not text; tokenize it first (tokenizer(text)['input_ids'])")
        elif isinstance(input_ids, Mapping):
            raise ValueError("input_ids is a mapping (a tokenizer's BatchEncoding?); pass enc['input_ids'] and "
                             "attention_mask=enc['attention_mask']")
        else:
            try:
                rows = list(input_ids)
            except TypeError:
                raise ValueError(f"input_ids must be a (B, T) or (T,) tensor or a list of token-id lists, "
                                 f"got {type(input_ids).__name__}") from None
            # A flat list of ids is one prompt, as a (T,) tensor is.
            prompts = [rows] if rows and all(isinstance(t, numbers.Integral) for t in rows) else rows
        if not prompts:
            raise ValueError("input_ids is empty: give at least one prompt")
        return [self._check_prompt(p, name=f"prompt {i}") for i, p in enumerate(prompts)]

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor | Sequence[Sequence[int]],
        attention_mask: torch.Tensor | None = None,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        generator: torch.Generator | None = None,
        num_draft_tokens: int | str | None = None,
        streamer: Any = None,
        **sampling: Any,
    ) -> GenerationOutput:
        """Generate up to ``max_new_tokens`` tokens per row; output follows the target's distribution exactly.

        A loop over the request API: one request per row, :meth:`step` until all finish. Needs an idle decoder.

        Args:
            input_ids: ``(B, T)`` or ``(T,)`` integer prompts (any padding side, given ``attention_mask``), a list
                of token-id lists, or one flat list of ids (one prompt).
            attention_mask: ``(B, T)`` (tensor or nested list) 1 for prompt tokens, 0 for padding, applied to
                list ``input_ids`` too; None means no padding.
            temperature, top_k, top_p: sampling parameters shared by target and draft; temperature 0 is greedy
                and gives exactly the target's plain greedy output.
            eos_token_id: id or ids that end a row (kept in the output; nothing follows it).
            generator: seeds the rows: row i's seed is the i-th of B draws from it (None: torch's global generator).
            num_draft_tokens: override γ for this call (0 = plain target decoding through the same engine).
            streamer: optional object with ``put(LongTensor)`` / ``end()`` (e.g. ``transformers.TextStreamer``);
                batch size 1 only. Receives the prompt first, then each step's committed tokens.
            **sampling: min_p, presence_penalty, frequency_penalty, repetition_penalty (see :meth:`add_request`).

        Returns:
            :class:`GenerationOutput` with per-row sequences and pooled :class:`DecodeStats`.

        Raises:
            ValueError: bad sampling values, an empty prompt, ids outside the vocabulary, a prompt that does not
                fit in the target's context, or ``max_new_tokens < 1``.
            RuntimeError: requests are in flight (generate owns the whole batch).
        """
        unknown = sorted(set(sampling) - PENALTY_ARGS)
        if unknown:
            raise ValueError(f"generate() got unknown argument(s) {', '.join(unknown)}; the sampling arguments are "
                             f"temperature (0 = greedy; there is no do_sample), top_k, top_p, "
                             f"{', '.join(sorted(PENALTY_ARGS))}")
        SamplingParams(temperature, top_k, top_p, **sampling)  # validate before any work
        if generator is not None and not isinstance(generator, torch.Generator):
            raise ValueError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
        max_new_tokens = check_max_new_tokens(max_new_tokens)
        gamma = self._check_gamma(num_draft_tokens) if num_draft_tokens is not None else None
        prompts = self._pack_prompts(input_ids, attention_mask)
        if streamer is not None and not (callable(getattr(streamer, "put", None))
                                         and callable(getattr(streamer, "end", None))):
            raise ValueError(f"streamer must have put(LongTensor) and end() (e.g. transformers.TextStreamer), got "
                             f"{type(streamer).__name__}")
        if streamer is not None and len(prompts) != 1:
            raise ValueError("streamer needs batch size 1")
        if self.has_unfinished():
            raise RuntimeError("generate() needs an idle decoder; finish or abort the queued requests first")
        if generator is not None:
            seeds = torch.randint(0, MAX_SEED, (len(prompts),), generator=generator, device=generator.device).tolist()
        else:
            seeds = [None] * len(prompts)
        on_tokens = (lambda _rid, tokens: streamer.put(torch.tensor(tokens))) if streamer is not None else None
        start, forwards = time.perf_counter(), (self.num_target_forwards, self.num_draft_forwards)
        outputs: dict[int, RequestOutput] = {}
        first = None
        self._gamma_override, self._static_batch = gamma, True
        try:
            for i, p in enumerate(prompts):
                self.add_request(p, max_new_tokens, temperature, top_k, top_p, eos_token_id=eos_token_id,
                                 seed=seeds[i], on_tokens=on_tokens, request_id=i, **sampling)
            if streamer is not None:
                streamer.put(torch.tensor(prompts[0]))
            with kernels.few_row_linear(self.few_row_linear):  # one block: the packed weights are made once per call
                while self.has_unfinished():
                    outputs.update((o.request_id, o) for o in self.step())
                    first = first or time.perf_counter()
        finally:
            self._gamma_override, self._static_batch = None, False
            self._undelivered = []
            for rid in [r.request_id for r in self._waiting + self._rows]:
                self.abort(rid)
        if streamer is not None:
            streamer.end()
        ordered = [outputs[i] for i in range(len(prompts))]
        stats = DecodeStats.merge([o.stats for o in ordered])
        stats.num_target_forwards = self.num_target_forwards - forwards[0]
        stats.num_draft_forwards = self.num_draft_forwards - forwards[1]
        stats.ttft_s = first - start
        stats.total_s = time.perf_counter() - start
        stats.peak_memory_bytes = peak_memory_bytes(self.target.device)
        new_tokens = [torch.tensor(o.new_tokens, dtype=torch.long) for o in ordered]
        sequences = [torch.tensor(p + o.new_tokens, dtype=torch.long) for p, o in zip(prompts, ordered)]
        return GenerationOutput(sequences=sequences, new_tokens=new_tokens, stats=stats)


class NonFiniteLogitsError(RuntimeError):
    """A model's logits were not finite (NaN or inf) during decoding, so no token could be drawn from them."""


NON_FINITE = ("a model's logits were not finite (NaN or inf) during this step, so the sampled id fell outside the "
              "vocabulary: float16 overflow, NaN weights, or a model/attention implementation that returns NaN for "
              "padded rows in this dtype. Run the models in float32 or bfloat16, check the weights "
              "(torch.isfinite), or try attn_implementation='sdpa'/'eager'")  # (its requests stay: see step())


PENALTY_ARGS = frozenset({"min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"})
