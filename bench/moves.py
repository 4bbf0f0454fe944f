#!/usr/bin/env python
"""Moves at link speed (issue 34, item 5): warm<->hot moves through the store against a plain copy.

`--blocks` blocks (default 2,000) of SmolLM2-135M's KV shape (30 layers, 3 KV heads, head_dim 64,
fp32, 16 tokens a block: 720 KiB each, 1.4 GiB in all) live in a TierStore whose hot and warm tiers
hold exactly that many (no cold tier, no background mover, the default copy engine: sync on a CPU).
Each round, in an order that alternates (A/B interleaved):
  * store - `store.demote(ids, WARM)` (hot -> warm), then `store.promote(ids)` (warm -> hot): the
            whole move path (plan, reserve, copy, commit) as a caller sees it;
  * plain - the same bytes with one `copy_` per direction between the two tiers' own slabs (hot
            slab -> warm slab, then back: preallocated tensors of exactly the tiers' layouts; the
            blocks sit in hot meanwhile and the warm slab is free, so this changes no block).
A warm-up round of each runs first and is not counted. Reported per direction (medians):
  * `ratio`: plain seconds / store seconds (1.0: the store moves at the speed of a plain copy), the
    median over rounds of each round's pair (the two run back to back, so a change of the machine's
    memory bandwidth between rounds, which swings 22-37 GB/s on this VM, cancels out;
    `ratio_of_medians` is the plain median over the store median);
  * `store_own_s_per_block`: the store's own time per block: its wall time minus the time spent
    inside its byte copies (`BlockCopier.copy` and `BlockCopier.direct/staged`, timed with
    perf_counter around each call by this script; on the sync engine they run on the calling
    thread, so the rest of the wall time is the store's Python: plan, reserve, commit);
  * `beyond_plain_s_per_block`: (store wall - plain wall) / blocks, median over rounds' pairs: what
    a move costs beyond the copy, the copies' own efficiency included (run by run vs one copy_);
  * `thread_cpu_s`: CPU seconds of the calling thread (time.thread_time), store and plain: torch
    spreads a large copy over its threads, so the difference is mostly the store's Python.
Every block's bytes are checked (crc32) after the last round: the moves must keep them exactly.

    python bench/moves.py --json bench/results/moves_cpu.json          # 2,000 blocks, 7 rounds
    python bench/moves.py --blocks 8 --layers 2 --kv-heads 1 --head-dim 8 --block-size 4 --rounds 1   # smoke
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import torch

# measure the tiered_kv of this checkout, not whichever one an editable install points at
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import tiered_kv  # noqa: E402
from tiered_kv.blocks import HOT, WARM, KVLayout  # noqa: E402
from tiered_kv.hw.block_copy import BlockCopier  # noqa: E402

RATIO_TARGET = 0.95  # store moves at >= this share of a plain copy's speed, both ways
STORE_S_PER_BLOCK_TARGET = 1e-6  # <= this much of the store's own time per moved block
DIRECTIONS = ("hot->warm", "warm->hot")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--blocks", type=int, default=2000, help="blocks moved each way per round")
    parser.add_argument("--layers", type=int, default=30, help="layers (SmolLM2-135M: 30)")
    parser.add_argument("--kv-heads", type=int, default=3, help="KV heads (SmolLM2-135M: 3)")
    parser.add_argument("--head-dim", type=int, default=64, help="head dimension (SmolLM2-135M: 64)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds (medians are reported)")
    parser.add_argument("--warm-layout", default="auto", choices=("auto", "paged", "records"),
                        help="config warm.layout (auto: paged on a CPU store)")
    parser.add_argument("--engine", default="auto", choices=("auto", "sync", "thread"), help="config copies.engine")
    parser.add_argument("--sub-batch-mib", type=float, default=None,
                        help="on-demand sub-batch size (store.demand; 0: a plan as one batch); default: the store's")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the blocks' random bytes")
    parser.add_argument("--json", default=None, metavar="PATH", help="write all results to this JSON file")
    parser.add_argument("--commit", default=None, help="the commit measured, for the JSON (default: this checkout's HEAD)")
    args = parser.parse_args(argv)
    for name in ("blocks", "layers", "kv_heads", "head_dim", "block_size", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.threads < 0:
        parser.error("--threads must be 0 or more")
    return args


class CopyTimer:
    """Seconds spent inside BlockCopier's byte copies (the outermost call only), while installed."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._depth = 0
        self._saved = {}

    def __enter__(self) -> "CopyTimer":
        for name in ("copy", "direct", "staged"):
            real = getattr(BlockCopier, name)
            self._saved[name] = real
            setattr(BlockCopier, name, self._timed(real))
        return self

    def _timed(self, real):
        def timed(copier, *args, **kwargs):
            self._depth += 1
            start = time.perf_counter()
            try:
                return real(copier, *args, **kwargs)
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self.seconds += time.perf_counter() - start
        return timed

    def __exit__(self, *exc) -> None:
        for name, real in self._saved.items():
            setattr(BlockCopier, name, real)


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).resolve().parents[1],
                              capture_output=True, text=True, timeout=10).stdout.strip() or None
    except OSError:
        return None


