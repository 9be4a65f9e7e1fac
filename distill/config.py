"""The recipe's typed configuration: one dataclass per config group, registered in Hydra's ConfigStore, and
:func:`compose`, which composes ``conf/`` with command-line overrides.

``Config`` is the schema of ``conf/config.yaml`` (its defaults list starts with ``distill_schema``), so every group
YAML is merged into a typed node: an unknown key (``train.max_step``) or a wrong type (``train.max_steps=abc``)
fails while Hydra composes. :func:`check_values` then checks values (ranges, allowed choices), without reading the
disk; :mod:`distill.checks` adds the checks against the disk and the machine. All run before any model or data
loads and raise :class:`SetupError` naming the key, the allowed values and the fix.

A scalar where a list is expected (``eval.temperatures=0.5``) is rejected with the list form to type
(``eval.temperatures=[0.5]``), the same as any other type error: silently wrapping would hide a typo such as
``eval.temperatures=0.5,1.0`` (a Hydra sweep, not a list).
"""
from __future__ import annotations

import difflib
import json
import math
import os
import re
import typing
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

from decode.loading import DTYPES

SCHEMA_NAME = "distill_schema"


class SetupError(ValueError):
    """A configuration or input problem found before training starts; the message names the fix."""


# Width keys of a derived draft config; passed through only when set, so any architecture works for layers alone.
ARCH_KEYS = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads")


# ------------------------------------------------------------------------------------------------ the schema
# Field comments are the documentation; the YAMLs under conf/ repeat them next to each value.

@dataclass
class TargetConfig:
    """``target``: the frozen target (``+target=NAME`` picks conf/target/NAME.yaml)."""

    name_or_path: Optional[str] = None   # local save_pretrained folder or hub id (required)
    tokenizer: Optional[str] = None      # tokenizer path if not stored with the target (null: name_or_path)
    dtype: Optional[str] = None          # float32 | bf16 | fp16 | auto | null (the checkpoint's default)
    trust_remote_code: bool = False      # let transformers run the checkpoint's own model code


@dataclass
class DraftVocabConfig:
    """``draft.vocab``: a vocabulary-pruned draft head (decode/vocab_map.py, distill/vocab.py)."""

    keep: Optional[int] = None  # N target ids the draft's lm_head keeps (most target mass on the data); null: all


@dataclass
class DraftConfig:
    """``draft``: an existing checkpoint, or a model built from the target's config with these overrides."""

    name_or_path: Optional[str] = None          # existing draft (hub id, local path, or a run's checkpoint)
    tokenizer: Optional[str] = None             # the draft's own tokenizer; null: the one saved with name_or_path
    num_hidden_layers: Optional[int] = None     # built draft: layers
    hidden_size: Optional[int] = None           # built draft: width
    intermediate_size: Optional[int] = None     # built draft: MLP width
    num_attention_heads: Optional[int] = None   # built draft: attention heads
    num_key_value_heads: Optional[int] = None   # built draft: KV heads (GQA)
    init_from_target: bool = True               # built draft: copy target tensors with the same name and shape
    dtype: Optional[str] = None                 # null: float32 master weights; auto: the checkpoint's
    seed: int = 0                               # init seed of a built draft
    trust_remote_code: bool = False             # let transformers run the checkpoint's own model code
    vocab: DraftVocabConfig = field(default_factory=DraftVocabConfig)  # keep: prune the lm_head to N ids


@dataclass
class SourceConfig:
    """``data.source`` / ``eval.prompts``: a local file or a named corpus (distill/data.py)."""

    path: Optional[str] = None                  # .jsonl/.jsonl.gz/.json/.parquet/.csv/.txt
    corpus: Optional[str] = None                # or a corpus name of distill.corpus.load_corpus
    corpus_kwargs: Dict[str, Any] = field(default_factory=dict)  # extra keyword arguments of load_corpus
    split: str = "train"                        # corpus split: train | validation | test
    kind: str = "auto"                          # auto | prompts | text
    prompt_field: str = "prompt"                # field holding the prompt
    completion_field: Optional[str] = None      # field holding a fixed completion (null: none)
    text_field: str = "text"                    # kind=text: document field
    sample_by: str = "paragraph"                # .txt: line | paragraph | document
    prompt_tokens: int = 32                     # kind=text: prefix length
    completion_tokens: int = 32                 # kind=text: continuation length
    windows_per_doc: Optional[int] = None       # kind=text: windows per document (null: all)
    add_bos: bool = True                        # kind=text: bos before each prefix
    limit: Optional[int] = None                 # at most this many rows (kind=text: documents, before windowing)


