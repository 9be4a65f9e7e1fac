"""The peer baseline: Hugging Face ``generate`` of the target alone and with ``assistant_model=draft`` (assisted
generation), set up to sample exactly what our decoder samples and timed the same way.

HF reads the assisted-generation settings (``num_assistant_tokens``, its schedule, the confidence threshold) from
the *draft's* ``generation_config``; a fixed-γ run sets them there for the call only (``AssistantSettings``).
"""
from __future__ import annotations

import time
from typing import Any

import torch

from decode.bench.config import BenchConfig, Method
from decode.bench.timing import peak_bytes, reset_peak, sync


class FirstTokenTimer:
    """An HF streamer that only notes when the first new token arrives (HF ``put``s the prompt first)."""

    def __init__(self):
        self.start, self.ttft_s, self._puts = 0.0, None, 0

    def put(self, value) -> None:
        self._puts += 1
        if self._puts == 2 and self.ttft_s is None:
            self.ttft_s = time.perf_counter() - self.start

    def end(self) -> None:
        pass


def hf_generation_config(target, cfg: BenchConfig, temperature: float, eos, pad_id: int):
    """The ``GenerationConfig`` of the HF baseline, set to sample exactly what our decoder samples.

    HF fills every unset (None) field from the checkpoint's ``generation_config`` (which may carry e.g.
    temperature 0.6, top_p 0.9 or a repetition penalty) and then from its global defaults (top_k=50). So every
    logits processor that would change the distribution is set explicitly to neutral: full softmax at
    ``temperature``, greedy at 0. ``eos`` None means never stop early; it becomes ``[]``, since None would be
    filled with the checkpoint's EOS.
    """
    from transformers import GenerationConfig

    gc = GenerationConfig(
        max_new_tokens=cfg.max_new_tokens, min_new_tokens=0, pad_token_id=pad_id,
        eos_token_id=[] if eos is None else eos, do_sample=temperature > 0,
        repetition_penalty=1.0, no_repeat_ngram_size=0, typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0,
    )
    if temperature > 0:
        gc.temperature, gc.top_k, gc.top_p, gc.min_p = float(temperature), 0, 1.0, 0.0
    return gc


class AssistantSettings:
    """Temporarily give the draft fixed-γ assisted-generation settings. HF reads ``num_assistant_tokens``, its
    schedule and ``assistant_confidence_threshold`` from the *assistant's* generation_config (defaults: 20 tokens,
    a dynamic confidence threshold of 0.4 that often stops drafting after one token); setting them on the
    target's config has no effect. ``gamma`` None leaves HF's own settings."""

    KEYS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")

    def __init__(self, draft, gamma: int | None):
        self.config, self.gamma, self.saved = draft.generation_config, gamma, None

    def __enter__(self):
        if self.gamma is not None:
            self.saved = {k: getattr(self.config, k, None) for k in self.KEYS}
            self.config.num_assistant_tokens = self.gamma
            self.config.num_assistant_tokens_schedule = "constant"
            self.config.assistant_confidence_threshold = 0.0

    def __exit__(self, *exc):
        if self.saved is not None:
            for k, v in self.saved.items():
                setattr(self.config, k, v)


def run_hf(target, draft, method: Method, ids: torch.Tensor, mask: torch.Tensor, temperature: float,
           cfg: BenchConfig, eos, pad_id: int, seed: int, device: torch.device, tokenizer=None,
           assistant_tokenizer=None):
    """One timed HF ``generate`` call.

    Args:
        ids, mask: (B, T) left-padded int64 prompt ids and attention mask; B must be 1 for assisted generation
            (an HF limitation). Token ids go in directly, so no tokenizer is needed when the pair shares the
            vocabulary (checked before the run).
        tokenizer, assistant_tokenizer: for a draft of another vocabulary, the target's and the draft's: assisted
            runs then use HF's universal assisted decoding (greedy: the draft re-reads the text in its own tokens;
            sampling: ``UniversalSpeculativeDecodingGenerator``, drafting through the tokens both vocabularies
            share). It prunes ``draft``'s head in place at T > 0: pass a copy (``runs.hf_assistant``).
        eos: int, list of ints, or None (never stop early).
        seed: seeds HF's global generator at T > 0 (HF samples from it).

    Returns:
        (new tokens per row cut after the first EOS, wall seconds, the TTFT timer or None, peak memory bytes).
    """
    generation_config = hf_generation_config(target, cfg, temperature, eos, pad_id)
    ttft = FirstTokenTimer() if ids.shape[0] == 1 else None  # HF streamers take batch size 1 only
    kwargs: dict[str, Any] = {"streamer": ttft} if ttft is not None else {}
    if method.assisted:
        kwargs["assistant_model"] = draft
        if assistant_tokenizer is not None:
            kwargs.update(tokenizer=tokenizer, assistant_tokenizer=assistant_tokenizer)
    if temperature > 0:
        torch.manual_seed(seed)  # HF draws from the global generator
    reset_peak(device)
    sync(device)
    t0 = time.perf_counter()
    if ttft is not None:
        ttft.start = t0
    with AssistantSettings(draft, method.gamma if method.assisted else None):
        seqs = target.generate(input_ids=ids, attention_mask=mask, generation_config=generation_config, **kwargs)
    sync(device)
    wall = time.perf_counter() - t0
    eos_set = set() if eos is None else set(eos) if isinstance(eos, (list, tuple)) else {eos}
    rows = []
    for row in seqs[:, ids.shape[1]:].tolist():
        # Finished rows are padded after EOS; cut at the first EOS like our engine does.
        hit = next((j for j, t in enumerate(row) if t in eos_set), None)
        rows.append(row if hit is None else row[: hit + 1])
    return rows, wall, ttft, peak_bytes(device)
