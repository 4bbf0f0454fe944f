"""Smoke test of bench/gpu_check.py in --quick mode (tiny sizes on CPU): every section runs in
its own child process and records figures, decode variants run interleaved round by round beside
an A/A control, and a variant with no timed repeat is a failure, never a figure."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "gpu_check.py"
BANK_VARIANTS = ("bank", "bank_hooks_exact", "bank_hooks_merge", "bank_hot25", "bank_hot25_hooks_exact",
                 "bank_hot25_hooks_merge", "bank_hot25_hooks_merge_paged_ref")
VARIANTS = ("dynamic", "dynamic_control", *BANK_VARIANTS)


def _positive(value) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value > 0


def _bench_module():
    spec = importlib.util.spec_from_file_location("gpu_check_under_test", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # the module imports only the standard library at the top
    return module


def test_gpu_check_quick_mode(tmp_path):
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--quick", "--sections", "env,decode,warm,cold,compressed",
                           "--out", str(out), "--scratch", str(tmp_path / "scratch")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "gpu_check summary" in proc.stdout
    result = json.loads(out.read_text())
    assert result["within_budget"] is True
    sections = result["sections"]
    assert list(sections) == ["env", "decode", "warm", "cold", "compressed"]
    for name, data in sections.items():
        assert data["status"] == "ok", f"{name}: {data.get('error')}\n{data.get('output_tail', '')}"

    env = sections["env"]
    assert env["backends"]["hot_device"] == "cpu" and env["backends"]["cold_backend"] == "posix"
    assert env["modules"]["tiered_kv"]["file"].startswith(str(BENCH.parents[1]))

    decode = sections["decode"]
    assert decode["variants"] == list(VARIANTS)
    assert decode["kernels_backend"]["backend"] == "torch"
    for context, row in decode["contexts"].items():
        variants, rounds = row["variants"], row["rounds"]
        assert list(variants) == list(VARIANTS), context
        # interleaved: every round ran one chunk of every variant; places rotate, the A/A pair swaps
        assert len(rounds) >= 2, context
        for r in rounds:
            assert sorted(r["order"]) == sorted(VARIANTS), (context, r)
        for name in VARIANTS:
            places = [r["order"].index(name) for r in rounds]
            assert len(set(places)) > 1, (context, name, places)
        pair = [r["order"].index("dynamic") < r["order"].index("dynamic_control") for r in rounds]
        assert True in pair and False in pair, (context, pair)
        for name, v in variants.items():
            where = f"{context} {name}: {v.get('error')}"
            assert v["status"] == "ok", where
            assert v["timed_rounds"] == len(rounds) and v["timed_steps"] == len(rounds) * row["decode_steps_per_chunk"]
            assert _positive(v["step_ms"]) and _positive(v["host_step_ms"]) and _positive(v["wall_step_ms"]), where
            assert v["step_clock"] == "perf_counter" and v["gpu_step_ms"] is None, where  # no CUDA events on CPU
            assert v["syncs_per_step"] is None, where  # sync counting needs CUDA
            assert isinstance(v["sdpa_backend"], str) and v["sdpa_backend"], where
            assert v["tokens_same_every_round"] is True, where
            assert len(v["rounds"]) == len(rounds), where
            if name == "dynamic":
                continue
            assert _positive(v["speed_vs_dynamic"]) and _positive(v["paired_speed_vs_dynamic"]), where
            assert v["tokens_equal_dynamic"] is True, where
            assert v["logits_dtype"] == "bfloat16", where
            assert v["prefill_logits_bitwise_equal"] is True, where
            if v["expected_bitwise"]:  # merge mode is exact to rounding, not bitwise
                assert v["logits_bitwise_equal"] is True, where
            assert v["logits_max_abs_diff"] < 0.05, where
        control = row["control"]
        assert _positive(control["speed_vs_dynamic"]) and isinstance(control["within_3pct"], bool), context
        assert control["logits_bitwise_equal"] is True
        assert row["exactness_ok"] is True, row["exactness_off"]
        assert variants["bank_hot25"]["bank_blocks"]["warm"] > 0, context  # the budget put history in warm
        hooked = variants["bank_hot25_hooks_exact"]["hook_paths_per_step"]
        assert sum(hooked.values()) >= 1 and hooked["paged"] == 0, hooked
        assert variants["bank_hot25_hooks_merge_paged_ref"]["hook_paths_per_step"]["paged"] > 0
        assert variants["dynamic"]["sdpa_backend"] in ("flash_cpu", "math"), variants["dynamic"]["sdpa_backend"]
        summary = decode["summary"][context]
        assert set(summary["variants"]) == set(VARIANTS) and summary["rounds"] == len(rounds)

    warm = sections["warm"]
    moves = warm["moves"]
    assert moves["rounds_counted"] >= 2 and len(moves["order"]) == moves["rounds_counted"] + 1
    assert moves["order"][1] != moves["order"][2]
    summary = warm["summary"]
    assert summary["data_round_trip_equal"] is True and summary["blocks"] == warm["layout"]["blocks"]
    for key in ("store_h2d_gb_per_s", "plain_h2d_gb_per_s", "store_d2h_gb_per_s", "plain_d2h_gb_per_s",
                "store_host_us_per_block_h2d", "store_host_us_per_block_d2h"):
        assert _positive(summary[key]), key

    cold = sections["cold"]
    assert cold["tier_posix"]["disk"]["data_round_trip_equal"] is True
    assert cold["tier_posix"]["cached"]["data_round_trip_equal"] is True
    assert _positive(cold["summary"]["raw_posix_disk_gb_per_s"])
    assert "error" in cold["tier_kvikio"]  # kvikio needs a CUDA device

    compressed = sections["compressed"]
    assert compressed["kernels_backend"] == "torch"
    for mode in ("fp8", "int8", "int4"):
        row = compressed["kernel"][mode]
        assert row["bitwise_equal_torch"] is True and _positive(row["ops_gb_per_s"]), (mode, row)
    moves = compressed["moves"]
    for mode in ("none", "int8"):
        assert moves[mode]["all_back_hot"] is True and moves[mode]["round_trip_as_expected"] is True, mode
    assert 0 < moves["int8"]["bytes_moved"]["hot->warm"] < moves["none"]["bytes_moved"]["hot->warm"]


def test_variant_without_a_timed_round_fails():
    g = _bench_module()
    v = g.DecodeVariant(g.DECODE_VARIANTS[2])
    v.ready = True
    figures = g.variant_figures(v, is_cuda=False)
    assert figures["status"] == "failed" and "no timed repeat" in figures["error"]
    assert figures["timed_rounds"] == 0 and "step_ms" not in figures and "tokens_per_s" not in figures
    v.tokens = [1, 2, 3]
    v.rounds.append({"round": 1, "position": 0, "host_ms": [2.0, 4.0, 3.0], "gpu_ms": None,
                     "wall_ms_per_step": 3.1, "tokens_same_as_warmup": True})
    v.out.pop("error")
    figures = g.variant_figures(v, is_cuda=False)
    assert figures["status"] == "ok" and figures["step_ms"] == 3.0 and figures["timed_steps"] == 3


def test_rounds_rotate_and_limits_fit_the_budget():
    g = _bench_module()
    items = list("abcdefghi")
    orders = [g.round_order(items, r) for r in range(1, 6)]
    assert all(sorted(o) == items for o in orders)
    for item in items:
        places = [o.index(item) for o in orders]
        assert len(set(places)) >= 3, (item, places)  # never stuck at one place
    # the first two (dynamic and its A/A control) swap: A before B in odd rounds, after it in even ones
    assert [o.index("a") < o.index("b") for o in orders] == [True, False, True, False, True]
    for budget in (g.TOTAL_BUDGET_S, 120):
        limits = g.section_limits(list(g.SECTIONS), budget, quick=False)
        assert sum(limits.values()) + g.ORCHESTRATOR_RESERVE_S * len(limits) <= budget
    assert g.TOTAL_BUDGET_S <= 300
