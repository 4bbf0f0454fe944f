"""The shared remote tier (issue 10) against real Redis servers (tests/redis_servers.py).

Every reuse is checked against a fresh computation (transformers' DynamicCache): blocks that
come from the server must give exactly the tokens a recompute gives, and every fault (server
down, killed, garbage at a key, expiry, another model's value) must cost reuse, never tokens.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from helpers import greedy, rand_ids, reference, same_shape_model, tiny_model
from redis_servers import RedisCluster, RedisServer, require_redis_binaries

import tiered_kv
from tiered_kv import CacheBank
from tiered_kv.errors import ConfigError
from tiered_kv.remote import codec

PASSWORD_ENV = "TKV_TEST_REDIS_PASSWORD"
PASSWORD = "pw-for-tests"
BLOCK_SIZE = 4
NEW_TOKENS = 5
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _password(monkeypatch):
    require_redis_binaries()
    monkeypatch.setenv(PASSWORD_ENV, PASSWORD)


def config(tmp_path, url: str, **remote) -> dict:
    return {"block_size": BLOCK_SIZE, "hot": {"device": "cpu", "capacity_blocks": 64},
            "warm": {"capacity_blocks": 64}, "cold": {"capacity_blocks": 0, "path": str(tmp_path / "cold")},
            "remote": {"url": url, "password_env": PASSWORD_ENV, "timeout_ms": 300, **remote}}


def first_chat(model, cfg, ids) -> torch.Tensor:
    """One turn in a bank of its own store, closed after (its writes flushed): another process, as far
    as the server can tell."""
    bank = CacheBank(model, cfg)
    out = greedy(model, ids, bank, NEW_TOKENS)
    bank.close()
    return out


def test_a_second_store_reuses_the_prefix_and_tokens_equal_a_recompute(tmp_path):
    model = tiny_model("llama")
    ids = rand_ids(1, 41)
    with RedisServer(password=PASSWORD) as server:
        out = first_chat(model, config(tmp_path / "a", server.url), ids)
        bank = CacheBank(model, config(tmp_path / "b", server.url))
        reused = bank.attach(out)
        stored = (out.shape[1] - 1) // BLOCK_SIZE * BLOCK_SIZE  # the full blocks of the first chat's KV
        assert reused >= 0.9 * stored and reused == stored
        assert torch.equal(greedy(model, out, bank, NEW_TOKENS), reference(model, out, NEW_TOKENS))
        remote = bank.stats()["remote"]
        assert remote["hits"] == stored // BLOCK_SIZE
        assert remote["bytes_in"] == remote["hits"] * codec.value_bytes(bank.store.layout)
        bank.close()


def test_wrong_password_is_a_clear_error_at_start(tmp_path, monkeypatch):
    with RedisServer(password=PASSWORD) as server:
        monkeypatch.setenv(PASSWORD_ENV, "not-the-password")
        with pytest.raises(ConfigError, match="remote.url.*" + server.url.replace("/", ".")):
            tiered_kv.TierStore(config(tmp_path, server.url))


def test_unreachable_server_warns_and_runs_locally_or_fails_when_required(tmp_path, caplog):
    with RedisServer(password=PASSWORD) as server:
        url = server.url
    model = tiny_model("llama")  # the server is gone: nothing listens on its port
    ids = rand_ids(2, 30)
    with caplog.at_level(logging.WARNING, logger="tiered_kv"):
        bank = CacheBank(model, config(tmp_path / "a", url))
    assert any("cannot reach" in r.getMessage() and url in r.getMessage() for r in caplog.records)
    assert torch.equal(greedy(model, ids, bank, NEW_TOKENS), reference(model, ids, NEW_TOKENS))
    assert bank.stats()["remote"]["hits"] == 0
    bank.close()
    with pytest.raises(ConfigError, match="remote.required"):
        tiered_kv.TierStore(config(tmp_path / "b", url, required=True))


def test_server_killed_mid_chat_then_restarted(tmp_path, caplog):
    model = tiny_model("llama")
    ids = rand_ids(3, 40)
    with RedisServer(password=PASSWORD) as server:
        bank = CacheBank(model, config(tmp_path / "a", server.url))
        out = greedy(model, ids, bank, NEW_TOKENS)
        server.kill()
        with caplog.at_level(logging.WARNING, logger="tiered_kv"):
            ids2 = torch.cat([out, rand_ids(4, 9)], dim=1)
            bank.attach(ids2)
            out2 = greedy(model, ids2, bank, NEW_TOKENS)  # the turn publishes blocks: writes fail, nothing waits
            bank.store.remote.flush()
        assert torch.equal(out2, reference(model, ids2, NEW_TOKENS))
        stats = bank.stats()["remote"]
        assert stats["errors"] and stats["down"] is True or stats["writes_dropped"]
        assert any("remote tier" in r.getMessage() for r in caplog.records)
        server.restart()  # empty: it kept nothing
        time.sleep(0.6)  # past the first backoff (0.5 s)
        ids3 = torch.cat([out2, rand_ids(5, 12)], dim=1)
        bank.attach(ids3)
        out3 = greedy(model, ids3, bank, NEW_TOKENS)
        bank.store.remote.flush()
        assert torch.equal(out3, reference(model, ids3, NEW_TOKENS))
        assert bank.stats()["remote"]["writes"] > 0  # writing again
        bank.close()


def test_garbage_at_a_key_stops_the_chain_and_is_recomputed(tmp_path, caplog):
    import redis

    model = tiny_model("llama")
    ids = rand_ids(6, 40)
    with RedisServer(password=PASSWORD) as server:
        out = first_chat(model, config(tmp_path / "a", server.url), ids)
        client = redis.Redis.from_url(server.url, password=PASSWORD)
        keys = sorted(client.keys(b"tkv:*"))
        assert len(keys) == (out.shape[1] - 1) // BLOCK_SIZE
        # find the remote key of the chain's 4th block: the one whose value names it
        bank = CacheBank(model, config(tmp_path / "b", server.url, write="off"))
        root = bank.fingerprint.root_key("float32")
        chain = tiered_kv.identity.chain_keys(root, out[0].tolist(), BLOCK_SIZE, 0, len(keys))
        victim = codec.remote_key("tkv:", bank.store.layout, root, chain[3])
        value = bytearray(client.get(victim))
        value[-7] ^= 0xFF  # one flipped byte in the last layer's data
        client.set(victim, bytes(value))
        with caplog.at_level(logging.WARNING, logger="tiered_kv"):
            reused = bank.attach(out)
        assert reused == 3 * BLOCK_SIZE  # blocks 0-2 came, block 3 failed its check, the chain stopped
        assert any("checksum" in r.getMessage() for r in caplog.records)
        assert bank.stats()["remote"]["misses"] == {"bad": 1}
        assert torch.equal(greedy(model, out, bank, NEW_TOKENS), reference(model, out, NEW_TOKENS))
        bank.close()


def _layout(model):
    from tiered_kv.blocks import layout_from_model_config

    return layout_from_model_config(model.config, BLOCK_SIZE, "float32")


def test_ttl_expiry_is_a_miss(tmp_path):
    model = tiny_model("llama")
    ids = rand_ids(7, 30)
    with RedisServer(password=PASSWORD) as server:
        out = first_chat(model, config(tmp_path / "a", server.url, ttl=1), ids)
        time.sleep(1.6)
        bank = CacheBank(model, config(tmp_path / "b", server.url))
        assert bank.attach(out) == 0
        assert bank.stats()["remote"]["misses"] == {"missing": 1}
        assert torch.equal(greedy(model, out, bank, NEW_TOKENS), reference(model, out, NEW_TOKENS))
        bank.close()


def test_two_models_of_one_shape_never_share(tmp_path):
    import redis

    model = tiny_model("llama")
    other = same_shape_model(model, seed=99)
    ids = rand_ids(8, 40)
    with RedisServer(password=PASSWORD) as server:
        out = first_chat(model, config(tmp_path / "a", server.url), ids)
        bank = CacheBank(other, config(tmp_path / "b", server.url))
        assert bank.attach(out) == 0  # its keys chain from another fingerprint
        # even a value copied under the other model's key is refused: its header names the first model
        client = redis.Redis.from_url(server.url, password=PASSWORD)
        layout = _layout(model)
        root_a = CacheBank(model, config(tmp_path / "c", server.url, write="off")).fingerprint.root_key("float32")
        root_b = bank.fingerprint.root_key("float32")
        key_a = tiered_kv.identity.chain_keys(root_a, out[0].tolist(), BLOCK_SIZE, 0, 1)[0]
        key_b = tiered_kv.identity.chain_keys(root_b, out[0].tolist(), BLOCK_SIZE, 0, 1)[0]
        client.set(codec.remote_key("tkv:", layout, root_b, key_b), client.get(codec.remote_key("tkv:", layout, root_a, key_a)))
        bank.reset()
        assert bank.attach(out) == 0
        assert bank.stats()["remote"]["misses"].get("bad") == 1
        assert torch.equal(greedy(other, out, bank, NEW_TOKENS), reference(other, out, NEW_TOKENS))
        bank.close()


SCRIPT = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {tests!r})
    import torch
    from helpers import greedy, rand_ids, reference, tiny_model
    from tiered_kv import CacheBank
    cfg = json.loads(sys.argv[1])
    model = tiny_model("llama")
    ids = torch.tensor([json.loads(sys.argv[2])]) if len(sys.argv) > 2 else rand_ids(11, 60)
    bank = CacheBank(model, cfg)
    reused = bank.attach(ids)
    out = greedy(model, ids, bank, 6)
    equal = torch.equal(out, reference(model, ids, 6))
    stats = bank.stats()["remote"]
    bank.close()
    print(json.dumps({{"reused": reused, "equal": equal, "out": out[0].tolist(), "hits": stats["hits"]}}))
""").format(tests=str(REPO / "tests"))


