"""The move path by arrays (issue 34, item 5): plans, committed moves, slot pools and slot runs as
int64 arrays, checked against the one-at-a-time behaviour they replace; and the path itself runs a
fixed number of Python calls per batch, whatever its number of blocks."""

from __future__ import annotations

import random
import sys
from collections import Counter

import numpy as np
import pytest
import torch

import tiered_kv
from tiered_kv.block_index import BlockIndex
from tiered_kv.blocks import COLD, DROPPED, HOT, WARM, KVLayout
from tiered_kv.hw.block_copy import slot_runs
from tiered_kv.pool import SlotPool
from tiered_kv.scheduler import Move, Plan
from tiered_kv.scheduler.arrays import ABSENT, first_occurrences, placements_of
from tiered_kv.scheduler.plan import MoveList


# ---- plans and committed moves -------------------------------------------------------------------
def test_a_plan_from_moves_and_from_arrays_is_the_same_plan():
    moves = [Move(4, HOT, WARM), Move(2, WARM, COLD), Move(9, HOT, DROPPED), Move(5, HOT, HOT, dst_slot=7)]
    plan = Plan(moves=moves, new_block_tiers=[HOT])
    assert plan.moves == moves and plan.num_moves == 4
    assert plan == Plan.of_arrays([4, 2, 9, 5], [HOT, WARM, HOT, HOT], [WARM, COLD, DROPPED, HOT], [-1, -1, -1, 7],
                                  new_block_tiers=[HOT])
    assert plan.count(HOT, WARM) == 1 and plan.count(HOT, COLD) == 0
    assert plan.take(plan.dst_tiers != DROPPED).moves == [moves[0], moves[1], moves[3]]
    assert plan.head(2).moves == moves[:2] and plan.head(2).new_block_tiers == [HOT]
    assert Plan() == Plan(moves=[]) and Plan().is_empty() and not plan.is_empty()
    with pytest.raises(ValueError, match="differ in length"):
        Plan.of_arrays([1, 2], [HOT], [WARM, WARM])


def test_a_plans_source_slots_travel_with_its_parts():
    plan = Plan.of_arrays([3, 4, 5], [HOT, HOT, WARM], [WARM, WARM, HOT]).with_sources([7, 8, -1], 42)
    part = plan.take(slice(1, 3))
    assert part.src_slots.tolist() == [8, -1] and part.placement_version == 42
    assert Plan(moves=plan.moves).src_slots is None  # built from moves: nothing known of the sources


def test_a_move_list_reads_as_the_moves_in_landing_order():
    moves = MoveList()
    moves.add(np.array([3, 1]), HOT, WARM)
    moves.add(np.array([7]), WARM, COLD)
    more = MoveList([Move(2, COLD, HOT)])
    moves.extend(more)
    expected = [Move(3, HOT, WARM), Move(1, HOT, WARM), Move(7, WARM, COLD), Move(2, COLD, HOT)]
    assert list(moves) == expected and moves == expected and len(moves) == 4 and moves
    assert list(reversed(moves)) == expected[::-1] and moves[2] == expected[2]
    assert moves.block_ids().tolist() == [3, 1, 7, 2]
    assert moves.counts() == {(HOT, WARM): 2, (WARM, COLD): 1, (COLD, HOT): 1}
    assert moves.any_down() and not MoveList([Move(2, COLD, HOT)]).any_down() and not MoveList()


