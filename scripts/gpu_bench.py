"""The Python half of scripts/gpu_bench.sh: plain vs ours (eager, and compiled where the engine can) vs Hugging Face
assisted generation on a pair built from configs (``decode.bench.synthetic_pair``: ≈1.03B Llama target, ≈110M
early-exit draft), batch 1 and 16, on random prompts. Prints the bench tables; writes JSON under ``--out``.

    python scripts/gpu_bench.py --out DIR            # CUDA, full sizes
    python scripts/gpu_bench.py --tiny --out DIR     # any device, tiny sizes: checks the whole path in seconds

Two stages, each its own interleaved ``run_benchmark`` and its own file, so a slow compilation cannot cost the
eager results: ``gpu_bench.json`` (ours eager, with the per-step profile, vs HF), then ``gpu_bench_compiled.json``
(ours eager vs compiled).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's decode/, also when not installed

from decode.bench import (BenchConfig, OutputPaths, compile_supported, highlights, render_tables,  # noqa: E402
                          run_benchmark, write_outputs)
from decode.bench.config import parse_gammas, parse_list  # noqa: E402
from decode.bench.synthetic_pair import build_pair, greedy_agreement  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    tiny = os.environ.get("GPU_BENCH_TINY", "") not in ("", "0")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", default=tiny, help="tiny sizes (also GPU_BENCH_TINY=1)")
    p.add_argument("--out", default=os.environ.get("OUT") or None, help="folder for the JSON files (default: $OUT)")
    p.add_argument("--device", default=None, help="default: cuda if available")
    p.add_argument("--prompts", type=int, default=None, help="number of random prompts (default 8, tiny 2)")
    p.add_argument("--prompt-tokens", type=int, default=None, help="prompt length (default 48, tiny 8)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 64, tiny 8")
    p.add_argument("--gammas", default="4,auto")
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--batching", default="static",
                   help="static and/or continuous (decode bench --batching); static by default, so the run keeps its "
                        "8-minute budget (a continuous stream of 32 requests at batch 16 would about triple the batch "
                        "pass; written before any GPU run, unmeasured)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    small = {"prompts": 2, "prompt_tokens": 8, "max_new_tokens": 8}
    big = {"prompts": 8, "prompt_tokens": 48, "max_new_tokens": 64}
    for k, v in (small if args.tiny else big).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


def compiled_decoder_works(pair, device) -> bool:
    """Whether SpeculativeDecoder(compile=True) exists here and decodes a few tokens; prints why not."""
    if not compile_supported():
        print("compiled: SpeculativeDecoder has no compile option in this version; compiled runs skipped", flush=True)
        return False
    from decode import SpeculativeDecoder

    try:
        t0 = time.perf_counter()
        SpeculativeDecoder(pair.target, pair.draft, 2, compile=True).generate(
            torch.tensor([[1, 5, 6, 7]], device=device), max_new_tokens=4)
        print(f"compiled: first compiled generate took {time.perf_counter() - t0:.1f} s", flush=True)
        return True
    except Exception as err:  # a platform without a working compiler: report it, keep the eager results
        print(f"compiled: SpeculativeDecoder(compile=True) failed here ({type(err).__name__}: {err}); "
              "compiled runs skipped", flush=True)
        return False


def stage(name: str, pair, prompts, cfg: BenchConfig, paths: OutputPaths | None, info: dict) -> None:
    """One interleaved run: tables on stdout, the JSON (and plots) at ``paths`` when given."""
    t0 = time.perf_counter()
    results = run_benchmark(pair.target, pair.draft, prompts, [None] * len(prompts), cfg, pad_token_id=0,
                            progress=False)
    results["pair"] = info
    results["wall_s"] = time.perf_counter() - t0
    if paths is not None:
        written = write_outputs(results, paths)
    else:
        results["report"] = highlights(results)
    print(f"\n=== {name}: {results['wall_s']:.0f} s ===", flush=True)
    render_tables(results)
    if paths is not None:
        print(f"wrote {written['results']}", flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # HF's assisted generate warns about its own internal generation_config use
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type != "cuda" and not args.tiny:
        print("error: the full-size pair (≈1B target) needs a CUDA device; use --tiny (GPU_BENCH_TINY=1) to check "
              "the path on a CPU", file=sys.stderr)
        return 2
    try:  # settings and output paths, before any model is built
        gammas, auto = parse_gammas(args.gammas)
        temperatures = parse_list(args.temperatures, float, "temperature")
        batch_sizes = parse_list(args.batch_sizes, int, "batch size")
        batching = parse_list(args.batching, str, "batching")
        BenchConfig(batch_sizes=batch_sizes, batching=batching).validate()  # named errors before the pair is built
        out = Path(args.out) if args.out else None
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
        # Both stages' files: an earlier run's results are never replaced.
        paths = {name: OutputPaths.plan(out / f"{name}.json") if out else None
                 for name in ("gpu_bench", "gpu_bench_compiled")}
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    dtype = torch.bfloat16 if device.type == "cuda" and not args.tiny else torch.float32  # tiny: exact checks
    t0 = time.perf_counter()
    pair = build_pair("tiny" if args.tiny else "full", device=device, dtype=dtype, seed=args.seed)
    vocab = pair.target.config.vocab_size
    g = torch.Generator().manual_seed(args.seed)
    prompts = [[1] + torch.randint(3, vocab, (args.prompt_tokens - 1,), generator=g).tolist()
               for _ in range(args.prompts)]
    agree = greedy_agreement(pair, torch.tensor(prompts, device=device))
    info = {"size": "tiny" if args.tiny else "full", "target_parameters": pair.target_parameters,
            "draft_parameters": pair.draft_parameters, "draft_layers": pair.draft_layers,
            "late_layer_scale": pair.late_layer_scale, "logit_scale": pair.logit_scale, "dtype": str(dtype),
            "teacher_forced_greedy_agreement": agree}
    print(f"pair: target {pair.target_parameters / 1e6:.2f}M, draft {pair.draft_parameters / 1e6:.2f}M "
          f"(first {pair.draft_layers} layer(s)), {dtype}, on {device}"
          + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
          + f"; teacher-forced greedy agreement {agree:.2f}; built in {time.perf_counter() - t0:.0f} s", flush=True)
    common = dict(gammas=gammas, auto=auto, temperatures=temperatures, batch_sizes=batch_sizes, batching=batching,
                  max_new_tokens=args.max_new_tokens, ignore_eos=True, cost_repeats=11, seed=args.seed,
                  target="synthetic", draft="synthetic", prompts="random", limit=args.prompts, device=str(device),
                  dtype=str(dtype).replace("torch.", ""))
    # Stage 1: ours (eager, with the per-step profile: where a step's time goes on the GPU) vs HF, HF assisted at
    # the same fixed γ as ours.
    stage("gpu_bench", pair, prompts, BenchConfig(**common, hf=True, hf_gammas=gammas, profile=True),
          paths["gpu_bench"], info)
    # Stage 2: ours eager vs compiled (no HF: its numbers are in stage 1).
    if compiled_decoder_works(pair, device):
        stage("gpu_bench_compiled", pair, prompts, BenchConfig(**{**common, "auto": False}, hf=False, compile=True),
              paths["gpu_bench_compiled"], info)
    return 0


if __name__ == "__main__":
    sys.exit(main())
