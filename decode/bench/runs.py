"""Running the benchmark: every method on every prompt, interleaved, then the batch pass; returns the results dict.

- Interleaved: for each prompt, every temperature and every method runs before the next prompt (method order
  rotated per prompt), so machine drift and thermal state hit all methods alike. With ``repeats`` > 1 the block
  runs that many times (rotation continuing) and each method keeps its median-wall run (``pool.median_run``): a
  call slowed by a burst of other load on a shared machine no longer moves the pooled ratio.
- Throughput is wall-clock around each generate call (device synchronised), identical for our engine and for HF.
- c is timed by ``decode.costs.cost_timer`` (the engine's forward path; a second time through the compiled
  forwards for compiled methods) and next to it the bare HF forwards (``decode.bench.bare_forward``) on the same
  context, in rounds spread over the main pass (before each prompt's block).
"""
from __future__ import annotations

import copy
import datetime as _dt
import functools
import inspect
import itertools
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, replace
from typing import Any, Callable

import torch
import transformers
from rich.progress import Progress

from decode import costs, kernels
from decode.bench.bare_forward import BareTimer
from decode.bench.config import HF, OURS, BenchConfig, Method, build_methods
from decode.bench.hf_assisted import run_hf
from decode.bench.measure import cost_context_ids, run_interleaved
from decode.bench.pool import (batch_row, median_run, pool, predicted_batch_speedup, prefill_seconds, prompt_alphas,
                               stats_counts)
from decode.bench.timing import peak_bytes, reset_peak, sync
from decode.batch import left_pad
from decode.cache import context_length
from decode.engine import SpeculativeDecoder
from decode.metrics import DecodeStats
from decode.profile import StepProfile
from decode.speedup import cost_buckets

SCHEMA_VERSION = 4  # 3: Leviathan's prediction keys named *_leviathan; 4: prefill_s and the bare prefills


def compile_supported() -> bool:
    """Whether this version's ``SpeculativeDecoder`` takes ``compile=True`` (torch.compile of its forwards)."""
    return "compile" in inspect.signature(SpeculativeDecoder.__init__).parameters


def run_ours(decoder, method: Method, ids: torch.Tensor, mask: torch.Tensor, temperature: float, cfg: BenchConfig,
             eos, seed: int, device: torch.device, profile: StepProfile | None = None):
    """One timed ``decoder.generate`` call at γ = ``method.gamma``.

    Args:
        ids, mask: (B, T) left-padded int64 prompt ids and attention mask on ``device``.
        seed: seeds the call's own ``torch.Generator`` at T > 0 (same seed for every method on a prompt).
        profile: attached to the decoder for this call (``decoder.profile``), which adds the call's steps to it;
            None leaves the call unprofiled.

    Returns:
        (new tokens per row as lists, wall seconds, the call's ``DecodeStats``, peak memory bytes).
    """
    generator = torch.Generator(device=device).manual_seed(seed) if temperature > 0 else None
    reset_peak(device)
    decoder.profile = profile
    try:
        sync(device)
        t0 = time.perf_counter()
        out = decoder.generate(ids, attention_mask=mask, max_new_tokens=cfg.max_new_tokens, temperature=temperature,
                               eos_token_id=eos, generator=generator, num_draft_tokens=method.gamma)
        sync(device)
        wall = time.perf_counter() - t0
    finally:
        decoder.profile = None
    return [t.tolist() for t in out.new_tokens], wall, out.stats, peak_bytes(device)


