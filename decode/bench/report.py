"""What a benchmark run reports: the highlights (headline comparisons: ours over a reference), the verdict (whether
drafting pays off on this pair and hardware, and the α a draft needs when it does not), the ``results.json``
schema, where outputs go (checked before the run), and the rich tables on the terminal."""
from __future__ import annotations

import datetime as _dt
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from decode.bench.config import OURS
from decode.bench.plots import PLOTS
from decode.bench.pool import RUN_METRICS, batching_of
from decode.bench.runs import SCHEMA_VERSION
from decode.outputs import writable, write_new_file
from decode.profile import PARTS
from decode.speedup import end_to_end_speedup, predicted_speedup

# ----------------------------------------------------------------------------------------------- highlights
def _check(name: str, value: float | None, ours: float | None, reference: float | None, **extra) -> dict[str, Any]:
    return {"name": name, "ours": ours, "reference": reference, "ratio": value, **extra}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def compiled_over_own_plain(runs: dict[str, dict], method: str, key: str, compile_: Any) -> float | None:
    """``runs[method][key]`` (a speedup over eager plain decoding) as a speedup over the plain decoding its
    prediction is relative to: eager plain with ``compile="draft"`` (the target stays eager), ``plain_compiled``
    when the target is compiled too (``True``/``"both"``; its c and v_γ are over the compiled target's forward).

    Args:
        runs: ``{method: overall}`` of one temperature; key: ``"speedup"`` or ``"decode_speedup"``.

    Returns:
        the ratio, or None where a value is missing."""
    ours = (runs.get(method) or {}).get(key)
    if compile_ == "draft":
        return ours
    return _ratio(ours, (runs.get("plain_compiled") or {}).get(key))


def end_to_end_prediction(runs: dict[str, dict], method: str, plain: str, prefill_cost_ratio: float | None
                          ) -> float | None:
    """``runs[method]``'s verify-aware prediction extended over the prefill (``decode.speedup.end_to_end_speedup``):
    the prefill share f is ``runs[plain]``'s (``prefill_s / total_s``, same prompts), r the bare prefill ratio
    (``cost.bare.prefill_cost_ratio``, measured on the cost context's prefix by the eager bare forwards, also for
    compiled methods). None where a value is missing (e.g. a results.json of schema < 4).

    Raises:
        ValueError: a value present but out of its range (an edited file), naming the fields.
    """
    predicted = (runs.get(method) or {}).get("predicted_speedup_verify_aware")
    ref = runs.get(plain) or {}
    if predicted is None or prefill_cost_ratio is None or ref.get("prefill_s") is None or not ref.get("total_s"):
        return None
    try:
        return end_to_end_speedup(predicted, ref["prefill_s"] / ref["total_s"], prefill_cost_ratio)
    except (TypeError, ValueError) as e:
        raise ValueError(f"results: no end-to-end prediction for {method} from runs[{plain}].overall.prefill_s / "
                         f"total_s, runs[{method}].overall.predicted_speedup_verify_aware and "
                         f"cost.bare.prefill_cost_ratio: {e}") from None


