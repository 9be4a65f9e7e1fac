"""Export round trip: LoRA merged, safetensors without adapter keys, equal logits, works as assistant_model in a
fresh process; the card names the target and the measured α/τ."""
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from distill.export import CARD_JSON, export, load_checkpoint_draft
from distill.recipe import train
from distill_helpers import PY, REPO, compose, make_llama, overrides, subprocess_env

CHECK = r"""
import json, sys, torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM
out, target_path, ids_path = sys.argv[1:4]
with safe_open(out + "/model.safetensors", "pt") as f:
    keys = list(f.keys())
draft = AutoModelForCausalLM.from_pretrained(out).eval()
target = AutoModelForCausalLM.from_pretrained(target_path).eval()
ids = torch.load(ids_path)
with torch.no_grad():
    logits = draft(ids).logits
gen = target.generate(ids[:1], assistant_model=draft, max_new_tokens=6, do_sample=False, pad_token_id=0)
plain = target.generate(ids[:1], max_new_tokens=6, do_sample=False, pad_token_id=0)
torch.save(logits, out + "/check_logits.pt")
print(json.dumps({"adapter_keys": [k for k in keys if "lora" in k or "base_layer" in k], "n_keys": len(keys),
                  "assisted": gen[0].tolist(), "plain": plain[0].tolist()}))
"""


