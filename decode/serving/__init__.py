"""Serving: the OpenAI-compatible HTTP app (``app``), its wire format (``protocol``), the continuous-batching
scheduler over the engine's request API (``scheduler``), Prometheus metrics (``metrics``), the command line
(``cli``: ``python -m decode serve``) and a bounded load generator (``loadtest``: ``python -m decode loadtest``).

Needs the ``serve`` extra (fastapi, uvicorn, prometheus-client); importing this package alone does not."""
