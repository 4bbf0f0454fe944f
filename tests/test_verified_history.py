"""Token identity is verified, never assumed (issue 5, defects 1 and 2).

A bank built with the model sees the input ids of every forward, so it knows the ids of every token
whose KV it holds, generated ones included. `attach(ids)` may reuse only the prefix equal to what was
computed, and only verified blocks enter the store's shared content index. A block's identity also
names the model (config, KV dtype, block size, weights digest or an explicit `model_id=`), so two
same-shape models on one store never share a block. A bank built from `model.config` cannot verify
generated ids: whatever it reuses stays private to it.
"""

from __future__ import annotations

import pytest
import torch

import tiered_kv
from helpers import (BLOCK_SIZE, TIER_KINDS, VOCAB, greedy, make_bank, rand_ids, reference, same_shape_model,
                     tier_config, tiny_model)

PROMPT_TOKENS, REPLY_TOKENS, NEXT_TOKENS = 14, 10, 6
EDIT_AT = {"reply": PROMPT_TOKENS + 3, "prompt": 6}  # both inside the tokens turn 1 computed


def _edited(ids: torch.Tensor, position: int) -> torch.Tensor:
    out = ids.clone()
    out[0, position] = 3 + (int(out[0, position]) - 3 + 1) % (VOCAB - 3)  # another id, never the pad id
    return out


def _first_turn(model, bank):
    prompt = rand_ids(1, PROMPT_TOKENS)
    assert bank.attach(prompt) == 0
    out = greedy(model, prompt, bank, REPLY_TOKENS)
    assert torch.equal(out, reference(model, prompt, REPLY_TOKENS))
    return out


@pytest.mark.parametrize("where", ("reply", "prompt"))
@pytest.mark.parametrize("kind", TIER_KINDS)
def test_edited_history_is_recomputed_and_never_shared(kind, where, tmp_path):
    model = tiny_model("llama")
    store = tiered_kv.TierStore(tier_config(kind, tmp_path))
    first = tiered_kv.CacheBank(model, store=store)
    out = _first_turn(model, first)
    position = EDIT_AT[where]
    user = rand_ids(2, 5)
    original = torch.cat([out, user], 1)
    edited = torch.cat([_edited(out, position), user], 1)
    expected_edited = reference(model, edited, NEXT_TOKENS)

    reused = first.attach(edited)
    assert reused <= position, f"edited {where} at token {position}: attach reused {reused} tokens"
    # a second chat on the same store, before the first recomputes: nothing at or after the edit
    second = tiered_kv.CacheBank(model, store=store)
    reused = second.attach(edited)
    assert reused <= position, f"a second bank reused {reused} tokens of a conversation edited at {position}"
    assert torch.equal(greedy(model, edited, second, NEXT_TOKENS), expected_edited)
    assert torch.equal(greedy(model, edited, first, NEXT_TOKENS), expected_edited)

    # the original conversation was verified: a third chat may reuse it, and must still be right
    third = tiered_kv.CacheBank(model, store=store)
    reused = third.attach(original)
    assert position // BLOCK_SIZE * BLOCK_SIZE <= reused <= original.shape[1] - 1
    assert torch.equal(greedy(model, original, third, NEXT_TOKENS), reference(model, original, NEXT_TOKENS))
    for bank in (first, second, third):
        bank.close()
    store.close()


@pytest.mark.parametrize("kind", TIER_KINDS)
def test_unedited_history_is_reused_whole(kind, tmp_path):
    """The other direction: verification must not cost the reuse of an unchanged conversation."""
    model = tiny_model("llama")
    bank = tiered_kv.CacheBank(model, tier_config(kind, tmp_path))
    out = _first_turn(model, bank)
    follow = torch.cat([out, rand_ids(3, 5)], 1)
    assert bank.attach(follow) == out.shape[1] - 1  # every computed token, generated ones included
    assert torch.equal(greedy(model, follow, bank, NEXT_TOKENS), reference(model, follow, NEXT_TOKENS))
    bank.close()