@dataclass
class TargetGeneratedConfig:
    """``data.target_generated``: the sequence-level KD cache made by ``generate-data``."""

    path: Optional[str] = None      # cache folder (null: <train.output_dir>/target_data)
    temperature: float = 0.0        # target sampling temperature (0: greedy)
    batch_size: int = 8             # prompts per decoder call
    shard_size: int = 64            # prompts per saved shard
    use_draft: bool = True          # draft speculatively while generating (lossless)


@dataclass
class DataConfig:
    """``data``: prompts, completions and the on-policy fraction λ."""

    source: SourceConfig = field(default_factory=SourceConfig)
    chat_template: bool = True                  # apply the tokenizer's chat template to prompts
    append_eos: bool = True                     # end fixed completions with eos
    max_prompt_tokens: Optional[int] = 512      # prompt length bound (null: the context only)
    truncate_prompts: bool = False              # keep the last max_prompt_tokens instead of failing
    train_prompt_tokens: Optional[int] = None   # training sequences keep their prompts' last N tokens (null: whole)
    max_new_tokens: int = 128                   # completion / rollout / generation length
    shuffle: bool = True                        # shuffle each epoch
    holdout: int = 32                           # eval prompts held out when eval.prompts is null
    completions: str = "data"                   # data | target | both
    target_generated: TargetGeneratedConfig = field(default_factory=TargetGeneratedConfig)
    on_policy_fraction: float = 0.0             # λ in [0, 1]
    rollout_temperature: float = 1.0            # draft sampling temperature of rollouts
    target_logits: str = "online"               # online (target forward per step) | cached (data.logit_cache)
    logit_cache: Optional[str] = None           # folder of cached target logits (data.target_logits=cached)
    logit_cache_k: Optional[int] = 32           # ids kept per position (top-k + tail); train with null: the cache's k
    logit_cache_tail_samples: Optional[int] = 0  # ids sampled per position from the target's tail (loss=fkl); null: the cache's
    logit_cache_shard_size: int = 256           # examples per cache shard (unit of resume and of the process split)


@dataclass
class LossConfig:
    """``loss``: the divergence between target and draft (distill/losses.py)."""

    name: str = "tvd"           # fkl | rkl | jsd | tvd | acceptance
    beta: float = 0.5           # jsd: 0 = forward KL, 1 = reverse KL
    temperature: float = 1.0    # softmax temperature of both logits
    ce_weight: float = 0.0      # (1 - w) * divergence + w * cross-entropy
    ce_labels: str = "data"     # the CE term's labels: data (the completion's next tokens) | target (its top-1 id)
    gamma: int = 4              # acceptance: γ, the number of drafted tokens the loss models
    fused: bool = True          # fkl/rkl/jsd/tvd (online and cached) with the closed-form gradient; false: autograd


@dataclass
class OptimConfig:
    """``optim``: AdamW with warmup + decay and gradient clipping."""

    lr: float = 1.0e-4                                              # peak learning rate
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])  # AdamW betas
    eps: float = 1.0e-8                                             # AdamW epsilon
    weight_decay: float = 0.0                                       # decoupled weight decay
    warmup_steps: int = 20                                          # linear warmup steps
    scheduler: str = "cosine"                                       # cosine | linear | constant
    min_lr_ratio: float = 0.1                                       # final lr / peak lr
    max_grad_norm: Optional[float] = 1.0                            # clip threshold (null or 0: none)


@dataclass
class LoraConfig:
    """``train.lora``: a peft LoRA adapter instead of a full fine-tune."""

    enabled: bool = False                   # train an adapter only
    r: int = 16                             # rank
    alpha: float = 32                       # scale alpha / r
    dropout: float = 0.0                    # adapter dropout
    target_modules: Any = "all-linear"      # module names, e.g. [q_proj, v_proj], or all-linear
    modules_to_save: Optional[List[str]] = None  # modules trained in full beside the adapter, e.g. [lm_head]


