"""trust_remote_code stays off unless asked: a checkpoint that ships its own modeling code (auto_map) is refused by
the decode and distill loaders with the setting that allows it, and its code runs only when that is given."""
import json
import shutil

import pytest
from omegaconf import OmegaConf

from distill_helpers import make_llama, make_tokenizer

CODE = '''
import pathlib
pathlib.Path({marker!r}).touch()  # importing this module is running the checkpoint's code
from transformers import LlamaConfig, LlamaForCausalLM


class CustomConfig(LlamaConfig):
    model_type = "custom_llama"


class CustomModel(LlamaForCausalLM):
    config_class = CustomConfig
'''


@pytest.fixture()
def custom(tmp_path):
    """A tiny Llama checkpoint whose config points at its own Python file, and the marker that file creates."""
    import uuid

    path, marker = tmp_path / f"custom_{uuid.uuid4().hex[:8]}", tmp_path / "marker"  # a fresh module name per test
    tok = make_tokenizer(tmp_path / "tok")
    make_llama(path, len(tok), layers=1)
    tok.save_pretrained(str(path))
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(model_type="custom_llama", architectures=["CustomModel"],
               auto_map={"AutoConfig": "custom_llama.CustomConfig", "AutoModelForCausalLM": "custom_llama.CustomModel"})
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "custom_llama.py").write_text(CODE.format(marker=str(marker)))
    yield path, marker
    import sys

    from transformers.utils import HF_MODULES_CACHE

    shutil.rmtree(f"{HF_MODULES_CACHE}/transformers_modules/{path.name}", ignore_errors=True)  # transformers' copy
    for name in [m for m in sys.modules if path.name in m]:
        del sys.modules[name]


def test_decode_loader_refuses_remote_code_unless_asked(custom):
    from decode.loading import load_causal_lm

    path, marker = custom
    with pytest.raises(ValueError, match="--trust-remote-code"):
        load_causal_lm(str(path), "target")
    assert not marker.exists()
    model = load_causal_lm(str(path), "target", trust_remote_code=True)
    assert type(model).__name__ == "CustomModel" and marker.exists()


def test_own_code_for_a_model_type_transformers_knows_is_not_run_and_is_named(custom):
    """With model_type "llama" and an auto_map, transformers builds its own LlamaForCausalLM and says nothing: the
    checkpoint's code did not run (right), but the user was not told that its own architecture was not used."""
    from decode.loading import load_causal_lm

    path, marker = custom
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    with pytest.warns(UserWarning, match=r"names its own code \(auto_map: custom_llama.CustomModel\), which is not "
                                         r"run: it was built with transformers' LlamaForCausalLM .*--trust-remote-code"):
        model = load_causal_lm(str(path), "draft")
    assert type(model).__name__ == "LlamaForCausalLM" and not marker.exists()
    (path / "config.json").write_text(json.dumps({**cfg, "model_type": "llama",  # an AutoModel entry only
                                                  "auto_map": {"AutoModel": "custom_llama.CustomModel"}}))
    with pytest.warns(UserWarning, match=r"auto_map: custom_llama.CustomModel\), which is not run"):
        load_causal_lm(str(path), "draft")


def test_decode_generate_cli_flag(custom, capsys):
    from decode.__main__ import main

    path, marker = custom
    argv = ["generate", "--target", str(path), "--prompt", "def add", "--max-new-tokens", "2", "--json",
            "--device", "cpu"]
    assert main(argv) == 2 and "--trust-remote-code" in capsys.readouterr().err and not marker.exists()
    assert main(argv + ["--trust-remote-code"]) == 0 and marker.exists()


def test_distill_loaders_refuse_remote_code_unless_asked(custom):
    from distill.config import SetupError
    from distill.models import load_draft, load_target

    path, marker = custom
    with pytest.raises(SetupError, match=r"set target.trust_remote_code=true"):  # a schema key: no "+"
        load_target(OmegaConf.create({"name_or_path": str(path)}))
    with pytest.raises(SetupError, match="draft.trust_remote_code=true"):
        load_draft(OmegaConf.create({"name_or_path": str(path)}), None)
    assert not marker.exists()
    target = load_target(OmegaConf.create({"name_or_path": str(path), "trust_remote_code": True}))
    assert type(target).__name__ == "CustomModel" and marker.exists()


def test_a_checkpoint_whose_draft_ships_code_is_refused_unless_asked(custom, tmp_path, monkeypatch):
    """A distill checkpoint (``<run>/best``) from someone else whose draft/ names its own code: export and
    draft.name_or_path=<checkpoint> refuse it with the setting, without asking on the terminal (transformers'
    "Do you wish to run the custom code? [y/N]") and without running it; draft.trust_remote_code=true runs it."""
    import io

    from decode.outputs import write_json
    from distill import checkpoint as ckpt
    from distill.config import SetupError
    from distill.export import export
    from distill.models import load_draft

    path, marker = custom
    folder = tmp_path / "best"
    shutil.copytree(path, folder / "draft")
    write_json(folder / ckpt.STATE_FILE, {"step": 2})
    ckpt.write_manifest(folder, 2)
    monkeypatch.setattr("sys.stdin", io.StringIO("y\n"))  # a prompt would read this and run the code
    with pytest.raises(ckpt.CheckpointError, match="auto_map"):
        export(folder, tmp_path / "out")
    with pytest.raises(SetupError, match="draft.trust_remote_code=true"):
        load_draft(OmegaConf.create({"name_or_path": str(folder)}), None)
    assert not marker.exists() and not (tmp_path / "out").exists()
    draft = load_draft(OmegaConf.create({"name_or_path": str(folder), "trust_remote_code": True}), None)
    assert type(draft).__name__ == "CustomModel" and marker.exists()


def test_export_cli_takes_trust_remote_code(custom, tmp_path, capsys):
    """``python -m distill export`` had no way to pass trust_remote_code: a draft with its own code could be
    exported only from Python."""
    from decode.outputs import write_json
    from distill import checkpoint as ckpt
    from distill.__main__ import cmd_export

    path, marker = custom
    folder = tmp_path / "best"
    shutil.copytree(path, folder / "draft")
    write_json(folder / ckpt.STATE_FILE, {"step": 2})
    ckpt.write_manifest(folder, 2)
    with pytest.raises(SystemExit) as stop:
        cmd_export([str(folder), str(tmp_path / "out")])
    assert stop.value.code == 2 and "--trust-remote-code" in capsys.readouterr().err
    assert not marker.exists() and not (tmp_path / "out").exists()
    cmd_export([str(folder), str(tmp_path / "out"), "--trust-remote-code"])
    assert marker.exists() and (tmp_path / "out" / "config.json").is_file()
