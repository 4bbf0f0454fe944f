"""A durable cold tier: a conversation picked up by a new store (and a new process) on the same
cold.path, from the blocks the last one left there, never from another model's."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch
from transformers import DynamicCache

import tiered_kv
from helpers import greedy, rand_ids, tier_config, tiny_model

TESTS_DIR = Path(__file__).resolve().parent


def _first_chat(model, cold_dir, ids, new_tokens=6):
    bank = tiered_kv.CacheBank(model, tier_config("forces_cold", cold_dir))
    bank.attach(ids)
    out = greedy(model, ids, bank, new_tokens)
    bank.close()  # closes the store it owns: published blocks are made durable in cold
    return out


def test_a_new_store_reattaches_a_conversation_from_cold(tmp_path):
    model = tiny_model("llama")
    out = _first_chat(model, tmp_path, rand_ids(1, 30))
    follow = torch.cat([out, rand_ids(2, 4)], 1)
    bank = tiered_kv.CacheBank(model, tier_config("forces_cold", tmp_path))
    reused = bank.attach(follow)
    assert reused == (out.shape[1] - 1) // 4 * 4  # every full block of the verified history
    assert torch.equal(greedy(model, follow, bank, 5), greedy(model, follow, DynamicCache(config=model.config), 5))
    bank.close()


def test_another_model_of_the_same_shape_reuses_nothing_from_cold(tmp_path):
    out = _first_chat(tiny_model("llama"), tmp_path, rand_ids(3, 30))
    torch.manual_seed(99)
    other = tiny_model("llama")
    with torch.no_grad():
        for parameter in other.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.01)
    bank = tiered_kv.CacheBank(other, tier_config("forces_cold", tmp_path))
    follow = torch.cat([out, rand_ids(4, 4)], 1)
    assert bank.attach(follow) == 0
    assert torch.equal(greedy(other, follow, bank, 5), greedy(other, follow, DynamicCache(config=other.config), 5))
    bank.close()


def test_a_new_process_reattaches_from_cold(tmp_path):
    """Process 1 chats and exits; process 2 (a real new interpreter) attaches and continues."""
    script = textwrap.dedent(f"""
        import sys, json, torch
        sys.path.insert(0, {str(TESTS_DIR)!r})
        import tiered_kv
        from helpers import greedy, rand_ids, tier_config, tiny_model
        model = tiny_model("llama")
        cfg = tier_config("forces_cold", {str(tmp_path / "cold")!r})
        ids = rand_ids(5, 30)
        if sys.argv[1] == "first":
            bank = tiered_kv.CacheBank(model, cfg)
            out = greedy(model, ids, bank, 6)
            bank.close()
            torch.save(out, {str(tmp_path / "out.pt")!r})
        else:
            out = torch.load({str(tmp_path / "out.pt")!r})
            follow = torch.cat([out, rand_ids(6, 4)], 1)
            bank = tiered_kv.CacheBank(model, cfg)
            reused = bank.attach(follow)
            tokens = greedy(model, follow, bank, 5)
            print(json.dumps({{"reused": reused, "tokens": tokens.tolist(), "history": out.shape[1]}}))
    """)
    run = [sys.executable, "-c", script]
    subprocess.run(run + ["first"], check=True, timeout=120)
    second = subprocess.run(run + ["second"], check=True, timeout=120, capture_output=True, text=True)

    result = json.loads(second.stdout.strip().splitlines()[-1])
    assert result["reused"] == (result["history"] - 1) // 4 * 4
    model = tiny_model("llama")
    out = torch.load(tmp_path / "out.pt")
    follow = torch.cat([out, rand_ids(6, 4)], 1)
    assert result["tokens"] == greedy(model, follow, DynamicCache(config=model.config), 5).tolist()


def test_two_processes_on_one_cold_path_at_once(tmp_path):
    """A second process on the same config while the first runs: both have a cold tier, each its
    own block file in the directory (issue 19: many processes, one cold directory), and the second
    chats correctly."""
    cold_dir = tmp_path / "cold"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(TESTS_DIR)!r})
        import tiered_kv
        from helpers import tier_config, tiny_model
        bank = tiered_kv.CacheBank(tiny_model("llama"), tier_config("forces_cold", {str(cold_dir)!r}))
        print(bank.stats()["tiers"]["cold"]["capacity_blocks"], flush=True)
        sys.stdin.readline()
        bank.close()
    """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert int(holder.stdout.readline()) == 256  # the first process has its cold tier
        model = tiny_model("llama")
        config = tier_config("forces_cold", cold_dir)
        config["warm"]["capacity_blocks"] = 64
        bank = tiered_kv.CacheBank(model, config)
        assert bank.stats()["tiers"]["cold"]["capacity_blocks"] == 256
        assert len(list(cold_dir.glob("*.blocks"))) == 2
        ids = rand_ids(7, 30)
        assert torch.equal(greedy(model, ids, bank, 5), greedy(model, ids, DynamicCache(config=model.config), 5))
        bank.close()
    finally:
        holder.communicate("done\n", timeout=60)
    assert holder.returncode == 0


