"""What vLLM's ``draft_model`` speculation and SGLang's STANDALONE algorithm would reject in an exported draft.

Both engines build the draft from its ``config.json`` with their own model class (``architectures``), an lm_head of
``config.vocab_size`` rows (tied to the input embedding when ``tie_word_embeddings`` is true), and the target's
tokenizer, dtype and ``--trust-remote-code``. vLLM then requires the draft's ``vocab_size`` to equal the target's
(``SpeculativeConfig.verify_equal_vocab_size_if_draft_model``) and stops drafting for a sequence past the draft's
``max_position_embeddings``. Each check below is a small function of the draft's config (a dict) and, where needed,
its head and embedding tensors or the target's config, and returns :class:`EngineProblem` entries: an error makes
the draft unservable there (``distill export`` refuses it unless ``--draftkit-only``), a warning is printed and
recorded in the card.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from decode.gguf import find_gguf
from decode.loading import local_folder
from decode.vllm_env import VLLM_CPU_HEAD_SIZES, config_vocab_size, head_size

ENGINES = "vLLM (draft_model) and SGLang (STANDALONE)"

# Architectures a small draft of this toolkit is usually built as, each in vLLM's registry
# (vllm/model_executor/models/registry.py: _TEXT_GENERATION_MODELS, or _TRANSFORMERS_SUPPORTED_MODELS for the
# GPT-NeoX, GPTBigCode and OLMo ones). Another architecture may still be served (the registry is long, and vLLM
# falls back to its transformers backend), so it is only a warning.
KNOWN_ARCHITECTURES = frozenset({
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM", "GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM",
    "GraniteForCausalLM", "OlmoeForCausalLM", "StableLmForCausalLM", "GPTJForCausalLM", "OPTForCausalLM",
    "FalconForCausalLM", "BloomForCausalLM", "InternLM2ForCausalLM", "MixtralForCausalLM", "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM", "Glm4ForCausalLM", "CohereForCausalLM", "ExaoneForCausalLM", "MiniCPMForCausalLM",
    "Lfm2ForCausalLM", "GPT2LMHeadModel", "GPTNeoXForCausalLM", "GPTBigCodeForCausalLM", "OlmoForCausalLM",
    "Olmo2ForCausalLM",
})


@dataclass(frozen=True)
class EngineProblem:
    """One thing an engine would do with the draft that it should not: the config field (or file) at fault, what
    the engine does with it, and how to fix it. ``error``: the engine refuses it or serves another draft."""

    field: str
    what: str
    fix: str
    error: bool = True

    def __str__(self) -> str:
        return f"{'error' if self.error else 'warning'}: {ENGINES}: {self.field}: {self.what}; fix: {self.fix}"

    def as_dict(self) -> dict:
        return asdict(self)


def check_vocab_size(draft_config: dict, target_config: dict | None,
                     cross_vocab: bool = False) -> list[EngineProblem]:
    """The draft's ``vocab_size`` must equal the target's (vLLM raises otherwise), unless the draft has a tokenizer
    of its own (``cross_vocab``): vLLM then serves it with ``use_heterogeneous_vocab`` (its token-level
    intersection, ``vllm/v1/spec_decode/vocab_mapping.py``, greedy draft sampling only), a note."""
    if target_config is None:
        return []
    draft, target = draft_config.get("vocab_size"), config_vocab_size(target_config)
    if target is None or draft == target:
        return []
    if cross_vocab:
        return [EngineProblem(
            "vocab_size", f"the draft's is {draft}, the target's {target} (the draft has a tokenizer of its own): "
            "vLLM serves it only with use_heterogeneous_vocab true in --speculative-config (its token-level "
            "intersection, greedy draft sampling only; not run by draftkit), SGLang not at all",
            "serve it with the card's vLLM line or draftkit's decoder", error=False)]
    return [EngineProblem(
        "vocab_size", f"the draft's is {draft}, the target's {target}: vLLM raises 'Target and draft model should "
        "have the same vocabulary size' (verify_equal_vocab_size_if_draft_model)",
        "train the draft with the target's tokenizer and vocabulary (draft.vocab_size set to the target's), or "
        "serve it with draftkit's decoder (--draftkit-only)")]


def check_head_rows(draft_config: dict, head_rows: int) -> list[EngineProblem]:
    """The lm_head must have ``config.vocab_size`` rows: the engines build it so and fail to load a smaller one."""
    if head_rows == draft_config.get("vocab_size"):
        return []
    pruned = draft_config.get("draft_vocab_map_size") is not None
    return [EngineProblem(
        "lm_head", f"{head_rows} rows, config.vocab_size {draft_config.get('vocab_size')}: the engines build a "
        f"{draft_config.get('vocab_size')}-row head and fail to load this one"
        + (" (a vocabulary-pruned head: they do not read its draft_vocab_map)" if pruned else ""),
        "pass --full-vocab to expand the pruned head to the target's vocabulary" if pruned
        else "export a draft whose head covers config.vocab_size")]


def check_tied_head(draft_config: dict, head: torch.Tensor, embedding: torch.Tensor) -> list[EngineProblem]:
    """With ``tie_word_embeddings`` true the engines use the input embedding as the head and ignore the saved head:
    a head that differs from the embedding would be replaced, serving another draft."""
    if not draft_config.get("tie_word_embeddings", True):
        return []
    if head.shape == embedding.shape and torch.equal(head, embedding):
        return []
    return [EngineProblem(
        "tie_word_embeddings", "true while the saved lm_head differs from the input embedding: the engines tie "
        "the head to the embedding and serve another draft than the one measured",
        "set tie_word_embeddings to false in the draft's config before export (draft.config.tie_word_embeddings = "
        "False), so the trained head is saved and read as its own weight")]


def check_architectures(draft_config: dict) -> list[EngineProblem]:
    """``architectures`` picks the engine's model class: missing or empty is an error, an unfamiliar one a
    warning."""
    archs = draft_config.get("architectures")
    if not archs:
        return [EngineProblem(
            "architectures", "missing or empty: the engines cannot tell which model class to build",
            "set config.architectures to the draft's class, e.g. [\"LlamaForCausalLM\"] (save the draft with "
            "transformers' save_pretrained, which writes it)")]
    unknown = [a for a in archs if a not in KNOWN_ARCHITECTURES]
    if not unknown:
        return []
    return [EngineProblem(
        "architectures", f"{unknown} is not among the text-generation architectures checked here: vLLM serves it "
        "only if its registry has it or its transformers backend can run it",
        "check vLLM's supported-models list (or run python -m decode vllm-check on the export)", error=False)]


def check_quantization(draft_config: dict) -> list[EngineProblem]:
    """A ``quantization_config`` makes the engines load the weights as that quantization; an export holds plain
    weights."""
    if not draft_config.get("quantization_config"):
        return []
    method = (draft_config["quantization_config"] or {}).get("quant_method", "?")
    return [EngineProblem(
        "quantization_config", f"left in the config ({method}) while the exported weights are plain tensors: the "
        "engines load them as quantized and fail or serve garbage",
        "export from the unquantized draft (load it without quantization), or remove quantization_config from its "
        "config.json")]


def check_remote_code(draft_config: dict) -> list[EngineProblem]:
    """``auto_map``: the draft names its own Python code, which vLLM runs only with the target's
    ``--trust-remote-code``."""
    if not draft_config.get("auto_map"):
        return []
    return [EngineProblem(
        "auto_map", "the draft names its own modeling code: vLLM loads it only when the server runs with "
        "--trust-remote-code (the target's setting is the draft's)",
        "add --trust-remote-code to the vllm serve line after reading that code", error=False)]


def check_tokenizer(tokenizer: Any, draft_config: dict) -> list[EngineProblem]:
    """The export ships a tokenizer (the card's transformers snippet loads it; vLLM and SGLang use the target's),
    and it must not give ids past the draft's embedding."""
    if tokenizer is None:
        return [EngineProblem(
            "tokenizer files", "none found with the draft: the export would ship no tokenizer",
            "save the target's tokenizer into the draft's folder (tokenizer.save_pretrained(FOLDER)) and export "
            "again")]
    size, vocab = len(tokenizer), draft_config.get("vocab_size")
    if vocab is not None and size > vocab:
        return [EngineProblem(
            "vocab_size", f"the tokenizer has {size} ids, the draft's embedding {vocab} rows: ids past {vocab - 1} "
            "index outside the draft", "train the draft with the target's tokenizer and a vocab_size that covers it")]
    return []


