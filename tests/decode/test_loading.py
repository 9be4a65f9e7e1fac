"""decode.loading with hub ids (``org/name``) served from the local Hugging Face cache while offline: the cache
layout is built by hand as huggingface_hub writes it (``models--org--name/{refs/main, snapshots/<commit>/}``)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import decode.__main__
import decode.loading
from decode.__main__ import main
from decode.loading import (check_model_path, hub_revision, load_causal_lm, load_draft_tokenizer, load_tokenizer,
                            local_folder, looks_local)
from decode.vocab_map import draft_vocab_map, prune_draft_head
from tests.conftest import make_tokenizer, put_snapshot, tiny_llama


def test_local_folder_follows_refs_main_of_a_cached_hub_id(hub_cache, tmp_path):
    tiny_llama(seed=0, dtype=torch.float32).save_pretrained(tmp_path / "v1")
    tiny_llama(seed=1, dtype=torch.float32).save_pretrained(tmp_path / "v2")
    old = put_snapshot(hub_cache, "org/target", "a" * 40, tmp_path / "v1")
    assert Path(local_folder("org/target")) == old
    new = put_snapshot(hub_cache, "org/target", "b" * 40, tmp_path / "v2")  # an update was downloaded
    assert Path(local_folder("org/target")) == new
    assert local_folder("org/not-cached") is None and local_folder("org/bad name!") is None
    assert local_folder(str(tmp_path / "v1")) == str(tmp_path / "v1")
    assert local_folder(str(tmp_path / "missing")) is None


def test_hub_revision_names_the_snapshot_refs_main_points_to(hub_cache, tmp_path):
    """Results record the bare id and this commit: a later ``hf download`` moves refs/main to other weights."""
    tiny_llama(seed=0, dtype=torch.float32).save_pretrained(tmp_path / "v1")
    assert hub_revision("org/target") is None  # not in the cache
    put_snapshot(hub_cache, "org/target", "a" * 40, tmp_path / "v1")
    assert hub_revision("org/target") == "a" * 40
    put_snapshot(hub_cache, "org/target", "b" * 40, tmp_path / "v1")
    assert hub_revision("org/target") == "b" * 40
    assert hub_revision(str(tmp_path / "v1")) is None and hub_revision(str(tmp_path / "missing")) is None


def test_a_cached_hub_draft_is_checked_with_its_own_tokenizer(hub_cache, tmp_path):
    """The draft's own tokenizer is what the pair's compatibility check compares; a hub id used to fall back to
    the target's silently, so a draft with another vocabulary passed as compatible."""
    draft = tmp_path / "draft"
    tiny_llama(seed=1, layers=1, dtype=torch.float32).save_pretrained(draft)
    make_tokenizer([f"x{i}" for i in range(92)]).save_pretrained(draft)
    put_snapshot(hub_cache, "org/draft", "c" * 40, draft)
    target_tokenizer = make_tokenizer()
    got = load_draft_tokenizer("org/draft", target_tokenizer)
    assert got is not target_tokenizer and "x0" in got.get_vocab()


def test_a_vocabulary_pruned_draft_loads_by_hub_id(hub_cache, tmp_path):
    """A pruned draft's N-row head and id map are read from its folder; by hub id it failed inside
    from_pretrained with a size-mismatch RuntimeError (a traceback from the CLIs)."""
    draft = tiny_llama(seed=1, layers=1, dtype=torch.float32)
    keep = torch.arange(0, draft.config.vocab_size, 2)
    prune_draft_head(draft, keep).save_pretrained(tmp_path / "pruned")
    put_snapshot(hub_cache, "org/pruned", "d" * 40, tmp_path / "pruned")
    model = load_causal_lm("org/pruned", "draft")
    assert model.lm_head.weight.shape[0] == len(keep)


