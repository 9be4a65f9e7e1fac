"""Would stopping a step's drafts at the draft's first unsure token pay at T = 0? Measured on a quickstart run.

    python scripts/measure_confidence_stop.py checkpoints/quickstart --out checkpoints/confidence_stop.json

For each evaluation prompt of the run (its results.json: prompt sets, prompt length, new tokens) the target
continues greedily (Hugging Face ``generate``); the distilled draft then reads that text teacher-forced and gives,
at every new position, its top-1 probability and whether its argmax is the target's token. At T = 0 that is exact:
a greedy draft proposes its argmax, and it is accepted while it equals the target's. The speculative steps are then
replayed (:func:`replay_speedup`) with the run's measured cost ratio c and verify costs v_γ, for every fixed γ and
for "draft up to γ tokens, stop after the first whose top-1 probability is below h" (the rule of Hugging Face's
``assistant_confidence_threshold``). The replay is decode-phase only (no prefill). Prints the tables; with
``--out``, writes JSON (refuses an existing file).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def replay_speedup(confidence: Sequence[Sequence[float]], agree: Sequence[Sequence[bool]], cost_ratio: float,
                   verify_costs: Sequence[float], max_gamma: int, threshold: float = 0.0) -> float:
    """Decode-phase speedup over plain decoding of greedy speculative decoding replayed on recorded positions.

    Args:
        confidence: per sequence, the draft's top-1 probability at each new position.
        agree: per sequence, whether the draft's argmax equals the target's greedy token at each position.
        cost_ratio: c, a draft forward's time over a one-token target forward's.
        verify_costs: v_γ for γ = 0, 1, ... (a target forward over γ + 1 tokens over one); the last repeats.
        max_gamma: γ, the most drafts per step.
        threshold: h; a step stops drafting after its first draft whose top-1 probability is below h (0: never).

    Returns:
        tokens per unit of time over plain decoding's (one token per target forward), all sequences pooled: each
        step drafts k tokens (cost k·c + v_k), keeps the agreeing prefix and the target's next token.
    """
    tokens = cost = 0.0
    for conf, ok in zip(confidence, agree):
        t, n = 0, len(conf)
        while t < n:
            k = 0
            while k < max_gamma and t + k < n:
                k += 1
                if conf[t + k - 1] < threshold:
                    break
            accepted = 0
            while accepted < k and ok[t + accepted]:
                accepted += 1
            tokens += min(accepted + 1, n - t)
            cost += k * cost_ratio + verify_costs[min(k, len(verify_costs) - 1)]
            t += accepted + 1
    return tokens / cost


def record(run: Path) -> dict:
    """The draft's top-1 probability and argmax agreement on the target's greedy continuations of the run's
    evaluation prompts."""
    import torch
    from transformers import AutoTokenizer

    from quickstart.run import _load_lm, encode_prompt_sets

    res = json.loads((run / "results.json").read_text())["eval"]
    tok = AutoTokenizer.from_pretrained(str(run / "tokenizer"))
    target, draft = _load_lm(run / "target", "target"), _load_lm(run / "draft-distilled")
    n_new = int(res["max_new_tokens"])
    confidence, agree = [], []
    with torch.no_grad():
        for _, ids in encode_prompt_sets(tok, res["num_prompts"], int(res["max_prompt_tokens"])):
            x = torch.tensor([ids])
            seq = target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n_new, min_new_tokens=n_new,
                                  do_sample=False, pad_token_id=tok.pad_token_id)[0]
            q = draft(seq[None]).logits[0, len(ids) - 1:len(ids) - 1 + n_new].float().softmax(-1)
            confidence.append(q.max(-1).values.tolist())
            agree.append((q.argmax(-1) == seq[len(ids):]).tolist())
    return {"confidence": confidence, "agree": agree, "cost_ratio": res["cost_ratio"]["distilled"],
            "verify_costs": res["verify_costs"]["distilled"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", type=Path, help="a quickstart output folder (target, draft-distilled, results.json)")
    p.add_argument("--gammas", type=int, nargs="+", default=[4, 6, 8], help="γ caps of the thresholded rule")
    p.add_argument("--thresholds", type=float, nargs="+", default=[0.05, 0.1, 0.15, 0.2, 0.25, 0.3])
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.out is not None and args.out.exists():
        print(f"error: --out {args.out} exists; choose a new file", file=sys.stderr)
        return 2
    if not (args.run / "results.json").is_file():
        print(f"error: {args.run} has no results.json; give a finished quickstart run folder", file=sys.stderr)
        return 2
    rec = record(args.run)
    conf = [c for seq in rec["confidence"] for c in seq]
    ok = [a for seq in rec["agree"] for a in seq]
    buckets = []
    print("| draft top-1 probability | positions | argmax agreement |\n| --- | --- | --- |")
    for lo, hi in ((0, .2), (.2, .4), (.4, .6), (.6, .8), (.8, 1.01)):
        hits = [a for c, a in zip(conf, ok) if lo <= c < hi]
        buckets.append({"low": lo, "high": min(hi, 1.0), "positions": len(hits),
                        "agreement": sum(hits) / len(hits) if hits else None})
        if hits:
            print(f"| {lo:.1f}–{min(hi, 1.0):.1f} | {len(hits)} | {sum(hits) / len(hits):.3f} |")
    replay = lambda g, h=0.0: replay_speedup(rec["confidence"], rec["agree"], rec["cost_ratio"],  # noqa: E731
                                             rec["verify_costs"], g, h)
    fixed = {g: replay(g) for g in range(1, 9)}
    best = max(fixed, key=fixed.get)
    print(f"\nfixed γ (replayed decode-phase speedup, c = {rec['cost_ratio']:.3f}): "
          + ", ".join(f"{g}: {s:.3f}" for g, s in fixed.items()) + f"; best γ = {best}")
    stop = {f"{h:g}": {g: replay(g, h) for g in args.gammas} for h in args.thresholds}
    print("\n| h | " + " | ".join(f"γ ≤ {g}" for g in args.gammas) + " |\n|" + " --- |" * (len(args.gammas) + 1))
    for h, row in stop.items():
        print(f"| {h} | " + " | ".join(f"{row[g]:.3f}" for g in args.gammas) + " |")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"run": str(args.run), "agreement_by_confidence": buckets,
                                        "fixed_gamma": fixed, "best_fixed_gamma": best, "confidence_stop": stop,
                                        "cost_ratio": rec["cost_ratio"], "verify_costs": rec["verify_costs"]},
                                       indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