def run_ours_stream(decoder, method: Method, rows: list[list[int]], concurrency: int, temperature: float,
                    cfg: BenchConfig, eos, seed: int, device: torch.device):
    """One timed continuous-batching run at γ = ``method.gamma``: the rows as requests through the decoder's request
    API, at most ``concurrency`` running at once, each later one joining at the step after one finishes (as
    ``decode.serving.scheduler`` admits them, in one few-row-kernel block like its busy periods).

    Args:
        rows: unpadded prompts (token id lists), queued in this order; request i is seeded ``seed + i``.
        concurrency: the most requests in the running batch (the server's ``--max-batch-size``), >= 1.

    Returns:
        (new tokens per row as lists, wall seconds from the first request queued to the last finished, the
        requests' merged ``DecodeStats``, peak memory bytes).

    Raises:
        ValueError: ``concurrency`` is not an integer >= 1.
        RuntimeError: the decoder has requests in flight (the run sets its ``num_draft_tokens`` and restores it).
    """
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        raise ValueError(f"concurrency must be an integer >= 1 (requests running at once), got {concurrency!r}")
    before, decoder.num_draft_tokens = decoder.num_draft_tokens, method.gamma
    outputs: dict[int, Any] = {}
    queued = 0
    try:
        reset_peak(device)
        sync(device)
        t0 = time.perf_counter()
        with kernels.few_row_linear(decoder.few_row_linear):
            while queued < len(rows) or decoder.has_unfinished():
                while queued < len(rows) and queued - len(outputs) < concurrency:
                    decoder.add_request(rows[queued], cfg.max_new_tokens, temperature, eos_token_id=eos,
                                        seed=seed + queued, request_id=queued)
                    queued += 1
                outputs.update((o.request_id, o) for o in decoder.step())
        sync(device)
        wall = time.perf_counter() - t0
    finally:
        for rid in decoder.active_ids + [i for i in range(queued) if i not in outputs]:
            decoder.abort(rid)
        decoder.num_draft_tokens = before
    ordered = [outputs[i] for i in range(len(rows))]
    return ([o.new_tokens for o in ordered], wall, DecodeStats.merge([o.stats for o in ordered]),
            peak_bytes(device))


def seed_for(cfg: BenchConfig, prompt_index: int, batch: int = 0) -> int:
    """Same seed for every method on a prompt: common random numbers make method differences less noisy."""
    return cfg.seed * 1_000_003 + prompt_index * 101 + batch


def run_benchmark(target, draft, prompt_ids: list[list[int]], categories: list[str | None], cfg: BenchConfig,
                  pad_token_id: int, eos_token_id=None, prompt_names: list[str] | None = None,
                  progress: bool = True, tokenizer=None, draft_tokenizer=None) -> dict[str, Any]:
    """Run every method on every prompt (interleaved), measure c, and pool into the results dict.

    Args:
        target, draft: causal LMs sharing a vocabulary, on one device, in eval mode.
        prompt_ids: token ids per prompt (unpadded, already fitting the models' positions).
        categories: one category (or None) per prompt.
        cfg: the run's settings (validated here first).
        pad_token_id: used to left-pad batches and given to HF generate.
        eos_token_id: int, list of ints, or None; generation stops there unless ``cfg.ignore_eos``.
        prompt_names: ids of the prompts, stored with the per-prompt records.
        progress: show progress on stderr (a rich bar on a terminal, plain lines elsewhere).
        tokenizer, draft_tokenizer: optional; passed to the decoder, which then checks them and limits sampling
            to the tokenizer's vocabulary (lm_head padding rows never sampled).

    Returns:
        the results dict described in docs/bench.md (without ``plots`` and ``report``; ``report.write_outputs``
        adds them).

    Raises:
        ValueError: bad config, empty prompt list, ``cfg.compile`` with a decoder that cannot compile, or a cost
            context that with the largest γ's verify forward does not fit the models' positions (before any model
            work).
    """
    _check_inputs(prompt_ids, categories, cfg)
    device = next(target.parameters()).device
    context = cost_context(prompt_ids, cfg, device)
    _check_cost_context_fits(context.shape[1], cfg, target, draft)
    eos = None if cfg.ignore_eos else eos_token_id
    say = functools.partial(_say, progress)
    say("building the decoders" + (" (compiling and warming up the compiled one)" if cfg.compile else ""))
    decoders = build_decoders(target, draft, cfg, tokenizer, draft_tokenizer)
    methods = build_methods(cfg)
    say(f"measuring c and v_γ: bare and engine forwards at {context.shape[1]} tokens, untimed rounds first (the "
        f"{cfg.cost_repeats} timed rounds are spread over the main pass)")
    timers = cost_timers(decoders, target, draft, context, cfg)
    if cfg.auto:
        say(f"calibrating the auto-γ cost model (batch sizes {cost_buckets(max(cfg.batch_sizes, default=1))}, "
            f"γ up to {cfg.auto_max_gamma}, {cfg.cost_repeats} forwards per median)")
    auto_costs = calibrate_auto(decoders, prompt_ids, cfg)
    cfg.cross_vocab = decoders[False].intersection is not None
    run = _Runner(decoders, target, draft, cfg, pad_token_id, eos, device, hf_assistant(draft, cfg, tokenizer,
                                                                                        draft_tokenizer))
    hf_failures: dict[tuple[float, str], str] = {}  # HF methods whose generate raised (_main_pass)
    if cfg.warmup:  # first calls pay for allocator growth and lazy init (compilation: warm_up above)
        say(f"warm-up: {len(methods) * len(cfg.temperatures)} untimed calls of up to {min(4, cfg.max_new_tokens)} "
            "tokens (every method once)")
        _warm_up(run, methods, prompt_ids[:1], cfg, hf_failures)
    say(f"main pass: {', '.join(m.name for m in methods)} on {len(prompt_ids)} prompt(s), interleaved")
    per_prompt = math.ceil(cfg.cost_repeats / len(prompt_ids))  # cost rounds before each prompt's runs
    profiles: dict[tuple[float, str], StepProfile] | None = {} if cfg.profile else None
    records = _main_pass(run, methods, prompt_ids, categories, prompt_names, cfg, progress,
                         lambda: _cost_rounds(timers, per_prompt), profiles, hf_failures)
    add_text_lengths(records, tokenizer)
    cost = _cost_results(timers, decoders, auto_costs)
    timers.clear()  # their prefilled caches are not held through the batch pass (peak memory)
    runs, summary = pool(records, methods, cfg, cost, categories)
    for entry in runs if profiles is not None else ():  # --profile: each of our methods' steps, by part
        if (entry["temperature"], entry["method"]) in profiles:
            entry["profile"] = profiles[(entry["temperature"], entry["method"])].summary()
    predict = functools.partial(_predict_batches, records, methods, len(prompt_ids), cfg, auto_costs,
                                cost["bare"].get("prefill_cost_ratio"), eos)
    batch = _batch_pass(run, records, summary, prompt_ids, cfg, progress, predict)
    return {
        "schema_version": SCHEMA_VERSION, "kind": "draftkit.bench",
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "config": {**asdict(cfg), "batching": batchings_run(cfg)}, "environment": environment(device),
        "prompts": {"source": cfg.prompts, "count": len(prompt_ids),
                    "categories": _count(c for c in categories if c is not None),
                    "mean_prompt_tokens": statistics.mean(len(r) for r in prompt_ids)},
        "cost": cost, "runs": runs, "summary": summary, "batch": batch,
        # with --compile: graphs torch.compile built inside timed runs (> 0: those timings include compilation)
        "compiled_graphs_during_timing": run.compiled_graphs if cfg.compile else None,
        "records": {f"{t}/{name}": _strip(rs) for (t, name), rs in records.items()},
        # Hugging Face methods whose generate raised, {"T/method": error}: not run at that temperature
        "hf_failures": {f"{t}/{name}": message for (t, name), message in hf_failures.items()},
    }


