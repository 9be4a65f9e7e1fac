"""Every config composes with Hydra's compose API into the typed schema (distill/config.py), every YAML documents
its command and keys, the schema rejects unknown keys, wrong types and out-of-range values, and the launcher files are
valid accelerate configs."""
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from distill.checks import normalize_config, validate
from distill.config import (LOSS_NAMES, Config, GROUPS as SCHEMA_GROUPS, LossConfig, SetupError, compose, conf_dir,
                            unknown_keys)
from distill.losses import DIVERGENCES

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
    validate(cfg)


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


def test_schema_covers_every_group_and_the_keys_other_features_use():
    assert set(SCHEMA_GROUPS) == set(GROUPS) | {"target"}
    cfg = OmegaConf.structured(Config)
    for key, default in [("train.overwrite", False), ("train.max_time_s", None), ("target.trust_remote_code", False),
                         ("draft.trust_remote_code", False), ("data.target_logits", "online"),
                         ("data.logit_cache", None), ("loss.gamma", 4)]:
        assert OmegaConf.select(cfg, key) == default, key


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_is_typed_by_the_schema(name):
    cfg = compose([f"+experiment={name}"])
    assert OmegaConf.get_type(cfg) is Config and OmegaConf.get_type(cfg.train) is not dict
    assert unknown_keys(cfg) == []


def test_group_yaml_keys_are_all_declared():
    """A YAML key the schema does not declare fails composition (struct), so a typo in a group file cannot hide."""
    for group in SCHEMA_GROUPS:
        for p in (CONF / group).glob("*.yaml"):
            raw = OmegaConf.to_container(OmegaConf.load(p))
            OmegaConf.merge(OmegaConf.structured(SCHEMA_GROUPS[group]), raw)  # raises on an unknown key or type


def test_acceptance_loss_fits_the_loss_schema():
    """conf/loss/acceptance.yaml (name=acceptance, gamma) merges into the loss schema; γ must be an integer >= 1."""
    node = OmegaConf.merge(OmegaConf.structured(LossConfig), {"name": "acceptance", "gamma": 3})
    assert node.name == "acceptance" and node.gamma == 3
    with pytest.raises(SetupError, match=r"loss.gamma=0 must be an integer >= 1"):
        validate(compose(["+target.name_or_path=org/t", "draft.num_hidden_layers=2", "loss.gamma=0"]))


def test_the_config_names_every_loss_and_only_those():
    """loss.name is checked against config.LOSS_NAMES (the config reads no module that runs the losses)."""
    assert LOSS_NAMES == tuple(DIVERGENCES)


@pytest.mark.parametrize("override,message", [
    ("train.max_steps=abc", "train.max_steps=abc: expected an integer, e.g. train.max_steps=1000"),
    ("train.cpu=maybe", "train.cpu=maybe: expected true or false"),
    ("eval.temperatures=0.5", "eval.temperatures=0.5: expected a list; write eval.temperatures=[0.5]"),
    ("eval.temperatures=[a]", "eval.temperatures=[a]: every item must be a number, e.g. eval.temperatures=[0.0,1.0]"),
    ("train.max_step=5", "unknown setting train.max_step: did you mean train.max_steps?"),
    ("optim=sgd", "optim=sgd: no such option in conf/optim/; choose one of adamw"),
    # a key given twice (appended to a base command): the value that failed, not the first (valid) one
    ("train.max_steps=4 train.max_steps=abc", "train.max_steps=abc: expected an integer"),
    # listed among --help's config groups; the error was Hydra's (cut off: "ConfigKeyError raised while composing")
    ("+launcher=cpu_2proc", "accelerate launch --config_file conf/launcher/cpu_2proc.yaml -m distill train"),
    ("launcher=fsdp", "launcher=fsdp: conf/launcher/ holds accelerate configs, not a Hydra group"),
    ("loss.fused=2", "loss.fused=2: expected true or false, e.g. loss.fused=true"),  # (OmegaConf read 2 as true)
])
def test_compose_errors_name_the_key_and_the_fix(override, message):
    with pytest.raises(SetupError) as e:
        compose(["+target.name_or_path=org/t", "draft.num_hidden_layers=2", *override.split()])
    assert message in str(e.value)
    assert "+train.max_step" not in str(e.value)  # Hydra's "use +KEY" hint would make a typo a new key


def test_plus_typo_is_rejected_with_the_closest_key():
    cfg = compose(["+target.name_or_path=org/t", "draft.num_hidden_layers=2", "+train.max_step=5",
                   "+eval.temperature=[0.0]"])
    assert unknown_keys(cfg) == ["train.max_step (did you mean train.max_steps?)",
                                 "eval.temperature (did you mean eval.temperatures?)"]
    with pytest.raises(SetupError, match=r"unknown setting train.max_step \(did you mean train.max_steps\?\)"):
        validate(cfg)


def test_free_form_mapping_takes_new_keys_with_plus():
    cfg = compose(["+target.name_or_path=org/t", "draft.num_hidden_layers=2", "data=corpus",
                   "+data.source.corpus_kwargs.max_items=3"])
    assert cfg.data.source.corpus_kwargs.max_items == 3 and unknown_keys(cfg) == []


def test_every_schema_default_validates():
    """The defaults themselves are valid (only the target and a draft are required)."""
    cfg = compose(["+target.name_or_path=org/t", "draft.num_hidden_layers=2"])
    validate(cfg)
    assert normalize_config(cfg).train.max_steps == 1000


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_a_loss_chosen_on_the_command_line_keeps_its_own_values(name):
    """`+experiment=X loss=Y` must give loss Y's values (conf/loss/Y.yaml): an experiment that pins a loss key
    silently overrides the chosen group's value (conf/loss/greedy_fkl.yaml's temperature 0.5 became the
    quickstart's 1.0, so a loss comparison trained plain FKL twice)."""
    import yaml

    for option in sorted(p.stem for p in (CONF / "loss").glob("*.yaml")):
        args = [f"+experiment={name}", f"loss={option}"]
        cfg = compose(args)
        if cfg.get("target") is None:
            cfg = compose(args + ["+target.name_or_path=some-org/some-target"])
        own = yaml.safe_load((CONF / "loss" / f"{option}.yaml").read_text())
        for key, value in own.items():
            assert cfg.loss[key] == value, f"+experiment={name} loss={option}: loss.{key} is {cfg.loss[key]}, " \
                                           f"conf/loss/{option}.yaml says {value}"


def test_a_conf_folder_without_config_yaml_is_named_with_the_fix(tmp_path, monkeypatch, capsys):
    """DRAFTKIT_CONF at a folder holding only experiment/mine.yaml gave Hydra's "Cannot find primary config
    'config'" without naming the variable."""
    from distill.__main__ import main

    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "mine.yaml").write_text("# @package _global_\n")
    monkeypatch.setenv("DRAFTKIT_CONF", str(tmp_path))
    with pytest.raises(SystemExit) as exit_:
        main(["train", "+experiment=mine"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"DRAFTKIT_CONF={tmp_path}: {tmp_path} has no config.yaml" in err and "copy of the package's" in err


