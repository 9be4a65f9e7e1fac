"""The speculative decoding engine: the request API, and the step (draft γ -> verify -> commit) over a running batch.

Algorithm: Leviathan et al. (2023), Algorithm 1; Chen et al. (2023). The acceptance rule is
:func:`decode.verify.verify`; p and q come from one path, :func:`decode.sampling.probs_from_logits`, applied to
the same prefix (penalty counts at window position i include the window's drafts d_1..d_{i-1}).

Requests (continuous batching): :meth:`SpeculativeDecoder.add_request` queues a prompt with its own sampling
settings and seed; :meth:`SpeculativeDecoder.step` admits the queued requests into the running batch
(:mod:`decode.batch`), runs one speculative step for every active row, and returns the requests that finished;
:meth:`SpeculativeDecoder.generate` is a loop over this API. Each row accepts its own prefix at its own positions and
draws its uniforms from its own CPU ``torch.Generator``, as many per step as its own γ_r needs (the configured γ cut
to its budget and context), so a seeded request's output is what it would be decoded alone.

Drafting (:mod:`decode.drafting`: the draft model, and prompt lookup for greedy rows) and the caches, which roll back
their own way (:mod:`decode.cache`), live beside this module.

Imports run one way: :mod:`decode.speedup` <- :mod:`decode.costs` <- this module <- ``decode.bench`` and
``decode.serving``. Auto γ measures its cost model lazily, at first use inside a step
(:func:`decode.costs.calibrate`), so the engine calls costs, and costs never imports the engine.
"""
from __future__ import annotations

import time
import warnings
from typing import Any, Callable, Sequence

import torch

from decode import batch
from decode import cache as kv
from decode import costs
from decode import kernels
from decode import profile as profiling
from decode.batch import DecodeState, RunningBatch, left_pad
from decode.cache import context_length
from decode.compat import (check_argument_types, check_decodable, draft_input_substitute, substitute_draft_inputs,
                           warn_chunk_dependent_rope)
from decode.compiling import check_compile, compiled_forward
from decode.cross_vocab import draft_intersection
from decode.drafting import draft_tokens
from decode.lookup import chain_tokens, check_prompt_lookup, lookup_chains, lookup_drafts
from decode.metrics import DecodeStats, peak_memory_bytes
from decode.requests import (GenerationOutput, Request, RequestIds, RequestOutput, check_eos, check_max_new_tokens,
                             check_num_draft_tokens, check_prompt, check_sampling_args, check_seed, check_streamer,
                             generation_output, pack_prompts, row_gammas, row_seeds)
from decode.sampling import (NON_FINITE, NonFiniteLogitsError, SamplingParams, draw_uniforms, greedy_ids,
                             probs_from_logits, window_counts)
from decode.speedup import AdaptiveGamma, check_auto_costs, check_max_auto_draft_tokens, cost_bucket
from decode.verify import verify, verify_greedy
from decode.vocab_map import draft_vocab_map


