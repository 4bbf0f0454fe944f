"""What one scheduler tick computes: one forward pass for every conversation with work to do.

A tick (batched mode, the default) is one forward pass (tiered_kv.forward_rows over a packed
BankBatch) whose rows are
- every decoding conversation's one pending token, and
- prompt chunks: sequences with a prompt to compute (oldest first) attach their stored prefix when
  the tick first reaches them (so they find what the prompts before them published), then add a
  chunk of their prompt, until the tick holds its prompt budget: `prefill_chunk` tokens, or, while
  other conversations decode, as many as cost about one decode pass (`PassTimes`, measured as the
  server runs; at least MIN_PROMPT_TOKENS). A long new prompt thus at most about doubles the
  others' inter-token gap; its last chunk picks its first token.
Each row attends its own history and picks its own token (its own sampling settings and
generator). A row whose bank fails is taken out of the step and handled alone (`row_failed`): a
corrupt block is recomputed from the tokens the request knows, never served; a row short of room
is retried alone; anything else is that request's error. Rolled back rows leave the others'
tokens untouched.
The per-request mode (`batch=False`, the baseline bench/serve.py compares with) runs one forward a
request: a new request's whole prompt first, then one decode step for one request in turn.
"""

from __future__ import annotations

import logging
import time

from ..bank import forward_rows
from ..errors import CapacityError, CorruptBlockError

log = logging.getLogger(__name__)

MAX_RECOMPUTES = 2  # corrupt blocks met by one request before it gets the error instead
MIN_PROMPT_TOKENS = 16  # a tick's prompt tokens while others decode, at least (prompts always progress)


class PassTimes:
    """What a tick's forward pass costs, measured as the server runs: seconds of a pass without
    prompt tokens, and seconds per prompt token on top (moving averages). While conversations
    decode, a tick takes only as many prompt tokens as cost about one decode pass, so a long new
    prompt at most doubles the others' inter-token gap; with nobody decoding, a whole chunk."""

    def __init__(self, weight: float = 0.2):
        self.weight = weight
        self.decode_s: float | None = None
        self.prompt_token_s: float | None = None

    def note(self, seconds: float, prompt_tokens: int, decode_rows: int) -> None:
        w = self.weight
        if prompt_tokens == 0:
            self.decode_s = seconds if self.decode_s is None else (1 - w) * self.decode_s + w * seconds
        elif self.decode_s is not None or decode_rows == 0:
            per_token = max(0.0, seconds - (self.decode_s or 0.0) * (decode_rows > 0)) / prompt_tokens
            self.prompt_token_s = per_token if self.prompt_token_s is None else \
                (1 - w) * self.prompt_token_s + w * per_token

    def prompt_budget(self, prefill_chunk: int, decoding: bool) -> int:
        if not decoding or self.decode_s is None or not self.prompt_token_s:
            return prefill_chunk
        return max(MIN_PROMPT_TOKENS, min(prefill_chunk, int(self.decode_s / self.prompt_token_s)))


def batched_tick(engine, prefill_chunk: int) -> None:
    """One forward pass: every decoding conversation's pending token, and prompt chunks (oldest
    first) until the tick's prompt budget is spent (`prefill_chunk`, or while others decode what
    costs about one decode pass: PassTimes)."""
    times = engine.pass_times
    decoding = any(s.started and s.decoding and not s.finished for _, s in engine.running)
    budget = times.prompt_budget(prefill_chunk, decoding)
    rows = []
    for job, sequence in list(engine.running):
        if job.cancelled.is_set() or sequence.finished:
            continue
        if not sequence.started and (budget <= 0 or not engine.started(job, sequence)):
            continue  # (its prompt's turn has not come, or its attach failed: told and closed)
        if len(sequence.pending) == 1:
            rows.append((job, sequence, sequence.pending))
        elif budget > 0:
            take = min(budget, len(sequence.pending))
            budget -= take
            rows.append((job, sequence, sequence.pending[:take]))
    if rows:
        started = time.perf_counter()
        run_rows(engine, rows)
        prompt_tokens = sum(len(ids) for _, _, ids in rows if len(ids) > 1)
        times.note(time.perf_counter() - started, prompt_tokens, sum(len(ids) == 1 for _, _, ids in rows))


def run_rows(engine, rows: list) -> None:
    """One forward for every row's tokens (tiered_kv.forward_rows, packed); each row's pick delivered
    once its pending tokens are all computed; failures handled per row."""
    try:
        out = forward_rows(engine.model, [sequence.bank for _, sequence, _ in rows], [ids for _, _, ids in rows])
    except Exception as error:  # noqa: BLE001 - the model's own error, every row rolled back: each row alone finds whose
        if len(rows) == 1:
            engine.failed(rows[0][0], rows[0][1], error)
            return
        log.warning("a batched step failed; its %d rows run one at a time", len(rows), exc_info=True)
        for row in rows:
            run_rows(engine, [row])
        return
    for i, r in enumerate(out.rows):
        job, sequence, ids = rows[r]
        token = sequence.computed(len(ids), out.logits[i, -1])
        if token is not None:
            engine.delivered(job, sequence, token)
    for r, error in out.failed.items():
        row_failed(engine, rows[r], error, alone=len(rows) == 1)


def row_failed(engine, row, error: BaseException, alone: bool) -> None:
    """A row taken out of a step (rolled back): recomputed, retried alone, or its error."""
    job, sequence, _ = row
    if isinstance(error, CorruptBlockError) and sequence.recomputed < MAX_RECOMPUTES:
        log.warning("a request's KV failed its checksum; its history is recomputed from token %d: %s",
                    sequence.bank.seq.num_tokens, error)
        sequence.recompute_from_bank()
        return
    if isinstance(error, CapacityError) and not alone:
        run_rows(engine, [row])  # with the others' steps done, it may fit alone
        return
    engine.failed(job, sequence, error)


def per_request_tick(engine) -> None:
    """The baseline: one decode step for the request whose turn it is (prefills ran at admission)."""
    job, sequence = engine.running.popleft()
    engine.running.append((job, sequence))  # (delivered() or failed() take it out when it ends)
    token = engine.guarded(job, sequence, lambda: sequence.prefill(len(sequence.pending)))
    if token is not None:
        engine.delivered(job, sequence, token)


__all__ = ["batched_tick", "run_rows", "row_failed", "per_request_tick", "MAX_RECOMPUTES"]
