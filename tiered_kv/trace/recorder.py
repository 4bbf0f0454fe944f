"""TraceRecorder: writes what a chat did to its tiers, step by step, as JSON lines.

One JSON object per line, each with a "type" and `t_s` (seconds since the trace started):

- `start` (first line): `version` (TRACE_FORMAT_VERSION), `created_unix_s`, `model` (name or
  None), `block_size` (tokens), `block_bytes`, `tiers` ({"hot": {"capacity_blocks",
  "capacity_bytes"}, ...}), `policy`, `background`, `hooks_mode`.
- `step`, one per committed forward pass: `turn`, `step` (index in the turn), `kind` ("prefill":
  the turn's first pass or one of several tokens; else "decode"), `new_tokens` (tokens this pass
  computed, per row), `seq_tokens` (the bank's length after it), `step_s` (layer 0 begin to
  commit), `used_blocks` and `capacity_blocks` per tier, `bytes_moved` per direction (cumulative,
  store-wide) and `bytes_moved_delta` (since the previous step line: moves between steps, e.g. a
  turn's promotions in attach(), land in the next step), `moves` (cumulative promotions,
  demotions, evictions in blocks), `bytes_background` (cumulative).
- `turn`, one per chat turn: `turn`, `prompt_tokens`, `reused_tokens`, `computed_tokens`,
  `new_tokens`, `seq_tokens`, `num_steps`, `attach_s`, `ttft_s`, `decode_tokens_per_s`, `turn_s`,
  `turn_blocks` (history blocks the turn began needing), `hit_rate` per tier (the share of those
  found in each tier; null without history), `bytes_moved` per direction (since the previous turn
  line; the turns' figures add up to the cumulative one), and, when the turn's record carries the
  bank's stats (run_chat's do), `attention`: `sampled_steps` (decode steps whose attention mass was
  measured in this turn), `mass_share_by_tier` (the bank's decaying share of the sampled mass each
  tier served, after the turn; {} before any sample) and `sparse_read_share_below_hot` (of the
  blocks below hot, the share this turn's sparse steps read; null without sparse steps).
- `end` (last line): `num_steps`, `num_turns`, `bytes_moved` (cumulative).

A step costs one counter snapshot (counters.py) and one small dict; lines are serialized and
written when a turn ends (or every FLUSH_LINES steps), outside the timed part of the chat.
One recorder follows one bank, driven from one thread.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from pathlib import Path

from ..errors import TraceError
from ..scheduler import TIER_NAMES
from .counters import Counters, read_counters

log = logging.getLogger(__name__)

TRACE_FORMAT_VERSION = 1
FLUSH_LINES = 4096  # step lines kept in memory at most before they are written


def open_private(path: Path):
    """Open `path` for writing, created 0600, its folder created 0700 when missing."""
    try:
        if str(path.parent) not in ("", "."):
            os.makedirs(path.parent, mode=0o700, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.fchmod(fd, 0o600)  # an existing file keeps its mode through O_CREAT
            return os.fdopen(fd, "w", encoding="utf-8")
        except BaseException:
            os.close(fd)
            raise
    except OSError as exc:
        raise TraceError(f"trace file {str(path)!r}: cannot write it ({exc.strerror or exc})") from None


def _per_tier(values: tuple[int, ...]) -> dict[str, int]:
    return dict(zip(TIER_NAMES, values))


class TraceRecorder:
    """Records a chat's steps and turns into a JSONL file (format above).

    `TraceRecorder(path)` opens the file at once (TraceError naming the path if it cannot),
    `start(bank)` writes the header and makes the recorder the bank's step observer,
    `begin_turn(n)` / `end_turn(record)` frame each turn, `close()` writes the end line.
    A write that fails later stops the recording (logged) and `close()` raises TraceError.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(os.path.expanduser(os.fspath(path)))
        self._file = open_private(self.path)
        self._t0 = time.perf_counter()
        self._lines: list[dict] = []
        self._bank = None
        self._last: Counters | None = None  # at the previous step line
        self._turn_base: Counters | None = None  # at the previous turn line (or the start)
        self._attention_base = (0, 0, 0)  # sampled steps, blocks below hot, of them read: at the previous turn line
        self._write_error: OSError | None = None
        self.turn = 0
        self.step_in_turn = 0
        self.num_steps = 0
        self.num_turns = 0
        self.is_closed = False

    def __enter__(self) -> "TraceRecorder":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _now_s(self) -> float:
        return time.perf_counter() - self._t0

    # ---- the chat drives these -------------------------------------------------------------
    def start(self, bank, model_name: str | None = None) -> None:
        """Write the header for `bank`'s store (bound: capacities are known) and watch its steps."""
        if self._bank is not None:
            raise RuntimeError(f"TraceRecorder({str(self.path)!r}) already follows a bank; one recorder per chat")
        store = bank.store
        counters = read_counters(store)
        block_bytes = store.layout.block_bytes if store.layout is not None else 0
        config = store.config
        self._lines.append({
            "type": "start", "t_s": self._now_s(), "version": TRACE_FORMAT_VERSION,
            "created_unix_s": time.time(), "model": model_name, "block_size": config.block_size,
            "block_bytes": block_bytes,
            "tiers": {name: {"capacity_blocks": n, "capacity_bytes": n * block_bytes}
                      for name, n in zip(TIER_NAMES, counters.capacity_blocks)},
            "policy": config.scheduler.policy, "background": config.scheduler.background,
            "hooks_mode": bank.hooks_mode,
        })
        self._last = self._turn_base = counters
        self._bank = bank
        bank.step_observer = self
        self.flush()

    def begin_turn(self, turn: int) -> None:
        self.turn = turn
        self.step_in_turn = 0

    def step_committed(self, bank, num_new_tokens: int, num_tokens: int, step_s: float) -> None:
        """The bank's step observer: called after every committed forward pass (no store lock held)."""
        now = read_counters(bank.store)
        last_moved = self._last.bytes_moved
        self._lines.append({
            "type": "step", "t_s": self._now_s(), "turn": self.turn, "step": self.step_in_turn,
            "kind": "prefill" if self.step_in_turn == 0 or num_new_tokens > 1 else "decode",
            "new_tokens": num_new_tokens, "seq_tokens": num_tokens, "step_s": step_s,
            "used_blocks": _per_tier(now.used_blocks), "capacity_blocks": _per_tier(now.capacity_blocks),
            "bytes_moved": now.bytes_moved,
            "bytes_moved_delta": {k: v - last_moved.get(k, 0) for k, v in now.bytes_moved.items()},
            "moves": now.num_moves, "bytes_background": now.bytes_background,
        })
        self._last = now
        self.step_in_turn += 1
        self.num_steps += 1
        if len(self._lines) >= FLUSH_LINES:
            self.flush()

    def end_turn(self, record: dict) -> None:
        """Write the turn line (from run_chat's per-turn record) and every line buffered so far."""
        if self._bank is None:
            raise RuntimeError("TraceRecorder.end_turn before start(bank)")
        now = read_counters(self._bank.store)
        base = self._turn_base
        turn_blocks = now.turn_blocks - base.turn_blocks
        self._lines.append({
            "type": "turn", "t_s": self._now_s(), "turn": record.get("turn", self.turn),
            **{key: record[key] for key in ("prompt_tokens", "reused_tokens", "computed_tokens", "new_tokens",
                                            "seq_tokens", "attach_s", "ttft_s", "decode_tokens_per_s", "turn_s")},
            "num_steps": self.step_in_turn,
            "turn_blocks": turn_blocks,
            "hit_rate": {name: ((now.turn_blocks_by_tier[name] - base.turn_blocks_by_tier.get(name, 0)) / turn_blocks
                                if turn_blocks else None) for name in TIER_NAMES},
            "bytes_moved": {k: v - base.bytes_moved.get(k, 0) for k, v in now.bytes_moved.items()},
            **self._attention(record),
        })
        self._turn_base = now
        self.num_turns += 1
        self.flush()

    def _attention(self, record: dict) -> dict:
        """The turn line's `attention` object, from the bank's stats in the record (module docstring)."""
        report = (record.get("stats") or {}).get("attention")
        if report is None:
            return {}
        sparse = report.get("sparse") or {}
        counts = (report["sampled_steps"], sparse.get("blocks_below_hot", 0), sparse.get("blocks_read_below_hot", 0))
        sampled, below, read = (now - before for now, before in zip(counts, self._attention_base))
        self._attention_base = counts
        return {"attention": {"sampled_steps": sampled, "mass_share_by_tier": dict(report["mass_share_by_tier"]),
                              "sparse_read_share_below_hot": read / below if below else None}}

    # ---- file ------------------------------------------------------------------------------
    def flush(self) -> None:
        """Write the buffered lines and flush the file. A failed write stops the recording."""
        lines, self._lines = self._lines, []
        if self._write_error is not None or self.is_closed:
            return
        try:
            self._file.write("".join(json.dumps(line, separators=(",", ":")) + "\n" for line in lines))
            self._file.flush()
        except OSError as exc:
            self._write_error = exc
            log.error("trace file %s: writing failed (%s); the trace stops here", self.path, exc.strerror or exc)

    def close(self) -> None:
        """Write the end line, close the file, stop watching the bank. Raises TraceError when a
        write failed on the way (the file then ends where it failed). A recorder never started
        (the chat failed before its bank existed) removes its empty file instead."""
        if self.is_closed:
            return
        if self._bank is None:  # never started (the chat failed before its bank existed): no trace
            self.is_closed = True
            self._file.close()
            with contextlib.suppress(OSError):
                self.path.unlink()
            return
        if self._bank.step_observer is self:
            self._bank.step_observer = None
        moved = self._last.bytes_moved if self._bank.store.is_closed else read_counters(self._bank.store).bytes_moved
        self._lines.append({"type": "end", "t_s": self._now_s(), "num_steps": self.num_steps,
                            "num_turns": self.num_turns, "bytes_moved": moved})
        self.flush()
        self.is_closed = True
        try:
            self._file.close()
        except OSError as exc:
            self._write_error = self._write_error or exc
        if self._write_error is not None:
            error = self._write_error
            raise TraceError(f"trace file {str(self.path)!r}: writing failed ({error.strerror or error}); "
                             "the trace is incomplete")

    def __repr__(self) -> str:
        return f"TraceRecorder({str(self.path)!r}, steps={self.num_steps}, turns={self.num_turns})"
