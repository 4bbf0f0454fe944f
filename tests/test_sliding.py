"""Sliding-window and hybrid models (issue 18): Mistral (every layer sliding), Qwen2
(max_window_layers), Gemma 3 (5 sliding : 1 full), Cohere2 (3 : 1), tiny random weights, windows
of SLIDING_WINDOW tokens, conversations several windows long. Greedy tokens through CacheBank
equal DynamicCache's in every tier squeeze, hooks off and on; a sliding layer keeps only what
its window reaches; reuse across turns, chats, restarts and the remote tier."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import DynamicCache

import tiered_kv
from helpers import (BLOCK_SIZE, ENGINES, SLIDING_WINDOW, TIER_KINDS, VOCAB, WINDOWED_ARCHS, greedy,
                     rand_ids, reference, tier_config, tiny_model)
from tiered_kv.blocks import model_layer_groups
from tiered_kv.errors import LayoutError

HOOKS = (None, "exact", "merge")


def _conversation(model, bank, reference_model, turns: int = 4, new_tokens: int = 9, first_prompt: int = 13,
                  user_tokens: int = 6):
    """Greedy turns through `bank` and through a DynamicCache; asserts equal tokens each turn and
    returns the reuse of each later turn (tokens reused / prompt tokens)."""
    dynamic = DynamicCache(config=reference_model.config)
    ids_bank = ids_dyn = rand_ids(0, first_prompt)
    reuse = []
    for turn in range(turns):
        reused = bank.attach(ids_bank)
        if turn:
            reuse.append(reused / ids_bank.shape[1])
        out_bank = greedy(model, ids_bank, bank, new_tokens)
        out_dyn = greedy(reference_model, ids_dyn, dynamic, new_tokens)
        assert torch.equal(out_bank, out_dyn), f"turn {turn}: {out_bank.tolist()} != {out_dyn.tolist()}"
        assert bank.get_seq_length() == dynamic.get_seq_length() == out_bank.shape[1] - 1
        user = rand_ids(100 + turn, user_tokens)
        ids_bank, ids_dyn = torch.cat([out_bank, user], 1), torch.cat([out_dyn, user], 1)
    return reuse


@pytest.mark.parametrize("hooks", HOOKS, ids=("no-hooks", "exact", "merge"))
@pytest.mark.parametrize("kind", TIER_KINDS)
@pytest.mark.parametrize("arch", WINDOWED_ARCHS)
def test_greedy_multiturn_matches_dynamic_cache(arch, kind, hooks, tmp_path):
    model, reference_model = tiny_model(arch), tiny_model(arch)
    bank = tiered_kv.CacheBank(model, tier_config(kind, tmp_path))
    if hooks:
        tiered_kv.hooks.install(model, bank, mode=hooks)
        assert bank.hooks_mode == hooks
    reuse = _conversation(model, bank, reference_model)
    assert bank.get_seq_length() > 4 * SLIDING_WINDOW  # several windows long
    assert min(reuse) >= 0.7 and reuse[-1] >= 0.85  # all but the new user tokens (+1), at 13..60 tokens
    blocks = bank.stats()["bank_blocks"]
    if kind != "all_hot":
        assert blocks["hot"] + blocks["warm"] + blocks["cold"] > 0
    bank.close()


@pytest.mark.parametrize("arch", ("gemma3", "qwen2_sw"))
def test_copies_held_back_on_the_thread_engine(arch, tmp_path):
    """Every copy runs later on the CPU copy engine: the GPU's ordering rules, with windows."""
    engine, delay_us = ENGINES[1]
    model, reference_model = tiny_model(arch), tiny_model(arch)
    bank = tiered_kv.CacheBank(model, tier_config("forces_cold", tmp_path, engine=engine, delay_us=delay_us))
    _conversation(model, bank, reference_model)
    bank.close()


