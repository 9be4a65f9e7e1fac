"""``python -m quickstart``: the whole quickstart (quickstart/run.py), ``python -m quickstart --real`` the main job
on a real pretrained target (quickstart/real.py), or ``python -m quickstart pretrain ...`` to run one pretraining
phase (quickstart/pretrain.py)."""
from __future__ import annotations

import sys

from quickstart import pretrain, real, run


def main(argv: list[str] | None = None) -> int:
    """Dispatch: ``pretrain ARGS`` to :func:`quickstart.pretrain.main`, ``--real ARGS`` to
    :func:`quickstart.real.main`, anything else to :func:`quickstart.run.main` (its arguments are ``key=value``
    settings and flags, never the word ``pretrain``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["pretrain"]:
        pretrain.main(argv[1:])
        return 0
    if "--real" in argv:
        return real.main([a for a in argv if a != "--real"])
    return run.main(argv)


if __name__ == "__main__":
    sys.exit(main())
