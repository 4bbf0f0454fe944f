"""Reading a trace back (the format is in recorder.py), checking every line.

A line that is not JSON, not an object, of an unknown type, or without a field its type needs
(or with a field of the wrong kind) is a TraceError naming the file, the line number and what
was wrong. A last line cut short (the chat was killed mid-write) is reported as truncated.
A trace without its `end` line (the chat stopped early) is still read: `Trace.is_complete`
says so.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import TraceError
from ..scheduler import TIER_NAMES
from .recorder import TRACE_FORMAT_VERSION


@dataclass
class Trace:
    path: Path
    start: dict
    steps: list[dict] = field(default_factory=list)
    turns: list[dict] = field(default_factory=list)
    end: dict | None = None

    @property
    def is_complete(self) -> bool:
        """True when the trace has its end line (the chat finished and closed the recorder)."""
        return self.end is not None


# ---- field checks: each returns what is wrong with a value, or None --------------------------
def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _number(value):
    return None if _is_number(value) else "a number"


def _count(value):
    return None if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else "an integer >= 0"


def _text_or_null(value):
    return None if value is None or isinstance(value, str) else "a string or null"


def _kind(value):
    return None if value in ("prefill", "decode") else "'prefill' or 'decode'"


def _per_tier(check, allowed: str):
    def checker(value):
        if not isinstance(value, dict) or any(name not in value or check(value[name]) for name in TIER_NAMES):
            return f"an object with {', '.join(TIER_NAMES)}: {allowed}"
        return None
    return checker


def _counts(value):
    if not isinstance(value, dict) or any(not isinstance(k, str) or _count(v) for k, v in value.items()):
        return "an object of integers >= 0"
    return None


def _rate_or_null(value):
    return None if value is None or (_is_number(value) and 0 <= value <= 1) else "a number from 0 to 1 or null"


def _tier_capacity(value):
    return None if isinstance(value, dict) and not _count(value.get("capacity_blocks")) \
        and not _count(value.get("capacity_bytes")) else "an object {capacity_blocks, capacity_bytes}"


_FIELDS = {
    "start": {"t_s": _number, "version": _count, "model": _text_or_null, "block_size": _count,
              "block_bytes": _count,
              "tiers": _per_tier(_tier_capacity, "each {capacity_blocks, capacity_bytes}")},
    "step": {"t_s": _number, "turn": _count, "step": _count, "kind": _kind, "new_tokens": _count,
             "seq_tokens": _count, "step_s": _number,
             "used_blocks": _per_tier(_count, "integers >= 0"),
             "capacity_blocks": _per_tier(_count, "integers >= 0"),
             "bytes_moved": _counts, "bytes_moved_delta": _counts, "moves": _counts,
             "bytes_background": _count},
    "turn": {"t_s": _number, "turn": _count, "prompt_tokens": _count, "reused_tokens": _count,
             "computed_tokens": _count, "new_tokens": _count, "seq_tokens": _count, "num_steps": _count,
             "ttft_s": _number, "decode_tokens_per_s": _number, "turn_blocks": _count,
             "hit_rate": _per_tier(_rate_or_null, "numbers from 0 to 1 or null"), "bytes_moved": _counts},
    "end": {"t_s": _number, "num_steps": _count, "num_turns": _count},
}


def _json_kind(value) -> str:
    return {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number")


def _check_record(record, line_number: int, fail) -> str:
    """The record's type, once every field its type needs is there and of the right kind."""
    if not isinstance(record, dict):
        fail(line_number, f"{_json_kind(record)}, not a JSON object")
    kind = record.get("type")
    if kind not in _FIELDS:
        fail(line_number, f"'type' is {kind!r}; allowed: {', '.join(repr(k) for k in _FIELDS)}")
    for name, check in _FIELDS[kind].items():
        if name not in record:
            fail(line_number, f"a {kind!r} record without the {name!r} field")
        wrong = check(record[name])
        if wrong is not None:
            fail(line_number, f"{kind!r} field {name!r} is {json.dumps(record[name])[:60]}; allowed: {wrong}")
    return kind


def read_trace(path: str | os.PathLike) -> Trace:
    """Read and check a trace written by TraceRecorder. TraceError names the file and line."""
    path = Path(os.fspath(path))

    def fail(line_number: int | None, what: str):
        where = f"line {line_number}: " if line_number is not None else ""
        raise TraceError(f"trace file {str(path)!r}: {where}{what}")

    try:
        data = path.read_bytes()
    except OSError as exc:
        fail(None, f"cannot read it ({exc.strerror or exc})")
    if not data.strip():
        fail(None, "is empty; expected JSON lines written by `tiered-kv chat --trace`")
    lines = data.split(b"\n")
    ends_cleanly = lines[-1] == b""
    if ends_cleanly:
        lines.pop()
    trace = None
    for number, raw in enumerate(lines, start=1):
        is_last = number == len(lines)
        try:
            record = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            if not raw.strip():
                fail(number, "an empty line; expected one JSON object per line")
            if is_last and not ends_cleanly:
                fail(number, f"truncated: the file ends in the middle of this line ({exc})")
            fail(number, f"not JSON ({exc})")
        kind = _check_record(record, number, fail)
        if trace is None:
            if kind != "start":
                fail(number, f"a {kind!r} record; a trace begins with its 'start' record")
            if record["version"] > TRACE_FORMAT_VERSION:
                fail(number, f"trace format version {record['version']}; this tiered_kv reads up to "
                             f"{TRACE_FORMAT_VERSION}")
            trace = Trace(path, record)
        elif trace.end is not None:
            fail(number, f"a {kind!r} record after the 'end' record")
        elif kind == "start":
            fail(number, "a second 'start' record; one trace per file")
        elif kind == "step":
            trace.steps.append(record)
        elif kind == "turn":
            trace.turns.append(record)
        else:
            trace.end = record
    return trace
