"""Adapters (peft) and block identity: a block's key names the weights as they act now
(DESIGN.md invariant 1), so one model under two LoRA adapters, or an adapter and none, never
share a block, while the same adapter in two banks does; a PeftModel passed to CacheBank is
watched where its forward runs (the inner transformers model); the fingerprint is digested once
per model and re-checked cheaply at every step; adapters tiered_kv cannot identify keep a bank's
blocks private."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import DynamicCache

import tiered_kv
from helpers import rand_ids, tier_config, tiny_model
from tiered_kv import identity, weights
from tiered_kv.logs import forget_logged_once

peft = pytest.importorskip("peft")
from peft import LoraConfig, get_peft_model  # noqa: E402
from peft.tuners.tuners_utils import BaseTunerLayer  # noqa: E402

BS = 4  # tier_config's block size
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def lora_model(seed_a: int = 11, seed_b: int = 22):
    """tiny Llama with two LoRA adapters "a" and "b" of different random weights (not identity:
    init_lora_weights=False), injected in place by peft. Returns (PeftModel, its inner model)."""
    base = tiny_model("llama")
    config = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False)
    torch.manual_seed(seed_a)
    wrapped = get_peft_model(base, config, adapter_name="a")
    torch.manual_seed(seed_b)
    wrapped.add_adapter("b", config)
    wrapped.set_adapter("a")
    wrapped.eval()
    return wrapped, wrapped.get_base_model()


def greedy(model, ids, cache, n: int = 6):
    return model.generate(input_ids=ids, cache=cache, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                          do_sample=False)


def reference(model, ids, n: int = 6):
    """The same generate() through a fresh DynamicCache, under the adapters active now."""
    return greedy(model, ids, DynamicCache(config=model.get_base_model().config if hasattr(model, "get_base_model")
                                           else model.config), n)


def full_blocks(num_tokens: int) -> int:
    """Tokens in the full blocks a chat of `num_tokens` (the last one never computed) published."""
    return (num_tokens - 1) // BS * BS


def published_count(store) -> int:
    return sum(1 for _, entry in store.index.items() if entry.key is not None)


@pytest.fixture
def store(tmp_path):
    store = tiered_kv.TierStore(tier_config("all_hot", tmp_path))
    yield store
    store.close()


def _chat(model, store, ids, n: int = 6):
    bank = tiered_kv.CacheBank(model, store=store)
    bank.attach(ids)
    out = greedy(model, ids, bank, n)
    bank.close()  # its blocks stay in the store as cache
    return out


# (1) the outside finding -----------------------------------------------------------------------
def test_a_chat_under_adapter_b_reuses_nothing_a_chat_under_a_stored(store):
    wrapped, model = lora_model()
    ids = rand_ids(1, 47)
    out = _chat(model, store, ids)  # under "a"
    wrapped.set_adapter("b")
    follow = torch.cat([out, rand_ids(2, 4)], 1)
    bank = tiered_kv.CacheBank(model, store=store)
    assert bank.attach(follow) == 0
    assert torch.equal(greedy(model, follow, bank), reference(model, follow))
    bank.close()


# (2) the same adapter shares; an adapter and none never do ------------------------------------
def test_the_same_adapter_in_two_banks_shares_the_prefix(store):
    wrapped, model = lora_model()
    wrapped.set_adapter("b")
    out = _chat(model, store, rand_ids(3, 30))
    follow = torch.cat([out, rand_ids(4, 4)], 1)
    bank = tiered_kv.CacheBank(model, store=store)
    assert bank.attach(follow) == full_blocks(out.shape[1])
    assert torch.equal(greedy(model, follow, bank), reference(model, follow))
    bank.close()
    # the same adapter weights in another model object (built the same way) share too
    other_wrapped, other = lora_model()
    other_wrapped.set_adapter("b")
    bank = tiered_kv.CacheBank(other, store=store)
    assert bank.attach(follow) == full_blocks(follow.shape[1])  # the second chat's blocks too
    assert torch.equal(greedy(other, follow, bank), reference(other, follow))
    bank.close()


def test_an_adapter_and_no_adapter_never_share_a_block(store):
    wrapped, model = lora_model()
    out_a = _chat(model, store, rand_ids(5, 30))  # under "a"
    follow = torch.cat([out_a, rand_ids(6, 4)], 1)
    plain = tiny_model("llama")  # the same base weights, no adapter
    bank = tiered_kv.CacheBank(plain, store=store)
    assert bank.attach(follow) == 0  # a's blocks: other weights
    bank.close()
    with wrapped.disable_adapter():  # the base weights alone act
        bank = tiered_kv.CacheBank(model, store=store)
        assert bank.attach(follow) == 0
        out_none = greedy(model, follow, bank)
        assert torch.equal(out_none, reference(model, follow))
        bank.close()
    # the plain model reuses the disabled-adapter chat's blocks (the same weights act, the same ops run)
    bank = tiered_kv.CacheBank(plain, store=store)
    follow_none = torch.cat([out_none, rand_ids(7, 3)], 1)
    assert bank.attach(follow_none) == full_blocks(out_none.shape[1])
    assert torch.equal(greedy(plain, follow_none, bank), reference(plain, follow_none))
    bank.close()
    # and the adapter, enabled again, finds its own blocks, not the plain ones
    bank = tiered_kv.CacheBank(model, store=store)
    assert bank.attach(follow) == full_blocks(out_a.shape[1])
    assert torch.equal(greedy(model, follow, bank), reference(model, follow))
    bank.close()


# (3) a PeftModel passed to CacheBank ----------------------------------------------------------
def test_a_peft_model_passed_to_the_bank_is_watched_reuses_and_verifies(store):
    wrapped, model = lora_model()
    ids = rand_ids(8, 30)
    bank = tiered_kv.CacheBank(wrapped, store=store)
    bank.attach(ids)
    out = greedy(wrapped, ids, bank)
    assert torch.equal(out, reference(wrapped, ids))
    assert published_count(store) == full_blocks(out.shape[1]) // BS  # its ids were seen computed
    bank.close()
    follow = torch.cat([out, rand_ids(9, 4)], 1)
    second = tiered_kv.CacheBank(wrapped, store=store)
    assert second.attach(follow) == full_blocks(out.shape[1])
    assert torch.equal(greedy(wrapped, follow, second), reference(wrapped, follow))
    second.close()
    # a bank built from the inner model names the same weights: it shares the same blocks
    inner = tiered_kv.CacheBank(model, store=store)
    assert inner.attach(follow) == full_blocks(follow.shape[1])  # the second chat's blocks too
    inner.close()


def test_hooks_install_accepts_a_peft_model(store):
    wrapped, model = lora_model()
    ids = rand_ids(10, 22)
    bank = tiered_kv.CacheBank(wrapped, store=store)
    tiered_kv.hooks.install(wrapped, bank)
    try:
        assert bank.hooks_mode == "exact"
        bank.attach(ids)
        out = greedy(wrapped, ids, bank)
        assert sum(bank.stats()["hooks"]["steps_by_read"].values()) > 0
    finally:
        tiered_kv.hooks.uninstall(wrapped)
    assert bank.hooks_mode is None
    assert torch.equal(out, reference(wrapped, ids))
    bank.close()


# (4) set_adapter between turns of one bank ----------------------------------------------------
def test_set_adapter_between_turns_gives_later_blocks_the_new_root(store):
    wrapped, model = lora_model()
    bank = tiered_kv.CacheBank(model, store=store)
    ids = rand_ids(11, 30)
    bank.attach(ids)
    out = greedy(model, ids, bank)  # turn 1 under "a"
    wrapped.set_adapter("b")
    follow = torch.cat([out, rand_ids(12, 5)], 1)
    assert bank.attach(follow) == 0  # its own KV was computed under "a"
    out2 = greedy(model, follow, bank)
    assert torch.equal(out2, reference(model, follow))
    bank.close()
    follow2 = torch.cat([out2, rand_ids(13, 3)], 1)
    under_b = tiered_kv.CacheBank(model, store=store)  # turn 2's blocks were published under "b"
    assert under_b.attach(follow2) == full_blocks(out2.shape[1])
    assert torch.equal(greedy(model, follow2, under_b, 4), reference(model, follow2, 4))
    under_b.close()
    wrapped.set_adapter("a")  # turn 1's blocks kept their keys: a chat under "a" reuses them, no more
    under_a = tiered_kv.CacheBank(model, store=store)
    assert under_a.attach(follow2) == full_blocks(out.shape[1])
    assert torch.equal(greedy(model, follow2, under_a, 4), reference(model, follow2, 4))
    under_a.close()


def test_a_turn_under_a_new_adapter_without_attach_continues_and_publishes_nothing_mixed(store):
    wrapped, model = lora_model()
    bank = tiered_kv.CacheBank(model, store=store)
    dynamic = DynamicCache(config=model.config)  # kept across turns, as the bank is
    ids = rand_ids(14, 30)
    out = greedy(model, ids, bank)
    assert torch.equal(out, greedy(model, ids, dynamic))
    wrapped.set_adapter("b")
    follow = torch.cat([out, rand_ids(15, 5)], 1)
    out2 = greedy(model, follow, bank)  # computes only the new tokens, under "b", over a's history
    assert torch.equal(out2, greedy(model, follow, dynamic))
    bank.close()
    follow2 = torch.cat([out2, rand_ids(16, 3)], 1)
    under_b = tiered_kv.CacheBank(model, store=store)
    assert under_b.attach(follow2) == 0  # nothing was computed under "b" alone
    under_b.close()
    wrapped.set_adapter("a")
    under_a = tiered_kv.CacheBank(model, store=store)
    assert under_a.attach(follow2) == full_blocks(out.shape[1])  # only what "a" computed alone
    assert torch.equal(greedy(model, follow2, under_a, 4), reference(model, follow2, 4))
    under_a.close()


# (5) merged weights ---------------------------------------------------------------------------
def test_merge_adapter_and_unmerge_change_the_root(store):
    wrapped, model = lora_model()
    out = _chat(model, store, rand_ids(17, 30))  # under "a", unmerged
    follow = torch.cat([out, rand_ids(18, 4)], 1)
    bank = tiered_kv.CacheBank(model, store=store)  # built before the merge, attached after it
    wrapped.merge_adapter()  # base weights += a's delta, in place (no new tensors, no version bump)
    assert bank.attach(follow) == 0
    merged_out = greedy(model, follow, bank)
    assert torch.equal(merged_out, reference(model, follow))
    bank.close()
    wrapped.unmerge_adapter()  # the base weights come back, rounded: not the bytes "a" computed over
    bank = tiered_kv.CacheBank(model, store=store)
    assert bank.attach(follow) == 0
    assert torch.equal(greedy(model, follow, bank), reference(model, follow))
    bank.close()


def test_merge_and_unload_changes_the_root(store):
    wrapped, model = lora_model()
    out_a = _chat(model, store, rand_ids(23, 30))  # under "a", unmerged
    with wrapped.disable_adapter():
        out_none = _chat(model, store, rand_ids(24, 30))  # the base weights
    plain = wrapped.merge_and_unload()  # a plain model again, with a's delta in its weights
    for out in (out_a, out_none):
        follow = torch.cat([out, rand_ids(25, 4)], 1)
        bank = tiered_kv.CacheBank(plain, store=store)
        assert bank.attach(follow) == 0
        assert torch.equal(greedy(plain, follow, bank), reference(plain, follow))
        bank.close()


# (6) the fingerprint is digested once per model, checked cheaply ------------------------------
@pytest.fixture
def digest_calls(monkeypatch):
    calls = []
    real = weights.weights_digest  # (the tracker's digest: weights.py; identity.weights_digest re-exports it)

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(weights, "weights_digest", counting)
    return calls


def test_fifty_banks_on_one_model_digest_its_weights_once(store, digest_calls):
    model = tiny_model("llama")
    banks = [tiered_kv.CacheBank(model, store=store) for _ in range(50)]
    assert len(digest_calls) == 1
    assert len({bank.fingerprint.root_key("float32") for bank in banks}) == 1
    for bank in banks:
        bank.close()
    with torch.no_grad():  # an in-place change of the weights: the next bank digests them again
        model.load_state_dict({name: t + 0.01 for name, t in model.state_dict().items()})
    changed = tiered_kv.CacheBank(model, store=store)
    assert len(digest_calls) == 2
    assert changed.fingerprint.root_key("float32") != banks[0].fingerprint.root_key("float32")
    changed.close()


def test_switching_adapters_digests_the_base_weights_once_and_steps_never(store, digest_calls, monkeypatch):
    wrapped, model = lora_model()
    roots = {}
    for name in ("a", "b", "a", "b"):
        wrapped.set_adapter(name)
        banks = [tiered_kv.CacheBank(model, store=store) for _ in range(10)]
        roots.setdefault(name, set()).update(bank.fingerprint.root_key("float32") for bank in banks)
        for bank in banks:
            bank.close()
    assert len(digest_calls) == 1  # the base weights, once; each adapter's own weights once too
    assert len(roots["a"]) == len(roots["b"]) == 1 and roots["a"] != roots["b"]
    full_checks = []
    real_check = identity.WeightsTracker.check
    monkeypatch.setattr(identity.WeightsTracker, "check",
                        lambda self, full=True: (full and full_checks.append(1), real_check(self, full))[1])
    bank = tiered_kv.CacheBank(model, store=store)
    before = len(full_checks)
    greedy(model, rand_ids(19, 20), bank, 8)  # one prefill, seven decode steps
    assert len(full_checks) - before == 1  # the prefill walks the parameters; a decode step does not
    assert len(digest_calls) == 1
    bank.close()


# (7) adapters that cannot be identified ------------------------------------------------------
class OpaqueTunerLayer(torch.nn.Module, BaseTunerLayer):
    """A tuner layer of a type tiered_kv does not know: it adds a learned bias to the base layer."""

    adapter_layer_names = ("opaque_bias",)

    def __init__(self, base_layer):
        super().__init__()
        self.base_layer = base_layer
        self.opaque_bias = torch.nn.ParameterDict({"x": torch.nn.Parameter(torch.randn(base_layer.out_features))})
        self._active_adapter = ["x"]
        self.merged_adapters = []

    def forward(self, x, *args, **kwargs):
        return self.base_layer(x) + self.opaque_bias["x"]


def _assert_private(model, store, caplog, ids, expected_message):
    forget_logged_once()
    with caplog.at_level(logging.WARNING, logger="tiered_kv"):
        outs = []
        for _ in range(3):
            bank = tiered_kv.CacheBank(model, store=store)
            assert bank.attach(torch.cat([ids, rand_ids(21, 4)], 1)) == 0
            outs.append(greedy(model, ids, bank))
            bank.close()
    assert published_count(store) == 0
    for out in outs:
        assert torch.equal(out, reference(model, ids))
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and expected_message in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]


def test_an_unknown_tuner_type_keeps_blocks_private_and_warns_once(store, caplog):
    model = tiny_model("llama")
    attention = model.model.layers[0].self_attn
    torch.manual_seed(5)
    attention.v_proj = OpaqueTunerLayer(attention.v_proj)
    _assert_private(model, store, caplog, rand_ids(20, 30), "OpaqueTunerLayer")


def test_an_active_adapter_whose_weights_are_not_reachable_keeps_blocks_private(store, caplog):
    wrapped, model = lora_model()
    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            module._active_adapter = ["ghost"]  # active, yet no layer holds its weights
    _assert_private(model, store, caplog, rand_ids(22, 30), "'ghost'")


def test_a_peft_tuner_tiered_kv_does_not_know_keeps_blocks_private(store, caplog):
    from peft import VeraConfig

    model = tiny_model("llama")
    torch.manual_seed(6)
    wrapped = get_peft_model(model, VeraConfig(r=4, target_modules=["q_proj", "k_proj"], init_weights=False))
    wrapped.eval()
    _assert_private(model, store, caplog, rand_ids(26, 30), "peft.tuners.vera")


# ---- what else names the acting weights -----------------------------------------------------------
def test_a_scaling_change_and_a_forgotten_data_write_change_the_root(store):
    wrapped, model = lora_model()
    root = tiered_kv.CacheBank(model, store=store).fingerprint.root_key("float32")
    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            module.scale_layer(0.5)  # scaling *= 0.5, in place
    scaled = tiered_kv.CacheBank(model, store=store).fingerprint.root_key("float32")
    assert scaled != root
    with torch.no_grad():  # through .data: no version counter moves, no flag changes: not seen...
        model.model.layers[0].self_attn.q_proj.base_layer.weight.data.add_(1.0)
    assert tiered_kv.CacheBank(model, store=store).fingerprint.root_key("float32") == scaled
    identity.forget(model)  # ...until the caller says so
    assert tiered_kv.CacheBank(model, store=store).fingerprint.root_key("float32") not in (root, scaled)
