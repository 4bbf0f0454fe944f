"""Idle chats cost a busy chat's decode nothing (issue 17, item 7): the mover's work while nothing
needs to move is O(what changed), not O(the store).

A store holds many idle chats whose rows are fragmented (written in interleaved turns), beside
one chat that decodes. Counted, not timed: how many rows the compactor lays out, how often the
background planner and the compaction planner run, per decode step, while the mover wakes every
millisecond. Before the fix every wake re-read every chat (rows per step ~ chats x wakes).
"""
from __future__ import annotations

import threading
import time

import pytest
import torch

import tiered_kv
import tiered_kv.store.compaction as store_compaction
from helpers import greedy, rand_ids, reference, tiny_model
from tiered_kv.scheduler import HOT

BLOCK = 4
NUM_IDLE = 60
DECODE_STEPS = 24


class Counts:
    """Counts, for one store only (other tests' stores may still be alive in this process), the
    rows its compactor lays out, its compaction plans and its background plans."""

    def __init__(self, monkeypatch, store):
        self.rows = self.compaction_plans = self.background_plans = 0
        mine = threading.local()
        row_layout, plan_compaction = store_compaction.RowLayout, store_compaction.plan_compaction
        compaction_plan, plan_background = store.compaction.plan, store.scheduler.plan_background

        def counted_row(*args, **kwargs):
            self.rows += getattr(mine, "on", False)
            return row_layout(*args, **kwargs)

        def counted_compaction(*args, **kwargs):
            self.compaction_plans += getattr(mine, "on", False)
            return plan_compaction(*args, **kwargs)

        def our_plan(*args, **kwargs):
            mine.on = True
            try:
                return compaction_plan(*args, **kwargs)
            finally:
                mine.on = False

        def counted_background(*args, **kwargs):
            self.background_plans += 1
            return plan_background(*args, **kwargs)

        monkeypatch.setattr(store_compaction, "RowLayout", counted_row)
        monkeypatch.setattr(store_compaction, "plan_compaction", counted_compaction)
        monkeypatch.setattr(store.compaction, "plan", our_plan)
        monkeypatch.setattr(store.scheduler, "plan_background", counted_background)

    def snapshot(self) -> tuple[int, int, int]:
        return self.rows, self.compaction_plans, self.background_plans


def _store_with_idle_chats(model, hot_blocks: int):
    # no watermark: nothing has to move, so the mover has nothing to do but look
    config = {"block_size": BLOCK, "hot": {"device": "cpu", "capacity_blocks": hot_blocks, "high_watermark": 1.0,
                                           "low_watermark": 1.0},
              "warm": {"capacity_blocks": 512}, "cold": {"capacity": 0},
              "scheduler": {"mover_interval_s": 0.001, "min_contiguity": 1.0}}
    store = tiered_kv.TierStore(config)
    banks = [tiered_kv.CacheBank(model, config, store=store) for _ in range(NUM_IDLE)]
    with torch.no_grad():
        for turn in range(3):  # interleaved turns: every idle chat's blocks end up apart
            for i, bank in enumerate(banks):
                model(rand_ids(100 * turn + i, BLOCK), past_key_values=bank)
    return store, config, banks


@pytest.mark.parametrize("room", ["tight", "roomy"])
def test_a_decoding_chat_beside_idle_fragmented_chats_costs_the_mover_o_of_what_changed(monkeypatch, room):
    model = tiny_model("llama")
    # tight: no room to repair anyone (compaction is stuck); roomy: room, but the store's idle
    # chats are already repaired by the time the busy chat decodes (or the repair goes on, bounded)
    hot_blocks = NUM_IDLE * 3 + 16 if room == "tight" else NUM_IDLE * 3 * 3 + 64
    store, config, idle = _store_with_idle_chats(model, hot_blocks)
    busy = tiered_kv.CacheBank(model, config, store=store)
    prompt = rand_ids(7, 6 * BLOCK)
    assert store.wait_for_background(60)  # compaction did what it could (or gave up)
    counts = Counts(monkeypatch, store)
    time.sleep(0.05)  # the mover wakes ~50 times with nothing new
    quiet = counts.snapshot()
    out = greedy(model, prompt, busy, DECODE_STEPS)
    after = counts.snapshot()
    assert torch.equal(out, reference(model, prompt, DECODE_STEPS))
    # nothing changed while quiet: no row laid out, no plan made
    assert quiet == (0, 0, 0), quiet
    rows, compaction_plans, background_plans = (a - b for a, b in zip(after, quiet))
    # while the busy chat decodes, only its own rows are laid out again (one per step it took,
    # allocating or not), never the idle chats'; the busy chat itself is not compacted mid-turn
    assert rows <= 2 * (DECODE_STEPS + 1), (rows, NUM_IDLE)
    assert compaction_plans <= 2 and background_plans <= 2, (compaction_plans, background_plans)
    for bank in idle + [busy]:
        bank.close()
    store.close()


