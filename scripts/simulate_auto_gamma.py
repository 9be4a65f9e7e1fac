"""Judge the ``num_draft_tokens="auto"`` controller against every fixed γ, by simulation (no model, no clock).

    python scripts/simulate_auto_gamma.py                              # CPU costs of the quickstart pair
    python scripts/simulate_auto_gamma.py --cost-ratio 0.05 --verify-costs 1 --max-new-tokens 64 256 \
        --out checkpoints/auto_gamma_sim.json

For each α and generation length, runs :func:`decode.speedup.simulate_speedup` (i.i.d. acceptance, one fresh
controller per request as the decoder makes) for γ = 0..max and for the controller with its defaults, and prints
the controller's speedup as a fraction of the best fixed γ. Use the c and v_γ that ``SpeculativeDecoder.calibrate``
or ``python -m decode bench`` measured on your hardware. With ``--out``, writes JSON (refuses an existing file).

Static batches (``generate()`` over several prompts, which ends with its last row):

    python scripts/simulate_auto_gamma.py --batch-alphas 0.3,0.5,0.7,0.9,1,1,1,1 \
        --auto-costs checkpoints/auto_batch/results.json

simulates one batch with those per-row α (:func:`decode.speedup.simulate_batch_speedup`, rows leave as they
finish) with the per-batch-size costs of ``--auto-costs`` (a JSON file holding ``SpeculativeDecoder.calibrate``'s
dict, or the results.json of ``scripts/measure_auto_batch.py`` or ``python -m decode bench``), and prints every fixed γ and the controller with and
without the static-batch planner.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from decode.speedup import AdaptiveGamma, simulate_batch_speedup, simulate_speedup  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    """Parse the flags, simulate every cell, print the markdown table and write ``--out``; returns 0 (2 on bad
    flags, through argparse)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cost-ratio", type=float, default=0.18,
                   help="c = draft forward time / target forward time (default 0.18: quickstart pair A, 2-core "
                        "AVX2-only EPYC, fp32)")
    p.add_argument("--verify-costs", default="1,1.45,1.5,1.55,1.6,1.63,1.67,1.7,1.74",
                   help="v_0..v_max, comma-separated, v_γ = target forward over γ+1 tokens / over one (v_0 is not "
                        "used; γ beyond the list takes its last value); default: the same pair and CPU")
    p.add_argument("--max-gamma", type=int, default=8, help="the controller's largest γ and the fixed γ tried")
    p.add_argument("--alphas", type=float, nargs="+", default=[0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 1.0],
                   help="per-token acceptance values to simulate, each in [0, 1]")
    p.add_argument("--max-new-tokens", type=int, nargs="+", default=[64, 256], help="generation lengths (>= 2)")
    p.add_argument("--runs", type=int, default=300, help="simulated requests per cell (>= 1)")
    p.add_argument("--batch-alphas", help="per-row α of one static batch, comma-separated (needs --auto-costs)")
    p.add_argument("--auto-costs", type=Path, help="JSON with the per-batch-size costs (calibrate's dict, or a "
                   "results.json of scripts/measure_auto_batch.py or of python -m decode bench)")
    p.add_argument("--out", type=Path, default=None, help="write the rows as JSON here (an existing file is refused)")
    args = p.parse_args(argv)
    try:
        verify = [float(x) for x in args.verify_costs.split(",") if x.strip()]
    except ValueError:
        p.error(f"--verify-costs must be comma-separated numbers, got {args.verify_costs!r}")
    if not verify or not all(math.isfinite(v) and v > 0 for v in verify):
        p.error(f"--verify-costs must be positive numbers, got {args.verify_costs!r}")
    if not (math.isfinite(args.cost_ratio) and args.cost_ratio >= 0):
        p.error(f"--cost-ratio must be a number >= 0, got {args.cost_ratio}")
    for flag, value, low in (("--max-gamma", args.max_gamma, 1), ("--runs", args.runs, 1),
                             ("--max-new-tokens", min(args.max_new_tokens), 2)):
        if value < low:
            p.error(f"{flag}={value} is out of range: it must be >= {low}")
    if any(not 0 <= a <= 1 for a in args.alphas):
        p.error(f"--alphas must lie in [0, 1], got {args.alphas}")
    if args.out is not None and args.out.exists():
        p.error(f"--out {args.out} exists; choose a new file (results are never overwritten)")

    if args.batch_alphas is not None or args.auto_costs is not None:
        return batch_main(p, args)

    def controller() -> AdaptiveGamma:
        ctl = AdaptiveGamma(args.max_gamma)
        ctl.set_costs(args.cost_ratio, verify)
        return ctl

    rows = []
    print(f"c = {args.cost_ratio}, v_γ = {verify}, {args.runs} runs per cell\n")
    print("| new tokens | α | best fixed γ | its speedup | auto speedup | auto / best |")
    print("|---|---|---|---|---|---|")
    for n in args.max_new_tokens:
        for alpha in args.alphas:
            fixed = {g: simulate_speedup(g, alpha, args.cost_ratio, verify, n, args.runs)
                     for g in range(args.max_gamma + 1)}
            best = max(fixed, key=fixed.get)
            auto = simulate_speedup(controller, alpha, args.cost_ratio, verify, n, args.runs)
            rows.append({"max_new_tokens": n, "alpha": alpha, "best_gamma": best, "best_speedup": fixed[best],
                         "auto_speedup": auto, "auto_vs_best_fixed": auto / fixed[best],
                         "fixed_speedup": {str(g): s for g, s in fixed.items()}})
            print(f"| {n} | {alpha:.2f} | {best} | {fixed[best]:.3f} | {auto:.3f} | {auto / fixed[best]:.3f} |")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"cost_ratio": args.cost_ratio, "verify_costs": verify,
                                        "max_gamma": args.max_gamma, "runs": args.runs, "rows": rows}, indent=1))
        print(f"\nwrote {args.out}")
    return 0


