"""``python -m decode.bench ...``: the same command as ``python -m decode bench ...``."""
import sys

from decode.bench.cli import main

sys.exit(main())