def test_a_hub_id_that_is_not_cached_offline_names_the_role_the_near_miss_and_the_fix(hub_cache, tmp_path):
    """It used to read 'the hub is not reachable or has no such model (OSError)' after transformers' network retry,
    and for the tokenizer 'save the tokenizer next to the model', which was not the problem."""
    tiny_llama(seed=0, dtype=torch.float32).save_pretrained(tmp_path / "t")
    make_tokenizer().save_pretrained(tmp_path / "t")
    put_snapshot(hub_cache, "org/target", "a" * 40, tmp_path / "t")
    for load in (lambda: load_causal_lm("org/targt", "target"),
                 lambda: load_tokenizer("org/targt", "tokenizer")):
        with pytest.raises(FileNotFoundError, match=r"tokenizer|target") as err:
            load()
        assert "'org/targt' is not a local folder, and as a hub id it is not in the local Hugging Face cache" \
            in str(err.value)
        assert "(did you mean 'org/target'?)" in str(err.value) and "hf download org/targt" in \
            str(err.value)
    with pytest.raises(FileNotFoundError, match="hf download org/target --revision v2"):
        load_causal_lm("org/target@v2", "target")


def test_offline_set_by_the_bench_is_named_as_the_bench_s_not_the_user_s(hub_cache, monkeypatch):
    """The bench sets HF_HUB_OFFLINE=1 itself; its error said 'while HF_HUB_OFFLINE is set' to a user who had not."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(decode.loading, "_offline_by", None)
    decode.loading.run_offline("decode bench")
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    with pytest.raises(FileNotFoundError, match=r"while decode bench runs offline \(HF_HUB_OFFLINE=1 unless you set "
                                                r"HF_HUB_OFFLINE=0\)"):
        load_causal_lm("org/nope", "target")
    monkeypatch.setattr(decode.loading, "_offline_by", None)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the user's own setting stands and is named as theirs
    decode.loading.run_offline("decode bench")
    assert decode.loading._offline_by is None
    with pytest.raises(FileNotFoundError, match="while HF_HUB_OFFLINE is set"):
        load_causal_lm("org/nope", "target")


def test_generate_names_an_uncached_draft_before_loading_the_target(hub_cache, monkeypatch, capsys):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before every path was checked")

    monkeypatch.setattr(decode.loading, "load_causal_lm", refuse)
    monkeypatch.setattr(decode.__main__, "load_causal_lm", refuse)  # the command's own reference
    assert main(["generate", "--target", "org/target", "--draft", "org/draft", "--prompt", "hi",
                 "--device", "cpu"]) == 2
    assert "--target 'org/target' is not a local folder" in capsys.readouterr().err


def test_a_relative_folder_that_shadows_a_cached_hub_id_is_named(hub_cache, tmp_path, monkeypatch):
    """``org/name`` that is also a folder of the current directory loads that folder (as transformers does); when
    it is not a checkpoint the error said only 'Unrecognized model', with the cached hub model never mentioned."""
    tiny_llama(seed=0, dtype=torch.float32).save_pretrained(tmp_path / "t")
    put_snapshot(hub_cache, "org/target", "a" * 40, tmp_path / "t")
    (tmp_path / "here" / "org" / "target").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "here")
    with pytest.raises(FileNotFoundError, match=r"'org/target' is the folder ./org/target of the current directory, "
                                                r"which shadows the hub id"):
        load_causal_lm("org/target", "target")


def test_a_distill_training_checkpoint_is_named_with_the_export_command(tmp_path):
    """A run's step_N or best folder (trainer_state.json, weights under draft/) failed with transformers' 'Should
    have a model_type key'; the decode CLIs now say to export it first."""
    ckpt = tmp_path / "run" / "best"
    tiny_llama(seed=0).save_pretrained(ckpt / "draft")
    (ckpt / "trainer_state.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"distill training checkpoint.*python -m distill export .*best OUT_DIR"):
        load_causal_lm(str(ckpt), "draft")


def test_a_peft_adapter_folder_loads_merged_into_its_base_a_pruned_one_too(tmp_path):
    """An adapter whose base is a vocabulary-pruned draft failed inside from_pretrained with a size-mismatch
    RuntimeError (a traceback from generate, serve and certify); one that names no base was transformers' error."""
    import json

    from peft import LoraConfig, get_peft_model


    draft = tiny_llama(seed=1, layers=1, dtype=torch.float32)
    keep = torch.arange(0, draft.config.vocab_size, 2)
    prune_draft_head(draft, keep).save_pretrained(tmp_path / "pruned")
    base = load_causal_lm(str(tmp_path / "pruned"), "draft")
    peft_model = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    peft_model.save_pretrained(tmp_path / "adapter")
    ids = torch.tensor([[1, 5, 9, 13]])
    with torch.no_grad():
        expected = peft_model(ids).logits
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] == \
        str(tmp_path / "pruned")
    model = load_causal_lm(str(tmp_path / "adapter"), "draft")
    assert model.lm_head.weight.shape[0] == len(keep) and torch.equal(draft_vocab_map(model), keep)
    assert not any("lora" in name for name, _ in model.named_parameters())  # merged: one plain model
    torch.testing.assert_close(model(ids).logits, expected, rtol=1e-5, atol=1e-5)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": None}))
    with pytest.raises(FileNotFoundError, match="names no base_model_name_or_path"):
        load_causal_lm(str(tmp_path / "adapter"), "draft")