def batch_main(p: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """The static-batch table: every fixed γ, the pooled controller and the planned one (exit 2 on bad flags)."""
    if args.batch_alphas is None or args.auto_costs is None:
        p.error("--batch-alphas and --auto-costs go together")
    try:
        alphas = [float(x) for x in args.batch_alphas.split(",")]
    except ValueError:
        p.error(f"--batch-alphas must be comma-separated numbers, got {args.batch_alphas!r}")
    if not all(0 <= a <= 1 for a in alphas):
        p.error(f"--batch-alphas must lie in [0, 1], got {alphas}")
    try:
        data = json.loads(args.auto_costs.read_text())
    except (OSError, ValueError) as e:
        p.error(f"--auto-costs {args.auto_costs}: {e}")
    if isinstance(data, dict) and isinstance(data.get("cost"), dict) and "auto_costs" in data["cost"]:
        data = data["cost"]  # a python -m decode bench results.json
    costs = data.get("auto_costs", data) if isinstance(data, dict) else data
    if not isinstance(costs, dict) or not all(isinstance(v, dict) for v in costs.values()):
        p.error(f"--auto-costs {args.auto_costs}: expected {{batch_size: {{cost_ratio, verify, target_forward_s}}}} "
                f"(calibrate's dict) or a results.json holding it under 'auto_costs'")

    def controller() -> AdaptiveGamma:
        return AdaptiveGamma(args.max_gamma)

    out = {"alphas": alphas, "max_gamma": args.max_gamma, "runs": args.runs, "auto_costs": costs, "rows": []}
    print(f"static batch of {len(alphas)} rows, α = {alphas}, costs from {args.auto_costs}, {args.runs} runs per cell")
    print("| new tokens | best fixed γ | its speedup | auto, pooled α | auto, planned | planned / pooled |")
    print("|---|---|---|---|---|---|")
    for n in args.max_new_tokens:
        try:
            fixed = {g: simulate_batch_speedup(g, alphas, costs, n, args.runs) for g in range(args.max_gamma + 1)}
            pooled = simulate_batch_speedup(controller, alphas, costs, n, args.runs, plan=False)
            planned = simulate_batch_speedup(controller, alphas, costs, n, args.runs, plan=True)
        except (ValueError, TypeError) as e:
            p.error(f"--auto-costs {args.auto_costs}: {e}")
        best = max(fixed, key=fixed.get)
        out["rows"].append({"max_new_tokens": n, "fixed_speedup": {str(g): v for g, v in fixed.items()},
                            "best_gamma": best, "auto_pooled": pooled, "auto_planned": planned})
        print(f"| {n} | {best} | {fixed[best]:.3f} | {pooled:.3f} | {planned:.3f} | {planned / pooled:.3f} |")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1))
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