def planned_calls(cfg: BenchConfig, num_prompts: int) -> dict[str, int]:
    """The ``generate`` calls (and continuous streams) a run makes: ``{"main": timed calls of the main pass,
    "batch": timed calls and streams of the batch pass, "warmup": untimed calls}``. The batch pass runs the best
    measured fixed γ, which is one of ``cfg.gammas``, so the count is known before the run."""
    methods = build_methods(cfg)
    temps = len(cfg.temperatures)
    g = cfg.batch_gamma or (cfg.gammas[0] if cfg.gammas else "auto")
    group = (2 + int(cfg.auto and g != "auto")) * (2 if cfg.compile else 1)  # plain, γ, [auto]; [compiled twins]
    units = jobs = 0
    for bs in cfg.batch_sizes:
        if bs == 1 and (g == "auto" or g in cfg.gammas):  # the main pass's rows are reused
            continue
        if "static" in cfg.batching:
            units, jobs = units + math.ceil(num_prompts / bs), jobs + 1
        if "continuous" in cfg.batching and bs > 1:
            units, jobs = units + 1, jobs + 1
    return {"main": num_prompts * cfg.repeats * temps * len(methods), "batch": units * group * cfg.repeats * temps,
            "warmup": (len(methods) + jobs * group) * temps if cfg.warmup else 0}


def plan_line(cfg: BenchConfig, num_prompts: int) -> str:
    """One line saying what a run will do, printed before the models load."""
    n = planned_calls(cfg, num_prompts)
    methods = build_methods(cfg)
    return (f"plan: {n['main'] + n['batch']} timed generate calls of up to {cfg.max_new_tokens} new tokens: "
            f"{n['main']} in the main pass ({num_prompts} prompt(s) × {len(cfg.temperatures)} temperature(s) × "
            f"{len(methods)} methods × {cfg.repeats} repeat(s)), {n['batch']} in the batch pass (batch sizes "
            f"{cfg.batch_sizes}); {n['warmup']} untimed warm-up calls")


