#!/usr/bin/env python
"""What durability costs a decode step, in two experiments (`--experiment`, default both):

fsync: tokens/s of a decoding chat while another chat's verified blocks are pushed into the cold
tier and made durable, with `cold.fsync: true` vs `false` (below);

write_behind: tokens/s of a chat decoding right after its prefill, while write-behind gives that
prefill's published blocks (and each new full block) durable copies in cold, `cold.write_behind_s:
1` vs `0` (off), with an A/A control (off vs off) in the same rounds: per round the three runs in a
rotating order; medians. Target (issue 19): on/off >= 0.97 beside an A/A ratio that shows the noise.

Model: SmolLM2-135M's KV shape with almost no compute (bench/overhead.py's), so the cache's own
work shows. Per round and setting, a fresh store whose hot tier holds exactly chat A's context plus
chat B (B: `--idle-tokens` prefilled through the model, so its blocks are verified and published;
warm is 0). A then decodes `--decode-tokens` one-token steps; every 16 tokens its new block pushes
one of B's published blocks into cold, which persists it (data, fdatasync when fsync is on, index
row) on the cold tier's writer thread. Rounds alternate the two settings (A B A B ...); medians.

    python bench/durability.py                          # 2k context, 256 decode tokens, 3 rounds
    python bench/durability.py --experiment write_behind --rounds 5
    python bench/durability.py --context-tokens 64 --idle-tokens 64 --decode-tokens 32 --rounds 1   # smoke
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import tiered_kv  # noqa: E402
from bench.overhead import build_model, fill  # noqa: E402

BLOCK_SIZE = 16


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--context-tokens", type=int, default=2048, help="chat A's context before decoding")
    parser.add_argument("--idle-tokens", type=int, default=512, help="chat B's verified tokens (pushed to cold)")
    parser.add_argument("--decode-tokens", type=int, default=256, help="one-token steps of chat A per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per setting (medians)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--experiment", choices=("fsync", "write_behind", "both"), default="both")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the results here")
    return parser.parse_args(argv)


def one_round(model, args, fsync: bool, seed: int) -> dict:
    a_blocks = math.ceil(args.context_tokens / BLOCK_SIZE)
    b_blocks = args.idle_tokens // BLOCK_SIZE
    new_blocks = math.ceil(args.decode_tokens / BLOCK_SIZE) + 1
    with tempfile.TemporaryDirectory(prefix="tiered_kv-durability-") as cold_dir:
        cfg = {"block_size": BLOCK_SIZE, "hot": {"device": "cpu", "capacity_blocks": a_blocks + b_blocks + 1},
               "warm": {"capacity": 0},
               "cold": {"capacity_blocks": b_blocks + new_blocks + 8, "path": cold_dir, "fsync": fsync}}
        store = tiered_kv.TierStore(cfg)
        bank_b = tiered_kv.CacheBank(model, store=store)
        ids_b = torch.randint(0, model.config.vocab_size, (1, args.idle_tokens),
                              generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            model(ids_b, cache=bank_b)  # verified and published: these become durable in cold
        bank_a = tiered_kv.CacheBank(model, store=store)
        fill([bank_a], args.context_tokens, model.config, 1024, seed + 1)
        ids = torch.zeros((1, 1), dtype=torch.long)
        start = time.perf_counter()
        with torch.no_grad():
            for _ in range(args.decode_tokens):
                model(ids, cache=bank_a)
        decode_s = time.perf_counter() - start
        moved = store.stats()["bytes_moved"]["hot->cold"]
        flush_start = time.perf_counter()
        store.tiers[2].flush()  # what was still queued for durability when decoding ended
        flush_s = time.perf_counter() - flush_start
        bank_a.close()
        bank_b.close()
        store.close()
        return {"fsync": fsync, "tokens_per_s": args.decode_tokens / decode_s, "hot_to_cold_bytes": moved,
                "flush_after_s": flush_s}


def write_behind_round(model, args, write_behind_s: float, seed: int) -> dict:
    """Chat A prefills `--context-tokens` through the model (published) and decodes at once."""
    with tempfile.TemporaryDirectory(prefix="tiered_kv-write-behind-") as cold_dir:
        blocks = math.ceil((args.context_tokens + args.decode_tokens) / BLOCK_SIZE) + 2
        cfg = {"block_size": BLOCK_SIZE, "hot": {"device": "cpu", "capacity_blocks": blocks},
               "warm": {"capacity": 0},
               "cold": {"capacity_blocks": blocks, "path": cold_dir, "write_behind_s": write_behind_s}}
        store = tiered_kv.TierStore(cfg)
        bank = tiered_kv.CacheBank(model, store=store)
        generator = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, model.config.vocab_size, (1, args.context_tokens), generator=generator)
        with torch.no_grad():
            out = model(ids, cache=bank)
            token = out.logits[:, -1:].argmax(-1)
            start = time.perf_counter()
            for _ in range(args.decode_tokens):
                token = model(token, cache=bank).logits[:, -1:].argmax(-1)
            decode_s = time.perf_counter() - start
        copies = store.stats()["durability"]["copies_written"]
        store.flush()  # what write-behind still owed (none when it is off)
        after_flush = store.stats()["durability"]["copies_written"]
        bank.close()
        store.close()
        return {"write_behind_s": write_behind_s, "tokens_per_s": args.decode_tokens / decode_s,
                "copies_during_decode": copies, "copies_after_flush": after_flush}


def run_write_behind(model, args) -> dict:
    rows, settings = [], [("on", 1.0), ("off", 0.0), ("off_again", 0.0)]
    for round_index in range(args.rounds):
        order = settings[round_index % 3:] + settings[:round_index % 3]
        for name, interval in order:
            row = write_behind_round(model, args, interval, seed=200 + round_index)
            row.update(round=round_index, setting=name)
            rows.append(row)
            print(f"  round {round_index} write-behind {name:9}: {row['tokens_per_s']:.1f} tok/s, "
                  f"{row['copies_during_decode']} durable copies", flush=True)
    medians = {name: statistics.median(r["tokens_per_s"] for r in rows if r["setting"] == name)
               for name, _ in settings}
    result = {"rows": rows, "median_tokens_per_s": medians, "ratio_on_over_off": medians["on"] / medians["off"],
              "ratio_aa_off_again_over_off": medians["off_again"] / medians["off"]}
    print(f"decode right after a prefill, write-behind on {medians['on']:.1f} tok/s vs off {medians['off']:.1f} "
          f"tok/s -> {result['ratio_on_over_off']:.3f}x (target >= 0.97); A/A control (off vs off) "
          f"{result['ratio_aa_off_again_over_off']:.3f}x")
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model = build_model(0, args.context_tokens + args.decode_tokens + 16)
    load_before, started = os.getloadavg(), time.perf_counter()
    write_behind = run_write_behind(model, args) if args.experiment in ("write_behind", "both") else None
    if args.experiment == "write_behind":
        load_after = os.getloadavg()
        print(f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after, {os.cpu_count()} cores, "
              f"{time.perf_counter() - started:.0f} s")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "write_behind": write_behind,
                           "load_average": [load_before[0], load_after[0]]}, f, indent=2)
        return 0
    rows = []
    for round_index in range(args.rounds):
        for fsync in ((True, False) if round_index % 2 == 0 else (False, True)):
            row = one_round(model, args, fsync, seed=100 + round_index)
            row["round"] = round_index
            rows.append(row)
            print(f"  round {round_index} fsync={str(fsync).lower():5}: {row['tokens_per_s']:.1f} tok/s, "
                  f"{row['hot_to_cold_bytes'] / 2**20:.1f} MiB pushed to cold", flush=True)
    medians = {fsync: statistics.median(r["tokens_per_s"] for r in rows if r["fsync"] == fsync)
               for fsync in (True, False)}
    ratio = medians[True] / medians[False]
    load_after = os.getloadavg()
    print(f"decode with durable writes behind: fsync true {medians[True]:.1f} tok/s, false {medians[False]:.1f} "
          f"tok/s -> {ratio:.3f}x (target: no measurable cost); load average {load_before[0]:.1f} before, "
          f"{load_after[0]:.1f} after, {os.cpu_count()} cores, {time.perf_counter() - started:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "median_tokens_per_s": {str(k).lower(): v
                       for k, v in medians.items()}, "ratio_fsync_true_over_false": ratio,
                       "write_behind": write_behind, "load_average": [load_before[0], load_after[0]]}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
