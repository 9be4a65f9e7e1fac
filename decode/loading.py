"""Load a target/draft pair and its tokenizer from local paths or hub ids, with clear errors."""
from __future__ import annotations

import os
from typing import Any

import torch

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "float64": torch.float64, "auto": "auto"}


def resolve_dtype(name: str | torch.dtype) -> Any:
    """``"float32" | "bfloat16" | "float16" | "auto"`` (or a torch.dtype) -> the value for ``from_pretrained``."""
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use one of {sorted(DTYPES)}")
    return DTYPES[name]


def load_causal_lm(name_or_path: str, role: str = "model", dtype: str | torch.dtype = "float32",
                   device: str | None = None) -> Any:
    """``AutoModelForCausalLM.from_pretrained`` in eval mode with frozen weights.

    Raises:
        FileNotFoundError: ``name_or_path`` looks like a local path (contains a path separator or starts with
            ``.``) but does not exist, or it could not be loaded from the hub (e.g. offline), naming the role.
    """
    from transformers import AutoModelForCausalLM

    looks_local = os.sep in name_or_path or name_or_path.startswith(".")
    if looks_local and not os.path.isdir(name_or_path):
        raise FileNotFoundError(f"{role} path {name_or_path!r} does not exist; pass a directory written by "
                                "save_pretrained (or a hub id when online)")
    try:
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=resolve_dtype(dtype))
    except OSError as err:
        raise FileNotFoundError(
            f"could not load the {role} {name_or_path!r}: not a local checkpoint directory, and the hub is not "
            f"reachable or has no such model ({err.__class__.__name__}). Pass a local path written by save_pretrained."
        ) from err
    model.eval().requires_grad_(False)
    if device:
        model.to(device)
    return model


def load_tokenizer(name_or_path: str, role: str = "tokenizer") -> Any:
    """``AutoTokenizer.from_pretrained`` with a clear error when it is missing."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name_or_path)
    except (OSError, ValueError) as err:
        raise FileNotFoundError(f"could not load the {role} from {name_or_path!r}: {err}. Save the tokenizer next to "
                                "the model (tokenizer.save_pretrained) or pass --tokenizer PATH.") from err


def default_device() -> str:
    """``"cuda"`` when available, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_device(device: str | None) -> str:
    """The device to use (``default_device()`` when None); raises ValueError if it is a CUDA device and this torch
    build or machine has none."""
    device = device or default_device()
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but this torch build or machine has no CUDA device; "
                         "use --device cpu (or install a CUDA build of torch on a GPU machine)")
    return device


def load_draft_tokenizer(draft_path: str, target_tokenizer: Any) -> Any:
    """The draft's own tokenizer if its checkpoint folder has one (so the pair can be checked), else the target's."""
    if os.path.isdir(draft_path) and any(os.path.exists(os.path.join(draft_path, f))
                                         for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return load_tokenizer(draft_path, "draft tokenizer")
    return target_tokenizer


def chat_prompt_ids(tokenizer: Any, messages: list[dict]) -> list[int]:
    """Token ids of ``messages`` (``[{"role", "content"}]``) through the tokenizer's chat template, with the
    assistant turn opened (``add_generation_prompt=True``).

    transformers 5 returns a dict (``BatchEncoding``) from ``apply_chat_template``, 4.x a list of ids; both work.

    Raises:
        ValueError: the tokenizer has no chat template.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template, so chat messages cannot be turned into a prompt; "
                         "send plain text (/v1/completions, or decode generate without --chat)")
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(out, "keys"):
        out = out["input_ids"]
    return [int(i) for i in out]