def _say(enabled: bool, message: str) -> None:
    """A progress line on stderr (the phases between the progress bars), when progress is on."""
    if enabled:
        print(message, file=sys.stderr, flush=True)


def batchings_run(cfg: BenchConfig) -> list[str]:
    """The batchings of ``cfg.batching`` that run: continuous streams need a batch size > 1 (at 1 a stream is the
    main pass), so at batch size 1 alone only static rows (the main pass's) are recorded."""
    return [b for b in cfg.batching if b == "static" or max(cfg.batch_sizes, default=1) > 1]


def _check_inputs(prompt_ids: list[list[int]], categories: list[str | None], cfg: BenchConfig) -> None:
    """The settings, the prompts and their categories, before any model work. Raises ValueError."""
    cfg.validate()
    if not prompt_ids:
        raise ValueError("no prompts to benchmark")
    if len(categories) != len(prompt_ids):
        raise ValueError(f"{len(categories)} categories for {len(prompt_ids)} prompts")
    if cfg.compile and not compile_supported():
        raise ValueError(f"compile={cfg.compile!r}: this version's SpeculativeDecoder has no compile option; drop "
                         "--compile")


def build_decoders(target, draft, cfg: BenchConfig, tokenizer=None, draft_tokenizer=None) -> dict[bool, Any]:
    """``{False: the eager decoder, True: the compiled one (with cfg.compile)}``; with ``cfg.warmup`` the compiled
    one has met every shape class its forwards will, so no timed run builds a graph."""
    kw = dict(num_draft_tokens=max(cfg.gammas or [1]), tokenizer=tokenizer, draft_tokenizer=draft_tokenizer,
              max_auto_draft_tokens=cfg.auto_max_gamma, few_row_linear=cfg.few_row_linear,
              prompt_lookup_ngram=cfg.prompt_lookup_ngram)
    decoders = {False: SpeculativeDecoder(target, draft, **kw)}
    if cfg.compile:
        decoders[True] = SpeculativeDecoder(target, draft, compile=cfg.compile, **kw)
        if cfg.warmup:
            costs.warm_up(decoders[True], max(cfg.batch_sizes, default=1))
    return decoders


def cost_timers(decoders: dict[bool, Any], target, draft, context: torch.Tensor, cfg: BenchConfig) -> dict[str, Any]:
    """The timers of c and v_γ, their untimed first rounds run (compiling the one-token shapes before any timed run).

    c as our decoder's steps pay it (its kernels, cache kind); compiled methods are predicted from their own; next
    to them the bare HF forwards, both models reading the ids the draft can embed (only the shapes matter) under the
    engine's matmul kernels, so c / bare is the work the engine adds around the models. The bench times them in
    rounds spread over the main pass, so the machine's drift hits them as it hits the runs they predict.
    """
    eager = decoders[False]
    timers = {"eager": costs.cost_timer(eager, context, cfg.gammas),
              "bare": BareTimer(target, draft, eager.draft_input_ids(context), few_row_linear=eager.few_row_linear)}
    if cfg.compile:
        timers["compiled"] = costs.cost_timer(decoders[True], context, cfg.gammas)
    for timer in timers.values():
        for _ in range(timer.warmup_rounds):
            timer.round()
    return timers


def calibrate_auto(decoders: dict[bool, Any], prompt_ids: list[list[int]], cfg: BenchConfig) -> dict | None:
    """With ``cfg.auto``: the auto-γ cost model measured now, so no timed run pays for it (and every run uses the
    same one), at every batch size a batch passes through as its rows finish (a batch of 4 runs at 2 rows, then 1).
    Returns the eager decoder's model, ``{str(batch size): costs}`` (``cost.auto_costs`` of results.json); None
    without ``cfg.auto``."""
    if not cfg.auto:
        return None
    for dec in decoders.values():
        costs.calibrate(dec, prompt_ids[0], batch_sizes=cost_buckets(max(cfg.batch_sizes, default=1)),
                        repeats=cfg.cost_repeats)
    return {str(b): dict(v) for b, v in decoders[False].auto_costs.items()}


def _cost_rounds(timers: dict[str, Any], rounds: int) -> None:
    for timer in timers.values():
        for _ in range(rounds):
            timer.round()


