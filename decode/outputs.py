"""Output paths checked before the work starts, so a finished run never fails on its last line (shared by the
decode CLIs and, through :func:`distill.config.check_output_file`, by distill's)."""
from __future__ import annotations

import os
from pathlib import Path


def writable(folder: str | os.PathLike) -> bool:
    """True if a file can be created in the existing ``folder`` (tried: ``os.access`` says yes to root everywhere,
    also on read-only mounts and in /proc)."""
    import tempfile

    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".draftkit-write-probe-")
    except OSError:
        return False
    os.close(fd)
    os.unlink(probe)
    return True


def check_output_file(path: str | os.PathLike, key: str, overwrite: bool = False) -> Path:
    """A results file the command will write at the end: its folder must exist and be writable, and an existing
    file is kept unless ``overwrite``.

    Args:
        path: the file to be written.
        key: the option or setting that named it (``--out``, ``eval.out``), used in the message.
        overwrite: the user asked to replace an existing file.

    Returns:
        ``path`` as a ``Path`` (``~`` expanded).

    Raises:
        ValueError: naming ``key`` and the fix (a folder given, a missing or read-only folder, an existing file).
    """
    p = Path(path).expanduser()
    if p.is_dir():
        raise ValueError(f"{key} {str(path)!r} is a folder; give a file name, e.g. {key} {p / 'results.json'}")
    if not p.parent.is_dir():
        raise ValueError(f"{key} {str(path)!r}: folder {str(p.parent)!r} does not exist; create it or choose "
                         "another path")
    if not writable(p.parent):
        raise ValueError(f"{key} {str(path)!r}: folder {str(p.parent)!r} is not writable; choose another path")
    if p.exists() and not overwrite:
        raise ValueError(f"{key} {str(path)!r} exists and would be overwritten; choose a new file or pass "
                         "--overwrite")
    return p
