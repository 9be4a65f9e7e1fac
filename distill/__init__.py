"""Distill draft models against a frozen target for speculative decoding.

From Python (docs/distill.md, "From Python"): ``cfg = distill.compose([...overrides...])``, then
``distill.recipe.train(cfg)`` and ``distill.export.export(checkpoint, out_dir)``. Importing the package registers
the config schema (``distill_schema`` in Hydra's ConfigStore) that conf/config.yaml starts from, so Hydra's own
compose API works on conf/ too, not only ``python -m distill``.
"""
from distill.config import compose

__all__ = ["compose"]
