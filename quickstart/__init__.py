"""The quickstart: a program that uses the toolkit end to end, kept apart from the ``distill`` library.

    python -m quickstart [--smoke] [key=value ...]   # bootstrap a pair, distill, export, measure (quickstart/run.py)
    python -m quickstart pretrain --size target ...  # one pretraining phase alone (quickstart/pretrain.py)

``distill`` holds the distillation library and its command line; ``decode`` the speculative decoder. This package
only calls them (``distill.corpus``, ``distill.checkpoint``, ``decode.SpeculativeDecoder``), as a user's script would.
"""

INTERRUPTED_EXIT = 130  # exit status of a phase stopped by Ctrl-C / SIGTERM after saving (the shell's for SIGINT)
