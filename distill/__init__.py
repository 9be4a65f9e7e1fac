"""Distill draft models against a frozen target for speculative decoding.

From Python (docs/distill.md, "From Python"): ``cfg = distill.compose([...overrides...])``, then
``distill.recipe.train(cfg)`` and ``distill.export.export(checkpoint, out_dir)``.
"""

# The config schema (distill_schema in Hydra's ConfigStore) that conf/config.yaml starts from: registered on import,
# so Hydra's own compose API works on conf/ too, not only `python -m distill`.
from distill import config as _config  # noqa: E402,F401


def compose(overrides: list[str]):
    """The config ``python -m distill train OVERRIDES`` runs with: ``conf/config.yaml`` composed with Hydra
    overrides (``key=value``, ``+key=value``, ``group=option``; ``+target=PATH_OR_HUB_ID`` too), typed by the
    schema. Raises SetupError (a ValueError) naming an unknown option, key or a wrong type."""
    from distill.__main__ import compose as _compose

    return _compose(overrides)
