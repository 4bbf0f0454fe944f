"""tiered_kv.hooks: the bank under a model's attention (issues 8, 34).

exact mode must give logits bitwise equal to transformers' sdpa over a DynamicCache, and greedy /
beam / left-padded tokens equal to it in every tier configuration; merge mode equal tokens and
logits within float tolerance (its paged kernel runs here through the kernels' torch reference).
The tallies in stats()["hooks"]["steps_by_read"] prove how each step read its blocks (views,
one gather per layer, the paged kernel, staged through the lease), so a silent fallback cannot
pass these tests.
"""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import DynamicCache

import tiered_kv
from tiered_kv import hooks
from helpers import TIER_KINDS, VOCAB, flip_cold_byte, linear_attention_model, rand_ids, tier_config, tiny_model

MODES = ("exact", "merge")


@pytest.fixture
def model():
    m = tiny_model("llama")
    yield m
    hooks.uninstall(m)


def _turn_ids(seed: int, length: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


def _logits_per_step(model, cache, ids, steps: int) -> list[torch.Tensor]:
    """Prefill `ids`, then `steps` greedy one-token forwards; the logits of each forward."""
    out = []
    with torch.no_grad():
        logits = model(ids, cache=cache, use_cache=True).logits
        out.append(logits)
        for _ in range(steps):
            token = logits[:, -1:].argmax(-1)
            logits = model(token, cache=cache, use_cache=True).logits
            out.append(logits)
    return out


def _reads(bank) -> dict:
    return bank.stats()["hooks"]["steps_by_read"]


def _logits_per_step_in_mode(model, config, mode):
    bank = tiered_kv.CacheBank(model, config)
    hooks.install(model, bank, mode=mode)
    try:
        assert bank.hooks_mode == mode
        return _logits_per_step(model, bank, _turn_ids(1, 23), 6)
    finally:
        hooks.uninstall(model)
        bank.close()


@pytest.mark.parametrize("kind", TIER_KINDS)
def test_exact_logits_are_bitwise_equal_to_sdpa(kind, model, tmp_path):
    assert model.config._attn_implementation == "sdpa"
    expected = _logits_per_step(model, DynamicCache(config=model.config), _turn_ids(1, 23), 6)
    bank = tiered_kv.CacheBank(model, tier_config(kind, tmp_path))
    hooks.install(model, bank, mode="exact")
    got = _logits_per_step(model, bank, _turn_ids(1, 23), 6)
    for step, (a, b) in enumerate(zip(got, expected)):
        assert torch.equal(a, b), f"step {step}: max diff {(a - b).abs().max().item()}"
    assert bank.stats()["hooks"]["mode"] == "exact"
    reads = _reads(bank)
    if kind == "all_hot":  # consecutive hot slots: views, nothing copied
        assert reads == {"view": 7, "gather": 0, "split": 0, "paged": 0, "staged": 0, "sparse": 0}, reads
    elif kind == "forces_warm":  # hot and paged warm share the CPU slab: one gather per layer
        assert reads["gather"] >= 5 and reads["staged"] == 0, reads
    else:  # blocks in cold are read through the lease
        assert reads["staged"] > 0, reads
    bank.close()


@pytest.mark.parametrize("kind", TIER_KINDS)
def test_merge_logits_match_sdpa_within_float_tolerance(kind, model, tmp_path):
    """merge on a CPU: a decode step over runs of the slab attends to each run in place and merges
    the partial attentions by log-sum-exp (bank/partial.py): equal to sdpa within fp32 rounding."""
    expected = _logits_per_step(model, DynamicCache(config=model.config), _turn_ids(2, 23), 6)
    bank = tiered_kv.CacheBank(model, tier_config(kind, tmp_path))
    hooks.install(model, bank, mode="merge")
    got = _logits_per_step(model, bank, _turn_ids(2, 23), 6)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    reads = _reads(bank)
    if kind == "all_hot":
        assert reads["view"] == 7, reads
    elif kind == "forces_warm":  # history in a hot run and a warm run: split, never gathered
        assert reads["split"] >= 5 and reads["gather"] == 0, reads
    else:
        assert reads["staged"] > 0, reads
    bank.close()


@pytest.mark.parametrize("layout", ("paged", "records"))
def test_a_spilled_step_reads_warm_where_the_layout_lets_it(layout, model, tmp_path):
    """A CPU store's paged warm slab shares hot's token axis: a step whose history spilled to warm
    gathers hot and warm with one index per layer. With records (a GPU's warm layout) the step
    reads through the lease. Logits equal sdpa's either way."""
    config = {"block_size": 4, "hot": {"device": "cpu", "capacity_blocks": 3},
              "warm": {"capacity_blocks": 64, "layout": layout}, "cold": {"capacity": 0}}
    expected = _logits_per_step(model, DynamicCache(config=model.config), _turn_ids(5, 30), 4)
    bank = tiered_kv.CacheBank(model, config)
    hooks.install(model, bank, mode="exact")
    got = _logits_per_step(model, bank, _turn_ids(5, 30), 4)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    reads = _reads(bank)
    if layout == "paged":  # (a step whose blocks happen to lie in one run of the slab is read as a view)
        assert reads["gather"] > 0 and reads["gather"] + reads["view"] == 5 and reads["staged"] == 0, reads
    else:
        assert reads["staged"] == 5 and reads["gather"] == 0, reads
    bank.close()


def test_a_padded_row_under_a_split_step_attends_through_its_mask(model, tmp_path):
    """A split step's query must see every key; a mask hiding some (here an explicit 4D mask that
    hides the first key) makes the step concatenate its runs and run sdpa with that mask."""
    bank = tiered_kv.CacheBank(model, tier_config("forces_warm", tmp_path))
    dynamic = DynamicCache(config=model.config)
    ids = _turn_ids(12, 23)
    with torch.no_grad():
        for cache in (bank, dynamic):  # the history, then decode steps that split it into runs
            hooks.install(model, bank, mode="merge") if cache is bank else hooks.uninstall(model)
            logits = model(ids, cache=cache, use_cache=True).logits
            for _ in range(4):
                logits = model(logits[:, -1:].argmax(-1), cache=cache, use_cache=True).logits
        hooks.install(model, bank, mode="merge")
        before = _reads(bank)["split"]
        token = _turn_ids(13, 1)
        mask = torch.ones(1, 1, 1, 28, dtype=torch.bool)
        mask[..., 0] = False
        got = model(token, cache=bank, attention_mask=mask, use_cache=True).logits
        hooks.uninstall(model)
        want = model(token, cache=dynamic, attention_mask=mask, use_cache=True).logits
    assert before >= 1 and _reads(bank)["split"] == before + 1, _reads(bank)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    bank.close()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", TIER_KINDS)
@pytest.mark.parametrize("arch", ("llama", "qwen2", "mistral"))
def test_greedy_multiturn_with_hooks_matches_dynamic_cache(arch, kind, mode, tmp_path):
    model = tiny_model(arch)
    bank = tiered_kv.CacheBank(model, tier_config(kind, tmp_path))
    hooks.install(model, bank, mode=mode)
    dynamic = DynamicCache(config=model.config)
    ids = _turn_ids(0, 13)
    for turn in range(3):
        bank.attach(ids)
        out_bank = model.generate(ids, cache=bank, attention_mask=torch.ones_like(ids), max_new_tokens=9,
                                  do_sample=False)
        hooks.uninstall(model)  # the reference runs plain sdpa
        out_dyn = model.generate(ids, cache=dynamic, attention_mask=torch.ones_like(ids), max_new_tokens=9,
                                 do_sample=False)
        hooks.install(model, bank, mode=mode)
        assert torch.equal(out_bank, out_dyn), f"turn {turn}: {out_bank.tolist()} != {out_dyn.tolist()}"
        ids = torch.cat([out_bank, _turn_ids(turn + 1, 6)], 1)
    assert sum(_reads(bank).values()) == 3 * 9  # every step counted once
    hooks.uninstall(model)
    bank.close()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", TIER_KINDS)
def test_beam_search_with_hooks_matches_dynamic_cache(kind, mode, model, tmp_path):
    ids = _turn_ids(7, 11)
    config = tier_config(kind, tmp_path)
    if kind == "forces_cold":
        config["cold"]["capacity_blocks"] = 64
    kwargs = dict(max_new_tokens=8, num_beams=2, do_sample=False, early_stopping=True)
    expected = model.generate(ids, cache=DynamicCache(config=model.config), **kwargs)
    bank = tiered_kv.CacheBank(model, config)
    hooks.install(model, bank, mode=mode)
    assert torch.equal(model.generate(ids, cache=bank, **kwargs), expected)
    reads = _reads(bank)
    assert reads["view"] == 0 and reads["gather" if kind != "forces_cold" else "staged"] > 0, reads  # 2 rows
    bank.close()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", TIER_KINDS)
def test_left_padded_batch_with_hooks_matches_dynamic_cache(kind, mode, model, tmp_path):
    a, b = _turn_ids(11, 12), _turn_ids(12, 7)
    ids = torch.cat([a, torch.cat([torch.zeros(1, 5, dtype=torch.long), b], 1)], 0)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    expected = model.generate(ids, cache=DynamicCache(config=model.config), attention_mask=mask, max_new_tokens=7,
                              do_sample=False)
    bank = tiered_kv.CacheBank(model, tier_config(kind, tmp_path))
    hooks.install(model, bank, mode=mode)
    assert torch.equal(model.generate(ids, cache=bank, attention_mask=mask, max_new_tokens=7, do_sample=False),
                       expected)
    bank.close()


def test_the_gather_buffer_is_one_layer_of_one_chat_and_reused(model, tmp_path):
    """Beyond the hot budget a step gathers into one buffer of one layer's K/V (whole blocks),
    grown by a quarter at least only when the chat outgrows it, never allocated per step."""
    bank = tiered_kv.CacheBank(model, tier_config("forces_warm", tmp_path))
    hooks.install(model, bank)
    ids = _turn_ids(3, 30)
    new_tokens = 40
    model.generate(ids, cache=bank, max_new_tokens=new_tokens, do_sample=False)
    layout = bank.store.layout
    blocks = -(-bank.get_seq_length() // layout.block_size)
    one_layer_bytes = 2 * layout.num_kv_heads * blocks * layout.block_size * layout.head_dim * 4  # K and V, fp32
    used = bank.stats()["hooks"]["gather_buffer_bytes"]
    assert one_layer_bytes <= used <= 1.25 * one_layer_bytes + 64 * 4 * 2 * layout.num_kv_heads * layout.head_dim
    reads = _reads(bank)
    assert reads["gather"] > 0 and reads["gather"] + reads["view"] == new_tokens and reads["staged"] == 0, reads
    # 40 steps grew the chat from 8 to 18 blocks: the first allocation, then growth by >= 25% (8 10 12 15 18)
    assert 1 <= bank.steps.gather_buffer.num_allocations <= 5
    bank.close()


def test_a_corrupt_cold_block_is_never_served(model, tmp_path):
    """A byte of a cold record rots between turns; the next turn's check of its history finds
    it: the bank is cut before the block; the retry recomputes it and equals DynamicCache."""
    bank = tiered_kv.CacheBank(model, tier_config("forces_cold", tmp_path))
    hooks.install(model, bank)
    ids = rand_ids(5, 30)
    out = model.generate(ids, cache=bank, max_new_tokens=4, do_sample=False)
    store = bank.store
    cold = [b for b in bank.block_table(0) if store.index.get(b).tier == 2]
    assert cold, "the config must have pushed history to cold"
    victim = cold[-1]
    position = bank.block_table(0).index(victim)
    flip_cold_byte(store, victim, 1 * store.layout.layer_bytes + 3)  # layer 1
    follow = torch.cat([out, rand_ids(6, 3)], 1)
    with pytest.raises(tiered_kv.CorruptBlockError):
        model.generate(follow, cache=bank, max_new_tokens=5, do_sample=False)
    assert bank.get_seq_length() <= position * store.config.block_size
    got = model.generate(follow, cache=bank, max_new_tokens=5, do_sample=False)  # the retry recomputes
    hooks.uninstall(model)
    assert torch.equal(got, model.generate(follow, max_new_tokens=5, do_sample=False))
    bank.close()


def test_banks_in_threads_share_a_hooked_model(model, tmp_path):
    store = tiered_kv.TierStore(tier_config("forces_cold", tmp_path))
    banks = [tiered_kv.CacheBank(model, store=store) for _ in range(2)]
    hooks.install(model, banks[0])
    prompts = [rand_ids(40 + i, 17 + 5 * i) for i in range(2)]
    results, errors = [None, None], []

    def chat(i):
        try:
            ids = prompts[i]
            for turn in range(2):
                ids = model.generate(ids, cache=banks[i], max_new_tokens=5, do_sample=False)
                ids = torch.cat([ids, rand_ids(60 + turn, 4)], 1)
            results[i] = ids
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=chat, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    hooks.uninstall(model)
    for i in range(2):
        ids = prompts[i]
        for turn in range(2):
            ids = model.generate(ids, max_new_tokens=5, do_sample=False)
            ids = torch.cat([ids, rand_ids(60 + turn, 4)], 1)
        assert torch.equal(results[i], ids)
    for bank in banks:
        assert sum(_reads(bank).values()) == 2 * 5
        bank.close()
    store.close()


def test_uninstall_restores_sdpa_and_the_bank_keeps_working(model, tmp_path):
    bank = tiered_kv.CacheBank(model, tier_config("forces_warm", tmp_path))
    hooks.install(model, bank, mode="merge")
    assert hooks.installed_mode(model) == "merge"
    ids = _turn_ids(9, 15)
    out = model.generate(ids, cache=bank, max_new_tokens=4, do_sample=False)
    hooks.uninstall(model)
    assert model.config._attn_implementation == "sdpa" and hooks.installed_mode(model) is None
    follow = torch.cat([out, _turn_ids(10, 3)], 1)
    got = model.generate(follow, cache=bank, max_new_tokens=4, do_sample=False)
    assert bank.stats()["hooks"]["mode"] is None
    assert torch.equal(got, model.generate(follow, max_new_tokens=4, do_sample=False))
    bank.close()


def test_a_later_set_attn_implementation_turns_the_hooks_off_never_wrong(model, tmp_path):
    bank = tiered_kv.CacheBank(model, tier_config("forces_warm", tmp_path))
    hooks.install(model, bank)
    model.set_attn_implementation("eager")
    ids = _turn_ids(4, 12)
    got = model.generate(ids, cache=bank, max_new_tokens=4, do_sample=False)
    assert bank.stats()["hooks"]["mode"] is None
    assert torch.equal(got, model.generate(ids, max_new_tokens=4, do_sample=False))
    bank.close()


# ---- bad input -----------------------------------------------------------------------------

def test_linear_attention_models_are_refused_and_nothing_is_patched():
    model = linear_attention_model()
    before = model.config._attn_implementation
    with pytest.raises(tiered_kv.LayoutError, match=r"'qwen3_next' has \['linear_attention'\] layers"):
        hooks.check_servable(model)
    assert model.config._attn_implementation == before and hooks.installed_mode(model) is None


def test_attention_layers_without_layer_idx_are_refused(model, tmp_path):
    bank = tiered_kv.CacheBank(model, tier_config("all_hot", tmp_path))
    del model.model.layers[1].self_attn.layer_idx
    with pytest.raises(tiered_kv.LayoutError, match="'llama'.*layer_idx"):
        hooks.install(model, bank)
    assert model.config._attn_implementation == "sdpa"
    bank.close()


def test_install_checks_mode_and_bank(model, tmp_path):
    bank = tiered_kv.CacheBank(model, tier_config("all_hot", tmp_path))
    with pytest.raises(ValueError, match="allowed: \\['exact', 'merge'\\]"):
        hooks.install(model, bank, mode="paged")
    hooks.install(model, bank, mode="fast")  # the name of earlier releases
    assert hooks.installed_mode(model) == "merge"
    hooks.uninstall(model)
    config_bank = tiered_kv.CacheBank(model.config, tier_config("all_hot", tmp_path / "b"))
    with pytest.raises(ValueError, match="built from this model"):
        hooks.install(model, config_bank)
    with pytest.raises(TypeError, match="CacheBank"):
        hooks.install(model, DynamicCache())
    assert model.config._attn_implementation == "sdpa"
    bank.close()
    config_bank.close()


@pytest.mark.parametrize("kind", ("forces_warm",))
def test_merge_decode_through_the_paged_kernel_path(kind, model, tmp_path, monkeypatch):
    """On a GPU, merge-mode decode steps over hot and warm blocks run the native paged decode
    kernel (native/paged_decode.cu). Here the same path runs through the kernel's torch reference
    (same signature): logits within float tolerance, tokens equal, the path counted."""
    from tiered_kv.bank import plan
    monkeypatch.setattr(plan, "PAGED_ON_CPU", True)
    expected = _logits_per_step(model, DynamicCache(config=model.config), _turn_ids(8, 21), 5)
    bank = tiered_kv.CacheBank(model, tier_config(kind, tmp_path))
    hooks.install(model, bank, mode="merge")
    got = _logits_per_step(model, bank, _turn_ids(8, 21), 5)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert _reads(bank)["paged"] == 5  # every decode step
    bank.close()


@pytest.mark.parametrize("mode", MODES)
def test_a_failure_inside_hooked_attention_rolls_the_step_back(mode, model, tmp_path, monkeypatch):
    """Invariant 3 with hooks: the step commits only after the last layer's attention. An error
    raised inside the attention of the last layer leaves the bank exactly as before; the retry
    equals DynamicCache."""
    from tiered_kv.hooks import attention
    bank = tiered_kv.CacheBank(model, tier_config("forces_warm", tmp_path))
    hooks.install(model, bank, mode=mode)
    ids = _turn_ids(21, 17)
    out = model.generate(ids, cache=bank, max_new_tokens=3, do_sample=False)
    before = (bank.get_seq_length(), bank.block_table(0), bank.stats()["tiers"])
    last_layer = model.config.num_hidden_layers - 1
    real = attention.sdpa_attention_forward

    def failing(module, *args, **kwargs):
        if module.layer_idx == last_layer:
            raise RuntimeError("injected failure in the last layer's attention")
        return real(module, *args, **kwargs)

    monkeypatch.setattr(attention, "sdpa_attention_forward", failing)
    follow = torch.cat([out, _turn_ids(22, 4)], 1)
    with pytest.raises(RuntimeError, match="injected failure"):
        model.generate(follow, cache=bank, max_new_tokens=2, do_sample=False)
    assert (bank.get_seq_length(), bank.block_table(0), bank.stats()["tiers"]) == before
    monkeypatch.undo()
    assert hooks.installed_mode(model) == mode
    got = model.generate(follow, cache=bank, max_new_tokens=4, do_sample=False)
    hooks.uninstall(model)
    assert torch.equal(got, model.generate(follow, max_new_tokens=4, do_sample=False))
    bank.close()
