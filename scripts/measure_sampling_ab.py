"""Measure the sampled (T > 0) speculative step's sampling math against an earlier revision's, side by side.

    python scripts/measure_sampling_ab.py --pair checkpoints/quickstart --baseline-rev 4182a0f~2 \
        --out checkpoints/sampling_ab.json

Both variants run in one process on one decoder: the baseline is ``decode/sampling.py`` as it was at
``--baseline-rev`` (read with ``git show``), patched into the engine and the acceptance rule in place of the current
``probs_from_logits`` and ``sample``; everything else (models, caches, forwards) is shared. For each temperature,
``--rounds`` interleaved rounds decode the same HumanEval prompts (``--limit``) with ``--max-new-tokens`` new tokens,
no eos, γ = ``--gamma`` and a fixed seed per prompt, alternating which variant goes first. Reports tokens/s of each
and their ratio per round (median and range), and whether both produced the same tokens (the distributions agree up
to round-off, so sampled texts can differ where a draw sits on a boundary). Prints a table and writes ``--out``
(refused if it exists). Run it alone on the machine.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def baseline_sampling(rev: str):
    """``decode/sampling.py`` at git revision ``rev`` as a module (raises CalledProcessError for an unknown rev)."""
    source = subprocess.run(["git", "show", f"{rev}:decode/sampling.py"], cwd=REPO, check=True,
                            capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "baseline_sampling.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("baseline_sampling", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["baseline_sampling"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def use(variant) -> None:
    """Point the engine and the acceptance rule at ``variant``'s probs_from_logits and sample."""
    import decode.engine
    import decode.verify

    decode.engine.probs_from_logits = variant.probs_from_logits
    decode.engine.sample = variant.sample
    decode.verify.sample = variant.sample


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pair", required=True, help="a quickstart folder with target/, draft-distilled/, tokenizer/")
    p.add_argument("--baseline-rev", required=True, help="git revision whose decode/sampling.py is the baseline")
    p.add_argument("--out", required=True)
    p.add_argument("--limit", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--temperatures", default="1,0.7")
    args = p.parse_args(argv)
    from decode.outputs import check_output_file

    try:  # every argument before the models load and the measurement runs
        check_output_file(args.out, "--out")
        for name in ("limit", "max_new_tokens", "gamma", "rounds"):
            if getattr(args, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1")
        try:
            temps = [float(t) for t in args.temperatures.split(",")]
        except ValueError:
            raise ValueError(f"--temperatures {args.temperatures!r}: give numbers >= 0, e.g. 1,0.7") from None
        if any(not t >= 0 for t in temps):
            raise ValueError(f"--temperatures {args.temperatures!r}: give numbers >= 0, e.g. 1,0.7")
        pair = Path(args.pair)
        missing = [d for d in ("target", "draft-distilled", "tokenizer") if not (pair / d).is_dir()]
        if missing:
            raise ValueError(f"--pair {pair} lacks {', '.join(missing)}: give a quickstart output folder")
        try:
            baseline = baseline_sampling(args.baseline_rev)
        except subprocess.CalledProcessError:
            raise ValueError(f"--baseline-rev {args.baseline_rev!r}: git show found no decode/sampling.py at that "
                             "revision of this repository") from None
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import decode.sampling as current
    from decode import SpeculativeDecoder
    from decode.prompts import encode_prompts, load_prompts

    tok = AutoTokenizer.from_pretrained(str(pair / "tokenizer"))
    target = AutoModelForCausalLM.from_pretrained(str(pair / "target")).eval()
    draft = AutoModelForCausalLM.from_pretrained(str(pair / "draft-distilled")).eval()
    dec = SpeculativeDecoder(target, draft, args.gamma, tokenizer=tok)
    prompts = encode_prompts(load_prompts("humaneval", limit=args.limit), tok)

    def run(variant, temperature: float) -> tuple[float, list[list[int]]]:
        use(variant)
        tokens, texts, start = 0, [], time.perf_counter()
        for i, ids in enumerate(prompts):
            o = dec.generate([ids], max_new_tokens=args.max_new_tokens, temperature=temperature,
                             generator=torch.Generator().manual_seed(i))  # no eos: every row runs to the end
            tokens += len(o.new_tokens[0])
            texts.append(o.new_tokens[0].tolist())
        return tokens / (time.perf_counter() - start), texts

    with torch.inference_mode():
        run(current, 1.0)  # warm-up
        run(baseline, 1.0)
        results = {}
        for t in temps:
            rounds = []
            for r in range(args.rounds):
                order = [("baseline", baseline), ("current", current)]
                if r % 2:
                    order.reverse()
                got = {name: run(v, t) for name, v in order}
                rounds.append({"baseline_tokens_per_s": got["baseline"][0], "current_tokens_per_s": got["current"][0],
                               "ratio": got["current"][0] / got["baseline"][0],
                               "same_tokens": got["current"][1] == got["baseline"][1]})
            ratios = [x["ratio"] for x in rounds]
            results[str(t)] = {"rounds": rounds, "ratio_median": statistics.median(ratios),
                               "ratio_min": min(ratios), "ratio_max": max(ratios)}
    print("| T | baseline tok/s | current tok/s | current / baseline: median (range) | same tokens |")
    print("|---|---|---|---|---|")
    for t, res in results.items():
        b = statistics.median(x["baseline_tokens_per_s"] for x in res["rounds"])
        c = statistics.median(x["current_tokens_per_s"] for x in res["rounds"])
        same = sum(x["same_tokens"] for x in res["rounds"])
        print(f"| {t} | {b:.1f} | {c:.1f} | {res['ratio_median']:.3f} ({res['ratio_min']:.3f}-{res['ratio_max']:.3f})"
              f" | {same}/{len(res['rounds'])} |")
    record = {"pair": str(pair), "baseline_rev": args.baseline_rev, "gamma": args.gamma, "limit": args.limit,
              "max_new_tokens": args.max_new_tokens, "torch_threads": torch.get_num_threads(), "results": results}
    with open(out, "x") as f:
        json.dump(record, f, indent=1)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