def test_a_shared_system_prompt_is_reused_by_new_chats_after_a_restart(tmp_path):
    model = tiny_model("llama")
    system = rand_ids(8, 24)  # 6 full blocks
    _first_chat(model, tmp_path, torch.cat([system, rand_ids(9, 5)], 1))
    store = tiered_kv.TierStore(tier_config("forces_cold", tmp_path))
    for chat in range(3):  # new chats, the same system prompt, other user messages
        ids = torch.cat([system, rand_ids(20 + chat, 6)], 1)
        bank = tiered_kv.CacheBank(model, store=store)
        assert bank.attach(ids) == 24
        assert torch.equal(greedy(model, ids, bank, 4), greedy(model, ids, DynamicCache(config=model.config), 4))
        bank.close()
    store.close()


def test_a_process_that_never_closes_its_store_still_leaves_its_chat_durable(tmp_path):
    """Most programs never call close(): at interpreter exit the store moves its published blocks
    (here all in hot) to cold and waits until they are durable."""
    cold_dir = tmp_path / "cold"
    script = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(TESTS_DIR)!r})
        import tiered_kv
        from helpers import greedy, rand_ids, tier_config, tiny_model
        model = tiny_model("llama")
        config = tier_config("all_hot", {str(cold_dir)!r})
        config["cold"]["capacity_blocks"] = 64
        bank = tiered_kv.CacheBank(model, config)
        out = greedy(model, rand_ids(10, 30), bank, 6)
        assert bank.stats()["bank_blocks"]["cold"] == 0
        torch.save(out, {str(tmp_path / "out.pt")!r})
    """)  # no close(): the process just ends
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    model = tiny_model("llama")
    out = torch.load(tmp_path / "out.pt")
    follow = torch.cat([out, rand_ids(11, 4)], 1)
    config = tier_config("all_hot", cold_dir)
    config["cold"]["capacity_blocks"] = 64
    bank = tiered_kv.CacheBank(model, config)
    assert bank.attach(follow) == (out.shape[1] - 1) // 4 * 4
    assert torch.equal(greedy(model, follow, bank, 5), greedy(model, follow, DynamicCache(config=model.config), 5))
    bank.close()


def test_a_store_collected_at_interpreter_shutdown_never_hangs_the_exit(tmp_path):
    """Without the exit hook (unregistered here) the store is only collected during finalization,
    when the cold tier's writer thread no longer runs: closing must not wait for it forever."""
    script = textwrap.dedent(f"""
        import atexit, sys
        sys.path.insert(0, {str(TESTS_DIR)!r})
        import tiered_kv
        import tiered_kv.store.closing as closing
        from helpers import greedy, rand_ids, tier_config, tiny_model
        atexit.unregister(closing._close_open_stores)
        model = tiny_model("llama")
        bank = tiered_kv.CacheBank(model, tier_config("forces_cold", {str(tmp_path / "cold")!r}))
        greedy(model, rand_ids(12, 30), bank, 6)
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)


def test_blocks_attach_brings_up_stay_up_until_the_turn_reads_them(tmp_path):
    """Hot holds the whole history but above its high watermark: the background mover must not
    take the blocks attach just promoted down again before the turn's first step reads them."""
    model = tiny_model("llama")
    out = _first_chat(model, tmp_path, rand_ids(11, 40))
    config = tier_config("forces_cold", tmp_path)
    config["hot"].update(capacity_blocks=12, high_watermark=0.5, low_watermark=0.4)
    bank = tiered_kv.CacheBank(model, config)
    follow = torch.cat([out, rand_ids(12, 3)], 1)
    reused = bank.attach(follow)
    table = bank.block_table()
    assert reused and bank.store.wait_for_background()
    time.sleep(0.2)  # ten mover intervals
    assert all(bank.store.index.get(b).tier == 0 for b in table)  # all still hot
    promoted = bank.stats()["bytes_moved"]["cold->hot"]
    assert torch.equal(greedy(model, follow, bank, 3), greedy(model, follow, DynamicCache(config=model.config), 3))
    assert bank.stats()["bytes_moved"]["cold->hot"] == promoted  # the turn read them where attach put them
    bank.close()
