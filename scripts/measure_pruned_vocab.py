"""Measure vocabulary-pruned drafts (``draft.vocab.keep=N``) on a pair: draft forward time, c, α and speedup.

    python scripts/measure_pruned_vocab.py --out checkpoints/pruned_vocab            # the quickstart pair
    python scripts/measure_pruned_vocab.py --out checkpoints/pruned_vocab --steps 50  # + equal fine-tuning
    python scripts/measure_pruned_vocab.py --tiny --out /tmp/pv                      # a seconds-long smoke run

From the quickstart pair (``--pair``: target/, draft-distilled/, distill/ (its config.yaml gives the training
data), tokenizer/), for each N in ``--keeps`` (N ≥ V is the full-vocabulary control): the distilled draft's lm_head
is sliced to the N ids with the most target probability on the training data (``--mass-examples`` training
sequences, one target pass shared by every N, :mod:`distill.vocab`). With ``--steps S`` every draft, the control
included, is then fine-tuned for S steps of the quickstart recipe (equal compute) and exported.

Then, in one interleaved run (plain decoding and every draft per prompt, same seeds): the draft's bare forward ms
(:func:`decode.bench.bare_forward.measure_bare_forwards`), the engine's c (:func:`decode.costs.measure_cost_ratio`),
α per token and τ at each temperature, and the measured speedup over plain decoding (Σ plain wall / Σ speculative
wall over the same prompts), using :func:`decode.bench.runs.run_ours`. At T = 0 every draft's output must equal
plain greedy decoding (``greedy_equal``). Prints a table and writes ``<out>/results.json`` (refused if it exists).
Default sizes (8 humaneval prompts × 64 new tokens, 2 rounds, γ = 4) take about 10 minutes on 2 quiet cores.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

QUICKSTART = REPO / "checkpoints" / "quickstart"
TINY_VOCAB = 64  # the tiny pair's vocabulary (build_tiny)
DEFAULTS = {"keeps": [1024, 2048, 4096, 8192], "limit": 8, "max_new_tokens": 64, "rounds": 2, "cost_repeats": 21}
TINY_DEFAULTS = {"keeps": [16, 32, TINY_VOCAB], "limit": 3, "max_new_tokens": 8, "rounds": 1, "cost_repeats": 3}


def _quiet(*_):
    pass


# ------------------------------------------------------------------------------------------------ the pair

def build_tiny(root: Path) -> dict:
    """A tiny pair (word-level tokenizer, 2-layer target, its noisy copy as the distilled draft) and a jsonl of
    prompt/completion pairs sampled from the target, so that the target's mass is concentrated on some ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    root.mkdir(parents=True, exist_ok=True)
    words = [f"w{i}" for i in range(TINY_VOCAB - 4)]
    vocab = {t: i for i, t in enumerate(["<pad>", "<s>", "</s>", "<unk>"] + words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1,
                      eos_token_id=2, pad_token_id=0)
    target = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(8.0)
    draft = LlamaForCausalLM(cfg).eval()
    draft.load_state_dict(target.state_dict())
    with torch.no_grad():
        w = draft.lm_head.weight
        w.add_(0.5 * w.std() * torch.randn(w.shape, generator=torch.Generator().manual_seed(1)))
    for name, model in (("target", target), ("draft-distilled", draft)):
        model.save_pretrained(root / name)
        fast.save_pretrained(root / name)
    fast.save_pretrained(root / "tokenizer")
    g = torch.Generator().manual_seed(2)
    with open(root / "data.jsonl", "w") as f:
        for _ in range(40):
            prompt = [1] + torch.randint(4, len(vocab), (4,), generator=g).tolist()
            with torch.no_grad():
                out = target.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=True, pad_token_id=0)
            text = lambda ids: " ".join(fast.convert_ids_to_tokens(ids))  # noqa: E731
            f.write(json.dumps({"prompt": text(prompt[1:]), "completion": " " + text(out[0, 5:].tolist())}) + "\n")
    return {"target": root / "target", "draft": root / "draft-distilled", "tokenizer": root / "tokenizer",
            "data": root / "data.jsonl"}


def training_config(args: argparse.Namespace, pair: dict, out: Path):
    """The recipe config the drafts were trained with (quickstart: its run's config.yaml), for the mass pass and
    the equal-compute fine-tuning."""
    from omegaconf import OmegaConf

    from distill.__main__ import compose

    if args.tiny:
        return compose([f"+target.name_or_path={pair['target']}", f"draft.name_or_path={pair['draft']}", "data=jsonl",
                        f"data.source.path={pair['data']}", "data.source.completion_field=completion",
                        "data.max_new_tokens=12", "data.holdout=4", "train.batch_size=4", "train.cpu=true",
                        "optim.warmup_steps=1", f"train.output_dir={out / 'runs'}"])
    cfg = OmegaConf.load(Path(args.pair) / "distill" / "config.yaml")
    cfg.target.name_or_path = str(Path(args.pair) / "target")
    cfg.draft.name_or_path = str(Path(args.pair) / "draft-distilled")
    return cfg