@dataclass
class TrainConfig:
    """``train``: the loop, precision, checkpoints."""

    max_steps: int = 1000                   # optimizer steps
    stop_at: Optional[int] = None           # stop (with a checkpoint) after this step
    batch_size: int = 8                     # sequences per micro-batch per process
    grad_accum: int = 1                     # micro-batches per optimizer step
    mixed_precision: str = "no"             # no | bf16 | fp16 (fp16: GPU only) | auto (bf16 where native, distill/precision.py)
    cpu: bool = False                       # force CPU
    seed: int = 0                           # seeds init, data order, on-policy draws
    output_dir: str = "checkpoints/run"     # run folder
    overwrite: bool = False                 # a fresh run deletes the earlier run in output_dir (else: refused)
    save_every: int = 200                   # checkpoint every N steps (0: only at the end)
    keep_last: int = 2                      # step checkpoints kept
    resume: Union[bool, str] = False        # false | true (newest complete checkpoint in output_dir) | PATH
    log_every: int = 10                     # log every N steps
    progress: str = "rich"                  # rich | tqdm | none
    max_time_s: Optional[float] = None      # wall-clock budget in seconds (null: none)
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class EvalConfig:
    """``eval``: periodic α/τ measurement (teacher-forced or by generation), best-checkpoint selection."""

    method: str = "teacher_forced"                  # teacher_forced (held-out target text) | generate
    with_cached_logits: bool = False                # data.target_logits=cached: load the target to evaluate
    prompts: Optional[SourceConfig] = None          # a source like data.source; null: data.holdout examples
    num_prompts: int = 32                           # at most this many prompts
    every: int = 100                                # every N steps (0: only at the end)
    at_start: bool = True                           # also measure the initial draft
    temperatures: List[float] = field(default_factory=lambda: [0.0, 1.0])  # sampling temperatures (0: greedy)
    num_draft_tokens: int = 4                       # γ during the measurement
    max_new_tokens: int = 64                        # tokens per prompt
    batch_size: int = 8                             # prompts per decoder call
    seed: int = 0                                   # decoder generator seed
    select_by: str = "acceptance_rate"              # acceptance_rate | predicted_speedup
    cost_ratio: Optional[float] = None              # c; null: measured at setup
    verify_costs: Optional[List[float]] = None      # v_0 = 1, v_1, ..: null: measured with c (v = 1 when c is set)
    max_gamma: int = 8                              # largest γ for the predicted speedup


@dataclass
class LoggerConfig:
    """``logger``: metrics.jsonl always; W&B with name=wandb."""

    name: str = "none"                      # none | wandb
    project: Optional[str] = "draftkit"     # W&B project
    run_name: Optional[str] = None          # W&B run name (null: the output folder's name)
    mode: str = "auto"                      # auto | online | offline | disabled
    tags: List[str] = field(default_factory=list)  # W&B tags