# ---- slot pools by arrays ------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(20))
def test_allocate_array_hands_out_what_allocate_would(seed):
    rng = random.Random(seed)
    size = rng.choice([5, 17, 64])
    one, many = SlotPool(size), SlotPool(size)
    held: list[int] = []
    for _ in range(60):
        action = rng.random()
        if action < 0.4:
            count = rng.randint(0, size)
            a, b = one.allocate(count), many.allocate_array(count)
            assert a == (None if b is None else b.tolist())
            held += a or []
        elif action < 0.55:
            count = rng.randint(1, max(1, size // 2))
            a, b = one.allocate_run(count), many.allocate_run_array(count)
            assert a == (None if b is None else b.tolist())
            held += a or []
        elif action < 0.65:
            count = rng.randint(1, size)
            a, b = one.allocate_runs(count), many.allocate_runs_array(count)
            assert a == (None if b is None else b.tolist())
            held += a or []
        elif held:
            rng.shuffle(held)
            give = held[:rng.randint(1, len(held))]
            del held[:len(give)]
            one.free(give)
            many.free(np.array(give, dtype=np.int64))
        assert one.free_order() == many.free_order() and one.num_free == many.num_free
        assert one.occupancy() == many.occupancy()


def test_freeing_an_array_checks_every_slot_first():
    pool = SlotPool(6, "warm")
    pool.allocate(4)
    for bad, message in (([1, 9], "slot 9 is out of range"), ([0, 5], "double free of slot 5"),
                         ([2, 0, 2], "double free of slot 2"), ([-1], "slot -1 is out of range")):
        with pytest.raises(ValueError, match=message):
            pool.free(np.array(bad))
        assert pool.num_free == 2  # nothing was freed
    pool.free(np.array([3, 2, 1, 0]))
    assert pool.num_free == 6 and pool.free_order()[:4] == [0, 1, 2, 3]


def test_take_free_takes_only_free_slots_and_each_once():
    pool = SlotPool(8)
    pool.take([2])
    taken = pool.take_free(np.array([1, 2, 1, 9, -1, 5]))
    assert taken.tolist() == [True, False, False, False, False, True]
    assert [pool.is_used(s) for s in range(8)] == [False, True, True, False, False, True, False, False]
    assert pool.num_free == 5


def _slot_runs_one_by_one(dst_slots, src_slots):
    runs = []
    for d, s in zip(dst_slots, src_slots):
        if runs and d == runs[-1][0] + runs[-1][2] and s == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((d, s, 1))
    return runs


@pytest.mark.parametrize("seed", range(10))
def test_slot_runs_by_arrays_match_block_by_block(seed):
    rng = random.Random(seed)
    dst = sorted(rng.sample(range(200), 40))
    src = [s + rng.choice([0, 0, 0, 3]) for s in range(100, 140)]
    assert slot_runs(np.array(dst), np.array(src)) == _slot_runs_one_by_one(dst, src)


def test_placements_of_names_absent_and_corrupt_blocks():
    index = BlockIndex()
    a, b, c = index.add(HOT, 3), index.add(WARM, 0), index.add(COLD, 5)
    index.mark_corrupt(b)
    index.remove(c)
    tiers, slots = placements_of(index, np.array([a, b, c, 77]))
    assert tiers.tolist() == [HOT, DROPPED, ABSENT, ABSENT] and slots.tolist() == [3, -1, ABSENT, ABSENT]
    assert first_occurrences(np.array([4, 2, 4, 7, 2])).tolist() == [True, True, False, True, False]


# ---- a fixed number of Python calls per batch ----------------------------------------------------------
LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, block_size=2, dtype_name="float32")


def _calls_per_function(num_blocks: int) -> Counter:
    store = tiered_kv.TierStore({
        "block_size": LAYOUT.block_size,
        "hot": {"device": "cpu", "capacity_blocks": num_blocks, "high_watermark": 1.0, "low_watermark": 1.0},
        "warm": {"capacity_blocks": num_blocks, "pinned": False, "high_watermark": 1.0, "low_watermark": 1.0},
        "cold": {"capacity_blocks": 0}, "scheduler": {"background": False}, "copies": {"engine": "sync"}})
    calls: Counter = Counter()

    def profile(frame, event, arg):
        if event == "call":
            calls[(frame.f_code.co_filename.rsplit("/", 1)[-1], frame.f_code.co_name)] += 1

    try:
        store.bind(LAYOUT, torch.float32)
        block_ids = store.allocate(num_blocks)
        store.demote(block_ids, WARM)
        store.promote(block_ids)  # (once, so that both runs below find the same warm caches)
        sys.setprofile(profile)
        try:
            store.demote(block_ids, WARM)
            store.promote(block_ids)
        finally:
            sys.setprofile(None)
        assert store.placements(block_ids)[0].tolist() == [HOT] * num_blocks
    finally:
        store.close()
    return calls


def test_a_move_costs_a_fixed_number_of_python_calls_whatever_its_blocks():
    """Demoting and promoting 64 or 512 blocks runs the same Python calls, but for the one index
    lookup per block (BlockIndex.peek: where each block lies, asked once per plan): no Move, no
    Transfer, no per-block bookkeeping of our own (REVIEW.md, "One moved block")."""
    small, large = _calls_per_function(64), _calls_per_function(512)
    grown = {name: large[name] - small.get(name, 0) for name in large if large[name] > small.get(name, 0)}
    assert grown.pop(("block_index.py", "peek")) == 2 * (512 - 64)
    # (the pool rebuilds its free list every few batches: a call or two more in one run or the other)
    assert all(more <= 4 for more in grown.values()), grown


# ---- blocks in flight, per group ------------------------------------------------------------------------
def test_in_flight_registers_cancels_and_settles_per_group():
    from tiered_kv.metrics.registry import BACKGROUND, ON_DEMAND
    from tiered_kv.store.batches import TransferBatch, TransferGroup
    from tiered_kv.store.in_flight import InFlight

    def group(mode, kind, ids):
        ids = np.array(ids, dtype=np.int64)
        return TransferGroup(TransferBatch(mode), kind, HOT, WARM, ids, ids + 100, ids + 200)

    in_flight = InFlight()
    demand, background, backup = group(ON_DEMAND, "move", [1, 2, 3]), group(BACKGROUND, "move", [4, 5]), \
        group(BACKGROUND, "backup", [6])
    for g in (demand, background, backup):
        in_flight.add(g)
    assert len(in_flight) == 6 and 5 in in_flight and 7 not in in_flight
    assert in_flight.contains_mask([0, 3, 6, 9]).tolist() == [False, True, True, False]
    assert in_flight[2].src_slot == 102 and in_flight[2].batch is demand.batch and in_flight.get(9) is None
    assert in_flight.any_moving({3, 9}, ON_DEMAND) and not in_flight.any_moving({6}, BACKGROUND)
    assert in_flight.any_moving(set(range(100)), BACKGROUND) and not in_flight.any_moving({1}, BACKGROUND)
    assert in_flight.cancel_moves({4, 6, 1}, BACKGROUND) == 1  # (a backup does not move its block)
    assert background.cancelled.tolist() == [True, False] and not backup.cancelled.any()
    assert in_flight.cancel_moves({4}, BACKGROUND) == 0  # cancelled already
    flight = in_flight.pop(2)  # freed while in flight: out of flight at once, its copy cancelled
    assert flight.cancelled and demand.gone.tolist() == [False, True, False] and 2 not in in_flight
    in_flight.settle(demand)
    assert sorted(in_flight) == [4, 5, 6] and in_flight.groups() == [background, backup]
    in_flight.settle(background)
    in_flight.settle(backup)
    assert not in_flight and in_flight.groups() == []