def check_context_length(draft_config: dict, target_config: dict | None) -> list[EngineProblem]:
    """vLLM stops drafting for a sequence longer than the draft's ``max_position_embeddings``."""
    if target_config is None:
        return []
    draft = draft_config.get("max_position_embeddings")
    target = target_config.get("max_position_embeddings") or (target_config.get("text_config") or {}).get(
        "max_position_embeddings")
    if draft is None or target is None or draft >= target:
        return []
    return [EngineProblem(
        "max_position_embeddings", f"the draft's is {draft}, the target's {target}: vLLM drafts nothing for a "
        f"sequence past {draft} tokens", f"raise the draft's max_position_embeddings to {target} if its position "
        "encoding extends that far (rotary does), or keep requests shorter", error=False)]


def check_head_size(draft_config: dict) -> list[EngineProblem]:
    """vLLM's CPU build refuses an attention head size outside :data:`decode.vllm_env.VLLM_CPU_HEAD_SIZES` at its
    first forward ("Unsupported CPU attention configuration"); its GPU backends take more sizes."""
    size = head_size(draft_config)
    if size is None or size in VLLM_CPU_HEAD_SIZES:
        return []
    return [EngineProblem(
        "head_dim", f"the draft's attention head size is {size}; vLLM's CPU build runs only "
        f"{', '.join(map(str, VLLM_CPU_HEAD_SIZES))} (its GPU backends take more)",
        "serve it on a GPU, or build the draft with hidden_size / num_attention_heads in that list", error=False)]


