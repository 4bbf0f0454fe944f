"""Load or recompute, decided per turn (issue 22): `scheduler.restore: auto` restores only the part
of a stored prefix that loads faster than the model recomputes it, from rates the store measured
itself; `always` restores everything. Tokens equal DynamicCache's whatever it decides."""

from __future__ import annotations

import time

import pytest
import torch
from transformers import DynamicCache

import tiered_kv
from helpers import greedy, rand_ids, tier_config, tiny_model
from tiered_kv.blocks import COLD
from tiered_kv.scheduler.restore import Rates, restore_blocks


# ---- the decision, no torch ----------------------------------------------------------------------

def test_restore_blocks_takes_the_cheapest_cut():
    assert restore_blocks([0.0, 0.0, 0.0], 1.0) == 3  # hot: free
    assert restore_blocks([0.5, 0.5, 0.5], 1.0) == 3  # cheaper to load than to recompute
    assert restore_blocks([2.0, 2.0, 2.0], 1.0) == 0  # a slow tier: recompute it all
    assert restore_blocks([0.0, 0.0, 3.0, 3.0], 1.0) == 2  # hot head, slow tail
    assert restore_blocks([3.0, 0.0, 0.0, 0.0], 1.0) == 4  # one slow block before three free ones pays off
    assert restore_blocks([1.0, 1.0], 1.0) == 2  # a tie: restored (recomputing must save enough)
    assert restore_blocks([0.002, 0.002], 0.0) == 2  # saves 4 ms: under MIN_GAIN_S, restored
    assert restore_blocks([0.1] * 10, 0.095) == 10  # saves 5%: under MIN_GAIN_SHARE, restored
    assert restore_blocks([0.1] * 10, 0.08) == 0  # saves 20%, 0.2 s: recomputed
    assert restore_blocks([None, 5.0], 1.0) == 1  # unmeasured counts as free
    assert restore_blocks([5.0, 5.0], None) == 2  # no prefill rate yet: restore (today's behaviour)
    assert restore_blocks([], 1.0) == 0


def test_rates_are_rolling_and_small_reads_are_round_trips():
    rates = Rates()
    assert rates.load_seconds("cold", 10**6) is None and rates.recompute_seconds(100) is None
    rates.note_read("cold", 10**8, 1.0)  # 100 MB/s
    assert rates.load_seconds("cold", 10**6) == pytest.approx(0.01)
    rates.note_read("cold", 10**8, 10.0)  # the disk slowed: the estimate follows within a few reads
    assert 0.01 < rates.load_seconds("cold", 10**6) < 0.1
    rates.note_read("remote", 100, 0.02)  # a small fetch: its time is the round trip
    rates.note_read("remote", 10**7, 0.12)  # 0.1 s for 10 MB once the round trip is taken off
    assert rates.load_seconds("remote", 10**7) == pytest.approx(0.02 + 0.1)
    rates.note_step(100, 0.5)  # one prefill, no decode step yet: all of it counts per token
    assert rates.recompute_seconds(10) == pytest.approx(0.05)
    rates = Rates()
    rates.note_step(1, 0.1)  # a decode step: the fixed cost of any step
    rates.note_step(100, 0.6)  # 0.5 s beyond it for 100 tokens
    rates.note_step(4, 0.5)  # too short to be a prefill rate
    assert rates.recompute_seconds(10) == pytest.approx(0.05)
    rates = Rates()  # prefills of two lengths: the slope of time over tokens, not their average
    rates.note_step(16, 0.1 + 16 * 0.002)
    rates.note_step(256, 0.1 + 256 * 0.002)
    assert rates.recompute_seconds(100) == pytest.approx(0.2)
    assert rates.snapshot()["prefill_ms_per_token"] == pytest.approx(2.0)


# ---- through a bank --------------------------------------------------------------------------------

def _slow_cold(monkeypatch, store, seconds_per_read: float) -> None:
    """Every read of cold records takes at least `seconds_per_read` longer (a throttled disk)."""
    cold = store.tiers[COLD]
    for name in ("read_blocks",):
        real = getattr(cold, name)

        def slow(*args, _real=real, **kwargs):
            time.sleep(seconds_per_read)
            return _real(*args, **kwargs)
        monkeypatch.setattr(cold, name, slow)