def test_lora_export_round_trip_in_fresh_process(pair, tmp_path):
    run = tmp_path / "run"
    train(compose(overrides(pair, run, "train.lora.enabled=true", "optim.lr=5e-2", "train.max_steps=2",
                            "eval.every=1")), log=lambda *_: None)
    ckpt = run / "best"
    assert (ckpt / "draft" / "adapter_config.json").exists()
    # the trained model as the recipe holds it: base + unmerged adapter
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(pair["draft"])),
                                           str(ckpt / "draft")).eval()
    ids = torch.tensor([[1, 20, 33, 47, 60, 71], [1, 9, 100, 4, 5, 6]])
    with torch.no_grad():
        trained = peft_model(ids).logits
        base = AutoModelForCausalLM.from_pretrained(str(pair["draft"])).eval()(ids).logits
    assert not torch.allclose(trained, base, atol=1e-4)  # the adapter changed something worth exporting
    torch.save(ids, tmp_path / "ids.pt")

    out = tmp_path / "export"
    env = subprocess_env()
    r = subprocess.run([PY, "-m", "distill", "export", str(ckpt), str(out)], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    r = subprocess.run([PY, "-c", CHECK, str(out), str(pair["target"]), str(tmp_path / "ids.pt")], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["adapter_keys"] == [] and res["n_keys"] > 0
    torch.testing.assert_close(torch.load(out / "check_logits.pt"), trained, rtol=1e-4, atol=1e-4)
    assert res["assisted"] == res["plain"]  # greedy assisted generation is exactly the target's greedy output
    assert len(res["assisted"]) > ids.shape[1]

    card = json.loads((out / "draftkit_card.json").read_text())
    assert card["target"] == str(pair["target"]) and card["lora_merged"] is True
    assert set(card["evaluation"]["per_temperature"]) == {"0.0", "1.0"}
    assert card["config"]["loss"]["name"] == "tvd"
    readme = (out / "README.md").read_text()
    assert str(pair["target"]) in readme and "| 0.0 |" in readme and "| 1.0 |" in readme
    assert (out / "tokenizer.json").exists()
    # the card's Use snippet runs as written (it used input_ids without defining them)
    snippet = readme.split("```python\n", 1)[1].split("```", 1)[0].replace("max_new_tokens=128", "max_new_tokens=4")
    scope = {}
    exec(snippet, scope)
    assert scope["out"].shape[1] > scope["inputs"]["input_ids"].shape[1]


def test_export_of_built_full_finetune_draft(pair, tmp_path):
    run = tmp_path / "run"
    train(compose(overrides(pair, run, "draft.name_or_path=null", "draft.num_hidden_layers=1", "train.max_steps=2")),
          log=lambda *_: None)
    draft, _, state = load_checkpoint_draft(run / "step_000002")
    card = export(run / "step_000002", tmp_path / "out")
    from transformers import AutoModelForCausalLM

    again = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    ids = torch.tensor([[1, 5, 6, 7]])
    with torch.no_grad():
        assert torch.equal(again(ids).logits, draft(ids).logits)
    assert again.config.num_hidden_layers == 1 and card["steps"] == 2 and state["lora"] is False
    per_t = card["evaluation"]["per_temperature"]
    gamma = per_t[min(per_t, key=float)]["best_gamma"]
    assert card["serving"]["num_draft_tokens"] == gamma
    readme = (tmp_path / "out" / "README.md").read_text()
    assert card["serving"]["vllm"] in readme and card["serving"]["sglang"] in readme
    assert "library_name: transformers" in readme and card["dtype"] == card["evaluated_dtype"] == "float32"
    assert "Weights: float32." in readme and "converted at export" not in readme
    assert json.loads((tmp_path / "out" / "draftkit_card.json").read_text())["serving"] == card["serving"]
    umask = os.umask(0)
    os.umask(umask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "out").iterdir()}
    assert modes == dict.fromkeys(modes, 0o666 & ~umask)  # readable by a server under another user (0644 under 022)


def test_a_hub_target_s_revision_is_recorded_in_the_run_and_the_card(pair, hub_cache, tmp_path):
    """The state, the export card and its README named the bare hub id only: a later ``hf download`` moves refs/main
    to other weights and nothing said which the draft was trained against. A resume after such a move says so."""
    from tests.conftest import put_snapshot

    put_snapshot(hub_cache, "org/target", "a" * 40, Path(pair["target"]))
    run, lines = tmp_path / "run", []
    hub = [o if not o.startswith("+target.name_or_path=") else "+target.name_or_path=org/target"
           for o in overrides(pair, run, "train.max_steps=2", "eval.temperatures=[0.0]", "eval.at_start=false")]
    train(compose(hub), log=lambda *_: None)
    assert json.loads((run / "step_000002" / "trainer_state.json").read_text())["target_revision"] == "a" * 40
    put_snapshot(hub_cache, "org/target", "b" * 40, Path(pair["target"]))  # an update was downloaded
    train(compose([*hub, "train.max_steps=3", "train.resume=true"]), log=lines.append)
    assert any("revision " + "b" * 40 in line and "a" * 40 in line for line in lines)
    card = export(run / "step_000003", tmp_path / "out")
    assert card["target"] == "org/target" and card["target_revision"] == "b" * 40
    # found by a new user: the card named only the new revision, though steps 1-2 trained against the old one
    assert card["earlier_target_revisions"] == [{"target_revision": "a" * 40, "through_step": 2}]
    assert (f"(hub revision `{'b' * 40}`; through step 2 against revision `{'a' * 40}`)"
            in (tmp_path / "out" / "README.md").read_text())
    assert any(line.startswith("warning: target org/target is at revision") for line in lines)
    assert export(run / "step_000002", tmp_path / "out2")["target_revision"] == "a" * 40  # what step 2 trained on


def test_serving_commands_use_the_evaluated_gamma():
    from distill.export import serving_commands

    ev = {"per_temperature": {"1.0": {"best_gamma": 3}, "0.0": {"best_gamma": 6}}}
    cmds = serving_commands("/m/target", "/m/draft", ev, None)
    assert cmds["num_draft_tokens"] == 6 and "0.0" in cmds["gamma_source"]
    spec = json.loads(cmds["vllm"].split("--speculative-config ", 1)[1].strip("'"))
    assert cmds["vllm"].startswith("vllm serve /m/target ")
    # probabilistic: vLLM's default (greedy) treats the draft as one-hot and accepts fewer than α at T > 0
    assert spec == {"model": "/m/draft", "num_speculative_tokens": 6, "method": "draft_model",
                    "draft_sample_method": "probabilistic"}
    assert "not run by draftkit" in cmds["sglang_note"] and cmds["engines_note"] is None
    assert cmds["sglang"].split() == ["python", "-m", "sglang.launch_server", "--model-path", "/m/target",
                                      "--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path",
                                      "/m/draft", "--speculative-num-steps", "6", "--speculative-eagle-topk", "1",
                                      "--speculative-num-draft-tokens", "7"]
    fallback = serving_commands("t", "d", None, {"eval": {"num_draft_tokens": 5}})
    assert fallback["num_draft_tokens"] == 5 and "not measured" in fallback["gamma_source"]


def test_lora_export_does_not_change_when_its_base_folder_changes_later(pair, tmp_path):
    """Re-exporting another draft over the LoRA run's base folder silently changed that run's later exports."""
    import shutil

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    base = tmp_path / "base"
    shutil.copytree(pair["draft"], base)
    run = tmp_path / "run"
    train(compose(overrides(pair, run, f"draft.name_or_path={base}", "train.lora.enabled=true", "optim.lr=5e-2",
                            "train.max_steps=2")), log=lambda *_: None)
    export(run / "step_000002", tmp_path / "e1")
    changed = AutoModelForCausalLM.from_pretrained(str(base))
    with torch.no_grad():
        for p in changed.parameters():
            p.add_(0.05)
    changed.save_pretrained(str(base))  # the base folder now holds other weights
    export(run / "step_000002", tmp_path / "e2")
    w1, w2 = load_file(str(tmp_path / "e1" / "model.safetensors")), load_file(str(tmp_path / "e2" / "model.safetensors"))
    assert w1.keys() == w2.keys()
    for k in w1:
        assert torch.equal(w1[k], w2[k]), k
    # the base folder moved: the export names --lora-base, and with it gives the same weights
    shutil.move(str(base), str(tmp_path / "moved"))
    with pytest.raises(FileNotFoundError, match="is missing.*--lora-base NEW_PATH"):
        export(run / "step_000002", tmp_path / "e3")
    export(run / "step_000002", tmp_path / "e3", lora_base=tmp_path / "moved")
    w3 = load_file(str(tmp_path / "e3" / "model.safetensors"))
    assert w3.keys() == w1.keys() and all(torch.equal(w1[k], w3[k]) for k in w1)


def test_export_lora_on_built_draft_uses_saved_base_also_in_a_moved_run(pair, tmp_path):
    run = tmp_path / "run"
    train(compose(overrides(pair, run, "draft.name_or_path=null", "draft.num_hidden_layers=1",
                            "train.lora.enabled=true", "train.max_steps=1")), log=lambda *_: None)
    state = json.loads((run / "step_000001" / "trainer_state.json").read_text())
    assert state["draft_base"] == str((run / "draft_base").resolve())
    card = export(run / "step_000001", tmp_path / "out")
    assert card["lora_merged"] and (tmp_path / "out" / "model.safetensors").exists()
    # found by a new user: a moved run folder could be resumed but neither exported nor evaluated (its recorded
    # base was the old folder's draft_base), and the resumed checkpoints kept recording the old path
    moved = tmp_path / "moved" / "run"
    moved.parent.mkdir()
    run.rename(moved)
    # another run now at the old place, with another draft_base: the moved run still uses its own (re-test trial)
    train(compose(overrides(pair, run, "draft.name_or_path=null", "draft.num_hidden_layers=2",
                            "train.lora.enabled=true", "train.max_steps=1")), log=lambda *_: None)
    from decode.loading import load_causal_lm

    adapter = load_causal_lm(str(moved / "step_000001" / "draft"), "draft")  # the adapter folder, merged on load
    assert adapter.config.num_hidden_layers == 1
    again = export(moved / "step_000001", tmp_path / "out2")
    assert again["lora_merged"]
    from safetensors.torch import load_file

    w1 = load_file(str(tmp_path / "out" / "model.safetensors"))
    w2 = load_file(str(tmp_path / "out2" / "model.safetensors"))
    assert w1.keys() == w2.keys() and all(torch.equal(w1[k], w2[k]) for k in w1)
    train(compose(overrides(pair, moved, "draft.name_or_path=null", "draft.num_hidden_layers=1",
                            "train.lora.enabled=true", "train.max_steps=2", "train.resume=true")), log=lambda *_: None)
    state = json.loads((moved / "step_000002" / "trainer_state.json").read_text())
    assert state["draft_base"] == str((moved / "draft_base").resolve())
    from distill.__main__ import main

    main(["eval", *overrides(pair, tmp_path / "x", f"draft.name_or_path={moved / 'step_000001'}",
                             "eval.temperatures=[0.0]"), "--out", str(tmp_path / "ev.json")])
    assert json.loads((tmp_path / "ev.json").read_text())["per_temperature"]["0.0"]["acceptance_rate"] >= 0


def test_export_bad_checkpoint(tmp_path, capsys):
    from distill.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["export", str(tmp_path), str(tmp_path / "o")])
    assert e.value.code == 2 and "not a complete distill checkpoint" in capsys.readouterr().err


