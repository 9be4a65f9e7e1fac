"""The recipe's configuration: defaults of optional keys and the checks that need no model or data.

Every check here runs before any model or data loads and raises SetupError naming the key and the fix.
"""
from __future__ import annotations

import math
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from distill.evaluate import SELECT_KEYS
from distill.losses import DIVERGENCES
from distill.models import ARCH_KEYS, SetupError, is_local_path

# Keys that may be absent from a composed config (the target group is not in the defaults list, and a
# `+target.name_or_path=PATH` override creates only that key).
TARGET_DEFAULTS = {"name_or_path": None, "tokenizer": None, "dtype": None}
COMPLETION_SOURCES = ("data", "target", "both")


def normalize_config(cfg: DictConfig) -> DictConfig:
    """Fill the target's defaults and validate every cheap-to-check value; raises SetupError naming the fix."""
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    if cfg.get("target") is None or isinstance(cfg.target, str):
        raise SetupError("no target given: pass +target=NAME (conf/target/NAME.yaml) or "
                         "+target.name_or_path=/path/or/hub-id")
    cfg.target = OmegaConf.merge(TARGET_DEFAULTS, cfg.target)
    validate_config(cfg)
    return cfg


def validate_config(cfg: DictConfig) -> None:
    """Checks that need no model or data (run before any loading)."""
    name = cfg.target.name_or_path
    if not name:
        raise SetupError("target.name_or_path is empty: pass +target.name_or_path=/path/or/hub-id")
    if is_local_path(str(name)) and not Path(str(name)).expanduser().exists():
        raise SetupError(f"target path {name!r} does not exist; fix +target.name_or_path=/path/to/checkpoint")
    draft = cfg.draft
    if draft.get("name_or_path"):
        if is_local_path(str(draft.name_or_path)) and not Path(str(draft.name_or_path)).expanduser().exists():
            raise SetupError(f"draft path {draft.name_or_path!r} does not exist; fix draft.name_or_path=/path")
    elif all(draft.get(k) is None for k in ARCH_KEYS):
        raise SetupError("no draft: set draft.name_or_path=/path/or/hub-id, or build one from the target's config "
                         "with draft.num_hidden_layers=N (or draft=small)")
    if cfg.loss.name not in DIVERGENCES:
        raise SetupError(f"unknown loss {cfg.loss.name!r}; choose loss=fkl|rkl|jsd|tvd")
    if not 0.0 <= float(cfg.loss.get("beta", 0.5)) <= 1.0:
        raise SetupError(f"loss.beta={cfg.loss.beta} must be in [0, 1] (0 = forward KL, 1 = reverse KL)")
    if not 0.0 <= float(cfg.loss.get("ce_weight", 0.0)) <= 1.0:
        raise SetupError(f"loss.ce_weight={cfg.loss.ce_weight} must be in [0, 1]")
    if not float(cfg.loss.get("temperature", 1.0)) > 0:
        raise SetupError(f"loss.temperature={cfg.loss.temperature} must be > 0")
    lam = float(cfg.data.on_policy_fraction)
    if not 0.0 <= lam <= 1.0:
        raise SetupError(f"data.on_policy_fraction={lam} must be in [0, 1] (the probability λ that a micro-batch "
                         "uses draft rollouts); e.g. data.on_policy_fraction=0.5")
    if cfg.data.completions not in COMPLETION_SOURCES:
        raise SetupError(f"data.completions={cfg.data.completions!r}; choose one of {COMPLETION_SOURCES}")
    if cfg.eval.select_by not in SELECT_KEYS:
        raise SetupError(f"eval.select_by={cfg.eval.select_by!r}; choose one of {SELECT_KEYS}")
    if not cfg.eval.temperatures:
        raise SetupError("eval.temperatures is empty; give at least one, e.g. eval.temperatures=[0.0]")
    for key in ("max_steps", "batch_size", "grad_accum"):
        if int(cfg.train[key]) < 1:
            raise SetupError(f"train.{key}={cfg.train[key]} must be >= 1")
    if str(cfg.train.mixed_precision) not in ("no", "bf16", "fp16"):
        raise SetupError(f"train.mixed_precision={cfg.train.mixed_precision!r}; choose no|bf16|fp16")
    if cfg.logger.name not in ("none", "wandb"):
        raise SetupError(f"logger={cfg.logger.name!r}; choose logger=none or logger=wandb")
    if int(cfg.data.max_new_tokens) < 1:
        raise SetupError(f"data.max_new_tokens={cfg.data.max_new_tokens} must be >= 1")
    for t in cfg.eval.temperatures:
        if not (isinstance(t, (int, float)) and math.isfinite(t) and t >= 0):
            raise SetupError(f"eval.temperatures has {t!r}; every temperature must be a finite number >= 0 "
                             "(0 = greedy), e.g. eval.temperatures=[0.0,1.0]")
    gamma = cfg.eval.get("num_draft_tokens", 4)
    if not isinstance(gamma, int) or isinstance(gamma, bool) or gamma < 1:
        raise SetupError(f"eval.num_draft_tokens={gamma!r} must be an integer >= 1 (γ during the measurement)")
    rt = cfg.data.get("rollout_temperature", 1.0)
    if not (isinstance(rt, (int, float)) and math.isfinite(rt) and rt >= 0):
        raise SetupError(f"data.rollout_temperature={rt!r} must be a finite number >= 0 (0 = greedy rollouts)")
    lr = cfg.optim.get("lr", 1e-4)
    if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
        raise SetupError(f"optim.lr={lr!r} must be a finite number > 0, e.g. optim.lr=1e-4")
