"""The transfer engine (issue 16): a move counts only once its bytes landed, on every path.

Store-level and exact: known bytes in blocks, moves through `store.transfers`, faults injected
at `store.transfers.launch` (tests/faults.py), the asynchronous CPU copy engine
(`copies.engine: thread`) holding copies back so that every ordering rule is observable here, as
DMA makes it matter on a GPU. After every case the store is consistent (`check_consistency`):
no slot, pin or reservation leaked.
"""

from __future__ import annotations

import logging
import threading

import pytest
import torch

import tiered_kv
from faults import WAYS, EngineGate, Faults, InjectedFault, every_batch
from tiered_kv.blocks import COLD, HOT, WARM, KVLayout
from tiered_kv.scheduler import Move

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype_name="float32")
ENGINES = ("sync", "thread")


@pytest.fixture
def make_store(tmp_path):
    stores = []

    def make(hot, warm, cold, engine="sync", delay_us=0, background=False):
        copies = {"engine": engine, "delay_us": delay_us} if engine == "thread" else {"engine": engine}
        store = tiered_kv.TierStore({
            "block_size": LAYOUT.block_size,
            "hot": {"device": "cpu", "capacity_blocks": hot, "high_watermark": 1.0, "low_watermark": 1.0},
            "warm": {"capacity_blocks": warm, "pinned": False, "high_watermark": 1.0, "low_watermark": 1.0},
            "cold": {"capacity_blocks": cold, "path": str(tmp_path / f"cold{len(stores)}"), "backend": "posix"},
            "scheduler": {"background": background, "mover_interval_s": 0.001},
            "copies": copies})
        stores.append(store)
        store.bind(LAYOUT, torch.float32)
        return store

    yield make
    for store in stores:
        store.close()


def data(seed: int) -> torch.Tensor:
    return torch.randn((1, *LAYOUT.record_shape()), generator=torch.Generator().manual_seed(seed))


def write(store, block_id: int, seed: int) -> torch.Tensor:
    """Known bytes into a block (written where it lies, as a step's writes would be)."""
    block = data(seed)
    entry = store.index.get(block_id)
    store.tiers[entry.tier].write_blocks([entry.slot], block)
    return block


def read(store, block_id: int) -> torch.Tensor:
    entry = store.index.get(block_id)
    return store.tiers[entry.tier].read_blocks([entry.slot]).to("cpu")


def tiers_of(store, block_ids) -> list[int]:
    return [store.index.get(b).tier for b in block_ids]


def filled(store, count: int) -> tuple[list[int], dict[int, torch.Tensor]]:
    block_ids = [store.allocate(1)[0] for _ in range(count)]  # one by one: older ones go down
    # write each where it is now (allocations moved the older ones down)
    return block_ids, {b: write(store, b, seed=100 + b) for b in block_ids}


def assert_intact(store, contents: dict[int, torch.Tensor]) -> None:
    for block_id, block in contents.items():
        assert torch.equal(read(store, block_id), block), f"block {block_id} lost its bytes"
    assert store.check_consistency() == []


# ---- a copy that raises changes nothing -----------------------------------------------------------
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("way", WAYS)
def test_a_failed_batch_commits_nothing_and_gives_every_slot_back(make_store, engine, way, caplog):
    store = make_store(4, 4, 8, engine=engine, delay_us=200)
    block_ids, contents = filled(store, 4)
    assert tiers_of(store, block_ids) == [HOT] * 4
    free_before = store.state.free_slots()
    with Faults(store, every_batch, way) as faults, caplog.at_level(logging.WARNING):
        assert store.demote(block_ids[:3], WARM) == []
        assert store.demote(block_ids[3:], COLD) == []  # through host staging and pwritev
    assert faults.failed >= 2
    assert tiers_of(store, block_ids) == [HOT] * 4  # nothing moved
    assert store.state.free_slots() == free_before  # every reserved slot went back
    assert_intact(store, contents)
    failed = store.stats()["metrics"]["failed_moves_total"]
    assert sum(failed.values()) == 4 and all("InjectedFault" in key for key in failed)
    assert any("nothing moved, they stay in hot" in r.getMessage() for r in caplog.records)
    # without the fault the same moves happen, and the bytes follow
    assert store.demote(block_ids[:3], WARM) == [] and store.demote(block_ids[3:], COLD) == []
    assert tiers_of(store, block_ids) == [WARM, WARM, WARM, COLD]
    assert_intact(store, contents)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("way", WAYS)