def _run_process(cfg: dict, ids: list[int] | None = None) -> dict:
    import json

    args = [sys.executable, "-c", SCRIPT, json.dumps(cfg)] + ([json.dumps(ids)] if ids is not None else [])
    done = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={**os.environ, PASSWORD_ENV: PASSWORD})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("kind", ["server", "cluster"])
def test_two_processes_share_a_conversation(tmp_path, kind):
    with (RedisServer(password=PASSWORD) if kind == "server" else RedisCluster(password=PASSWORD)) as server:
        extra = {"cluster": True} if kind == "cluster" else {}
        first = _run_process(config(tmp_path / "a", server.url, **extra))
        assert first["equal"] and first["reused"] == 0
        conversation = first["out"] + [7, 9, 11]  # the next user message
        second = _run_process(config(tmp_path / "b", server.url, **extra), conversation)
        stored = (len(first["out"]) - 1) // BLOCK_SIZE * BLOCK_SIZE
        assert second["reused"] >= 0.9 * stored
        assert second["hits"] == second["reused"] // BLOCK_SIZE
        assert second["equal"]


@pytest.mark.parametrize("remote, message", [
    ({"url": "http://127.0.0.1:6379"}, "unknown scheme 'http'"),
    ({"url": "redis://:secret@127.0.0.1:6379"}, "carries a password"),
    ({"url": "redis://127.0.0.1:99999"}, "malformed"),
    ({"url": "redis:///0"}, "no host"),
    ({"url": "redis://h:6379/zero"}, "database 'zero'"),
    ({"url": "unix://"}, "unix:///absolute/path"),
    ({"url": "unix:///tmp/r.sock", "cluster": True}, "remote.cluster"),
    ({"password_env": "TKV_SURELY_UNSET_VARIABLE"}, "not set in the environment"),
    ({"password_env": "not a name"}, "remote.password_env"),
    ({"ttl": -1}, "remote.ttl"),
    ({"write": "back"}, "remote.write"),
    ({"timeout_ms": 0}, "remote.timeout_ms"),
    ({"key_prefix": "has space"}, "remote.key_prefix"),
    ({"required": "yes"}, "remote.required"),
])
def test_bad_remote_config_names_the_key(remote, message):
    with pytest.raises(ConfigError, match=message):
        tiered_kv.load_config({"remote": remote})


