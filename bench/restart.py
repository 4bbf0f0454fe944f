#!/usr/bin/env python
"""Restart benchmark: a new process reattaches a conversation from the cold tier vs recomputing it.

Each phase is this script in a new process (`--phase`): build (once) prefills `--context-tokens`
through a CacheBank with 2 hot and 2 warm blocks (cold.fsync true), offloads it to cold, closes
bank and store (the block file stays) and exits; reattach (a new bank on the same cold.path, hot
room for everything) times `attach(ids)` + `generate(ids + --new-tokens, max_new_tokens=1)`: the
time to first token (TTFT); recompute times the same generate on a fresh DynamicCache. The two
alternate (ABBA) `--repeats` times; the block file's page cache is dropped before each reattach,
and each repeat reads it with `dd bs=4M iflag=direct` (the raw device's sequential direct read).
Medians are reported; the first generated token must be equal everywhere (else exit status 2).

    python bench/restart.py                                         # SmolLM2, 4,096 tokens
    python bench/restart.py --tiny --context-tokens 64 --repeats 1  # smoke test size
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# measure the tiered_kv of this checkout, not whichever one an editable install points at
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
TTFT_TARGET_RATIO, TTFT_TARGET_CONTEXT_TOKENS, READ_TARGET_RATIO = 20.0, 4096, 0.8
SPILL_BLOCKS = 2  # hot and warm capacity while building: the history has to go to cold
FORWARDED = ("context_tokens", "new_tokens", "block_size", "threads", "seed")  # to every phase process


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default=None, help="local HF model folder or .gguf (default: bundled SmolLM2)")
    parser.add_argument("--tiny", action="store_true", help="tiny random-weight Llama instead of a real model")
    parser.add_argument("--context-tokens", type=int, default=4096, help="tokens of the stored conversation")
    parser.add_argument("--new-tokens", type=int, default=16, help="user tokens added after the restart")
    parser.add_argument("--repeats", type=int, default=3, help="reattach/recompute process pairs (medians)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--cold-dir", default=None, help="cold-tier directory (default: a fresh temp dir, removed)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--seed", type=int, default=0, help="seed for the tiny model and random ids")
    parser.add_argument("--json", default=None, metavar="PATH", help="write all results to this JSON file")
    parser.add_argument("--phase", choices=("build", "reattach", "recompute"), help=argparse.SUPPRESS)
    parser.add_argument("--phase-json", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if min(args.context_tokens, args.new_tokens, args.repeats, args.block_size) < 1 or args.threads < 0:
        parser.error("--context-tokens, --new-tokens, --repeats and --block-size must be >= 1, --threads >= 0")
    if args.tiny and args.model:
        parser.error("--tiny and --model exclude each other")
    return args


# ---- the three phases, each in its own process -------------------------------------------------
def run_phase(args) -> dict:
    import torch
    from transformers import DynamicCache

    import tiered_kv
    from bench.multiturn import TokenTimer, TurnMaker, load
    from tiered_kv.blocks import num_blocks_for

    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    model, tokenizer, _ = load(args)
    load_s = time.perf_counter() - started
    maker = TurnMaker(tokenizer, model.config.vocab_size, args.seed)
    device = str(model.device)
    history = maker.next_turn(args.context_tokens, first=True).to(device)
    ids = torch.cat([history, maker.next_turn(args.new_tokens, first=False).to(device)], 1)
    num_blocks = num_blocks_for(ids.shape[1] + 1, args.block_size) + 4  # the same cold file size in every phase

    def config(hot_blocks: int, warm_blocks: int, cold_blocks: int) -> dict:
        return {"block_size": args.block_size, "hot": {"device": device, "capacity_blocks": hot_blocks},
                "warm": {"capacity_blocks": warm_blocks},
                "cold": {"capacity_blocks": cold_blocks, "path": args.cold_dir, "fsync": True}}

    def generate(prompt, cache):  # -> (ids out, time of the first new token)
        timer = TokenTimer()
        out = model.generate(prompt, cache=cache, attention_mask=torch.ones_like(prompt), max_new_tokens=1,
                             min_new_tokens=1, do_sample=False, streamer=timer)
        return out, timer.times[1]

    if args.phase == "build":
        bank = tiered_kv.CacheBank(model, config(SPILL_BLOCKS, SPILL_BLOCKS, num_blocks))
        start = time.perf_counter()
        generate(history, bank)
        blocks = bank.offload("cold")
        build_s = time.perf_counter() - start
        bank.close()
        bank.store.close()  # idempotent; keeps the block files
        return {"phase": "build", "load_s": load_s, "build_s": build_s, "bank_blocks_before_close": blocks}
    # the same first-call warm-up in both timed phases (its bank has no cold tier)
    warm_ids = maker.next_turn(48, first=True)
    generate(warm_ids, DynamicCache(config=model.config))
    warm_bank = tiered_kv.CacheBank(model, config(num_blocks, 0, 0))
    generate(warm_ids, warm_bank)
    warm_bank.close()
    bank = tiered_kv.CacheBank(model, config(num_blocks, 0, num_blocks)) if args.phase == "reattach" else None
    cache = bank if bank is not None else DynamicCache(config=model.config)
    gc.collect()
    start = time.perf_counter()
    reused = bank.attach(ids) if bank is not None else 0
    attach_s = time.perf_counter() - start
    promoted_bytes = bank.stats()["bytes_moved"]["cold->hot"] if bank is not None else 0  # not timed:
    paused_s = time.perf_counter() - start - attach_s  # taken out of the TTFT below
    out, first_token_time = generate(ids, cache)
    result = {"phase": args.phase, "load_s": load_s, "context_tokens": ids.shape[1], "reused_tokens": reused,
              "attach_s": attach_s, "ttft_s": first_token_time - start - paused_s,
              "first_token": int(out[0, ids.shape[1]]), "cold_to_hot_bytes_at_attach": promoted_bytes}
    if bank is not None:
        stats = bank.stats()
        result.update(cold_to_hot_bytes=stats["bytes_moved"]["cold->hot"], bank_blocks_after=stats["bank_blocks"])
        bank.close()
        bank.store.close()
    return result


# ---- the parent: processes, page cache, dd ------------------------------------------------------
def run_child(args, phase: str, workdir: str) -> dict:
    out_path = os.path.join(workdir, f"{phase}-{time.monotonic_ns()}.json")
    argv = [sys.executable, str(Path(__file__).resolve()), "--phase", phase, "--phase-json", out_path,
            *(["--tiny"] if args.tiny else []), *(["--model", args.model] if args.model else []), "--cold-dir",
            args.cold_dir, *(f"--{k.replace('_', '-')}={getattr(args, k)}" for k in FORWARDED)]
    started = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"bench: the {phase} process exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    with open(out_path, encoding="utf-8") as f:
        return {**json.load(f), "process_s": time.perf_counter() - started}


def drop_page_cache(path: str) -> None:
    with open(path, "rb", buffering=0) as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def raw_read(path: str) -> dict:
    """Sequential read of the whole file: dd with O_DIRECT, else buffered after dropping its cache."""
    proc = subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=4M", "iflag=direct"], capture_output=True,
                          text=True, env={**os.environ, "LC_ALL": "C"})
    found = re.search(r"^(\d+) bytes.* copied, ([0-9.e+-]+) s", proc.stderr, re.M)
    if proc.returncode == 0 and found and float(found[2]) > 0:
        return {"method": "dd iflag=direct", "bytes": int(found[1]), "bytes_per_s": int(found[1]) / float(found[2])}
    drop_page_cache(path)
    num_bytes, buffer = 0, bytearray(4 * 2**20)
    started = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            num_bytes += n
    return {"method": "buffered read after POSIX_FADV_DONTNEED", "bytes": num_bytes,
            "bytes_per_s": num_bytes / (time.perf_counter() - started), "dd_error": proc.stderr.strip()[-300:]}


def median_of(rows: list[dict], key: str):
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def run_parent(args) -> int:
    load_before, started = os.getloadavg(), time.perf_counter()
    own_cold_dir = args.cold_dir is None
    args.cold_dir = tempfile.mkdtemp(prefix="tiered_kv-restart-") if own_cold_dir else os.path.abspath(args.cold_dir)
    workdir = tempfile.mkdtemp(prefix="tiered_kv-restart-results-")
    print(f"restart bench: {args.context_tokens} + {args.new_tokens} tokens, {args.repeats} repeats, "
          f"cold dir {args.cold_dir}; load average {load_before[0]:.1f} on {os.cpu_count()} cores", flush=True)
    try:
        build = run_child(args, "build", workdir)
        files = {str(p): p.stat().st_size for p in sorted(Path(args.cold_dir).glob("*.blocks")) if p.is_file()}
        print(f"build: {build['build_s']:.2f} s, blocks before close {build['bank_blocks_before_close']}, "
              f"block files after exit {files}", flush=True)
        if not files:
            raise SystemExit(f"bench: no block file is left in {args.cold_dir} after the build process exited")
        block_file = max(files, key=files.get)
        rows, reads = [], []
        for repeat in range(args.repeats):
            for phase in ("reattach", "recompute") if repeat % 2 == 0 else ("recompute", "reattach"):
                if phase == "reattach":
                    for path in files:
                        drop_page_cache(path)
                row = {**run_child(args, phase, workdir), "repeat": repeat}
                if row["cold_to_hot_bytes_at_attach"] and row["attach_s"] > 0:
                    row["cold_read_bytes_per_s"] = row["cold_to_hot_bytes_at_attach"] / row["attach_s"]
                rows.append(row)
                print(f"  repeat {repeat} {phase:>9}: TTFT {row['ttft_s']:.3f} s, reused {row['reused_tokens']}, "
                      f"first token {row['first_token']}", flush=True)
            reads.append(raw_read(block_file))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        if own_cold_dir:
            shutil.rmtree(args.cold_dir, ignore_errors=True)
    summary = summarize(args, rows, reads)
    wall_s, load_after = time.perf_counter() - started, os.getloadavg()
    print_table(rows, reads, summary)
    busy = max(load_before[0], load_after[0]) > (os.cpu_count() or 1) + 0.5
    print(f"wall time {wall_s:.0f} s; load average {load_before[0]:.1f} before, {load_after[0]:.1f} after on "
          f"{os.cpu_count()} cores" + (" (other jobs shared the cores: timings are noisy)" if busy else ""))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "cpu_count": os.cpu_count(), "load_average_before": load_before,
                       "load_average_after": load_after, "build": build, "block_files": files, "runs": rows,
                       "raw_reads": reads, "summary": summary, "wall_s": wall_s}, f, indent=2)
    if not summary["first_tokens_equal"]:
        print("ERROR: the first generated token differs between reattach and recompute", file=sys.stderr)
        return 2
    return 0


def summarize(args, rows: list[dict], reads: list[dict]) -> dict:
    reattach, recompute = ([r for r in rows if r["phase"] == phase] for phase in ("reattach", "recompute"))
    ttft_reattach, ttft_recompute = median_of(reattach, "ttft_s"), median_of(recompute, "ttft_s")
    ratio = ttft_recompute / ttft_reattach
    cold_read = median_of(reattach, "cold_read_bytes_per_s")
    raw = statistics.median(r["bytes_per_s"] for r in reads)
    read_ratio = cold_read / raw if cold_read else None
    return {
        "ttft_reattach_s": ttft_reattach, "ttft_recompute_s": ttft_recompute, "ttft_ratio": ratio,
        "attach_s": median_of(reattach, "attach_s"), "reused_tokens": [r["reused_tokens"] for r in reattach],
        "reused_tokens_min": min(r["reused_tokens"] for r in reattach),
        "first_tokens_equal": len({r["first_token"] for r in rows}) == 1,
        "cold_read_bytes_per_s": cold_read, "raw_read_bytes_per_s": raw, "raw_read_method": reads[0]["method"],
        "cold_read_ratio": read_ratio,
        "ttft_target": {"target": f">= {TTFT_TARGET_RATIO:g}x at {TTFT_TARGET_CONTEXT_TOKENS} tokens", "met":
                        ratio >= TTFT_TARGET_RATIO if args.context_tokens >= TTFT_TARGET_CONTEXT_TOKENS else None},
        "read_target": {"target": f">= {READ_TARGET_RATIO:g}x raw sequential direct read",
                        "met": None if read_ratio is None else read_ratio >= READ_TARGET_RATIO},
    }


def print_table(rows: list[dict], reads: list[dict], s: dict) -> None:
    def gbs(value):
        return "-" if value is None else f"{value / 1e9:.2f} GB/s"

    print(f"\n{'repeat':>6} {'phase':>9} {'reused':>6} {'attach s':>9} {'TTFT s':>8} {'first tok':>9} "
          f"{'cold->hot MiB':>13} {'cold read':>11} {'raw read':>11}")
    for row in rows:
        promoted_mib = row["cold_to_hot_bytes_at_attach"] / 2**20
        print(f"{row['repeat']:>6} {row['phase']:>9} {row['reused_tokens']:>6} {row['attach_s']:>9.3f} "
              f"{row['ttft_s']:>8.3f} {row['first_token']:>9} {promoted_mib:>13.1f} "
              f"{gbs(row.get('cold_read_bytes_per_s')):>11} {gbs(reads[row['repeat']]['bytes_per_s']):>11}")
    verdict = {True: "MET", False: "NOT MET", None: "not judged"}  # None: too short, or nothing promoted
    print(f"\nmedian TTFT: reattach {s['ttft_reattach_s']:.3f} s, recompute {s['ttft_recompute_s']:.3f} s -> "
          f"{s['ttft_ratio']:.1f}x (target {s['ttft_target']['target']}: {verdict[s['ttft_target']['met']]}); "
          f"tokens reused {s['reused_tokens']}")
    print(f"cold read {gbs(s['cold_read_bytes_per_s'])} vs raw {gbs(s['raw_read_bytes_per_s'])} "
          f"({s['raw_read_method']}) -> " + (f"{s['cold_read_ratio']:.2f}x (target {s['read_target']['target']}: "
                                               f"{verdict[s['read_target']['met']]})" if s["cold_read_ratio"]
                                               else "not measured: attach promoted nothing from cold"))
    print(f"first generated token equal in every process: {'yes' if s['first_tokens_equal'] else 'NO'}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.phase is None:
        return run_parent(args)
    result = run_phase(args)
    with open(args.phase_json, "w", encoding="utf-8") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
