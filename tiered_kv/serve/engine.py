"""The server's generation side: one TierStore shared by every conversation, a bounded queue of
requests and a fixed pool of worker threads that run them.

A request is the whole conversation (OpenAI clients are stateless). A worker renders it with the
chat template, opens a CacheBank on the store, `attach()`es the longest stored verified prefix
(from this conversation's last request, another conversation, an earlier process) and runs
`model.generate(cache=bank)` over the rest, exactly as a local greedy generate over the same
template would; the bank is closed after the request, its blocks staying in the store. Tokens go
to the request's event queue as they come (the HTTP side streams them); a request whose client
went away is cancelled between two tokens, which ends its step and frees its bank.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time

import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from ..bank import CacheBank
from ..errors import CapacityError
from ..store import TierStore
from .protocol import ChatRequest, RequestError

log = logging.getLogger(__name__)


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


class _TokenStreamer(BaseStreamer):
    """generate()'s streamer: its first put() is the prompt, each later one a new token."""

    def __init__(self, job: Job):
        self.job, self._prompt_seen = job, False

    def put(self, value) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        for token in value.reshape(-1).tolist():
            self.job.completion_ids.append(int(token))
            self.job.emit("token", int(token))

    def end(self) -> None:
        pass


class _Cancelled(StoppingCriteria):
    def __init__(self, job: Job):
        self.job = job

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), self.job.cancelled.is_set(), dtype=torch.bool)


class ChatEngine:
    """`workers` generation threads over one store; at most `max_queue` requests wait for one."""

    def __init__(self, model, tokenizer, config, model_name: str, workers: int = 2, max_queue: int = 64,
                 reuse: bool = True):
        """`reuse=False` re-prefills every request (no attach): the baseline bench/serve.py compares with."""
        self.model, self.tokenizer, self.model_name, self.reuse = model, tokenizer, model_name, reuse
        self.store = TierStore(config)
        self.device = next(model.parameters()).device
        self.max_positions = getattr(model.config, "max_position_embeddings", None)
        eos = model.generation_config.eos_token_id if model.generation_config.eos_token_id is not None \
            else tokenizer.eos_token_id
        self.eos_ids = [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])] if eos is not None else []
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._seed_lock = threading.Lock()  # a seeded sampled request seeds torch's global generator
        self._stopping = False
        self.active = 0
        self._threads = [threading.Thread(target=self._work, name=f"tiered_kv-serve-{i}", daemon=True)
                         for i in range(workers)]
        for thread in self._threads:
            thread.start()

    # ---- the HTTP side ------------------------------------------------------------------------
    def prompt_ids(self, request: ChatRequest) -> list[int]:
        text = self.tokenizer.apply_chat_template(request.messages, tokenize=False, add_generation_prompt=True)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def submit(self, request: ChatRequest, loop) -> Job:
        """Queue the request (RequestError: too long for the model, or the queue is full: 429)."""
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
        self._stopping = True
        for _ in self._threads:
            try:
                self._queue.put_nowait(None)
            except queue.Full:
                pass
        for thread in self._threads:
            thread.join(timeout=30)
        self.store.close()

    # ---- the workers ----------------------------------------------------------------------------
    def _work(self) -> None:
        while not self._stopping:
            job = self._queue.get()
            if job is None:
                return
            if job.cancelled.is_set():
                continue
            self.active += 1
            try:
                self._run(job)
            except RequestError as error:
                job.emit("error", error)
            except CapacityError as error:
                job.emit("error", RequestError(400, f"the conversation does not fit the KV tiers: {error}",
                                               param="messages", code="context_length_exceeded"))
            except Exception as error:  # noqa: BLE001 - reported to the client, logged here
                log.exception("a chat completion failed")
                job.emit("error", RequestError(500, f"generation failed: {type(error).__name__}: {error}",
                                               type_="server_error", code="internal_error"))
            finally:
                self.active -= 1

    def _run(self, job: Job) -> None:
        request = job.request
        bank = CacheBank(self.model, store=self.store)
        try:
            ids = torch.tensor([job.prompt_ids], device=self.device)
            job.cached_tokens = bank.attach(ids) if self.reuse else 0
            kwargs = dict(max_new_tokens=job.max_new_tokens, attention_mask=torch.ones_like(ids),
                          streamer=_TokenStreamer(job), stopping_criteria=StoppingCriteriaList([_Cancelled(job)]),
                          pad_token_id=self.eos_ids[0] if self.eos_ids else None)
            if request.stop:
                kwargs.update(stop_strings=list(request.stop), tokenizer=self.tokenizer)
            if request.temperature == 0.0:
                kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
            else:
                kwargs.update(do_sample=True, temperature=request.temperature, top_p=request.top_p, top_k=None)
            with torch.no_grad():
                if request.seed is not None and kwargs["do_sample"]:
                    with self._seed_lock:
                        torch.manual_seed(request.seed)
                        self.model.generate(ids, cache=bank, **kwargs)
                else:
                    self.model.generate(ids, cache=bank, **kwargs)
        finally:
            bank.close()
        if job.cancelled.is_set():
            return
        last = job.completion_ids[-1] if job.completion_ids else None
        finished = last in self.eos_ids or len(job.completion_ids) < job.max_new_tokens
        job.emit("done", "stop" if finished else "length")

    def health(self) -> dict:
        stats = self.store.stats() if self.store.is_bound else None
        return {"status": "ok", "model": self.model_name, "queued": self._queue.qsize(), "active": self.active,
                "tiers": None if stats is None else {name: {"used_blocks": t["used_blocks"],
                                                            "capacity_blocks": t["capacity_blocks"]}
                                                     for name, t in stats["tiers"].items()},
                "time": time.time()}