def test_an_adapter_on_a_tied_head_loads_as_trained_a_base_cycle_is_named_and_a_moved_run_loads(tmp_path):
    """Merging into a tied lm_head moved the input embeddings too (the loaded draft differed from base + adapter
    by 18 in logits, 1 of 8 argmaxes the same); an adapter naming itself as its base recursed until Python's limit
    (a RecursionError traceback); a moved LoRA run's adapter said only that its old base path does not exist."""
    import json
    import shutil

    from peft import LoraConfig, get_peft_model

    tied = tiny_llama(seed=1, layers=1, dtype=torch.float32, tie_word_embeddings=True)
    assert tied.lm_head.weight.data_ptr() == tied.model.embed_tokens.weight.data_ptr()
    tied.save_pretrained(tmp_path / "run" / "draft_base")
    peft_model = get_peft_model(load_causal_lm(str(tmp_path / "run" / "draft_base"), "draft"),
                                LoraConfig(r=2, target_modules=["q_proj", "lm_head"], init_lora_weights=False))
    adapter = tmp_path / "run" / "best" / "draft"
    peft_model.save_pretrained(adapter)
    ids = torch.tensor([[1, 5, 9, 13, 40]])
    with torch.no_grad():
        expected = peft_model(ids).logits
    torch.testing.assert_close(load_causal_lm(str(adapter), "draft")(ids).logits, expected, rtol=1e-5, atol=1e-5)

    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": str(adapter)}))
    with pytest.raises(FileNotFoundError, match="returns to an adapter it passed; set base_model_name_or_path"):
        load_causal_lm(str(adapter), "draft")
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    shutil.move(tmp_path / "run", tmp_path / "moved")  # a moved run's adapter takes the run's own draft_base
    moved = load_causal_lm(str(tmp_path / "moved" / "best" / "draft"), "draft")
    torch.testing.assert_close(moved(ids).logits, expected, rtol=1e-5, atol=1e-5)
    shutil.rmtree(tmp_path / "moved" / "draft_base")  # gone from both places: named
    with pytest.raises(FileNotFoundError, match=r"base_model_name_or_path .*run/draft_base' is not a folder"):
        load_causal_lm(str(tmp_path / "moved" / "best" / "draft"), "draft")


def test_a_plain_peft_adapter_takes_its_base_s_tokenizer_and_a_relative_base_is_named(tmp_path, monkeypatch):
    """An adapter saved by peft alone (no tokenizer files) as --target failed with the tokenizer library's
    "sentencepiece or tiktoken" message; a base named relative to the adapter's folder was looked up as a hub id
    ("hf download draft-distilled")."""
    import json

    from peft import LoraConfig, get_peft_model

    make_tokenizer().save_pretrained(tmp_path / "base")
    tiny_llama(seed=1, layers=1, dtype=torch.float32).save_pretrained(tmp_path / "base")
    model = load_causal_lm(str(tmp_path / "base"), "target")
    get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(tmp_path / "adapter")
    assert load_tokenizer(str(tmp_path / "adapter"), "target tokenizer").get_vocab() == \
        load_tokenizer(str(tmp_path / "base")).get_vocab()
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": "base"}))
    monkeypatch.chdir(tmp_path / "adapter")
    with pytest.raises(FileNotFoundError, match=r"read from the working folder .*base exists: set base_model_name"):
        load_causal_lm(str(tmp_path / "adapter"), "target")


