"""A step is atomic (issue 5, defect 4): a forward pass that stops partway leaves the bank as it was.

A forward hook on one decoder layer raises once, during a prefill or during a decode step of
generate(); layers before it have called `bank.update`, the layers after it never do. Afterwards the
bank's length, its blocks per tier and the store's tier use equal what they were before that forward
pass, and a retry of the same turn gives DynamicCache's tokens. (The hooked layer is never the last
one: DESIGN.md commits a step when the last layer's update finishes.)

Also: a corrupt cold block in a prefix two banks share never leaves either bank stuck.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import tiered_kv
from helpers import BLOCK_SIZE, flip_cold_byte, TIER_KINDS, VOCAB, greedy, make_bank, rand_ids, reference, tier_config, tiny_model

NUM_LAYERS = 6
LAYERS = sorted(random.Random(2024).sample(range(NUM_LAYERS - 1), 3))  # several k, never the last layer
NEW_TOKENS = 7


class Interrupt(Exception):
    """Raised from a forward hook, as Ctrl-C, an OOM or a failing kernel would."""


def _deep_model():
    torch.manual_seed(1234)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=NUM_LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=1024))
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _state(bank) -> dict:
    stats = bank.stats()
    return {
        "get_seq_length": bank.get_seq_length(),
        "seq_tokens": stats["seq_tokens"],
        "bank_blocks": dict(stats["bank_blocks"]),
        "used_blocks": {name: tier["used_blocks"] for name, tier in stats["tiers"].items()},
    }


def _failing_forward(prompt_tokens: int, phase: str) -> int:
    """Which forward of generate() fails (1 = the prefill): for decode, the step that writes the
    first token of a new block ("decode_new_block") or a token inside the tail block ("decode_tail")."""
    if phase == "prefill":
        return 1
    for forward in range(2, NEW_TOKENS + 1):  # forward f writes the token at position prompt_tokens + f - 2
        starts_block = (prompt_tokens + forward - 2) % BLOCK_SIZE == 0
        if starts_block == (phase == "decode_new_block"):
            return forward
    raise AssertionError("no such decode step")


@pytest.mark.parametrize("form, layer", [("model", k) for k in LAYERS] + [("config", LAYERS[0])])
@pytest.mark.parametrize("phase", ("prefill", "decode_new_block", "decode_tail"))
@pytest.mark.parametrize("kind", TIER_KINDS)
def test_interrupted_forward_leaves_the_bank_as_before_and_a_retry_matches(kind, phase, form, layer, tmp_path):
    rng = random.Random(f"{kind}/{phase}/{layer}")
    model = _deep_model()
    # the step's own atomicity: no background mover moving blocks between the snapshots
    bank = make_bank(form, model, {**tier_config(kind, tmp_path), "scheduler": {"background": False}})
    prompt = rand_ids(rng.randrange(10_000), rng.randint(9, 14))
    bank.attach(prompt)
    out = greedy(model, prompt, bank, NEW_TOKENS)  # history, so the failing turn has blocks to disturb
    ids = torch.cat([out, rand_ids(rng.randrange(10_000), rng.randint(3, 7))], 1)
    bank.attach(ids)

    fail_at = _failing_forward(ids.shape[1], phase)
    before_each_forward = []
    calls = [0]

    def snapshot(module, args, kwargs):
        before_each_forward.append(_state(bank))

    def interrupt(module, args, output):
        calls[0] += 1
        if calls[0] == fail_at:
            raise Interrupt(f"layer {layer}, forward {fail_at}")

    hooks = [model.register_forward_pre_hook(snapshot, with_kwargs=True),
             model.model.layers[layer].register_forward_hook(interrupt)]
    try:
        with pytest.raises(Interrupt):
            greedy(model, ids, bank, NEW_TOKENS)
    finally:
        for hook in hooks:
            hook.remove()
    assert len(before_each_forward) == fail_at
    assert _state(bank) == before_each_forward[-1], f"{phase} interrupted at layer {layer} changed the bank"

    if phase == "prefill":  # nothing of the failed step reached the store's shared index either
        other = make_bank(form, model, store=bank.store)
        assert other.attach(ids) <= before_each_forward[-1]["seq_tokens"]
        other.close()
    else:  # a front end sends the whole conversation again; the bank holds the decoded tokens before the failure
        bank.attach(ids)
    # the retry: the same generate() again
    assert torch.equal(greedy(model, ids, bank, NEW_TOKENS), reference(model, ids, NEW_TOKENS))
    bank.close()


def _corrupt_a_shared_cold_block(first, second, layer: int) -> int:
    """Flip one byte of one layer of the on-disk record of a cold block both banks hold; returns the
    block's position in the chat. The one place these tests reach into store and bank internals."""
    store = first.store
    shared = [b for b in first.block_table(0) if b in second.block_table(0) and store.index.get(b).tier == 2]
    assert shared, "the config must have pushed the shared prefix to cold"
    victim = shared[0]
    # byte 3 of a float: its sign and exponent, so served it would change the tokens
    flip_cold_byte(store, victim, layer * store.layout.layer_bytes + 3)
    return first.block_table(0).index(victim)


