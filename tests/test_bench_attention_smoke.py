"""bench/attention.py at its smallest size: every section runs and reports what bench/README.md
quotes (sparse quality per text, the question trace under both placements, the sampling cost)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "attention.py"


def test_attention_bench_smoke(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_attention", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "attention.json"
    result = module.main(["--tiny", "--json", str(out)])
    assert json.loads(out.read_text())["settings"]["budget"] == 0.25
    for name in ("prose", "dialogue", "code", "docs"):
        report = result["quality"][name]
        assert 0 < report["read_share_below_hot"] < 1 and 0 <= report["argmax_agreement"] <= 1
        assert report["step_ms_exact"] > 0 and report["step_ms_sparse"] > 0
    trace = result["trace"]
    assert trace["lru"]["sparse_steps"] > 0 and trace["attention"]["sparse_steps"] > 0
    assert trace["attention"]["mass_share_by_tier"] and trace["lru"]["mass_share_by_tier"]
    assert trace["bytes_ratio_attention_vs_lru"] > 0
    cost = result["cost"]
    assert cost["step_ms_off"] > 0 and cost["step_ms_on"] > 0 and len(cost["rounds"]) == 2


def test_attention_bench_oracle_and_spill_sections(tmp_path):
    """The oracle section swaps the bound for the true attention mass and puts the bound back after."""
    from tiered_kv.bank.sparse import SparseStep

    spec = importlib.util.spec_from_file_location("bench_attention", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    bound = SparseStep.scores
    result = module.main(["--tiny", "--sections", "oracle,spill", "--spill-positions", "4"])
    assert SparseStep.scores is bound
    assert set(result["spill"]) == {"warm", "warm int8", "cold", "cold int8"}
    for report in result["spill"].values():
        assert 0 < report["read_share_below_hot"] < 1 and report["speedup_vs_exact"] > 0
    for name in ("prose", "dialogue", "code", "docs"):
        report = result["oracle"][name]
        assert 0 < report["read_share_below_hot"] < 1 and 0 <= report["argmax_agreement"] <= 1