def _cost_results(timers: dict[str, Any], decoders: dict[bool, Any], auto_costs: dict | None) -> dict[str, Any]:
    """``results.json["cost"]``: the eager timer's result, with the bare, compiled and auto-γ costs beside it."""
    cost = timers["eager"].result()
    cost["few_row_linear"] = decoders[False].few_row_linear  # as resolved (None in the config means: default)
    cost["bare"] = timers["bare"].result()
    if "compiled" in timers:
        cost["compiled"] = timers["compiled"].result()
    if auto_costs is not None:
        cost["auto_costs"] = auto_costs
    return cost


def hf_assistant(draft, cfg: BenchConfig, tokenizer=None, draft_tokenizer=None) -> dict[str, Any]:
    """What HF assisted generation runs with: ``{"draft": the model for greedy runs, "sampling_draft": for T > 0}``,
    and for a draft of another vocabulary (``cfg.cross_vocab``) universal assisted decoding's ``tokenizer`` and
    ``assistant_tokenizer``, with a copy of the draft for sampling: HF's sampling path prunes and re-indexes the
    assistant's lm_head and input embedding in place (``AssistantToTargetTranslator``), which must touch neither
    the draft our decoder runs nor the one HF's greedy path reads."""
    if not (cfg.hf and cfg.cross_vocab):
        return {"draft": draft, "sampling_draft": draft}
    sampling = copy.deepcopy(draft) if any(t > 0 for t in cfg.temperatures) else draft
    return {"draft": draft, "sampling_draft": sampling, "tokenizer": tokenizer, "assistant_tokenizer": draft_tokenizer}


def add_text_lengths(records: dict[tuple[float, str], list[dict]], tokenizer=None) -> None:
    """Give every record ``num_chars``: the characters of its new tokens decoded by the target's tokenizer
    (special tokens skipped), the text behind :func:`decode.bench.pool.aggregate`'s characters per verify step.
    Without a tokenizer the records are left as they are."""
    if tokenizer is None:
        return
    for recs in records.values():
        for r in recs:
            r["num_chars"] = len(tokenizer.decode(r["new_tokens"], skip_special_tokens=True))


class _Runner:
    """One timed call of a method: ``run(method, rows, temperature, seed)`` runs ``rows`` as one static batch, or
    (``concurrency``, our engine) as a continuous stream; it counts the graphs torch.compile built inside timed
    runs (their wall time includes the compilation)."""

    def __init__(self, decoders: dict[bool, Any], target, draft, cfg: BenchConfig, pad_token_id: int, eos,
                 device: torch.device, hf: dict[str, Any] | None = None):
        self.decoders, self.target, self.draft, self.cfg = decoders, target, draft, cfg
        self.pad_token_id, self.eos, self.device = pad_token_id, eos, device
        self.hf = hf or {"draft": draft, "sampling_draft": draft}  # hf_assistant(): HF's drafts (and tokenizers)
        self.compiled_graphs = 0

    def __call__(self, method: Method, rows, temperature: float, seed: int, max_new_tokens: int | None = None,
                 timed: bool = True, concurrency: int | None = None, profile: StepProfile | None = None):
        ids, mask = left_pad(rows, self.pad_token_id, self.device)
        c = self.cfg if max_new_tokens is None else replace(self.cfg, max_new_tokens=max_new_tokens)
        if method.kind != OURS:
            draft = self.hf["sampling_draft" if temperature > 0 else "draft"]
            return run_hf(self.target, draft, method, ids, mask, temperature, c, self.eos,
                          self.pad_token_id, seed, self.device, self.hf.get("tokenizer"),
                          self.hf.get("assistant_tokenizer"))
        before = _compiled_graphs()
        dec = self.decoders[method.compiled]
        out = (run_ours(dec, method, ids, mask, temperature, c, self.eos, seed, self.device, profile)
               if concurrency is None
               else run_ours_stream(dec, method, rows, concurrency, temperature, c, self.eos, seed, self.device))
        self.compiled_graphs += (_compiled_graphs() - before) if timed else 0
        return out


def _predict_batches(records, methods: list[Method], num_prompts: int, cfg: BenchConfig, auto_costs: dict | None,
                     prefill_ratio: float | None, eos, t: float, gamma, batches: list[list[int]],
                     plain_recs: list[dict]) -> float | None:
    """The batch pass's prediction for static batches of these prompt indices (``predicted_batch_speedup``); None
    without the costs per batch size (``--no-auto``), with an eos (rows of free length) or without an α."""
    alphas = prompt_alphas(records, t, methods, num_prompts)
    rows = [[alphas[i] for i in b] for b in batches]
    if (auto_costs is None or prefill_ratio is None or eos is not None
            or any(a is None for r in rows for a in r) or any(r.get("prefill_s") is None for r in plain_recs)):
        return None
    return predicted_batch_speedup(gamma, rows, [r["wall_s"] for r in plain_recs],
                                   [r["prefill_s"] for r in plain_recs], auto_costs, cfg.max_new_tokens,
                                   prefill_ratio, cfg.auto_max_gamma)


