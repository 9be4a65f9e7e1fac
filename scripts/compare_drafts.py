"""Compare drafts of one pair through the quickstart's interleaved evaluation (plain decoding, then every draft, per
prompt, same seeds): acceptance rate, α, τ, c and measured speedup at T=0 and T=1, all prompt sets pooled.

    python scripts/compare_drafts.py --pair checkpoints/quickstart --out results.json \
        full=checkpoints/quickstart/draft-distilled n4096=checkpoints/measure/pruned_cached/n4096_export

Drafts are NAME=PATH (plain or vocabulary-pruned Hugging Face checkpoints); the pair's target is PAIR/target and the
evaluation settings are the quickstart's (``--set eval.KEY=VALUE``, once per setting): γ is chosen per draft and
temperature on further prompts (``eval.num_draft_tokens=best``) unless ``--set eval.num_draft_tokens=4`` fixes it,
and the drafts' forwards are compiled (``eval.compile=draft``; ``--set eval.compile=false`` for the eager engine).
Speedups are wall clock: run it on an otherwise idle machine, twice for a spread. An existing --out is never overwritten.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pair", required=True, help="a quickstart output folder (its target/ is the target)")
    p.add_argument("--out", required=True, help="results JSON (must not exist)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a quickstart setting, e.g. --set eval.max_new_tokens=32 (repeat for more)")
    p.add_argument("drafts", nargs="+", help="NAME=PATH")
    args = p.parse_args()
    out = Path(args.out)
    if out.exists():
        p.error(f"--out {out} exists; choose another file (results are never overwritten)")
    bad = [d for d in args.drafts if "=" not in d]
    if bad:
        p.error(f"drafts are NAME=PATH, got {bad}")
    drafts = dict(d.split("=", 1) for d in args.drafts)
    reserved = [n for n in drafts if n in ("plain", "")]
    if reserved or len(drafts) < len(args.drafts):
        p.error("draft names must be unique, non-empty and not 'plain' (the plain-decoding reference), got "
                f"{[d.split('=', 1)[0] for d in args.drafts]}")
    for name, path in [("--pair", f"{args.pair}/target"), *drafts.items()]:
        if not (Path(path) / "config.json").is_file():
            p.error(f"{name}: {path} is not a checkpoint folder (no config.json)")
    if not out.parent.is_dir():
        p.error(f"--out {out}: the folder {out.parent} does not exist")

    from rich.console import Console

    from quickstart.run import _fmt, check_eval_settings, evaluate, load_settings

    bare = [s for s in args.set if "=" not in s]
    if bare:
        p.error(f"--set needs KEY=VALUE, e.g. --set eval.max_new_tokens=32 (got {bare[0]!r})")
    try:
        ecfg = load_settings("quickstart", args.set).eval
        check_eval_settings(ecfg)
    except (KeyError, ValueError) as err:
        p.error(f"--set: {err.args[0]}")
    t0 = time.time()
    ev = evaluate(f"{args.pair}/target", drafts, ecfg, Console(width=132))
    out.write_text(json.dumps({"eval": ev, "drafts": drafts, "seconds": time.time() - t0}, indent=1, default=str))
    for r in ev["rows"]:
        if r["set"] == "all":
            for n in drafts:
                m = r[n]
                print(f"T={r['temperature']:g} {n}: γ {m['num_draft_tokens']} acc. rate {m['acceptance_rate']:.3f} "
                      f"α {_fmt(m['alpha'], '.3f')} τ {m['mean_accepted_length']:.2f} "
                      f"speedup {m['speedup']:.2f}x")
    print("c:", {k: round(v, 3) for k, v in (ev.get("cost_ratio") or {}).items()})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