class SpeculativeDecoder:
    """Lossless speculative decoding of ``target`` with proposals from ``draft``, over requests that join and
    leave a running batch between steps.

    Not thread-safe: call every method from one thread (a server runs them on one scheduler thread).

    Args:
        target: a Hugging Face causal LM (``PreTrainedModel``), used frozen.
        draft: a causal LM sharing the target's tokenizer, or ``None``: plain decoding, or prompt lookup alone.
        num_draft_tokens: γ, tokens drafted per verify step (None: 4 with a draft or prompt lookup, 0 without; 0 =
            plain decoding;
            ``"auto"``: γ in ``[0, max_auto_draft_tokens]`` chosen each step by
            :class:`decode.speedup.AdaptiveGamma` from the acceptance so far and the cost model of the batch size,
            deterministically given ``auto_costs``; in :meth:`generate` over several prompts it plans for the
            batch's last row, :meth:`decode.speedup.AdaptiveGamma.plan_batch`, unless ``plan_static_batches`` is
            set False).
        tokenizer, draft_tokenizer: if given, checked for compatibility and used to set the shared vocabulary
            (see :func:`decode.compat.check_compatibility`); ids beyond it never appear in the output. A
            ``draft_tokenizer`` of another vocabulary than ``tokenizer`` (needs both) makes the draft read the
            target's tokens mapped into its vocabulary and propose the tokens both share
            (:mod:`decode.cross_vocab`, :attr:`intersection`); the output stays the target's.
        max_auto_draft_tokens: upper bound on γ in ``"auto"`` mode.
        auto_costs: the cost model of ``"auto"``, ``{batch_size: {"cost_ratio": c, "verify": [v_0, .., v_max]}}``
            for batch sizes 1, 2, 4, 8, ... (B rows use the next power of two; keys may be strings, as after a JSON
            round trip; a bad entry raises ValueError). Missing entries are measured once, at first use
            (:func:`decode.costs.calibrate`), and kept in :attr:`auto_costs`, which reproduces the γ schedule.
        compile: False (default); True: both models' forwards run through ``torch.compile(model.forward,
            dynamic=True)``, applied from outside; ``"draft"``: the draft's only (on CPU the eager target keeps the
            few-row kernels: docs/decode.md, "Compilation"). The first calls compile (tens of seconds on CPU).
        static_cache: None or True (default None): a preallocated :class:`decode.cache.StaticKV` for each model
            whose architecture allows it, the DynamicCache path with a one-line warning for the others; False: the
            DynamicCache path for both.
        few_row_linear: run the steps and the cost measurement under :func:`decode.kernels.few_row_linear` (the
            faster transposed CPU GEMM for 1..64-row linear layers; same function up to float32 round-off). None
            (default): on for float32 CPU models unless ``compile`` is True; True/False: force.
        prompt_lookup_ngram: n > 0: a greedy request's next draft is, while its last n tokens (prompt, output and
            the step's drafts) occurred earlier, the token that followed their most recent occurrence
            (:mod:`decode.lookup`) instead of the draft's argmax; sampled requests always draft from the draft
            model. Without a draft model, a greedy row drafts the lookup's chain (up to γ tokens) where its last n
            tokens occurred earlier and nothing otherwise, and a sampled row takes plain steps. 0 (default): off
            (docs/decode.md, "Prompt lookup").

    Raises:
        decode.compat.IncompatibleModelsError: the pair cannot share a vocabulary, or a model keeps state that
            cannot be rolled back (Mamba and other recurrent/hybrid models: :func:`decode.compat.check_cache_support`).
        ValueError: a bad ``num_draft_tokens`` (γ > 0 needs a draft or prompt lookup, ``"auto"`` a draft),
            ``compile`` or ``prompt_lookup_ngram``.
    """

    def __init__(self, target: Any, draft: Any = None, num_draft_tokens: int | str | None = None,
                 tokenizer: Any = None, draft_tokenizer: Any = None, max_auto_draft_tokens: int = 8,
                 auto_costs: dict[int, dict] | None = None, compile: bool | str = False,
                 static_cache: bool | None = None, few_row_linear: bool | None = None,
                 prompt_lookup_ngram: int = 0):
        for name, value in (("static_cache", static_cache), ("few_row_linear", few_row_linear)):
            if not (value is None or isinstance(value, bool)):
                raise ValueError(f"{name} must be None (the default choice), True or False, got {value!r}")
        self.target, self.draft, self.tokenizer = target, draft, tokenizer
        check_argument_types(target, draft, tokenizer, draft_tokenizer)  # before any tokenizer is read
        if draft_tokenizer is not None and tokenizer is None:
            raise ValueError("draft_tokenizer= needs tokenizer= (the target's tokenizer) too: without it the decoder "
                             "cannot tell whether the draft's vocabulary is the target's. Pass both")
        # A draft with a tokenizer of its own drafts through the tokens both vocabularies share (decode.cross_vocab;
        # None: one vocabulary). Its target side is len(tokenizer), the vocabulary check_decodable returns for it.
        self.intersection = draft_intersection(draft, tokenizer, draft_tokenizer)
        cross = self.intersection is not None
        self.vocab_size = check_decodable(target, draft, tokenizer, draft_tokenizer, cross_vocab=cross)
        if cross:
            warnings.warn(f"decode: the draft's tokenizer differs from the target's; it drafts through the "
                          f"{self.intersection.summary()} (docs/decode.md, \"Drafts with their own tokenizer\")",
                          stacklevel=2)
        self.max_auto_draft_tokens = check_max_auto_draft_tokens(max_auto_draft_tokens)
        self.prompt_lookup_ngram = check_prompt_lookup(prompt_lookup_ngram)
        drafts = draft is not None or self.prompt_lookup_ngram > 0
        self._num_draft_tokens = self._check_gamma((4 if drafts else 0) if num_draft_tokens is None
                                                   else num_draft_tokens)
        self.context_length = context_length(target)
        self.draft_context_length = context_length(draft) if draft is not None else None
        # (limit, substitute): the draft reads ids >= limit as substitute (see decode.compat); None: it reads all.
        self._draft_input = (draft_input_substitute(draft, self.vocab_size, tokenizer)
                             if draft is not None and not cross else None)
        # A vocabulary-pruned draft's (N,) draft-to-target id map (checked above), None for a full-vocabulary draft;
        # for a draft of another vocabulary, the shared tokens' target ids and the draft's logit columns of them.
        self._draft_map = draft_vocab_map(draft) if draft is not None else None
        self._draft_columns = None
        if self.intersection is not None:
            device = next(draft.parameters()).device
            self.intersection = self.intersection.to(device)
            self._draft_map, self._draft_columns = self.intersection.target_ids, self.intersection.columns
        self.compile = check_compile(compile, draft is not None)
        warn_chunk_dependent_rope(target)
        # Per model: the preallocated static cache (decode.cache.StaticKV) or the DynamicCache path.
        self.static_cache, self._max_rows = kv.cache_kinds(target, draft, static_cache)
        # A compiled target loses the kernels (inductor picks its own); a compiled draft keeps the traceable ones.
        self.few_row_linear = (kernels.default_for(target, draft) and self.compile is not True if few_row_linear is None
                               else bool(few_row_linear))
        self.target_call = compiled_forward(target) if self.compile is True else None
        self.draft_call = compiled_forward(draft) if self.compile and draft is not None else None
        self.auto_costs: dict[int, dict] = check_auto_costs(auto_costs)
        # False: auto γ keeps the pooled choice in generate() too (the planner's A/B baseline, docs/decode.md)
        self.plan_static_batches = True
        self.num_target_forwards = 0  # batched forwards after prefill, over the decoder's life
        self.num_draft_forwards = 0
        self.draft_prefill_s = 0.0  # seconds of the draft's prefills, over the decoder's life
        # Requests: none queued or running yet.
        self._step_draft_forwards = 0
        self._waiting: list[Request] = []
        self._batch = RunningBatch(self.vocab_size)
        self._use_draft = False
        self._lookup_alone = False  # drafts come from prompt lookup only (no draft model)
        self._adaptive: AdaptiveGamma | None = None
        self._gamma_override: int | str | None = None
        self._static_batch = False  # True inside generate(): auto γ minimizes the time to the last row's end
        self._costs_bucket = None
        self._ids = RequestIds()
        self._undelivered: list[RequestOutput] = []  # finished in a step whose on_tokens callback raised
        self._joining: list[Request] = []  # being admitted: their first token is out, the draft's prefill is not
        self.profile: profiling.StepProfile | None = None  # attach one to time each step's parts (decode.profile)
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

    def _check_gamma(self, gamma: Any) -> int | str:
        """γ checked: γ > 0 needs a draft model or prompt lookup, ``"auto"`` a draft model (its cost model)."""
        if gamma == "auto" or self.draft is not None:
            return check_num_draft_tokens(gamma, self.draft is not None)
        return check_num_draft_tokens(gamma, self.prompt_lookup_ngram > 0)

    @property
    def state(self) -> DecodeState | None:
        """The running batch's device state (None when idle); rows follow the order of :attr:`active_ids`."""
        return self._batch.state

    @property
    def active_ids(self) -> list[Any]:
        """Request ids of the active rows, in batch order."""
        return [r.request_id for r in self._batch.rows]

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
        prompt = check_prompt(prompt_ids, self.vocab_size, self.context_length)
        eos = check_eos(eos_token_id)
        seed = check_seed(seed)
        if on_tokens is not None and not callable(on_tokens):
            raise ValueError(f"on_tokens must be callable or None, got {on_tokens!r}")
        request_id = self._ids.claim(request_id)
        generator = torch.Generator().manual_seed(seed)
        self._waiting.append(Request(request_id, prompt, params, max_new_tokens, eos, generator, on_tokens))
        return request_id

    def has_unfinished(self) -> bool:
        """True while a request is queued or active (or finished but not yet returned by :meth:`step`)."""
        return bool(self._waiting or self._joining or self._batch.rows or self._undelivered)

    def num_active(self) -> int:
        """Rows decoding in the running batch (queued requests not counted)."""
        return len(self._batch.rows)

    def abort(self, request_id: Any) -> bool:
        """Drop a queued or active request (its row leaves the batch now, and its ``on_tokens`` is not called
        again, even for tokens of a step whose callbacks are running); False if it is neither."""
        for i, r in enumerate(self._waiting):
            if r.request_id == request_id:
                del self._waiting[i]
                self._ids.discard(request_id)
                return True
        for r in self._joining:
            if r.request_id == request_id:
                r.aborted = True
                self._joining.remove(r)
                self._ids.discard(request_id)
                return True
        for i, r in enumerate(self._batch.rows):
            if r.request_id == request_id:
                r.aborted = True
                self._batch.keep([j for j in range(len(self._batch.rows)) if j != i])
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
            with profiling.step(self.profile):
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
            if not self._batch.rows:
                late, self._undelivered = self._undelivered, []  # finished in a step whose on_tokens raised
                return late
            gammas = self._row_gammas()
            chains = None
            if self._lookup_alone and max(gammas) > 0:  # a row drafts its lookup chain, or nothing (a plain step)
                chains = lookup_chains(self._batch.rows, self._batch.state.committed, gammas, self.prompt_lookup_ngram)
                gammas = [len(c) for c in chains]
            n_acc, new = self._speculative_step(max(gammas), gammas, chains)
        if self._adaptive is not None and max(gammas) > 0:
            self._adaptive.update(sum(gammas), sum(n_acc),
                                  num_rejected=sum(1 for g, n in zip(gammas, n_acc) if 0 < g and n < g),
                                  num_draft_forwards=self._step_draft_forwards, step_gamma=max(gammas))
            for row, g, n in zip(self._batch.rows, gammas, n_acc):
                row.acceptance.update(g, n)
        return self._commit(gammas, n_acc, new)

    # ------------------------------------------------------------------ admission
    def _gamma_config(self) -> int | str:
        return self.num_draft_tokens if self._gamma_override is None else self._gamma_override

    def _admit(self) -> None:
        """Queued requests join the running batch (as many as it has room for), each with its first token out
        before the draft's prefill runs (:meth:`_join`). An ``on_tokens`` callback's exception propagates once the
        rows have joined; a failure of the admission itself (out of memory, Ctrl-C) queues the rows still joining
        again (a row that has its first token prefills it with its prompt when it is admitted again)."""
        room = len(self._waiting) if self._max_rows is None else self._max_rows - len(self._batch.rows)
        if room <= 0:
            return
        new, self._waiting = self._waiting[:room], self._waiting[room:]
        if self._batch.state is None:
            self._start_batch()
        self._joining = list(new)
        try:
            with profiling.part(self.profile, "admission"):
                error = self._join(new, fresh=self._batch.state is None)
        except BaseException:  # so abort() and generate()'s cleanup see them
            self._waiting = self._joining + self._waiting
            raise
        finally:
            self._joining = []
        if error is not None:
            raise error

    def _join(self, new: list[Request], fresh: bool) -> BaseException | None:
        """The target's prefill of each row's context (prompt and any tokens it has), its next token committed and
        delivered (:meth:`_first_tokens`), then the draft's prefill of the rows still joining (the same context: the
        new token is its one pending input, so its first forward reads one token), which join the batch.
        Returns the first exception an ``on_tokens`` callback raised (None if none did)."""
        contexts = [r.prompt + r.new_tokens for r in new]
        ids, mask = left_pad(contexts, 0, self.target.device)
        with profiling.part(self.profile, "prefill_target"):
            target, logits = batch.prefill_cache(self.target, ids, mask, [len(c) for c in contexts],
                                                 self.context_length)
        with profiling.part(self.profile, "first_token"):
            firsts, error = self._first_tokens(new, contexts, logits)
        keep = [i for i, r in enumerate(new) if r in self._joining]  # not finished, not aborted by a callback
        if not keep:
            return error
        if len(keep) < len(new):
            target.select_rows(keep)
            ids, mask = ids[keep], mask[keep]
        contexts = [contexts[i] + [firsts[i]] for i in keep]
        draft = None
        if self._use_draft:
            start = time.perf_counter()
            with profiling.part(self.profile, "prefill_draft"):
                draft, _ = batch.prefill_cache(self.draft, self.draft_input_ids(ids), mask,
                                               [len(c) - 1 for c in contexts], self.draft_context_length)
                profiling.sync(ids.device)
            elapsed = time.perf_counter() - start
            self.draft_prefill_s += elapsed
            for i in keep:
                new[i].stats.draft_prefill_s += elapsed
        if fresh and self.static_cache["target"]:
            target = batch.to_static(target, self.target, ids.device, self.room())
        if fresh and draft is not None and self.static_cache["draft"]:
            draft = batch.to_static(draft, self.draft, ids.device, self.room())
        pending = torch.tensor([[c[-1]] for c in contexts], device=ids.device)  # the first token, which neither read
        self._batch.add([new[i] for i in keep], batch.new_state(target, draft, contexts, pending), self.room())
        return error

    def _first_tokens(self, new: list[Request], contexts: list[list[int]],
                      logits: torch.Tensor) -> tuple[list[int], BaseException | None]:
        """Draw each joining row's next token from the target's prefill ``logits`` (:func:`decode.batch.first_tokens`),
        commit it (a row that stops or fills its budget here finishes: it is returned by this step) and call
        ``on_tokens``, before any draft work. Returns the tokens and the first exception a callback raised."""
        firsts = batch.first_tokens(logits, new, self.vocab_size)
        if max(firsts) >= self.vocab_size:
            raise NonFiniteLogitsError(NON_FINITE)
        now, error = time.perf_counter(), None
        for row, context, token in zip(new, contexts, firsts):
            tokens, stopped = row.trim([token], row.remaining(len(context), self.context_length))
            row.commit_prefill(tokens, now)
            if stopped or row.remaining(len(context) + len(tokens), self.context_length) <= 0:
                self._joining.remove(row)
                self._ids.discard(row.request_id)
                self._undelivered.append(row.output("stop" if stopped else "length"))
        for row in new:
            if row.on_tokens is not None and not row.aborted and error is None:
                try:
                    row.on_tokens(row.request_id, list(row.new_tokens[-1:]))
                except Exception as err:  # noqa: BLE001 - raised once the rows have joined
                    error = err
        return firsts, error

    def _start_batch(self) -> None:
        """A new running batch: warn about a model in training mode, choose whether it drafts and its γ control."""
        for name, model, harm in (("target", self.target, "the output is not the target's"),
                                  ("draft", self.draft, "its proposals are noisier (still lossless)")):
            if model is not None and model.training:  # dropout, if any, makes every forward random
                warnings.warn(f"decode: the {name} is in training mode (dropout, if any, is active: {harm}); "
                              f"call {name}.eval() before decoding", stacklevel=4)
        self._use_draft = self.draft is not None and self._gamma_config() != 0
        self._lookup_alone = self.draft is None and self.prompt_lookup_ngram > 0 and self._gamma_config() != 0
        self._adaptive = AdaptiveGamma(self.max_auto_draft_tokens) if self._gamma_config() == "auto" else None
        self._costs_bucket = None

    def room(self) -> int:
        """Columns one step may write into a cache: γ + 1 for the target, up to 2 + γ - 1 for the draft."""
        gamma = self.max_auto_draft_tokens if self._gamma_config() == "auto" else self._gamma_config()
        return int(gamma) + 2

    @torch.no_grad()
    def prefill(self, prompts: list[list[int]], use_draft: bool = True, static: bool = True) -> DecodeState:
        """A state whose rows have ``prompts`` and no new token yet: both models (the target only if ``use_draft``
        is false) run on all but each prompt's last token, which is the target's next input and the draft's pending
        one. ``static``: a model on the static path gets its cache as a new :class:`decode.cache.StaticKV` (a fresh
        batch); else both stay :class:`decode.cache.DynamicKV`. (Requests join through :meth:`step`, which has the
        target read the whole prompt and commits its next token before the draft's prefill.)"""
        device = self.target.device
        ids, mask = left_pad(prompts, 0, device)
        lens = [len(p) - 1 for p in prompts]
        target, _ = batch.prefill_cache(self.target, ids[:, :-1], mask[:, :-1], lens, self.context_length)
        draft = (batch.prefill_cache(self.draft, self.draft_input_ids(ids[:, :-1]), mask[:, :-1], lens,
                                     self.draft_context_length)[0] if self.draft is not None and use_draft else None)
        if static and self.static_cache["target"]:
            target = batch.to_static(target, self.target, device, self.room())
        if static and draft is not None and self.static_cache["draft"]:
            draft = batch.to_static(draft, self.draft, device, self.room())
        return batch.new_state(target, draft, prompts, ids[:, -1:])

    # ------------------------------------------------------------------ one step
    def _row_gammas(self) -> list[int]:
        """γ_r per row: the configured γ cut so that the row cannot overshoot its budget or either context."""
        cfg = self._gamma_config()
        if cfg == "auto" and self._use_draft:
            self._set_auto_costs()
            rows = self._batch.rows
            if self._static_batch and self.plan_static_batches and len(rows) > 1:  # ends with its last row
                self._adaptive.plan_batch([row.acceptance for row in rows],
                                          [max(1, row.remaining(len(seq), self.context_length))
                                           for row, seq in zip(rows, self._batch.state.committed)])
            gamma = self._adaptive.next_gamma()
        else:
            gamma = cfg if self._use_draft or self._lookup_alone else 0
        return row_gammas(gamma, self._batch.rows, self._batch.state.committed, self.context_length,
                          self.draft_context_length)

    def _set_auto_costs(self) -> None:
        """Give the γ controller the cost model of the current batch size (measured once per power of two)."""
        bucket = cost_bucket(len(self._batch.rows))
        if bucket == self._costs_bucket:
            return
        if bucket not in self.auto_costs:
            costs.calibrate(self, self._batch.state.committed[0], [bucket])
        entry = self.auto_costs[bucket]
        self._adaptive.set_costs(entry["cost_ratio"], entry["verify"], entry.get("catchup_cost_ratio"))
        self._costs_bucket = bucket

    def draft_input_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids`` (LongTensor, any shape) as the draft reads them: ids its input embedding lacks replaced by the
        substitute id (:mod:`decode.compat`); ``ids`` itself for a draft that reads every id."""
        if self.intersection is not None:
            return self.intersection.draft_ids(ids)
        return substitute_draft_inputs(ids, self._draft_input)

    def _draft(self, state: DecodeState, gammas: list[int], gamma: int, draft_u: torch.Tensor,
               chains: list[list[int]] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft γ tokens per row (:func:`decode.drafting.draft_tokens`: prompt lookup's proposals beside the draft
        model's guesses; ``chains``: prompt lookup alone, :func:`decode.lookup.chain_tokens`). Returns tokens
        ``(B, γ)`` and q ``(B, γ, V)`` (None when every row is greedy)."""
        if gamma == 0 or chains is not None:
            self._step_draft_forwards = 0
            if gamma > 0:
                return chain_tokens(chains, self.vocab_size, not self._batch.sampling.all_greedy, state.last.device)
            return state.last.new_zeros(len(gammas), 0), torch.zeros(len(gammas), 0, self.vocab_size,
                                                                     device=state.last.device)
        lookup = (lookup_drafts(self._batch.rows, state.committed, gammas, gamma, self.prompt_lookup_ngram,
                                self.target.device) if self.prompt_lookup_ngram else None)
        drafts, q, self._step_draft_forwards = draft_tokens(
            state, gamma, lookup, self.draft_forward, self._batch.sampling, self.vocab_size, self._draft_map,
            self._batch.counts, self._batch.seen, draft_u, self._draft_columns)
        return drafts, q

    def draft_forward(self, state: DecodeState, inp: torch.Tensor, inp_mask: torch.Tensor, holes: bool) -> torch.Tensor:
        """One draft forward on ``inp`` ``(B, k)`` (``inp_mask`` ``(B, k)``: 0 for the holes of rows with fewer
        pending tokens; ``holes``: whether it has a 0) appended to the draft's cache; returns logits ``(B, 1, N)``."""
        max_pos = self.draft_context_length - 1 if self.draft_context_length else None
        with profiling.part(self.profile, "draft_forward"):
            return state.draft_cache.forward(self.draft, self.draft_input_ids(inp), inp_mask if holes else None,
                                             logits_to_keep=1, max_position=max_pos, call=self.draft_call,
                                             holes=holes)

    def verify_forward(self, state: DecodeState, target_in: torch.Tensor) -> torch.Tensor:
        """The target's forward on ``target_in`` ``(B, γ+1)`` (the last committed token and the drafts) appended to
        its cache; returns logits ``(B, γ+1, V)``."""
        max_pos = self.context_length - 1 if self.context_length else None
        with profiling.part(self.profile, "verify_forward"):
            return state.target_cache.forward(self.target, target_in, None, max_position=max_pos,
                                              call=self.target_call)

    def _speculative_step(self, gamma: int, gammas: list[int],
                          chains: list[list[int]] | None = None) -> tuple[list[int], list[list[int]]]:
        """Draft -> verify -> roll back, for every active row (``chains``: the rows' drafts when prompt lookup
        drafts alone). Returns ``(n_accepted per row, committed new tokens per row before the eos/length trim)``."""
        state = self._batch.state
        draft_u, accept_u, sample_u = draw_uniforms(self._batch.rows, gammas, gamma, self.target.device)
        with profiling.part(self.profile, "drafting"):
            drafts, q = self._draft(state, gammas, gamma, draft_u, chains)  # (B, γ), (B, γ, V) or None
        logits = self.verify_forward(state, torch.cat([state.last[:, None], drafts], dim=1))  # (B, γ+1, V)
        with profiling.part(self.profile, "verify_math"):
            n_acc, nxt = self._accept(logits, drafts, q, gammas, accept_u, sample_u)
        with profiling.part(self.profile, "host_sync"):
            host = torch.cat([drafts, n_acc[:, None], nxt[:, None]], dim=1).tolist()  # the step's one host sync
        if any(row[gamma + 1] >= self.vocab_size or max(row[:gamma], default=0) >= self.vocab_size for row in host):
            raise NonFiniteLogitsError(NON_FINITE)  # inverse-CDF sampling of NaN probabilities returns id V
        n_list = [row[gamma] for row in host]
        with profiling.part(self.profile, "roll_back"):
            if state.draft_cache is None and gamma > 0:  # prompt lookup alone: the target's cache is the only one
                kept = torch.arange(gamma, device=drafts.device) < n_acc[:, None]
                cache = state.target_cache
                cache.roll_back(kept, n_list, [t + 1 + n for t, n in zip(cache.lens, n_list)])
                state.last = nxt
            else:
                batch.roll_back(state, gamma, drafts, n_acc, nxt, n_list)
        self.num_target_forwards += 1
        self.num_draft_forwards += self._step_draft_forwards
        return n_list, [row[:n] + [row[gamma + 1]] for row, n in zip(host, n_list)]

    def _accept(self, logits: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor | None, gammas: list[int],
                accept_u: torch.Tensor, sample_u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The verify math over the target's ``logits`` ``(B, γ+1, V)``: accepted drafts per row ``(B,)`` and the next
        token ``(B,)`` (:func:`decode.verify.verify_greedy` on ids when every row is greedy, else
        :func:`decode.verify.verify` on p and q)."""
        sampling = self._batch.sampling
        counts, seen = window_counts(self._batch.counts, self._batch.seen, drafts, self.vocab_size)
        num_draft = None if len(set(gammas)) == 1 else torch.tensor(gammas, device=drafts.device)
        if sampling.all_greedy:  # ids only: no (B, γ+1, V) one-hots
            return verify_greedy(greedy_ids(logits, sampling, self.vocab_size, counts, seen), drafts, num_draft)
        p = probs_from_logits(logits, sampling, self.vocab_size, counts, seen)  # (B, γ+1, V)
        return verify(q, p, drafts, accept_u=accept_u, sample_u=sample_u, num_draft=num_draft)

    def _commit(self, gammas: list[int], n_acc: list[int], new: list[list[int]]) -> list[RequestOutput]:
        """Commit each row's tokens and retire finished rows (:meth:`decode.batch.RunningBatch.commit`), then call
        ``on_tokens``."""
        with profiling.part(self.profile, "commit"):
            return self._commit_rows(gammas, n_acc, new)

    def _commit_rows(self, gammas: list[int], n_acc: list[int], new: list[list[int]]) -> list[RequestOutput]:
        finished, calls = self._batch.commit(gammas, n_acc, new, self._step_draft_forwards, self.context_length)
        for out in finished:
            self._ids.discard(out.request_id)
        # Kept (with those of earlier steps whose callbacks raised) for the next step() if a callback raises below.
        finished = self._undelivered = self._undelivered + finished
        for row, tokens in calls:
            if row.on_tokens is not None and tokens and not row.aborted:  # aborted by an earlier callback
                row.on_tokens(row.request_id, list(tokens))
        self._undelivered = []
        return finished

    # ------------------------------------------------------------------ generate
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
        check_sampling_args(temperature, top_k, top_p, generator, sampling)
        max_new_tokens = check_max_new_tokens(max_new_tokens)
        gamma = None if num_draft_tokens is None else self._check_gamma(num_draft_tokens)
        prompts = [check_prompt(p, self.vocab_size, self.context_length, name=f"prompt {i}")
                   for i, p in enumerate(pack_prompts(input_ids, attention_mask))]
        check_streamer(streamer, len(prompts))
        if self.has_unfinished():
            raise RuntimeError("generate() needs an idle decoder; finish or abort the queued requests first")
        seeds = row_seeds(generator, len(prompts))
        start, forwards = time.perf_counter(), (self.num_target_forwards, self.num_draft_forwards, self.draft_prefill_s)
        outputs: dict[int, RequestOutput] = {}
        first: list[float] = []  # when the first token was out (the time to first token)

        def on_tokens(_rid: Any, tokens: list[int]) -> None:
            if not first:
                first.append(time.perf_counter())
            if streamer is not None:
                streamer.put(torch.tensor(tokens))
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
        finally:
            self._gamma_override, self._static_batch = None, False
            self._undelivered = []
            for rid in [r.request_id for r in self._waiting + self._batch.rows]:
                self.abort(rid)
        if streamer is not None:
            streamer.end()
        ordered = [outputs[i] for i in range(len(prompts))]
        stats = DecodeStats.merge([o.stats for o in ordered])
        stats.num_target_forwards = self.num_target_forwards - forwards[0]
        stats.num_draft_forwards = self.num_draft_forwards - forwards[1]
        stats.draft_prefill_s = self.draft_prefill_s - forwards[2]
        stats.ttft_s, stats.total_s = first[0] - start, time.perf_counter() - start
        stats.peak_memory_bytes = peak_memory_bytes(self.target.device)
        return generation_output(prompts, ordered, stats)

