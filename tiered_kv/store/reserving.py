"""What `Transfers.prepare` does with a plan's arrays (store lock held): choose the moves that can
go now, settle the ones that copy nothing, reserve destination slots, and group the rest into a
batch, one TransferGroup per direction. A fixed number of numpy operations per batch and per tier:
no Python step per block, except for evictions and moves into cold that adopt a durable copy
(they change the index one block at a time; they are rare and copy nothing).
"""

from __future__ import annotations

import numpy as np

from ..blocks import COLD, DROPPED, HOT
from ..scheduler.arrays import contains_mask, first_occurrences, leave_alone_mask, placements_of
from ..scheduler.plan import ANY_SLOT, UNKNOWN_SLOT, Plan
from .batches import TransferBatch, TransferGroup
from .copies import MOVE

RUNS_FROM_BLOCKS = 8  # a batch of this many moves into warm takes its slots in runs (into hot: 2)


def select(state, plan: Plan, leave_alone) -> tuple[np.ndarray, np.ndarray]:
    """(positions in `plan` of the moves that can go now, their blocks' source slots): each block's
    first move, the block not in flight, not named by `leave_alone`, and still where the move says
    (looked up in the index, unless the plan read it there at the index's current placement version)."""
    ids = plan.block_ids
    keep = first_occurrences(ids)
    keep &= ~state.in_flight.contains_mask(ids.tolist())
    if leave_alone is not None and keep.any():
        keep[keep] = ~leave_alone_mask(leave_alone, ids[keep])
    positions = np.flatnonzero(keep)
    current = plan.src_slots is not None and plan.placement_version is not None \
        and plan.placement_version == getattr(state.index, "placement_version", None)
    if current:  # nothing changed tier or slot since the plan read the sources
        slots = plan.src_slots[positions]
        unknown = slots == UNKNOWN_SLOT
        if not unknown.any():
            return positions, slots
        tiers = plan.src_tiers[positions].copy()
        tiers[unknown], slots[unknown] = placements_of(state.index, ids[positions[unknown]])
    else:
        tiers, slots = placements_of(state.index, ids[positions])
    here = tiers == plan.src_tiers[positions]
    return positions[here], slots[here]


def settle(state, batch: TransferBatch, block_ids: np.ndarray, dst_tiers: np.ndarray) -> np.ndarray:
    """Apply the chosen moves that copy nothing, in plan order: an eviction drops an unreferenced
    block (one with a durable copy goes down to it instead), a move into cold takes the block's
    durable copy's slot. Returns the mask of those (the others still copy)."""
    settled = dst_tiers == DROPPED
    if state.copies:
        settled |= (dst_tiers == COLD) & contains_mask(state.copies, block_ids.tolist())
    if not settled.any():
        return settled
    index = state.index
    for block_id, dst in zip(block_ids[settled].tolist(), dst_tiers[settled].tolist()):
        if dst == COLD:
            state.adopt_copy(block_id)  # down to its durable copy: nothing to write
            batch.num_adopted += 1
        elif index.get(block_id).ref_count == 0:
            if state.evict(block_id):
                batch.num_evictions += 1
            else:
                batch.num_adopted += 1
    return settled


def reserve_runs(pool, tier: int, count: int) -> np.ndarray:
    """`count` free slots of `tier` (the caller checked there are): in hot and warm as few
    consecutive runs as the pool has (one, when a free run is long enough), in cold the pool's
    order (a file slot's place matters little; its pool can be very large)."""
    if tier == COLD or count < (2 if tier == HOT else RUNS_FROM_BLOCKS):
        return pool.allocate_array(count)
    slots = pool.allocate_run_array(count)
    return slots if slots is not None else pool.allocate_runs_array(count)