def test_example_config_loads_with_its_password_variable(monkeypatch):
    monkeypatch.setenv("TKV_REDIS_PASSWORD", "x")
    cfg = tiered_kv.load_config(REPO / "configs" / "remote.yaml")
    assert cfg.remote.enabled and cfg.remote.password() == "x" and cfg.remote.url.startswith("redis://")
    monkeypatch.delenv("TKV_REDIS_PASSWORD")
    with pytest.raises(ConfigError, match="remote.password_env.*TKV_REDIS_PASSWORD"):
        tiered_kv.load_config(REPO / "configs" / "remote.yaml")


def test_unix_socket_url(tmp_path):
    model = tiny_model("llama")
    ids = rand_ids(12, 30)
    with RedisServer(password=PASSWORD, unix_socket=True) as server:
        assert server.url.startswith("unix://")
        out = first_chat(model, config(tmp_path / "a", server.url), ids)
        bank = CacheBank(model, config(tmp_path / "b", server.url))
        assert bank.attach(out) == (out.shape[1] - 1) // BLOCK_SIZE * BLOCK_SIZE
        bank.close()


def test_decode_never_touches_the_network(tmp_path, monkeypatch):
    """Every remote round trip of a chat runs either in attach() (turn start) or on the writer
    thread; none inside generate()'s forward passes on the calling thread."""
    from tiered_kv.remote.client import RemoteClient

    calls = []
    for name in ("get_many", "set_many"):
        original = getattr(RemoteClient, name)

        def spy(self, *args, _original=original, _name=name, **kwargs):
            calls.append((_name, threading.current_thread() is threading.main_thread(), phase[0]))
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(RemoteClient, name, spy)
    phase = ["setup"]
    model = tiny_model("llama")
    ids = rand_ids(13, 41)
    with RedisServer(password=PASSWORD) as server:
        out = first_chat(model, config(tmp_path / "a", server.url), ids)
        bank = CacheBank(model, config(tmp_path / "b", server.url))
        phase[0] = "attach"
        bank.attach(out)
        phase[0] = "generate"
        greedy(model, out, bank, 8)
        phase[0] = "after"
        bank.store.remote.flush()
        bank.close()
    assert ("get_many", True, "attach") in calls  # the lookup ran at the turn's start
    assert not [c for c in calls if c[2] == "generate" and c[1]]  # nothing on the caller during decode
    assert any(name == "set_many" and not on_main for name, on_main, _ in calls)  # writes went behind