def test_a_failed_promotion_out_of_cold_leaves_the_blocks_readable_where_they_were(make_store, engine, way):
    store = make_store(2, 2, 8, engine=engine, delay_us=200)
    block_ids, contents = filled(store, 6)
    assert tiers_of(store, block_ids) == [COLD, COLD, WARM, WARM, HOT, HOT]
    with Faults(store, every_batch, way, limit=1):
        store.promote(block_ids[:2])  # the first batch fails; the next rounds plan around those blocks
    assert_intact(store, contents)
    store.promote(block_ids[:2])
    assert tiers_of(store, block_ids[:2]) == [HOT, HOT]
    assert_intact(store, contents)


@pytest.mark.parametrize("error", [OSError(5, "injected EIO"), MemoryError("injected"), ValueError("injected")])
def test_any_exception_type_fails_its_batch_the_same_way(make_store, error):
    store = make_store(2, 2, 4, engine="thread", delay_us=100)
    block_ids, contents = filled(store, 2)
    with Faults(store, every_batch, "in_unit", error=error):
        store.demote(block_ids, WARM)
    assert tiers_of(store, block_ids) == [HOT, HOT]
    assert_intact(store, contents)


# ---- ordering: nothing reuses a slot a copy still uses -------------------------------------------------
def test_a_slot_a_move_leaves_is_handed_out_only_after_its_copy_landed(make_store):
    """Block X leaves hot slot 0 for warm while its copy is held back on the engine's thread. A new
    block wanted meanwhile must not get slot 0: a step's K/V written there at once would be what
    the late copy carries down as X's bytes (issue 16: a source slot freed right after queueing
    the async copy)."""
    store = make_store(1, 2, 2, engine="thread", delay_us=300)
    (x,) = store.allocate(1)
    contents = {x: write(store, x, 11)}
    assert (store.index.get(x).tier, store.index.get(x).slot) == (HOT, 0)
    gate = EngineGate(store)
    demotion = threading.Thread(target=store.demote, args=([x], WARM), daemon=True)
    demotion.start()
    _until(lambda: x in store.state.in_flight)
    (new,) = store.allocate(1)  # hot's one slot is still X's source: the new block goes to warm
    assert (store.index.get(new).tier, store.index.get(new).slot) != (HOT, 0)
    contents[new] = write(store, new, 12)
    gate.open()
    demotion.join(30)
    assert tiers_of(store, [x]) == [WARM]
    assert_intact(store, contents)


def test_a_cascade_plan_keeps_every_block_with_copies_held_back(make_store):
    """[warm->hot A, hot->warm C, cold->hot B] in one promotion: each block lands with its own
    bytes though every copy runs later than it was planned."""
    store = make_store(2, 1, 2, engine="thread", delay_us=500)
    block_ids, contents = filled(store, 4)  # 0 cold, 1 warm, 2 and 3 hot
    assert tiers_of(store, block_ids) == [COLD, WARM, HOT, HOT]
    store.release([block_ids[3]])
    del contents[block_ids[3]]
    store.promote([block_ids[1], block_ids[0]])
    assert tiers_of(store, block_ids[:2]) == [HOT, HOT]
    assert_intact(store, contents)


