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

from ..blocks import COLD, HOT, WARM
from ..logs import error_name
from .batches import Transfer, TransferBatch
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
    slots = pool.allocate(len(wanted)) or []
    for (block_id, entry), slot in zip(wanted, slots):
        t = Transfer(block_id, entry.tier, entry.slot, COLD, slot, batch, kind=BACKUP)
        in_flight[block_id] = t
        batch.transfers.append(t)
    return batch, no_room


def complete_backups(transfers, backups: list[Transfer], error, landed: dict, given_back: dict) -> None:
    """Commit the backups whose copy landed: the block's copy, persisted; the others give their slot back."""
    state, metrics = transfers.state, transfers.metrics
    cold, copies, now = state.tiers[COLD], state.copies, time.monotonic()
    failed = 0
    for t in backups:
        if state.in_flight.get(t.block_id) is t:
            del state.in_flight[t.block_id]
        entry = state.index.peek(t.block_id)
        still_there = entry is not None and entry.tier == t.src_tier and entry.slot == t.src_slot \
            and entry.key is not None and t.block_id not in copies
        if error is None and still_there and not t.cancelled and not t.corrupt and cold is not None:
            try:
                cold.persist(t.dst_slot, entry.key, entry.root)
            except ValueError:  # the tier is closing (or the record is not whole): no copy after all
                given_back.setdefault(COLD, []).append(t.dst_slot)
                continue
            copies.add(t.block_id, t.dst_slot)
            landed[(t.src_tier, COLD)] = landed.get((t.src_tier, COLD), 0) + 1
            continue
        given_back.setdefault(COLD, []).append(t.dst_slot)
        if error is not None and still_there:
            failed += 1
            copies.retry_later(t.block_id, now)  # the mover backs off after a failed write into cold
    if failed:
        metrics.copies_failed.inc((error_name(error),), failed)
    written = len(backups) - failed
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
