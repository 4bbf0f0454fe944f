#!/usr/bin/env python
"""What metrics cost: decode tokens/s through CacheBank with `metrics.enabled` true vs false.

One bank generates greedy tokens from a fixed prompt under tiered_kv.hooks (exact), as
`tiered-kv chat` does; rounds alternate its store's `metrics.enabled` between true and false (a
flag every metric call checks), so both variants run on the same blocks, slots and files. Per
round the bank re-attaches the prompt (its KV is reused, one token recomputed) and decodes
`--steps` tokens; decode tokens/s = (new tokens - 1) / (time from the first new token to the
last). Rounds alternate which variant goes first. Reported: median tokens/s of each, their ratio on / off,
and the median of each round's own on / off ratio (the two ran back to back, so slow drifts of a
shared machine cancel; the target, >= 0.98, is judged on it: metrics cost at most 2% of decode).

Placements (`--placements`):
  * hot     - everything in hot: the counters of a step (hits, tokens) and the TTFT histogram;
  * offload - hot holds a quarter of the context, the rest sits in warm and cold: every layer of
              every step also reads warm and cold runs, each read timed into a histogram (the
              most observations per step metrics ever make).
The model has SmolLM2-135M's KV shape (30 layers, 3 KV heads, head_dim 64) with next to no
compute (as bench/overhead.py), so a step is mostly the cache's own work and any metrics cost
shows; with the real model it would be a smaller share still.

On a shared 2-core machine the A/B ratio is noisy (a few % either way), so the bench also
counts what metrics do per decode step (every Counter.inc / Histogram.observe call, counted by
wrapping them during one extra round) and times those calls in a tight loop: ops per step x
ns per op / step time is the metrics' share of a step, independent of the load.

    python bench/metrics_overhead.py                                   # 2048-token context, 15 rounds
    python bench/metrics_overhead.py --context 64 --steps 3 --rounds 1  # smoke size
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

# measure the tiered_kv of this checkout, not whichever one an editable install points at
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import tiered_kv  # noqa: E402
from tiered_kv import hooks  # noqa: E402
from tiered_kv.chat import TurnTimer  # noqa: E402
from tiered_kv.metrics import registry  # noqa: E402

TARGET_RATIO = 0.98
PLACEMENTS = ("hot", "offload")
VARIANTS = ("on", "off")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--context", type=int, default=2048, help="prompt tokens")
    parser.add_argument("--steps", type=int, default=16, help="new tokens per round")
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds per bank (medians reported)")
    parser.add_argument("--placements", default=",".join(PLACEMENTS), help="comma-separated: hot, offload")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--control", action="store_true",
                        help="A/A control: metrics off in both variants (the noise floor of the comparison)")
    parser.add_argument("--json", default=None, metavar="PATH", help="write all results to this JSON file")
    args = parser.parse_args(argv)
    args.placement_list = [p for p in args.placements.split(",") if p]
    if not args.placement_list or any(p not in PLACEMENTS for p in args.placement_list):
        parser.error(f"--placements: got {args.placements!r}; allowed: a comma-separated subset of {PLACEMENTS}")
    for name in ("context", "steps", "rounds", "block_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.steps < 2:
        parser.error("--steps must be at least 2 (decode speed is timed after the first new token)")
    return args


def build_model(seed: int, max_tokens: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=256, hidden_size=72, intermediate_size=128, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                         max_position_embeddings=max_tokens)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def config_for(placement: str, context: int, steps: int, block_size: int, cold_dir: str, enabled: bool) -> dict:
    blocks = math.ceil((context + steps) / block_size) + 2
    hot = blocks if placement == "hot" else max(4, blocks // 4)
    return {"block_size": block_size, "hot": {"device": "cpu", "capacity_blocks": hot},
            "warm": {"capacity_blocks": 0 if placement == "hot" else blocks // 2},
            "cold": {"capacity_blocks": 0 if placement == "hot" else blocks, "path": cold_dir},
            "scheduler": {"background": False}, "metrics": {"enabled": enabled}}


def decode_round(model, bank, prompt: torch.Tensor, steps: int) -> tuple[float, list[int]]:
    bank.attach(prompt)
    timer = TurnTimer()
    out = model.generate(prompt, cache=bank, attention_mask=torch.ones_like(prompt), max_new_tokens=steps,
                         min_new_tokens=steps, do_sample=False, streamer=timer)
    end_s = time.perf_counter()
    return (steps - 1) / (end_s - timer.first_token_time), out[0, prompt.shape[1]:].tolist()


def measure(model, placement: str, args, tmp: str) -> dict:
    """One bank; rounds alternate its store's `metrics.enabled` (a plain flag every metric call
    checks), so on and off run on the same blocks, slots and files."""
    prompt = torch.randint(1, model.config.vocab_size, (1, args.context),
                           generator=torch.Generator().manual_seed(args.seed))
    cfg = config_for(placement, args.context, args.steps, args.block_size, os.path.join(tmp, placement), enabled=True)
    bank = tiered_kv.CacheBank(model, cfg)
    metrics = bank.store.metrics
    samples = {variant: [] for variant in VARIANTS}
    tokens = {}
    off_counted = 0
    hooks.install(model, bank, mode="exact")
    try:
        with torch.no_grad():
            for variant in VARIANTS:  # warm-up: the prefill and first-call costs stay out
                metrics.enabled = variant == "on" and not args.control
                _, tokens[variant] = decode_round(model, bank, prompt, args.steps)
            for round_idx in range(args.rounds):
                for variant in (VARIANTS if round_idx % 2 == 0 else VARIANTS[::-1]):
                    metrics.enabled = variant == "on" and not args.control
                    hits_before = metrics.hits.total()
                    gc.collect()
                    rate, _ = decode_round(model, bank, prompt, args.steps)
                    samples[variant].append(rate)
                    if variant == "off":
                        off_counted += metrics.hits.total() - hits_before
            metrics.enabled = not args.control
            reads_before = {tier: s["count"] for tier, s in metrics.snapshot()["read_seconds"].items()}
            ops = count_ops(lambda: decode_round(model, bank, prompt, args.steps))
            reads_after = {tier: s["count"] for tier, s in metrics.snapshot()["read_seconds"].items()}
    finally:
        hooks.uninstall(model)
    stats = bank.stats()
    bank_blocks, steps_by_read = stats["bank_blocks"], stats["hooks"]["steps_by_read"]
    bank.close()
    median = {variant: statistics.median(values) for variant, values in samples.items()}
    ns = op_ns()
    ops_per_step = {name: count / args.steps for name, count in ops.items()}
    cost_s = (ops_per_step["inc"] * ns["inc"] + ops_per_step["observe"] * ns["start_observe"]) * 1e-9
    return {
        "placement": placement,
        "tokens_equal": tokens["on"] == tokens["off"],
        "tokens_per_s": median, "samples_tokens_per_s": samples,
        "ratio_on_off": median["on"] / median["off"],
        # each round's on and off ran back to back: the median of their ratios drops slow drifts of the machine
        "paired_ratio_on_off": statistics.median(a / b for a, b in zip(samples["on"], samples["off"])),
        "bank_blocks": bank_blocks,
        "steps_by_read": steps_by_read,  # how its steps read their blocks (bank/plan.py)
        "read_observations_per_round": {t: n - reads_before.get(t, 0) for t, n in reads_after.items()},
        "off_counted_nothing": off_counted == 0,
        "control": args.control,
        "ops_per_step": ops_per_step, "ns_per_op": ns,
        "estimated_share_of_step": cost_s * median["on"],  # seconds of metrics / seconds of a step
    }


def count_ops(run) -> dict:
    """Counter.inc and Histogram.observe calls made while `run()` runs (wrapped, then restored)."""
    counts = {"inc": 0, "observe": 0}
    originals = {"inc": registry.Counter.inc, "observe": registry.Histogram.observe}

    def counted(name):
        original = originals[name]

        def call(*args, **kwargs):
            counts[name] += 1
            return original(*args, **kwargs)
        return call

    registry.Counter.inc, registry.Histogram.observe = counted("inc"), counted("observe")
    try:
        run()
    finally:
        registry.Counter.inc, registry.Histogram.observe = originals["inc"], originals["observe"]
    return counts


def op_ns(repeats: int = 100_000) -> dict:
    """Nanoseconds of one Counter.inc and of one timed observation (start + stop) when enabled."""
    m = registry.Metrics()
    start = time.perf_counter()
    for _ in range(repeats):
        m.hits.inc(("hot",), 3)
    inc_ns = (time.perf_counter() - start) / repeats * 1e9
    start = time.perf_counter()
    for _ in range(repeats):
        m.read_seconds.stop(("warm",), m.read_seconds.start())
    return {"inc": inc_ns, "start_observe": (time.perf_counter() - start) / repeats * 1e9}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    load_before = os.getloadavg()
    model = build_model(args.seed, args.context + args.steps + 8)
    rows = []
    with tempfile.TemporaryDirectory(prefix="tkv-metrics-bench-") as tmp:
        for placement in args.placement_list:
            row = measure(model, placement, args, tmp)
            rows.append(row)
            print(f"{placement:>8}: metrics on {row['tokens_per_s']['on']:.1f} tok/s, off {row['tokens_per_s']['off']:.1f} "
                  f"tok/s -> on/off {row['ratio_on_off']:.3f}, paired {row['paired_ratio_on_off']:.3f} (target >= "
                  f"{TARGET_RATIO}); tokens equal: "
                  f"{row['tokens_equal']}; reads timed per round: {row['read_observations_per_round']}")
            print(f"{'':>8}  per step: {row['ops_per_step']['inc']:.1f} increments, {row['ops_per_step']['observe']:.1f} "
                  f"observations ({row['ns_per_op']['inc']:.0f} / {row['ns_per_op']['start_observe']:.0f} ns each) "
                  f"= {100 * row['estimated_share_of_step']:.3f}% of a step")
    load_after = os.getloadavg()
    result = {
        "args": {k: v for k, v in vars(args).items() if k != "placement_list"},
        "cpu_count": os.cpu_count(), "threads": torch.get_num_threads(),
        "load_average_before": load_before, "load_average_after": load_after,
        "placements": rows,
        "summary": {"target_ratio": TARGET_RATIO,
                    "met": all(r["paired_ratio_on_off"] >= TARGET_RATIO for r in rows),
                    "tokens_equal_everywhere": all(r["tokens_equal"] for r in rows)},
    }
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f}; "
          f"target met: {result['summary']['met']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