@pytest.mark.parametrize("engine, delay_us", ENGINES, ids=("sync", "thread300us"))
@pytest.mark.parametrize("kind", TIER_KINDS)
@pytest.mark.parametrize("arch", ("gemma3", "mistral_sw"))
def test_turns_longer_than_a_window_store_only_what_it_keeps(arch, kind, engine, delay_us, tmp_path):
    """Every turn's new tokens pass the window (40-token prompt, 25-token messages, window 10):
    each sliding row's new blocks start past a gap, and the tokens still equal DynamicCache's."""
    model, reference_model = tiny_model(arch), tiny_model(arch)
    bank = tiered_kv.CacheBank(model, tier_config(kind, tmp_path, engine=engine, delay_us=delay_us))
    gapped, open_step = [], bank.store.open_step

    def spy(request):
        gapped.append(sum(g is not None for g in request.new_first_blocks))
        return open_step(request)

    bank.store.open_step = spy
    _conversation(model, bank, reference_model, turns=3, first_prompt=40, user_tokens=25)
    sliding_rows = sum(g.is_sliding for g in bank.layer_groups.groups)
    assert gapped.count(sliding_rows) >= 3  # every prefill gapped every sliding row
    bank.close()


def test_layer_groups_of_each_family():
    shapes = {}
    for arch in WINDOWED_ARCHS:
        groups = model_layer_groups(tiny_model(arch).config)
        shapes[arch] = (groups.layers_per_group, [(g.layer_type, g.window, g.layers) for g in groups.groups])
    sliding, full = "sliding_attention", "full_attention"
    assert shapes["mistral_sw"] == (2, [(sliding, SLIDING_WINDOW, (0, 1))])
    assert shapes["qwen2_sw"] == (2, [(full, None, (0, 1)), (sliding, SLIDING_WINDOW, (2, 3))])
    assert shapes["gemma3"][0] == 1 and [g[2] for g in shapes["gemma3"][1]] == [(0,), (1,), (2,), (3,), (4,), (5,)]
    assert [g[0] for g in shapes["gemma3"][1]] == [sliding] * 5 + [full]
    assert [g[0] for g in shapes["cohere2"][1]] == [sliding] * 3 + [full]
    llama = model_layer_groups(tiny_model("llama").config)
    assert llama.is_single_full and llama.layers_per_group == 2