@pytest.mark.parametrize("head_setting", ["train.lora.target_modules=[q_proj,lm_head]", "train.lora.modules_to_save=[lm_head]",
                                     None])
def test_lora_on_tied_embeddings_exports_the_adapter_model(pair, tmp_path, head_setting):
    """tie_word_embeddings=True with LoRA on lm_head (or lm_head trained in full): the merge must not move the
    shared embedding matrix; the exported model computes what base + adapter computed (it moved embeddings by 0.08
    and logits by 0.70). With no adapter on the head or embeddings (None: q_proj only) the export stays tied (it
    was untied, growing by a vocabulary-sized matrix)."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from distill_helpers import make_llama

    tied = tmp_path / "tied"
    make_llama(tied, pair["vocab"], layers=1, seed=3, tie=True)
    run = tmp_path / "run"
    train(compose(overrides(pair, run, f"draft.name_or_path={tied}", "train.lora.enabled=true",
                            head_setting or "train.lora.target_modules=[q_proj]", "optim.lr=5e-2",
                            "eval.temperatures=[0.0]")),
          log=lambda *_: None)
    out = tmp_path / "export"
    export(run / "step_000004", out)
    base = AutoModelForCausalLM.from_pretrained(str(tied)).eval()
    embeddings = base.get_input_embeddings().weight.detach().clone()
    adapter = PeftModel.from_pretrained(base, str(run / "step_000004" / "draft")).eval()
    exported = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    ids = torch.tensor([[1, 20, 33, 47, 60, 71], [1, 9, 100, 4, 5, 6]])
    with torch.no_grad():
        want, got = adapter(ids).logits, exported(ids).logits
        assert not torch.allclose(want, AutoModelForCausalLM.from_pretrained(str(tied))(ids).logits, atol=1e-3)
    assert torch.equal(exported.get_input_embeddings().weight, embeddings)  # the merge left embeddings alone
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5)  # same function (merge rounding only)
    assert exported.config.tie_word_embeddings is (head_setting is None)
    assert ("lm_head.weight" in load_file(str(out / "model.safetensors"))) is (head_setting is not None)


def test_export_never_overwrites_a_folder_it_was_not_asked_to(pair, tmp_path, capsys):
    from distill.__main__ import main

    run = tmp_path / "run"
    train(compose(overrides(pair, run, "train.max_steps=2", "eval.temperatures=[0.0]")), log=lambda *_: None)
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "README.md").write_text("my project")
    with pytest.raises(SystemExit) as e:
        main(["export", str(run / "step_000002"), str(repo)])
    assert e.value.code == 2 and "not empty" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # --overwrite replaces only an earlier export
        main(["export", str(run / "step_000002"), str(repo), "--overwrite"])
    assert "not a draftkit export" in capsys.readouterr().err
    assert (repo / "README.md").read_text() == "my project" and sorted(os.listdir(repo)) == ["README.md"]

    out = tmp_path / "out"
    main(["export", str(run / "step_000002"), str(out)])
    first = (out / "model.safetensors").read_bytes()
    with pytest.raises(SystemExit):
        main(["export", str(run / "step_000002"), str(out)])
    main(["export", str(run / "step_000002"), str(out), "--overwrite"])
    assert (out / "model.safetensors").read_bytes() == first
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temp folder left


def test_a_failed_export_leaves_the_earlier_export_as_it_was(pair, tmp_path, monkeypatch):
    """The export is written to a temporary folder and renamed: an error halfway (after the weights, before the
    card) while replacing step 1's export with step 2's keeps the earlier export byte for byte and leaves no
    temporary folder."""
    import distill.export as export_module

    run = tmp_path / "run"
    train(compose(overrides(pair, run, "train.max_steps=2", "train.save_every=1", "eval.temperatures=[0.0]")),
          log=lambda *_: None)
    out = tmp_path / "out"
    export(run / "step_000001", out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def broken(card):
        raise RuntimeError("disk full")

    monkeypatch.setattr(export_module, "_card_markdown", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        export(run / "step_000002", out, overwrite=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "run"]  # no .out.*.tmp or .old left


def test_folders_of_an_export_killed_midway_are_named_and_kept(pair, tmp_path, capsys):
    """Found by a new user's SIGKILL trial: a kill between export's two renames left the earlier export only in a
    hidden .OUT.<id>.old folder (OUT missing), and a kill while writing a hidden .OUT.<id>.tmp with a full model copy;
    nothing said so. The rerun names both and keeps them."""
    from distill.__main__ import main

    run = tmp_path / "run"
    train(compose(overrides(pair, run, "train.max_steps=2", "eval.temperatures=[0.0]")), log=lambda *_: None)
    out = tmp_path / "out"
    main(["export", str(run / "step_000002"), str(out)])
    earlier = {p.name: p.read_bytes() for p in out.iterdir()}
    out.rename(tmp_path / ".out.k1ll3d.old")  # killed after moving the earlier export aside
    (tmp_path / ".out.p4rt.tmp").mkdir()  # killed while writing
    (tmp_path / ".out.p4rt.tmp" / "model.safetensors").write_bytes(b"cut")
    capsys.readouterr()
    main(["export", str(run / "step_000002"), str(out)])
    err = capsys.readouterr().err
    assert f"{tmp_path / '.out.k1ll3d.old'} holds an earlier export of out" in err and "it is kept" in err
    assert f"{tmp_path / '.out.p4rt.tmp'} holds a partial export" in err
    assert {p.name: p.read_bytes() for p in (tmp_path / ".out.k1ll3d.old").iterdir()} == earlier
    assert (tmp_path / ".out.p4rt.tmp" / "model.safetensors").exists() and (out / "draftkit_card.json").is_file()
    main(["export", str(run / "step_000002"), str(tmp_path / "other")])  # another folder's leftovers: not named
    assert "note:" not in capsys.readouterr().err


def test_card_states_the_speedup_model_it_predicted_with():
    from distill.export import _verify_markdown

    assert "(γc + 1)" in _verify_markdown({"cost_ratio": 0.5})  # c given: Leviathan et al.'s v = 1
    text = _verify_markdown({"cost_ratio": 0.2, "verify_costs": [1.0, 1.5, 1.75]})
    assert "(γc + v_γ)" in text and "1.50, 1.75" in text and "eval.cost_ratio" in text
    assert "(γc + 1)" in _verify_markdown({"cost_ratio": 0.2, "verify_costs": [1.0]})  # no v_1: Leviathan's


def test_card_shows_acceptance_rate_and_alpha_and_a_dash_for_an_alpha_not_recorded():
    from distill.export import _card_markdown, serving_commands

    def card(row):
        ev = {"per_temperature": {"1.0": row}, "num_draft_tokens": 4, "step": 2, "cost_ratio": 0.2}
        return {"target": "t", "loss": "fkl", "steps": 2, "lora_merged": False, "evaluation": ev,
                "serving": serving_commands("t", "d", ev, None)}

    row = {"acceptance_rate": 0.512, "mean_accepted_length": 2.5, "best_gamma": 4, "predicted_speedup": 1.7}
    assert "| 1.0 | 0.512 | 0.715 | 2.50 | 4 | 1.70 |" in _card_markdown(card({**row, "alpha": 0.715}))
    assert "| 1.0 | 0.512 | - | 2.50 | 4 | 1.70 |" in _card_markdown(card(row))


def test_overwrite_keeps_what_a_user_added_to_an_earlier_export(pair, tmp_path, capsys):
    """--overwrite swapped the whole folder: notes and eval results a user had put in an earlier export were deleted.
    It now refuses (exit 2, naming them) and changes nothing; over the export's own files alone it replaces them."""
    from distill.__main__ import main

    run = tmp_path / "run"
    train(compose(overrides(pair, run, "train.max_steps=2", "eval.temperatures=[0.0]")), log=lambda *_: None)
    out = tmp_path / "out"
    main(["export", str(run / "step_000002"), str(out)])
    exported = sorted(os.listdir(out))
    (out / "NOTES.md").write_text("notes")
    (out / "eval_runs").mkdir()
    (out / "eval_runs" / "r.json").write_text("1")
    before = sorted(os.listdir(out))
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["export", str(run / "step_000002"), str(out), "--overwrite"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "NOTES.md" in err and "eval_runs" in err and "Move those" in err
    assert sorted(os.listdir(out)) == before and (out / "eval_runs" / "r.json").read_text() == "1"

    card = json.loads((out / "draftkit_card.json").read_text())
    assert card["files"] == exported  # what a later --overwrite may replace

    # an export written before the card listed its files: the files any export may write are its own, others not
    del card["files"]
    (out / "draftkit_card.json").write_text(json.dumps(card))
    (out / "eval_runs" / "r.json").unlink()
    (out / "eval_runs").rmdir()
    (out / "special_tokens_map.json").write_text("{}")  # a tokenizer of another kind wrote it
    (out / "model.safetensors.index.json").write_text("{}")  # a sharded draft wrote it
    with pytest.raises(SystemExit) as e:
        main(["export", str(run / "step_000002"), str(out), "--overwrite"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "NOTES.md" in err and "special_tokens_map" not in err and "index" not in err
    (out / "NOTES.md").unlink()
    main(["export", str(run / "step_000002"), str(out), "--overwrite"])
    assert sorted(os.listdir(out)) == exported == json.loads((out / "draftkit_card.json").read_text())["files"]


@pytest.mark.parametrize("name", ["my export", "my export's dir"])
def test_serving_commands_quote_paths(name, tmp_path):
    """The card's command lines did not quote paths: an apostrophe broke shlex.split, a space split one path in two."""
    import shlex

    from distill.export import _card_markdown, serving_commands

    target, draft = f"/models/{name} target", str(tmp_path / name)
    cmds = serving_commands(target, draft, None, None)
    vllm = shlex.split(cmds["vllm"])
    assert vllm[:4] == ["vllm", "serve", target, "--speculative-config"] and len(vllm) == 5
    assert json.loads(vllm[4])["model"] == draft
    sglang = shlex.split(cmds["sglang"])
    assert sglang[sglang.index("--model-path") + 1] == target
    assert sglang[sglang.index("--speculative-draft-model-path") + 1] == draft and len(sglang) == 15
    card = _card_markdown({"target": target, "loss": "fkl", "steps": 2, "lora_merged": False, "evaluation": None,
                           "serving": cmds})
    assert f"from_pretrained({draft!r})" in card and f"from_pretrained({target!r})" in card  # Use names the paths
    assert "PATH_TO_THIS_FOLDER" not in card


def test_card_without_an_evaluation_says_so():
    """It printed "γ = ?, step ?" and "Cost ratio c ...: nan"."""
    from distill.export import _card_markdown, serving_commands

    card = _card_markdown({"target": "t", "loss": "fkl", "steps": 2, "lora_merged": False, "evaluation": None,
                           "serving": serving_commands("t", "/d", None, {"eval": {"num_draft_tokens": 4}})})
    assert "No evaluation was recorded" in card and "?" not in card and "nan" not in card and "Cost ratio" not in card


def test_export_of_a_run_folder_names_its_checkpoint(pair, tmp_path, capsys):
    """A run folder was reported as "its save was interrupted, or it is not a checkpoint"."""
    from distill.__main__ import main

    run = tmp_path / "run"
    train(compose(overrides(pair, run, "train.max_steps=2", "eval.temperatures=[0.0]", "eval.at_start=false")),
          log=lambda *_: None)
    with pytest.raises(SystemExit) as e:
        main(["export", str(run), str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "is a run folder" in err and str(run / "step_000002") in err
    assert not (tmp_path / "out").exists()


def test_a_full_disk_during_export_exits_2_and_keeps_the_earlier_export(pair, tmp_path, monkeypatch, capsys):
    """A full disk mid-export was a traceback (exit 1): tokenizers reports it as a plain Exception, safetensors as
    its own error type, neither of which the CLI named."""
    from transformers import PreTrainedTokenizerFast

    from distill.__main__ import main

    run = tmp_path / "run"
    train(compose(overrides(pair, run, "train.max_steps=2", "train.save_every=1", "eval.temperatures=[0.0]")),
          log=lambda *_: None)
    out = tmp_path / "out"
    export(run / "step_000001", out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def disk_full(self, *a, **k):  # what tokenizers raises when its file cannot be written
        raise Exception("No space left on device (os error 28)")

    monkeypatch.setattr(PreTrainedTokenizerFast, "save_pretrained", disk_full)
    with pytest.raises(SystemExit) as e:
        main(["export", str(run / "step_000002"), str(out), "--overwrite"])
    err = " ".join(capsys.readouterr().err.split())
    assert e.value.code == 2 and "could not write the export to OUT_DIR" in err and "os error 28" in err
    assert "the earlier export there is unchanged" in err and "run the same command again" in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "run"]  # no .out.*.tmp left


def test_card_names_dtype_conversion_slower_temperatures_and_a_missing_relative_target(pair, tmp_path, monkeypatch,
                                                                                     capsys):
    """Found by a new user: a bf16 export's card stated the fp32 checkpoint's acceptance without a word; a card
    predicting a slowdown gave serving lines without one; a run given a relative target path exported a card whose
    snippets named `from_pretrained('target')`, and a target no longer there was not noticed."""
    import shutil

    shutil.copytree(pair["target"], tmp_path / "tgt")
    monkeypatch.chdir(tmp_path)
    ov = [o for o in overrides(pair, tmp_path / "run", "train.max_steps=2", "train.save_every=1", "eval.cost_ratio=5.0")
          if not o.startswith("+target.name_or_path=")]
    train(compose(["+target.name_or_path=tgt", *ov]), log=lambda *_: None)
    state = json.loads((tmp_path / "run" / "best" / "trainer_state.json").read_text())
    assert state["target"] == str((tmp_path / "tgt").resolve())
    card = export(tmp_path / "run" / "best", tmp_path / "e_bf16", dtype=torch.bfloat16)
    readme = (tmp_path / "e_bf16" / "README.md").read_text()
    assert card["dtype"] == "bfloat16" and card["evaluated_dtype"] == "float32"
    assert "Weights: bfloat16 (converted at export from the checkpoint's float32" in readme
    assert "`python -m distill eval ... draft.dtype=bfloat16`" in readme
    assert card["target"] == str((tmp_path / "tgt").resolve()) and card["target_found"]
    assert f"from_pretrained({str((tmp_path / 'tgt').resolve())!r})" in readme and "not found" not in readme
    # c = 5: every temperature is predicted slower than plain decoding, and the card says so before serving
    assert all(m["predicted_speedup"] < 1 for m in card["evaluation"]["per_temperature"].values())
    assert "**Predicted slower than plain decoding** at temperature 0.0 (" in readme
    assert "predicted slower than plain decoding at temperature 0.0, 1.0: see above" in readme
    # a checkpoint without an evaluation claims no evaluated dtype (found by the re-test trial)
    card = export(tmp_path / "run" / "step_000001", tmp_path / "e_none", dtype=torch.bfloat16)
    assert card["evaluation"] is None and card["evaluated_dtype"] is None
    assert "Weights: bfloat16." in (tmp_path / "e_none" / "README.md").read_text()
    (tmp_path / "tgt").rename(tmp_path / "tgt_moved")
    from distill.__main__ import main

    capsys.readouterr()
    main(["export", str(tmp_path / "run" / "best"), str(tmp_path / "e2")])
    err = capsys.readouterr().err
    assert f"warning: the run's target {(tmp_path / 'tgt').resolve()} is not there now" in err
    assert "warning: the checkpoint's evaluation predicts this draft slower than plain decoding at temperature 0.0" \
        in err
    card = json.loads((tmp_path / "e2" / "draftkit_card.json").read_text())
    assert card["target_found"] is False
    assert f"**The target was not found at `{(tmp_path / 'tgt').resolve()}` when this draft was exported**" in (
        tmp_path / "e2" / "README.md").read_text()


# ------------------------------------------------------------------------------------------------ engine checks

def _hand_export(pair, folder, vocab=None, tokenizer=True, drop_architectures=False):
    """An earlier export written by hand: a 1-layer draft (``vocab`` rows), the pair's tokenizer and a card."""
    from transformers import AutoTokenizer

    make_llama(folder, vocab or pair["vocab"], layers=1, seed=4)
    if tokenizer:
        AutoTokenizer.from_pretrained(str(pair["tokenizer"])).save_pretrained(str(folder))
    if drop_architectures:
        config = json.loads((folder / "config.json").read_text())
        del config["architectures"]
        (folder / "config.json").write_text(json.dumps(config))
    card = {"target": str(pair["target"]), "checkpoint": "/runs/r/best", "steps": 7, "tokens_seen": 900,
            "lora_merged": False, "loss": "fkl", "evaluation": None, "config": {"eval": {"num_draft_tokens": 3}}}
    (folder / CARD_JSON).write_text(json.dumps(card))
    return card


@pytest.mark.parametrize("case,field,words", [
    ("vocab", "vocab_size", "verify_equal_vocab_size_if_draft_model"),
    ("architectures", "architectures", "missing or empty"),
    ("tokenizer", "tokenizer files", "no tokenizer")])
def test_a_draft_an_engine_would_reject_is_refused_or_exported_for_draftkit_only(pair, tmp_path, capsys, case, field,
                                                                                 words):
    from distill.__main__ import main

    src, out = tmp_path / "src", tmp_path / "out"
    _hand_export(pair, src, vocab=pair["vocab"] + 8 if case == "vocab" else None, tokenizer=case != "tokenizer",
                 drop_architectures=case == "architectures")
    with pytest.raises(SystemExit) as e:
        main(["export", str(src), str(out)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and not out.exists()
    assert f"vLLM (draft_model) and SGLang (STANDALONE): {field}: " in err and words in err
    assert "fix: " in err and "nothing was written" in err and "--draftkit-only" in err

    main(["export", str(src), str(out), "--draftkit-only"])
    err = capsys.readouterr().err
    card = json.loads((out / CARD_JSON).read_text())
    assert card["serving"]["vllm"] is None and card["serving"]["sglang"] is None
    assert "--draftkit-only" in card["serving"]["engines_note"] and field in card["serving"]["engines_note"]
    assert card["engine_checks"]["draftkit_only"] and not card["engine_checks"]["servable"]
    assert f"note: no vLLM/SGLang lines in the card: exported with --draftkit-only: {field}" in err
    readme = (out / "README.md").read_text()
    assert "vllm serve" not in readme and "sglang.launch_server" not in readme and "library_name" not in readme
    assert "**Not for vLLM or SGLang**: exported with --draftkit-only" in readme
    assert card["serving"]["draftkit"] in readme
    # the draftkit snippet loads a tokenizer that is there: the target's when the export has none
    assert (f"load_tokenizer({str(pair['target'])!r})" in readme) == (case == "tokenizer")
    assert card["tokenizer_saved"] == (case != "tokenizer") and card["steps"] == 7


def test_a_warning_is_recorded_and_printed_but_the_export_is_servable(pair, tmp_path, capsys):
    """The draft's context is shorter than the target's: vLLM stops drafting past it, which is worth saying."""
    from distill.__main__ import main

    src = tmp_path / "src"
    _hand_export(pair, src)
    config = json.loads((src / "config.json").read_text())
    config["max_position_embeddings"] = 64  # the pair's target has 128
    (src / "config.json").write_text(json.dumps(config))
    main(["export", str(src), str(tmp_path / "out")])
    err = capsys.readouterr().err
    card = json.loads((tmp_path / "out" / CARD_JSON).read_text())
    assert card["engine_checks"]["servable"] and card["serving"]["vllm"] is not None
    # (head size 8: vLLM's CPU build would not run it, a warning too)
    assert [p["field"] for p in card["engine_checks"]["problems"]] == ["max_position_embeddings", "head_dim"]
    assert "warning: vLLM (draft_model) and SGLang (STANDALONE): max_position_embeddings: " in err
    readme = (tmp_path / "out" / "README.md").read_text()
    assert "- `max_position_embeddings`: the draft's is 64, the target's 128" in readme


def test_a_pruned_export_expands_to_the_full_vocabulary_and_re_exports_carry_the_card(pair, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from decode.loading import load_causal_lm
    from decode.vllm_card import record_served
    from decode.vocab_map import SIZE_FIELD, draft_vocab_map
    from distill.__main__ import main
    from distill.export import SERVED_NOT_CARRIED

    keep, run = 60, tmp_path / "run"
    train(compose(overrides(pair, run, f"draft.vocab.keep={keep}", "train.max_steps=2")), log=lambda *_: None)
    pruned, full = tmp_path / "pruned", tmp_path / "full"
    main(["export", str(run / "best"), str(pruned)])
    assert "re-export it with --full-vocab" in capsys.readouterr().err
    old = json.loads((pruned / CARD_JSON).read_text())
    assert old["draft_vocab"]["kept_ids"] == keep and old["serving"]["vllm"] is None
    assert [p["field"] for p in old["engine_checks"]["problems"]] == ["lm_head", "head_dim"]
    assert "--full-vocab` writes a copy they can serve" in (pruned / "README.md").read_text()

    assert record_served(pruned, SERVED)  # measured on the pruned head: not the expanded draft's figures
    capsys.readouterr()
    main(["export", str(pruned), str(full), "--full-vocab"])
    err = capsys.readouterr().err
    assert "expanded from 60 ids" in err and SERVED_NOT_CARRIED in err
    card = json.loads((full / CARD_JSON).read_text())
    assert card["head_expanded_from"] == keep and card["draft_vocab"] is None and "served" not in card
    assert card["exported_from"] == str(pruned.resolve())
    assert [p["field"] for p in card["engine_checks"]["problems"]] == ["head_dim"]  # a warning only
    for key in ("target", "checkpoint", "steps", "tokens_seen", "loss", "evaluation", "config", "best"):
        assert card[key] == old[key], key
    assert card["serving"]["vllm"] is not None and str(full.resolve()) in card["serving"]["vllm"]
    readme = (full / "README.md").read_text()
    assert "**Head expanded from 60 ids**" in readme
    assert f"Re-exported from the earlier export `{pruned.resolve()}`" in readme
    assert SIZE_FIELD not in (full / "config.json").read_text()

    small = load_causal_lm(str(pruned), "draft")
    big = AutoModelForCausalLM.from_pretrained(str(full)).eval()  # plain transformers, as vLLM's loader needs
    ids, kept = torch.tensor([[1, 20, 33, 47, 60, 71]]), draft_vocab_map(small)
    with torch.no_grad():
        a, b = small(ids).logits, big(ids).logits  # (1, 6, N), (1, 6, V)
    torch.testing.assert_close(b[..., kept], a, rtol=1e-6, atol=1e-6)
    others = torch.ones(pair["vocab"], dtype=torch.bool)
    others[kept] = False
    assert torch.equal(b[..., others], torch.zeros_like(b[..., others]))
    positive = a.max(-1).values > 0
    assert positive.any() and torch.equal(b.argmax(-1)[positive], kept[a.argmax(-1)][positive])
    # from the training checkpoint directly: the same weights
    direct = export(run / "best", tmp_path / "direct", full_vocab=True)
    assert direct["head_expanded_from"] == keep and direct["exported_from"] is None
    with torch.no_grad():
        assert torch.equal(AutoModelForCausalLM.from_pretrained(str(tmp_path / "direct")).eval()(ids).logits, b)

    # vLLM's served figures recorded on the export survive a re-export that changes nothing, which expands nothing
    assert record_served(full, SERVED)
    capsys.readouterr()
    again = export(full, tmp_path / "again")
    assert again["served"]["vllm"] == SERVED and again["exported_from"] == str(full.resolve())
    assert again["head_expanded_from"] == keep
    err = capsys.readouterr().err
    assert "expanded" not in err and SERVED_NOT_CARRIED not in err
    assert "## Served acceptance" in (tmp_path / "again" / "README.md").read_text()


def test_an_export_never_writes_into_the_export_it_reads(pair, tmp_path, capsys):
    from distill.__main__ import main

    src = tmp_path / "src"
    _hand_export(pair, src)
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    for out in (src, src / "inside"):
        with pytest.raises(SystemExit) as e:
            main(["export", str(src), str(out), "--overwrite"])
        assert e.value.code == 2 and "never writes into the folder it reads" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before


# ------------------------------------------------------------------------------------------------ what a user hit

SERVED = {"version": "0.32.0", "device": "cpu", "dtype": "float32", "num_draft_tokens": 3, "num_prompts": 2,
          "prompts": "p.jsonl", "max_new_tokens": 8, "date": "2026-12-07", "command": "python -m decode vllm-check",
          "per_temperature": {"0.0": {"acceptance_rate": 0.5, "mean_accepted_length": 1.5}}}
QUANTIZED = {"quant_method": "bitsandbytes", "load_in_8bit": True}


def _add_quantization(config_path: Path) -> None:
    config = json.loads(config_path.read_text())
    config["quantization_config"] = QUANTIZED
    config_path.write_text(json.dumps(config))


def test_a_quantized_draft_is_refused_before_it_loads(pair, tmp_path, capsys):
    """transformers would fail on bitsandbytes (an ImportError, exit 1); the engine check's words, exit 2."""
    from distill.__main__ import main
    from distill.engine_checks import check_quantization

    words = str(check_quantization({"quantization_config": QUANTIZED})[0])
    src = tmp_path / "src"
    _hand_export(pair, src)
    _add_quantization(src / "config.json")
    run = tmp_path / "run"
    train(compose(overrides(pair, run, "train.max_steps=1")), log=lambda *_: None)
    ckpt = run / "best" if (run / "best").is_dir() else run / "step_000001"
    _add_quantization(ckpt / "draft" / "config.json")
    manifest = json.loads((ckpt / "manifest.json").read_text())  # the edit keeps the checkpoint complete
    manifest["files"]["draft/config.json"] = (ckpt / "draft" / "config.json").stat().st_size
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    for source in (src, ckpt):
        for extra in ([], ["--draftkit-only"]):
            with pytest.raises(SystemExit) as e:
                main(["export", str(source), str(tmp_path / "out"), *extra])
            err = capsys.readouterr().err
            assert e.value.code == 2 and not (tmp_path / "out").exists()
            assert words in err and "(bitsandbytes)" in err and "nothing was written" in err


def test_a_plain_hugging_face_model_folder_is_named_as_such(pair, tmp_path, capsys):
    from distill.__main__ import main

    plain = tmp_path / "plain"
    make_llama(plain, pair["vocab"], layers=1, seed=4)
    with pytest.raises(SystemExit) as e:
        main(["export", str(plain), str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "is a plain Hugging Face model" in err and "not a draftkit checkpoint" in err
    assert "<run>/best, <run>/step_N or an earlier export's folder" in err and "interrupted" not in err


def test_served_figures_go_only_with_the_weights_they_were_measured_on(pair, tmp_path, capsys):
    from decode.vllm_card import record_served
    from distill.__main__ import main
    from distill.export import SERVED_NOT_CARRIED

    src = tmp_path / "src"
    _hand_export(pair, src)
    assert record_served(src, SERVED)
    capsys.readouterr()
    # the same weights (the source's dtype, given or not): kept, and the card says where they were measured
    for name, extra in (("same", []), ("same32", ["--dtype", "float32"])):
        main(["export", str(src), str(tmp_path / name), *extra])
        assert SERVED_NOT_CARRIED not in capsys.readouterr().err
        card = json.loads((tmp_path / name / CARD_JSON).read_text())
        assert card["served"]["vllm"] == SERVED
        readme = (tmp_path / name / "README.md").read_text()
        assert f"measured on the earlier export `{src.resolve()}`" in readme and "## Served acceptance" in readme
    # another dtype: other weights, so the figures are dropped and said to be
    main(["export", str(src), str(tmp_path / "bf16"), "--dtype", "bfloat16"])
    assert SERVED_NOT_CARRIED in capsys.readouterr().err
    card = json.loads((tmp_path / "bf16" / CARD_JSON).read_text())
    assert card["dtype"] == "bfloat16" and "served" not in card
    assert "Served acceptance" not in (tmp_path / "bf16" / "README.md").read_text()


def test_overwrite_from_a_checkpoint_says_the_served_figures_are_not_carried(pair, tmp_path, capsys):
    from decode.vllm_card import record_served
    from distill.__main__ import main
    from distill.export import SERVED_NOT_CARRIED

    run, out = tmp_path / "run", tmp_path / "out"
    train(compose(overrides(pair, run, "train.max_steps=1")), log=lambda *_: None)
    ckpt = run / "best" if (run / "best").is_dir() else run / "step_000001"
    main(["export", str(ckpt), str(out)])
    assert SERVED_NOT_CARRIED not in capsys.readouterr().err
    main(["export", str(ckpt), str(out), "--overwrite"])  # nothing served yet: nothing to say
    assert SERVED_NOT_CARRIED not in capsys.readouterr().err
    assert record_served(out, SERVED)
    main(["export", str(ckpt), str(out), "--overwrite"])
    assert SERVED_NOT_CARRIED in capsys.readouterr().err
    assert "served" not in json.loads((out / CARD_JSON).read_text())
    assert "Served acceptance" not in (out / "README.md").read_text()
