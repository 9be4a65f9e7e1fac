"""Distill draft models against a frozen target for speculative decoding."""

# The config schema (distill_schema in Hydra's ConfigStore) that conf/config.yaml starts from: registered on import,
# so Hydra's own compose API works on conf/ too, not only `python -m distill`.
from distill import config as _config  # noqa: E402,F401