def test_a_chat_that_stops_decoding_is_compacted_once_it_is_quiet():
    model = tiny_model("llama")
    config = {"block_size": BLOCK, "hot": {"device": "cpu", "capacity_blocks": 256},
              "warm": {"capacity": 0}, "cold": {"capacity": 0},
              "scheduler": {"mover_interval_s": 0.001, "min_contiguity": 1.0}}
    store = tiered_kv.TierStore(config)
    a, b = (tiered_kv.CacheBank(model, config, store=store) for _ in range(2))
    ids = {a: rand_ids(1, 2 * BLOCK), b: rand_ids(2, 2 * BLOCK)}
    for turn in range(3):  # interleaved: both fragmented
        for bank in (a, b):
            out = greedy(model, ids[bank], bank, BLOCK)
            ids[bank] = torch.cat([out, rand_ids(10 + turn, BLOCK)], dim=1)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and store.stats()["contiguity_min"] < 1.0:
        assert store.wait_for_background(30)
        time.sleep(0.01)
    assert store.stats()["contiguity_min"] == 1.0
    for bank in (a, b):
        slots = [store.index.get(block).slot for block in bank.block_table()]
        assert slots == list(range(slots[0], slots[0] + len(slots)))
        assert store.index.get(bank.block_table()[0]).tier == HOT
    a.close(), b.close()
    store.close()


# --- the rows the compactor keeps stay true (review of the incremental cache) ----------------------

def _quiet_store(hot_blocks=48):
    config = {"block_size": BLOCK, "hot": {"device": "cpu", "capacity_blocks": hot_blocks},
              "warm": {"capacity_blocks": 64}, "cold": {"capacity": 0},
              "scheduler": {"background": False, "min_contiguity": 1.0}}
    return tiered_kv.TierStore(config), config


def _fresh_rows(store, bank):
    """The bank's row as the index says now: (hot block ids, their slots)."""
    table = bank.block_table(0)
    tiers, slots = store.state.placements(table)
    return tuple(b for b, t in zip(table, tiers.tolist()) if t == HOT), tuple(slots[tiers == HOT].tolist())


def _cached_rows(store, bank):
    with store.lock:
        store.compaction._refresh()
        (row,) = store.compaction._rows_by_owner[bank.owner]
        return row.block_ids, row.slots


def test_a_step_then_a_crop_leaves_no_freed_block_in_the_rows():
    from tiered_kv.blocks import WARM
    model = tiny_model("llama")
    store, config = _quiet_store()
    a, c = (tiered_kv.CacheBank(model, config, store=store) for _ in range(2))
    with torch.no_grad():
        model(rand_ids(1, 4 * BLOCK), past_key_values=a)
        model(rand_ids(3, 3 * BLOCK), past_key_values=c)
        store.demote([c.block_table(0)[1]], WARM)  # c needs repair: compaction plans
        with store.lock:
            store.compaction._refresh()
        model(rand_ids(2, 1), past_key_values=a)  # a's step allocates a block...
        a.crop(-1)  # ...that is freed again (assisted generation rejecting a candidate)
    time.sleep(0.3)  # both chats quiet
    assert _cached_rows(store, a) == _fresh_rows(store, a)
    with store.lock:
        store.compaction.plan(64)  # never names a freed block (it raised KeyError)
    a.close(), c.close()
    store.close()


def test_a_block_two_chats_shared_that_moves_later_updates_the_chat_that_kept_it():
    import copy
    from tiered_kv.blocks import WARM
    model = tiny_model("llama")
    store, config = _quiet_store()
    a = tiered_kv.CacheBank(model, config, store=store)
    with torch.no_grad():
        model(rand_ids(1, 4 * BLOCK), past_key_values=a)
        b = copy.deepcopy(a)
        model(rand_ids(2, 1), past_key_values=b)  # b laid out last: it shares a's blocks
    with store.lock:
        store.compaction._refresh()
    b.close()
    store.demote([a.block_table(0)[1]], WARM)  # a's block, no longer shared, moves
    assert _cached_rows(store, a) == _fresh_rows(store, a)
    assert store.stats()["contiguity_min"] == pytest.approx(a.stats()["contiguity"])
    a.close()
    store.close()
