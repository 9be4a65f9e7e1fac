"""Load the frozen target and the draft, attach LoRA, and check the pair with the decoder's compatibility rule.

The draft is either an existing checkpoint (``draft.name_or_path``) or a new model built from the target's config
with fewer layers / a smaller width (``draft.num_hidden_layers``, ``draft.hidden_size``, ...), optionally
initialized from the target's embeddings and first layers (every tensor whose name and shape match is copied).
"""
from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import torch

from decode.engine import context_length  # noqa: F401  (the recipe imports it from here)
from decode.loading import DTYPES


# Width keys of a derived draft config; passed through only when set, so any architecture works for layers alone.
ARCH_KEYS = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads")


class SetupError(ValueError):
    """A configuration or input problem found before training starts; the message names the fix."""


def resolve_dtype(name: str | None) -> Any:
    """Map a config dtype string (``bf16``, ``float32``, ``auto``, None) to a torch dtype (None = leave as is)."""
    if name is None:
        return None
    if name not in DTYPES:
        raise SetupError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[name]


def _from_pretrained(cls: Any, name_or_path: str, what: str, key: str, **kw: Any) -> Any:
    try:
        return cls.from_pretrained(name_or_path, **kw)
    except (OSError, ValueError) as e:
        if "trust_remote_code" in str(e):
            group = "draft" if key.startswith("draft") else "+target"
            raise SetupError(f"the {what} {name_or_path!r} ships its own Python code (auto_map in its config), which "
                             f"is not run unless you set {group}.trust_remote_code=true; read that code first") from e
        local = Path(name_or_path).expanduser()
        where = ("the directory exists but holds no loadable checkpoint" if local.is_dir() else
                 "not a local directory, and not a hub id in the local cache (HF_HUB_OFFLINE may be set)")
        raise SetupError(f"cannot load the {what} {name_or_path!r}: {where}. Set {key}=/path/to/checkpoint "
                         f"(a save_pretrained directory) or a cached hub id. ({type(e).__name__}: {e})") from e


def load_tokenizer(name_or_path: str, key: str = "+target.name_or_path (or +target.tokenizer)",
                   trust_remote_code: bool = False) -> Any:
    """AutoTokenizer with a pad token (eos when the tokenizer has none, as batch rollouts need padding).

    ``trust_remote_code`` (``target.trust_remote_code=true``) lets the tokenizer folder run its own Python code.
    """
    from transformers import AutoTokenizer

    tok = _from_pretrained(AutoTokenizer, name_or_path, "tokenizer", key, trust_remote_code=trust_remote_code)
    if tok.pad_token_id is None:
        if tok.eos_token is None:
            raise SetupError(f"tokenizer {name_or_path!r} has neither a pad nor an eos token; add a pad token")
        tok.pad_token = tok.eos_token
    return tok


def load_draft_tokenizer(cfg: Any) -> Any:
    """The tokenizer saved with an existing draft checkpoint (None for a built draft or a folder without one).

    The recipe trains with the target's tokenizer; the draft's own is loaded only to check that they agree.
    """
    from transformers import AutoTokenizer

    if not cfg.get("name_or_path"):
        return None
    path = Path(cfg.name_or_path) / "draft" if (Path(cfg.name_or_path) / "trainer_state.json").exists() \
        else cfg.name_or_path
    try:
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=bool(cfg.get("trust_remote_code", False)))
    except (OSError, ValueError, TypeError):
        return None


def load_target(cfg: Any) -> Any:
    """The frozen target: ``eval()``, ``requires_grad_(False)``, in ``target.dtype``. ``cfg`` is the target node.

    Remote code (a checkpoint's own Python modeling files) runs only with ``target.trust_remote_code=true``.

    Raises SetupError when ``target.name_or_path`` is missing or cannot be loaded.
    """
    from transformers import AutoModelForCausalLM

    if not cfg.get("name_or_path"):
        raise SetupError("no target given: pass +target=NAME (conf/target/NAME.yaml) or "
                         "+target.name_or_path=/path/or/hub-id")
    kw = {"dtype": resolve_dtype(cfg.get("dtype"))} if cfg.get("dtype") else {}
    kw["trust_remote_code"] = bool(cfg.get("trust_remote_code", False))
    target = _from_pretrained(AutoModelForCausalLM, cfg.name_or_path, "target", "+target.name_or_path", **kw)
    target.eval().requires_grad_(False)
    return target