@dataclass
class Config:
    """The whole recipe config (``conf/config.yaml``)."""

    target: TargetConfig = field(default_factory=TargetConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    data: DataConfig = field(default_factory=DataConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    quickstart: Any = None  # read by quickstart/run.py only (conf/experiment/quickstart*.yaml)


GROUPS = {"target": TargetConfig, "draft": DraftConfig, "data": DataConfig, "loss": LossConfig,
          "optim": OptimConfig, "train": TrainConfig, "eval": EvalConfig, "logger": LoggerConfig}


HELP = {  # hydra/help=distill (conf/config.yaml): what `python -m distill train --help` prints
    "app_name": "python -m distill",
    "header": "${hydra.help.app_name} ${hydra.job.name}: Hydra overrides select group options (group=option) and "
              "set keys (key=value);\n-m sweeps comma-separated values, each job into its own run folder "
              "train.output_dir/<job number>.",
    "footer": "Examples:\n"
              "  python -m distill ${hydra.job.name} +target=PATH_OR_CONFIG draft.name_or_path=PATH loss=jsd "
              "loss.beta=0.5\n"
              "  python -m distill ${hydra.job.name} ... --cfg job            (print the composed config, exit)\n"
              "  python -m distill ${hydra.job.name} ... -m loss=fkl,tvd,jsd  (a sweep: one run folder per job)\n"
              "launcher/ holds accelerate configs (accelerate launch --config_file conf/launcher/NAME.yaml), not a "
              "Hydra group.\nOwn options: eval --out FILE [--overwrite]; bench-step --steps N (10) --warmup N (2) "
              "--out FILE [--overwrite].\nEvery key's type and allowed values: distill/config.py and docs/distill.md.",
    "template": "${hydra.help.header}\n\n"
                "== Config groups (group=option; target and experiment: +target=NAME, +experiment=NAME) ==\n"
                "$APP_CONFIG_GROUPS\n\n== Keys and their defaults (key=value) ==\n$CONFIG\n"
                "== Flags ==\n$FLAGS_HELP\n${hydra.help.footer}\n",
}


def register() -> None:
    """Store the schema as ``distill_schema`` and the help text as ``hydra/help=distill`` (idempotent);
    conf/config.yaml lists both in its defaults."""
    cs = ConfigStore.instance()
    cs.store(name=SCHEMA_NAME, node=Config)
    cs.store(group="hydra/help", name="distill", node=HELP)


register()


# ------------------------------------------------------------------------------------------------ composition

CONF_ENV = "DRAFTKIT_CONF"


def conf_dir() -> Path:
    """The Hydra config folder: ``$DRAFTKIT_CONF``; else the copy of ``conf/`` that a wheel or ``pip install .``
    puts inside the package (``distill/conf``, pyproject.toml); else the repository's ``conf/`` (a checkout, an
    editable install)."""
    if os.environ.get(CONF_ENV):
        return Path(os.environ[CONF_ENV]).resolve()
    here = Path(__file__).resolve().parent
    installed = here / "conf"
    return installed if (installed / "config.yaml").is_file() else here.parent / "conf"


def target_options() -> list[str]:
    """Names of the target configs (``conf/target/NAME.yaml``)."""
    return sorted(p.stem for p in (conf_dir() / "target").glob("*.yaml"))


def expand_target_shorthand(overrides: list[str]) -> list[str]:
    """``+target=X`` selects ``conf/target/X.yaml`` when it exists; a local path or hub id (anything with a ``/``,
    or an existing path) becomes ``+target.name_or_path=X``; any other name is an error listing the configs.

    Raises:
        SetupError: ``X`` matches no target config and no path.
    """
    out = []
    for o in overrides:
        if o.startswith("+target="):
            name = o.split("=", 1)[1]
            options = target_options()
            if name not in options:
                if "/" not in name and not Path(name).expanduser().exists():
                    close = difflib.get_close_matches(name, options, n=1)
                    hint = f" (did you mean +target={close[0]}?)" if close else ""
                    raise SetupError(f"+target={name}: no config conf/target/{name}.yaml and no local path {name!r}"
                                     f"{hint}. Target configs: {', '.join(options)}. Or give a checkpoint: "
                                     "+target=/path/to/model, +target=org/hub-id, +target.name_or_path=NAME")
                o = "+target.name_or_path=" + name
        out.append(o)
    return out


def _schema_default(key: str) -> Any:
    try:
        return OmegaConf.select(OmegaConf.structured(Config), key.split("[")[0])
    except Exception:  # a key outside the schema
        return None


def explain(err: Exception, overrides: list[str] = ()) -> str:
    """One clear line (or two) for an error Hydra/OmegaConf raised while composing, naming the setting and the fix.

    Hydra's own hint for an unknown key (``use +train.max_step=5``) is never repeated: it would turn a typo into
    a new key. The closest known key is suggested instead.
    """
    cause = err.__cause__ if err.__cause__ is not None else err
    msg = str(err)
    launcher = next((o for o in overrides if o.lstrip("+").startswith("launcher=")), None)
    if launcher:  # conf/launcher/ lists in --help's config groups, but its files are accelerate's
        name = launcher.split("=", 1)[1]
        folder = conf_dir() / "launcher"
        try:  # as typed from here: conf/launcher in a checkout, the package's folder for an installed one
            folder = folder.relative_to(Path.cwd())
        except ValueError:
            pass
        return (f"{launcher}: {folder}/ holds accelerate configs, not a Hydra group; launch with them: "
                f"accelerate launch --config_file {folder / (name + '.yaml')} -m distill train ...")
    m = re.search(r"Could not find '([\w\-/]+)/([^']+)'", msg)
    if m:  # an unknown group option, e.g. loss=kld or +experiment=nope
        group, option = m.group(1), m.group(2)
        options = sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))
        close = difflib.get_close_matches(option, options, n=1)
        hint = f" (did you mean {group}={close[0]}?)" if close else ""
        plus = "+" if group in ("target", "experiment") else ""
        return f"{plus}{group}={option}: no such option in conf/{group}/{hint}; choose one of {', '.join(options)}"
    m = re.search(r"Could not append to config\. An item is already at '([^']+)'", msg, re.IGNORECASE)
    if m:  # +key=value for a key the config (or an experiment) already sets
        key = m.group(1)
        value = next((o.split("=", 1)[1] for o in overrides if o.startswith(f"+{key}=")), "VALUE")
        return (f"+{key}={value}: {key} is already set (by the config or the +experiment); replace it with "
                f"++{key}={value}")
    key = getattr(cause, "full_key", None)
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and key:
        return _unknown_key(cause, key)
    if isinstance(cause, ValidationError) and key:
        return _wrong_type(cause, key, overrides)
    first = msg.strip().splitlines()[0] if msg.strip() else type(err).__name__
    if "Could not override" in msg or "Could not append" in msg:
        first = first.replace("Could not", "cannot")
    return first


