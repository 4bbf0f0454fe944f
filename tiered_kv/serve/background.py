"""The server in a thread of this process, on a free localhost port: for tests, benchmarks and
notebooks that drive it over real HTTP while they keep the model in hand."""

from __future__ import annotations

import socket
import threading
import time


class BackgroundServer:
    """uvicorn serving `make_app(engine, api_key)` on 127.0.0.1 in a daemon thread; `stop()` ends it
    and closes the engine (its store)."""

    def __init__(self, engine, api_key: str | None = None, start_timeout_s: float = 30.0):
        import uvicorn

        from .app import make_app
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.engine = engine
        self._server = uvicorn.Server(uvicorn.Config(make_app(engine, api_key), host="127.0.0.1", port=self.port,
                                                     log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, name="tiered_kv-uvicorn", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + start_timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.engine.close()
                raise RuntimeError(f"the server did not start on 127.0.0.1:{self.port}")
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"
        self.base_url = self.url + "/v1"

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=60)
        self.engine.close()

    def __enter__(self) -> "BackgroundServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
