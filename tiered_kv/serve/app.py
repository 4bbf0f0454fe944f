"""The HTTP side of `tiered-kv serve`: a Starlette app (run by uvicorn) speaking OpenAI's chat API.

    POST /v1/chat/completions   one reply, or (`stream: true`) server-sent events ending `data: [DONE]`
    GET  /v1/models             the served model
    GET  /health                queued and active requests, tier use
    GET  /metrics               the Prometheus exposition of the store's metrics

Every refusal is a 4xx (or a 429 with Retry-After) with OpenAI's `{"error": {...}}` body, and leaves
the store as it was. `usage.prompt_tokens_details.cached_tokens` is what `attach()` reused. A
client that goes away (mid-stream, or while it waits for a whole reply) cancels its generation
before its next forward pass.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from . import protocol
from .engine import ChatEngine, Job
from .protocol import RequestError


def make_app(engine: ChatEngine, api_key: str | None = None) -> Starlette:
    async def chat_completions(http: Request):
        try:
            _check_key(http, api_key)
            request = protocol.parse_chat_request(await http.body(), engine.model_name)
            job = engine.submit(request, asyncio.get_running_loop())
        except RequestError as error:
            return _error(error)
        if request.stream:
            return StreamingResponse(_stream(engine, job), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            text, finish = await _collect_while_connected(http, engine, job)
        except RequestError as error:
            return _error(error)
        except _ClientGone:
            return Response(status_code=499)  # nobody reads it: uvicorn drops it
        finally:
            job.cancel()  # (a no-op once it finished)
        return JSONResponse(protocol.completion(request, text, finish, _usage(job)))

    async def models(http: Request):
        try:
            _check_key(http, api_key)
        except RequestError as error:
            return _error(error)
        return JSONResponse({"object": "list", "data": [{"id": engine.model_name, "object": "model",
                                                         "created": int(time.time()), "owned_by": "tiered_kv"}]})

    async def health(_: Request):
        return JSONResponse(engine.health())

    async def metrics(_: Request):
        from ..metrics.export import exposition
        return PlainTextResponse(exposition([engine.store]), media_type="text/plain; version=0.0.4")

    async def not_found(http: Request, _exc):
        return _error(RequestError(404, f"no route {http.method} {http.url.path}", code="not_found"))

    async def not_allowed(http: Request, _exc):
        return _error(RequestError(405, f"{http.method} is not allowed on {http.url.path}", code="method_not_allowed"))

    routes = [Route("/v1/chat/completions", chat_completions, methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]), Route("/health", health, methods=["GET"]),
              Route("/metrics", metrics, methods=["GET"])]
    return Starlette(routes=routes, exception_handlers={404: not_found, 405: not_allowed})


def _check_key(http: Request, api_key: str | None) -> None:
    if api_key is None:
        return
    given = http.headers.get("authorization", "")
    if not given.startswith("Bearer ") or not hmac.compare_digest(given[len("Bearer "):], api_key):
        raise RequestError(401, "a valid API key is required: 'Authorization: Bearer <key>'",
                           type_="authentication_error", code="invalid_api_key")


def _error(error: RequestError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def _usage(job: Job) -> dict:
    return protocol.usage(len(job.prompt_ids), len(job.completion_ids), job.cached_tokens)


class _Text:
    """The reply's text as tokens arrive: special tokens (EOS) dropped, cut before a stop string,
    and, while streaming, held back where a stop string or a multi-byte character may still be
    forming, so no delta is ever taken back."""

    def __init__(self, engine: ChatEngine, stops: tuple[str, ...]):
        self.engine, self.stops = engine, stops
        self.ids: list[int] = []
        self.sent = 0
        self.stopped = False

    def full(self) -> str:
        text = self.engine.tokenizer.decode([t for t in self.ids if t not in self.engine.eos_ids],
                                            skip_special_tokens=True)
        for stop in self.stops:
            at = text.find(stop)
            if at >= 0:
                text, self.stopped = text[:at], True
        return text

    def delta(self, final: bool) -> str:
        text = self.full()
        safe = len(text) if final or self.stopped else len(text) - max((len(s) - 1 for s in self.stops), default=0)
        if not final:
            while safe > 0 and text[safe - 1] == "\ufffd":  # an incomplete UTF-8 sequence
                safe -= 1
        out = text[self.sent:max(self.sent, safe)]
        self.sent += len(out)
        return out


async def _collect(engine: ChatEngine, job: Job) -> tuple[str, str]:
    text = _Text(engine, job.request.stop)
    while True:
        kind, value = await job.events.get()
        if kind == "token":
            text.ids.append(value)
        elif kind == "error":
            raise value
        else:
            return text.full(), value


class _ClientGone(Exception):
    pass


async def _collect_while_connected(http: Request, engine: ChatEngine, job: Job,
                                   poll_s: float = 0.25) -> tuple[str, str]:
    """`_collect`, given up as soon as the client disconnects (_ClientGone; the caller cancels the job)."""
    collecting = asyncio.ensure_future(_collect(engine, job))
    try:
        while True:
            done, _ = await asyncio.wait({collecting}, timeout=poll_s)
            if done:
                return collecting.result()
            if await http.is_disconnected():
                raise _ClientGone  # the caller cancels the job
    finally:
        collecting.cancel()


async def _stream(engine: ChatEngine, job: Job):
    request = job.request
    text = _Text(engine, request.stop)
    try:
        yield protocol.chunk(request, {"role": "assistant", "content": ""})
        while True:
            kind, value = await job.events.get()
            if kind == "token":
                text.ids.append(value)
                piece = text.delta(final=False)
                if piece:
                    yield protocol.chunk(request, {"content": piece})
            elif kind == "error":
                yield f"data: {json.dumps(value.body())}\n\n"
                break
            else:
                piece = text.delta(final=True)
                if piece:
                    yield protocol.chunk(request, {"content": piece})
                yield protocol.chunk(request, {}, finish_reason=value)
                if request.include_usage:
                    yield protocol.chunk(request, {}, usage_=_usage(job), choices=False)
                break
        yield protocol.DONE
    finally:
        job.cancel()  # the client went away (or the stream ended): its generation stops