def read_target_config(target: str) -> tuple[dict | None, str | None]:
    """The target's ``config.json`` (a local folder, or a hub id in the local cache) and a note when it is not
    read: a GGUF file (its metadata is not read here) or a target not on this machine."""
    if find_gguf(target) is not None:
        return None, (f"the target {target} is a GGUF file: its vocabulary is not compared here; serve the export "
                      "beside the Hugging Face folder the GGUF was made from")
    folder = local_folder(target)
    path = Path(folder) / "config.json" if folder else None
    if path is None or not path.is_file():
        return None, f"the target {target} is not on this machine: its config was not compared with the draft's"
    try:
        return json.loads(path.read_text()), None
    except (OSError, ValueError) as err:
        return None, f"the target's {path} could not be read ({err}): it was not compared with the draft's"


def engine_problems(draft: Any, tokenizer: Any, target_config: dict | None,
                    cross_vocab: bool = False) -> list[EngineProblem]:
    """Every :class:`EngineProblem` of a loaded draft (a transformers causal LM) with its tokenizer against the
    target's config dict (None: the checks that need it are skipped). ``cross_vocab``: the draft has a tokenizer
    of its own (:func:`check_vocab_size`)."""
    config = draft.config.to_dict()
    head = draft.get_output_embeddings().weight.detach()
    embedding = draft.get_input_embeddings().weight.detach()
    return [*check_architectures(config), *check_vocab_size(config, target_config, cross_vocab),
            *check_head_rows(config, int(head.shape[0])), *check_tied_head(config, head, embedding),
            *check_quantization(config), *check_remote_code(config), *check_tokenizer(tokenizer, config),
            *check_context_length(config, target_config), *check_head_size(config)]