def draft_config_from_target(target_config: Any, cfg: Any) -> Any:
    """A copy of the target's config with the draft's architecture overrides (``draft.<ARCH_KEYS>``) applied."""
    dcfg = copy.deepcopy(target_config)
    for key in ARCH_KEYS:
        value = cfg.get(key)
        if value is None:
            continue
        if not hasattr(dcfg, key):
            raise SetupError(f"draft.{key}={value} but the target's config ({type(dcfg).__name__}) has no {key}; "
                             "remove the override or give draft.name_or_path")
        setattr(dcfg, key, int(value))
    if getattr(dcfg, "layer_types", None) is not None:  # per-layer lists must shrink with the layer count
        dcfg.layer_types = list(dcfg.layer_types)[: dcfg.num_hidden_layers]
    return dcfg


def init_from_target(draft: Any, target: Any) -> list[str]:
    """Copy every target tensor whose name and shape match the draft's (embeddings, first layers, norms, head).

    Returns the copied names. With a smaller hidden size nothing matches and the draft stays randomly initialized.
    """
    target_sd = target.state_dict()
    copied = []
    with torch.no_grad():
        for name, tensor in draft.state_dict().items():
            src = target_sd.get(name)
            if src is not None and src.shape == tensor.shape:
                tensor.copy_(src.to(tensor.dtype))
                copied.append(name)
    return copied


def load_draft(cfg: Any, target: Any) -> Any:
    """The trainable draft: ``draft.name_or_path`` if set (a HF checkpoint, or a distill checkpoint folder such as
    ``<run>/best``, whose LoRA is merged), else built from the target's config (see module doc).

    Remote code runs only with ``draft.trust_remote_code=true``. ``draft.dtype`` null means float32: the optimizer needs float32 master weights (bf16 compute comes from
    ``train.mixed_precision``); ``auto`` keeps a loaded checkpoint's own dtype.
    """
    from transformers import AutoModelForCausalLM

    dtype = resolve_dtype(cfg.get("dtype") or "float32")
    if cfg.get("name_or_path") and (Path(cfg.name_or_path) / "trainer_state.json").exists():
        from distill.export import load_checkpoint_draft  # a distill checkpoint (e.g. <run>/best): LoRA merged

        draft = load_checkpoint_draft(cfg.name_or_path, None if dtype == "auto" else dtype)[0]
    elif cfg.get("name_or_path"):
        draft = _from_pretrained(AutoModelForCausalLM, cfg.name_or_path, "draft", "draft.name_or_path", dtype=dtype,
                                 trust_remote_code=bool(cfg.get("trust_remote_code", False)))
    else:
        dcfg = draft_config_from_target(target.config, cfg)
        torch.manual_seed(int(cfg.get("seed", 0)))  # the init is part of the experiment: make it repeatable
        draft = AutoModelForCausalLM.from_config(dcfg)
        draft = draft.to(target.dtype if dtype == "auto" else dtype)
        if cfg.get("init_from_target", True):
            init_from_target(draft, target)
    draft.requires_grad_(True)  # a merged LoRA checkpoint comes back frozen; attach_lora freezes the base again
    draft.train()
    return draft


def attach_lora(draft: Any, cfg: Any) -> Any:
    """Wrap the draft with a peft LoRA adapter (``train.lora``: r, alpha, dropout, target_modules)."""
    from peft import LoraConfig, get_peft_model

    modules = cfg.get("target_modules") or "all-linear"
    if not isinstance(modules, str):
        modules = list(modules)
    lcfg = LoraConfig(r=int(cfg.r), lora_alpha=int(cfg.alpha), lora_dropout=float(cfg.dropout),
                      target_modules=modules, bias="none", task_type="CAUSAL_LM")
    try:
        return get_peft_model(draft, lcfg)
    except ValueError as e:
        names = sorted({n.rsplit(".", 1)[-1] for n, m in draft.named_modules() if isinstance(m, torch.nn.Linear)})
        raise SetupError(f"train.lora.target_modules={modules!r} matches no module of the draft; its linear layers "
                         f"are {names} ({e})") from e


def check_pair(target: Any, draft: Any, tokenizer: Any, draft_tokenizer: Any = None) -> int:
    """Shared vocabulary size V; raises SetupError (from decode.compat's IncompatibleModelsError) naming the fix."""
    from decode.compat import IncompatibleModelsError, check_compatibility

    try:
        return check_compatibility(target, draft, tokenizer, draft_tokenizer)
    except IncompatibleModelsError as e:
        raise SetupError(f"incompatible target/draft pair: {e}") from e


def is_local_path(name_or_path: str) -> bool:
    """True for something that looks like a filesystem path rather than a hub id."""
    return name_or_path.startswith((".", "/", "~")) or os.path.exists(name_or_path)