def _unknown_key(cause: Exception, key: str) -> str:
    """:func:`explain` for a key the schema does not have: the closest known one, or the keys of its parent."""
    parent, _, leaf = key.rpartition(".")
    ref = str(getattr(cause, "ref_type", "") or "")
    if "Dict[" in ref:
        return (f"{key}: {parent} is a free-form mapping; add a new entry with a plus: +{key}=VALUE")
    node = OmegaConf.select(OmegaConf.structured(Config), parent) if parent else OmegaConf.structured(Config)
    known = list(node.keys()) if OmegaConf.is_dict(node) else []
    close = difflib.get_close_matches(leaf, known, n=1)
    hint = f"did you mean {parent + '.' if parent else ''}{close[0]}?" if close else \
        f"the keys of {parent or 'the config'} are {', '.join(known)}"
    return f"unknown setting {key}: {hint} (`python -m distill train --help` lists every key)"


def _wrong_type(cause: Exception, key: str, overrides: list[str]) -> str:
    """:func:`explain` for a value of the wrong type: the value given, the type wanted and an example."""
    values = [o.split("=", 1)[1] for o in overrides if o.lstrip("+").split("=", 1)[0] == key.split("[")[0]]
    bad = getattr(cause, "value", None)  # a key given twice: the value that failed, not the first one
    given = next((v for v in values if v == str(bad)), values[-1] if values else bad)
    text = str(cause).splitlines()[0]
    example = _schema_default(key.split("[")[0])
    kinds = {"Integer": "an integer", "Float": "a number", "Boolean": "true or false", "String": "a string"}
    conv = re.search(r"could not be converted to (\w+)", text)
    if conv and "[" in key:  # an item of a list
        base = key.split("[")[0]
        want = kinds.get(conv.group(1), conv.group(1))
        eg = f", e.g. {base}={json.dumps(list(example)).replace(' ', '')}" if example is not None else ""
        return f"{base}={given}: every item must be {want}{eg}"
    if conv:
        want = kinds.get(conv.group(1), conv.group(1))
        eg = f", e.g. {key}={example}" if example is not None and "[" not in key else ""
        return f"{key}={given}: expected {want}{eg}"
    if "is not a valid bool" in text:
        return f"{key}={given}: expected true or false, e.g. {key}={str(bool(example)).lower()}"
    if "is not a ListConfig" in text:
        return f"{key}={given}: expected a list; write {key}=[{given}] (several: {key}=[0.0,1.0])"
    return f"{key}={given}: {text}"


def compose(overrides: list[str]):
    """Compose ``conf/config.yaml`` with Hydra overrides (``key=value``, ``+key=value``, ``group=option``); the
    result is typed by :class:`Config`. ``+target=PATH_OR_HUB_ID`` is accepted too.

    Raises:
        SetupError: the overrides do not compose (unknown option, key or type), with :func:`explain`'s message.
    """
    overrides = expand_target_shorthand(list(overrides))
    for override in overrides:  # OmegaConf reads any integer as a bool (2 -> true): only 0 and 1 mean one
        key, sep, value = override.lstrip("+").partition("=")
        if sep and re.fullmatch(r"[+-]?\d+", value.strip()) and value.strip() not in ("0", "1") \
                and isinstance(_schema_default(key), bool):
            raise SetupError(f"{key}={value}: expected true or false, e.g. {key}={str(_schema_default(key)).lower()}")
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(version_base="1.3", config_dir=str(conf_dir()), job_name="distill"):
            return hydra_compose(config_name="config", overrides=overrides)
    except (HydraException, OmegaConfBaseException) as e:
        raise SetupError(explain(e, overrides)) from e
    finally:
        GlobalHydra.instance().clear()


# ------------------------------------------------------------------------------------------------ value checks
# What reads nothing but the config; the checks against the disk and the machine are in distill/checks.py.

