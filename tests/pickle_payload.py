"""A crafted pickle for the "files are data" tests (tests/distill/test_checkpoint.py,
tests/quickstart/test_pretrain_snapshot.py): unpickling it creates a marker file, so a test can prove that a loader
refused the file without running its payload."""
import json

import torch

from distill.checkpoint import write_manifest


class Payload:
    """Unpickling this opens (creates) the marker file: a harmless stand-in for os.system."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def plant(path, marker):
    """Replace ``path`` by a torch.save pickle whose unpickling creates ``marker``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    torch.save({"state": Payload(marker)}, path)


def fix_manifest(folder):
    """Record the tampered sizes, as a crafted checkpoint or snapshot would (so the loader really parses each file)."""
    try:
        step = json.loads((folder / "manifest.json").read_text())["step"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return  # the manifest itself was replaced
    (folder / "manifest.json").unlink()
    write_manifest(folder, step)
