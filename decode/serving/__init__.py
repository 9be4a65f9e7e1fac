"""Serving: the OpenAI-compatible HTTP app and its routes (``app``), the work behind them (``handlers``), request
parsing and its 4xx errors (``parsing``), the wire format (``protocol``), the continuous-batching scheduler over the
engine's request API (``scheduler``), Prometheus metrics (``metrics``), the command line (``cli``:
``python -m decode serve``) and a bounded load generator (``loadtest``: ``python -m decode loadtest``).

Needs the ``serve`` extra (fastapi, uvicorn, prometheus-client, httpx); importing this package alone does not:
:func:`check_serve_extra` says which of its modules a command lacks before anything else loads."""
from __future__ import annotations

import importlib

# The serve extra's modules (pyproject.toml, [project.optional-dependencies] serve) that each command imports.
SERVE_EXTRA_MODULES = {"serve": ("fastapi", "uvicorn", "prometheus_client"), "loadtest": ("httpx",)}


def missing_serve_modules(command: str) -> list[str]:
    """The modules of the serve extra that ``python -m decode COMMAND`` (``serve`` or ``loadtest``) imports and that
    cannot be imported here (not installed, or blocked); [] for any other command."""
    missing = []
    for name in SERVE_EXTRA_MODULES.get(command, ()):
        try:
            importlib.import_module(name)
        except ImportError:  # ModuleNotFoundError, or a module set to None in sys.modules
            missing.append(name)
    return missing


def check_serve_extra(command: str) -> None:
    """Raise ModuleNotFoundError naming the missing modules and the install command when ``command`` (``serve`` or
    ``loadtest``) lacks part of the serve extra (:func:`missing_serve_modules`); nothing for other commands."""
    missing = missing_serve_modules(command)
    if missing:
        raise ModuleNotFoundError(
            f"python -m decode {command} needs the serve extra: pip install 'draftkit[serve]' (missing: "
            f"{', '.join(missing)})", name=missing[0])
