"""What `Transfers.complete` does with a batch whose copies are done (store lock held): commit what
copied without error, give back what did not, count and report (docs/design.md, invariant 7).

Per group of moves (one direction), by arrays: the blocks still in flight, not cancelled and not
corrupt are committed with one index update (`BlockIndex.move_many`), their source slots freed
together once the batch's event has passed; every reserved destination slot no block took goes
back the same way. A block in flight moves only by its own transfer (in_flight.py), so a block
still registered is where its group's source slot says. Copies into new blocks (copy-on-write,
write-in) and backups are few per batch and are settled block by block.
"""

from __future__ import annotations

import numpy as np

from ..blocks import COLD, TIER_NAMES
from ..hw.block_io import ColdWriteError
from . import failures, write_behind
from .batches import TransferBatch, TransferGroup
from .copies import BACKUP, COPY, MOVE, WRITE_IN


def complete(transfers, batch: TransferBatch) -> None:
    """See the module docstring (`transfers` is the Transfers: state, metrics, counts)."""
    state, event, error = transfers.state, batch.event, batch.failure
    landed: dict[tuple[int, int], int] = {}  # (src, dst) -> blocks whose bytes landed
    given_back: dict[int, list] = {}  # tier -> arrays (or lists) of reserved slots no block took
    backups = []
    for group in batch.groups:
        if group.kind == MOVE:
            state.in_flight.settle(group)
            _complete_moves(transfers, batch, group, error, landed, given_back)
        elif group.kind == BACKUP:
            backups.append(group)
        elif group.kind in (COPY, WRITE_IN):
            _complete_fills(state, batch, group, error, landed)
            state.in_flight.settle(group)  # (after: a block freed above waits for the event in flight)
    if backups:
        write_behind.complete_backups(transfers, backups, error, landed, given_back)
    for tier, slot in batch.frees:
        given_back.setdefault(tier, []).append(np.array([slot], dtype=np.int64))
    batch.frees.clear()
    for tier, parts in given_back.items():
        if parts:
            state.free_slots_after(tier, parts[0] if len(parts) == 1 else np.concatenate(parts), after=event)
    for (src, dst), count in landed.items():
        transfers.count_bytes(src, dst, count * transfers.moved_bytes[(src, dst)], batch.mode)
    transfers.observe_copy_seconds(batch, landed)
    if isinstance(error, ColdWriteError):
        failures.drop_cached_that_failed_into_cold(state, batch)
    if error is not None and batch.failed_parts:
        failures.report(transfers.metrics, transfers.failure_warnings, batch, error)
    state.changes.bump()


def _complete_moves(transfers, batch: TransferBatch, group: TransferGroup, error, landed: dict,
                    given_back: dict) -> None:
    state = transfers.state
    count = len(group)
    if error is not None:  # the whole batch failed: nothing moved
        given_back.setdefault(group.dst_tier, []).append(group.dst_slots)
        batch.failed_parts.append((group, np.arange(count)))
        return
    good = ~(group.cancelled | group.corrupt)  # (gone blocks are cancelled too)
    if good.all():
        ids, dst_slots, src_slots = group.block_ids, group.dst_slots, group.src_slots
    else:
        ids, dst_slots, src_slots = group.block_ids[good], group.dst_slots[good], group.src_slots[good]
        given_back.setdefault(group.dst_tier, []).append(group.dst_slots[~good])
        bad = group.corrupt & ~group.cancelled  # corrupt where it still is: never served
        for block_id in group.block_ids[bad].tolist():
            state.mark_corrupt(block_id)
            batch.corrupt.append(block_id)
    if len(ids):
        _commit(transfers, group.src_tier, group.dst_tier, ids, dst_slots, src_slots, batch.event)
        batch.committed.add(ids, group.src_tier, group.dst_tier)
        if group.src_tier != group.dst_tier:
            key = (group.src_tier, group.dst_tier)
            landed[key] = landed.get(key, 0) + len(ids)


def _commit(transfers, src: int, dst: int, block_ids: np.ndarray, dst_slots: np.ndarray, src_slots: np.ndarray,
            event) -> None:
    """The blocks live at their destinations from now on; their source slots are freed once the
    event has passed."""
    state, metrics, count = transfers.state, transfers.metrics, len(block_ids)
    ids = block_ids.tolist()
    if src == dst:  # compaction: each block keeps its place in the tier's orders
        for block_id, slot in zip(ids, dst_slots.tolist()):
            state.index.relocate(block_id, slot)
        metrics.relocations.inc((), count)
    else:
        state.index.move_many(ids, src, dst, dst_slots.tolist())
        metrics.blocks_moved.inc((TIER_NAMES[src], TIER_NAMES[dst]), count)
        (metrics.demotions if dst > src else metrics.promotions).inc((), count)
        if dst == COLD:
            for block_id in ids:
                state.persist_if_published(block_id)
        elif src == COLD:
            src_slots = write_behind.keep_records(state, ids, src_slots.tolist())
    state.free_slots_after(src, src_slots, after=event)


def _complete_fills(state, batch: TransferBatch, group: TransferGroup, error, landed: dict) -> None:
    """Copies-on-write and write-ins: each new block is at its destination already; one whose
    bytes never landed goes (never served; its slot waits for the event, in flight still)."""
    index, failed = state.index, []
    src_blocks = group.src_blocks.tolist() if group.src_blocks is not None else None
    cancelled, corrupt = group.cancelled.tolist(), group.corrupt.tolist()
    for i, block_id in enumerate(group.block_ids.tolist()):
        if corrupt[i] and error is None and src_blocks is not None and src_blocks[i] in index:
            state.mark_corrupt(src_blocks[i])  # the source's bytes are bad
            batch.corrupt.append(src_blocks[i])
        if error is not None and not cancelled[i]:
            failed.append(i)
            state.free_block(block_id)
        elif group.kind == COPY and not cancelled[i] and group.src_tier != group.dst_tier:
            key = (group.src_tier, group.dst_tier)
            landed[key] = landed.get(key, 0) + 1
    if failed:
        batch.failed_parts.append((group, np.array(failed, dtype=np.int64)))


__all__ = ["complete"]
