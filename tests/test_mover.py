"""The background mover (issue 7): prefetch off the critical path, watermark demotion, cancelled
moves, link-saturation gating, hit rates, and one chat's failure leaving the others untouched.

Real store, real model, real thread. Where a test needs a move to be *in flight*, it holds the
mover's copy step at a gate (an Event) so the timing is deterministic, never a sleep.
"""
from __future__ import annotations

import threading

import pytest
import torch

import tiered_kv
from helpers import greedy, rand_ids, reference, tiny_model
from tiered_kv.metrics.registry import BACKGROUND
from tiered_kv.scheduler import HOT

BLOCK = 4
WAIT_S = 60.0


def config(tmp_path, hot=64, warm=64, cold=64, **scheduler) -> dict:
    return {"block_size": BLOCK, "hot": {"device": "cpu", "capacity_blocks": hot},
            "warm": {"capacity_blocks": warm}, "cold": {"capacity_blocks": cold, "path": str(tmp_path / "cold")},
            "scheduler": {"mover_interval_s": 0.001, **scheduler}}


def tiers_of(bank) -> dict:
    return bank.stats()["bank_blocks"]


class Gate:
    """Holds the mover's batches between prepare and their copy (at store.transfers.launch), until opened."""

    def __init__(self, store):
        self.entered, self.opened = threading.Event(), threading.Event()
        launch = store.transfers.launch

        def gated(batch):
            if batch.mode == BACKGROUND:
                self.entered.set()
                assert self.opened.wait(WAIT_S), "the test never opened the gate"
            return launch(batch)

        store.transfers.launch = gated

    def open(self):
        self.opened.set()


