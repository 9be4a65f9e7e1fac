"""HTTP server over the speculative decoder (FastAPI + uvicorn). No algorithm logic lives here.

Endpoints:
- ``GET /health`` -> ``{"status": "ok", "target": ..., "draft": ..., "num_draft_tokens": ...}``
- ``POST /generate`` with JSON ``{"prompt": str | "input_ids": [int], "max_new_tokens": int, "temperature": float,
  "top_k": int|null, "top_p": float|null, "num_draft_tokens": int|"auto"|null, "seed": int|null}`` ->
  ``{"text", "token_ids", "finish_reason", "stats"}``
- ``GET /metrics`` -> decoder statistics pooled over every request served so far.

Bad requests get HTTP 400/422 with a message naming the problem; the server keeps running.
"""
# No `from __future__ import annotations`: FastAPI must see the request model class itself, not a string.

import argparse
import threading
from typing import Any

import torch

from decode.engine import SpeculativeDecoder
from decode.metrics import DecodeStats


def create_app(decoder: SpeculativeDecoder, tokenizer: Any, names: dict | None = None):
    """Build the FastAPI app serving ``decoder``. Requests are served one at a time (one model copy)."""
    from fastapi import FastAPI, HTTPException
    from pydantic import BaseModel, Field, model_validator

    class GenerateRequest(BaseModel):
        prompt: str | None = None
        input_ids: list[int] | None = None
        max_new_tokens: int = Field(128, ge=1, le=1 << 16)
        temperature: float = Field(0.0, ge=0.0)
        top_k: int | None = Field(None, ge=1)
        top_p: float | None = Field(None, gt=0.0, le=1.0)
        num_draft_tokens: int | str | None = None
        seed: int | None = None

        @model_validator(mode="after")
        def one_prompt(self):
            if (self.prompt is None) == (self.input_ids is None):
                raise ValueError("give exactly one of 'prompt' (text) or 'input_ids' (token ids)")
            return self

    app = FastAPI(title="draftkit speculative decoder")
    lock = threading.Lock()
    pooled: list[DecodeStats] = []
    names = names or {}

    @app.get("/health")
    def health():
        return {"status": "ok", **names, "num_draft_tokens": decoder.num_draft_tokens}

    @app.get("/metrics")
    def metrics():
        return DecodeStats.merge(pooled).to_dict()

    @app.post("/generate")
    def generate(req: GenerateRequest):
        ids = req.input_ids if req.input_ids is not None else tokenizer(req.prompt)["input_ids"]
        if not ids:
            raise HTTPException(400, "the prompt encodes to no tokens; send a non-empty prompt")
        device = decoder.target.device
        generator = torch.Generator(device=device)
        if req.seed is not None:
            generator.manual_seed(req.seed)
        else:
            generator.seed()
        eos = getattr(tokenizer, "eos_token_id", None)
        try:
            with lock:
                out = decoder.generate([ids], max_new_tokens=req.max_new_tokens, temperature=req.temperature,
                                       top_k=req.top_k, top_p=req.top_p, eos_token_id=eos, generator=generator,
                                       num_draft_tokens=req.num_draft_tokens)
        except ValueError as err:
            raise HTTPException(400, str(err)) from err
        pooled.append(out.stats)
        new = out.new_tokens[0].tolist()
        finish = "stop" if new and eos is not None and new[-1] == eos else "length"
        return {"text": tokenizer.decode(new, skip_special_tokens=True), "token_ids": new, "finish_reason": finish,
                "stats": out.stats.to_dict()}

    return app


def main(argv: list[str] | None = None) -> int:
    """``python -m decode serve --target PATH [--draft PATH] [--host 127.0.0.1 --port 8000]``."""
    p = argparse.ArgumentParser(prog="python -m decode serve", description="Serve the speculative decoder over HTTP.")
    p.add_argument("--target", required=True)
    p.add_argument("--draft", default=None)
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--num-draft-tokens", "-g", default="4", help="γ or 'auto'")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--trust-remote-code", action="store_true",
                   help="allow checkpoints to run their own Python modeling/tokenizer code (off by default)")
    args = p.parse_args(argv)
    import uvicorn

    from decode.loading import check_device, load_causal_lm, load_draft_tokenizer, load_tokenizer

    device = check_device(args.device)
    trust = args.trust_remote_code
    target = load_causal_lm(args.target, "target", args.dtype, device, trust)
    tok = load_tokenizer(args.tokenizer or args.target, trust_remote_code=trust)
    draft = load_causal_lm(args.draft, "draft", args.dtype, device, trust) if args.draft else None
    draft_tok = load_draft_tokenizer(args.draft, tok, trust) if args.draft else None
    gamma: int | str = args.num_draft_tokens if args.num_draft_tokens == "auto" else int(args.num_draft_tokens)
    dec = SpeculativeDecoder(target, draft, gamma if draft is not None else 0, tokenizer=tok, draft_tokenizer=draft_tok)
    app = create_app(dec, tok, {"target": args.target, "draft": args.draft})
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0