# ------------------------------------------------------------------------------------------------ the drafts

def id_mass(cfg, tokenizer, target, max_examples: int) -> tuple[torch.Tensor, int]:
    """(V,) target mass per id over up to ``max_examples`` evenly spaced training sequences, and V."""
    from distill.config import normalize_config
    from distill.recipe import load_data
    from distill.vocab import target_id_mass

    cfg = normalize_config(cfg)
    examples = load_data(cfg, tokenizer, None)[0]
    step = max(1, len(examples) // max_examples)
    examples = examples[::step][:max_examples]
    vocab = len(tokenizer)
    return target_id_mass(target, examples, tokenizer.pad_token_id, vocab,
                          temperature=float(cfg.loss.temperature)), vocab


def make_drafts(args, cfg, pair: dict, tokenizer, target, out: Path) -> list[dict]:
    """The pruned drafts (saved under ``out/drafts``), and, with ``--steps``, their equal-compute fine-tunes."""
    from decode.compat import vocab_fingerprint
    from decode.loading import load_causal_lm
    from decode.vocab_map import prune_draft_head, select_kept_ids
    from distill.vocab import special_ids

    mass, vocab = id_mass(cfg, tokenizer, target, args.mass_examples)
    drafts = []
    for keep in args.keeps:
        if keep >= vocab:
            drafts.append({"name": f"full_{vocab}", "keep": vocab, "path": str(pair["draft"]), "mass_kept": 1.0})
            continue
        try:
            ids = select_kept_ids(mass, keep, special_ids(tokenizer, vocab))
        except ValueError as err:
            print(f"error: --keeps {keep}: {err}", file=sys.stderr)
            raise SystemExit(2) from None
        draft = load_causal_lm(str(pair["draft"]), "draft", dtype="float32")
        prune_draft_head(draft, ids, vocab_fingerprint(tokenizer))
        path = out / "drafts" / f"keep_{keep}"
        draft.save_pretrained(path)
        tokenizer.save_pretrained(path)
        drafts.append({"name": f"keep_{keep}", "keep": keep, "path": str(path),
                       "mass_kept": float(mass[ids].sum() / mass.sum())})
    if args.steps > 0:
        for d in drafts:
            d["path"] = fine_tune(args, cfg, d, out)
    return drafts


def fine_tune(args, cfg, d: dict, out: Path) -> str:
    """``args.steps`` recipe steps from the draft (its map kept), exported; returns the export folder."""
    from omegaconf import OmegaConf

    from distill.checkpoint import find_latest, step_dir
    from distill.export import export
    from distill.recipe import train

    run = out / "runs" / d["name"]
    dest = out / "drafts_tuned" / d["name"]
    if (dest / "draftkit_card.json").is_file():  # an interrupted measurement's finished export (written atomically)
        steps = json.loads((dest / "draftkit_card.json").read_text()).get("steps")
        if steps != args.steps:
            print(f"error: {dest} was fine-tuned for {steps} steps, not --steps {args.steps}; choose another --out",
                  file=sys.stderr)
            raise SystemExit(2)
        d["fine_tune_s"] = None
        return str(dest)
    resume = find_latest(run) is not None  # Ctrl-C midway: continue from the last checkpoint, or start over
    cfg = OmegaConf.merge(cfg, {
        "draft": {"name_or_path": d["path"]}, "train": {"max_steps": args.steps, "output_dir": str(run),
                                                        "save_every": 0, "progress": "none", "stop_at": None,
                                                        "resume": resume, "overwrite": not resume},
        "eval": {"every": 0, "at_start": False, "num_prompts": 2, "max_new_tokens": 8, "temperatures": [0.0],
                 "cost_ratio": 1.0}, "logger": {"name": "none"}})
    t0 = time.perf_counter()
    train(cfg, log=_quiet)
    d["fine_tune_s"] = time.perf_counter() - t0
    export(step_dir(run, args.steps), dest)
    return str(dest)


# ------------------------------------------------------------------------------------------------ measuring

def measure(args, target, drafts: list[dict], prompts: list[list[int]], tokenizer) -> dict:
    """One interleaved run of plain decoding and every draft (see module doc); returns per-draft metrics."""
    from decode import SpeculativeDecoder
    from decode.bench.bare_forward import measure_bare_forwards
    from decode.bench.config import OURS, BenchConfig, Method
    from decode.bench.runs import cost_context, run_ours
    from decode.engine import left_pad
    from decode.loading import load_causal_lm
    from decode.metrics import DecodeStats
    from decode.costs import measure_cost_ratio

    device = next(target.parameters()).device
    cfg = BenchConfig(gammas=[args.gamma], auto=False, temperatures=args.temperatures,
                      max_new_tokens=args.max_new_tokens, hf=False, ignore_eos=True, cost_repeats=args.cost_repeats)
    context = cost_context(prompts, cfg, device)
    models = {d["name"]: load_causal_lm(d["path"], "draft", dtype="float32", device=str(device)) for d in drafts}
    for d in drafts:
        m = models[d["name"]]
        d["lm_head_rows"] = int(m.get_output_embeddings().weight.shape[0])
        d["parameters"] = sum(p.numel() for p in m.parameters())
        bare = measure_bare_forwards(target, m, context, args.cost_repeats)
        cost = measure_cost_ratio(target, m, context, args.cost_repeats)
        d.update(draft_forward_ms=1e3 * bare["draft_forward_s"], bare_cost_ratio=bare["cost_ratio"],
                 cost_ratio=cost["cost_ratio"], engine_draft_forward_ms=1e3 * cost["draft_forward_s"])
    decoders = {"plain": SpeculativeDecoder(target, None, 0)}
    decoders.update({n: SpeculativeDecoder(target, m, args.gamma, tokenizer=tokenizer) for n, m in models.items()})
    names = list(decoders)
    walls = {(t, n): [] for t in args.temperatures for n in names}
    stats = {(t, n): [] for t in args.temperatures for n in names}
    outputs = {}
    for n, dec in decoders.items():  # warm-up: allocator growth and lazy init stay out of the timings
        ids, mask = left_pad(prompts[:1], tokenizer.pad_token_id, device)
        run_ours(dec, Method(n, OURS, 0 if n == "plain" else args.gamma), ids, mask, 1.0,
                 BenchConfig(**{**cfg.__dict__, "max_new_tokens": 4}), None, 0, device)
    for rnd in range(args.rounds):
        for i, prompt in enumerate(prompts):
            ids, mask = left_pad([prompt], tokenizer.pad_token_id, device)
            for t in args.temperatures:
                order = names[(i + rnd) % len(names):] + names[:(i + rnd) % len(names)]  # rotate: drift hits all
                for n in order:
                    method = Method(n, OURS, 0 if n == "plain" else args.gamma)
                    seed = 1_000_003 * rnd + 101 * i
                    new, wall, st, _ = run_ours(decoders[n], method, ids, mask, t, cfg, None, seed, device)
                    walls[(t, n)].append(wall)
                    stats[(t, n)].append(st)
                    outputs[(rnd, i, t, n)] = new
    for d in drafts:
        n = d["name"]
        d["per_temperature"] = {}
        for t in args.temperatures:
            s = DecodeStats.merge(stats[(t, n)])
            row = {"alpha": s.alpha, "acceptance_rate": s.acceptance_rate,
                   "mean_accepted_length": s.mean_accepted_length,
                   "speedup": sum(walls[(t, "plain")]) / sum(walls[(t, n)]),
                   "spec_wall_s": sum(walls[(t, n)]), "plain_wall_s": sum(walls[(t, "plain")])}
            if t == 0:
                row["greedy_equal"] = all(outputs[(r, i, t, n)] == outputs[(r, i, t, "plain")]
                                          for r in range(args.rounds) for i in range(len(prompts)))
            d["per_temperature"][str(t)] = row
    return {"gamma": args.gamma, "rounds": args.rounds, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
            "drafts": drafts}


def table(results: dict) -> str:
    temps = list(results["drafts"][0]["per_temperature"])
    head = ("| draft | head rows | target mass kept | draft fwd ms | c | "
            + " | ".join(f"α T={t} | τ T={t} | speedup T={t}" for t in temps) + " |")
    lines = [head, "|" + " --- |" * (5 + 3 * len(temps))]
    for d in results["drafts"]:
        cells = [d["name"], str(d["lm_head_rows"]), f"{d['mass_kept']:.3f}", f"{d['draft_forward_ms']:.2f}",
                 f"{d['cost_ratio']:.3f}"]
        for t in temps:
            r = d["per_temperature"][t]
            cells += [f"{r['alpha']:.3f}", f"{r['mean_accepted_length']:.2f}", f"{r['speedup']:.2f}×"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def greedy_mismatches(results: dict) -> list[str]:
    """Names of the drafts whose T = 0 output differed from plain greedy decoding on some prompt and round."""
    return [d["name"] for d in results["drafts"]
            if d["per_temperature"].get("0.0", {}).get("greedy_equal") is False]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pair", default=str(QUICKSTART),
                   help="folder with target/, draft-distilled/, distill/, tokenizer/")
    # None: the flag's default, which --tiny changes (a flag given on the command line always wins).
    p.add_argument("--keeps", type=int, nargs="+", default=None,
                   help="N values, each >= 1 (N >= V: the full-vocabulary control; default 1024 2048 4096 8192, "
                        "with --tiny 16 32 64)")
    p.add_argument("--steps", type=int, default=0,
                   help="fine-tune every draft for this many recipe steps (0: none, the default)")
    p.add_argument("--mass-examples", type=int, default=256, help="training sequences of the target mass pass (>= 1)")
    p.add_argument("--prompts", default="humaneval", help="prompt set (decode.prompts)")
    p.add_argument("--limit", type=int, default=None, help="prompts of the set (>= 1; default 8, with --tiny 3)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="tokens per prompt (>= 2; default 64, with --tiny 8)")
    p.add_argument("--gamma", type=int, default=4, help="γ, draft tokens per step (>= 1)")
    p.add_argument("--rounds", type=int, default=None,
                   help="interleaved passes over the prompts (>= 1; default 2, with --tiny 1)")
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0], help="each >= 0 (0: greedy)")
    p.add_argument("--cost-repeats", type=int, default=None,
                   help="timed repeats per cost (>= 1; default 21, with --tiny 3)")
    p.add_argument("--tiny", action="store_true",
                   help=f"build a tiny pair (vocabulary {TINY_VOCAB}) under --out and run a seconds-long check; "
                        f"keeps >= {TINY_VOCAB} become its full-vocabulary control")
    p.add_argument("--out", required=True, help="work folder; must not hold a results.json")
    args = p.parse_args(argv)
    for name, value in (TINY_DEFAULTS if args.tiny else DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for flag, ok, need in (("--keeps", min(args.keeps) >= 1, ">= 1"), ("--steps", args.steps >= 0, ">= 0"),
                           ("--mass-examples", args.mass_examples >= 1, ">= 1"), ("--limit", args.limit >= 1, ">= 1"),
                           ("--max-new-tokens", args.max_new_tokens >= 2, ">= 2"), ("--gamma", args.gamma >= 1, ">= 1"),
                           ("--rounds", args.rounds >= 1, ">= 1"), ("--cost-repeats", args.cost_repeats >= 1, ">= 1"),
                           ("--temperatures", all(math.isfinite(t) and t >= 0 for t in args.temperatures),
                            "finite and >= 0")):
        if not ok:
            p.error(f"{flag}={getattr(args, flag[2:].replace('-', '_'))} is out of range: it must be {need}")
    out = Path(args.out).resolve()  # absolute: the exported cards record their target's path
    from decode.outputs import check_output_folder

    try:
        check_output_folder(out)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.tiny:
        args.keeps = sorted({min(k, TINY_VOCAB) for k in args.keeps})
        pair = build_tiny(out / "pair")
    else:
        pair = {"target": Path(args.pair) / "target", "draft": Path(args.pair) / "draft-distilled",
                "tokenizer": Path(args.pair) / "tokenizer"}
        for key, path in [*pair.items(), ("training config", Path(args.pair) / "distill" / "config.yaml")]:
            if not path.exists():
                print(f"error: the {key} {path} does not exist; run bash scripts/quickstart.sh or pass --pair",
                      file=sys.stderr)
                return 2
    out.mkdir(parents=True, exist_ok=True)
    from decode.loading import load_causal_lm, load_tokenizer
    from decode.prompts import encode_prompts, load_prompts

    tokenizer = load_tokenizer(str(pair["tokenizer"]), pad_from_eos=True)
    target = load_causal_lm(str(pair["target"]), "target", dtype="float32")
    cfg = training_config(args, pair, out)
    t0 = time.perf_counter()
    drafts = make_drafts(args, cfg, pair, tokenizer, target, out)
    if args.tiny:
        rows = [json.loads(line) for line in open(pair["data"])][-args.limit:]
        prompts = [tokenizer(r["prompt"])["input_ids"] for r in rows]
    else:
        prompts = encode_prompts(load_prompts(args.prompts, limit=args.limit), tokenizer, chat_template=False,
                                 max_prompt_tokens=256)
    results = measure(args, target, drafts, prompts, tokenizer)
    results.update(pair={k: str(v) for k, v in pair.items()}, steps=args.steps, prompt_set="tiny" if args.tiny
                   else args.prompts, total_s=time.perf_counter() - t0, threads=torch.get_num_threads())
    print(table(results))
    (out / "results.json").write_text(json.dumps(results, indent=2))
    print(f"wrote {out / 'results.json'}")
    for name in greedy_mismatches(results):
        # Lossless greedy decoding gives plain decoding's tokens; a flip can also come from a near-tie that a
        # several-token verify forward rounds differently from a one-token forward (docs/decode.md, precision).
        print(f"warning: at T=0 the {name} draft's output differs from plain greedy decoding on some prompt "
              "(greedy_equal: false in results.json)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