def in_thread(fn, *args):
    box = {}

    def run():
        try:
            box["result"] = fn(*args)
        except BaseException as error:  # noqa: BLE001 - reported by the caller
            box["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def test_prefetch_returns_at_once_and_the_mover_brings_the_chat_up(tmp_path):
    model = tiny_model("llama")
    bank = tiered_kv.CacheBank(model, config(tmp_path))
    ids = rand_ids(1, 30)
    out = greedy(model, ids, bank, 4)
    bank.offload("cold")
    assert tiers_of(bank) == {"hot": 0, "warm": 0, "cold": 9}
    gate = Gate(bank.store)
    bank.prefetch()  # would hang here if prefetch waited for the (held) copy
    assert gate.entered.wait(WAIT_S)
    assert tiers_of(bank)["cold"] == 9  # nothing landed while the copy is held
    gate.open()
    assert bank.store.wait_for_background(WAIT_S)
    assert tiers_of(bank) == {"hot": 9, "warm": 0, "cold": 0}
    stats = bank.stats()
    assert stats["bytes_background"] == 9 * bank.store.layout.block_bytes
    assert stats["critical_path"]["promote_s"] == 0.0  # this thread moved nothing itself
    follow = torch.cat([out, rand_ids(2, 5)], 1)
    assert bank.attach(follow) == out.shape[1] - 1  # all it holds: the last reply token was never fed back
    assert torch.equal(greedy(model, follow, bank, 4), reference(model, follow, 4))
    assert bank.stats()["hit_rate"]["hot"] == 1.0  # the turn found its history hot
    bank.close()


def test_a_forward_never_waits_for_a_background_move_of_blocks_it_does_not_read(tmp_path):
    model = tiny_model("llama")
    store = tiered_kv.TierStore(config(tmp_path))
    idle = tiered_kv.CacheBank(model, store=store)
    greedy(model, rand_ids(3, 40), idle, 2)
    idle.offload("cold")
    gate = Gate(store)
    idle.prefetch()
    assert gate.entered.wait(WAIT_S)  # the mover now holds a batch of the idle chat's blocks in flight
    busy = tiered_kv.CacheBank(model, store=store)
    ids = rand_ids(4, 20)
    thread, box = in_thread(greedy, model, ids, busy, 6)
    thread.join(WAIT_S)
    assert not thread.is_alive(), "a forward over other blocks waited for the background copy"
    assert "error" not in box, box.get("error")
    assert torch.equal(box["result"], reference(model, ids, 6))
    gate.open()
    assert store.wait_for_background(WAIT_S)
    assert tiers_of(idle)["hot"] == 11
    store.close()


def test_a_turn_that_starts_during_its_prefetch_waits_for_the_blocks_in_flight(tmp_path):
    model = tiny_model("llama")
    bank = tiered_kv.CacheBank(model, config(tmp_path))
    ids = rand_ids(5, 30)
    out = greedy(model, ids, bank, 4)
    bank.offload("cold")
    gate = Gate(bank.store)
    bank.prefetch()
    assert gate.entered.wait(WAIT_S)
    follow = torch.cat([out, rand_ids(6, 3)], 1)

    def turn():
        bank.attach(follow)
        return greedy(model, follow, bank, 4)

    thread, box = in_thread(turn)
    thread.join(0.2)
    assert thread.is_alive(), "the turn read blocks that were still in flight"
    gate.open()
    thread.join(WAIT_S)
    assert not thread.is_alive() and "error" not in box, box.get("error")
    assert torch.equal(box["result"], reference(model, follow, 4))
    assert bank.stats()["critical_path"]["promote_s"] > 0  # it waited for the landing
    bank.close()


def test_a_step_that_starts_using_a_block_in_flight_cancels_that_move(tmp_path):
    model = tiny_model("llama")
    # hot is over its high watermark once the chat has 9 blocks: the mover demotes some
    cfg = config(tmp_path, hot=12, idle_steps=0, cs_weight=0.0)
    cfg["hot"].update(high_watermark=0.5, low_watermark=0.2)
    store = tiered_kv.TierStore(cfg)
    other = tiered_kv.CacheBank(model, store=store)
    bank = tiered_kv.CacheBank(model, store=store)
    ids = rand_ids(7, 30)
    out = greedy(model, ids, bank, 2)  # 8 blocks
    gate = Gate(store)
    greedy(model, rand_ids(8, 3), other, 8)  # 8 steps of another chat: the first one's ALI falls to 0.2
    assert gate.entered.wait(WAIT_S)  # its blocks are in flight to a lower tier
    follow = torch.cat([out, rand_ids(9, 2)], 1)
    bank.attach(follow)
    got = greedy(model, follow, bank, 3)  # its steps cancel the moves of its blocks in flight
    gate.open()
    assert store.wait_for_background(WAIT_S)
    assert torch.equal(got, reference(model, follow, 3))
    assert store.stats()["scheduler"]["background_cancelled"] > 0
    store.close()


def test_watermark_demotion_runs_in_the_background(tmp_path):
    model = tiny_model("llama")
    cfg = config(tmp_path, hot=10, idle_steps=0)
    cfg["hot"].update(high_watermark=0.6, low_watermark=0.3)
    store = tiered_kv.TierStore(cfg)
    banks = [tiered_kv.CacheBank(model, store=store) for _ in range(4)]
    for i, bank in enumerate(banks):
        greedy(model, rand_ids(20 + i, 6), bank, 2)  # 2 blocks each: 8 of 10 hot, over the high mark
    assert store.wait_for_background(WAIT_S)
    deadline = threading.Event()
    for _ in range(200):
        if store.stats()["tiers"]["hot"]["used_blocks"] <= 6:
            break
        deadline.wait(0.01)
    stats = store.stats()
    # back under the high mark (6 of 10); toward the low one (3), the latest chats' blocks, read
    # by most steps since they exist, stay: their ALI says hot
    assert stats["tiers"]["hot"]["used_blocks"] <= 6, stats["tiers"]
    assert stats["moves"]["demotions"] >= 2 and stats["bytes_background"] > 0
    assert stats["critical_path"]["demote_s"] == 0.0  # no turn demoted while a user waited
    store.close()


def test_optional_moves_wait_while_the_link_is_saturated_but_prefetch_does_not(tmp_path):
    model = tiny_model("llama")
    cfg = config(tmp_path, hot=10, idle_steps=0, bs_threshold=0.5)
    cfg["hot"].update(high_watermark=0.6, low_watermark=0.3)
    store = tiered_kv.TierStore(cfg)
    monitor = store.link_monitor
    monitor.window_s = 3600.0  # keep the saturation we record for the whole test
    monitor.record(int(monitor.peak_bytes_per_s * monitor.window_s))
    assert store.stats()["scheduler"]["link_saturation"] == pytest.approx(1.0)
    banks = [tiered_kv.CacheBank(model, store=store) for _ in range(4)]
    for i, bank in enumerate(banks):
        greedy(model, rand_ids(30 + i, 6), bank, 2)
    assert store.wait_for_background(WAIT_S)
    assert store.stats()["tiers"]["hot"]["used_blocks"] == 8  # over the high mark, yet nothing moved
    assert store.stats()["bytes_background"] == 0
    banks[0].offload("cold")
    banks[0].prefetch()  # a user is typing: not optional
    assert store.wait_for_background(WAIT_S)
    assert tiers_of(banks[0])["hot"] == 2
    store.close()


def test_a_chat_too_big_for_the_whole_store_fails_alone(tmp_path):
    model = tiny_model("llama")
    store = tiered_kv.TierStore(config(tmp_path, hot=4, warm=4, cold=4))
    small = tiered_kv.CacheBank(model, store=store)
    ids = rand_ids(40, 10)
    out = greedy(model, ids, small, 3)
    huge = tiered_kv.CacheBank(model, store=store)
    with pytest.raises(tiered_kv.CapacityError, match=r"needs \d+ blocks .* hold 12 blocks"):
        greedy(model, rand_ids(41, 60), huge, 2)
    assert huge.get_seq_length() == 0
    follow = torch.cat([out, rand_ids(42, 3)], 1)
    small.attach(follow)
    assert torch.equal(greedy(model, follow, small, 3), reference(model, follow, 3))
    store.close()


def test_hit_rates_count_where_a_turns_history_was_when_it_began(tmp_path):
    model = tiny_model("llama")
    store = tiered_kv.TierStore(config(tmp_path, background=False))
    bank = tiered_kv.CacheBank(model, store=store)
    out = greedy(model, rand_ids(50, 14), bank, 2)  # 16 tokens: 4 blocks
    assert store.stats()["turn_blocks"] == 0  # a first turn has no history to find
    bank.offload("warm")
    follow = torch.cat([out, rand_ids(51, 3)], 1)
    bank.attach(follow)
    stats = store.stats()
    assert stats["turn_blocks"] == 4 and stats["hit_rate"] == {"hot": 0.0, "warm": 1.0, "cold": 0.0}
    out = greedy(model, follow, bank, 2)
    history_blocks = len(bank.block_table())  # all hot now
    follow = torch.cat([out, rand_ids(52, 3)], 1)
    greedy(model, follow, bank, 2)  # a turn without attach() counts at its first step
    stats = store.stats()
    total = 4 + history_blocks
    assert stats["turn_blocks"] == total
    assert stats["hit_rate"]["hot"] == pytest.approx(history_blocks / total)
    assert stats["hit_rate"]["warm"] == pytest.approx(4 / total)
    store.close()


def test_prefetch_without_a_mover_promotes_before_returning(tmp_path):
    model = tiny_model("llama")
    bank = tiered_kv.CacheBank(model, config(tmp_path, background=False))
    greedy(model, rand_ids(60, 10), bank, 2)
    bank.offload("cold")
    bank.prefetch()
    assert tiers_of(bank) == {"hot": 3, "warm": 0, "cold": 0}
    assert bank.stats()["scheduler"]["background"] is False
    bank.close()


@pytest.mark.parametrize("value", [-0.1, 1.5, "high", True])
def test_cost_sensitivity_out_of_range_is_refused(value, tmp_path):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=r"cost_sensitivity=.*allowed: a number from 0"):
        tiered_kv.CacheBank(model, config(tmp_path), cost_sensitivity=value)