CHOICES = {
    "data.source.kind": ("auto", "prompts", "text"),
    "data.source.sample_by": ("line", "paragraph", "document"),
    "data.source.split": ("train", "validation", "test"),
    "data.completions": ("data", "target", "both"),
    "data.target_logits": ("online", "cached"),
    "loss.ce_labels": ("data", "target"),
    "optim.scheduler": ("cosine", "linear", "constant"),
    "train.mixed_precision": ("no", "bf16", "fp16", "auto"),
    "train.progress": ("rich", "tqdm", "none"),
    "logger.name": ("none", "wandb"),
    "logger.mode": ("auto", "online", "offline", "disabled"),
    "eval.method": ("teacher_forced", "generate"),
}
# The divergences of distill.losses (its DIVERGENCES, which a test compares with these names).
LOSS_NAMES = ("fkl", "rkl", "jsd", "tvd", "acceptance")
# What eval.select_by may rank checkpoints by: keys of distill.evaluate.acceptance_eval's result.
SELECT_BY = ("acceptance_rate", "predicted_speedup")
# Integers with a lower bound (the fix is in the message).
AT_LEAST = {
    "data.source.prompt_tokens": 1, "data.source.completion_tokens": 1,
    "data.source.windows_per_doc": 1, "data.source.limit": 1, "data.max_prompt_tokens": 1, "data.max_new_tokens": 1,
    "data.train_prompt_tokens": 1,
    "data.holdout": 0, "data.target_generated.batch_size": 1, "data.target_generated.shard_size": 1,
    "data.logit_cache_k": 1, "data.logit_cache_tail_samples": 0, "data.logit_cache_shard_size": 1,
    "loss.gamma": 1, "draft.vocab.keep": 1, "optim.warmup_steps": 0, "train.max_steps": 1, "train.stop_at": 1, "train.batch_size": 1,
    "train.grad_accum": 1, "train.save_every": 0, "train.keep_last": 1, "train.log_every": 1, "train.lora.r": 1,
    "eval.num_prompts": 1, "eval.every": 0, "eval.num_draft_tokens": 1, "eval.max_new_tokens": 1,
    "eval.batch_size": 1, "eval.max_gamma": 1,
}
# Floats in [low, high] (None: unbounded on that side); all must be finite.
IN_RANGE = {
    "data.on_policy_fraction": (0.0, 1.0, "the probability λ that a micro-batch uses draft rollouts"),
    "data.rollout_temperature": (0.0, None, "0 = greedy rollouts"),
    "data.target_generated.temperature": (0.0, None, "0 = greedy"),
    "loss.beta": (0.0, 1.0, "0 = forward KL, 1 = reverse KL"),
    "loss.ce_weight": (0.0, 1.0, "(1 - w) * divergence + w * cross-entropy"),
    "optim.weight_decay": (0.0, None, "decoupled weight decay"),
    "optim.min_lr_ratio": (0.0, 1.0, "final lr / peak lr"),
    "optim.max_grad_norm": (0.0, None, "0 or null: no clipping"),
    "train.lora.dropout": (0.0, 1.0, "adapter dropout probability"),
    "train.max_time_s": (0.0, None, "wall-clock budget in seconds; 0 or null: none"),
}
# Seeds: numpy's seeding (accelerate's set_seed, which seeds python, numpy and torch) takes [0, 2^32 - 1].
SEEDS = ("draft.seed", "train.seed", "eval.seed")
MAX_SEED = 2**32 - 1
POSITIVE = {"loss.temperature": "softmax temperature", "optim.lr": "peak learning rate, e.g. optim.lr=1e-4",
            "optim.eps": "AdamW epsilon", "train.lora.alpha": "LoRA scale numerator", "eval.cost_ratio":
            "draft forward time / target forward time, or null to measure it"}


def check_choice(key: str, value: Any, choices: tuple) -> None:
    """Raise SetupError unless ``value`` is one of ``choices``, naming ``key``, the choices and an example."""
    if value not in choices:
        raise SetupError(f"{key}={value!r} is not allowed; choose one of {', '.join(map(str, choices))} "
                         f"(e.g. {key}={choices[0]})")


def check_tail_samples_loss(tail_samples: int | None, loss: str) -> None:
    """Sampled tail ids in the logit cache serve forward KL only (only FKL is linear in p, so only its gradient is
    unbiased on the sparse target). Raises SetupError for ``tail_samples`` > 0 with another ``loss``."""
    if tail_samples and str(loss) != "fkl":
        raise SetupError(f"data.logit_cache_tail_samples={tail_samples} (sampled tail ids) give an unbiased gradient "
                         f"for loss=fkl only (loss={loss}): use loss=fkl, data.logit_cache_tail_samples=0 (a cache "
                         "built without them), or data.target_logits=online")


def check_values(cfg: DictConfig) -> None:
    """Every check that reads nothing but ``cfg``: unknown keys, missing values, ranges and allowed values (types
    were checked by the schema at compose time). The data sources and model folders: :func:`distill.checks.validate`.

    Raises:
        SetupError: the first problem, naming the key, the allowed values and the fix.
    """
    bad = unknown_keys(cfg)
    if bad:
        raise SetupError(f"unknown setting {bad[0]}; a misspelled key is never added to the config (remove the "
                         "'+' and fix the name). `python -m distill train --help` lists every key")
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise SetupError(f"{missing[0]} is required and has no value: set {missing[0]}=VALUE")
    _check_choices(cfg)
    _check_numbers(cfg)
    _check_eval_costs(cfg)
    for key in ARCH_KEYS:
        value = OmegaConf.select(cfg, f"draft.{key}")
        if value is not None and value < 1:
            raise SetupError(f"draft.{key}={value} must be an integer >= 1 (or null: keep the target's)")
    _check_lists(cfg)
    if not str(cfg.train.output_dir).strip():
        raise SetupError("train.output_dir is empty; give the run folder, e.g. train.output_dir=checkpoints/run1")


