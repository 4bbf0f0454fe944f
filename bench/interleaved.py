#!/usr/bin/env python
"""Eight chats in one store, written turn by turn interleaved as a server writes them, then decoded
round-robin: CacheBank step time beside DynamicCache's.

The model is bench/overhead.py's: SmolLM2-135M's KV shape (30 layers, 3 KV heads, head_dim 64,
fp32: 46 KiB of KV per token) with next to no compute, so a step is mostly the cache's work.

Per mode, one TierStore (all hot: room for every chat's context and its decode steps, plus
`--headroom` spare) and `--chats` CacheBanks, beside as many DynamicCaches. Each chat's KV is
written in `--turns` turns of context/turns tokens (`--uneven`: a seeded random context from half
of `--context` to all of it, in turns of random lengths),
interleaved (chat 0 turn 1, chat 1 turn 1, ..., chat 0 turn 2, ...; `cache.update` per layer with
seeded random K/V, the same tensors to the bank and its DynamicCache), so blocks land where a
server's would. Then each timed round runs `--steps` decode steps round-robin over the chats (one
one-token forward per chat per step) on the banks and on the DynamicCaches, A/B order
alternating per round, and crops every cache back.
Reported per mode: median seconds per chat-step, ratio = DynamicCache / bank (target >= 0.95; also
the median of each round's own ratio, steadier when the machine's load drifts between rounds), and
the hot pool's contiguity (mean and min over chats) and fragmentation after the fill, after the
mover settled, and after the rounds. Modes:

  * mover    - scheduler.background true: the mover compacts the hot pool before timing starts
               (the bench waits for store.wait_for_background and for contiguity to hold)
  * no-mover - scheduler.background false: allocation placement alone, no compaction

    python bench/interleaved.py                                 # 8 chats x 2k context, both modes
    python bench/interleaved.py --uneven --headroom 0.1         # chats of different lengths, less spare room
    python bench/interleaved.py --chats 2 --context 40 --turns 2 --rounds 2 --steps 2   # smoke size
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

# measure the tiered_kv of this checkout, not whichever one an editable install points at
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import tiered_kv  # noqa: E402

MODES = {"mover": True, "no-mover": False}  # mode -> scheduler.background
TARGET_RATIO = 0.95


def _load_overhead():
    spec = importlib.util.spec_from_file_location("bench_overhead", Path(__file__).resolve().parent / "overhead.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


overhead = _load_overhead()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--chats", type=int, default=8, help="chats sharing the store")
    parser.add_argument("--context", type=int, default=2048, help="tokens of context per chat before decoding")
    parser.add_argument("--turns", type=int, default=8, help="turns each chat's context is written in")
    parser.add_argument("--uneven", action="store_true",
                        help="seeded random context per chat (from half --context to all of it) and turn lengths")
    parser.add_argument("--headroom", type=float, default=0.25,
                        help="spare hot capacity, as a share of what the chats need")
    parser.add_argument("--modes", default="mover,no-mover", help=f"comma-separated, from {list(MODES)}")
    parser.add_argument("--rounds", type=int, default=7, help="timed A/B rounds per mode (medians are reported)")
    parser.add_argument("--steps", type=int, default=4, help="round-robin decode steps per round")
    parser.add_argument("--settle-s", type=float, default=60.0, help="longest wait for the mover to compact")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--seed", type=int, default=0, help="seed for the weights and the random K/V")
    parser.add_argument("--json", default=None, metavar="PATH", help="write all results to this JSON file")
    args = parser.parse_args(argv)
    args.mode_names = [m for m in args.modes.split(",") if m]
    if not args.mode_names or any(m not in MODES for m in args.mode_names):
        parser.error(f"--modes: got {args.modes!r}; allowed: comma-separated from {list(MODES)}")
    for name in ("chats", "context", "turns", "rounds", "steps", "block_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.turns > args.context or args.headroom < 0 or args.threads < 0 or args.settle_s < 0:
        parser.error("--turns must not exceed --context; --headroom, --threads and --settle-s must be >= 0")
    return args


def layout(store: tiered_kv.TierStore) -> dict:
    stats = store.stats()
    return {"contiguity": stats.get("contiguity"), "contiguity_min": stats.get("contiguity_min"),
            "fragmentation": stats.get("fragmentation"), "hot_used_blocks": stats["tiers"]["hot"]["used_blocks"],
            "relocations": int(store.metrics.relocations.value())}


def settle(store: tiered_kv.TierStore, timeout_s: float) -> tuple[bool, float]:
    """Wait for the mover to finish compacting (contiguity then holds from one look to the next)."""
    started = time.perf_counter()
    deadline = started + timeout_s
    settled = False
    while time.perf_counter() < deadline:
        settled = store.wait_for_background(max(0.0, deadline - time.perf_counter()))
        before = layout(store)
        time.sleep(0.05)
        if settled and layout(store) == before:
            break
    return settled, time.perf_counter() - started


def turn_bounds(args, chat: int) -> list[int]:
    """Token positions where each of a chat's turns starts, and its context length last."""
    if not args.uneven:
        return [round(args.context * t / args.turns) for t in range(args.turns + 1)]
    rng = random.Random(args.seed + chat)
    context = rng.randint(max(args.turns, args.context // 2), args.context)
    return [0, *sorted(rng.sample(range(1, context), args.turns - 1)), context]


def fill_interleaved(pairs: list[tuple], args, model_config) -> None:
    """Write every chat's context turn by turn, the chats interleaved within each turn."""
    bounds = [turn_bounds(args, chat) for chat in range(len(pairs))]
    for turn in range(args.turns):
        for chat, caches in enumerate(pairs):
            seed = args.seed + 1000 * chat + turn
            num_tokens = bounds[chat][turn + 1] - bounds[chat][turn]
            overhead.fill(list(caches), num_tokens, model_config, args.context, seed)


def decode_round(model, caches: list, ids: torch.Tensor, steps: int) -> float:
    """Seconds per chat-step of `steps` round-robin steps over `caches`; crops them back after."""
    gc.collect()
    start = time.perf_counter()
    for _ in range(steps):
        for cache in caches:
            model(input_ids=ids, cache=cache, use_cache=True)
    elapsed = time.perf_counter() - start
    for cache in caches:
        cache.crop(-steps)
    return elapsed / (steps * len(caches))


def measure_mode(model, mode: str, args) -> dict:
    bs = args.block_size
    contexts = [turn_bounds(args, chat)[-1] for chat in range(args.chats)]
    chat_blocks = sum(math.ceil(c / bs) for c in contexts)
    capacity = math.ceil(sum(math.ceil((c + args.steps + 1) / bs) for c in contexts) * (1 + args.headroom))
    cfg = {"block_size": bs, "hot": {"device": "cpu", "capacity_blocks": capacity},
           "warm": {"capacity": 0}, "cold": {"capacity": 0}, "scheduler": {"background": MODES[mode]}}
    store = tiered_kv.TierStore(cfg)
    banks = [overhead.make_bank(model, cfg, store) for _ in range(args.chats)]
    dynamics = [DynamicCache(config=model.config) for _ in range(args.chats)]
    started = time.perf_counter()
    fill_interleaved(list(zip(banks, dynamics)), args, model.config)
    fill_s = time.perf_counter() - started
    after_fill = layout(store)
    settled, settle_s = settle(store, args.settle_s) if MODES[mode] else (True, 0.0)
    after_settle = layout(store)
    ids = torch.randint(0, model.config.vocab_size, (1, 1), generator=torch.Generator().manual_seed(args.seed))
    samples = {"bank": [], "dynamic": []}
    with torch.no_grad():
        # warm-up step per cache (first-call costs stay out); each bank's logits must agree
        diffs = []
        for bank, dynamic in zip(banks, dynamics):
            a = model(input_ids=ids, cache=bank, use_cache=True).logits
            b = model(input_ids=ids, cache=dynamic, use_cache=True).logits
            diffs.append((a - b).abs().max().item())
            bank.crop(-1)
            dynamic.crop(-1)
        if MODES[mode]:
            settle(store, args.settle_s)  # the warm-up's blocks came and went
        for round_idx in range(args.rounds):
            order = ("bank", "dynamic") if round_idx % 2 == 0 else ("dynamic", "bank")
            for name in order:
                samples[name].append(decode_round(model, banks if name == "bank" else dynamics, ids, args.steps))
    after_rounds = layout(store)
    step_s = {name: statistics.median(values) for name, values in samples.items()}
    row = {
        "mode": mode, "background": MODES[mode], "hot_capacity_blocks": capacity,
        "chat_contexts": contexts, "chat_blocks": chat_blocks, "fill_s": fill_s,
        "settled": settled, "settle_s": settle_s,
        "layout": {"after_fill": after_fill, "after_settle": after_settle, "after_rounds": after_rounds},
        "bank_contiguity": [bank.stats().get("contiguity") for bank in banks],
        "max_logit_diff": max(diffs), "logits_match": max(diffs) <= 1e-4,
        "bank_step_s": step_s["bank"], "dynamic_step_s": step_s["dynamic"],
        "bank_samples_s": samples["bank"], "dynamic_samples_s": samples["dynamic"],
        "ratio": step_s["dynamic"] / step_s["bank"],
        "round_ratios": [d / b for d, b in zip(samples["dynamic"], samples["bank"])],
        "paired_ratio": statistics.median(d / b for d, b in zip(samples["dynamic"], samples["bank"])),
        "mover_batches": store.stats()["scheduler"]["background_batches"],
    }
    for bank in banks:
        bank.close()
    store.close()
    del banks, dynamics, store
    gc.collect()
    return row


def print_table(rows: list[dict], args) -> None:
    print(f"\n{args.chats} chats x {args.context} tokens written in {args.turns} interleaved turns; median ms per "
          f"chat-step over {args.rounds} rounds x {args.steps} round-robin steps; ratio = DynamicCache / bank "
          f"(target >= {TARGET_RATIO}); paired = median over rounds of that round's ratio")
    print(f"{'mode':>9} {'DC ms':>7} {'bank ms':>8} {'ratio':>6} {'paired':>6}  "
          f"{'contiguity mean/min (fragmentation)':<60} logits")
    for r in rows:
        stages = []
        for stage in ("after_fill", "after_settle", "after_rounds"):
            s = r["layout"][stage]
            if s["contiguity"] is None:
                stages.append(f"{stage[6:]}: n/a")
            else:
                stages.append(f"{stage[6:]} {s['contiguity']:.3f}/{s['contiguity_min']:.3f} ({s['fragmentation']:.2f})")
        print(f"{r['mode']:>9} {r['dynamic_step_s'] * 1e3:>7.2f} {r['bank_step_s'] * 1e3:>8.2f} {r['ratio']:>5.2f}x "
              f"{r['paired_ratio']:>5.2f}x  "
              f"{'; '.join(stages):<60} {'same' if r['logits_match'] else 'DIFFER'}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    started = time.perf_counter()
    model = overhead.build_model(args.seed, args.context + 2 * args.steps + 4)
    print(f"{torch.get_num_threads()} torch threads, {os.cpu_count()} cores, load average {load_before[0]:.1f}; "
          f"{args.chats} chats x {args.context} tokens, modes {args.mode_names}", flush=True)
    rows = []
    for mode in args.mode_names:
        rows.append(measure_mode(model, mode, args))
        r = rows[-1]
        print(f"  {mode}: filled in {r['fill_s']:.1f} s, settled in {r['settle_s']:.1f} s, "
              f"DC {r['dynamic_step_s'] * 1e3:.2f} ms, bank {r['bank_step_s'] * 1e3:.2f} ms, "
              f"ratio {r['ratio']:.2f}x", flush=True)
    wall_s, load_after = time.perf_counter() - started, os.getloadavg()
    print_table(rows, args)
    print(f"wall time {wall_s:.0f} s; load average {load_before[0]:.1f} before, {load_after[0]:.1f} after "
          f"on {os.cpu_count()} cores")
    summary = {r["mode"]: {"ratio": r["ratio"], "met": r["ratio"] >= TARGET_RATIO} for r in rows}
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"cpu_count": os.cpu_count(), "threads": torch.get_num_threads(),
                       "load_average_before": load_before, "load_average_after": load_after,
                       "torch": torch.__version__, "args": {k: v for k, v in vars(args).items()},
                       "target_ratio": TARGET_RATIO, "modes": rows, "summary": summary, "wall_s": wall_s},
                      f, indent=2)
    if not all(r["logits_match"] for r in rows):
        print("ERROR: a bank's logits differ from DynamicCache's (see the table)", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
