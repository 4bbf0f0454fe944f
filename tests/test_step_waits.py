"""A decode step waits for nothing it does not need (issue 17, item 1).

CPU, `copies.engine: thread`: every copy really happens later on the engine's thread, so a step
that waited for a copy would show as a wait on a copy event. With history partly in warm (read
where it lies by the hooks), a decode step that moves nothing waits for no copy; one that makes
room moves once and waits once per batch. On CUDA, the same decode step runs under
`torch.cuda.set_sync_debug_mode("error")`: no host sync at all (the forward's token ids reach the
host by an asynchronous copy, read at commit).
"""
from __future__ import annotations

import threading

import pytest
import torch

import tiered_kv
from helpers import rand_ids, tiny_model
from tiered_kv import hooks
from tiered_kv.hw import copy_engine

BLOCK = 4


def moves(store) -> int:
    counts = store.stats()["moves"]
    return counts["promotions"] + counts["demotions"]


class WaitCounter:
    """Counts waits on copy events, host waits and engine synchronizations."""

    def __init__(self, monkeypatch):
        self.waits, self.thread = 0, threading.get_ident()
        for cls in [obj for obj in vars(copy_engine).values() if isinstance(obj, type) and obj.__module__ == copy_engine.__name__]:
            for name in ("wait", "host_wait", "synchronize"):
                if name in vars(cls):
                    self._count(monkeypatch, cls, name)

    def _count(self, monkeypatch, cls, name):
        original = getattr(cls, name)

        def counted(obj, *args, **kwargs):
            if threading.get_ident() == self.thread:  # the stepping thread (not another store's mover)
                self.waits += 1
            return original(obj, *args, **kwargs)

        monkeypatch.setattr(cls, name, counted)


@pytest.mark.parametrize("mode", ["exact", "merge"])
def test_a_decode_step_over_warm_history_waits_only_for_its_own_moves(monkeypatch, mode):
    model = tiny_model("llama")
    # hot holds a quarter of the chat; the rest is read in warm, in place
    config = {"block_size": BLOCK, "hot": {"device": "cpu", "capacity_blocks": 6},
              "warm": {"capacity_blocks": 64}, "cold": {"capacity": 0},
              "copies": {"engine": "thread", "delay_us": 200}, "scheduler": {"background": False}}
    bank = tiered_kv.CacheBank(model, config)
    hooks.install(model, bank, mode=mode)
    try:
        ids = rand_ids(3, 20)
        with torch.no_grad():
            out = model(ids, cache=bank, use_cache=True)
            next_id = out.logits[:, -1:].argmax(-1)
            counter = WaitCounter(monkeypatch)
            moves_before = moves(bank.store)
            waits_per_step, moved_per_step = [], []
            for _ in range(3 * BLOCK):
                waits, moved = counter.waits, moves(bank.store)
                out = model(next_id, cache=bank, use_cache=True)
                next_id = out.logits[:, -1:].argmax(-1)
                waits_per_step.append(counter.waits - waits)
                moved_per_step.append(moves(bank.store) - moved)
        assert bank.stats()["bank_blocks"]["warm"] > 0  # history really is read in warm
        assert moves(bank.store) > moves_before  # some steps made room in hot
        for waits, moved in zip(waits_per_step, moved_per_step):
            assert waits == 0 if moved == 0 else waits >= 1, f"{waits_per_step} {moved_per_step}"
        assert max(waits_per_step) <= 2, waits_per_step  # one batch (and the engine's own host wait)
    finally:
        hooks.uninstall(model)
        bank.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (runs on the lent H200)")
def test_a_cuda_decode_step_with_history_in_warm_makes_no_host_sync():
    model = tiny_model("llama").cuda()
    config = {"block_size": BLOCK, "hot": {"capacity_blocks": 64}, "warm": {"capacity_blocks": 64},
              "cold": {"capacity": 0}, "scheduler": {"background": False}}
    bank = tiered_kv.CacheBank(model, config)
    hooks.install(model, bank, mode="exact")
    try:
        with torch.no_grad():
            out = model(rand_ids(3, 20).cuda(), cache=bank, use_cache=True)
            bank.offload("warm")  # the history now lies in warm (pinned host memory)
            next_id = out.logits[:, -1:].argmax(-1)
            model(next_id, cache=bank, use_cache=True)  # first step after offload: may move, may sync
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                for _ in range(2):
                    out = model(next_id, cache=bank, use_cache=True)
                    next_id = out.logits[:, -1:].argmax(-1)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
    finally:
        hooks.uninstall(model)
        bank.close()
