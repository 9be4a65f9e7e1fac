"""Speedup-calibrated benchmark: plain decoding, our speculative decoder at each γ and γ="auto", and Hugging Face
assisted generation, side by side on one target/draft pair and one prompt set, in one interleaved run.

    python -m decode bench --target PATH --draft PATH --prompts humaneval --limit 20 --max-new-tokens 64 \
        --gammas 1,2,4,8 --temperatures 0,1 --batch-sizes 1,4,8 --out checkpoints/bench.json

One job per module (see docs/bench.md):
- ``config``: settings, the γ/temperature lists, the methods;
- ``runs``: timed calls of our engine, the interleaved main pass, the batch pass -> the results dict;
- ``measure``: the one measurement of a draft against its target (interleaving, α, τ, c, v_γ, the prediction and
  the γ it picks), which ``distill.evaluate`` and the quickstart call too;
- ``hf_assisted``: the Hugging Face baseline (``generate`` alone and with ``assistant_model``);
- ``bare_forward``: the bare HF decode forwards, the reference for the engine's cost ratio c;
- ``pool``: per-prompt records -> metrics (``DecodeStats``), predictions (``decode.speedup``), summary;
- ``report``: the highlights, the verdict (whether drafting pays off), the JSON schema, output paths, tables;
  ``plots``: PNG figures;
- ``cli``: ``python -m decode bench``; ``synthetic_pair``: a target/draft pair built from configs for
  ``scripts/gpu_bench.sh``.

α is Leviathan et al.'s per-token acceptance (``alpha``); ``acceptance_rate`` is Σaccepted/Σdrafted; c comes from
``decode.costs.measure_cost_ratio``; the prediction is (1 − α^(γ+1)) / ((1 − α)(γc + 1)) (Leviathan et al.
2023, Sec. 3) and its verify-aware variant.
"""
from decode.bench.cli import build_parser, main, run_cli
from decode.bench.config import HF, OURS, BenchConfig, Method, build_methods, parse_gammas
from decode.bench.hf_assisted import hf_generation_config, run_hf
from decode.bench.pool import alpha_from_steps
from decode.bench.report import (OutputPaths, break_even_alpha, highlights, render_tables, validate_results, verdict,
                                 write_outputs)
from decode.bench.runs import SCHEMA_VERSION, compile_supported, run_benchmark, run_ours

__all__ = ["BenchConfig", "Method", "OURS", "HF", "SCHEMA_VERSION", "OutputPaths", "alpha_from_steps",
           "break_even_alpha", "build_methods", "build_parser", "compile_supported", "hf_generation_config", "main",
           "highlights", "parse_gammas", "render_tables", "run_benchmark", "run_cli",
           "run_hf", "run_ours", "validate_results", "verdict", "write_outputs"]