@pytest.mark.parametrize("mode", ("auto", "always"))
def test_a_slow_cold_tier_is_recomputed_not_read_once_its_rate_is_known(mode, tmp_path, monkeypatch):
    """A chat's history goes to cold; the disk is throttled to ~1 s a read. The first restore reads
    it (and measures the rate); after that, `auto` recomputes what it would read, `always` reads
    on. Tokens equal DynamicCache's either way; stats() counts the choice."""
    model = tiny_model("llama")
    config = tier_config("forces_cold", tmp_path / "cold")
    config["scheduler"] = {"restore": mode, "background": False}
    store = tiered_kv.TierStore(config)
    ids = rand_ids(3, 40)
    first = tiered_kv.CacheBank(model, store=store)
    out = greedy(model, ids, first, 4)  # a prefill: the store learns the model's prefill rate
    first.offload("cold")
    _slow_cold(monkeypatch, store, 0.3)
    follow = torch.cat([out, rand_ids(4, 3)], 1)
    stored = (follow.shape[1] - 1) // 4 * 4  # the full blocks of follow the first bank publishes
    reference = greedy(model, follow, DynamicCache(config=model.config), 4)
    assert first.attach(follow) == out.shape[1] - 1  # the cold rate is not known yet: restored (and measured)
    assert torch.equal(greedy(model, follow, first, 4), reference)
    first.offload("cold")
    second = tiered_kv.CacheBank(model, store=store)
    reused = second.attach(follow)
    restore = store.stats()["restore"]
    if mode == "auto":  # (the full blocks the first bank published: all in cold now)
        assert reused == 0 and restore["recomputed_tokens"] == stored
        assert restore["read_mb_per_s"]["cold"] < 1.0  # measured: a few KB per 0.3 s
    else:
        assert reused == stored and restore["recomputed_tokens"] == 0
    assert restore["mode"] == mode and restore["prefill_ms_per_token"] > 0
    assert torch.equal(greedy(model, follow, second, 4), reference)
    assert store.check_consistency() == []
    first.close()
    second.close()
    store.close()


def test_a_fast_tier_is_restored_whole_under_auto(tmp_path):
    model = tiny_model("llama")
    config = tier_config("forces_cold", tmp_path / "cold")
    config["scheduler"] = {"background": False, "restore": "auto"}
    store = tiered_kv.TierStore(config)
    bank = tiered_kv.CacheBank(model, store=store)
    out = greedy(model, rand_ids(5, 40), bank, 4)
    follow = torch.cat([out, rand_ids(6, 3)], 1)
    for _ in range(2):  # the second attach knows both rates: loading a few KB beats recomputing
        bank.offload("cold")
        assert bank.attach(follow) == out.shape[1] - 1
    stats = store.stats()["restore"]
    assert stats["mode"] == "auto" and stats["recomputed_tokens"] == 0 and stats["restored_tokens"] > 0
    bank.close()
    store.close()


def test_a_slow_peer_is_not_fetched_when_recomputing_is_faster(tmp_path):
    """Another store's records on the same cold path (a peer), estimated slower than recomputing:
    attach() does not fetch them (`not_fetched` counts the tokens); tokens equal DynamicCache's."""
    model = tiny_model("llama")
    config = tier_config("all_hot", tmp_path / "cold")
    config["cold"].update(capacity_blocks=256, write_behind_s=0.05)
    config["scheduler"] = {"background": False, "restore": "auto"}
    owner = tiered_kv.TierStore(config)
    bank = tiered_kv.CacheBank(model, store=owner)
    out = greedy(model, rand_ids(8, 40), bank, 4)
    assert owner.flush()
    reader = tiered_kv.TierStore(config)
    other = tiered_kv.CacheBank(model, store=reader)
    greedy(model, rand_ids(9, 20), other, 2)  # its own prefill: the reader's prefill rate
    other.reset()
    reader.rates.note_read("peer", 10**6, 100.0)  # 10 KB/s: far slower than recomputing
    follow = torch.cat([out, rand_ids(10, 3)], 1)
    assert other.attach(follow) == 0
    # the chain's rest up to the turn's last full block was not looked for (the peer held 10 of 11)
    assert reader.stats()["restore"]["not_fetched_tokens"] == (follow.shape[1] - 1) // 4 * 4
    assert torch.equal(greedy(model, follow, other, 4), greedy(model, follow, DynamicCache(config=model.config), 4))
    other.close()
    bank.close()
    reader.close()
    owner.close()
