"""Every config composes with Hydra's compose API, every YAML documents its command and keys, and the launcher
files are valid accelerate configs."""
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from distill.__main__ import compose, conf_dir
from distill.config import validate_config, normalize_config
from distill.models import SetupError

CONF = conf_dir()
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
GROUPS = ["draft", "data", "loss", "optim", "train", "eval", "logger"]
ALL_YAML = sorted(CONF.rglob("*.yaml"))


def test_conf_has_experiments():
    assert {"distillspec_qwen", "lora_seqkd_qwen", "layer_draft_llama"} <= set(EXPERIMENTS)


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_composes(name):
    cfg = compose([f"+experiment={name}"])
    if cfg.get("target") is None:  # experiments meant to get the target on the command line (e.g. quickstart)
        cfg = compose([f"+experiment={name}", "+target.name_or_path=some-org/some-target"])
    for group in GROUPS:
        assert group in cfg, f"{name}: missing group {group}"
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    cfg.target = OmegaConf.merge({"name_or_path": None, "tokenizer": None, "dtype": None}, cfg.target)
    # Local checkpoints of an experiment need not exist here; everything else must validate.
    for key in ("target", "draft"):
        path = str(cfg[key].get("name_or_path") or "")
        if path.startswith((".", "/", "~", "checkpoints")):
            cfg[key].name_or_path = "some-org/some-model"
    validate_config(cfg)


def _leaves(d, prefix=""):
    for k, v in d.items():
        if isinstance(v, dict) and v:
            yield from _leaves(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}"


def _known_keys():
    known = set()
    for group in GROUPS + ["target"]:
        for p in (CONF / group).glob("*.yaml"):
            known |= {f"{group}.{k}" for k in _leaves(OmegaConf.to_container(OmegaConf.load(p)))}
    return known


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiments_use_only_known_keys(name):
    """A typo in an experiment (e.g. train.max_step) would silently add a key; every key must exist in a group."""
    known = _known_keys()
    cfg = OmegaConf.to_container(OmegaConf.load(CONF / "experiment" / f"{name}.yaml"))
    cfg.pop("defaults", None)
    for key in _leaves({k: v for k, v in cfg.items() if k in GROUPS + ["target"]}):
        # a key below a leaf that is an empty mapping or null (data.source.corpus_kwargs, eval.prompts) is free-form
        assert key in known or any(key.startswith(k + ".") for k in known), f"{name}: unknown key {key}"


@pytest.mark.parametrize("group", GROUPS + ["target"])
def test_every_group_option_composes(group):
    for option in sorted(p.stem for p in (CONF / group).glob("*.yaml")):
        prefix = "+" if group == "target" else ""
        cfg = compose([f"{prefix}{group}={option}"])
        assert cfg[group] is not None


def test_target_shorthand_accepts_a_group_option_or_a_path():
    assert compose(["+target=qwen2.5-7b-instruct"]).target.dtype == "bf16"
    cfg = compose(["+target=/models/my-target", "draft.num_hidden_layers=2"])
    assert cfg.target.name_or_path == "/models/my-target"
    assert compose(["+target=org/hub-model"]).target.name_or_path == "org/hub-model"


def test_target_by_path_key_and_missing_target():
    cfg = compose(["+target.name_or_path=org/model", "draft.num_hidden_layers=2"])
    assert normalize_config(cfg).target.dtype is None  # defaults filled in
    with pytest.raises(SetupError, match=r"\+target.name_or_path"):
        normalize_config(compose(["draft.num_hidden_layers=2"]))
    with pytest.raises(SetupError, match="does not exist"):
        normalize_config(compose(["+target.name_or_path=/no/such/target", "draft.num_hidden_layers=2"]))


@pytest.mark.parametrize("path", ALL_YAML, ids=lambda p: str(p.relative_to(CONF)))
def test_yaml_starts_with_command_and_comments_every_key(path):
    lines = path.read_text().splitlines()
    start = 1 if lines[0].strip() == "# @package _global_" else 0
    assert re.match(r"# .*(python -m |accelerate launch|scripts/)", lines[start]), f"{path}: first line is not a command"
    for line in lines:
        stripped = line.strip()
        if not stripped or stripped.startswith(("#", "- ")) or stripped == "defaults:":
            continue
        key, _, value = stripped.partition(":")
        if value.strip() and not value.strip().startswith("#"):  # a leaf key: must carry a comment
            assert "#" in value, f"{path}: key {key!r} has no comment"


@pytest.mark.parametrize("path", sorted((CONF / "launcher").glob("*.yaml")), ids=lambda p: p.stem)
def test_launcher_configs_load_in_accelerate(path):
    from accelerate.commands.config.config_args import load_config_from_file

    cfg = load_config_from_file(str(path))
    assert cfg.num_processes >= 2
    assert {"ddp", "fsdp", "deepspeed_zero2", "deepspeed_zero3", "cpu_2proc"} == {
        p.stem for p in (CONF / "launcher").glob("*.yaml")}
    if "deepspeed" in path.stem:
        assert cfg.deepspeed_config["zero_stage"] == int(path.stem[-1])
        assert cfg.deepspeed_config["gradient_accumulation_steps"] == 1


def test_docs_list_every_group():
    doc = (Path(CONF).parent / "docs" / "distill.md").read_text()
    for group in GROUPS + ["target", "launcher", "experiment"]:
        assert f"`{group}`" in doc
