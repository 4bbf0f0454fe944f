"""The OpenAI chat-completions protocol as the server speaks it: a request checked into a
`ChatRequest`, errors in OpenAI's shape, response and stream-chunk bodies. Plain data, no torch.

Checked: `model` (must name the served model), `messages` (a non-empty list of {role, content},
roles system / user / assistant / developer, content a string or a list of text parts),
`max_tokens` / `max_completion_tokens`, `temperature` (0 = greedy), `top_p`, `seed`, `stop` (a
string or up to 4), `stream`, `stream_options.include_usage`, `n` (1 only). Fields OpenAI defines
that do not change the tokens here (`user`, `metadata`, `store`, ...) are accepted and ignored; any
other field is an error naming it.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

ROLES = ("system", "developer", "user", "assistant")
MAX_STOP = 4
# accepted and ignored: they change nothing about the tokens this server generates
IGNORED_FIELDS = ("user", "metadata", "store", "service_tier", "parallel_tool_calls", "logit_bias",
                  "presence_penalty", "frequency_penalty", "reasoning_effort", "modalities", "prediction")
KNOWN_FIELDS = ("model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop",
                "stream", "stream_options", "n", *IGNORED_FIELDS)


class RequestError(Exception):
    """A request the server refuses: HTTP `status`, and OpenAI's error fields."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class ChatRequest:
    model: str
    messages: list[dict]
    max_tokens: int | None
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))


def parse_chat_request(raw: bytes, served_model: str) -> ChatRequest:
    """The request in `raw` (the HTTP body), checked; RequestError naming what is wrong otherwise."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RequestError(400, f"the request body is not valid JSON ({exc})", code="invalid_json") from None
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object", code="invalid_json")
    unknown = sorted(set(body) - set(KNOWN_FIELDS))
    if unknown:
        raise RequestError(400, f"unknown field {unknown[0]!r}; allowed: {', '.join(KNOWN_FIELDS)}",
                           param=unknown[0], code="unknown_parameter")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError(400, "'model' is required: the name of the served model", param="model",
                           code="missing_required_parameter" if model is None else "invalid_type")
    if model != served_model:
        raise RequestError(404, f"the model {model!r} does not exist here; this server serves {served_model!r}",
                           param="model", code="model_not_found")
    messages = _messages(body.get("messages"))
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    param = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    if max_tokens is not None and (not _is_int(max_tokens) or max_tokens < 1):
        raise RequestError(400, f"{param!r} must be an integer >= 1, got {max_tokens!r}", param=param,
                           code="invalid_value")
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0.0:
        raise RequestError(400, "'top_p' must be > 0 and <= 1", param="top_p", code="invalid_value")
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise RequestError(400, f"'seed' must be an integer, got {seed!r}", param="seed", code="invalid_type")
    stop = body.get("stop")
    stops = (stop,) if isinstance(stop, str) else tuple(stop) if isinstance(stop, list) else () if stop is None else None
    if stops is None or len(stops) > MAX_STOP or not all(isinstance(s, str) and s for s in stops):
        raise RequestError(400, f"'stop' must be a non-empty string or a list of up to {MAX_STOP} of them, got "
                                f"{stop!r}", param="stop", code="invalid_value")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(400, f"'stream' must be true or false, got {stream!r}", param="stream",
                           code="invalid_type")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage", "include_obfuscation"}:
        raise RequestError(400, f"'stream_options' must be an object with 'include_usage', got {options!r}",
                           param="stream_options", code="invalid_value")
    n = body.get("n", 1)
    if n != 1:
        raise RequestError(400, f"'n' must be 1 here (one choice per request), got {n!r}", param="n",
                           code="invalid_value")
    return ChatRequest(model, messages, max_tokens, temperature, top_p, seed, stops, stream,
                       bool(options.get("include_usage", False)))


def _messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "'messages' is required: a non-empty list of {role, content} objects",
                           param="messages", code="missing_required_parameter" if messages is None else "invalid_type")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise RequestError(400, f"{where} must be an object whose 'role' is one of {', '.join(ROLES)}",
                               param=f"{where}.role", code="invalid_value")
        content = message.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise RequestError(400, f"{where}.content: only text parts ({{'type': 'text', 'text': ...}}) are "
                                        "served", param=f"{where}.content", code="invalid_value")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise RequestError(400, f"{where}.content must be a string (or a list of text parts)",
                               param=f"{where}.content", code="invalid_type")
        role = "system" if message["role"] == "developer" else message["role"]
        out.append({"role": role, "content": content})
    return out


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise RequestError(400, f"{name!r} must be a number from {low:g} to {high:g}, got {value!r}", param=name,
                           code="invalid_value")
    return float(value)


# ---- responses ---------------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion(request: ChatRequest, text: str, finish_reason: str, usage_: dict) -> dict:
    return {"id": request.id, "object": "chat.completion", "created": request.created, "model": request.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": finish_reason, "logprobs": None}],
            "usage": usage_}


def chunk(request: ChatRequest, delta: dict, finish_reason: str | None = None, usage_: dict | None = None,
          choices: bool = True) -> str:
    """One server-sent event of a stream (`data: {...}` and a blank line)."""
    body = {"id": request.id, "object": "chat.completion.chunk", "created": request.created, "model": request.model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}]
            if choices else []}
    if usage_ is not None:
        body["usage"] = usage_
    return f"data: {json.dumps(body)}\n\n"


DONE = "data: [DONE]\n\n"
