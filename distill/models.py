"""Load the frozen target and the draft, attach LoRA, and check the pair with the decoder's compatibility rule.

The draft is either an existing checkpoint (``draft.name_or_path``) or a new model built from the target's config
with fewer layers / a smaller width (``draft.num_hidden_layers``, ``draft.hidden_size``, ...), optionally
initialized from the target's embeddings and first layers (every tensor whose name and shape match is copied).
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
import transformers  # (AutoModelForCausalLM loads on first use, not with this import)

from decode import loading
from decode.compat import IncompatibleModelsError, NotCausalError, check_compatibility
from distill.config import ARCH_KEYS, SetupError
from distill.export import load_checkpoint_draft


def _loaded(load: Any, what: str, key: str) -> Any:
    """Run a ``decode.loading`` loader; its FileNotFoundError becomes a SetupError naming the config key to fix."""
    try:
        return load()
    except loading.RemoteCodeError as e:
        group = "draft" if key.startswith("draft") else "target"  # in the schema: no "+" (that would fail)
        raise SetupError(f"the {what} ships its own Python code (auto_map in its config), which is not run unless "
                         f"you set {group}.trust_remote_code=true; read that code first") from e
    except FileNotFoundError as e:
        raise SetupError(f"cannot load the {what}: {e} Set {key}=/path/to/checkpoint (a save_pretrained "
                         "directory) or a cached hub id (HF_HUB_OFFLINE may be set).") from e
    except NotCausalError as e:
        raise SetupError(f"{e} Set {key} to a causal LM checkpoint.") from e


def load_tokenizer(name_or_path: str, key: str = "+target.name_or_path (or +target.tokenizer)",
                   trust_remote_code: bool = False) -> Any:
    """The target's tokenizer through ``decode.loading.load_tokenizer``, with eos as pad when it has no pad token
    (batched rollouts and training pad their rows). ``trust_remote_code`` (``target.trust_remote_code=true``) lets
    the tokenizer folder run its own Python code. Raises SetupError naming ``key``."""
    return _loaded(lambda: loading.load_tokenizer(str(name_or_path), "tokenizer", pad_from_eos=True,
                                                  trust_remote_code=trust_remote_code,
                                                  fix="set +target.tokenizer=PATH"),
                   f"tokenizer {str(name_or_path)!r}", key)


def load_draft_tokenizer(cfg: Any) -> Any:
    """``draft.tokenizer`` when set, else the tokenizer saved with an existing draft checkpoint (None for a built
    draft or a folder without one), via ``decode.loading.load_draft_tokenizer``; a run's checkpoint folder keeps it
    in ``draft/``.

    The recipe trains on the target's tokens; a draft whose own tokenizer differs reads them through the
    token-level intersection (:mod:`distill.cross_vocab`), and its tokenizer is saved with its checkpoints.
    """
    own = cfg.get("tokenizer")
    if not cfg.get("name_or_path"):
        if own:
            raise SetupError(f"draft.tokenizer={own} needs draft.name_or_path: a draft built from the target's config "
                             "has the target's vocabulary. Give the draft checkpoint, or set draft.tokenizer=null")
        return None
    path = Path(cfg.name_or_path) / "draft" if (Path(cfg.name_or_path) / "trainer_state.json").exists() \
        else Path(cfg.name_or_path)
    trust = bool(cfg.get("trust_remote_code", False))
    return _loaded(lambda: loading.load_draft_tokenizer(str(path), None, trust, str(own) if own else None),
                   f"draft tokenizer {str(own or path)!r}", "draft.tokenizer" if own else "draft.name_or_path")


def load_target(cfg: Any) -> Any:
    """The frozen target: ``eval()``, ``requires_grad_(False)``, in ``target.dtype``. ``cfg`` is the target node.

    Remote code (a checkpoint's own Python modeling files) runs only with ``target.trust_remote_code=true``.

    Raises SetupError when ``target.name_or_path`` is missing or cannot be loaded.
    """
    if not cfg.get("name_or_path"):
        raise SetupError("no target given: pass +target=NAME (conf/target/NAME.yaml) or "
                         "+target.name_or_path=/path/or/hub-id")
    name, trust = str(cfg.name_or_path), bool(cfg.get("trust_remote_code", False))
    return _loaded(lambda: loading.load_causal_lm(name, "target", cfg.get("dtype") or None,  # frozen, eval()
                                                  trust_remote_code=trust),
                   f"target {name!r}", "+target.name_or_path")


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


SHAPE_KEYS = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_key_value_heads")


def check_overrides_took(draft: Any, target_config: Any, cfg: Any) -> None:
    """Raise SetupError when a ``draft.<key>`` override that changes weight shapes left the built draft's shapes as
    they would be without it: the config class keeps the value but its model reads another field (FalconConfig
    stores ``num_key_value_heads``, FalconForCausalLM reads ``num_kv_heads``). The comparison builds on the meta
    device (no memory, no init)."""
    shapes = {k: tuple(v.shape) for k, v in draft.state_dict().items()}
    for key in SHAPE_KEYS:
        value = cfg.get(key)
        if value is None or int(value) == getattr(target_config, key, None):
            continue
        without = draft_config_from_target(target_config, {k: cfg.get(k) for k in ARCH_KEYS if k != key})
        with torch.device("meta"):
            other = transformers.AutoModelForCausalLM.from_config(without)
        if {k: tuple(v.shape) for k, v in other.state_dict().items()} == shapes:
            raise SetupError(f"draft.{key}={value} changes nothing in the {type(draft).__name__} built from the "
                             f"target's config ({type(target_config).__name__} keeps {key} but its model reads "
                             "another field); remove the override, or build the draft yourself and give "
                             "draft.name_or_path")


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

    Remote code runs only with ``draft.trust_remote_code=true``. ``draft.dtype`` null means float32: the optimizer
    needs float32 master weights (bf16 compute comes from ``train.mixed_precision``); ``auto`` keeps a loaded checkpoint's own dtype.
    """
    dtype = loading.resolve_dtype(cfg.get("dtype") or "float32")
    if cfg.get("name_or_path") and (Path(cfg.name_or_path) / "trainer_state.json").exists():  # a run's: LoRA merged
        name, trust = str(cfg.name_or_path), bool(cfg.get("trust_remote_code", False))
        draft = _loaded(lambda: load_checkpoint_draft(name, None if dtype == "auto" else dtype, trust)[0],
                        f"draft {name!r}", "draft.name_or_path")
    elif cfg.get("name_or_path"):
        name, trust = str(cfg.name_or_path), bool(cfg.get("trust_remote_code", False))
        draft = _loaded(lambda: loading.load_causal_lm(name, "draft", dtype, trust_remote_code=trust),
                        f"draft {name!r}", "draft.name_or_path")
    else:
        dcfg = draft_config_from_target(target.config, cfg)
        torch.manual_seed(int(cfg.get("seed", 0)))  # the init is part of the experiment: make it repeatable
        draft = transformers.AutoModelForCausalLM.from_config(dcfg)
        check_overrides_took(draft, target.config, cfg)
        draft = draft.to(target.dtype if dtype == "auto" else dtype)
        if cfg.get("init_from_target", True):
            init_from_target(draft, target)
    draft.requires_grad_(True)  # a merged LoRA checkpoint comes back frozen; attach_lora freezes the base again
    draft.train()
    return draft


def attach_lora(draft: Any, cfg: Any) -> Any:
    """Wrap the draft with a peft LoRA adapter (``train.lora``: r, alpha, dropout, target_modules, and
    modules_to_save: modules peft trains in full beside the adapter, e.g. ``[lm_head]``; export merges them).

    ``alpha`` is passed as given (a float: the adapter's scale is alpha / r); truncating it to an integer would
    turn ``train.lora.alpha=0.5`` into 0, an adapter with zero scale and zero gradient that never trains.
    """
    from peft import LoraConfig, get_peft_model

    modules = cfg.get("target_modules") or "all-linear"
    if not isinstance(modules, str):
        modules = list(modules)
    save = list(cfg.get("modules_to_save") or [])
    leaves = {n.rsplit(".", 1)[-1] for n, _ in draft.named_modules() if n}
    missing = [m for m in save if m not in leaves]
    if missing:  # peft would train nothing for them, without a word
        raise SetupError(f"train.lora.modules_to_save={save} names {missing}, which the draft has no module called; "
                         f"e.g. train.lora.modules_to_save=[lm_head]")
    if isinstance(modules, list):  # peft adapts the names that match and skips the rest with a warning only
        names = [n for n, _ in draft.named_modules() if n]
        unmatched = [m for m in modules if not any(n == m or n.endswith("." + m) for n in names)]
        if unmatched and len(unmatched) < len(modules):
            linear = sorted({n.rsplit(".", 1)[-1] for n, m in draft.named_modules() if isinstance(m, torch.nn.Linear)})
            raise SetupError(f"train.lora.target_modules={modules} names {unmatched}, which the draft "
                             f"({type(draft).__name__}) has no module called, so they would get no adapter; its "
                             f"linear layers are {linear}: fix the list or use train.lora.target_modules=all-linear")
    alpha = float(cfg.alpha)
    lcfg = LoraConfig(r=int(cfg.r), lora_alpha=int(alpha) if alpha.is_integer() else alpha,
                      lora_dropout=float(cfg.dropout), target_modules=modules, bias="none", task_type="CAUSAL_LM",
                      modules_to_save=save or None)
    try:
        return get_peft_model(draft, lcfg)
    except ValueError as e:
        names = sorted({n.rsplit(".", 1)[-1] for n, m in draft.named_modules() if isinstance(m, torch.nn.Linear)})
        raise SetupError(f"train.lora.target_modules={modules!r} matches no module of the draft; its linear layers "
                         f"are {names} ({e})") from e


def check_pair(target: Any, draft: Any, tokenizer: Any, draft_tokenizer: Any = None, cross_vocab: bool = False) -> int:
    """Shared vocabulary size V (the target's for a draft with a tokenizer of its own, ``cross_vocab``:
    :mod:`distill.cross_vocab`); raises SetupError (from decode.compat's IncompatibleModelsError) naming the fix."""
    try:
        return check_compatibility(target, draft, tokenizer, draft_tokenizer, cross_vocab=cross_vocab)
    except IncompatibleModelsError as e:
        raise SetupError(f"incompatible target/draft pair: {e}") from e


def is_local_path(name_or_path: str) -> bool:
    """True for something that looks like a filesystem path rather than a hub id (``decode.loading.looks_local``)."""
    return loading.looks_local(name_or_path)