def _recording_hf_failures(call: Callable[[], Any], method: Method, t: float, hf_failures: dict, where: str) -> Any:
    """``call()``'s result; when ``method`` is an HF one and its generate raises (universal assisted decoding fails
    on some pairs), None, with the error kept in ``hf_failures[(t, method name)]`` (``where`` says which call)."""
    try:
        return call()
    except Exception as err:  # noqa: BLE001 - that HF row is not run further
        if method.kind != HF:
            raise
        hf_failures[(t, method.name)] = f"{where}: {type(err).__name__}: {err}"[:300]
        return None


def _warm_up(run, methods: list[Method], prompt: list[list[int]], cfg: BenchConfig, hf_failures: dict) -> None:
    """One untimed call of every method at every temperature; an HF method whose generate raises is not run
    further at that temperature (:func:`_recording_hf_failures`, as in :func:`_main_pass`)."""
    for method in methods:
        for t in cfg.temperatures:
            _recording_hf_failures(lambda: run(method, prompt, t, 0, max_new_tokens=min(4, cfg.max_new_tokens),
                                               timed=False), method, t, hf_failures, "warm-up")


def _main_pass(run, methods, prompt_ids, categories, prompt_names, cfg: BenchConfig, progress: bool,
               before_block=lambda: None, profiles: dict | None = None, hf_failures: dict | None = None):
    """Batch-1 runs, interleaved (:func:`decode.bench.measure.run_interleaved`): prompt i's runs (every temperature,
    every method, ``cfg.repeats`` times) form one block, and the method that opens each round of the block rotates;
    ``before_block()`` runs before each block (the cost rounds). With ``profiles`` (a dict), each of our methods'
    timed calls run with the ``decode.profile.StepProfile`` of its (temperature, method name), made there on first
    use: one profile per method and temperature over all its prompts and repeats. Returns {(temperature, method
    name): [record per prompt]}, each the median of its repeats (``median_run``). A Hugging Face method whose
    ``generate`` raises (universal assisted decoding fails on some pairs) is not run further at that temperature:
    its error goes into ``hf_failures`` {(temperature, method name): message} and it has no records."""
    hf_failures = {} if hf_failures is None else hf_failures
    names = prompt_names or [str(i) for i in range(len(prompt_ids))]
    total = len(prompt_ids) * cfg.repeats * len(cfg.temperatures) * len(methods)
    order = itertools.count()
    with _progress(progress, total, "decoding") as tick:
        def one(method: Method, i: int, t: float) -> dict | None:
            row = prompt_ids[i]
            prof = (profiles.setdefault((t, method.name), StepProfile(run.device))
                    if profiles is not None and method.kind == OURS else None)
            if (t, method.name) in hf_failures:
                tick(f"skipped: {method.name} at T={t:g}")
                return None
            result = _recording_hf_failures(lambda: run(method, [row], t, seed_for(cfg, i), profile=prof), method,
                                            t, hf_failures, f"prompt {names[i]}")
            if result is None:
                _say(progress, f"{method.name} at T={t:g} is not run: Hugging Face's generate raised "
                               f"{hf_failures[(t, method.name)]}")
                return None
            new, wall, stats, peak = result
            tick(f"last: {method.name} at T={t:g}")
            return {"key": i, "order": next(order), "prompt": names[i], "category": categories[i],
                    "prompt_tokens": len(row), "new_tokens": new[0], "wall_s": wall, "peak_memory_bytes": peak,
                    "stats": stats if method.kind == OURS else None, "ttft_s": getattr(stats, "ttft_s", None)}

        blocks = run_interleaved(one, methods, len(prompt_ids), cfg.temperatures, cfg.repeats,
                                 lambda i: before_block())
    return {(t, m.name): [median_run(repeats) for repeats in per_prompt] for (t, m), per_prompt in blocks.items()
            if (t, m.name) not in hf_failures}


