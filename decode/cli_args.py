"""What the commands of ``python -m decode`` (``generate``, ``serve``) share: the ``--num-draft-tokens`` argument and
its default with a draft (``auto``), ``--draft-tokenizer`` (every command that takes ``--draft``), and the slowdown
warning of a fixed γ (:func:`slowdown_warning`)."""
from __future__ import annotations

import argparse
from typing import Any

from decode import costs
from decode.loading import check_cached
from decode.speedup import predicted_speedup, verify_cost_at

DEFAULT_NUM_DRAFT_TOKENS = "auto"  # γ of `generate` and `serve` with a draft and no -g: the calibrated choice
MIN_DRAFTED_TO_WARN = 200  # drafted tokens before the server judges a fixed γ by its measured acceptance


def num_draft_tokens_arg(value: str) -> int | str:
    """``--num-draft-tokens``: γ as an integer >= 0, or ``"auto"``."""
    if value == "auto":
        return value
    try:
        g = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--num-draft-tokens must be an integer >= 0 or 'auto', got {value!r}")
    if g < 0:
        raise argparse.ArgumentTypeError(f"--num-draft-tokens must be >= 0, got {g}")
    return g


DRAFT_TOKENIZER_HELP = ("the draft's tokenizer: folder, .gguf file or hub id (default: the draft's own when its "
                        "checkpoint has one, else the target's); one of another vocabulary than the target's drafts "
                        "through the tokens both share (docs/decode.md, \"Drafts with their own tokenizer\")")


def add_draft_tokenizer_arg(parser: argparse.ArgumentParser) -> None:
    """``--draft-tokenizer PATH`` (checked by :func:`check_draft_tokenizer_arg`)."""
    parser.add_argument("--draft-tokenizer", default=None, metavar="PATH", help=DRAFT_TOKENIZER_HELP)


def check_draft_tokenizer_arg(draft: str | None, draft_tokenizer: str | None) -> None:
    """Before any model loads: ``--draft-tokenizer`` needs ``--draft``, and its path must exist (a hub id must be
    in the local cache when offline). Raises ValueError / FileNotFoundError naming the option."""
    if draft_tokenizer is None:
        return
    if not draft:
        raise ValueError(f"--draft-tokenizer {draft_tokenizer} is the draft's tokenizer, and no --draft was given: "
                         "add --draft PATH, or drop --draft-tokenizer")
    check_cached(draft_tokenizer, "--draft-tokenizer")


def command_gamma(num_draft_tokens: int | str | None, has_draft: bool) -> int | str:
    """The γ a command decodes with: ``--num-draft-tokens`` as given, ``auto`` when left out, 0 without a draft."""
    if not has_draft:
        return 0
    return DEFAULT_NUM_DRAFT_TOKENS if num_draft_tokens is None else num_draft_tokens


def fixed_gamma_cost_model(decoder: Any) -> dict:
    """The cost model at batch size 1 (``{"cost_ratio": c, "verify": [v_0, .., v_max], ...}``) of a decoder with a
    draft, measured now by :func:`decode.costs.calibrate` on a dummy 64-token context (a few seconds of timed
    forwards on a CPU): what :func:`slowdown_warning` prices a fixed γ with."""
    return costs.calibrate(decoder, [i % decoder.vocab_size for i in range(1, 65)], [1])[1]


def fixed_gamma_speedup(alpha: float, gamma: int, cost_model: dict) -> float:
    """The verify-aware predicted speedup over plain decoding of a fixed γ at per-token acceptance α,
    ``(1 − α^(γ+1)) / ((1 − α)(γc + v_γ))`` with c and v_γ from ``cost_model`` (:func:`fixed_gamma_cost_model`)."""
    return predicted_speedup(alpha, gamma, cost_model["cost_ratio"], verify_cost_at(cost_model["verify"], gamma))


def slowdown_warning(alpha: float, num_drafted: int, gamma: int, cost_model: dict, fix: str) -> str | None:
    """A one-line warning when a fixed γ > 0 at the per-token acceptance α measured over ``num_drafted`` drafted
    tokens is predicted to be slower than plain decoding (:func:`fixed_gamma_speedup` < 1), ending with ``fix``
    (what to do); None when it is not, or when nothing was drafted."""
    if not gamma or not num_drafted:
        return None
    speedup = fixed_gamma_speedup(alpha, gamma, cost_model)
    if speedup >= 1.0:
        return None
    return (f"warning: at the measured acceptance (α = {alpha:.3f} over {num_drafted:,} drafted tokens) and "
            f"the measured costs (c = {cost_model['cost_ratio']:.3f}, v_{gamma} = "
            f"{verify_cost_at(cost_model['verify'], gamma):.2f}), γ = {gamma} is predicted to run at {speedup:.2f}× "
            f"plain decoding's speed, slower than the target alone: {fix}")
