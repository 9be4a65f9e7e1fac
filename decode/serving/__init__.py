"""Serving: the OpenAI-compatible HTTP app and its routes (``app``), the work behind them (``handlers``), request
parsing and its 4xx errors (``parsing``), the wire format (``protocol``), the continuous-batching scheduler over the
engine's request API (``scheduler``), Prometheus metrics (``metrics``), the command line (``cli``:
``python -m decode serve``) and a bounded load generator (``loadtest``: ``python -m decode loadtest``).

Needs the ``serve`` extra (fastapi, uvicorn, prometheus-client, httpx); importing this package alone does not."""