def test_cost_sensitivity_reaches_the_scheduler(tmp_path):
    model = tiny_model("llama")
    store = tiered_kv.TierStore(config(tmp_path, background=False))
    bank = tiered_kv.CacheBank(model, store=store, cost_sensitivity=0.9)
    greedy(model, rand_ids(70, 6), bank, 2)
    chats = store.stats()["scheduler"]["chats"]
    assert [c["cost_sensitivity"] for c in chats.values()] == [0.9]
    assert bank.stats()["cost_sensitivity"] == 0.9
    bank.close()
    assert store.stats()["scheduler"]["chats"] == {}
    store.close()


# ---- issue 22: prefetch that fits the think time, and background moves that never delay a turn ------

def test_a_prefetch_stops_at_its_deadline_most_recent_blocks_first(tmp_path):
    """Batches of 4 blocks, each held 0.15 s: with a 0.2 s deadline the mover brings up the first
    batch or two (the chat's most recent blocks), then drops the request; the turn brings the rest."""
    model = tiny_model("llama")
    bank = tiered_kv.CacheBank(model, config(tmp_path))
    out = greedy(model, rand_ids(21, 60), bank, 4)  # 16 blocks
    bank.offload("cold")
    store = bank.store
    store.mover.batch_blocks = 4
    launch = store.transfers.launch

    def slow(batch):
        if batch.mode == BACKGROUND:
            threading.Event().wait(0.15)
        return launch(batch)

    store.transfers.launch = slow
    with pytest.raises(ValueError, match="deadline_s"):
        bank.prefetch(deadline_s=-1)
    bank.prefetch(deadline_s=0.2)
    assert store.wait_for_background(WAIT_S)
    hot = [store.index.get(b).tier == HOT for b in bank.block_table(0)]
    assert 4 <= sum(hot) < 16 and store.mover.num_expired == 1
    assert hot == sorted(hot), hot  # the ones that came up are the newest (at the end of the table)
    follow = torch.cat([out, rand_ids(22, 3)], 1)
    bank.attach(follow)
    assert torch.equal(greedy(model, follow, bank, 4), reference(model, follow, 4))
    bank.close()


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_a_prefetch_of_a_chat_larger_than_hot_fills_hot_once_and_settles(policy, tmp_path):
    """A chat of 16 blocks, hot room for 10: the prefetch brings its 10 newest up and stops. It
    must not make room by pushing the chat's own blocks that are up already back down (it swapped
    them in a loop until the turn came: bytes moved for nothing, and hot slots held by copies in
    flight instead of blocks)."""
    model = tiny_model("llama")
    bank = tiered_kv.CacheBank(model, config(tmp_path, hot=10, policy=policy))
    out = greedy(model, rand_ids(23, 60), bank, 4)  # 16 blocks
    store = bank.store
    assert store.wait_for_background(WAIT_S)
    bank.offload("warm")
    bank.prefetch()
    assert store.wait_for_background(WAIT_S / 4), "the prefetch kept moving the chat's own blocks"
    table = bank.block_table(0)
    hot = [store.index.get(b).tier == HOT for b in table]
    assert sum(hot) == 10 and hot == sorted(hot), hot  # its newest 10, once
    block_bytes = store.layout.block_bytes
    assert bank.stats()["bytes_moved"]["warm->hot"] <= 10 * block_bytes
    follow = torch.cat([out, rand_ids(24, 3)], 1)
    bank.attach(follow)
    assert torch.equal(greedy(model, follow, bank, 4), reference(model, follow, 4))
    bank.close()


