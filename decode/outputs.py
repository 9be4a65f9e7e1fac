"""Output paths checked before the work starts, so a finished run never fails on its last line (shared by the
decode CLIs and, through :func:`distill.checks.check_output_file`, by distill's), and files and folders written
whole or not at all (shared with distill's checkpoints and run folders)."""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

WRITE_PROBE = ".draftkit-write-probe-"  # the short-lived file of :func:`writable` (another process's check)


def umask() -> int:
    """The process's umask (read by setting it and putting it back): the mode bits a plain ``open()`` or
    ``mkdir`` leaves out, for files that ``tempfile`` or a library made private (0600/0700)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def writable(folder: str | os.PathLike) -> bool:
    """True if a file can be created in the existing ``folder`` (tried: ``os.access`` says yes to root everywhere,
    also on read-only mounts and in /proc)."""
    import tempfile

    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=WRITE_PROBE)
    except OSError:
        return False
    os.close(fd)
    os.unlink(probe)
    return True


def expanded(path: str | os.PathLike, key: str) -> Path:
    """``path`` with ``~`` expanded; ValueError naming ``key`` where it cannot be (``~name`` of no user, no home)."""
    try:
        return Path(path).expanduser()
    except RuntimeError:
        raise ValueError(f"{key} {str(path)!r}: '~' cannot be expanded here (no such user, or no home folder); "
                         "give the full path") from None


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
    p = expanded(path, key)
    if p.is_dir():
        raise ValueError(f"{key} {str(path)!r} is a folder; give a file name, e.g. {key} {p / 'results.json'}")
    if not p.parent.is_dir():
        above = next((f for f in p.parents if f.exists()), None)  # the nearest existing path above the file
        if above is not None and not above.is_dir():
            raise ValueError(f"{key} {str(path)!r}: {str(above)!r} is a file, not a folder; choose another path")
        raise ValueError(f"{key} {str(path)!r}: folder {str(p.parent)!r} does not exist; create it or choose "
                         "another path")
    if not writable(p.parent):
        raise ValueError(f"{key} {str(path)!r}: folder {str(p.parent)!r} is not writable; choose another path")
    if p.exists() and not overwrite:
        raise ValueError(f"{key} {str(path)!r} exists and would be overwritten; choose a new file or pass "
                         "--overwrite")
    return p


def check_output_dir(path: str | os.PathLike, key: str) -> Path:
    """A folder the command creates (with its parents) or writes into: it must not be a file, nor lie under one or
    under a dangling symlink, and its nearest existing parent must be writable.

    Raises:
        ValueError: naming ``key`` and the fix.
    """
    p = expanded(path, key)
    if p.exists() and not p.is_dir():
        raise ValueError(f"{key}={str(path)!r} is a file, not a folder; choose a folder path")
    parent = p
    while not parent.exists() and not parent.is_symlink():
        parent = parent.parent
    if parent.is_symlink() and not parent.exists():
        raise ValueError(f"{key}={str(path)!r}: {str(parent)!r} is a symlink to {os.readlink(parent)!r}, which does "
                         "not exist; create its target or choose another folder")
    if not parent.is_dir():
        raise ValueError(f"{key}={str(path)!r} lies under {str(parent)!r}, which is a file; choose a folder path")
    if not writable(parent):
        raise ValueError(f"{key}={str(path)!r}: {str(parent)!r} is not writable; choose another folder")
    return p


def write_new_file(text: str, out: Path, overwrite: bool = False) -> Path:
    """Write ``text`` to ``out`` through a uniquely named temporary file in its folder, so ``out`` appears whole or
    not at all and no other file is touched. Without ``overwrite`` an ``out`` that exists by then (made while the
    command ran) is kept, and ``text`` stays in the temporary file.

    Returns:
        the path that holds ``text``: ``out``, or the temporary file when ``out`` was kept.

    Raises:
        ValueError: the file system refused the write (a full disk, a quota); no partial file is left.
    """
    import tempfile

    fd, name = tempfile.mkstemp(dir=out.parent, prefix=f"{out.stem}-", suffix=out.suffix or ".tmp")
    tmp = Path(name)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o666 & ~umask())  # mkstemp makes it private; give it the mode a plain open() would
        if overwrite:
            os.replace(tmp, out)
            return out
        try:
            os.link(tmp, out)  # atomic, and fails rather than replace a file made meanwhile
        except FileExistsError:
            return tmp
        except OSError:  # a filesystem without hard links
            if out.exists():
                return tmp
            os.replace(tmp, out)
            return out
        tmp.unlink()
        return out
    except OSError as err:  # a full disk or a quota: say so (exit 2 in the CLIs), leave no partial file
        tmp.unlink(missing_ok=True)
        raise ValueError(f"could not write {out} ({err}); nothing was written there. Free space on that disk (or "
                         "choose another path) and run the command again") from err
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_results(text: str, out: str | os.PathLike, overwrite: bool = False, key: str = "--out") -> Path:
    """Write a results file (checked before the work: :func:`check_output_file`) with :func:`write_new_file`: whole
    or not at all; one made meanwhile by someone else is kept (without ``overwrite``) and ``text`` goes beside it,
    which a warning naming ``key`` says. Returns the path that holds ``text``. Raises ValueError (full disk)."""
    path = Path(out).expanduser()
    written = write_new_file(text, path, overwrite)
    if written != path:
        print(f"warning: {key} {str(path)!r} appeared during the run and was kept; the results are in "
              f"{str(written)!r}", file=sys.stderr)
    return written


def replace_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all: into ``path.tmp``, then renamed over ``path``. A kill or a
    full disk mid-write leaves the previous file (or none), never a cut one that reads as damaged; a ``.tmp`` whose
    write failed is removed. A file that is replaced keeps its permissions. Raises what the file system raises."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text)
        if path.exists():
            os.chmod(tmp, path.stat().st_mode & 0o777)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)


def write_json(path: Path, obj: Any) -> None:
    """``obj`` as indented JSON, written whole or not at all (:func:`replace_text`; raises TypeError for anything
    JSON cannot hold: state must be plain data)."""
    replace_text(path, json.dumps(obj, indent=2, allow_nan=True))


def replace_dir(tmp: Path, path: Path) -> None:
    """Move the finished ``tmp`` to ``path``; an existing ``path`` is moved aside first and deleted last, so a
    crash at any point leaves a complete copy under ``path``, ``path.old`` or ``tmp``."""
    old = path.with_name(path.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if path.exists():
        path.rename(old)
    tmp.rename(path)
    if old.exists():
        shutil.rmtree(old)
