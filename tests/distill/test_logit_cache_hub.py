"""The target's fingerprint for a hub id served from the local Hugging Face cache: a downloaded update of the
target (refs/main moved to a new snapshot) must not reuse a logit cache or target-generated data made from the old
one. The cache layout and the hub_cache fixture are in tests/conftest.py."""
from __future__ import annotations

import pytest
import torch

from distill.target_data import cache_key, target_data_settings
from decode.loading import target_fingerprint
from distill.logit_cache import FORMAT_VERSION, check_manifest
from distill.config import SetupError
from tests.conftest import put_snapshot, tiny_llama


def test_a_new_revision_of_a_hub_target_changes_its_fingerprint(hub_cache, tmp_path):
    tiny_llama(seed=0, dtype=torch.float32).save_pretrained(tmp_path / "v1")
    tiny_llama(seed=1, dtype=torch.float32).save_pretrained(tmp_path / "v2")
    snap = put_snapshot(hub_cache, "org/target", "a" * 40, tmp_path / "v1")
    old, old_key = target_fingerprint("org/target"), cache_key(target_data_settings("org/target", "float32", [], {}))
    assert old == target_fingerprint(str(snap))  # the snapshot's files are hashed, as for a local folder
    put_snapshot(hub_cache, "org/target", "b" * 40, tmp_path / "v2")
    assert target_fingerprint("org/target") != old
    assert cache_key(target_data_settings("org/target", "float32", [], {})) != old_key  # the target-data cache too
    assert target_fingerprint("org/not-cached") == target_fingerprint("org/not-cached")  # the name only


def test_the_target_fingerprint_reads_every_byte_and_a_hash_of_another_form_is_refused(tmp_path):
    """A target changed in the middle of its weights (a LoRA merged into q/k) is another target. A manifest whose
    target_hash is not of the current form cannot show which target made it: refused, naming the rebuild."""
    folder = tmp_path / "target"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    weights = bytearray(torch.randint(0, 256, (3 << 20,), dtype=torch.uint8).numpy().tobytes())
    (folder / "model.safetensors").write_bytes(weights)
    before = target_fingerprint(str(folder))
    assert before.startswith("2:")
    weights[len(weights) // 2] ^= 1
    (folder / "model.safetensors").write_bytes(weights)
    assert target_fingerprint(str(folder)) != before
    expected = {"target": str(folder), "target_hash": target_fingerprint(str(folder))}
    check_manifest({"format": FORMAT_VERSION, "target": str(folder), "target_hash": expected["target_hash"]},
                   expected, "cache")
    with pytest.raises(SetupError, match=r"target hash '0123456789abcdef'.*rebuild it with python -m distill "
                                         r"cache-logits"):
        check_manifest({"format": FORMAT_VERSION, "target": str(folder), "target_hash": "0123456789abcdef"}, expected,
                       "cache")


def test_a_gguf_target_is_hashed_by_its_bytes(tmp_path):
    """A GGUF file replaced at the same path is another target: caches made from the old one are refused."""
    f = tmp_path / "m" / "model.gguf"
    f.parent.mkdir()
    f.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    first = target_fingerprint(str(f))
    assert first == target_fingerprint(str(f.parent))  # the folder of one GGUF file stands for it
    data = bytearray(f.read_bytes())
    data[8000] ^= 1  # one byte in the middle
    f.write_bytes(bytes(data))
    assert target_fingerprint(str(f)) != first
