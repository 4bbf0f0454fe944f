"""bench/policy_family.py (issue 35): the default-policy rule on given numbers, and the bench at
its smallest size (two variants, every policy, tokens equal to the ideal run's)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import policy_family  # noqa: E402

POLICIES = ["lru", "lfu", "fifo", "turns"]


def rows(*hot_by_variant):
    return [{"hot": dict(zip(POLICIES, hot))} for hot in hot_by_variant]


def test_the_rule_takes_a_policy_never_far_below_lru_and_above_it_on_average():
    table = rows((0.50, 0.52, 0.49, 0.51), (0.60, 0.598, 0.55, 0.62), (0.40, 0.43, 0.40, 0.401))
    verdict = policy_family.choose_default(table, POLICIES)
    # lfu: +2, -0.2, +3 -> qualifies (mean +1.6); turns: +1, +2, +0.1 -> qualifies (mean +1.03); fifo: -5 no
    assert verdict["qualifying"] == ["lfu", "turns"] and verdict["default"] == "lfu"
    assert verdict["per_policy"]["fifo"]["qualifies"] is False


def test_the_rule_falls_back_to_lru_when_no_policy_qualifies():
    one_bad_variant = rows((0.50, 0.60, 0.51, 0.55), (0.60, 0.594, 0.59, 0.55))  # lfu -0.6 once, turns -5
    verdict = policy_family.choose_default(one_bad_variant, POLICIES)
    assert verdict["qualifying"] == [] and verdict["default"] == "lru"
    below_on_average = rows((0.50, 0.499, 0.50, 0.498), (0.60, 0.598, 0.60, 0.599))  # never 0.5 below, mean < 0
    assert policy_family.choose_default(below_on_average, POLICIES)["default"] == "lru"


def test_policy_family_smallest_size(tmp_path):
    out = tmp_path / "family.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "policy_family.py"), "--seeds", "0-1", "--smoke",
                           "--json", str(out)], timeout=600, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert len(result["variants"]) == 2 and result["tokens_match_everywhere"] is True
    for variant in result["variants"]:
        assert set(variant["policies"]) == set(POLICIES)
        assert all(0.0 <= p["hot_hit_rate"] <= 1.0 for p in variant["policies"].values())
    assert result["rule"]["default"] in POLICIES
    assert result["rule"]["default"] == policy_family.choose_default(result["rows"], POLICIES)["default"]