def _check_choices(cfg: DictConfig) -> None:
    """Allowed values, and the combinations of them that cannot run together."""
    get = lambda key: OmegaConf.select(cfg, key)  # noqa: E731
    for key, choices in CHOICES.items():
        if not key.startswith("data.source."):  # sources: distill.checks.check_sources (data.source, eval.prompts)
            check_choice(key, get(key), choices)
    check_choice("loss.name", cfg.loss.name, LOSS_NAMES)
    if get("loss.ce_labels") == "target" and not get("loss.ce_weight"):
        raise SetupError("loss.ce_labels=target sets the labels of the cross-entropy term, whose weight "
                         "loss.ce_weight is 0: give it a weight, e.g. loss.ce_weight=0.2, or drop loss.ce_labels")
    if cfg.loss.name == "acceptance" and get("data.target_logits") == "cached":
        raise SetupError("loss=acceptance needs the target's full distribution at every position of a window; the "
                         "logit cache keeps top-k + tail only: use data.target_logits=online, or another loss with "
                         "the cache (loss=tvd is its per-token counterpart)")
    if get("data.target_logits") == "cached":  # also checked against the cache itself when it opens
        lam = float(get("data.on_policy_fraction"))
        if lam > 0:
            raise SetupError(f"data.target_logits=cached with data.on_policy_fraction={lam}: on-policy batches are "
                             "draft samples the target never scored, so they need the target online. Set "
                             "data.on_policy_fraction=0, or data.target_logits=online")
        check_tail_samples_loss(get("data.logit_cache_tail_samples"), cfg.loss.name)
    if get("draft.vocab.keep") is not None and float(get("data.on_policy_fraction")) > 0:
        raise SetupError(f"draft.vocab.keep={get('draft.vocab.keep')} with data.on_policy_fraction="
                         f"{get('data.on_policy_fraction')}: on-policy rollouts sample from the draft alone, which a "
                         "pruned head cannot do over the full vocabulary yet. Set data.on_policy_fraction=0 (or "
                         "draft.vocab.keep=null)")
    check_choice("eval.select_by", cfg.eval.select_by, SELECT_BY)
    for key in ("target.dtype", "draft.dtype"):
        if get(key) is not None:
            check_choice(key, get(key), tuple(DTYPES))


def _check_numbers(cfg: DictConfig) -> None:
    """Lower bounds of integers, seeds, ranges of floats, positive numbers (tables above)."""
    get = lambda key: OmegaConf.select(cfg, key)  # noqa: E731
    for key, low in AT_LEAST.items():
        value = get(key)
        if value is not None and value < low:
            raise SetupError(f"{key}={value} must be an integer >= {low}, e.g. {key}={max(low, 1)}")
    for key in SEEDS:
        value = get(key)
        if value is not None and not 0 <= value <= MAX_SEED:
            raise SetupError(f"{key}={value} must be an integer in [0, {MAX_SEED}] (the seeds numpy takes, which "
                             f"seeding python, numpy and torch together needs), e.g. {key}=0")
    for key, (low, high, what) in IN_RANGE.items():
        value = get(key)
        if value is None:
            continue
        if not math.isfinite(value) or value < low or (high is not None and value > high):
            span = f"in [{low:g}, {high:g}]" if high is not None else f">= {low:g}"
            raise SetupError(f"{key}={value} must be {span}, a finite number ({what})")
    for key, what in POSITIVE.items():
        value = get(key)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise SetupError(f"{key}={value} must be a finite number > 0 ({what})")


def _check_eval_costs(cfg: DictConfig) -> None:
    """The verify costs v_γ given by hand, and a γ the eval budget can draft."""
    get = lambda key: OmegaConf.select(cfg, key)  # noqa: E731
    verify = get("eval.verify_costs")
    if verify is not None and (len(verify) == 0 or float(verify[0]) != 1.0
                               or not all(math.isfinite(v) and v >= 1.0 for v in verify)):
        raise SetupError(f"eval.verify_costs={list(verify)} must be [1.0, v_1, v_2, ..] with every v_γ >= 1 (a "
                         "verify forward over γ+1 tokens / a one-token forward, indexed by γ; v_0 = 1), or null to "
                         "measure them")
    max_gamma = get("eval.max_gamma")
    if verify is not None and max_gamma is not None and len(verify) < max_gamma + 1:
        raise SetupError(f"eval.verify_costs has {len(verify)} entries (v_0..v_{len(verify) - 1}) but "
                         f"eval.max_gamma={max_gamma} needs v_0..v_{max_gamma}: give {max_gamma + 1} values, lower "
                         f"eval.max_gamma to {len(verify) - 1}, or set eval.verify_costs=null to measure them")
    gamma, budget = get("eval.num_draft_tokens"), get("eval.max_new_tokens")
    if gamma is not None and budget is not None and gamma > budget:
        raise SetupError(f"eval.num_draft_tokens={gamma} is larger than eval.max_new_tokens={budget}: no step can "
                         f"draft more tokens than are left, so the eval would measure a smaller γ than it reports; "
                         f"lower eval.num_draft_tokens or raise eval.max_new_tokens")