def test_a_prefetch_goes_before_durable_copies_and_every_background_move_waits_for_a_turns_own(tmp_path):
    """A prefetch request is served before the write-behind copies due at the same time; and while a
    caller's on-demand batch is in flight (or the copy engine has units queued), the mover prepares
    nothing: a turn's own moves are never queued behind background ones."""
    model = tiny_model("llama")
    cfg = config(tmp_path)
    cfg["cold"]["write_behind_s"] = 0.001
    cfg["copies"] = {"engine": "thread", "delay_us": 0}
    store = tiered_kv.TierStore(cfg)
    other = tiered_kv.CacheBank(model, store=store)
    greedy(model, rand_ids(23, 40), other, 2)
    other.offload("cold")
    order = []
    launch = store.transfers.launch

    def record(batch):
        if batch.mode == BACKGROUND:
            order.append("backup" if any(t.kind == "backup" for t in batch.transfers) else "move")
        return launch(batch)

    parked, real_batch = threading.Event(), store.mover._one_batch
    store.mover._one_batch = lambda: parked.wait(WAIT_S) and real_batch()  # the mover waits while both become due
    store.transfers.launch = record
    fresh = tiered_kv.CacheBank(model, store=store)
    greedy(model, rand_ids(24, 20), fresh, 2)  # publishes blocks: durable copies due at once
    other.prefetch()
    threading.Event().wait(0.01)
    parked.set()
    assert store.wait_for_background(WAIT_S) and store.flush()
    assert "move" in order and "backup" in order and order.index("move") < order.index("backup")
    # an on-demand batch in flight (held on the engine's thread): the mover yields
    gate = threading.Event()
    store.copy_engine.submit(lambda: gate.wait(WAIT_S))
    assert store.copy_engine.queue_depth() == 1
    yielded = store.mover.num_yielded
    thread, box = in_thread(other.offload, "warm")  # on demand, queued behind the held unit
    for _ in range(200):
        store.mover.wake()
        threading.Event().wait(0.005)
        if store.mover.num_yielded > yielded:
            break
    assert store.mover.num_yielded > yielded and thread.is_alive()
    gate.set()
    thread.join(WAIT_S)
    assert not thread.is_alive() and "error" not in box, box.get("error")
    assert store.wait_for_background(WAIT_S) and store.copy_engine.queue_depth() == 0
    store.close()
