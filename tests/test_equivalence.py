"""The core test: greedy (and beam) tokens through CacheBank equal those through DynamicCache,
for several architectures and every tier configuration, over several turns."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import tiered_kv
from helpers import ENGINE_IDS, ENGINES, TIER_KINDS, VOCAB, tier_config, tiny_model

ARCHS = ("llama", "qwen2", "mistral")


def _turn_ids(seed: int, length: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (1, length), generator=generator)


@pytest.mark.parametrize("engine, delay_us", ENGINES, ids=ENGINE_IDS)
@pytest.mark.parametrize("source", ("model", "config"))
@pytest.mark.parametrize("kind", TIER_KINDS)
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_multiturn_matches_dynamic_cache(arch, kind, source, engine, delay_us, tmp_path):
    """A bank built from the model (verified ids) and one from its config alone (private reuse);
    with copies at once and with every copy held back on the thread engine."""
    model = tiny_model(arch)
    bank = tiered_kv.CacheBank(model if source == "model" else model.config,
                               tier_config(kind, tmp_path, engine=engine, delay_us=delay_us))
    dynamic = DynamicCache(config=model.config)
    ids_bank = ids_dyn = _turn_ids(0, 13)
    seen_tiers = set()
    for turn in range(3):
        reused = bank.attach(ids_bank)
        assert reused == (0 if turn == 0 else ids_bank.shape[1] - 7)  # all but the 6 new user tokens + 1
        out_bank = model.generate(ids_bank, cache=bank, attention_mask=torch.ones_like(ids_bank),
                                  max_new_tokens=9, do_sample=False)
        out_dyn = model.generate(ids_dyn, cache=dynamic, attention_mask=torch.ones_like(ids_dyn),
                                 max_new_tokens=9, do_sample=False)
        assert torch.equal(out_bank, out_dyn), f"turn {turn}: {out_bank.tolist()} != {out_dyn.tolist()}"
        assert bank.get_seq_length() == dynamic.get_seq_length() == out_bank.shape[1] - 1
        blocks = bank.stats()["bank_blocks"]
        seen_tiers |= {tier for tier, count in blocks.items() if count}
        user = _turn_ids(turn + 1, 6)
        ids_bank, ids_dyn = torch.cat([out_bank, user], 1), torch.cat([out_dyn, user], 1)
    expected = {"all_hot": {"hot"}, "forces_warm": {"hot", "warm"}, "forces_cold": {"hot", "warm", "cold"}}[kind]
    assert seen_tiers == expected
    bank.close()


@pytest.mark.parametrize("kind", TIER_KINDS)
def test_generate_without_attach_reuses_cache_like_dynamic(kind, tmp_path):
    """Plain transformers usage: pass the whole conversation again, no attach()."""
    model = tiny_model("llama")
    bank = tiered_kv.CacheBank(model, tier_config(kind, tmp_path))
    dynamic = DynamicCache(config=model.config)
    ids = _turn_ids(5, 10)
    for turn in range(2):
        out_bank = model.generate(ids, cache=bank, max_new_tokens=6, do_sample=False)
        out_dyn = model.generate(ids, cache=dynamic, max_new_tokens=6, do_sample=False)
        assert torch.equal(out_bank, out_dyn)
        ids = torch.cat([out_bank, _turn_ids(50 + turn, 5)], 1)
    bank.close()


@pytest.mark.parametrize("engine, delay_us", ENGINES, ids=ENGINE_IDS)
@pytest.mark.parametrize("kind", TIER_KINDS)
@pytest.mark.parametrize("arch", ("llama", "qwen2"))
def test_beam_search_matches_dynamic_cache(arch, kind, engine, delay_us, tmp_path):
    model = tiny_model(arch)
    ids = _turn_ids(7, 11)
    config = tier_config(kind, tmp_path, engine=engine, delay_us=delay_us)
    if kind == "forces_cold":  # two beams need room for both rows' tails
        config["cold"]["capacity_blocks"] = 64
    bank = tiered_kv.CacheBank(model, config)
    kwargs = dict(max_new_tokens=8, num_beams=2, do_sample=False, early_stopping=True)
    out_bank = model.generate(ids, cache=bank, **kwargs)
    out_dyn = model.generate(ids, cache=DynamicCache(config=model.config), **kwargs)
    assert torch.equal(out_bank, out_dyn)
    bank.close()


@pytest.mark.parametrize("engine, delay_us", ENGINES, ids=ENGINE_IDS)
@pytest.mark.parametrize("kind", TIER_KINDS)
def test_batch_with_left_padding_matches_dynamic_cache(kind, engine, delay_us, tmp_path):
    model = tiny_model("llama")
    config = tier_config(kind, tmp_path, engine=engine, delay_us=delay_us)
    bank = tiered_kv.CacheBank(model, config)
    a, b = _turn_ids(11, 12), _turn_ids(12, 7)
    ids = torch.cat([a, torch.cat([torch.zeros(1, 5, dtype=torch.long), b], 1)], 0)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    out_bank = model.generate(ids, cache=bank, attention_mask=mask, max_new_tokens=7, do_sample=False)
    out_dyn = model.generate(ids, cache=DynamicCache(config=model.config), attention_mask=mask,
                             max_new_tokens=7, do_sample=False)
    assert torch.equal(out_bank, out_dyn)
    assert bank.batch_size == 2
    bank.close()


@pytest.mark.parametrize("engine, delay_us", ENGINES + (("thread", 100), ("thread", 500)),
                         ids=ENGINE_IDS + ("thread100us", "thread500us"))
def test_shared_store_serves_two_chats_interleaved(engine, delay_us, tmp_path):
    """Two banks on one small store: each chat's idle history is pushed down by the other and
    comes back for its next turn; tokens still match DynamicCache."""
    model = tiny_model("llama")
    store = tiered_kv.TierStore(tier_config("forces_cold", tmp_path, engine=engine, delay_us=delay_us))
    banks = [tiered_kv.CacheBank(model, store=store) for _ in range(2)]
    dyns = [DynamicCache(config=model.config) for _ in range(2)]
    ids = [_turn_ids(20, 9), _turn_ids(21, 14)]
    for turn in range(3):
        for chat in range(2):
            banks[chat].attach(ids[chat])
            out_bank = model.generate(ids[chat], cache=banks[chat], max_new_tokens=5, do_sample=False)
            out_dyn = model.generate(ids[chat], cache=dyns[chat], max_new_tokens=5, do_sample=False)
            assert torch.equal(out_bank, out_dyn), f"chat {chat} turn {turn}"
            ids[chat] = torch.cat([out_bank, _turn_ids(100 + 10 * turn + chat, 4)], 1)
    assert store.stats()["bytes_moved"]["warm->cold"] > 0
    for bank in banks:
        bank.close()
    store.close()
