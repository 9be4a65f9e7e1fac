"""Measure auto γ on static batches (``SpeculativeDecoder.generate`` over several prompts) against plain decoding
and fixed γ, with the static-batch planner on and off side by side.

    python scripts/measure_auto_batch.py --pair checkpoints/quickstart --out checkpoints/auto_batch
    python scripts/measure_auto_batch.py --pair checkpoints/quickstart --out /tmp/ab --limit 4 --rounds 1

A batch's rows all wait for the last one. ``auto`` (planner on) chooses γ each step from every row's own
acceptance and remaining budget (:meth:`decode.speedup.AdaptiveGamma.plan_batch`); ``auto_pooled`` is the same
controller choosing from the pooled α (``plan_static_batches = False``), the choice before the planner. Both share
one cost model (measured once by ``calibrate`` for batch sizes 1..max and reused). For each temperature, batch size
and group of consecutive prompts (the quickstart's held-out sets, ``--limit`` per set, interleaved so that a
batch mixes them), every method decodes the
group with ``--max-new-tokens`` new tokens and no eos, in a rotated order, ``--rounds`` passes. Speedup =
Σ plain wall / Σ method wall over the same groups; at T = 0 every output must equal plain decoding's. Prints a
table and writes ``<out>/results.json`` (refused if it exists). Run it alone on the machine.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SETS = ("humaneval", "mbpp_code", "stdlib")


def parse_ints(text: str, flag: str, low: int) -> list[int]:
    """``"2,4"`` -> ``[2, 4]``. Raises ValueError (exit status 2) for a part that is not an integer >= ``low``."""
    out = []
    for part in text.split(","):
        try:
            value = int(part)
        except ValueError:
            raise ValueError(f"{flag}: {part!r} is not an integer") from None
        if value < low:
            raise ValueError(f"{flag}: {value} must be >= {low}")
        out.append(value)
    return sorted(set(out))


def parse_temperature(text: str) -> float:
    """One temperature. Raises ValueError (exit status 2) for text that is not a number."""
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"--temperatures: {text!r} is not a number") from None


def measure(target, draft, tokenizer, prompts: list[list[int]], batch_sizes: list[int], gammas: list[int],
            temperatures: list[float], max_new_tokens: int, rounds: int, max_auto: int) -> dict:
    """Σ wall seconds and stats per (temperature, batch size, method); greedy equality at T = 0."""
    from decode import SpeculativeDecoder
    from decode.engine import left_pad
    from decode.metrics import DecodeStats
    from decode.speedup import cost_buckets

    device = next(target.parameters()).device
    decs = {"plain": SpeculativeDecoder(target, None, 0)}
    decs.update({f"g{g}": SpeculativeDecoder(target, draft, g, tokenizer=tokenizer) for g in gammas})
    planned = SpeculativeDecoder(target, draft, "auto", tokenizer=tokenizer, max_auto_draft_tokens=max_auto)
    costs = planned.calibrate(prompts[0], batch_sizes=cost_buckets(max(batch_sizes)))
    pooled = SpeculativeDecoder(target, draft, "auto", tokenizer=tokenizer, max_auto_draft_tokens=max_auto,
                                auto_costs=costs)
    pooled.plan_static_batches = False
    decs.update(auto=planned, auto_pooled=pooled)
    methods = list(decs)
    ids, mask = left_pad(prompts[:2], tokenizer.pad_token_id, device)
    for dec in decs.values():  # warm-up: lazy init and allocator growth stay out of the timings
        dec.generate(ids, attention_mask=mask, max_new_tokens=4)
    wall = {}
    stats: dict = {}
    equal = compared = 0
    for r in range(rounds):
        for t in temperatures:
            for b in batch_sizes:
                groups = [prompts[i:i + b] for i in range(0, len(prompts) - b + 1, b)]
                for gi, group in enumerate(groups):
                    ids, mask = left_pad(group, tokenizer.pad_token_id, device)
                    k = (gi + r) % len(methods)
                    outs = {}
                    for m in methods[k:] + methods[:k]:  # rotate: drift hits every method
                        gen = torch.Generator().manual_seed(1_000_003 * r + gi)
                        t0 = time.perf_counter()
                        out = decs[m].generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                               temperature=t, generator=gen)
                        wall[(t, b, m)] = wall.get((t, b, m), 0.0) + time.perf_counter() - t0
                        stats.setdefault((t, b, m), []).append(out.stats)
                        outs[m] = [x.tolist() for x in out.new_tokens]
                    if t == 0:
                        for m in methods[1:]:
                            equal += int(outs[m] == outs["plain"])
                            compared += 1
    rows = []
    for t in temperatures:
        for b in batch_sizes:
            row = {"temperature": t, "batch_size": b,
                   "new_tokens": sum(s.num_new_tokens for s in stats[(t, b, "plain")])}
            for m in methods:
                st = DecodeStats.merge(stats[(t, b, m)])
                row[m] = {"wall_s": wall[(t, b, m)], "speedup": wall[(t, b, "plain")] / wall[(t, b, m)],
                          "alpha": st.alpha if m != "plain" else None,
                          "draft_forwards": st.num_draft_forwards, "target_forwards": st.num_target_forwards}
            rows.append(row)
    return {"methods": methods, "auto_costs": {str(k): v for k, v in costs.items()}, "rows": rows,
            "greedy_equal": [equal, compared]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pair", type=Path, default=REPO / "checkpoints" / "quickstart",
                   help="a quickstart output folder: target/, draft-distilled/, tokenizer/")
    p.add_argument("--draft", default="draft-distilled", help="the pair folder's draft: draft-distilled (default) or "
                   "draft-baseline (a weaker draft, whose rows differ more in acceptance)")
    p.add_argument("--out", type=Path, required=True, help="folder for results.json (must not hold one)")
    p.add_argument("--limit", type=int, default=8, help="prompts per held-out set (3 sets)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2, help="passes over the groups")
    p.add_argument("--batch-sizes", default="4,8")
    p.add_argument("--gammas", default="2,4", help="fixed γ values to run beside auto")
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--auto-max-gamma", type=int, default=8)
    args = p.parse_args(argv)
    for name in ("limit", "max_new_tokens", "rounds", "auto_max_gamma"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    missing = [d for d in ("target", "tokenizer") if not (args.pair / d).is_dir()]
    if missing:
        p.error(f"--pair {args.pair} lacks {', '.join(missing)}: give a quickstart output folder")
    if not (args.pair / args.draft).is_dir():
        p.error(f"--draft {args.draft}: no such folder in --pair {args.pair} (draft-distilled or draft-baseline)")
    from decode.outputs import check_output_folder

    try:
        check_output_folder(args.out)
    except ValueError as e:
        p.error(str(e))
    result_path = args.out / "results.json"
    try:
        batch_sizes = parse_ints(args.batch_sizes, "--batch-sizes", 2)
        gammas = parse_ints(args.gammas, "--gammas", 1)
        temperatures = sorted({parse_temperature(x) for x in args.temperatures.split(",")})
    except ValueError as e:
        p.error(str(e))
    if any(t < 0 for t in temperatures):
        p.error("--temperatures must be >= 0")
    if 3 * args.limit < max(batch_sizes):
        p.error(f"--limit {args.limit} gives {3 * args.limit} prompts, fewer than batch size {max(batch_sizes)}")
    args.out.mkdir(parents=True, exist_ok=True)

    from transformers import AutoTokenizer

    from quickstart.run import _load_lm, encode_prompt_sets

    tokenizer = AutoTokenizer.from_pretrained(str(args.pair / "tokenizer"))
    target, draft = _load_lm(args.pair / "target", "target"), _load_lm(args.pair / args.draft)
    by_set = [[ids for _, ids in encode_prompt_sets(tokenizer, {s: args.limit}, 192)] for s in SETS]
    prompts = [ids for group in zip(*by_set) for ids in group]  # sets interleaved: a batch mixes them
    res = measure(target, draft, tokenizer, prompts, batch_sizes, gammas, temperatures, args.max_new_tokens,
                  args.rounds, args.auto_max_gamma)
    result = {"pair": str(args.pair), "draft": args.draft, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
              "rounds": args.rounds, "torch": torch.__version__, "threads": torch.get_num_threads(), **res}
    result_path.write_text(json.dumps(result, indent=1))
    methods = res["methods"][1:]
    print(f"speedup over plain decoding at the same batch (Σ wall over {len(prompts)} prompts in groups, "
          f"{args.rounds} rounds, {args.max_new_tokens} new tokens; α in brackets)")
    print(f"  {'T':<4}{'batch':<7}" + "".join(f"{m:>20}" for m in methods))
    for row in res["rows"]:
        cells = "".join(f"{row[m]['speedup']:>12.3f} ({row[m]['alpha']:.2f})" for m in methods)
        print(f"  {row['temperature']:<4g}{row['batch_size']:<7d}{cells}")
    eq, n = res["greedy_equal"]
    print(f"greedy equal to plain decoding (every method, group and round at T = 0): {eq}/{n}; wrote {result_path}")
    return 0 if eq == n else 1


if __name__ == "__main__":
    sys.exit(main())
