"""Speculative decoder: lossless draft-then-verify decoding over Hugging Face causal LMs.

    from decode import SpeculativeDecoder
    dec = SpeculativeDecoder(target, draft, num_draft_tokens=4)
    out = dec.generate(input_ids, max_new_tokens=128, temperature=0.0)

    rid = dec.add_request(prompt_ids, max_new_tokens=64, temperature=0.7, seed=0)   # continuous batching
    while dec.has_unfinished():
        for finished in dec.step(): ...
"""
from decode.batch import DecodeState
from decode.engine import SpeculativeDecoder
from decode.metrics import DecodeStats
from decode.requests import GenerationOutput, RequestOutput
from decode.sampling import NonFiniteLogitsError

__all__ = ["SpeculativeDecoder", "GenerationOutput", "DecodeStats", "DecodeState", "RequestOutput",
           "NonFiniteLogitsError"]
