"""Traces of a chat: per-step tier occupancy, moves and timings as JSON lines, and their plots.

`TraceRecorder` writes a trace while `run_chat(..., trace=path)` (or `tiered-kv chat --trace`)
runs; `read_trace` reads one back, checking every line; `tiered_kv.trace.plot` draws it
(matplotlib, the `plot` extra, imported only there). The record format is in recorder.py.
"""

from ..errors import TraceError
from .counters import Counters, read_counters
from .reader import Trace, read_trace
from .recorder import TRACE_FORMAT_VERSION, TraceRecorder

__all__ = ["TraceRecorder", "TraceError", "Trace", "read_trace", "Counters", "read_counters",
           "TRACE_FORMAT_VERSION"]
