"""The server's generation side: one TierStore shared by every conversation, a bounded queue of
requests, and one scheduler thread that runs the conversations' forward passes.

A request is the whole conversation (OpenAI clients are stateless). The scheduler renders it with
the chat template and starts a Sequence (decoding.py): a CacheBank on the store that `attach()`es
the longest stored verified prefix (from this conversation's last request, another conversation,
an earlier process); the rest of the prompt is computed in chunks. Up to `max_active` sequences
are generated at once: each tick (ticks.py) is one forward pass (tiered_kv.BankBatch) giving every
decoding conversation its next token, with prompt chunks of at most `prefill_chunk` tokens (while
others decode, as many as cost about one decode pass).
Waiting requests are admitted at the start of every tick, so a first token waits for the tick in
flight and the prompt chunks ahead of it, never for other replies to finish. A request whose
client went away ends before its next forward pass, which frees its bank; the blocks stay in the
store. `batch=False` keeps the engine of earlier releases (one forward pass a request, prompts
first): the baseline bench/serve.py measures against.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
import time

from ..errors import CapacityError
from ..store import TierStore
from . import ticks
from .decoding import Sequence
from .protocol import ChatRequest, RequestError

log = logging.getLogger(__name__)

DEFAULT_PREFILL_CHUNK = 256  # prompt tokens a tick computes (at most one such pass delays the others' next token)


class Job:
    """One request on its way: events ("token", id) ..., then ("done", finish_reason) or ("error",
    RequestError), delivered to the asyncio loop that waits for them."""

    def __init__(self, request: ChatRequest, prompt_ids: list[int], max_new_tokens: int, loop):
        self.request, self.prompt_ids, self.max_new_tokens = request, prompt_ids, max_new_tokens
        self.events: asyncio.Queue = asyncio.Queue()
        self._loop = loop
        self.cancelled = threading.Event()
        self.cached_tokens = 0
        self.completion_ids: list[int] = []

    def emit(self, *event) -> None:
        self._loop.call_soon_threadsafe(self.events.put_nowait, event)

    def cancel(self) -> None:
        self.cancelled.set()


class ChatEngine:
    """One scheduler thread over one store: at most `max_active` requests generated at once, at
    most `max_queue` more waiting for a place."""

    def __init__(self, model, tokenizer, config, model_name: str, max_active: int = 16, max_queue: int = 64,
                 reuse: bool = True, batch: bool = True, prefill_chunk: int = DEFAULT_PREFILL_CHUNK):
        """`reuse=False` re-prefills every request (no attach), `batch=False` runs one forward pass
        a request: the baselines bench/serve.py compares with. `prefill_chunk`: prompt tokens
        computed per tick (batched mode)."""
        if max_active < 1 or max_queue < 1 or prefill_chunk < 1:
            raise ValueError(f"ChatEngine(max_active={max_active}, max_queue={max_queue}, prefill_chunk={prefill_chunk})"
                             ": each must be >= 1")
        self.model, self.tokenizer, self.model_name, self.reuse = model, tokenizer, model_name, reuse
        self.batch, self.prefill_chunk = batch, prefill_chunk
        self.pass_times = ticks.PassTimes()  # what a tick's pass costs: its prompt budget while others decode
        self.max_active = max_active
        self.store = TierStore(config)
        self.max_positions = getattr(model.config, "max_position_embeddings", None)
        eos = model.generation_config.eos_token_id if model.generation_config.eos_token_id is not None \
            else tokenizer.eos_token_id
        self.eos_ids = [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])] if eos is not None else []
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self.running: collections.deque[tuple[Job, Sequence]] = collections.deque()  # being generated, oldest first
        self._open = 0  # sequences whose bank is open
        self._stopping = False
        self._thread = threading.Thread(target=self._schedule, name="tiered_kv-serve", daemon=True)
        self._thread.start()

    @property
    def active(self) -> int:
        """Requests being generated (their banks open)."""
        return self._open

    # ---- the HTTP side ------------------------------------------------------------------------
    def prompt_ids(self, request: ChatRequest) -> list[int]:
        text = self.tokenizer.apply_chat_template(request.messages, tokenize=False, add_generation_prompt=True)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def submit(self, request: ChatRequest, loop) -> Job:
        """Queue the request (RequestError: too long for the model, or the queue is full: 429)."""
        if self._stopping:
            raise RequestError(503, "the server is shutting down", type_="server_error", code="shutting_down")
        ids = self.prompt_ids(request)
        limit = self.max_positions
        max_new = request.max_tokens if request.max_tokens is not None else \
            max(1, min(1024, (limit or len(ids) + 1024) - len(ids)))
        if limit is not None and len(ids) + max_new > limit:
            raise RequestError(400, f"the prompt is {len(ids)} tokens and {max_new} more were asked for, but the model "
                                    f"takes at most {limit}; shorten the conversation or ask for fewer tokens",
                               param="messages", code="context_length_exceeded")
        job = Job(request, ids, max_new, loop)
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise RequestError(429, f"the server is busy: {self._queue.maxsize} requests already wait; retry shortly",
                               type_="rate_limit_error", code="queue_full", headers={"Retry-After": "1"}) from None
        return job

    def close(self) -> None:
        """Stop generating (requests still in flight get a 503 error event) and close the store."""
        self._stopping = True
        try:
            self._queue.put_nowait(None)  # wakes an idle scheduler
        except queue.Full:
            pass
        self._thread.join(timeout=60)
        self.store.close()

    # ---- the scheduler ----------------------------------------------------------------------------
    def _schedule(self) -> None:
        try:
            while not self._stopping:
                self._admit(block=not self.running)
                self._end_cancelled()
                if not self.running:
                    continue
                if self.batch:
                    ticks.batched_tick(self, self.prefill_chunk)
                else:
                    ticks.per_request_tick(self)
        finally:
            self._end_all()

    def _admit(self, block: bool) -> None:
        """Take every waiting request there is room for. Per-request mode starts it now (attach, its
        whole prompt, its first token: prompts first); batched mode attaches it when the tick
        reaches its prompt (ticks.py), so it finds what the prompts before it published."""
        while len(self.running) < self.max_active:
            try:
                job = self._queue.get(timeout=0.5) if block else self._queue.get_nowait()
            except queue.Empty:
                return
            block = False
            if job is None or job.cancelled.is_set():
                continue
            request = job.request
            sequence = self.guarded(job, None, lambda: Sequence(
                self.model, self.store, job.prompt_ids, job.max_new_tokens, self.eos_ids, request.temperature,
                request.top_p, request.seed, request.stop, self.tokenizer, self.reuse))
            if sequence is None:
                continue
            self._open += 1
            self.running.append((job, sequence))
            job.completion_ids = sequence.completion_ids  # one list: the sequence appends, usage counts it
            if not self.batch and self.started(job, sequence):
                token = self.guarded(job, sequence, lambda: sequence.prefill(len(sequence.pending)))
                if token is not None:
                    self.delivered(job, sequence, token)

    def started(self, job: Job, sequence: Sequence) -> bool:
        """Attach the request's stored prefix (the rest of its prompt is pending); False when that failed."""
        if self.guarded(job, sequence, sequence.start) is None:
            return False  # (told and closed)
        job.cached_tokens = sequence.cached_tokens
        return True

    def _end_cancelled(self) -> None:
        for job, sequence in [a for a in self.running if a[0].cancelled.is_set()]:
            self._remove(job, sequence)

    def delivered(self, job: Job, sequence: Sequence, token: int) -> None:
        job.emit("token", token)
        if sequence.finished or job.cancelled.is_set():
            self._remove(job, sequence)
            if not job.cancelled.is_set():
                job.emit("done", sequence.finish_reason)

    def guarded(self, job: Job, sequence: Sequence | None, call):
        """`call()`'s result; None when it failed, the client told why and the sequence closed."""
        try:
            return call()
        except Exception as error:  # noqa: BLE001 - reported to the client (and logged when unexpected)
            self.failed(job, sequence, error)
            return None

    def failed(self, job: Job, sequence: Sequence | None, error: BaseException) -> None:
        """The request ends with `error` (its client is told); its bank is closed."""
        if sequence is not None:
            try:
                self._remove(job, sequence)
            except Exception:  # noqa: BLE001 - the first error is the one to report
                log.exception("closing a failed request's bank failed")
        job.emit("error", self._client_error(error))

    def _remove(self, job: Job, sequence: Sequence) -> None:
        try:
            self.running.remove((job, sequence))
        except ValueError:
            return  # (ended already)
        try:
            sequence.close()
        finally:
            self._open -= 1

    @staticmethod
    def _client_error(error: Exception) -> RequestError:
        if isinstance(error, RequestError):
            return error
        if isinstance(error, CapacityError):
            return RequestError(400, f"the conversation does not fit the KV tiers: {error}", param="messages",
                                code="context_length_exceeded")
        log.error("a chat completion failed", exc_info=error)
        return RequestError(500, f"generation failed: {type(error).__name__}: {error}", type_="server_error",
                            code="internal_error")

    def _end_all(self) -> None:
        """At shutdown: every request in flight or waiting gets an error and its bank is closed."""
        stopped = RequestError(503, "the server shut down before this reply was finished", type_="server_error",
                               code="shutting_down")
        while self.running:
            job, sequence = self.running[0]
            self._remove(job, sequence)
            job.emit("error", stopped)
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                job.emit("error", stopped)

    def health(self) -> dict:
        stats = self.store.stats() if self.store.is_bound else None
        return {"status": "ok", "model": self.model_name, "queued": self._queue.qsize(), "active": self.active,
                "max_active": self.max_active,
                "tiers": None if stats is None else {name: {"used_blocks": t["used_blocks"],
                                                            "capacity_blocks": t["capacity_blocks"]}
                                                     for name, t in stats["tiers"].items()},
                "time": time.time()}
