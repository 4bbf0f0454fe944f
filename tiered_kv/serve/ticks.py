"""What one scheduler tick computes: every decoding conversation's next token in one forward pass.

A tick (batched mode, the default):
1. prefill: sequences with a prompt to compute (oldest first) run alone, a chunk each, until the
   tick's `prefill_chunk` tokens are spent; a sequence whose last chunk ran picks its first token
   (so a long new prompt delays the others' next token by at most one chunk's pass);
2. decode: every sequence with one token to compute is a row of one forward (tiered_kv.forward_rows
   over a BankBatch): each row attends its own history, picks its own token (its own sampling
   settings and generator), and a row whose bank fails is taken out of the step and handled alone
   (`row_failed`): a corrupt block is recomputed from the tokens the request knows, never served;
   a row short of room is retried alone; anything else is that request's error. Rolled back rows
   leave the others' tokens untouched.
The per-request mode (`batch=False`, the baseline bench/serve.py compares with) runs one forward a
request: a new request's whole prompt first, then one decode step for one request in turn.
"""

from __future__ import annotations

import logging

import torch

from ..bank import forward_rows
from ..errors import CapacityError, CorruptBlockError

log = logging.getLogger(__name__)

MAX_RECOMPUTES = 2  # corrupt blocks met by one request before it gets the error instead


def batched_tick(engine, prefill_chunk: int) -> None:
    budget = prefill_chunk
    for job, sequence in list(engine.running):
        if budget <= 0:
            break
        if len(sequence.pending) > 1 and not job.cancelled.is_set():
            take = min(budget, len(sequence.pending))
            budget -= take
            token = engine.guarded(job, sequence, lambda: sequence.prefill(take))
            if token is not None:
                engine.delivered(job, sequence, token)
    rows = [(job, sequence) for job, sequence in engine.running
            if sequence.decoding and not sequence.finished and not job.cancelled.is_set()]
    if rows:
        decode_rows(engine, rows)


def decode_rows(engine, rows: list) -> None:
    """One forward for every row's pending token; each row's pick delivered, failures handled per row."""
    sequences = [sequence for _, sequence in rows]
    ids = torch.tensor([sequence.pending for sequence in sequences], device=sequences[0].device)
    try:
        out = forward_rows(engine.model, [sequence.bank for sequence in sequences], ids)
    except Exception:  # noqa: BLE001 - the model's own error, every row rolled back: each row alone finds whose
        if len(rows) == 1:
            job, sequence = rows[0]
            engine.guarded(job, sequence, lambda: sequence.prefill(1))  # (raises again: the client is told)
            return
        log.warning("a batched decode step failed; its %d rows run one at a time", len(rows), exc_info=True)
        for row in rows:
            decode_rows(engine, [row])
        return
    for i, r in enumerate(out.rows):
        job, sequence = rows[r]
        engine.delivered(job, sequence, sequence.picked(out.logits[i, -1]))
    for r, error in out.failed.items():
        row_failed(engine, *rows[r], error, alone=len(rows) == 1)


def row_failed(engine, job, sequence, error: BaseException, alone: bool) -> None:
    """A row taken out of a decode step (rolled back): recomputed, retried alone, or its error."""
    if isinstance(error, CorruptBlockError) and sequence.recomputed < MAX_RECOMPUTES:
        log.warning("a request's KV failed its checksum; its history is recomputed from token %d: %s",
                    sequence.bank.seq.num_tokens, error)
        sequence.recompute_from_bank()
        return
    if isinstance(error, CapacityError) and not alone:
        decode_rows(engine, [(job, sequence)])  # with the others' steps done, it may fit alone
        return
    engine.failed(job, sequence, error)


def per_request_tick(engine) -> None:
    """The baseline: one decode step for the request whose turn it is (prefills ran at admission)."""
    job, sequence = engine.running.popleft()
    engine.running.append((job, sequence))  # (delivered() or failed() take it out when it ends)
    token = engine.guarded(job, sequence, lambda: sequence.prefill(len(sequence.pending)))
    if token is not None:
        engine.delivered(job, sequence, token)


__all__ = ["batched_tick", "decode_rows", "row_failed", "per_request_tick", "MAX_RECOMPUTES"]
