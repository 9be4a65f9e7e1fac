"""``torch.compile`` for the decoder: the compiled forward it calls, the ``compile`` setting's check, and the check
that inductor can build CPU code here (done by the command lines and the quickstart before any model loads).

The decoder compiles each model's ``forward`` from outside (``torch.compile(model.forward, dynamic=True)``; the
models are not modified), as gpt-fast compiles its decode step (CUDA graphs on GPU).
"""
from __future__ import annotations

from typing import Any, Callable

import torch


def _standard_strides(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy of it with the row-major strides of its shape when its own differ (also in size-1 dims)."""
    stride, expected = t.stride(), []
    n = 1
    for size in reversed(t.shape):
        expected.append(n)
        n *= size
    return t if stride == tuple(reversed(expected)) else t.clone(memory_format=torch.contiguous_format)


def compiled_forward(model: Any) -> Callable:
    """``torch.compile(model.forward, dynamic=True)``, called under a raised recompile limit: target and draft
    share one code object (``forward`` of their class), so dynamo's per-code cache holds the entries of both
    models and of each cache width/γ, and the default limit of 8 sent the engine back to eager. Tensor arguments
    are passed with the standard strides of their shape: dynamo guards on strides, and slices (the draft's pending
    input) recompiled it. ``contiguous()`` is not enough: it keeps a size-1 dimension's stride (a ``(1, 1)`` slice
    of a ``(1, 2)`` tensor keeps strides ``(2, 1)``), which cost one more graph per shape class."""
    fn = torch.compile(model.forward, dynamic=True)

    def call(**kwargs: Any) -> Any:
        kwargs = {k: _standard_strides(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        with torch._dynamo.config.patch(recompile_limit=64, accumulated_recompile_limit=512):
            return fn(**kwargs)

    return call


def cpu_compiler_problem() -> str | None:
    """Why ``torch.compile`` cannot build CPU code on this machine, or None: inductor's CPU backend compiles C++ with
    the compiler of ``torch._inductor.config.cpp.cxx`` (``$CXX``, else ``g++``), found by the function inductor
    itself uses (``torch._inductor.cpp_builder.get_cpp_compiler``: runs ``<cxx> --version``). Callers check it
    before loading models, so a missing compiler is not found after minutes of work. None also when this torch has
    no such function (nothing to check)."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler
    except ImportError:
        return None
    try:
        get_cpp_compiler()
    except Exception as err:  # noqa: BLE001 - InvalidCxxCompiler and whatever a broken toolchain raises
        return f"{type(err).__name__}: {err}".strip()
    return None


def check_cpu_compiler(setting: str, instead: str) -> None:
    """Raise ValueError naming ``setting`` (e.g. ``--compile``) and the fixes, ``instead`` the last of them (e.g.
    ``drop --compile``), when torch.compile cannot build CPU code here (:func:`cpu_compiler_problem`)."""
    problem = cpu_compiler_problem()
    if problem:
        raise ValueError(f"{setting}: torch.compile needs a working C++ compiler on CPU ($CXX, else g++) and found "
                         f"none ({problem}); install one (e.g. apt install g++), point CXX at one, or {instead}")


def compile_setting(flag: str | None) -> bool | str:
    """The ``compile`` value of a command line's ``--compile [both|draft]`` (absent: None): False, True or
    ``"draft"``."""
    return {None: False, "both": True, "draft": "draft"}[flag]


def check_compile(compile: Any, has_draft: bool = True) -> bool | str:
    """``SpeculativeDecoder(compile=...)`` checked: False, True (both models' forwards) or ``"draft"`` (the draft's
    only); look-alikes such as 1 or 0 are refused. Returns the value. Raises ValueError naming the setting, also
    for ``"draft"`` when ``has_draft`` is False (the bench checks its config with it before loading models)."""
    if not (isinstance(compile, bool) or (isinstance(compile, str) and compile == "draft")):
        raise ValueError(f"compile must be False, True (both models) or 'draft' (the draft's forwards only), got "
                         f"{compile!r}")
    if compile == "draft" and not has_draft:
        raise ValueError("compile='draft' compiles the draft's forwards, but draft is None: pass a draft, or "
                         "compile=True to compile the target")
    return compile