def highlights(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The headline comparisons of a run, per temperature, computed from a results dict (or loaded JSON).

    Each temperature gets ``checks``: {name, ours, reference, ratio = ours / reference (None without a value)}:

    - ``cost_ratio_vs_bare``: engine c (``measure_cost_ratio``) over the ratio of the bare HF decode forwards;
    - ``measured_vs_verify_aware``: measured (end-to-end, prefill included) speedup at the best measured fixed γ
      over its verify-aware prediction (per step: it leaves the prefill out);
    - ``measured_vs_end_to_end``: the same speedup over that prediction extended over the prefill
      (:func:`end_to_end_prediction`: plain decoding's measured prefill share, the bare prefill ratio of the models);
    - ``decode_vs_verify_aware``: the same for the decode-phase speedup (prefill and first step left out on both
      sides, as in the prediction's per-step model; ``decode.bench.pool.decode_speedup``);
    - ``ours_vs_hf_assisted`` (one per γ run by both ``spec_g{γ}`` and ``hf_assisted_g{γ}``): our speedup over HF
      assisted generation's at the same fixed γ; ``analytic_bound`` is the verify-aware prediction over HF's
      speedup, the largest ratio a decoder with no overhead beyond its forwards could reach;
    - ``cost_ratio_compiled_vs_bare``, ``measured_compiled_vs_verify_aware``, ``measured_compiled_vs_end_to_end``,
      ``decode_compiled_vs_verify_aware`` (with ``--compile``): the first four for the compiled decoder: its c
      (``cost["compiled"]``) over the bare ratio, and ``spec_g{best}_compiled``'s speedups over its own predictions,
      made from the compiled c and v_γ (``compile`` says which forwards were compiled; with the target compiled
      too, the predictions and ``ours`` are over ``plain_compiled``: :func:`compiled_over_own_plain`);
    - ``ours_compiled_vs_hf_assisted`` (with ``--compile``): the same for ``spec_g{γ}_compiled`` (its speedup is over
      the eager plain run, like every speedup here);
    - ``batch_speedup`` (one per batch size > 1 and speculative method): speculative over plain tokens/s, our eager
      engine, same static batches (``generate()`` calls), with ``predicted``: the row's ``predicted_speedup`` (with
      no cost beyond the forwards, ``decode.bench.pool.predicted_batch_speedup``; None where it was not computed);
      ``batch_continuous_speedup``: the same for the continuous-batching streams (``batching`` "continuous"), under
      the same ratio;
    - ``auto_vs_best_fixed``: γ="auto" speedup over the best fixed γ's.
    """
    out = []
    for s in results["summary"]:
        t, best = s["temperature"], s["best_gamma_measured"]
        runs = {r["method"]: r["overall"] for r in results["runs"] if r["temperature"] == t}
        checks = (_eager_checks(results, runs, best) + _compiled_checks(results, runs, best)
                  + _hf_checks(results, runs, s) + _batch_checks(results, t))
        checks.append(_check("auto_vs_best_fixed", s["auto_vs_best_fixed"], s["spec_auto_speedup"],
                             s["measured_speedup_at_best"], gamma=best))
        out.append({"temperature": t, "checks": checks})
    return out


def _costs(results: dict[str, Any]) -> tuple[float, float | None, float | None]:
    """(engine c, bare HF forward ratio, bare prefill ratio) of a results dict."""
    cost = results["cost"]
    bare = cost.get("bare") or {}
    return cost["cost_ratio"], bare.get("cost_ratio"), bare.get("prefill_cost_ratio")


def _eager_checks(results: dict[str, Any], runs: dict[str, dict], best: int | None) -> list[dict[str, Any]]:
    """c against the bare forwards, and the best fixed γ's speedups against their predictions."""
    c, bare, prefill_ratio = _costs(results)
    at_best = runs.get(f"spec_g{best}", {}) if best else {}
    speedup, decode, predicted = (at_best.get("speedup"), at_best.get("decode_speedup"),
                                  at_best.get("predicted_speedup_verify_aware"))
    whole = end_to_end_prediction(runs, f"spec_g{best}", "plain", prefill_ratio) if best else None
    return [_check("cost_ratio_vs_bare", _ratio(c, bare), c, bare),
            _check("measured_vs_verify_aware", _ratio(speedup, predicted), speedup, predicted, gamma=best),
            _check("measured_vs_end_to_end", _ratio(speedup, whole), speedup, whole, gamma=best),
            _check("decode_vs_verify_aware", _ratio(decode, predicted), decode, predicted, gamma=best)]


def _compiled_checks(results: dict[str, Any], runs: dict[str, dict], best: int | None) -> list[dict[str, Any]]:
    """With ``--compile``: the eager checks for the compiled decoder, against its own costs (none without)."""
    cost = results["cost"]
    if not cost.get("compiled"):
        return []
    _, bare, prefill_ratio = _costs(results)
    compile_ = (results.get("config") or {}).get("compile")
    cc = cost["compiled"]["cost_ratio"]
    checks = [_check("cost_ratio_compiled_vs_bare", _ratio(cc, bare), cc, bare, compile=compile_)]
    method = f"spec_g{best}_compiled"
    predicted = (runs.get(method) or {}).get("predicted_speedup_verify_aware")
    plain = "plain" if compile_ == "draft" else "plain_compiled"
    whole = end_to_end_prediction(runs, method, plain, prefill_ratio) if best else None
    for name, key, reference in (("measured_compiled_vs_verify_aware", "speedup", predicted),
                                 ("measured_compiled_vs_end_to_end", "speedup", whole),
                                 ("decode_compiled_vs_verify_aware", "decode_speedup", predicted)):
        ours = compiled_over_own_plain(runs, method, key, compile_) if best else None
        checks.append(_check(name, _ratio(ours, reference), ours, reference, gamma=best, compile=compile_))
    return checks


def _hf_checks(results: dict[str, Any], runs: dict[str, dict], s: dict[str, Any]) -> list[dict[str, Any]]:
    """Ours (eager, and compiled with ``--compile``) against HF assisted generation at each fixed γ both ran."""
    compile_ = (results.get("config") or {}).get("compile")
    checks = []
    for g in sorted(int(k) for k in s["hf_assisted_fixed_speedup"]):
        hf = s["hf_assisted_fixed_speedup"][str(g)]
        if f"spec_g{g}" in runs:
            ours = runs[f"spec_g{g}"]["speedup"]
            checks.append(_check("ours_vs_hf_assisted", _ratio(ours, hf), ours, hf, gamma=g, analytic_bound=_ratio(
                                     runs[f"spec_g{g}"].get("predicted_speedup_verify_aware"), hf)))
        if f"spec_g{g}_compiled" in runs:  # --compile: the compiled decoder against the same HF runs
            ours = runs[f"spec_g{g}_compiled"]["speedup"]
            checks.append(_check("ours_compiled_vs_hf_assisted", _ratio(ours, hf), ours, hf, gamma=g,
                                 compile=compile_))
    return checks


def _batch_checks(results: dict[str, Any], t: float) -> list[dict[str, Any]]:
    """Speculative over plain tokens/s of each eager batch row of size > 1 at temperature ``t``."""
    batch = [b for b in results["batch"] if b["temperature"] == t and b["batch_size"] > 1 and not b["compiled"]]
    checks = []
    for b in sorted((b for b in batch if b["method"] != "plain"),
                    key=lambda b: (batching_of(b) != "static", b["batch_size"])):
        plain = [p for p in batch if p["method"] == "plain" and p["batch_size"] == b["batch_size"]
                 and batching_of(p) == batching_of(b)]
        checks.append(_check("batch_speedup" if batching_of(b) == "static" else "batch_continuous_speedup",
                             b["speedup"], b["tokens_per_s"], plain[0]["tokens_per_s"] if plain else None,
                             gamma=b["num_draft_tokens"],
                             batch_size=b["batch_size"], predicted=b.get("predicted_speedup")))
    return checks


# ----------------------------------------------------------------------------------------------- verdict
def break_even_alpha(cost_ratio: float, verify_costs: dict[int, float]) -> tuple[float, int] | None:
    """The lowest α whose verify-aware prediction ``(1 − α^(γ+1)) / ((1 − α)(γc + v_γ))`` reaches 1 at some γ of
    ``verify_costs``, with that γ (the smallest on ties): the acceptance a draft needs for any speedup at this c.

    Args:
        cost_ratio: c >= 0; verify_costs: ``{γ: v_γ}`` for the γ >= 1 to consider (others are ignored).

    Returns:
        ``(α, γ)``, α to 1e-6 (at γ = 1 it is ``c + v_1 − 1``, clamped at 0); None when no γ reaches 1 even at
        α = 1 (the draft costs more than its tokens save).
    """
    best = None
    for g, v in sorted(verify_costs.items()):
        if g < 1 or predicted_speedup(1.0, g, cost_ratio, v) < 1:
            continue
        lo, hi = 0.0, 1.0
        if predicted_speedup(0.0, g, cost_ratio, v) >= 1:
            hi = 0.0
        while hi - lo > 1e-7:  # the prediction grows with α
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if predicted_speedup(mid, g, cost_ratio, v) >= 1 else (mid, hi)
        if best is None or hi < best[0] - 1e-9:
            best = (round(hi, 6), g)
    return best


def _speculative(run: dict[str, Any]) -> bool:
    """Whether a run drafts: ours at γ != 0 (fixed or auto), or HF assisted generation."""
    return run["num_draft_tokens"] != 0 if run["kind"] == OURS else run["method"].startswith("hf_assisted")


def _verify_costs(cost: dict[str, Any]) -> dict[int, float]:
    """``{γ: v_γ}`` of the cost measurement, with the auto-γ calibration's v_γ at batch size 1 for the γ it did not
    time (the calibration covers 1..--auto-max-gamma)."""
    calibrated = ((cost.get("auto_costs") or {}).get("1") or {}).get("verify") or []
    verify = {g: float(v) for g, v in enumerate(calibrated) if g >= 1}
    verify.update({int(e["gamma"]): float(e["relative_cost"]) for e in cost.get("verify") or []})
    return verify


def verdict(results: dict[str, Any]) -> dict[str, Any]:
    """Whether drafting pays off in this run: the best speculative method (ours at any γ != 0, compiled or not, and
    HF assisted generation) by measured speedup over plain decoding, per temperature and overall, with the pooled
    α, c, and the α a draft needs for a speedup by the verify-aware prediction (:func:`break_even_alpha` over the
    measured v_γ).

    Returns:
        ``{"drafting_wins" (best speedup > 1; None with no speculative speedup measured), "best_method",
        "temperature", "best_speedup", "alpha", "cost_ratio", "alpha_needed", "alpha_needed_gamma" (None when no
        α reaches a speedup at this c), "by_temperature": [the same keys per temperature]}``.
    """
    c = results["cost"]["cost_ratio"]
    needed = break_even_alpha(c, _verify_costs(results["cost"]))
    common = {"cost_ratio": c, "alpha_needed": needed[0] if needed else None,
              "alpha_needed_gamma": needed[1] if needed else None}
    by_t = []
    for s in results["summary"]:
        t = s["temperature"]
        spec = [r for r in results["runs"] if r["temperature"] == t and _speculative(r)
                and r["overall"]["speedup"] is not None]
        best = max(spec, key=lambda r: r["overall"]["speedup"], default=None)
        alpha = s["alpha"]
        if alpha is None:  # no fixed γ ran: the α of the adaptive runs
            alpha = next((r["overall"]["alpha"] for r in spec if r["kind"] == OURS), None)
        by_t.append({"temperature": t, "drafting_wins": None if best is None else best["overall"]["speedup"] > 1,
                     "best_method": None if best is None else best["method"],
                     "best_speedup": None if best is None else best["overall"]["speedup"], "alpha": alpha,
                     **common})
    top = max((e for e in by_t if e["best_speedup"] is not None), key=lambda e: e["best_speedup"],
              default=by_t[0] if by_t else {"temperature": None, "drafting_wins": None, "best_method": None,
                                            "best_speedup": None, "alpha": None, **common})
    return {**top, "by_temperature": by_t}


def verdict_lines(v: dict[str, Any]) -> list[str]:
    """One plain sentence per temperature: drafting wins (which method, how much) or loses (how much, the α a draft
    needs, what to do instead)."""
    lines = []
    for e in v["by_temperature"]:
        if e["drafting_wins"] is None:
            continue
        where = f"T={e['temperature']:g}, α = {_fmt(e['alpha'], '.2f')}, c = {e['cost_ratio']:.2f}"
        if e["drafting_wins"]:
            lines.append(f"drafting wins ({where}): {e['best_method']} runs at {e['best_speedup']:.2f}× plain "
                         "decoding")
            continue
        line = (f"drafting loses here ({where}): the best speculative method, {e['best_method']}, runs at "
                f"{e['best_speedup']:.2f}× plain decoding; ")
        if e["alpha_needed"] is None:
            line += ("by the verify-aware prediction no draft at this c gives a speedup on this hardware, even one "
                     "whose every token is accepted; use γ = 0 (plain decoding: --num-draft-tokens 0) or a cheaper "
                     "draft")
        else:
            line += (f"the verify-aware prediction says a draft needs α ≥ {e['alpha_needed']:.2f} for a speedup (at "
                     f"γ = {e['alpha_needed_gamma']}) on this hardware")
            if e["alpha"] is not None and e["alpha"] >= e["alpha_needed"]:
                line += ("; this draft's α reaches that, so the loss is the decoder's work beyond the forwards (see "
                         "the highlights)")
            line += ("; use γ = 0 (plain decoding: --num-draft-tokens 0) or train a better draft (python -m distill "
                     "train)")
        lines.append(line)
    return lines


# ----------------------------------------------------------------------------------------------- schema
SUMMARY_KEYS = ("temperature", "alpha", "cost_ratio", "best_gamma_measured", "measured_speedup_at_best",
                "best_gamma_leviathan", "predicted_speedup_leviathan_at_best", "best_gamma_leviathan_tested",
                "best_gamma_verify_aware_tested", "predicted_curve", "spec_auto_speedup", "hf_target_speedup",
                "hf_assisted_speedup", "auto_vs_best_fixed", "hf_assisted_fixed_speedup")
BATCH_KEYS = ("temperature", "method", "num_draft_tokens", "compiled", "batch_size", "num_batches", "num_new_tokens",
              "total_s", "tokens_per_s", "peak_memory_bytes", "reused_main_pass", "speedup")
TOP_KEYS = ("schema_version", "kind", "created", "config", "environment", "prompts", "cost", "runs", "summary",
            "batch", "records", "report")


def validate_results(results: dict[str, Any]) -> None:
    """Check a results dict (or loaded results.json) against schema version ``SCHEMA_VERSION``.

    Raises:
        ValueError: naming the first missing key, wrong version or wrong type.
    """
    def need(obj, keys, where):
        if not isinstance(obj, dict):
            raise ValueError(f"{where}: expected an object, got {type(obj).__name__}")
        missing = [k for k in keys if k not in obj]
        if missing:
            raise ValueError(f"{where}: missing keys {missing}")

    need(results, ("schema_version",), "results")
    if results["schema_version"] != SCHEMA_VERSION:
        raise ValueError(f"results: schema_version {results['schema_version']!r}, this code reads {SCHEMA_VERSION}")
    need(results, TOP_KEYS, "results")
    need(results["cost"], ("context_tokens", "target_forward_s", "draft_forward_s", "cost_ratio", "verify", "bare"),
         "cost")
    need(results["cost"]["bare"], ("target_forward_s", "draft_forward_s", "cost_ratio", "target_prefill_s",
                                   "draft_prefill_s", "prefill_cost_ratio", "few_row_linear"), "cost.bare")
    if not isinstance(results["runs"], list) or not results["runs"]:
        raise ValueError("results.runs: expected a non-empty list")
    for i, run in enumerate(results["runs"]):
        need(run, ("temperature", "method", "kind", "num_draft_tokens", "hf_num_assistant_tokens", "compiled",
                   "overall", "by_category"), f"runs[{i}]")
        need(run["overall"], RUN_METRICS, f"runs[{i}].overall")
        for cat, m in run["by_category"].items():
            need(m, RUN_METRICS, f"runs[{i}].by_category[{cat}]")
    for i, s in enumerate(results["summary"]):
        need(s, SUMMARY_KEYS, f"summary[{i}]")
    for i, b in enumerate(results["batch"]):
        need(b, BATCH_KEYS, f"batch[{i}]")
    for i, r in enumerate(results["report"]):
        need(r, ("temperature", "checks"), f"report[{i}]")


# ----------------------------------------------------------------------------------------------- output paths
@dataclass(frozen=True)
class OutputPaths:
    """Where a run writes: ``results`` (JSON) and one PNG per plot. ``--out X.json`` names the JSON file, its plots
    go beside it as ``X_<plot>.png``; any other ``--out DIR`` is a folder holding ``results.json`` and
    ``<plot>.png``."""

    results: Path
    plots: dict[str, Path]
    overwrite: bool = False

    @classmethod
    def plan(cls, out: str | os.PathLike, overwrite: bool = False) -> "OutputPaths":
        """Resolve and check ``out`` before any work starts, so a finished run can always be written.

        Raises:
            ValueError: naming the path and the fix, when the folder it goes into is missing, not a folder or not
                writable, or (without ``overwrite``) when a file it would write already exists.
        """
        out = Path(out).expanduser()  # as certify and loadtest do: a quoted ~ must not become a folder named ~
        if out.suffix.lower() == ".json":
            folder, results = out.parent, out
            plots = {name: folder / f"{out.stem}_{name}.png" for name in PLOTS}
        else:
            folder, results = out, out / "results.json"
            plots = {name: folder / f"{name}.png" for name in PLOTS}
        existing = next((p for p in (folder, *folder.parents) if p.exists()), Path("."))
        if not existing.is_dir():
            hint = "to write JSON there name it *.json" if existing == out else "choose another path"
            raise ValueError(f"--out {out}: {existing} is a file, not a folder; {hint}")
        if results == out and existing != folder:  # a folder --out is created at the end, X.json's must exist
            raise ValueError(f"--out {out}: folder {folder} does not exist; create it first or choose another path")
        if results.is_dir():
            raise ValueError(f"--out {out}: {results} is a folder; give a new file name or a folder without .json")
        if not writable(existing):  # a real probe file: os.access says yes to root even in /proc
            raise ValueError(f"--out {out}: cannot write into folder {existing} (read-only or not a real folder); "
                             "choose another path")
        taken = [str(p) for p in (results, *plots.values()) if p.exists()]
        if taken and not overwrite:
            raise ValueError(f"--out {out}: {', '.join(taken)} already exist(s); pass --overwrite to replace, or "
                             "choose another path")
        return cls(results, plots, overwrite)


def write_outputs(results: dict[str, Any], out: str | os.PathLike | OutputPaths,
                  overwrite: bool = False) -> dict[str, str]:
    """Add the highlights as ``report`` and the verdict as ``verdict``, write the JSON first (the run's value), then
    the PNG plots.

    Args:
        out: an ``OutputPaths`` planned before the run, or a path planned here (see ``OutputPaths.plan``).

    Returns:
        {"results": path, plot name: path}; plot paths are also stored in ``results["plots"]``.

    Raises:
        ValueError: bad ``out`` (see ``OutputPaths.plan``), results that fail ``validate_results``, or a write the
            file system refused (a full disk: no cut JSON is left, an earlier one is kept).
    """
    paths = out if isinstance(out, OutputPaths) else OutputPaths.plan(out, overwrite)
    plots = paths.plots
    taken = [p for p in (paths.results, *plots.values()) if p.exists()] if not paths.overwrite else []
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    if taken:  # made since the plan: keep them, and write this run's set beside them under one timestamp
        plots = {name: _stamped(p, stamp) for name, p in plots.items()}
        print(f"warning: {', '.join(map(str, taken))} appeared during the run and were kept; this run's outputs "
              "get a timestamped name", file=sys.stderr)
    results["report"] = highlights(results)
    results["verdict"] = verdict(results)
    results["plots"] = {name: str(p) for name, p in plots.items()}
    validate_results(results)
    paths.results.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(results, indent=1, default=_json_default) + "\n"
    written = _write_new(_stamped(paths.results, stamp) if taken else paths.results, text, paths.overwrite)
    for name, fn in PLOTS.items():
        fn(results, plots[name])
    return {"results": str(written), **results["plots"]}


def _stamped(path: Path, stamp: str | None = None) -> Path:
    """``path`` with a timestamp (default: now) before its suffix: where an output goes when ``path`` was taken
    during the run."""
    return path.with_name(f"{path.stem}.{stamp or _dt.datetime.now().strftime('%Y%m%d-%H%M%S')}{path.suffix}")


def _write_new(path: Path, text: str, overwrite: bool) -> Path:
    """Write ``text`` to ``path`` whole or not at all (:func:`decode.outputs.write_new_file`: a full disk is a
    ValueError and leaves no cut file, nor an emptied earlier one with ``overwrite``); if the file appeared since
    the run started (and ``overwrite`` is off), it is kept and ``text`` goes beside it under a new name."""
    written = write_new_file(text, path, overwrite)
    if written != path:
        print(f"warning: {path} appeared during the run; results written to {written}", file=sys.stderr)
    return written


def _json_default(x):
    if isinstance(x, torch.Tensor):
        return x.tolist()
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


# ----------------------------------------------------------------------------------------------- tables
def _fmt(x, spec=".2f", scale=1.0, none="-"):
    return none if x is None else format(x * scale, spec)


def _x(v) -> str:
    return _fmt(v) + ("x" if v is not None else "")


def render_tables(results: dict[str, Any], console=None) -> None:
    """Print the cost line, the per-temperature method tables, the summary, the category tables, the batch table,
    the highlights and the verdict (:func:`verdict_lines`) with rich. Raises ValueError for results that fail
    :func:`validate_results`."""
    from rich.console import Console

    validate_results(results)  # a file of another schema version is named, not a KeyError half-way
    # Not a terminal (logs, CI): wide enough that no column is cut.
    console = console or Console(width=None if sys.stdout.isatty() else 160)
    c = results["cost"]
    console.print(f"cost ratio c = {c['cost_ratio']:.3f}  (draft {c['draft_forward_s'] * 1e3:.2f} ms / target "
                  f"{c['target_forward_s'] * 1e3:.2f} ms per decode forward at {c['context_tokens']} tokens)")
    b = c.get("bare")
    if b:
        console.print(f"bare HF forwards: draft {b['draft_forward_s'] * 1e3:.2f} ms / target "
                      f"{b['target_forward_s'] * 1e3:.2f} ms = {b['cost_ratio']:.3f}")
        if b.get("prefill_cost_ratio") is not None:
            console.print(f"bare HF prefills of {c['context_tokens'] - 1} tokens: draft "
                          f"{b['draft_prefill_s'] * 1e3:.2f} ms / target {b['target_prefill_s'] * 1e3:.2f} ms = "
                          f"{b['prefill_cost_ratio']:.3f}")
    if c.get("verify"):
        console.print("verify cost v_γ = t(γ+1 tokens) / t(1 token): "
                      + ", ".join(f"γ={e['gamma']}: {e['relative_cost']:.2f}" for e in c["verify"]))
    k = c.get("compiled")
    if k:  # what the *_compiled rows' predictions use
        console.print(f"compiled forwards: c = {k['cost_ratio']:.3f}  (draft {k['draft_forward_s'] * 1e3:.2f} ms / "
                      f"target {k['target_forward_s'] * 1e3:.2f} ms)"
                      + ("; v_γ " + ", ".join(f"γ={e['gamma']}: {e['relative_cost']:.2f}" for e in k["verify"])
                         if k.get("verify") else "")
                      + "; the *_compiled predictions use these")
    for s in results["summary"]:
        _render_methods(results, s, console)
    _render_summary(results, console)
    for key, message in results.get("hf_failures", {}).items():
        console.print(f"not run: {key.split('/', 1)[1]} at T={float(key.split('/', 1)[0]):g}: Hugging Face's "
                      f"generate raised ({message})")
    _render_categories(results, console)
    _render_batch(results, console)
    _render_profile(results, console)
    if results.get("report"):
        _render_highlights(results, console)
    if results.get("compiled_graphs_during_timing"):
        console.print(f"[bold]note:[/] torch.compile built {results['compiled_graphs_during_timing']} graph(s) inside "
                      "timed runs: the *_compiled timings include compilation (shapes the warm-up did not meet)")
    for line in verdict_lines(results.get("verdict") or verdict(results)):  # last: what a first run wants to know
        console.print(line, style="bold", markup=False, highlight=False)


def _render_methods(results, s, console) -> None:
    from rich.table import Table

    t = s["temperature"]
    if s["best_gamma_measured"] is None:  # --gammas auto: nothing to rank
        best = "no fixed γ measured"
    else:
        best = (f"best γ: measured {s['best_gamma_measured']}, predicted {s['best_gamma_leviathan']} (among tested "
                f"{s['best_gamma_leviathan_tested']}, verify-aware {s['best_gamma_verify_aware_tested']})")
    table = Table(title=f"T={t:g}  α={_fmt(s['alpha'], '.3f')}  {best}")
    for col in ("method", "γ", "α", "τ", "chars/step", "TTFT ms", "ms/token", "tok/s", "speedup", "predicted",
                "pred. v-aware", "=greedy", "peak MiB"):
        table.add_column(col, justify="left" if col == "method" else "right")
    for run in (r for r in results["runs"] if r["temperature"] == t):
        m = run["overall"]
        g = run["num_draft_tokens"] if run["kind"] == OURS else run["hf_num_assistant_tokens"]
        if g == "auto" and m["mean_gamma"] is not None:
            g = f"auto ({m['mean_gamma']:.1f})"  # the mean γ the controller actually used
        table.add_row(run["method"], "-" if g is None else str(g), _fmt(m["alpha"], ".3f"),
                      _fmt(m["mean_accepted_length"]), _fmt(m.get("chars_per_verify_step"), ".1f"),
                      _fmt(m["ttft_s"], ".1f", 1e3),
                      _fmt(m["per_token_latency_s"], ".2f", 1e3), _fmt(m["tokens_per_s"], ".1f"), _x(m["speedup"]),
                      _x(m["predicted_speedup_leviathan"]), _x(m["predicted_speedup_verify_aware"]),
                      _fmt(m["matches_plain_greedy"], ".0%"), _fmt(m["peak_memory_bytes"], ".0f", 2 ** -20))
    console.print(table)


def _lookup_note(results, brackets: bool = False) -> str:
    """Names prompt lookup in a table title when our speculative runs used it (greedy runs only)."""
    config = results.get("config") or {}
    n = config.get("prompt_lookup_ngram")
    if not n or 0.0 not in (config.get("temperatures") or []):  # it drafts for greedy runs only
        return ""
    note = f"ours with prompt lookup (n = {n}) at T = 0, HF assisted without; its prediction counts γ draft forwards"
    return f" ({note})" if brackets else f"; {note}"


def _render_summary(results, console) -> None:
    """One row per temperature: ours (best fixed γ, auto) vs HF assisted, measured vs predicted."""
    from rich.table import Table

    compiled = (results["cost"].get("compiled") or {}).get("cost_ratio")
    compile_ = (results.get("config") or {}).get("compile")
    title = f"summary: speedup over plain decoding (c = {results['cost']['cost_ratio']:.3f}"
    title += f"; compiled c = {compiled:.3f}" if compiled is not None else ""
    table = Table(title=title + _lookup_note(results) + ")")
    cols = ("T", "α", "best γ meas.", "speedup", "best γ pred.", "predicted", "auto", "auto/best")
    own = "compiled" if compile_ == "draft" else "compiled over plain_compiled"
    for col in cols + ((f"{own}, best γ (pred. v-aware)",) if compiled is not None else ()) + ("HF assisted",
                                                                                               "HF target"):
        table.add_column(col, justify="right")
    for s in results["summary"]:
        hf = _x(s["hf_assisted_speedup"]) + "".join(f", γ={g}: {_x(v)}"
                                                    for g, v in s["hf_assisted_fixed_speedup"].items())
        row = [f"{s['temperature']:g}", _fmt(s["alpha"], ".3f"), _fmt(s["best_gamma_measured"], "g"),
               _x(s["measured_speedup_at_best"]), _fmt(s["best_gamma_leviathan"], "g"),
               _x(s["predicted_speedup_leviathan_at_best"]), _x(s["spec_auto_speedup"]), _fmt(s["auto_vs_best_fixed"])]
        if compiled is not None:  # the compiled decoder at the same best γ, against its own (compiled-c) prediction
            runs = {r["method"]: r["overall"] for r in results["runs"] if r["temperature"] == s["temperature"]}
            method = f"spec_g{s['best_gamma_measured']}_compiled"
            row.append("-" if method not in runs else
                       f"{_x(compiled_over_own_plain(runs, method, 'speedup', compile_))} "
                       f"({_x(runs[method]['predicted_speedup_verify_aware'])})")
        table.add_row(*row, hf, _x(s["hf_target_speedup"]))
    console.print(table)


def _render_categories(results, console) -> None:
    from rich.table import Table

    counts = results["prompts"]["categories"]
    cats = sorted(counts)
    if not cats:
        return
    if min(counts.values()) < 2:  # one prompt's ratio is that prompt's noise, not its category's
        few = [c for c in cats if counts[c] < 2]
        console.print(f"per-category tables left out: {len(few)} of {len(cats)} categories have one prompt "
                      f"({', '.join(few)}); runs[].by_category in the JSON keeps each category's numbers with its "
                      "num_prompts; --limit 2 prompts per category or more shows them", markup=False, highlight=False)
        return
    for s in results["summary"]:
        t, best = s["temperature"], s["best_gamma_measured"]
        shown = ([f"spec_g{best}"] if best else []) + ["spec_auto", "hf_assisted"]
        runs = {r["method"]: r for r in results["runs"] if r["temperature"] == t and r["method"] in shown}
        table = Table(title=f"T={t:g} by category: α / speedup")
        table.add_column("category")
        table.add_column("n", justify="right")
        shown = [name for name in shown if name in runs]
        for name in shown:
            table.add_column(name, justify="right")
        for cat in cats:
            cells = []
            for name in shown:
                m = runs[name]["by_category"].get(cat, {})
                cells.append(f"{_fmt(m.get('alpha'), '.2f')} / {_fmt(m.get('speedup'))}x")
            table.add_row(cat, str(results["prompts"]["categories"][cat]), *cells)
        console.print(table)


def _render_batch(results, console) -> None:
    from rich.table import Table

    if not results["batch"]:
        return
    predicted = any(b.get("predicted_speedup") is not None for b in results["batch"])
    table = Table(title="batch throughput (our engine; speedup over plain at the same batch size and batching"
                        + ("; predicted: with no cost beyond the forwards, static batches)" if predicted else ")"))
    for col in ("T", "method", "batching", "batch", "tok/s", "speedup") + (("predicted",) if predicted else ()):
        table.add_column(col, justify="right")
    for b in sorted(results["batch"], key=lambda b: (b["temperature"], batching_of(b) != "static", b["batch_size"],
                                                     b["method"] != "plain")):
        table.add_row(f"{b['temperature']:g}", b["method"], batching_of(b), str(b["batch_size"]),
                      _fmt(b["tokens_per_s"], ".1f"), _fmt(b["speedup"]),
                      *((_fmt(b.get("predicted_speedup")),) if predicted else ()))
    console.print(table)


def profile_rows(results: dict[str, Any], temperature: float) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """The per-step breakdown of the runs profiled at ``temperature`` (``--profile``): (method names, rows of
    (label, a cell per method)). One row per part of ``decode.profile.PARTS`` any of them entered (ms per step),
    the whole step, then the forwards the bench measures without the engine (the bare HF forwards) and through it
    (the cost measurement), and c, the same in every column: what a step spends beyond its forwards shows against
    them."""
    runs = [r for r in results["runs"] if r["temperature"] == temperature and r.get("profile")]
    names = [r["method"] for r in runs]
    rows = []
    for part in PARTS:
        if any(part in r["profile"]["parts"] for r in runs):
            rows.append((part, [_fmt((r["profile"]["parts"].get(part) or {}).get("ms_per_step"), ".2f", none="0")
                                for r in runs]))
    rows.append(("step (all parts)", [_fmt(r["profile"]["step_ms"]) for r in runs]))
    rows.append(("steps", [str(r["profile"]["steps"]) for r in runs]))
    cost, bare = results["cost"], results["cost"].get("bare") or {}
    for label, value, spec, scale in (("bare HF target forward (1 token)", bare.get("target_forward_s"), ".2f", 1e3),
                                      ("bare HF draft forward (1 token)", bare.get("draft_forward_s"), ".2f", 1e3),
                                      ("engine target forward (1 token)", cost["target_forward_s"], ".2f", 1e3),
                                      ("engine draft forward (1 token)", cost["draft_forward_s"], ".2f", 1e3),
                                      ("c (engine)", cost["cost_ratio"], ".3f", 1.0),
                                      ("c (bare HF)", bare.get("cost_ratio"), ".3f", 1.0)):
        rows.append((label, [_fmt(value, spec, scale)] * len(runs)))
    return names, rows


def _render_profile(results, console) -> None:
    """With ``--profile``: one table per temperature, a column per profiled method, a row per part (ms per step)."""
    from rich.table import Table

    for s in results["summary"]:
        names, rows = profile_rows(results, s["temperature"])
        if not names:
            continue
        table = Table(title=f"per-step breakdown (ms per step), T={s['temperature']:g}: the main pass's steps by "
                            "part; below the line, the one-token forwards the bench times, and c")
        table.add_column("part")
        for name in names:
            table.add_column(name, justify="right")
        for label, cells in rows:
            table.add_row(label, *cells, end_section=label == "steps")
        console.print(table)


def _gamma(ck, prefix: str = "") -> str:
    return "no fixed γ measured" if ck["gamma"] is None else f"{prefix}γ={ck['gamma']}"


def _compiled(ck) -> str:
    return "draft only" if ck.get("compile") == "draft" else "both"


_LABELS = {
    "cost_ratio_vs_bare": lambda ck: "engine c / bare HF forward ratio",
    "measured_vs_verify_aware": lambda ck: f"speedup / verify-aware prediction, {_gamma(ck, 'best ')}",
    "measured_vs_end_to_end": lambda ck: f"speedup / verify-aware prediction with the prefill, {_gamma(ck)}",
    "decode_vs_verify_aware": lambda ck: f"decode-phase speedup / verify-aware prediction, {_gamma(ck)}",
    "cost_ratio_compiled_vs_bare": lambda ck: f"compiled ({_compiled(ck)}) c / bare HF forward ratio",
    "measured_compiled_vs_verify_aware": lambda ck: (f"compiled ({_compiled(ck)}) speedup / its verify-aware "
                                                     f"prediction, {_gamma(ck)}"),
    "measured_compiled_vs_end_to_end": lambda ck: (f"compiled ({_compiled(ck)}) speedup / its verify-aware "
                                                   f"prediction with the prefill, {_gamma(ck)}"),
    "decode_compiled_vs_verify_aware": lambda ck: (f"compiled ({_compiled(ck)}) decode-phase speedup / its "
                                                   f"verify-aware prediction, {_gamma(ck)}"),
    "ours_vs_hf_assisted": lambda ck: (f"ours / HF assisted speedup, γ={ck['gamma']} (analytic bound "
                                       f"{_fmt(ck.get('analytic_bound'))})"),
    "ours_compiled_vs_hf_assisted": lambda ck: (f"ours compiled ({_compiled(ck)}) / HF assisted speedup, "
                                                f"γ={ck['gamma']}"),
    "batch_speedup": lambda ck: (f"batch {ck['batch_size']} tok/s, γ={ck['gamma']} / plain"
                                 + (f" (predicted {_fmt(ck['predicted'])})" if ck.get("predicted") is not None
                                    else "")),
    "batch_continuous_speedup": lambda ck: (f"continuous batching, {ck['batch_size']} at a time, tok/s, "
                                            f"γ={ck['gamma']} / plain"),
    "auto_vs_best_fixed": lambda ck: (f"auto γ / best fixed γ={ck['gamma']} speedup" if ck["gamma"] is not None
                                      else "auto γ / best fixed γ speedup: no fixed γ measured"),
}


def _render_highlights(results, console) -> None:
    """The highlights, one row each: ours, the reference and their ratio."""
    from rich.table import Table

    table = Table(title="highlights: ours / reference" + _lookup_note(results, brackets=True))
    for col in ("T", "comparison", "ours", "reference", "ratio"):
        table.add_column(col, justify="left" if col == "comparison" else "right")
    for entry in results["report"]:
        for ck in entry["checks"]:  # the ratio to 3 places: 0.9469 is not 0.95
            digits = ".3f" if ck["name"].startswith("cost_ratio") else ".2f"
            table.add_row(f"{entry['temperature']:g}", _LABELS[ck["name"]](ck), _fmt(ck["ours"], digits),
                          _fmt(ck["reference"], digits), _fmt(ck["ratio"], ".3f"))
    console.print(table)