def _turn_with_one_retry(model, bank, ids, max_new_tokens):
    """A chat front end's turn: on a corrupt block, one retry with the whole conversation.
    Returns (tokens, what the successful attach reused)."""
    for attempt in range(2):
        try:
            reused = bank.attach(ids)
            return greedy(model, ids, bank, max_new_tokens), reused
        except tiered_kv.CorruptBlockError:
            if attempt:
                raise


@pytest.mark.parametrize("when", ("between_turns", "mid_decode"))
def test_a_corrupt_shared_cold_block_never_leaves_another_bank_stuck(when, tmp_path):
    """Two chats share a prefix; one byte of a shared cold block rots, between turns or while the
    first chat is decoding (in its second layer, so the step fails partway). Both chats' next turns
    equal DynamicCache, each after at most one retry."""
    model = tiny_model("llama")
    store = tiered_kv.TierStore(tier_config("forces_cold", tmp_path))
    banks = [tiered_kv.CacheBank(model, store=store), tiered_kv.CacheBank(model, store=store)]
    prompt = rand_ids(60, 30)
    banks[0].attach(prompt)
    out = greedy(model, prompt, banks[0], 4)
    # the second chat continues the same conversation differently: it shares the first's blocks
    ids = [torch.cat([out, rand_ids(61, 3)], 1), torch.cat([out, rand_ids(62, 5)], 1)]
    banks[0].attach(ids[0])
    assert banks[1].attach(ids[1]) >= 28
    positions, forwards = [], [0]

    def rot_during_first_decode_step(module, args, kwargs):
        forwards[0] += 1
        if forwards[0] == 2:
            positions.append(_corrupt_a_shared_cold_block(*banks, layer=1))

    hook = None
    if when == "between_turns":
        positions.append(_corrupt_a_shared_cold_block(*banks, layer=0))
    else:
        hook = model.register_forward_pre_hook(rot_during_first_decode_step, with_kwargs=True)
    for turn, chat in enumerate((0, 1, 0, 1)):  # each meets the corrupt block, then a turn after it
        follow, reused = _turn_with_one_retry(model, banks[chat], ids[chat], 5)
        if hook is not None:
            hook.remove()
            hook = None
        assert positions and positions[0] * BLOCK_SIZE < out.shape[1] - 1
        if when == "between_turns" and turn == 0:  # the first to meet it recomputes from there on
            assert reused <= positions[0] * BLOCK_SIZE, f"reused {reused} tokens past a corrupt block"
        assert torch.equal(follow, reference(model, ids[chat], 5)), f"chat {chat}, turn {turn // 2}"
        ids[chat] = torch.cat([follow, rand_ids(70 + turn, 3)], 1)
    for bank in banks:
        bank.close()
    store.close()
