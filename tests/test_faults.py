"""A copy that raises costs that move, never a token (issue 16), through a real model.

Chats whose history spills out of hot and warm run turn after turn while copies on one path —
on demand (a step's room and history), background (prefetch, watermark demotion), compaction —
raise, under the sync and the thread (asynchronous) copy engines. Every turn's greedy tokens
must equal transformers' DynamicCache, the store must stay consistent (no slot, pin or
reservation leaked) and the faults must really have hit. (The remote path: test_remote.py.)
"""

from __future__ import annotations

import pytest
import torch

import tiered_kv
from faults import WAYS, Faults, background, compaction, on_demand, thread_engine
from helpers import greedy, rand_ids, reference, tier_config, tiny_model

TURNS = 3


def _config(tmp_path, engine: str) -> dict:
    config = tier_config("forces_cold", tmp_path)
    config["hot"].update(capacity_blocks=6, high_watermark=0.7, low_watermark=0.5)
    config["warm"].update(capacity_blocks=6, high_watermark=0.7, low_watermark=0.5)
    config["scheduler"] = {"mover_interval_s": 0.001, "idle_steps": 6}
    return thread_engine(config, 300) if engine == "thread" else config


def _chats(model, store, seeds):
    return [(tiered_kv.CacheBank(model, store=store), rand_ids(seed, 9 + seed % 5)) for seed in seeds]


def _run_turns(model, store, chats, prefetch: bool) -> None:
    outputs = [None] * len(chats)
    for turn in range(TURNS):
        for i, (bank, prompt) in enumerate(chats):
            ids = prompt if turn == 0 else torch.cat([outputs[i], rand_ids(1000 * turn + i, 3)], 1)
            if prefetch and turn:
                bank.prefetch()
                store.wait_for_background(30)
            bank.attach(ids)
            outputs[i] = greedy(model, ids, bank, 5)
            assert torch.equal(outputs[i], reference(model, ids, 5)), f"chat {i} turn {turn}"
            assert store.check_consistency() == [], f"chat {i} turn {turn}"


def _assert_clean(store) -> None:
    assert store.wait_for_background(30)
    assert store.check_consistency() == []
    assert not store.state.in_flight and not store.state.has_pins


@pytest.mark.parametrize("engine", ("sync", "thread"))
@pytest.mark.parametrize("way", WAYS)
def test_on_demand_copies_that_fail_leave_every_chat_exact(engine, way, tmp_path):
    model = tiny_model("llama")
    store = tiered_kv.TierStore(_config(tmp_path, engine))
    chats = _chats(model, store, range(4))
    with Faults(store, on_demand, way, every=2) as faults:
        _run_turns(model, store, chats, prefetch=False)
    assert faults.failed > 0, "no on-demand batch was made to fail"
    _assert_clean(store)
    for bank, _ in chats:
        bank.close()
    _assert_clean(store)
    store.close()


@pytest.mark.parametrize("engine", ("sync", "thread"))
@pytest.mark.parametrize("way", WAYS)
def test_background_copies_that_fail_leave_every_chat_exact(engine, way, tmp_path):
    model = tiny_model("llama")
    store = tiered_kv.TierStore(_config(tmp_path, engine))
    chats = _chats(model, store, range(4, 8))
    with Faults(store, background, way, every=2) as faults:
        _run_turns(model, store, chats, prefetch=True)
    assert faults.failed > 0, "no background batch was made to fail"
    assert store.stats()["metrics"]["failed_moves_total"]
    _assert_clean(store)
    for bank, _ in chats:
        bank.close()
    store.close()


@pytest.mark.parametrize("engine", ("sync", "thread"))
def test_compaction_copies_that_fail_leave_interleaved_chats_exact(engine, tmp_path):
    """Two chats take turns; one grows by 14 tokens a turn and soon runs into the other's slots, so
    hot fragments and the mover compacts it (test_compaction.py). Every other compaction batch
    fails; generation stays exact and the store consistent."""
    model = tiny_model("llama")
    config = {"block_size": 4, "hot": {"device": "cpu", "capacity_blocks": 48}, "warm": {"capacity": 0},
              "cold": {"capacity": 0}, "scheduler": {"min_contiguity": 1.0, "mover_interval_s": 0.001}}
    store = tiered_kv.TierStore(thread_engine(config, 200) if engine == "thread" else config)
    banks = [tiered_kv.CacheBank(model, store=store) for _ in range(2)]
    conversations = [rand_ids(1, 10), rand_ids(2, 30)]
    with Faults(store, compaction, "in_unit", every=2) as faults:
        for turn in range(5):
            for chat, bank in enumerate(banks):
                out = greedy(model, conversations[chat], bank, 6)
                assert torch.equal(out, reference(model, conversations[chat], 6)), f"turn {turn} chat {chat}"
                conversations[chat] = torch.cat([out, rand_ids(10 * turn + chat, (14, 1)[chat])], dim=1)
                store.wait_for_background(30)
        assert faults.seen > 0, "compaction never ran"
    assert faults.failed > 0
    _assert_clean(store)
    for bank in banks:
        bank.close()
    store.close()