@pytest.mark.parametrize("kind", TIER_KINDS)
def test_ids_a_config_bank_adopts_never_reach_another_bank(kind, tmp_path):
    """CacheBank(model.config) never sees generated ids: an edited reply it is handed must not be
    published for a second chat on the same store."""
    model = tiny_model("llama")
    store = tiered_kv.TierStore(tier_config(kind, tmp_path))
    first = tiered_kv.CacheBank(model.config, store=store)
    out = _first_turn(model, first)
    position = EDIT_AT["reply"]
    edited = torch.cat([_edited(out, position), rand_ids(2, 5)], 1)
    first.attach(edited)  # may reuse its own history (documented: private to this bank)
    second = tiered_kv.CacheBank(model.config, store=store)
    reused = second.attach(edited)
    assert reused <= position, f"a second bank reused {reused} tokens of a conversation edited at {position}"
    assert torch.equal(greedy(model, edited, second, NEXT_TOKENS), reference(model, edited, NEXT_TOKENS))
    first.close()
    second.close()
    store.close()


def _chat_then_other_model(kind, tmp_path, first_model, second_model, form, first_kwargs, second_kwargs):
    """Chat with `first_model` on a shared store, then attach the same ids with `second_model`.
    Returns (conversation, turn-1 output, (tokens the second bank reused, whether its next turn
    equals its own DynamicCache run), store, banks to close)."""
    store = tiered_kv.TierStore(tier_config(kind, tmp_path))
    first = make_bank(form, first_model, store=store, **first_kwargs)
    prompt = rand_ids(4, 18)
    first.attach(prompt)
    out = greedy(first_model, prompt, first, 8)
    assert torch.equal(out, reference(first_model, prompt, 8))
    conversation = torch.cat([out, rand_ids(5, 5)], 1)
    first.attach(conversation)  # every computed token is now known to the first bank
    second = make_bank(form, second_model, store=store, **second_kwargs)
    reused = second.attach(conversation)
    follow = greedy(second_model, conversation, second, NEXT_TOKENS)
    served_right = torch.equal(follow, reference(second_model, conversation, NEXT_TOKENS))
    return conversation, out, (reused, served_right), store, [first, second]


@pytest.mark.parametrize("how", ("weights", "model_id"))
@pytest.mark.parametrize("kind", TIER_KINDS)
def test_same_shape_models_never_share_blocks(kind, how, tmp_path):
    base = tiny_model("llama")
    tuned = same_shape_model(base, seed=99)
    kwargs = ({}, {}) if how == "weights" else ({"model_id": "org/base"}, {"model_id": "org/tuned"})
    conversation, out, (reused, right), store, banks = _chat_then_other_model(kind, tmp_path, base, tuned, "model",
                                                                             *kwargs)
    assert reused == 0, f"a model with other weights reused {reused} tokens of the first model's KV"
    assert right, "the second model's tokens differ from its own DynamicCache run"
    # the same model (same model_id) on the same store does reuse: the test can fail both ways
    third = tiered_kv.CacheBank(base, store=store, **kwargs[0])
    assert third.attach(conversation) == (out.shape[1] - 1) // BLOCK_SIZE * BLOCK_SIZE
    follow = greedy(base, conversation, third, NEXT_TOKENS)
    assert torch.equal(follow, reference(base, conversation, NEXT_TOKENS))
    for bank in banks + [third]:
        bank.close()
    store.close()


def test_same_shape_models_config_banks_never_share_blocks(tmp_path):
    """Banks built from model.config know no weights digest: their reuse stays private."""
    base = tiny_model("llama")
    tuned = same_shape_model(base, seed=99)
    _, _, (reused, right), store, banks = _chat_then_other_model("forces_cold", tmp_path, base, tuned, "config", {}, {})
    assert reused == 0, f"a bank for another model reused {reused} tokens"
    assert right, "the second model's tokens differ from its own DynamicCache run"
    for bank in banks:
        bank.close()
    store.close()
