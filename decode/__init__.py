"""Speculative decoder: lossless draft-then-verify decoding over Hugging Face causal LMs."""
