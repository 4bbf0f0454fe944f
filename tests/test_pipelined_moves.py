"""Pipelined on-demand moves (issue 34, item 5): a large plan is cut into sub-batches; the copy
engine gets sub-batch k+1 before sub-batch k completes; every rule of invariant 7 still holds per
sub-batch (reserve, copy, commit what copied; sources free only after the copy; a raising copy
fails its own sub-batch and changes nothing of it). Store-level and exact, on the asynchronous
CPU copy engine (`copies.engine: thread`), with the engine held shut (tests/faults.py EngineGate)
to see what is queued while nothing has copied yet.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

import tiered_kv
from faults import EngineGate, Faults, on_demand
from tiered_kv.blocks import COLD, HOT, WARM, KVLayout

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype_name="float32")
NUM_BLOCKS, SUB_BATCH = 12, 3


@pytest.fixture
def store(tmp_path):
    store = tiered_kv.TierStore({
        "block_size": LAYOUT.block_size,
        "hot": {"device": "cpu", "capacity_blocks": NUM_BLOCKS, "high_watermark": 1.0, "low_watermark": 1.0},
        "warm": {"capacity_blocks": NUM_BLOCKS, "pinned": False, "high_watermark": 1.0, "low_watermark": 1.0},
        "cold": {"capacity_blocks": NUM_BLOCKS, "path": str(tmp_path / "cold"), "backend": "posix"},
        "scheduler": {"background": False},
        "copies": {"engine": "thread", "delay_us": 100}})
    store.bind(LAYOUT, torch.float32)
    store.demand.sub_batch_blocks = SUB_BATCH  # (64 MiB of these tiny blocks would be one batch)
    yield store
    store.close()


def _filled(store) -> tuple[list[int], dict[int, torch.Tensor]]:
    block_ids = store.allocate(NUM_BLOCKS)
    contents = {}
    for b in block_ids:
        entry = store.index.get(b)
        data = torch.randn((1, *LAYOUT.record_shape()), generator=torch.Generator().manual_seed(100 + b))
        store.tiers[entry.tier].write_blocks([entry.slot], data)
        contents[b] = data
    return block_ids, contents


def _tiers(store, block_ids) -> list[int]:
    return store.placements(block_ids)[0].tolist()


def _intact(store, contents) -> None:
    for b, data in contents.items():
        entry = store.index.get(b)
        assert torch.equal(store.tiers[entry.tier].read_blocks([entry.slot]).cpu(), data), b
    assert store.check_consistency() == []


def _until(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def test_the_engine_gets_the_next_sub_batch_before_the_first_one_completes(store):
    block_ids, contents = _filled(store)
    assert store.demote(block_ids, WARM) == []
    warm_slots = store.placements(block_ids)[1].tolist()
    gate = EngineGate(store)
    submitted = []
    real_submit = store.copy_engine.submit
    store.copy_engine.submit = lambda unit, after=(): (submitted.append(time.monotonic()),
                                                       real_submit(unit, after=after))[1]
    promotion = threading.Thread(target=store.promote, args=(block_ids,), daemon=True)
    promotion.start()
    try:
        _until(lambda: len(submitted) >= 2)  # sub-batch 1 queued while sub-batch 0 has not copied
        time.sleep(0.05)
        assert len(submitted) == 2  # at most two in flight: the third waits for the first to complete
        assert len(store.state.in_flight) == 2 * SUB_BATCH
        assert store.copy_engine.queue_depth() == 3  # the gate, then both sub-batches
        assert _tiers(store, block_ids) == [WARM] * NUM_BLOCKS  # nothing committed before its copy
        assert all(store.pools[WARM].is_used(slot) for slot in warm_slots)  # no source slot freed early
    finally:
        gate.open()
        promotion.join(30)
    assert not promotion.is_alive()
    assert len(submitted) == NUM_BLOCKS // SUB_BATCH
    assert _tiers(store, block_ids) == [HOT] * NUM_BLOCKS
    assert not store.state.in_flight and store.pools[WARM].num_free == NUM_BLOCKS
    assert store.stats()["bytes_moved"]["warm->hot"] == NUM_BLOCKS * LAYOUT.block_bytes
    _intact(store, contents)


def test_a_failing_sub_batch_fails_only_its_own_moves(store):
    block_ids, contents = _filled(store)
    assert store.demote(block_ids, WARM) == []
    with Faults(store, on_demand, "in_unit", skip=1, limit=1) as faults:  # the second sub-batch raises
        assert store.promote(block_ids) == []
    assert faults.failed == 1
    tiers = _tiers(store, block_ids)
    assert tiers == [HOT] * SUB_BATCH + [WARM] * SUB_BATCH + [HOT] * (NUM_BLOCKS - 2 * SUB_BATCH)
    assert sum(store.stats()["metrics"]["failed_moves_total"].values()) == SUB_BATCH
    _intact(store, contents)
    assert store.promote(block_ids) == []  # without the fault they come up too
    assert _tiers(store, block_ids) == [HOT] * NUM_BLOCKS
    _intact(store, contents)


@pytest.mark.parametrize("way", ["before", "after", "in_unit"])
def test_an_interrupt_in_a_pipelined_move_reaches_the_caller_and_leaks_nothing(store, way):
    block_ids, contents = _filled(store)
    free_before = store.state.free_slots()
    faults = Faults(store, on_demand, way, skip=1, limit=1, error=KeyboardInterrupt())
    try:
        if way == "in_unit":  # raised on the engine's own thread: a failed copy, not an interrupt here
            store.demote(block_ids, COLD)
        else:
            with pytest.raises(KeyboardInterrupt):
                store.demote(block_ids, COLD)
    finally:
        faults.remove()
    assert not store.state.in_flight
    tiers = _tiers(store, block_ids)
    assert tiers[SUB_BATCH:2 * SUB_BATCH] == [HOT] * SUB_BATCH  # the interrupted sub-batch moved nothing
    moved = tiers.count(COLD)
    assert store.state.free_slots() == [free_before[HOT] + moved, free_before[WARM], free_before[COLD] - moved]
    _intact(store, contents)
    assert store.demote(block_ids, COLD) == []
    assert _tiers(store, block_ids) == [COLD] * NUM_BLOCKS
    _intact(store, contents)


def test_a_block_freed_while_its_sub_batch_waits_keeps_its_slot_until_that_copy_is_done(store):
    block_ids, contents = _filled(store)
    gate = EngineGate(store)
    demotion = threading.Thread(target=store.demote, args=(block_ids, WARM), daemon=True)
    demotion.start()
    try:
        _until(lambda: len(store.state.in_flight) == 2 * SUB_BATCH)
        victim = block_ids[SUB_BATCH]  # in the second sub-batch, queued behind the first
        victim_slot = store.index.get(victim).slot
        store.release([victim])  # its chat let go of it mid-flight: its move is cancelled
        del contents[victim]
        assert victim not in store.index and store.pools[HOT].is_used(victim_slot)  # the copy still reads it
    finally:
        gate.open()
        demotion.join(30)
    assert not demotion.is_alive()
    assert _tiers(store, [b for b in block_ids if b in store.index]) == [WARM] * (NUM_BLOCKS - 1)
    assert not store.pools[HOT].is_used(victim_slot)
    _intact(store, contents)


def test_the_sync_engine_moves_a_plan_as_one_batch(tmp_path):
    store = tiered_kv.TierStore({
        "block_size": LAYOUT.block_size,
        "hot": {"device": "cpu", "capacity_blocks": 4}, "warm": {"capacity_blocks": 4, "pinned": False},
        "cold": {"capacity_blocks": 0}, "scheduler": {"background": False}, "copies": {"engine": "sync"}})
    try:
        store.bind(LAYOUT, torch.float32)
        assert store.demand.sub_batch_blocks == 0  # it copies inside launch: nothing to overlap
        assert len(store.demand.parts(store.scheduler.plan_demotion(
            store.allocate(4), WARM, store.index, store.state.free_slots(), store.capacities))) == 1
    finally:
        store.close()