def test_sliding_rows_keep_only_their_window(tmp_path):
    """A long chat: each sliding row holds at most its window plus two blocks; the full row all of it;
    stats() reports bytes per layer type against what DynamicLayer everywhere would hold."""
    model = tiny_model("gemma3")
    bank = tiered_kv.CacheBank(model, tier_config("all_hot", tmp_path))
    out = greedy(model, rand_ids(3, 90), bank, 30)
    assert torch.equal(out, reference(model, rand_ids(3, 90), 30))
    num_tokens = bank.get_seq_length()
    window_blocks = -(-(SLIDING_WINDOW - 1) // BLOCK_SIZE) + 2
    for group in range(5):
        assert len(bank.block_table(0, group)) <= window_blocks
    assert len(bank.block_table(0, 5)) == -(-num_tokens // BLOCK_SIZE)
    kv = bank.stats()["kv_bytes"]
    per_token_layer = kv["full_attention"] // (len(bank.block_table(0, 5)) * BLOCK_SIZE)
    assert kv["full_attention_equivalent"] == num_tokens * 6 * per_token_layer
    assert kv["sliding_attention"] <= 5 * window_blocks * BLOCK_SIZE * per_token_layer
    assert kv["total"] == kv["full_attention"] + kv["sliding_attention"]
    # the store holds no more than the bank's rows: what left a window was freed, not moved down
    used = sum(tier["used_blocks"] for tier in bank.stats()["tiers"].values())
    assert used == sum(len(bank.block_table(0, g)) for g in range(6))
    bank.close()


def test_a_second_chat_reuses_a_published_conversation(tmp_path):
    """Another bank on the same store picks the conversation up where it ended: full groups from
    their whole chain, sliding groups from the blocks just before that point."""
    model = tiny_model("gemma3")
    store = tiered_kv.TierStore(tier_config("forces_warm", tmp_path))
    first = tiered_kv.CacheBank(model, store=store)
    out = greedy(model, rand_ids(4, 50), first, 8)
    follow = torch.cat([out, rand_ids(5, 5)], 1)
    second = tiered_kv.CacheBank(model, store=store)
    reused = second.attach(follow)
    assert reused == (out.shape[1] - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert torch.equal(greedy(model, follow, second, 7), reference(model, follow, 7))
    first.close()
    second.close()
    store.close()


def test_a_new_store_reattaches_a_hybrid_conversation_from_cold(tmp_path):
    model = tiny_model("cohere2")
    bank = tiered_kv.CacheBank(model, tier_config("forces_cold", tmp_path))
    out = greedy(model, rand_ids(6, 40), bank, 9)
    bank.close()  # its store closes: published blocks made durable in cold
    follow = torch.cat([out, rand_ids(7, 4)], 1)
    again = tiered_kv.CacheBank(model, tier_config("forces_cold", tmp_path))
    reused = again.attach(follow)
    assert reused == (out.shape[1] - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert reused >= 0.9 * (follow.shape[1] - 4)
    assert torch.equal(greedy(model, follow, again, 6), reference(model, follow, 6))
    again.close()


def test_another_layout_is_never_read_as_this_one(tmp_path):
    """Blocks of a Qwen2 model with windows and of the same model without them hold the same
    shapes but other bytes' meaning: a store written by one serves the other nothing."""
    windowed = tiny_model("qwen2_sw")
    bank = tiered_kv.CacheBank(windowed, tier_config("forces_cold", tmp_path))
    out = greedy(windowed, rand_ids(8, 30), bank, 5)
    bank.close()
    plain_config = type(windowed.config).from_dict({**windowed.config.to_dict(), "use_sliding_window": False,
                                                    "layer_types": None})
    torch.manual_seed(1234)
    plain = type(windowed)(plain_config)
    plain.load_state_dict(windowed.state_dict())
    plain.eval()
    plain.generation_config.eos_token_id, plain.generation_config.pad_token_id = None, 0
    assert model_layer_groups(plain.config).is_single_full
    try:
        other = tiered_kv.CacheBank(plain, tier_config("forces_cold", tmp_path))
    except LayoutError:
        return  # refused outright: never read
    assert other.attach(out) == 0
    assert torch.equal(greedy(plain, out, other, 4), reference(plain, out, 4))
    other.close()


def test_group_keys_differ_for_the_same_ids(tmp_path):
    model = tiny_model("gemma3")
    bank = tiered_kv.CacheBank(model, tier_config("all_hot", tmp_path))
    greedy(model, rand_ids(9, 12), bank, 2)
    roots = {bank.root_key(g) for g in range(6)}
    assert len(roots) == 6 and bank.fingerprint.root_key(bank.store.layout.dtype_name) not in roots
    bank.close()


@pytest.mark.parametrize("kind", TIER_KINDS)
@pytest.mark.parametrize("arch", ("gemma3", "mistral_sw"))
def test_beam_search_matches_dynamic_cache(arch, kind, tmp_path):
    model = tiny_model(arch)
    ids = rand_ids(10, 17)
    config = tier_config(kind, tmp_path)
    if kind == "forces_cold":
        config["cold"]["capacity_blocks"] = 256
    bank = tiered_kv.CacheBank(model, config)
    kwargs = dict(max_new_tokens=2 * SLIDING_WINDOW, num_beams=2, do_sample=False, early_stopping=True)
    out_bank = model.generate(ids, cache=bank, **kwargs)
    out_dyn = model.generate(ids, cache=DynamicCache(config=model.config), **kwargs)
    assert torch.equal(out_bank, out_dyn)
    bank.close()


@pytest.mark.parametrize("hooks", (None, "exact"), ids=("no-hooks", "exact"))
@pytest.mark.parametrize("kind", TIER_KINDS)
@pytest.mark.parametrize("arch", ("cohere2", "qwen2_sw"))
def test_batch_with_left_padding_matches_dynamic_cache(arch, kind, hooks, tmp_path):
    model, reference_model = tiny_model(arch), tiny_model(arch)
    bank = tiered_kv.CacheBank(model, tier_config(kind, tmp_path))
    if hooks:
        tiered_kv.hooks.install(model, bank, mode=hooks)
    a, b = rand_ids(11, 22), rand_ids(12, 9)
    ids = torch.cat([a, torch.cat([torch.zeros(1, 13, dtype=torch.long), b], 1)], 0)
    mask = torch.ones_like(ids)
    mask[1, :13] = 0
    out_bank = model.generate(ids, cache=bank, attention_mask=mask, max_new_tokens=15, do_sample=False)
    out_dyn = reference_model.generate(ids, cache=DynamicCache(config=reference_model.config), attention_mask=mask,
                                       max_new_tokens=15, do_sample=False)
    assert torch.equal(out_bank, out_dyn)
    assert bank.batch_size == 2
    bank.close()


def test_truncate_inside_a_released_window_is_refused_and_loses_nothing(tmp_path):
    model = tiny_model("mistral_sw")
    bank = tiered_kv.CacheBank(model, tier_config("all_hot", tmp_path))
    out = greedy(model, rand_ids(13, 40), bank, 5)
    length = bank.get_seq_length()
    with pytest.raises(ValueError, match="sliding-window layers released"):
        bank.truncate(8)
    assert bank.get_seq_length() == length
    bank.truncate(length - 2)  # still inside what the window keeps
    assert torch.equal(greedy(model, out, bank, 4), reference(model, out, 4))
    bank.truncate(0)
    assert bank.get_seq_length() == 0
    bank.close()


def test_attach_after_a_divergent_edit_recomputes_rather_than_serve_a_missing_window(tmp_path):
    """The user edits an early message: the bank's own window no longer matches; with nothing
    stored for that point it starts over, and the tokens are still DynamicCache's."""
    model = tiny_model("gemma3")
    bank = tiered_kv.CacheBank(model, tier_config("forces_warm", tmp_path))
    out = greedy(model, rand_ids(14, 45), bank, 6)
    edited = out.clone()
    edited[0, 30] = (edited[0, 30] + 1) % VOCAB
    reused = bank.attach(edited)
    assert reused in (0, 28)  # the block boundary before the edit, when its window is stored
    assert torch.equal(greedy(model, edited, bank, 6), reference(model, edited, 6))
    bank.close()


def test_linear_attention_layers_are_refused_before_anything_is_allocated(tmp_path):
    from transformers import Qwen3NextConfig

    config = Qwen3NextConfig(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                             vocab_size=VOCAB)
    cold = tmp_path / "cold"
    with pytest.raises(LayoutError, match=r"'qwen3_next'.*'linear_attention'"):
        tiered_kv.CacheBank(config, tier_config("forces_cold", cold))
    assert not cold.exists() or not any(cold.iterdir())


def test_soft_capped_attention_keeps_transformers_own_function(tmp_path, caplog):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    def build():
        torch.manual_seed(5)
        model = Gemma3ForCausalLM(Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                   head_dim=16, sliding_window=SLIDING_WINDOW,
                                                   attn_logit_softcapping=5.0, attn_implementation="eager"))
        model.eval()
        model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 0
        return model

    model, reference_model = build(), build()
    bank = tiered_kv.CacheBank(model, tier_config("forces_warm", tmp_path))
    with caplog.at_level(logging.WARNING, logger="tiered_kv.hooks"):
        tiered_kv.hooks.install(model, bank, mode="merge")
    assert model.config._attn_implementation == "eager" and bank.hooks_mode is None
    assert "soft-caps" in caplog.text
    _conversation(model, bank, reference_model, turns=2)
    bank.close()


def test_the_memory_target_shape_stores_about_the_window_share(tmp_path):
    """A 5:1 model with a window an eighth of the chat stores ~(1/6 + 5/6 * 1/8) of the full KV
    (issue 18's target shape, scaled down: 256 tokens, window 32), within a block per layer."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(2)
    model = Gemma3ForCausalLM(Gemma3TextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1,
                                               head_dim=16, sliding_window=32, query_pre_attn_scalar=16))
    model.eval()
    config = tier_config("all_hot", tmp_path)
    config["hot"]["capacity_blocks"] = 120  # the prefill too stores only what each window keeps (109)
    bank = tiered_kv.CacheBank(model, config)
    with torch.no_grad():
        model(rand_ids(15, 256), cache=bank, use_cache=True)
    kv = bank.stats()["kv_bytes"]
    share = kv["total"] / kv["full_attention_equivalent"]
    expected = 1 / 6 + 5 / 6 * 32 / 256
    assert abs(share - expected) <= 6 * BLOCK_SIZE / (6 * 256), (share, expected)  # a block per layer
    bank.close()


def test_a_long_prefill_stores_only_what_each_window_keeps(tmp_path):
    """A prefill whose new tokens pass a sliding group's window stores only the blocks that
    window keeps (the tokens before are attended from the model's own K/V): 100 tokens of a
    5:1 model fit 80 blocks where all of them would take 150. A prompt too large even so is a
    CapacityError naming the blocks, before any forward pass writes; the bank stays usable."""
    model = tiny_model("gemma3")
    config = tier_config("all_hot", tmp_path)
    config["hot"]["capacity_blocks"] = 80
    bank = tiered_kv.CacheBank(model, config)
    with pytest.raises(tiered_kv.CapacityError, match="blocks"):
        greedy(model, rand_ids(16, 300), bank, 2)  # its full-attention group alone needs 75, windows 40
    assert bank.get_seq_length() == 0 and bank.stats()["tiers"]["hot"]["used_blocks"] == 0
    ids = rand_ids(16, 100)
    out = greedy(model, ids, bank, 12)
    assert torch.equal(out, reference(model, ids, 12))
    assert bank.stats()["tiers"]["hot"]["used_blocks"] <= 80
    follow = torch.cat([out, rand_ids(17, 40)], 1)  # a long next turn: gapped again, over history
    assert bank.attach(follow) == out.shape[1] - 1
    assert torch.equal(greedy(model, follow, bank, 6), reference(model, follow, 6))
    bank.close()


def _other_family(name: str):
    """Tiny random-weight OLMo 3 (3 sliding : 1 full), gpt-oss (alternating, attention sinks) and
    Llama 4 text (3 chunked : 1 full, chunk = SLIDING_WINDOW)."""
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, head_dim=16)
    torch.manual_seed(1234)
    if name == "olmo3":
        common.pop("head_dim")
        model = transformers.Olmo3ForCausalLM(transformers.Olmo3Config(**common, sliding_window=SLIDING_WINDOW))
    elif name == "gpt_oss":
        model = transformers.GptOssForCausalLM(transformers.GptOssConfig(
            **common, sliding_window=SLIDING_WINDOW, num_local_experts=2, num_experts_per_tok=1,
            layer_types=["sliding_attention", "full_attention"] * 2))
    else:
        model = transformers.Llama4ForCausalLM(transformers.Llama4TextConfig(
            **common, attention_chunk_size=SLIDING_WINDOW, intermediate_size_mlp=128, num_local_experts=2))
    model.eval()
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 0
    return model


@pytest.mark.parametrize("hooks", (None, "exact"), ids=("no-hooks", "exact"))
@pytest.mark.parametrize("name", ("olmo3", "gpt_oss", "llama4"))
def test_more_families_match_dynamic_cache(name, hooks, tmp_path):
    model, reference_model = _other_family(name), _other_family(name)
    bank = tiered_kv.CacheBank(model, tier_config("forces_warm", tmp_path))
    assert bank.layer_groups.any_sliding and not bank.layer_groups.is_single_full
    if hooks:
        tiered_kv.hooks.install(model, bank, mode=hooks)
        # gpt-oss adds sink logits: its attention stays transformers' own, served through update()
        assert bank.hooks_mode == (None if name == "gpt_oss" else hooks)
    _conversation(model, bank, reference_model, turns=3)
    bank.close()


@pytest.mark.parametrize("how", ("another_bank", "restart"))
def test_a_model_of_sliding_layers_only_resumes_a_stored_conversation(how, tmp_path):
    """No full chain caps where Mistral (every layer sliding) can resume: it is the last boundary
    at which every window is stored, not the end of the new prompt (found by a review: such a
    model reused nothing once the ids carried a new message)."""
    model = tiny_model("mistral_sw")
    config = tier_config("forces_cold", tmp_path)
    store = tiered_kv.TierStore(config)
    first = tiered_kv.CacheBank(model, store=store)
    out = greedy(model, rand_ids(17, 45), first, 12)
    if how == "restart":
        first.close()
        store.close()
        store = tiered_kv.TierStore(config)
    follow = torch.cat([out, rand_ids(18, 5)], 1)
    second = tiered_kv.CacheBank(model, store=store)
    assert second.attach(follow) == (out.shape[1] - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert torch.equal(greedy(model, follow, second, 6), reference(model, follow, 6))
    second.close()
    if how == "another_bank":
        first.close()
    store.close()


def test_a_padded_group_is_written_whole_and_survives_a_restart(tmp_path):
    """34 layers of Gemma 3's pattern (29 sliding, 5 full) make more than MAX_GROUPS equal groups,
    so groups take 5 layers and the last sliding one has 4: its blocks' fifth layer is written
    (zeros), so a block made in cold is durable and the chat resumes after a restart (found by a
    review: it was never made durable and a restart reused nothing)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(4)
    model = Gemma3ForCausalLM(Gemma3TextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=34, num_attention_heads=2, num_key_value_heads=1,
                                               head_dim=16, sliding_window=SLIDING_WINDOW, query_pre_attn_scalar=16))
    model.eval()
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 0
    groups = model_layer_groups(model.config)
    assert any(len(g.layers) < groups.layers_per_group for g in groups.groups)
    config = tier_config("forces_cold", tmp_path)
    config["cold"]["capacity_blocks"] = 512
    bank = tiered_kv.CacheBank(model, config)
    out = greedy(model, rand_ids(19, 40), bank, 9)
    bank.close()
    again = tiered_kv.CacheBank(model, config)
    follow = torch.cat([out, rand_ids(20, 4)], 1)
    assert again.attach(follow) == (out.shape[1] - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert torch.equal(greedy(model, follow, again, 4), reference(model, follow, 4))
    again.close()


def test_history_comes_up_newest_first_by_position_across_groups(tmp_path):
    """Promotion and prefetch order blocks by sequence position, newest first, so a sliding
    group's window comes up with the full group's newest blocks, not after its whole history."""
    model = tiny_model("gemma3")
    bank = tiered_kv.CacheBank(model, tier_config("all_hot", tmp_path))
    greedy(model, rand_ids(21, 60), bank, 9)
    order = bank.seq.promotion_order()
    newest = {bank.block_table(0, g)[-1] for g in range(6)}
    assert set(order[:6]) == newest
    assert len(order) == len(set(order)) == sum(len(bank.block_table(0, g)) for g in range(6))
    bank.close()