def _fingerprints(store, block_ids: list[int]) -> list[int]:
    """crc32 of each block's bytes, wherever it lies."""
    tiers, slots = store.placements(block_ids)
    out = []
    for tier, slot in zip(tiers.tolist(), slots.tolist()):
        block = store.tiers[tier].slots_view()[slot].contiguous()
        out.append(zlib.crc32(block.view(-1).view(torch.uint8).numpy()))
    return out


def _timed(fn, blocks: int, timer: CopyTimer | None = None) -> dict:
    gc.collect()
    copy_before = timer.seconds if timer is not None else 0.0
    cpu0, wall0 = time.thread_time(), time.perf_counter()
    fn()
    wall, cpu = time.perf_counter() - wall0, time.thread_time() - cpu0
    row = {"wall_s": wall, "thread_cpu_s": cpu}
    if timer is not None:
        row["in_copy_s"] = timer.seconds - copy_before
    return row


def run(args: argparse.Namespace) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    layout = KVLayout(num_layers=args.layers, num_kv_heads=args.kv_heads, head_dim=args.head_dim,
                      block_size=args.block_size, dtype_name="float32")
    store = tiered_kv.TierStore({
        "block_size": args.block_size,
        "hot": {"device": "cpu", "capacity_blocks": args.blocks, "high_watermark": 1.0, "low_watermark": 1.0},
        "warm": {"capacity_blocks": args.blocks, "pinned": False, "layout": args.warm_layout,
                 "high_watermark": 1.0, "low_watermark": 1.0},
        "cold": {"capacity_blocks": 0},
        "scheduler": {"background": False},
        "copies": {"engine": args.engine}})
    try:
        store.bind(layout, torch.float32)
        if args.sub_batch_mib is not None:  # (a store without sub-batches ignores it)
            if hasattr(store.demand, "sub_batch_blocks"):
                store.demand.sub_batch_blocks = int(args.sub_batch_mib * 2**20 // layout.block_bytes)
        sub_batch_blocks = getattr(store.demand, "sub_batch_blocks", None)
        block_ids = store.allocate(args.blocks)
        hot_view, warm_view = store.tiers[HOT].slots_view(), store.tiers[WARM].slots_view()
        store.tiers[HOT].slab.normal_(generator=torch.Generator().manual_seed(args.seed))  # seeded bytes
        before = _fingerprints(store, block_ids)
        hot_slab, warm_slab = store.tiers[HOT].slab, store.tiers[WARM].slab
        paged_both = hot_slab.shape == warm_slab.shape

        def plain_down():  # the blocks are hot; the warm slab is free
            (warm_slab.copy_(hot_slab) if paged_both else warm_view.copy_(hot_view))

        def plain_up():  # the same bytes back: hot keeps what it held
            (hot_slab.copy_(warm_slab) if paged_both else hot_view.copy_(warm_view))

        def store_down():
            assert store.demote(block_ids, WARM) == []

        def store_up():
            assert store.promote(block_ids) == []

        samples = {side: {d: [] for d in DIRECTIONS} for side in ("store", "plain")}
        load_before = list(os.getloadavg())
        with CopyTimer() as timer:
            for r in range(-1, args.rounds):  # round -1: warm-up, not counted
                order = ("store", "plain") if r % 2 == 0 else ("plain", "store")
                for side in order:
                    down, up = (store_down, store_up) if side == "store" else (plain_down, plain_up)
                    t = timer if side == "store" else None
                    rows = (_timed(down, args.blocks, t), _timed(up, args.blocks, t))
                    if side == "store":
                        tiers, _ = store.placements(block_ids)
                        assert (tiers == HOT).all(), "every block is back in hot after a round"
                    if r >= 0:
                        for direction, row in zip(DIRECTIONS, rows):
                            samples[side][direction].append(row)
        load_after = list(os.getloadavg())
        intact = _fingerprints(store, block_ids) == before
        problems = store.check_consistency()
        moved_bytes = store.stats()["bytes_moved"]
    finally:
        store.close()

    directions = {}
    for direction in DIRECTIONS:
        store_rows, plain_rows = samples["store"][direction], samples["plain"][direction]
        median = lambda rows, key: statistics.median(row[key] for row in rows)  # noqa: E731
        store_wall, plain_wall = median(store_rows, "wall_s"), median(plain_rows, "wall_s")
        own = statistics.median(row["wall_s"] - row["in_copy_s"] for row in store_rows)
        pairs = list(zip(store_rows, plain_rows))  # (the same round's, back to back)
        directions[direction] = {
            "store_wall_s": store_wall,
            "plain_wall_s": plain_wall,
            "ratio": statistics.median(p["wall_s"] / s["wall_s"] for s, p in pairs),
            "ratio_of_medians": plain_wall / store_wall,
            "store_in_copy_s": median(store_rows, "in_copy_s"),
            "store_own_s_per_block": own / args.blocks,
            "beyond_plain_s_per_block": statistics.median(s["wall_s"] - p["wall_s"] for s, p in pairs) / args.blocks,
            "store_thread_cpu_s": median(store_rows, "thread_cpu_s"),
            "plain_thread_cpu_s": median(plain_rows, "thread_cpu_s"),
            "store_gbps": layout.block_bytes * args.blocks / store_wall / 1e9,
            "plain_gbps": layout.block_bytes * args.blocks / plain_wall / 1e9,
            "store_wall_samples_s": [row["wall_s"] for row in store_rows],
            "plain_wall_samples_s": [row["wall_s"] for row in plain_rows],
        }
    summary = {
        "ratio_target": RATIO_TARGET,
        "store_s_per_block_target": STORE_S_PER_BLOCK_TARGET,
        "ratio_met": all(directions[d]["ratio"] >= RATIO_TARGET for d in DIRECTIONS),
        "store_time_met": all(directions[d]["store_own_s_per_block"] <= STORE_S_PER_BLOCK_TARGET for d in DIRECTIONS),
        "bytes_intact": intact,
        "consistent": problems == [],
    }
    return {
        "bench": "moves",
        "commit": args.commit or _git_commit(),
        "argv": sys.argv[1:],
        "blocks": args.blocks,
        "layout": {"layers": args.layers, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
                   "block_size": args.block_size, "dtype": "float32", "block_bytes": layout.block_bytes},
        "warm_layout": args.warm_layout,
        "engine": args.engine,
        "sub_batch_blocks": sub_batch_blocks,
        "rounds": args.rounds,
        "seed": args.seed,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "load_average_before": load_before,
        "load_average_after": load_after,
        "store_bytes_moved": {k: v for k, v in moved_bytes.items() if k in DIRECTIONS},
        "directions": directions,
        "consistency_problems": problems,
        "summary": summary,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    for direction, row in result["directions"].items():
        print(f"{direction}: store {row['store_wall_s'] * 1e3:8.2f} ms ({row['store_gbps']:.2f} GB/s)  plain "
              f"{row['plain_wall_s'] * 1e3:8.2f} ms ({row['plain_gbps']:.2f} GB/s)  ratio {row['ratio']:.3f}  "
              f"store own {row['store_own_s_per_block'] * 1e6:.2f} us/block  beyond plain "
              f"{row['beyond_plain_s_per_block'] * 1e6:.2f} us/block")
    print(f"load average before {result['load_average_before']}, after {result['load_average_after']}; "
          f"summary {result['summary']}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["summary"]["bytes_intact"] and result["summary"]["consistent"] else 1


if __name__ == "__main__":
    sys.exit(main())
