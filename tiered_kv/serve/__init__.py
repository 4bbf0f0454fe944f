"""`tiered-kv serve`: an OpenAI-compatible chat server over CacheBank (issue 20).

    engine.py    the shared TierStore, a bounded queue, the scheduler thread and its requests
    ticks.py     what a tick computes: prompt chunks, then every decoding request in one forward pass
    decoding.py  one request's generation: its bank, the tokens it has to compute, token picks
    background.py  the server in a thread of this process (tests, benchmarks)
    app.py       the HTTP side (Starlette, run by uvicorn): routes, streaming, errors
    protocol.py  the request checks, OpenAI's error and response shapes (no torch)

Needs the `[serve]` extra (starlette, uvicorn).
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8000


def model_name_of(model, model_path: str | None) -> str:
    """The name clients send as `model`: the bundled SmolLM2's, or the model folder's / file's name."""
    if model_path is None:
        return "SmolLM2-135M-Instruct"
    return os.path.splitext(os.path.basename(os.path.normpath(model_path)))[0]


def api_key_from_env(name: str | None) -> str | None:
    """The API key held in the environment variable `name` (never the key itself on the command
    line); ValueError when it is unset or empty."""
    if not name:
        return None
    key = os.environ.get(name, "")
    if not key:
        raise ValueError(f"--api-key-env {name!r}: that environment variable is unset or empty; set it to the key "
                         "clients must send, or leave --api-key-env out to serve without one")
    return key


def run_server(model, tokenizer, config, model_name: str, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT,
               api_key: str | None = None, max_active: int = 16, max_queue: int = 64, prefill_chunk: int | None = None,
               batch: bool = True) -> None:
    """Serve until interrupted (uvicorn), then close the store (its blocks stay durable in cold)."""
    import uvicorn

    from .app import make_app
    from .engine import ChatEngine

    from .engine import DEFAULT_PREFILL_CHUNK
    chunk = prefill_chunk if prefill_chunk is not None else DEFAULT_PREFILL_CHUNK
    engine = ChatEngine(model, tokenizer, config, model_name, max_active=max_active, max_queue=max_queue,
                        batch=batch, prefill_chunk=chunk)
    try:
        log.warning("serving %s on http://%s:%d/v1 (%d requests at once%s, queue %d%s)", model_name, host, port,
                    max_active, f" in one forward pass, prompts {chunk} tokens a pass" if batch else ", one at a time",
                    max_queue, ", API key required" if api_key else "")
        uvicorn.run(make_app(engine, api_key), host=host, port=port, log_level="warning")
    finally:
        engine.close()