def _batch_pass(run, records, summary, prompt_ids, cfg: BenchConfig, progress: bool, predict=None) -> list[dict]:
    """Tokens/s of plain and speculative decoding (our engine) at each batch size, interleaved per batch, batched
    the ways ``cfg.batching`` names.

    The speculative methods are ``cfg.batch_gamma``, else the best measured fixed γ, else γ="auto" when no fixed γ
    ran; and γ="auto" too when ``cfg.auto`` (it re-plans γ from costs measured at each batch size). With
    ``cfg.compile`` the compiled decoder's plain and speculative runs join each group.

    - static: ``generate()`` calls of batch_size rows (a batch ends with its slowest row). Batch size 1 reuses the
      main pass (same prompts, same measurement; also with continuous batching alone). Larger batches cycle through
      the prompts so every batch is full, with ceil(n / batch_size) batches: roughly the same number of prompts per
      size. A ``cfg.batch_gamma`` that the main pass did not run is measured at batch size 1 here too.
    - continuous (batch sizes > 1): one stream of max(n, 2 × batch_size) requests (the prompts, cycled), at most
      batch_size running at once, each joining as another finishes (``run_ours_stream``, the server's way), so a
      row the draft does not help holds back no other.

    Each batch (each stream) runs ``cfg.repeats`` times (order reversed every other time) and keeps each method's
    median-wall run. Every row's speedup is over eager plain decoding at the same temperature, batch size and
    batching. ``predict(t, γ, batches as prompt indices, plain's records)`` gives the eager speculative static rows
    of batch size > 1 their ``predicted_speedup`` (with no cost beyond the forwards, see
    ``decode.bench.pool.predicted_batch_speedup``); the other rows keep None.
    """
    out, jobs = [], []
    for entry in summary:
        t = entry["temperature"]
        # No fixed γ run (--gammas auto): the batch pass measures γ="auto".
        g = cfg.batch_gamma or entry["best_gamma_measured"] or (cfg.gammas[0] if cfg.gammas else "auto")
        group = [Method("plain", OURS, 0), Method("spec_auto" if g == "auto" else f"spec_g{g}", OURS, g)]
        if cfg.auto and g != "auto":  # γ="auto" chooses per step from costs measured at the current batch size
            group.append(Method("spec_auto", OURS, "auto"))
        if cfg.compile:
            group += [Method(f"{m.name}_compiled", OURS, m.gamma, compiled=True) for m in group]
        for bs in cfg.batch_sizes:
            if bs == 1 and all(records.get((t, m.name)) for m in group):  # whichever batching: one row at a time
                out += [batch_row(t, m, 1, records[(t, m.name)], reused=True) for m in group]
            elif "static" in cfg.batching:  # also batch 1 when the main pass did not run that γ (--batch-gamma)
                n_batches = math.ceil(len(prompt_ids) / bs)
                index = [[i % len(prompt_ids) for i in range(b * bs, (b + 1) * bs)] for b in range(n_batches)]
                jobs.append((t, group, bs, "static", [[prompt_ids[i] for i in b] for b in index], index))
            if "continuous" in cfg.batching and bs > 1:
                rows = [prompt_ids[i % len(prompt_ids)] for i in range(max(len(prompt_ids), 2 * bs))]
                jobs.append((t, group, bs, "continuous", [rows], None))
    total = sum(len(units) * len(group) for _, group, _, _, units, _ in jobs) * cfg.repeats
    if total:
        _say(progress, f"batch pass: {total} timed calls and streams at batch sizes "
                       f"{sorted({bs for _, _, bs, _, _, _ in jobs})} ({', '.join(cfg.batching)})")
    with _progress(progress, total, "batches") as tick:
        for t, group, bs, batching, units, index in jobs:
            concurrency = bs if batching == "continuous" else None
            if cfg.warmup:
                for m in group:
                    if concurrency is None:
                        run(m, units[0], t, 0, timed=False)
                    else:  # a short stream in which one request joins the running batch
                        run(m, units[0][:bs + 1], t, 0, max_new_tokens=min(8, cfg.max_new_tokens), timed=False,
                            concurrency=concurrency)
            recs: dict[str, list[dict]] = {m.name: [] for m in group}
            for b, unit in enumerate(units):
                repeats: dict[str, list[dict]] = {m.name: [] for m in group}
                for rep in range(cfg.repeats):
                    for m in (group if (b + rep) % 2 == 0 else group[::-1]):
                        new, wall, stats, peak = run(m, unit, t, seed_for(cfg, b, batch=bs), concurrency=concurrency)
                        repeats[m.name].append({"new_tokens": [x for r in new for x in r], "wall_s": wall,
                                                "peak_memory_bytes": peak,
                                                "prefill_s": prefill_seconds(stats) if isinstance(stats, DecodeStats)
                                                else None})
                        tick()
                for name, runs_of_m in repeats.items():
                    recs[name].append(median_run(runs_of_m))
            rows = [batch_row(t, m, bs, recs[m.name], reused=False, batching=batching) for m in group]
            if predict is not None and index is not None:  # static batches: each speculative row's prediction
                for row, m in zip(rows, group):
                    if m.gamma != 0 and not m.compiled:
                        row["predicted_speedup"] = predict(t, m.gamma, index, recs["plain"])
            out += rows
    for row in out:  # over plain decoding (the eager engine) at the same temperature, batch size and batching
        plain = [r for r in out if (r["temperature"], r["batch_size"], r["batching"], r["method"])
                 == (row["temperature"], row["batch_size"], row["batching"], "plain")]
        row["speedup"] = (row["tokens_per_s"] / plain[0]["tokens_per_s"]
                          if plain and plain[0]["tokens_per_s"] and row["tokens_per_s"] else None)
    return out