def _until(condition, timeout_s: float = 30.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def test_a_block_freed_while_its_move_is_in_flight_keeps_its_slot_until_the_copy_is_done(make_store):
    store = make_store(4, 4, 4, engine="thread", delay_us=100)
    block_ids, contents = filled(store, 3)
    victim = block_ids[0]
    victim_slot = store.index.get(victim).slot
    gate = EngineGate(store)
    mover = threading.Thread(target=store.demote, args=([victim], WARM), daemon=True)
    mover.start()
    _until(lambda: victim in store.state.in_flight)  # prepared and launched, held by the gate
    store.release([victim])  # its chat let go of it mid-copy: the move is cancelled
    assert store.pools[HOT].is_used(victim_slot)  # the copy still reads that slot
    new = store.allocate(1)[0]
    assert (store.index.get(new).tier, store.index.get(new).slot) != (HOT, victim_slot)
    gate.open()
    mover.join(30)
    assert not mover.is_alive()
    assert victim not in store.index
    assert_intact(store, {b: contents[b] for b in block_ids[1:]})
    assert not store.pools[HOT].is_used(victim_slot) or store.index.get(new).slot == victim_slot


def test_the_remote_writers_read_waits_for_copies_in_flight(make_store):
    """A read-out goes through the engine like any move, after the copies queued before it: the
    bytes it returns are the block's landed bytes, never what a slot held before."""
    store = make_store(2, 2, 4, engine="thread", delay_us=500)
    block_ids, contents = filled(store, 2)
    store.publish(block_ids[0], b"k" * 16, b"r" * 16)
    store.demote([block_ids[0]], WARM)
    raw = store.remote_io.read_block_bytes(block_ids[0], b"k" * 16)
    assert raw is not None
    assert torch.equal(torch.from_numpy(raw.copy()).view(torch.float32).reshape(1, *LAYOUT.record_shape()),
                       contents[block_ids[0]])
    assert store.remote_io.read_block_bytes(block_ids[0], b"other key 123456") is None
    assert store.check_consistency() == []


# ---- copy-on-write and a corrupt source -------------------------------------------------------------
@pytest.mark.parametrize("way", WAYS)
def test_a_failed_copy_on_write_frees_the_copy_and_changes_nothing_else(make_store, way):
    store = make_store(4, 4, 4, engine="thread")
    (block,) = store.allocate(1)
    contents = {block: write(store, block, 7)}
    with Faults(store, every_batch, way), pytest.raises(InjectedFault):
        store.allocation.copy_block(block)
    assert len(store.index) == 1
    assert_intact(store, contents)
    copy = store.allocation.copy_block(block)
    assert torch.equal(read(store, copy), contents[block])


def test_stats_report_the_engine_and_nothing_left_in_flight(make_store):
    store = make_store(2, 2, 2, engine="thread", delay_us=50)
    filled(store, 5)
    copies = store.stats()["copies"]
    assert copies == {"engine": "thread", "in_flight_blocks": 0, "deferred_frees": 0, "failed_moves": 0}


def test_prepare_leaves_out_moves_that_cannot_go_now(make_store):
    from tiered_kv.metrics.registry import ON_DEMAND

    store = make_store(2, 1, 2)
    block_ids, _ = filled(store, 2)
    moves = [Move(block_ids[0], HOT, WARM), Move(block_ids[1], HOT, WARM)]  # warm has one free slot
    with store.lock:
        batch = store.transfers.prepare(moves, ON_DEMAND)
        assert [t.block_id for t in batch.transfers] == [block_ids[0]]
        assert block_ids[0] in store.state.in_flight and store.pools[WARM].num_free == 0
    store.demand.run_batch(batch)
    assert tiers_of(store, block_ids) == [WARM, HOT]
    assert store.check_consistency() == []


# ---- an interrupt (Ctrl-C) while a batch copies ------------------------------------------------------
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("way", ("before", "after", "in_unit"))
def test_an_interrupt_during_a_move_reaches_the_caller_and_leaks_nothing(make_store, engine, way):
    """A KeyboardInterrupt raised while a batch copies goes up to the caller (it is never swallowed
    as a failed copy where the caller runs the unit), and the batch still completes as failed: no
    block stays in flight, every reserved slot comes back, the store goes on."""
    store = make_store(2, 2, 4, engine=engine, delay_us=100)
    block_ids, contents = filled(store, 2)
    free_before = store.state.free_slots()
    faults = Faults(store, every_batch, way, error=KeyboardInterrupt())
    try:
        if way == "in_unit" and engine == "thread":  # raised on the engine's own thread: a failed copy
            store.demote(block_ids, WARM)
        else:
            with pytest.raises(KeyboardInterrupt):
                store.demote(block_ids, WARM)
    finally:
        faults.remove()
    assert not store.state.in_flight
    assert store.state.free_slots() == free_before and tiers_of(store, block_ids) == [HOT, HOT]
    assert_intact(store, contents)
    store.demote(block_ids, WARM)
    assert tiers_of(store, block_ids) == [WARM, WARM]
    assert_intact(store, contents)