def test_a_device_this_torch_lacks_is_a_value_error_before_loading(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on a CPU build of torch
    tiny_llama().save_pretrained(tmp_path / "m")
    with pytest.raises(ValueError, match=r"device 'cuda:7' asked for, but this torch build or machine has no CUDA"):
        load_causal_lm(str(tmp_path / "m"), device="cuda:7")
    with pytest.raises(ValueError, match="device 'tpu' is not a torch device"):
        load_causal_lm(str(tmp_path / "m"), device="tpu")
    with pytest.raises(ValueError, match=r"device 0 is not a torch device.*no(ne is)? .*available"):
        load_causal_lm(str(tmp_path / "m"), device=0)  # torch reads 0 as its accelerator's; it loaded on the CPU
    with pytest.raises(ValueError, match=r"device 'xpu' asked for"):
        load_causal_lm(str(tmp_path / "m"), device=torch.device("xpu"))
    # found by a new user: mps on a machine without it failed in torch after the weights had loaded
    for device in ("mps", "xpu", "meta"):
        with pytest.raises(ValueError, match=rf"device '{device}' asked for, but this torch build or machine cannot"):
            load_causal_lm(str(tmp_path / "m"), device=device)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"device 'cuda:7' asked for, but this machine has 2 CUDA device\(s\): use "
                                         r"cuda:0 to cuda:1"):
        load_causal_lm(str(tmp_path / "m"), device="cuda:7")


def test_a_model_folder_without_tokenizer_files_is_named(tmp_path):
    """transformers 5 builds a Qwen2Tokenizer with one token for a qwen2/qwen3 folder that has no tokenizer files,
    so a trial's prompts came out 'empty' and the tokenizers 'disagreed on bos': the folder is named instead."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    AutoModelForCausalLM.from_config(Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                 num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                                 head_dim=8)).save_pretrained(str(tmp_path / "qwen3"))
    with pytest.raises(FileNotFoundError, match=r"the tokenizer folder .*qwen3 has no tokenizer files .* pass "
                                                r"--tokenizer PATH"):
        load_tokenizer(str(tmp_path / "qwen3"))


def test_a_generic_tokenizer_saved_in_a_qwen2_folder_loads_as_saved(tmp_path):
    """transformers 5's AutoTokenizer loads a tokenizer saved with a generic class (TokenizersBackend) from a folder
    whose config.json says qwen2 as Qwen2Tokenizer, which adds <|endoftext|> as unk: a trial's distilled Qwen2-type
    draft (Llama-vocabulary tokenizer) was then refused by its own run's eval and export. The saved class is used."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    tok = make_tokenizer()
    tok.save_pretrained(str(tmp_path / "tok"))
    saved = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))  # as a run saves it: a generic class
    AutoModelForCausalLM.from_config(Qwen2Config(vocab_size=len(saved), hidden_size=32, intermediate_size=64,
                                                 num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
                                     ).save_pretrained(str(tmp_path / "qwen2"))
    saved.save_pretrained(str(tmp_path / "qwen2"))
    # what transformers does (with no unk token in the vocabulary, as the quickstart's, it also adds one)
    assert type(AutoTokenizer.from_pretrained(str(tmp_path / "qwen2"))).__name__ == "Qwen2Tokenizer"
    loaded = load_tokenizer(str(tmp_path / "qwen2"))
    assert type(loaded) is type(saved) and len(loaded) == len(saved) and loaded.unk_token == saved.unk_token
    assert loaded("a b c").input_ids == saved("a b c").input_ids


def test_a_path_with_two_slashes_is_a_missing_folder_not_an_uncached_hub_id(tmp_path, monkeypatch):
    """A relative path that did not exist (checkpoints/quickstart/target) was read as a hub id: 'not in the local
    Hugging Face cache ... hf download checkpoints/quickstart/target'. Hub ids have at most one '/'."""
    assert looks_local("checkpoints/quickstart/target") and looks_local("./x")
    assert not looks_local("org/name") and not looks_local("gpt2") and not looks_local("org/name@refs/pr/1")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as err:
        check_model_path("checkpoints/quickstart/target", "--target")
    assert f"--target path 'checkpoints/quickstart/target' ({tmp_path / 'checkpoints/quickstart/target'}) does " \
           "not exist" in str(err.value)
