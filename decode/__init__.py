"""Speculative decoder: lossless draft-then-verify decoding over Hugging Face causal LMs.

    from decode import SpeculativeDecoder
    dec = SpeculativeDecoder(target, draft, num_draft_tokens=4)
    out = dec.generate(input_ids, max_new_tokens=128, temperature=0.0)
"""
from decode.engine import DecodeState, GenerationOutput, SpeculativeDecoder
from decode.metrics import DecodeStats

__all__ = ["SpeculativeDecoder", "GenerationOutput", "DecodeStats", "DecodeState"]
