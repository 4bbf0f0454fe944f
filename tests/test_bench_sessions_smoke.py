"""Smoke test of bench/sessions.py at its smallest size: a tiny random Llama, 3 chats x 3 turns, two
policies, two worker threads. Nothing here depends on timings: only shapes, signs and token equality."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import tiered_kv.config

BENCH = Path(__file__).resolve().parents[1] / "bench" / "sessions.py"
CHATS, TURNS, POLICIES = 3, 3, ("lru", "lfu", "turns")


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_sessions", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _positive(value) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value > 0


def _share(value) -> bool:
    return isinstance(value, float) and 0.0 <= value <= 1.0


def _has_matplotlib() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def test_sessions_bench_smallest_size(tmp_path):
    out_json, out_png = tmp_path / "sessions.json", tmp_path / "sessions.png"
    argv = ["--tiny", "--chats", str(CHATS), "--turns", str(TURNS), "--system-tokens", "24",
            "--tokens-per-turn", "8", "--max-new-tokens", "3", "--block-size", "4", "--think-mean-s", "0.001",
            "--recompute-every", "1", "--segment-events", "4", "--policies", ",".join(POLICIES), "--threads", "2",
            "--cold-dir", str(tmp_path / "cold"), "--json", str(out_json), "--plot", str(out_png)]
    assert _load_bench().main(argv) == 0

    result = json.loads(out_json.read_text())
    assert result["cpu_count"] >= 1 and result["torch_threads"] >= 1
    assert len(result["load_average_before"]) == 3 and len(result["load_average_after"]) == 3
    assert result["args"]["chats"] == CHATS and result["args"]["threads"] == 2

    trace = result["trace"]
    assert len(trace["events"]) == CHATS * TURNS
    assert trace["events_per_chat"] == [TURNS] * CHATS
    for chat in range(CHATS):  # each chat's turns come in order
        assert [turn for c, turn, _ in trace["events"] if c == chat] == list(range(1, TURNS + 1))
    budget = result["tier_budget"]
    assert budget["trace_blocks"] == CHATS * math.ceil((24 + TURNS * (8 + 3)) / 4)
    assert budget["hot_blocks"] == math.ceil(budget["trace_blocks"] / 8)

    # a policy this checkout's scheduler does not know yet is reported, never silently dropped;
    # every policy that ran must reproduce the ideal run's tokens exactly
    assert set(result["policies"]) == set(POLICIES)
    assert result["policies"]["lru"]["available"] is True
    ran = [p for p, s in result["policies"].items() if s["available"]]
    for name, summary in result["policies"].items():
        if not summary["available"]:
            assert "policy" in summary["error"], name
    assert result["tokens_match"] == {p: True for p in ran}
    assert result["tokens_match_everywhere"] is True

    events = result["events"]
    for system in ("ideal", *ran, "recompute"):
        rows = [r for r in events if r["system"] == system]
        assert len(rows) == CHATS * TURNS, system  # recompute-every 1: every event
        for row in rows:
            where = f"{system} event {row['event']}"
            assert _positive(row["ttft_s"]) and row["turn_s"] >= row["ttft_s"], where
            if system != "ideal":
                assert row["tokens_match"] is True, where
            if system in ran:
                blocks = row["blocks_before_turn"]
                assert set(blocks) == {"hot", "warm", "cold"}, where
                if row["turn"] == 1:
                    assert sum(blocks.values()) == 0 and row["hot_hit"] is None, where
                else:
                    assert _share(row["hot_hit"]), where
                    assert row["reused_tokens"] > 0, where

    for name in ran:
        summary = result["policies"][name]
        assert _share(summary["hot_hit_rate_bench"]), name
        assert summary["hot_hit_rate_store"] is None or _share(summary["hot_hit_rate_store"]), name
        for part in ("all_turns", "later_turns"):
            for key in ("mean_s", "p50_s", "p95_s"):
                assert _positive(summary["ttft"][part][key]), (name, part, key)
        assert set(summary["bytes_moved"]) == {f"{a}->{b}" for a in ("hot", "warm", "cold")
                                               for b in ("hot", "warm", "cold") if a != b}
        assert set(summary["moves"]) == {"promotions", "demotions", "evictions"}
        assert set(summary["critical_path_s"]) == {"move_s", "demote_s", "promote_s"}
        restore = summary["restore"]  # the load-or-recompute split (issue 22)
        assert restore["mode"] == "auto" and restore["restored_tokens"] > 0 and restore["recomputed_tokens"] >= 0
    for name in ("ideal", "recompute"):
        for key in ("mean_s", "p50_s", "p95_s"):
            assert _positive(result["baselines"][name]["ttft"]["all_turns"][key]), (name, key)
    assert result["baselines"]["recompute"]["tokens_match"] is True
    assert set(result["targets"]) == {"p95_vs_ideal", "recompute_vs_policy", "turns_vs_lru_hot_hit", "default_vs_lru"}
    default = result["targets"]["default_vs_lru"]
    # lru is the default (issue 35: bench/policy_family.py); its gain over itself is 0 and no verdict is owed
    assert default["policy"] == tiered_kv.config.SchedulerConfig().policy == "lru"
    assert default["met"] is None and default["gain"] == 0
    assert set(result["targets"]["p95_vs_ideal"]["per_policy"]) == set(ran)

    if _has_matplotlib():
        assert out_png.is_file() and out_png.stat().st_size > 0
        assert result["plot"] == str(out_png)
    assert not any((tmp_path / "cold").iterdir()), "the run's cold directories were not removed"


def test_store_figures_reads_todays_and_coming_keys():
    """One accessor reads the store's statistics: absent keys are None, coming ones are picked up."""
    bench = _load_bench()
    today = {"tiers": {}, "hits": {"hot": 3}, "misses": 1, "bytes_moved": {"hot->warm": 10}, "link_saturation": 0.0}
    figures = bench.store_figures(today)
    assert figures["bytes_moved"]["hot->warm"] == 10 and figures["bytes_moved"]["warm->hot"] is None
    assert figures["hit_rate"] == {"hot": None, "warm": None, "cold": None}
    assert figures["moves"] == {"promotions": None, "demotions": None, "evictions": None}
    assert figures["critical_path"] == {"move_s": None, "demote_s": None, "promote_s": None}
    coming = {**today, "hit_rate": {"hot": 0.5, "warm": 0.25, "cold": None}, "turn_blocks": 8,
              "moves": {"promotions": 4, "demotions": 2, "evictions": 0}, "bytes_background": 7,
              "bytes_on_demand": 3, "critical_path": {"move_s": 0.5, "demote_s": 0.25, "promote_s": 0.25},
              "fragmentation": 0.1, "contiguity": 0.9}
    figures = bench.store_figures(coming)
    assert figures["hit_rate"]["hot"] == 0.5 and figures["turn_blocks"] == 8
    assert figures["moves"]["promotions"] == 4 and figures["bytes_background"] == 7
    delta = bench._delta(figures, bench.store_figures(today))
    assert delta["critical_path"]["demote_s"] is None  # absent before: no difference to report
    assert delta["bytes_moved"]["hot->warm"] == 0
