"""PNG plots of a benchmark results dict (``decode.bench.run_benchmark``): speedup vs γ, predicted vs measured
speedup, acceptance by draft position, and batch throughput (``PLOTS``: name -> function(results, path)).

Figures are built with ``matplotlib.figure.Figure`` and the Agg canvas, never pyplot, so no display and no global
figure state are involved (safe in servers, tests and headless machines). matplotlib is imported inside the
plotting functions: ``decode.bench`` (and ``distill``, through ``decode.bench.measure``) loads without it.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from decode.bench.pool import batching_of

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def _figure(width: float = 6.4, height: float = 4.2) -> Figure:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(fig)
    return fig


def _integer_ticks():
    from matplotlib.ticker import MaxNLocator

    return MaxNLocator(integer=True)


def _fixed_runs(results: dict[str, Any], temperature: float) -> list[dict[str, Any]]:
    # Eager runs only: a compiled twin has the same acceptance and would draw a second point per γ on one line.
    runs = [r for r in results["runs"] if r["temperature"] == temperature and isinstance(r["num_draft_tokens"], int)
            and r["num_draft_tokens"] > 0 and not r.get("compiled")]
    return sorted(runs, key=lambda r: r["num_draft_tokens"])


def _run(results, temperature, method):
    hit = [r for r in results["runs"] if r["temperature"] == temperature and r["method"] == method]
    return hit[0] if hit else None


def plot_speedup_vs_gamma(results: dict[str, Any], path: str | os.PathLike) -> str:
    """Measured speedup over plain decoding per γ (solid, one line per temperature), Leviathan-predicted speedup
    from the pooled α and measured c (dashed), HF assisted generation at fixed γ (crosses), γ="auto" and HF
    assisted generation with its own settings as horizontal reference lines."""
    fig = _figure()
    ax = fig.add_subplot()
    colors = {}
    for s in results["summary"]:
        t = s["temperature"]
        runs = _fixed_runs(results, t)
        pts = [(r["num_draft_tokens"], r["overall"]["speedup"]) for r in runs if r["overall"]["speedup"] is not None]
        if pts:
            (line,) = ax.plot(*zip(*pts), "o-", label=f"measured T={t:g}")
            colors[t] = line.get_color()
        curve = s.get("predicted_curve") or []
        # The stored curve runs to γ=16; show it only around the tested γs and the predicted optimum.
        top = max([g for g, _ in pts] + [s.get("best_gamma_leviathan") or 0]) + 1
        curve = [c for c in curve if c["gamma"] <= top]
        if curve:
            ax.plot([c["gamma"] for c in curve], [c["predicted_speedup_leviathan"] for c in curve], "--",
                    color=colors.get(t),
                    alpha=0.8, label=f"predicted T={t:g} (α={s['alpha']:.2f})")
        hf_fixed = [(r["hf_num_assistant_tokens"], r["overall"]["speedup"]) for r in results["runs"]
                    if r["temperature"] == t and r["kind"] == "hf" and r.get("hf_num_assistant_tokens")
                    and r["overall"]["speedup"] is not None]
        if hf_fixed:
            ax.plot(*zip(*hf_fixed), "x", markersize=9, color=colors.get(t), label=f"hf_assisted fixed γ T={t:g}")
        for name, style in (("spec_auto", ":"), ("hf_assisted", "-.")):
            run = _run(results, t, name)
            if run and run["overall"]["speedup"] is not None:
                ax.axhline(run["overall"]["speedup"], linestyle=style, color=colors.get(t), alpha=0.6,
                           label=f"{name} T={t:g}")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.xaxis.set_major_locator(_integer_ticks())
    ax.set_xlabel("γ (num_draft_tokens)")
    ax.set_ylabel("speedup over plain decoding (tokens/s ratio)")
    ax.set_title(f"speedup vs γ (c = {results['cost']['cost_ratio']:.3f})")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def plot_predicted_vs_measured(results: dict[str, Any], path: str | os.PathLike) -> str:
    """One point per speculative run (fixed γ and auto, per temperature): predicted speedup against measured,
    with the y = x line; points below it mean the cost model is optimistic (overheads it does not see). Hollow
    markers: the verify-aware prediction (measured cost of the (γ+1)-token verify forward)."""
    fig = _figure(5.2, 5.0)
    ax = fig.add_subplot()
    values = []
    for s in results["summary"]:
        t = s["temperature"]
        runs = [r for r in results["runs"]
                if r["temperature"] == t and r["overall"]["predicted_speedup_leviathan"] is not None
                and r["overall"]["speedup"] is not None]
        if not runs:
            continue
        xs = [r["overall"]["predicted_speedup_leviathan"] for r in runs]
        ys = [r["overall"]["speedup"] for r in runs]
        points = ax.scatter(xs, ys, label=f"T={t:g} (Leviathan)")
        for r, x, y in zip(runs, xs, ys):
            ax.annotate(f"γ={r['num_draft_tokens']}", (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        aware = [(r["overall"]["predicted_speedup_verify_aware"], r["overall"]["speedup"]) for r in runs
                 if r["overall"].get("predicted_speedup_verify_aware") is not None]
        if aware:
            ax.scatter(*zip(*aware), facecolors="none", edgecolors=points.get_facecolor(),
                       label=f"T={t:g} (verify-aware)")
            values += [x for x, _ in aware]
        values += xs + ys
    lo, hi = (min(values + [1.0]) * 0.9, max(values + [1.0]) * 1.1) if values else (0.5, 2.0)
    ax.plot([lo, hi], [lo, hi], color="grey", linewidth=0.8, label="measured = predicted")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("predicted speedup (Leviathan et al. 2023)")
    ax.set_ylabel("measured speedup")
    ax.set_title("predicted vs measured speedup")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def plot_acceptance_by_position(results: dict[str, Any], path: str | os.PathLike) -> str:
    """P(draft position i accepted) per fixed-γ run, one panel per temperature; the i.i.d. model predicts α^i."""
    temps = [s["temperature"] for s in results["summary"]]
    fig = _figure(4.2 * max(1, len(temps)), 3.8)
    for k, s in enumerate(results["summary"]):
        ax = fig.add_subplot(1, max(1, len(temps)), k + 1)
        for r in _fixed_runs(results, s["temperature"]):
            acc = r["overall"]["acceptance_by_position"]
            if acc:
                ax.plot(range(1, len(acc) + 1), acc, "o-", label=f"γ={r['num_draft_tokens']}")
        if s["alpha"] is not None:
            n = max([len(r["overall"]["acceptance_by_position"] or []) for r in _fixed_runs(results, s["temperature"])]
                    + [1])
            ax.plot(range(1, n + 1), [s["alpha"] ** i for i in range(1, n + 1)], "k--", alpha=0.6,
                    label=f"α^i, α={s['alpha']:.2f}")
        ax.set_ylim(0, 1.02)
        ax.xaxis.set_major_locator(_integer_ticks())
        ax.set_xlabel("draft position i")
        ax.set_ylabel("fraction of verify steps accepting position i")
        ax.set_title(f"T={s['temperature']:g}")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        else:  # --gammas auto: no fixed-γ run has positions to show
            ax.text(0.5, 0.5, "no fixed γ measured", ha="center", va="center", transform=ax.transAxes)
        ax.grid(alpha=0.3)
    return _save(fig, path)


def plot_batch_throughput(results: dict[str, Any], path: str | os.PathLike) -> str:
    """Tokens/s against batch size for plain and speculative decoding, per temperature and batching (continuous
    lines dotted)."""
    fig = _figure()
    ax = fig.add_subplot()
    keys = sorted({(b["temperature"], b["method"], batching_of(b)) for b in results["batch"]})
    for t, method, batching in keys:
        rows = sorted((b for b in results["batch"] if b["temperature"] == t and b["method"] == method
                       and batching_of(b) == batching), key=lambda b: b["batch_size"])
        pts = [(b["batch_size"], b["tokens_per_s"]) for b in rows if b["tokens_per_s"]]
        style = ("o" if method == "plain" else "s") + ("-" if batching == "static" else ":")
        if pts:
            ax.plot(*zip(*pts), style, label=f"{method} T={t:g}" + ("" if batching == "static" else " continuous"))
    ax.xaxis.set_major_locator(_integer_ticks())
    ax.set_xlabel("batch size")
    ax.set_ylabel("tokens/s (all rows)")
    ax.set_title("batch throughput")
    if keys:
        ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return _save(fig, path)


PLOTS = {
    "speedup_vs_gamma": plot_speedup_vs_gamma,
    "predicted_vs_measured": plot_predicted_vs_measured,
    "acceptance_by_position": plot_acceptance_by_position,
    "batch_throughput": plot_batch_throughput,
}


def _save(fig: Figure, path: str | os.PathLike) -> str:
    fig.tight_layout()
    fig.savefig(path)
    return str(path)