def _check_lists(cfg: DictConfig) -> None:
    """eval.temperatures, optim.betas and train.lora.target_modules."""
    if not cfg.eval.temperatures:
        raise SetupError("eval.temperatures is empty; give at least one, e.g. eval.temperatures=[0.0]")
    for t in cfg.eval.temperatures:
        if not (math.isfinite(t) and t >= 0):
            raise SetupError(f"eval.temperatures has {t!r}; every temperature must be a finite number >= 0 "
                             "(0 = greedy), e.g. eval.temperatures=[0.0,1.0]")
    betas = list(cfg.optim.betas)
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise SetupError(f"optim.betas={betas} must be two numbers in [0, 1), e.g. optim.betas=[0.9,0.95]")
    mods = cfg.train.lora.target_modules
    if not (isinstance(mods, str) or (OmegaConf.is_list(mods) and all(isinstance(m, str) for m in mods) and mods)):
        raise SetupError(f"train.lora.target_modules={mods!r} must be all-linear or a list of module names, "
                         "e.g. train.lora.target_modules=[q_proj,v_proj]")
    if isinstance(mods, str) and mods != "all-linear" and mods.isidentifier():
        # peft reads any other string as a regex over full module paths, so a bare name matches nothing
        raise SetupError(f"train.lora.target_modules={mods!r} is a single name, which peft reads as a regex over "
                         f"full module paths (it matches nothing); write a list, train.lora.target_modules=[{mods}], "
                         "or all-linear")


def eval_prompts_source(cfg: DictConfig) -> Any:
    """``eval.prompts`` when it names a file or a corpus, else None (the eval prompts are then the last
    ``data.holdout`` examples). conf/eval/default.yaml gives it as a source without path and corpus, rather than
    null, so that ``eval.prompts.path=FILE`` works on the command line (Hydra cannot set a key under a null node)."""
    src = cfg.eval.get("prompts") if cfg.get("eval") is not None else None
    return src if src is not None and (src.get("path") or src.get("corpus")) else None


def unknown_keys(cfg: DictConfig) -> list[str]:
    """Keys of ``cfg`` that the schema does not declare (``+train.max_step=5`` adds one; Hydra's own hint for a
    typo suggests exactly that): each is returned with the closest declared key, e.g. ``train.max_step (did you
    mean train.max_steps?)``."""
    out = []
    _unknown_in(cfg, Config, "", out)
    return out


def _unknown_in(node: Any, schema: Any, prefix: str, out: list[str]) -> None:
    """Append the keys of ``node`` that ``schema`` (a dataclass) does not declare to ``out``, recursively."""
    declared = {f.name: f for f in fields(schema)}
    for key in node.keys() if OmegaConf.is_dict(node) else []:
        full = f"{prefix}{key}"
        if key not in declared:
            close = difflib.get_close_matches(str(key), list(declared), n=1)
            hint = f" (did you mean {prefix}{close[0]}?)" if close else f" (keys: {', '.join(declared)})"
            out.append(full + hint)
            continue
        child_type = _dataclass_of(schema, key)
        child = node._get_node(key)
        if child_type is not None and OmegaConf.is_dict(child) and not child._is_none():
            _unknown_in(child, child_type, full + ".", out)


def _dataclass_of(schema: Any, key: str) -> Any:
    hints = typing.get_type_hints(schema)
    t = hints.get(key)
    for arg in (t, *getattr(t, "__args__", ())):
        if is_dataclass(arg):
            return arg
    return None


def typed_config(cfg: DictConfig) -> DictConfig:
    """``cfg`` typed by the schema: as it is when Hydra composed it, else merged into ``Config`` now (a config
    built by hand, in tests or notebooks).

    Raises:
        SetupError: no target is given, or a key does not fit the schema's type.
    """
    if cfg.get("target") is None or isinstance(cfg.get("target"), str):
        raise SetupError("no target given: pass +target=NAME (conf/target/NAME.yaml) or "
                         "+target.name_or_path=/path/or/hub-id")
    if OmegaConf.get_type(cfg) is Config:
        return cfg
    try:
        return OmegaConf.merge(OmegaConf.structured(Config), cfg)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        raise SetupError(f"{key}: {str(e).splitlines()[0]} (the keys and types are in distill/config.py)") from e