# ---- issue 16: the remote paths go through the transfer engine ---------------------------------------
def _thread_engine(cfg: dict) -> dict:
    return {**cfg, "copies": {"engine": "thread", "delay_us": 300}}


@pytest.mark.parametrize("way", ("before", "in_unit"))
def test_remote_fetch_and_write_copies_that_fail_cost_reuse_never_tokens(way, tmp_path):
    """Copies between the tiers and host memory for the remote tier (the writer's reads of blocks,
    a fetch's writes into new blocks) fail: nothing wrong reaches the server or a chat; with the
    thread engine holding every copy back, what the server gets is the block's landed bytes."""
    from faults import Faults, remote

    model = tiny_model("llama")
    ids = rand_ids(11, 41)
    with RedisServer(password=PASSWORD) as server:
        first = CacheBank(model, _thread_engine(config(tmp_path / "a", server.url)))
        with Faults(first.store, remote, way, every=2, skip=3) as writer_faults:  # after 3, every other read-out fails
            out = greedy(model, ids, first, NEW_TOKENS)
            first.store.remote.flush()
        assert writer_faults.failed > 0
        assert first.store.check_consistency() == []
        first.close()
        second = CacheBank(model, _thread_engine(config(tmp_path / "b", server.url)))
        with Faults(second.store, remote, way, limit=1) as fetch_faults:  # the fetch's write-in fails once
            reused_during_fault = second.attach(out)
        assert fetch_faults.failed == 1 and reused_during_fault == 0
        assert second.store.check_consistency() == []
        assert torch.equal(greedy(model, out, second, NEW_TOKENS), reference(model, out, NEW_TOKENS))
        third = CacheBank(model, _thread_engine(config(tmp_path / "c", server.url)))
        reused = third.attach(out)  # whatever the first store wrote is the blocks' true bytes
        assert reused > 0
        assert torch.equal(greedy(model, out, third, NEW_TOKENS), reference(model, out, NEW_TOKENS))
        second.close()
        third.close()