def reserve_any(state, tier: int, block_ids: np.ndarray, src_tiers: np.ndarray, src_slots: np.ndarray) \
        -> tuple[np.ndarray, np.ndarray]:
    """Destination slots in `tier` for the first moves (plan order) that find room: (their
    positions in transfer order, their destination slots). Slots are taken in runs: into hot in
    token order (a chat's ids grow with its tokens; attention reads one slice), below in source
    order (both sides of the copy advance together). The transfer order is the order the blocks
    enter the tier's recency order: into hot token order too (a chat's oldest tokens are its first
    victims, so its hot part stays one run), below the plan's (its victims' LRU order)."""
    room = state.cold_room(len(block_ids)) if tier == COLD else state.pools[tier].num_free
    count = min(len(block_ids), room)
    if not count:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    ids = block_ids[:count]
    order = np.argsort(ids, kind="stable") if tier == HOT else np.lexsort((src_slots[:count], src_tiers[:count]))
    slots = np.empty(count, dtype=np.int64)
    slots[order] = reserve_runs(state.pools[tier], tier, count)
    transfer_order = order if tier == HOT else np.arange(count)
    return transfer_order, slots[transfer_order]


def add_groups(state, batch: TransferBatch, kind: str, dst_tier: int, block_ids: np.ndarray, src_tiers: np.ndarray,
               src_slots: np.ndarray, dst_slots: np.ndarray) -> None:
    """One group per source tier (in order of first appearance, each keeping the given order),
    each registered in flight."""
    if not len(block_ids):
        return
    first_src = int(src_tiers[0])
    if (src_tiers == first_src).all():
        parts = [(first_src, slice(None))]
    else:
        _, first = np.unique(src_tiers, return_index=True)
        parts = [(int(src_tiers[i]), src_tiers == src_tiers[i]) for i in np.sort(first)]
    for src, which in parts:
        group = TransferGroup(batch, kind, src, dst_tier, block_ids[which], src_slots[which], dst_slots[which])
        state.in_flight.add(group)
        batch.groups.append(group)


def prepare_moves(state, batch: TransferBatch, plan: Plan, leave_alone) -> None:
    """Fill `batch` with the moves of `plan` that can go now (see Transfers.prepare)."""
    positions, src_slots = select(state, plan, leave_alone)
    ids, src_tiers = plan.block_ids[positions], plan.src_tiers[positions]
    dst_tiers, dst_slots = plan.dst_tiers[positions], plan.dst_slots[positions]
    settled = settle(state, batch, ids, dst_tiers)
    if settled.any():
        go = ~settled
        ids, src_tiers, src_slots, dst_tiers, dst_slots = ids[go], src_tiers[go], src_slots[go], dst_tiers[go], \
            dst_slots[go]
    placed = dst_slots != ANY_SLOT  # a particular slot (compaction): only when it is free
    if placed.any():
        for tier in _in_order(dst_tiers[placed]):
            which = np.flatnonzero(placed & (dst_tiers == tier))
            taken = which[state.pools[tier].take_free(dst_slots[which])]
            add_groups(state, batch, MOVE, tier, ids[taken], src_tiers[taken], src_slots[taken], dst_slots[taken])
    wanted = ~placed
    for tier in _in_order(dst_tiers[wanted]):
        which = np.flatnonzero(wanted & (dst_tiers == tier))
        order, slots = reserve_any(state, tier, ids[which], src_tiers[which], src_slots[which])
        which = which[order]
        add_groups(state, batch, MOVE, tier, ids[which], src_tiers[which], src_slots[which], slots)
    batch.num_left_out = plan.num_moves - batch.settled_at_prepare - batch.num_copies


def _in_order(values: np.ndarray) -> list[int]:
    """The distinct values, in order of first appearance."""
    if not len(values):
        return []
    if (values == values[0]).all():
        return [int(values[0])]
    _, first = np.unique(values, return_index=True)
    return values[np.sort(first)].tolist()


__all__ = ["prepare_moves", "select", "settle", "reserve_any", "reserve_runs", "add_groups", "RUNS_FROM_BLOCKS"]
