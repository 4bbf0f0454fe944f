"""`copy.deepcopy(bank)` (issue 5, defect 5): transformers' prompt-reuse pattern with every tier.

transformers' docs: prefill a prompt once into a cache, then for each follow-up prompt deep-copy that
cache and generate with the copy. A copy of a CacheBank is an independent bank on the SAME store
whose blocks are shared by reference (copy-on-write); copies that are closed or collected release
their references and never close or touch what the original still uses.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from transformers import DynamicCache

import tiered_kv
from helpers import BLOCK_SIZE, FORMS, greedy, make_bank, rand_ids, reference, tier_config, tiny_model

KINDS = ("all_hot", "forces_cold")
PROMPT_TOKENS = 14


def _config(kind: str, cold_dir) -> dict:
    """helpers.tier_config with a smaller total, so a capacity probe stays cheap."""
    config = tier_config(kind, cold_dir)
    if kind == "all_hot":
        config["hot"]["capacity_blocks"] = 48
    else:
        config["cold"]["capacity_blocks"] = 40  # hot 2 + warm 3: copies' blocks spill to cold
    return config


def _prefilled(model, form: str, store):
    """A bank and a DynamicCache each holding the same prompt, filled by one forward pass."""
    prompt = rand_ids(1, PROMPT_TOKENS)
    bank = make_bank(form, model, store=store)
    dynamic = DynamicCache(config=model.config)
    with torch.no_grad():
        model(prompt, cache=bank)
        model(prompt, cache=dynamic)
    assert bank.get_seq_length() == dynamic.get_seq_length() == PROMPT_TOKENS
    return prompt, bank, dynamic


def _used_blocks(store) -> int:
    return sum(tier["used_blocks"] for tier in store.stats()["tiers"].values())


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("kind", KINDS)
def test_prompt_reuse_loop_with_deepcopy_matches_dynamic_cache(kind, form, tmp_path):
    model = tiny_model("llama")
    store = tiered_kv.TierStore(_config(kind, tmp_path))
    prompt, bank, dynamic = _prefilled(model, form, store)
    for i in range(3):
        ids = torch.cat([prompt, rand_ids(10 + i, 5)], 1)
        cached = copy.deepcopy(bank)
        out = greedy(model, ids, cached, 6)
        expected = greedy(model, ids, copy.deepcopy(dynamic), 6)
        assert torch.equal(out, expected), f"follow-up {i}"
        assert bank.get_seq_length() == PROMPT_TOKENS, "generating with a copy changed the original"
        assert cached.store is store, "a copy must share the original's store, not duplicate it"
    # the original is still usable
    ids = torch.cat([prompt, rand_ids(20, 4)], 1)
    assert torch.equal(greedy(model, ids, bank, 5), reference(model, ids, 5))
    bank.close()
    store.close()


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("kind", KINDS)
def test_two_copies_continue_two_chats_side_by_side(kind, form, tmp_path):
    model = tiny_model("llama")
    store = tiered_kv.TierStore(_config(kind, tmp_path))
    prompt, bank, dynamic = _prefilled(model, form, store)
    banks = [copy.deepcopy(bank), copy.deepcopy(bank)]
    dynamics = [copy.deepcopy(dynamic), copy.deepcopy(dynamic)]
    user_tokens, new_tokens = (3, 7), (4, 8)  # chats of different lengths: their blocks sit in different places
    ids = [torch.cat([prompt, rand_ids(30 + chat, user_tokens[chat])], 1) for chat in range(2)]
    for turn in range(3):
        for chat in range(2):  # turns alternate: each copy's writes land while the other's blocks exist
            out = greedy(model, ids[chat], banks[chat], new_tokens[chat])
            expected = greedy(model, ids[chat], dynamics[chat], new_tokens[chat])
            assert torch.equal(out, expected), f"chat {chat} turn {turn}"
            ids[chat] = torch.cat([out, rand_ids(40 + 10 * turn + chat, user_tokens[chat])], 1)
    for copied in banks:
        copied.close()
    ids = torch.cat([prompt, rand_ids(50, 4)], 1)
    assert torch.equal(greedy(model, ids, bank, 5), reference(model, ids, 5)), "the original broke"
    bank.close()
    store.close()


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("kind", KINDS)
def test_collected_copies_release_their_blocks_and_close_nothing_of_the_original(kind, form, tmp_path):
    model = tiny_model("llama")
    store = tiered_kv.TierStore(_config(kind, tmp_path / "store"))
    prompt, bank, _ = _prefilled(model, form, store)
    copies = [copy.deepcopy(bank) for _ in range(2)]
    for i, copied in enumerate(copies):
        ids = torch.cat([prompt, rand_ids(60 + i, 9)], 1)
        assert torch.equal(greedy(model, ids, copied, 6), reference(model, ids, 6))
    used_with_copies = _used_blocks(store)
    del copies, copied
    gc.collect()

    # a store opened later (it may be handed a file descriptor number the copies' collection freed)
    other_store = tiered_kv.TierStore(_config(kind, tmp_path / "other"))
    other = make_bank(form, model, store=other_store)
    other_ids = rand_ids(70, 30)
    other_out = greedy(model, other_ids, other, 5)
    assert torch.equal(other_out, reference(model, other_ids, 5))

    # the copies' references are gone: a new bank can fill everything the original does not hold
    capacity = sum(tier["capacity_blocks"] for tier in store.stats()["tiers"].values())
    held = sum(bank.stats()["bank_blocks"].values())
    assert held == -(-PROMPT_TOKENS // BLOCK_SIZE)
    fresh = make_bank(form, model, store=store)
    probe = rand_ids(71, (capacity - held) * BLOCK_SIZE)
    greedy(model, probe, fresh, 1)  # one forward pass: exactly the free blocks (CapacityError on a leak)
    fresh.close()

    # the original bank and the later store keep working
    ids = torch.cat([prompt, rand_ids(72, 5)], 1)
    assert torch.equal(greedy(model, ids, bank, 5), reference(model, ids, 5)), "the original lost its history"
    other_ids = torch.cat([other_out, rand_ids(73, 3)], 1)
    assert torch.equal(greedy(model, other_ids, other, 4), reference(model, other_ids, 4))
    assert used_with_copies > held, "the copies' blocks were not in the original's store"
    for b, s in ((bank, store), (other, other_store)):
        b.close()
        s.close()
