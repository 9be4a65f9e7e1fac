"""Distill draft models against a frozen target for speculative decoding."""
