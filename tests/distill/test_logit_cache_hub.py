"""The target's fingerprint for a hub id served from the local Hugging Face cache: a downloaded update of the
target (refs/main moved to a new snapshot) must not reuse a logit cache or target-generated data made from the old
one. The cache layout and the hub_cache fixture are in tests/conftest.py."""
from __future__ import annotations

import torch

from distill.data import cache_key
from distill.logit_cache import target_fingerprint
from tests.conftest import put_snapshot, tiny_llama


def test_a_new_revision_of_a_hub_target_changes_its_fingerprint(hub_cache, tmp_path):
    tiny_llama(seed=0, dtype=torch.float32).save_pretrained(tmp_path / "v1")
    tiny_llama(seed=1, dtype=torch.float32).save_pretrained(tmp_path / "v2")
    snap = put_snapshot(hub_cache, "org/target", "a" * 40, tmp_path / "v1")
    old, old_key = target_fingerprint("org/target"), cache_key("org/target", [], {})
    assert old == target_fingerprint(str(snap))  # the snapshot's files are hashed, as for a local folder
    put_snapshot(hub_cache, "org/target", "b" * 40, tmp_path / "v2")
    assert target_fingerprint("org/target") != old
    assert cache_key("org/target", [], {}) != old_key  # the target-generated data cache too
    assert target_fingerprint("org/not-cached") == target_fingerprint("org/not-cached")  # the name only
