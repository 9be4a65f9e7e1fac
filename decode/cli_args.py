"""Argument types shared by the commands of ``python -m decode`` (``generate``, ``serve``)."""
from __future__ import annotations

import argparse


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
