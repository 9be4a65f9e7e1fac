"""Measure the decoder's few-row linear kernels (:mod:`decode.kernels`) on a trained pair, on and off side by side.

    python scripts/measure_few_row_linear.py --pair checkpoints/quickstart --out checkpoints/few_row_linear
    python scripts/measure_few_row_linear.py --pair checkpoints/quickstart --out /tmp/frl --limit 1 --rounds 1

0. Linear forms: the time of one pass over every ``nn.Linear`` weight of the target (streamed from memory, as in a
   forward) with ``--linear-rows`` rows, for each form the kernels choose between (``F.linear``,
   :func:`decode.kernels.transposed_linear`, :func:`decode.kernels.packed_linear` where oneDNN is present),
   alternating forms, median of ``--linear-repeats`` passes.
1. Forward costs through the engine's forward path (:func:`decode.costs.measure_cost_ratio`, the function the
   recipe, the quickstart and the bench use): target and draft single-token forwards and the target's verify
   forwards of γ+1 tokens (v_γ), with the kernels on and off, alternating rounds.
2. End to end: for each prompt of the quickstart's held-out sets (``--limit`` per set) and each temperature, plain
   and speculative decoding, each with the kernels on and off (``SpeculativeDecoder(few_row_linear=...)``), in a
   rotated order, same seed for every method, each call timed by :func:`decode.bench.runs.run_ours` after one
   short warm-up call per decoder; ``--rounds`` passes. Tokens/s over the same prompts; speedup =
   Σ plain wall / Σ speculative wall on the same side; at T = 0 every output must equal plain greedy decoding
   with the kernels off (``greedy_equal``).

γ per temperature: ``--gammas`` (e.g. ``0:8,1:7``), else what the pair's quickstart results.json chose for the
distilled draft, else 4. Prints a table and writes ``<out>/results.json`` (refused if it exists). Run it alone on
the machine (two torch processes on 2 cores disturb each other's timings).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SETS = ("humaneval", "mbpp_code", "stdlib")


def parse_gammas(text: str | None, pair: Path) -> dict[float, int]:
    """``{temperature: γ}`` from ``"T:γ,T:γ"``, else from the pair's results.json, else ``{0: 4, 1: 4}``.

    Raises:
        ValueError: a part that is not ``T:γ`` with γ >= 1 (the CLI turns it into exit status 2)."""
    if text:
        out = {}
        for part in text.split(","):
            t, _, g = part.partition(":")
            try:
                out[float(t)] = int(g)
            except ValueError:
                raise ValueError(f"--gammas: {part!r} is not T:γ (e.g. 0:8,1:7)") from None
            if out[float(t)] < 1:
                raise ValueError(f"--gammas: γ must be >= 1 (got {part!r})")
        return out
    results = pair / "results.json"
    if results.is_file():
        chosen = json.loads(results.read_text()).get("eval", {}).get("gammas", {}).get("distilled")
        if chosen:
            return {float(t): int(g) for t, g in chosen.items()}
    return {0.0: 4, 1.0: 4}


def parse_rows(text: str) -> list[int]:
    """``"1,2,8"`` -> ``[1, 2, 8]``. Raises ValueError (exit status 2) for a part that is not an integer in 1..64."""
    from decode import kernels

    out = []
    for part in text.split(","):
        try:
            n = int(part)
        except ValueError:
            raise ValueError(f"--linear-rows: {part!r} is not an integer") from None
        if not kernels.MIN_ROWS <= n <= kernels.MAX_ROWS:
            raise ValueError(f"--linear-rows: {n} is outside {kernels.MIN_ROWS}..{kernels.MAX_ROWS} (the kernels' "
                             f"range)")
        out.append(n)
    return out


def linear_forms(model, rows: list[int], repeats: int) -> dict:
    """Milliseconds for one pass over all of ``model``'s ``nn.Linear`` weights per form and row count (medians)."""
    import time

    import torch.nn.functional as F

    from decode import kernels

    layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    original = F.linear  # taken before the block below, which installs the kernels in its place
    forms = {"f_linear": original, "transposed": kernels.transposed_linear}
    if kernels.onednn_available():
        forms["packed"] = kernels.packed_linear
    out = {name: {} for name in forms}
    with torch.no_grad(), kernels.few_row_linear():  # the block keeps the packed copies, as the engine's does
        for n in rows:
            xs = {m.in_features: torch.randn(n, m.in_features) for m in layers}
            samples = {name: [] for name in forms}
            for i in range(repeats + 2):
                for name, fn in forms.items():
                    t0 = time.perf_counter()
                    for m in layers:
                        fn(xs[m.in_features], m.weight, m.bias)
                    if i >= 2:  # the first passes pack the weights and warm the allocator
                        samples[name].append(1e3 * (time.perf_counter() - t0))
            for name in forms:
                out[name][n] = statistics.median(samples[name])
    return {"num_linear_layers": len(layers), "ms": out}


