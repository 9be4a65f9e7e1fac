"""Training modes as a Hugging Face/TRL/peft user tries them: LoRA settings that must not be silently changed, and
the target-generated data cache (sequence-level KD) against a target that changed after the cache was made."""
import shutil
import warnings

import pytest
import torch
from omegaconf import OmegaConf

from distill.data import build_examples
from distill.target_data import cache_key, generate_target_data, target_data_settings
from distill.models import attach_lora, load_draft, load_target
from distill_helpers import make_llama


@pytest.fixture(scope="module")
def tok(pair):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(pair["tokenizer"]))


def _draft_cfg(path):
    return OmegaConf.create({"name_or_path": str(path), "num_hidden_layers": None, "hidden_size": None,
                             "intermediate_size": None, "num_attention_heads": None, "num_key_value_heads": None,
                             "init_from_target": True, "dtype": None, "seed": 0})


def _lora_cfg(**kw):
    return OmegaConf.create({"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj"], **kw})


def test_lora_fractional_alpha_keeps_its_scale_and_trains(pair):
    """train.lora.alpha=0.5 (a float in the schema) was truncated to 0: zero scale, zero gradient, no training."""
    target = load_target(OmegaConf.create({"name_or_path": str(pair["target"])}))
    lora = attach_lora(load_draft(_draft_cfg(pair["draft"]), target), _lora_cfg(alpha=0.5))
    layer = lora.base_model.model.model.layers[0].self_attn.q_proj
    assert layer.scaling["default"] == 0.5 / 4
    lora(torch.tensor([[1, 5, 9, 12]])).logits.square().mean().backward()
    assert layer.lora_B["default"].weight.grad.abs().sum() > 0  # B starts at 0: only its gradient can move it


def test_lora_integer_alpha_is_saved_as_before(pair):
    target = load_target(OmegaConf.create({"name_or_path": str(pair["target"])}))
    lora = attach_lora(load_draft(_draft_cfg(pair["draft"]), target), _lora_cfg(alpha=8.0))
    assert lora.peft_config["default"].lora_alpha == 8 and isinstance(lora.peft_config["default"].lora_alpha, int)


def test_target_data_cache_key_follows_the_targets_weights(pair, tmp_path):
    """A target retrained or replaced at the same path must not reuse the old target's completions."""
    path = tmp_path / "target"
    shutil.copytree(pair["target"], path)
    examples = [{"prompt_ids": [1, 5, 9], "completion_ids": []}]
    gen = {"temperature": 0.0, "max_new_tokens": 4, "seed": 0, "shard_size": 2}

    def key(name):
        return cache_key(target_data_settings(name, "float32", examples, gen))

    before = key(str(path))
    assert key(str(path)) == before  # same files, same key: the cache is reused
    make_llama(path, pair["vocab"], layers=2, seed=7)  # new weights, same path and config
    assert key(str(path)) != before
    assert key("org/hub-id") == key("org/hub-id")


def test_target_generation_drafts_in_eval_mode_and_restores_train_mode(pair, tok, tmp_path):
    """The recipe's draft is in train mode; generate-data must not draft with dropout (the decoder warned about it)
    and must hand the draft back in train mode."""
    target = load_target(OmegaConf.create({"name_or_path": str(pair["target"])}))
    draft = load_draft(_draft_cfg(pair["draft"]), target)
    assert draft.training
    modes = []
    draft.register_forward_pre_hook(lambda module, args: modes.append(module.training))
    src = OmegaConf.create({"path": str(pair["data"]), "prompt_field": "prompt", "limit": 2})
    data_cfg = OmegaConf.create({"max_new_tokens": 4, "chat_template": False, "append_eos": True})
    examples = build_examples(src, tok, data_cfg)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = generate_target_data(target, tok, examples, tmp_path / "cache", "k", temperature=0.0, max_new_tokens=4,
                                   batch_size=2, shard_size=2, seed=0, draft=draft)
    assert len(out) == 2 and modes and not any(modes)
    assert draft.training
    assert not [w for w in caught if "training mode" in str(w.message)]


def test_cross_entropy_is_not_applied_to_on_policy_batches(pair, tmp_path):
    """loss.ce_weight mixed CE into on-policy batches too, whose labels are the draft's own samples: the draft was
    trained toward what it already says. With every batch on-policy, ce_weight must change nothing."""
    from distill.recipe import train
    from distill_helpers import compose, overrides

    runs = {w: train(compose(overrides(pair, tmp_path / f"ce{w}", "data.on_policy_fraction=1.0",
                                       f"loss.ce_weight={w}", "train.max_steps=2", "eval.at_start=false",
                                       "eval.temperatures=[0.0]")), log=lambda *_: None)
            for w in (0.0, 0.7)}
    assert runs[0.0]["final_loss"] == pytest.approx(runs[0.7]["final_loss"], rel=1e-6)


def test_lora_modules_to_save_trains_the_head_in_full_and_export_merges_it(pair, tmp_path):
    """train.lora.modules_to_save (peft's, e.g. [lm_head]) did not exist: a LoRA user could not train the head."""
    from safetensors.torch import load_file

    from distill.export import export
    from distill.config import SetupError
    from distill.recipe import train
    from distill_helpers import compose, overrides

    run = tmp_path / "run"
    train(compose(overrides(pair, run, "train.lora.enabled=true", "train.lora.target_modules=[q_proj]",
                            "train.lora.modules_to_save=[lm_head]", "optim.lr=5e-2", "train.max_steps=2",
                            "eval.at_start=false", "eval.temperatures=[0.0]")), log=lambda *_: None)
    export(run / "step_000002", tmp_path / "export")
    base = load_file(str(pair["draft"] / "model.safetensors"))["lm_head.weight"]
    exported = load_file(str(tmp_path / "export" / "model.safetensors"))["lm_head.weight"]
    assert exported.shape == base.shape and not torch.allclose(exported, base)  # the head itself was trained
    with pytest.raises(SetupError, match=r"modules_to_save=\['lm_haed'\] names \['lm_haed'\]"):
        train(compose(overrides(pair, tmp_path / "bad", "train.lora.enabled=true",
                                "train.lora.modules_to_save=[lm_haed]")), log=lambda *_: None)
