"""Target/draft loading: frozen target, drafts built from the target's config, LoRA, pair compatibility."""
import pytest
import torch
from omegaconf import OmegaConf

from distill.config import SetupError
from distill.models import attach_lora, check_pair, draft_config_from_target, load_draft, load_target, load_tokenizer


def _draft_cfg(**kw):
    base = {"name_or_path": None, "num_hidden_layers": None, "hidden_size": None, "intermediate_size": None,
            "num_attention_heads": None, "num_key_value_heads": None, "init_from_target": True, "dtype": None,
            "seed": 0}
    return OmegaConf.create({**base, **kw})


def test_target_is_frozen_and_draft_gets_float32_master_weights(pair):
    target = load_target(OmegaConf.create({"name_or_path": str(pair["target"]), "dtype": "bf16"}))
    assert not target.training and not any(p.requires_grad for p in target.parameters())
    assert next(target.parameters()).dtype == torch.bfloat16
    built = load_draft(_draft_cfg(num_hidden_layers=1), target)
    assert next(built.parameters()).dtype == torch.float32
    assert next(load_draft(_draft_cfg(num_hidden_layers=1, dtype="auto"), target).parameters()).dtype == torch.bfloat16


def test_draft_built_from_target_copies_first_layers(pair):
    target = load_target(OmegaConf.create({"name_or_path": str(pair["target"]), "dtype": None}))
    draft = load_draft(_draft_cfg(num_hidden_layers=1), target)
    assert draft.config.num_hidden_layers == 1 and draft.training
    assert any(p.requires_grad for p in draft.parameters())
    tsd, dsd = target.state_dict(), draft.state_dict()
    assert set(dsd) < set(tsd)
    for name in dsd:  # embeddings, layer 0, final norm and head all come from the target
        assert torch.equal(dsd[name], tsd[name]), name
    ids = torch.tensor([[1, 5, 9, 12]])
    assert draft(ids).logits.shape == target(ids).logits.shape
    narrow = load_draft(_draft_cfg(num_hidden_layers=1, hidden_size=16, intermediate_size=32), target)
    assert narrow.config.hidden_size == 16
    assert not torch.equal(narrow.lm_head.weight[:, :16], target.lm_head.weight[:, :16])  # nothing to copy
    fresh = load_draft(_draft_cfg(num_hidden_layers=1, init_from_target=False), target)
    assert not torch.equal(fresh.model.embed_tokens.weight, target.model.embed_tokens.weight)
    cfg = _draft_cfg(num_hidden_layers=1)
    cfg.hidden_size = 16
    dcfg = draft_config_from_target(target.config, cfg)
    assert dcfg.hidden_size == 16 and target.config.hidden_size == 32  # the target's config is untouched


def test_lora_target_modules(pair):
    target = load_target(OmegaConf.create({"name_or_path": str(pair["target"])}))
    draft = load_draft(_draft_cfg(name_or_path=str(pair["draft"])), target)
    lora = attach_lora(draft, OmegaConf.create({"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj"]}))
    trainable = [n for n, p in lora.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n and "q_proj" in n for n in trainable)
    draft2 = load_draft(_draft_cfg(name_or_path=str(pair["draft"])), target)
    all_linear = attach_lora(draft2, OmegaConf.create({"r": 4, "alpha": 8, "dropout": 0.0,
                                                        "target_modules": "all-linear"}))
    names = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n, p in all_linear.named_parameters() if p.requires_grad}
    assert {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"} == names
    draft3 = load_draft(_draft_cfg(name_or_path=str(pair["draft"])), target)
    with pytest.raises(SetupError, match="matches no module.*q_proj"):
        attach_lora(draft3, OmegaConf.create({"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["qkv"]}))


def test_pair_check_uses_the_decoders_rule(pair, tmp_path):
    from transformers import AutoTokenizer

    from distill_helpers import make_tokenizer

    target = load_target(OmegaConf.create({"name_or_path": str(pair["target"])}))
    draft = load_draft(_draft_cfg(name_or_path=str(pair["draft"])), target)
    tok = load_tokenizer(str(pair["target"]))
    assert check_pair(target, draft, tok, AutoTokenizer.from_pretrained(str(pair["draft"]))) == pair["vocab"]
    other = make_tokenizer(tmp_path / "other", vocab_size=290)
    other.add_special_tokens({"eos_token": "<eos2>"})
    with pytest.raises(SetupError, match="incompatible target/draft pair.*eos"):
        check_pair(target, draft, tok, other)


def test_missing_checkpoints_name_the_key(tmp_path):
    with pytest.raises(SetupError, match=r"\+target.name_or_path"):
        load_target(OmegaConf.create({"name_or_path": str(tmp_path)}))
    with pytest.raises(SetupError, match="no target given"):
        load_target(OmegaConf.create({"name_or_path": None}))


def test_lora_target_modules_partly_missing_in_a_fused_qkv_architecture():
    """Phi3 fuses q/k/v into qkv_proj: the usual list [q_proj,k_proj,v_proj,o_proj] used to adapt o_proj alone
    (peft only warns about the rest), so attention trained no adapter without a word."""
    from transformers import Phi3Config, Phi3ForCausalLM

    draft = Phi3ForCausalLM(Phi3Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
                                       pad_token_id=0))
    cfg = {"r": 2, "alpha": 4, "dropout": 0.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
    with pytest.raises(SetupError, match=r"train.lora.target_modules=.*\['q_proj', 'k_proj', 'v_proj'\].*qkv_proj"):
        attach_lora(draft, OmegaConf.create(cfg))
    lora = attach_lora(draft, OmegaConf.create({**cfg, "target_modules": ["qkv_proj", "self_attn.o_proj"]}))
    assert {n.split(".lora_")[0].rsplit(".", 1)[-1] for n, p in lora.named_parameters() if p.requires_grad} \
        == {"qkv_proj", "o_proj"}


def test_an_override_the_built_model_ignores_is_refused():
    """FalconConfig keeps draft.num_key_value_heads=2 but FalconForCausalLM reads num_kv_heads: a trial got a draft
    with 4 KV heads and a config saying 2, silently. Shape-changing overrides must change the built shapes."""
    from transformers import AutoModelForCausalLM, FalconConfig, LlamaConfig

    falcon = AutoModelForCausalLM.from_config(FalconConfig(vocab_size=64, new_decoder_architecture=True, hidden_size=64,
                                                           num_attention_heads=4, num_kv_heads=4, num_hidden_layers=2))
    with pytest.raises(SetupError, match=r"draft.num_key_value_heads=2 changes nothing in the FalconForCausalLM"):
        load_draft(_draft_cfg(num_hidden_layers=1, num_key_value_heads=2), falcon)
    assert load_draft(_draft_cfg(num_hidden_layers=1, hidden_size=32), falcon).config.hidden_size == 32
    llama = AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                         num_hidden_layers=2, num_attention_heads=4))
    draft = load_draft(_draft_cfg(num_hidden_layers=1, num_key_value_heads=2), llama)
    assert draft.model.layers[0].self_attn.k_proj.weight.shape[0] == 2 * 8
