"""What vLLM (draft_model) and SGLang (STANDALONE) would reject in an exported draft: each check alone on dicts and
tensors, the target's config as read from a folder, a GGUF file or nowhere, and all checks on a loaded draft."""
import json

import pytest
import torch

from decode.vllm_env import config_vocab_size
from distill.engine_checks import (EngineProblem, check_architectures, check_context_length, check_head_rows,
                                   check_head_size, check_quantization, check_remote_code, check_tied_head,
                                   check_tokenizer, check_vocab_size, engine_problems, read_target_config)
from distill_helpers import make_llama

LLAMA = {"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "tie_word_embeddings": False,
         "max_position_embeddings": 128}


def test_a_draft_that_fits_the_target_has_no_problems():
    head, embed = torch.ones(100, 8), torch.zeros(100, 8)
    assert check_vocab_size(LLAMA, {"vocab_size": 100}) == []
    assert check_head_rows(LLAMA, 100) == [] and check_tied_head(LLAMA, head, embed) == []
    assert check_architectures(LLAMA) == [] and check_quantization(LLAMA) == [] and check_remote_code(LLAMA) == []
    assert check_context_length(LLAMA, {"max_position_embeddings": 128}) == []
    assert check_vocab_size(LLAMA, None) == [] and check_context_length(LLAMA, None) == []  # target not read


def test_a_head_size_vllm_s_cpu_build_cannot_run_is_a_warning():
    assert check_head_size({"hidden_size": 576, "num_attention_heads": 9}) == []  # SmolLM2: 64
    assert check_head_size({"hidden_size": 64, "num_attention_heads": 4, "head_dim": 32}) == []  # head_dim wins
    [p] = check_head_size({"hidden_size": 64, "num_attention_heads": 4})
    assert not p.error and p.field == "head_dim" and "16" in p.what and "CPU" in p.what and "GPU" in p.fix


def test_a_vocab_size_other_than_the_targets_is_an_error_naming_vllms_check():
    [p] = check_vocab_size(LLAMA, {"vocab_size": 120})
    assert p.error and p.field == "vocab_size" and "100" in p.what and "120" in p.what
    assert "verify_equal_vocab_size_if_draft_model" in p.what and "--draftkit-only" in p.fix
    # a multimodal target keeps its vocabulary in text_config, as vLLM's get_vocab_size reads it
    assert config_vocab_size({"text_config": {"vocab_size": 120}}) == 120
    assert len(check_vocab_size(LLAMA, {"text_config": {"vocab_size": 120}})) == 1
    assert str(p).startswith("error: vLLM (draft_model) and SGLang (STANDALONE): vocab_size: ")


def test_a_head_of_other_rows_is_an_error_and_a_pruned_one_names_full_vocab():
    [p] = check_head_rows(LLAMA, 60)
    assert p.error and p.field == "lm_head" and "60 rows" in p.what and "--full-vocab" not in p.fix
    [p] = check_head_rows({**LLAMA, "draft_vocab_map_size": 60}, 60)
    assert "vocabulary-pruned" in p.what and "--full-vocab" in p.fix


def test_a_tied_config_with_a_head_that_differs_from_the_embedding_is_an_error():
    embed = torch.randn(100, 8)
    tied = {**LLAMA, "tie_word_embeddings": True}
    assert check_tied_head(tied, embed.clone(), embed) == []
    [p] = check_tied_head(tied, embed + 1, embed)
    assert p.error and p.field == "tie_word_embeddings" and "another draft" in p.what
    assert "tie_word_embeddings to false" in p.fix
    assert len(check_tied_head(tied, torch.randn(60, 8), embed)) == 1  # a head of another shape
    assert len(check_tied_head({"vocab_size": 100}, embed + 1, embed)) == 1  # transformers' default is tied


@pytest.mark.parametrize("archs", [None, []])
def test_a_missing_or_empty_architectures_is_an_error(archs):
    config = {k: v for k, v in LLAMA.items() if k != "architectures"}
    if archs is not None:
        config["architectures"] = archs
    [p] = check_architectures(config)
    assert p.error and p.field == "architectures" and "LlamaForCausalLM" in p.fix


def test_an_unfamiliar_architecture_is_a_warning():
    [p] = check_architectures({**LLAMA, "architectures": ["MyDraftForCausalLM"]})
    assert not p.error and "MyDraftForCausalLM" in p.what and str(p).startswith("warning: ")


def test_quantization_config_is_an_error_and_auto_map_a_warning():
    [p] = check_quantization({**LLAMA, "quantization_config": {"quant_method": "bitsandbytes"}})
    assert p.error and p.field == "quantization_config" and "bitsandbytes" in p.what
    [p] = check_remote_code({**LLAMA, "auto_map": {"AutoModelForCausalLM": "modeling_x.X"}})
    assert not p.error and p.field == "auto_map" and "--trust-remote-code" in p.fix


def test_a_missing_tokenizer_or_one_larger_than_the_embedding_is_an_error():
    [p] = check_tokenizer(None, LLAMA)
    assert p.error and p.field == "tokenizer files" and "save_pretrained" in p.fix

    class Tok:
        def __init__(self, n):
            self.n = n

        def __len__(self):
            return self.n

    assert check_tokenizer(Tok(100), LLAMA) == [] and check_tokenizer(Tok(90), LLAMA) == []
    [p] = check_tokenizer(Tok(101), LLAMA)
    assert p.error and "101 ids" in p.what


def test_a_draft_context_shorter_than_the_targets_is_a_warning():
    [p] = check_context_length(LLAMA, {"max_position_embeddings": 8192})
    assert not p.error and "past 128 tokens" in p.what and "8192" in p.fix


def test_the_targets_config_is_read_from_its_folder_and_a_gguf_or_missing_one_is_named(tmp_path):
    make_llama(tmp_path / "target", 100, layers=1)
    config, note = read_target_config(str(tmp_path / "target"))
    assert config["vocab_size"] == 100 and note is None
    gguf = tmp_path / "t.gguf"
    gguf.write_bytes(b"GGUF" + bytes(20))
    config, note = read_target_config(str(gguf))
    assert config is None and "GGUF" in note
    config, note = read_target_config(str(tmp_path / "gone"))
    assert config is None and "not on this machine" in note


def test_engine_problems_of_a_loaded_draft(tmp_path):
    """A draft whose config says tied while its head was changed alone (a merge that untied it in memory) would be
    served with the embedding as its head."""
    draft = make_llama(tmp_path / "draft", 100, layers=1, tie=False)
    assert engine_problems(draft, None, {"vocab_size": 100, "max_position_embeddings": 128}) == [
        EngineProblem(**check_tokenizer(None, LLAMA)[0].as_dict()),
        *check_head_size(draft.config.to_dict())]  # head size 8: a warning for vLLM's CPU build
    draft.config.tie_word_embeddings = True
    draft.config.vocab_size = 100
    fields = [p.field for p in engine_problems(draft, None, {"vocab_size": 120})]
    assert fields == ["vocab_size", "tie_word_embeddings", "tokenizer files", "head_dim"]
    assert json.loads(json.dumps([p.as_dict() for p in engine_problems(draft, None, None)]))  # card-ready
