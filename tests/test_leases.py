"""Step leases and the store's lock (issue 16): the bank never takes the lock; a step's layer reads
and writes run without it; close() from any thread joins every thread the store owns; attention
without its layer handle raises; the structure keeps the lock and the slabs where they belong."""

from __future__ import annotations

import ast
import pathlib
import threading
import time

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import tiered_kv
from faults import EngineGate, thread_engine
from helpers import VOCAB, greedy, rand_ids, reference, tier_config, tiny_model
from tiered_kv import hooks
from tiered_kv.hooks import attention

PACKAGE = pathlib.Path(tiered_kv.__file__).parent


def _model(num_layers: int):
    torch.manual_seed(7)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=512))
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@pytest.mark.parametrize("hooked", (False, True))
def test_a_decode_step_takes_the_store_lock_a_few_times_whatever_the_number_of_layers(hooked, tmp_path):
    """Layer reads and writes go through the step's lease without the lock: acquisitions per decode
    step are the same for a 2-layer and an 8-layer model (they used to grow by two per layer)."""
    per_step = {}
    for num_layers in (2, 8):
        model = _model(num_layers)
        bank = tiered_kv.CacheBank(model, {**tier_config("forces_warm", tmp_path / str(num_layers)),
                                           "scheduler": {"background": False}})
        if hooked:
            hooks.install(model, bank)
        greedy(model, rand_ids(3, 21), bank, 2)  # 22 tokens: the next 2 steps stay in the 6th block
        lock = bank.store.lock
        before = lock.acquisitions
        with torch.no_grad():
            for _ in range(2):
                model(torch.tensor([[5]]), cache=bank, use_cache=True)
        per_step[num_layers] = (lock.acquisitions - before) / 2
        if hooked:
            hooks.uninstall(model)
        bank.close()
    assert per_step[2] == per_step[8], per_step
    assert per_step[8] <= 4, per_step


def test_a_step_reads_cold_blocks_without_the_store_lock(tmp_path, monkeypatch):
    model = tiny_model("llama")
    bank = tiered_kv.CacheBank(model, tier_config("forces_cold", tmp_path))
    hooks.install(model, bank)
    store = bank.store
    seen = []
    cold = store.tiers[2]
    real, real_into = cold.read_tokens, cold.read_tokens_into

    def spy(layer, index):
        seen.append(store.lock.held_by_me)
        return real(layer, index)

    def spy_into(layer, index, out):  # (a range of consecutive positions is read straight into the step's buffer)
        seen.append(store.lock.held_by_me)
        return real_into(layer, index, out)

    monkeypatch.setattr(cold, "read_tokens", spy)
    monkeypatch.setattr(cold, "read_tokens_into", spy_into)
    ids = rand_ids(8, 30)
    out = greedy(model, ids, bank, 3)
    follow = torch.cat([out, rand_ids(9, 2)], 1)
    bank.attach(follow)
    got = greedy(model, follow, bank, 3)
    hooks.uninstall(model)
    assert torch.equal(got, reference(model, follow, 3))
    assert seen and not any(seen)
    bank.close()


def test_the_bank_hooks_tools_and_remote_never_take_the_store_lock():
    """The lock stays inside the store (DESIGN.md, invariant 8): no code outside tiered_kv/store
    names a store's `.lock`."""
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative.startswith("store/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "lock" and "store" in ast.unparse(node.value):
                offenders.append(f"{relative}:{node.lineno}: {ast.unparse(node)}")
    assert offenders == []


def test_nothing_outside_the_tiers_touches_a_slab_and_only_the_transfers_copy_blocks():
    """One read path (the tiers' read/write methods, through a lease or the mapper); whole blocks
    move only through store/copies.py, run by store/transfers.py."""
    slab_users, block_copiers = [], []
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative.startswith("tiers/"):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "slab":
                slab_users.append(f"{relative}:{node.lineno}")
            if isinstance(node, ast.Attribute) and node.attr in ("read_blocks", "write_blocks", "slots_view") \
                    and relative not in ("store/copies.py",):
                block_copiers.append(f"{relative}:{node.lineno}: {node.attr}")
    assert slab_users == []
    assert block_copiers == []


def test_store_modules_stay_small_and_the_tier_ids_live_in_blocks():
    sizes = {p.name: len(p.read_text().splitlines()) for p in (PACKAGE / "store").glob("*.py")}
    assert sizes["tier_store.py"] <= 350, sizes  # the façade: the wiring and one-line delegations
    assert all(n <= 320 for name, n in sizes.items() if name != "tier_store.py"), sizes
    from tiered_kv import blocks, block_index, scheduler

    assert scheduler.DROPPED is blocks.DROPPED and not hasattr(block_index, "NO_TIER")
    assert (blocks.HOT, blocks.WARM, blocks.COLD, blocks.DROPPED) == (0, 1, 2, -1)


# ---- closing ---------------------------------------------------------------------------------------
def _store_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith(("tiered_kv", "tiered-kv"))}