def forward_costs(target, draft, context: torch.Tensor, repeats: int, max_gamma: int, rounds: int) -> dict:
    """Engine-path forward costs with the kernels on and off, ``rounds`` alternating measurements each."""
    from decode import kernels
    from decode.costs import measure_cost_ratio

    out: dict[str, list] = {"on": [], "off": []}
    for _ in range(rounds):
        for label in ("on", "off"):
            with kernels.few_row_linear(label == "on"):
                m = measure_cost_ratio(target, draft, context, repeats=repeats, verify_gammas=range(1, max_gamma + 1))
            out[label].append({"target_forward_ms": 1e3 * m["target_forward_s"],
                               "draft_forward_ms": 1e3 * m["draft_forward_s"], "cost_ratio": m["cost_ratio"],
                               "verify_forward_ms": {v["gamma"]: 1e3 * v["forward_s"] for v in m["verify"]},
                               "verify_relative_cost": {v["gamma"]: v["relative_cost"] for v in m["verify"]}})
    return out


def end_to_end(target, draft, tokenizer, prompts, gammas: dict[float, int], max_new_tokens: int,
               rounds: int) -> dict:
    """Σ wall seconds per (temperature, method) over every prompt and round, and the greedy-equality count."""
    from decode import SpeculativeDecoder
    from decode.bench.config import OURS, BenchConfig, Method
    from decode.bench.runs import run_ours
    from decode.engine import left_pad
    from decode.metrics import DecodeStats

    device = next(target.parameters()).device
    cfg = BenchConfig(gammas=sorted(set(gammas.values())), auto=False, temperatures=list(gammas),
                      max_new_tokens=max_new_tokens, hf=False, ignore_eos=True)
    decs = {"plain_on": SpeculativeDecoder(target, None, 0, few_row_linear=True),
            "plain_off": SpeculativeDecoder(target, None, 0, few_row_linear=False),
            "spec_on": SpeculativeDecoder(target, draft, 4, tokenizer=tokenizer, few_row_linear=True),
            "spec_off": SpeculativeDecoder(target, draft, 4, tokenizer=tokenizer, few_row_linear=False)}
    methods = list(decs)
    k = len(methods)

    def method(m: str, t: float) -> Method:
        return Method(m, OURS, 0 if m.startswith("plain") else gammas[t])

    for m, dec in decs.items():  # warm-up: allocator growth and lazy init stay out of the timings
        ids, mask = left_pad(prompts[:1], tokenizer.pad_token_id, device)
        t = next(iter(gammas))
        run_ours(dec, method(m, t), ids, mask, t, BenchConfig(**{**cfg.__dict__, "max_new_tokens": 4}), None, 0,
                 device)
    wall = {(t, m): 0.0 for t in gammas for m in methods}
    stats = {(t, m): [] for t in gammas for m in methods}
    equal, compared = 0, 0
    for r in range(rounds):
        for i, prompt in enumerate(prompts):
            ids, mask = left_pad([prompt], tokenizer.pad_token_id, device)
            for t in gammas:
                order = methods[(i + r) % k:] + methods[:(i + r) % k]  # rotate: drift hits all
                outs = {}
                for m in order:
                    outs[m], w, st, _ = run_ours(decs[m], method(m, t), ids, mask, t, cfg, None, 1_000_003 * r + i,
                                                 device)
                    wall[(t, m)] += w
                    stats[(t, m)].append(st)
                if t == 0:
                    for m in ("plain_on", "spec_on", "spec_off"):
                        equal += int(outs[m] == outs["plain_off"])
                        compared += 1
    rows = []
    for t, g in gammas.items():
        tokens = sum(s.num_new_tokens for s in stats[(t, "plain_off")])
        row = {"temperature": t, "num_draft_tokens": g, "new_tokens": tokens}
        for m in methods:
            row[m] = {"wall_s": wall[(t, m)], "tokens_per_s": tokens / wall[(t, m)]}
            if m.startswith("spec"):
                st = DecodeStats.merge(stats[(t, m)])
                row[m].update(speedup=wall[(t, "plain_" + m.split("_")[1])] / wall[(t, m)], alpha=st.alpha,
                              mean_accepted_length=st.mean_accepted_length)
        row["plain_on_over_off"] = wall[(t, "plain_off")] / wall[(t, "plain_on")]
        row["spec_on_over_off"] = wall[(t, "spec_off")] / wall[(t, "spec_on")]
        row["spec_on_over_plain_off"] = wall[(t, "plain_off")] / wall[(t, "spec_on")]
        rows.append(row)
    return {"rows": rows, "greedy_equal": [equal, compared]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pair", type=Path, default=REPO / "checkpoints" / "quickstart",
                   help="a quickstart output folder: target/, draft-distilled/, tokenizer/")
    p.add_argument("--out", type=Path, required=True, help="folder for results.json (must not hold one)")
    p.add_argument("--limit", type=int, default=3, help="prompts per held-out set (3 sets)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2, help="passes over the prompts (and forward-cost rounds)")
    p.add_argument("--gammas", help="γ per temperature, e.g. 0:8,1:7 (default: the pair's quickstart choice)")
    p.add_argument("--cost-repeats", type=int, default=11)
    p.add_argument("--linear-rows", default="1,2,3,4,8,12,20,40", help="row counts of the linear-forms pass")
    p.add_argument("--linear-repeats", type=int, default=12)
    args = p.parse_args(argv)
    for name in ("limit", "max_new_tokens", "rounds", "cost_repeats", "linear_repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    missing = [d for d in ("target", "draft-distilled", "tokenizer") if not (args.pair / d).is_dir()]
    if missing:
        p.error(f"--pair {args.pair} lacks {', '.join(missing)}: give a quickstart output folder")
    from decode.outputs import check_output_folder

    try:
        check_output_folder(args.out)
    except ValueError as e:
        p.error(str(e))
    result_path = args.out / "results.json"
    try:
        gammas = parse_gammas(args.gammas, args.pair)
        linear_rows = parse_rows(args.linear_rows)
    except ValueError as e:
        p.error(str(e))
    args.out.mkdir(parents=True, exist_ok=True)

    from transformers import AutoTokenizer

    from quickstart.run import _load_lm, encode_prompt_sets

    tokenizer = AutoTokenizer.from_pretrained(str(args.pair / "tokenizer"))
    target, draft = _load_lm(args.pair / "target", "target"), _load_lm(args.pair / "draft-distilled")
    prompts = [ids for _, ids in encode_prompt_sets(tokenizer, {s: args.limit for s in SETS}, 192)]
    context = torch.tensor([(prompts[0] * 2)[-64:]])
    forms = linear_forms(target, linear_rows, args.linear_repeats)
    costs = forward_costs(target, draft, context, args.cost_repeats, max(gammas.values()), args.rounds)
    e2e = end_to_end(target, draft, tokenizer, prompts, gammas, args.max_new_tokens, args.rounds)
    result = {"pair": str(args.pair), "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
              "rounds": args.rounds, "torch": torch.__version__, "threads": torch.get_num_threads(),
              "linear_forms": forms, "forward_costs": costs, "end_to_end": e2e}
    result_path.write_text(json.dumps(result, indent=1))

    def med(label, key):
        return statistics.median(r[key] for r in costs[label])

    print(f"linear forms (ms per pass over the target's {forms['num_linear_layers']} linear weights, median of "
          f"{args.linear_repeats})")
    print(f"  {'rows':<10}" + "".join(f"{n:>8d}" for n in linear_rows))
    for name, by_rows in forms["ms"].items():
        print(f"  {name:<10}" + "".join(f"{by_rows[n]:8.2f}" for n in linear_rows))
    print(f"forward costs (ms, median of {args.rounds} rounds x {args.cost_repeats} repeats; on / off)")
    print(f"  target 1 token {med('on', 'target_forward_ms'):.2f} / {med('off', 'target_forward_ms'):.2f}   "
          f"draft 1 token {med('on', 'draft_forward_ms'):.2f} / {med('off', 'draft_forward_ms'):.2f}")
    for g in range(1, max(gammas.values()) + 1):
        on = statistics.median(r["verify_forward_ms"][g] for r in costs["on"])
        off = statistics.median(r["verify_forward_ms"][g] for r in costs["off"])
        print(f"  verify γ={g} ({g + 1} tokens) {on:.2f} / {off:.2f}")
    print(f"end to end ({len(prompts)} prompts x {args.rounds} rounds, {args.max_new_tokens} new tokens)")
    print("  T   γ  tok/s plain off/on  spec off/on  | speedup over plain, off / on | on/off plain, spec | α off / on")
    for r in e2e["rows"]:
        print(f"  {r['temperature']:<3g} {r['num_draft_tokens']:<2d} {r['plain_off']['tokens_per_s']:>8.1f} / "
              f"{r['plain_on']['tokens_per_s']:<6.1f} {r['spec_off']['tokens_per_s']:>6.1f} / "
              f"{r['spec_on']['tokens_per_s']:<6.1f} | {r['spec_off']['speedup']:>6.3f} / {r['spec_on']['speedup']:<6.3f}"
              f"             | {r['plain_on_over_off']:.3f}, {r['spec_on_over_off']:.3f}     | "
              f"{r['spec_off']['alpha']:.3f} / {r['spec_on']['alpha']:.3f}")
    eq, n = e2e["greedy_equal"]
    print(f"greedy equal to plain decoding with the kernels off (plain on, spec on and spec off at T = 0, each prompt "
          f"and round): {eq}/{n}; wrote {result_path}")
    return 0 if eq == n else 1


if __name__ == "__main__":
    sys.exit(main())
