"""Write-behind: the transfers that give published blocks above cold a durable copy there, and
what the other moves do with copies (store/durable_copies.py says what a copy is).

A backup is a transfer like any other (DESIGN invariant 7): prepared under the store lock (a cold
slot reserved, cold room made by dropping the coldest copies first, the block marked in flight so
nothing moves or frees its source under the copy), copied by the copy engine into cold on the
background staging set (never the decode path), completed under the lock: a copy that landed
becomes the block's copy and its record is persisted (header, fdatasync, index row on the cold
writer thread, invariant 6); one that failed costs only itself (its slot goes back once the copy's
event passed, the block stays where it is and is tried again later). A step that reads the block
meanwhile does not cancel a backup: the block does not move.
"""

from __future__ import annotations

import time

import numpy as np

from ..blocks import COLD, HOT, WARM
from ..logs import error_name
from .batches import TransferBatch, TransferGroup
from .copies import BACKUP


def prepare_backups(transfers, block_ids: list[int], mode: str) -> tuple[TransferBatch, int]:
    """(a batch copying each block (published, above cold, not in flight, without a copy) into a
    free cold slot, how many found no room: those wait for a later batch). Blocks that no longer
    qualify are left out; ones a move has in flight wait too."""
    state = transfers.state
    batch = TransferBatch(mode)
    if transfers.closed or state.copies is None:
        return batch, 0
    index, copies, in_flight, now = state.index, state.copies, state.in_flight, time.monotonic()
    wanted = []
    for block_id in block_ids:
        entry = index.peek(block_id)
        if entry is None or entry.tier not in (HOT, WARM) or entry.key is None or entry.root is None \
                or block_id in copies:
            continue
        if block_id in in_flight:  # a move copies it now: try again with the next batch
            if in_flight[block_id].kind != BACKUP:
                copies.retry_later(block_id, now)
            continue
        wanted.append((block_id, entry))
    if not wanted:
        return batch, 0
    pool = state.pools[COLD]
    free = state.cold_room(len(wanted))  # (the blocks wanted have no copy: none of theirs is dropped)
    for block_id, _ in wanted[free:]:  # cold is full of blocks of its own: later
        copies.retry_later(block_id, now)
    no_room = max(0, len(wanted) - free)
    wanted = wanted[:free]
    slots = pool.allocate_array(len(wanted))
    if slots is None or not len(wanted):
        return batch, no_room
    for tier in (HOT, WARM):  # a group per source tier
        rows = [i for i, (_, entry) in enumerate(wanted) if entry.tier == tier]
        if rows:
            group = TransferGroup(batch, BACKUP, tier, COLD, np.array([wanted[i][0] for i in rows], dtype=np.int64),
                                  np.array([wanted[i][1].slot for i in rows], dtype=np.int64), slots[rows])
            state.in_flight.add(group)
            batch.groups.append(group)
    return batch, no_room


def complete_backups(transfers, backups: list[TransferGroup], error, landed: dict, given_back: dict) -> None:
    """Commit the backups whose copy landed: the block's copy, persisted; the others give their slot back."""
    state, metrics = transfers.state, transfers.metrics
    cold, copies, now = state.tiers[COLD], state.copies, time.monotonic()
    failed = written = 0
    back = given_back.setdefault(COLD, [])
    for group in backups:
        state.in_flight.settle(group)
        src_tier, cancelled, corrupt = group.src_tier, group.cancelled.tolist(), group.corrupt.tolist()
        for i, (block_id, src_slot, dst_slot) in enumerate(zip(group.block_ids.tolist(), group.src_slots.tolist(),
                                                                group.dst_slots.tolist())):
            entry = state.index.peek(block_id)
            still_there = entry is not None and entry.tier == src_tier and entry.slot == src_slot \
                and entry.key is not None and block_id not in copies
            if error is None and still_there and not cancelled[i] and not corrupt[i] and cold is not None:
                try:
                    cold.persist(dst_slot, entry.key, entry.root)
                except ValueError:  # the tier is closing (or the record is not whole): no copy after all
                    back.append(np.array([dst_slot], dtype=np.int64))
                    continue
                copies.add(block_id, dst_slot)
                landed[(src_tier, COLD)] = landed.get((src_tier, COLD), 0) + 1
                written += 1
                continue
            back.append(np.array([dst_slot], dtype=np.int64))
            if error is not None and still_there:
                failed += 1
                copies.retry_later(block_id, now)  # the mover backs off after a failed write into cold
    if failed:
        metrics.copies_failed.inc((error_name(error),), failed)
    if written:
        metrics.copies_written.inc((), written)


def keep_records(state, block_ids: list[int], src_slots: list[int]) -> list[int]:
    """Blocks that just left cold keep their durable record as a copy (promotion no longer deletes
    it); returns the source slots still to free (records that were not durable)."""
    cold, copies = state.tiers[COLD], state.copies
    if cold is None or copies is None:
        return src_slots
    free = []
    for block_id, slot in zip(block_ids, src_slots):
        entry = state.index.get(block_id)
        if entry.key is not None and entry.tier in (HOT, WARM) and cold.is_durable(slot) and block_id not in copies:
            copies.add(block_id, slot)
        else:
            free.append(slot)
    return free
