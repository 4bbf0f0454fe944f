"""The stream worker: fetches a hooked step's lower-tier K/V one layer ahead (reads.py).

One thread per store (shared by its banks; each bank keeps at most two fetches in flight, one
per stream buffer). On CUDA each fetch runs on the worker's own side stream: it first waits for
an event recorded on the compute stream when the fetch was asked for (the buffer's previous
reader and every earlier write of the hot blocks are done), and hands back an event the compute
stream waits on before attention reads the buffer. On CPU the copies simply run in the thread;
file reads, checksums and large copies release the GIL, so they overlap the model's compute.
A fetch reads through the step's lease, never under the store's lock. The store owns the worker
(one per store, shared by its banks) and joins it at close.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch


class StreamWorker:
    def __init__(self, device: torch.device):
        self.device = device
        # (no torch.set_num_threads(1) here: besides OpenMP's per-thread count it sets MKL's,
        # which is process-wide, and would change the model's own GEMMs)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tiered-kv-stream")
        self._stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None

    @property
    def kind(self) -> str:
        return "cuda side stream" if self._stream is not None else "thread"

    def submit(self, fill, *args) -> Future:
        """Run `fill(*args)` on the worker; the future's result is what `wait_ready` takes."""
        asked = None
        if self._stream is not None:
            asked = torch.cuda.Event()
            asked.record(torch.cuda.current_stream(self.device))
        return self._pool.submit(self._run, fill, args, asked)

    def _run(self, fill, args, asked):
        if self._stream is None:
            fill(*args)
            return None
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(asked)
            fill(*args)
            done = torch.cuda.Event()
            done.record(self._stream)
        return done

    def wait_ready(self, done) -> None:
        """Order the compute stream after a finished fetch's copies (nothing to do on CPU)."""
        if done is not None:
            torch.cuda.current_stream(self.device).wait_event(done)

    def close(self) -> None:
        """Stop the worker, waiting for a fetch that runs (unless called from the worker itself)."""
        on_worker = threading.current_thread().name.startswith("tiered-kv-stream")
        self._pool.shutdown(wait=not on_worker)