def test_writes_queued_when_the_store_closes_still_reach_the_server(tmp_path):
    """close() flushes the remote writer before it stops the transfers: a block published just
    before close is on the server after it (its read-out is not refused as 'closing')."""
    model = tiny_model("llama")
    ids = rand_ids(12, 41)
    with RedisServer(password=PASSWORD) as server:
        bank = CacheBank(model, _thread_engine(config(tmp_path / "a", server.url)))
        out = greedy(model, ids, bank, NEW_TOKENS)
        queued = bank.store.remote.stats()["queued"]
        bank.close()  # no flush before: whatever is queued goes out in close()
        stats_dropped = bank.store.metrics.remote_writes_dropped.snapshot()
        assert not stats_dropped.get("gone"), (queued, stats_dropped)
        other = CacheBank(model, config(tmp_path / "b", server.url))
        assert other.attach(out) == (out.shape[1] - 1) // BLOCK_SIZE * BLOCK_SIZE
        other.close()


def test_a_hybrid_model_picks_its_conversation_up_from_the_server(tmp_path):
    """Gemma-3-shaped (5 sliding : 1 full): a second store, empty, resumes the first chat from
    the server: every full group's chain and each sliding group's last window, tokens equal."""
    model = tiny_model("gemma3")
    ids = rand_ids(21, 37)
    with RedisServer(password=PASSWORD) as server:
        out = first_chat(model, config(tmp_path / "a", server.url), ids)
        bank = CacheBank(model, config(tmp_path / "b", server.url))
        reused = bank.attach(out)
        assert reused == (out.shape[1] - 1) // BLOCK_SIZE * BLOCK_SIZE
        assert torch.equal(greedy(model, out, bank, NEW_TOKENS), reference(model, out, NEW_TOKENS))
        assert bank.stats()["remote"]["hits"] > 0
        bank.close()


def test_compressed_remote_values_are_smaller_reused_checked_and_never_read_as_another_mode(tmp_path, caplog):
    """remote.compression int8 (issue 21): the values carry packed bytes (~1/4 of fp32 here) under keys
    that name the compression, so a store of another mode never reads them; a second int8 store reuses
    the conversation; a flipped byte of the packed bytes fails the checksum and is recomputed."""
    import redis

    model = tiny_model("llama")
    ids = rand_ids(21, 41)

    def compressed(path, **remote):
        cfg = config(path, server.url, compression="int8", **remote)
        cfg["warm"]["compression"] = "int8"
        return cfg

    with RedisServer(password=PASSWORD) as server:
        out = first_chat(model, compressed(tmp_path / "a"), ids)
        client = redis.Redis.from_url(server.url, password=PASSWORD)
        keys = sorted(client.keys(b"tkv:*"))
        stored_blocks = (out.shape[1] - 1) // BLOCK_SIZE
        assert len(keys) == stored_blocks
        layout = _layout(model)
        assert all(client.strlen(k) == codec.value_bytes(layout.stored("int8")) < codec.value_bytes(layout)
                   for k in keys)
        plain = CacheBank(model, config(tmp_path / "b", server.url, write="off"))
        assert plain.attach(out) == 0  # another mode's keys: nothing found, nothing misread
        plain.close()
        bank = CacheBank(model, compressed(tmp_path / "c", write="off"))
        assert bank.attach(out) == stored_blocks * BLOCK_SIZE
        assert torch.equal(greedy(model, out, bank, NEW_TOKENS), reference(model, out, NEW_TOKENS))
        bank.close()
        bank = CacheBank(model, compressed(tmp_path / "d", write="off"))
        root = bank.fingerprint.root_key("float32")
        chain = tiered_kv.identity.chain_keys(root, out[0].tolist(), BLOCK_SIZE, 0, stored_blocks)
        victim = codec.remote_key("tkv:", bank.store.layout.stored("int8"), root, chain[2])
        value = bytearray(client.get(victim))
        value[-5] ^= 0x40  # a byte of the last layer's value scales
        client.set(victim, bytes(value))
        with caplog.at_level(logging.WARNING, logger="tiered_kv"):
            assert bank.attach(out) == 2 * BLOCK_SIZE
        assert bank.stats()["remote"]["misses"] == {"bad": 1}
        assert torch.equal(greedy(model, out, bank, NEW_TOKENS), reference(model, out, NEW_TOKENS))
        bank.close()
