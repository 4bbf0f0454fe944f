"""The store's self-check (tests' `check_consistency`): the block index, the slot pools, the pins,
the transfers, the deferred frees and the durable copies agree. Reads StoreState; changes nothing."""

from __future__ import annotations

from ..blocks import COLD, DROPPED, HOT, TIER_NAMES, WARM


def check_consistent(state) -> list[str]:
    """What is wrong between the index, the pools, the pins and the transfers (tests' `verify`):
    every used slot belongs to exactly one block, a quarantined slot, a reservation of a block in
    flight, or a deferred free; nothing is pinned or in flight once everything ended."""
    problems = []
    groups = state.in_flight.groups()  # (a block freed while in flight keeps its reservation until complete)
    in_flight_dst = {(g.dst_tier, slot) for g in groups for slot in g.dst_slots.tolist()}
    problems += [f"block {b} is still in flight in a batch that completed" for b, g in state.in_flight.items()
                 if g.batch.completed]
    deferred = {(tier, int(slot)) for tier, slots, _ in state._deferred_frees for slot in slots}
    quarantined = state.quarantined_slots()
    copy_slots = dict(state.copies.slot_of) if state.copies else {}  # block -> cold slot of its copy
    copies = {(COLD, slot) for slot in copy_slots.values()}
    problems += [f"block {b} has a durable copy but is not in hot or warm" for b in copy_slots
                 if b not in state.index or state.index.get(b).tier not in (HOT, WARM)]
    if len(copies) < len(copy_slots):
        problems.append("two durable copies share a cold slot")
    problems += [f"cold slot {key[1]} holds a durable copy and is also {what}" for key in copies
                 for what, keys in (("a transfer's destination", in_flight_dst), ("waiting to be freed", deferred),
                                    ("quarantined", quarantined)) if key in keys]
    for tier, pool in enumerate(state.pools):
        owned: dict[int, int] = {}
        for block_id, entry in state.index.items():
            if entry.tier == tier:
                if entry.slot in owned:
                    problems.append(f"{TIER_NAMES[tier]} slot {entry.slot} holds blocks {owned[entry.slot]} "
                                    f"and {block_id}")
                owned[entry.slot] = block_id
        for slot in range(pool.num_slots):
            key = (tier, slot)
            accounted = slot in owned or key in in_flight_dst or key in deferred or key in quarantined or key in copies
            if pool.is_used(slot) and not accounted:
                problems.append(f"{TIER_NAMES[tier]} slot {slot} is used but no block, transfer or free holds it")
            if slot in owned and key in copies:
                problems.append(f"cold slot {slot} holds block {owned[slot]} and a durable copy")
            if not pool.is_used(slot) and key in copies:
                problems.append(f"cold slot {slot} holds a durable copy but is free")
            if not pool.is_used(slot) and slot in owned:
                problems.append(f"{TIER_NAMES[tier]} slot {slot} holds block {owned[slot]} but is free")
    for block_id, entry in state.index.items():
        if entry.tier == DROPPED and entry.key is not None:
            problems.append(f"corrupt block {block_id} still has a key")
    return problems