def _compiled_graphs() -> int:
    """Graphs torch.compile has built in this process so far (dynamo's ``unique_graphs`` counter)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def cost_context(prompt_ids, cfg: BenchConfig, device) -> torch.Tensor:
    """(1, n) real prompt tokens (repeated when the prompts are shorter) for measuring c; n defaults to the mean
    prompt length + max_new_tokens // 2, a typical context in the middle of a generation."""
    n = cfg.cost_context_tokens or int(statistics.mean(len(r) for r in prompt_ids)) + cfg.max_new_tokens // 2
    return torch.tensor([cost_context_ids(prompt_ids, n)], dtype=torch.long, device=device)


def _check_cost_context_fits(n: int, cfg: BenchConfig, target, draft) -> None:
    """The cost measurement prefills n - 1 tokens, then times forwards of 1 and (verify) γ+1 tokens after them:
    n + the largest γ positions must fit both models."""
    positions = [p for p in (context_length(target), context_length(draft)) if p]
    g = max(cfg.gammas or [0])
    if positions and n + g > min(positions):
        what = (f"--cost-context {n}" if cfg.cost_context_tokens is not None
                else f"the cost context (mean prompt + max_new_tokens // 2 = {n} tokens)")
        raise ValueError(f"{what} plus the largest γ {g} (the verify forward) needs {n + g} positions, more than the "
                         f"models' {min(positions)}; give --cost-context <= {min(positions) - g}")


def _count(items) -> dict[str, int]:
    out: dict[str, int] = {}
    for x in items:
        out[x] = out.get(x, 0) + 1
    return out


def _strip(records: list[dict]) -> list[dict]:
    """Per-prompt records for the JSON: DecodeStats objects become their counters."""
    return [{**{k: v for k, v in r.items() if k != "stats"}, "stats": stats_counts(r.get("stats"))} for r in records]


class _progress:
    """A rich progress bar on a terminal; elsewhere (logs, CI) a plain stderr line at every tenth of the work, so a
    redirected run of many minutes still shows it is moving; nothing when disabled (tests)."""

    def __init__(self, enabled: bool, total: int, label: str):
        self.enabled, self.total, self.label = enabled and total > 0, total, label

    def __enter__(self):
        """``tick(detail="")``: one unit done; ``detail`` (e.g. the method just run) goes into the plain line."""
        if not self.enabled:
            return lambda detail="": None
        if not sys.stderr.isatty():
            done, start, step = 0, time.perf_counter(), max(1, self.total // 10)

            def tick(detail: str = ""):
                nonlocal done
                done += 1
                if done % step == 0 or done == self.total:
                    print(f"{self.label}: {done}/{self.total} ({time.perf_counter() - start:.0f} s"
                          f"{'; ' + detail if detail else ''})", file=sys.stderr, flush=True)
            return tick
        self._p = Progress(transient=True)
        self._p.start()
        task = self._p.add_task(self.label, total=self.total)
        return lambda detail="": self._p.advance(task)

    def __exit__(self, *exc):
        if hasattr(self, "_p"):
            self._p.stop()


def environment(device: torch.device) -> dict[str, Any]:
    """Versions, platform and device of the run, stored in ``results.json["environment"]``."""
    env = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
           "platform": platform.platform(), "device": str(device), "torch_threads": torch.get_num_threads(),
           "cpu_count": os.cpu_count()}
    if device.type == "cuda":
        env["device_name"] = torch.cuda.get_device_name(device)
    return env