def test_close_from_another_thread_with_moves_in_flight_joins_every_thread_it_owns(tmp_path):
    before = _store_threads()
    model = tiny_model("llama")
    config = thread_engine(tier_config("forces_cold", tmp_path), 200)
    config["scheduler"] = {"mover_interval_s": 0.001}
    bank = tiered_kv.CacheBank(model, config)
    hooks.install(model, bank)
    store = bank.store
    out = greedy(model, rand_ids(1, 30), bank, 3)
    bank.offload("cold")
    gate = EngineGate(store)  # every copy from now on waits: the prefetch below stays in flight
    bank.prefetch()
    deadline = time.monotonic() + 30
    while not store.mover.busy:
        assert time.monotonic() < deadline, "the prefetch never went into flight"
        time.sleep(0.002)
    closer = threading.Thread(target=store.close, name="closer", daemon=True)
    closer.start()
    time.sleep(0.2)
    assert closer.is_alive()  # it waits for the copy in flight, it does not pull the tiers from under it
    gate.open()
    closer.join(30)
    assert not closer.is_alive() and store.is_closed
    hooks.uninstall(model)
    left = _store_threads() - before
    assert not [t.name for t in left if t.is_alive()], [t.name for t in left]
    assert out.shape[1] == 33


def test_close_under_the_store_lock_is_refused_and_a_closed_store_refuses_leases(tmp_path):
    store = tiered_kv.TierStore(tier_config("forces_warm", tmp_path))
    with store.lock:
        with pytest.raises(RuntimeError, match="under the store's own lock"):
            store.close()
    with pytest.raises(RuntimeError, match="taken again by the thread that holds it"):
        with store.lock:
            with store.lock:
                pass
    store.close()
    with pytest.raises(tiered_kv.BankClosedError):
        store.open_step(tiered_kv.store.StepRequest(1, [[]], set(), 0, 4))


def test_a_failed_bind_stops_the_link_sampler_and_removes_what_it_made(tmp_path):
    store = tiered_kv.TierStore({"hot": {"device": "cpu", "capacity": "1TiB"}, "cold": {"path": str(tmp_path / "c")}})
    with pytest.raises(tiered_kv.ConfigError, match="hot.capacity"):
        tiered_kv.CacheBank(tiny_model("llama"), store=store)
    assert store.is_closed and store.link_monitor.closed
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").iterdir())


def test_a_step_that_outlives_its_store_fails_cleanly_instead_of_reading_a_closed_file(tmp_path):
    from tiered_kv.tiers.shared_io import TierClosedError

    model = tiny_model("llama")
    bank = tiered_kv.CacheBank(model, tier_config("forces_cold", tmp_path))
    store = bank.store
    greedy(model, rand_ids(2, 30), bank, 2)
    cold = store.tiers[2]
    store.close()
    with pytest.raises(TierClosedError):
        cold.read_blocks([0])


# ---- attention without its plan ------------------------------------------------------------------------
def test_paged_attention_that_gets_another_kwargs_dict_than_the_cache_raises(tmp_path, monkeypatch):
    """A paged step's update() hands back only the new token and leaves the step's plan in the
    kwargs it gave cache.update(); a model handing attention a copy of them (the plan lost) would
    attend over the new token alone: the hooks raise instead of computing wrong attention. Exact
    steps hand attention the whole K/V and need nothing in the kwargs."""
    from tiered_kv.bank import plan as step_plan
    monkeypatch.setattr(step_plan, "PAGED_ON_CPU", True)  # the paged path through the kernels' torch reference
    model = tiny_model("llama")
    bank = tiered_kv.CacheBank(model, tier_config("forces_warm", tmp_path))
    hooks.install(model, bank, mode="merge")
    function = attention.merge_attention

    def without_plan(module, query, key, value, attention_mask, **kwargs):
        kwargs.pop(hooks.PAGED_KEY, None)  # what a model passing another dict looks like
        return function(module, query, key, value, attention_mask, **kwargs)

    from transformers import AttentionInterface
    AttentionInterface.register(hooks.MODES["merge"][0], without_plan)
    ids = rand_ids(3, 12)
    try:
        with pytest.raises(attention.MissingPlan, match="did not get its step's plan"):
            greedy(model, ids, bank, 2)  # (the prefill is no paged step: the first decode step raises)
    finally:
        AttentionInterface.register(hooks.MODES["merge"][0], function)
    assert bank.get_seq_length() == 12 and bank.store.check_consistency() == []  # the prefill stays, the step went
    assert torch.equal(greedy(model, ids, bank, 2), reference(model, ids, 2))  # the retry, plan passed
    hooks.uninstall(model)
    bank.close()


