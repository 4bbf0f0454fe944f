#!/usr/bin/env python
"""Load or recompute (issue 22): `scheduler.restore: auto` against always restoring and always
recomputing, on a slow and a fast cold tier; and a turn's own moves with and without background load.

  restore     per prefix length (`--prefixes`, short and long) and cold tier (throttled to
              `--cold-mbps` MB/s, a disk under contention; and as it is), a chat's history sits in
              cold; each round a new bank attaches it and generates the first token of a
              `--turn-tokens` turn, once with `restore: always`, once with `auto`, and the same
              prompt is prefilled into a fresh DynamicCache (recompute). Rounds rotate the order.
              One warm-up restore first measures the cold tier's rate (auto decides from rates the
              store measured itself). Reported: median TTFT of each, auto / min(always, recompute)
              (target <= 1.1), and how many tokens auto restored.
  background  a chat's turn promotes its history from warm while other chats' prefetches keep the
              mover busy (background load) and with the mover idle, on the sync and the thread copy
              engine; the turn's critical-path move seconds (bank.stats()["critical_path"]) and
              TTFT, medians over rounds (target: background load costs the turn nothing).

Every run checks the first token against the recompute's (a restore never changes it).

    python bench/restore.py --json bench/results/restore_cpu.json     # SmolLM2
    python bench/restore.py --tiny --rounds 1                         # smoke size
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import tiered_kv  # noqa: E402
from tiered_kv.blocks import COLD  # noqa: E402

TARGET_RATIO = 1.1


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="local HF model folder or .gguf (default: bundled SmolLM2)")
    p.add_argument("--tiny", action="store_true", help="smoke size: a tiny random Llama")
    p.add_argument("--prefixes", default="256,2048", help="history lengths in tokens, comma-separated")
    p.add_argument("--turn-tokens", type=int, default=16, help="new tokens of the measured turn")
    p.add_argument("--cold-mbps", type=float, default=20.0, help="the throttled cold tier's read rate, MB/s")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--background-chats", type=int, default=4, help="chats prefetched while the measured turn runs")
    p.add_argument("--background-tokens", type=int, default=512, help="history of each chat in the background section")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--sections", default="restore,background")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.tiny:
        args.prefixes, args.turn_tokens, args.background_chats, args.background_tokens = "32,96", 4, 2, 64
        args.block_size = 4
    args.prefix_list = [int(x) for x in args.prefixes.split(",") if x.strip()]
    args.section_list = [s.strip() for s in args.sections.split(",") if s.strip()]
    return args


def load(args):
    if args.tiny:
        from bench.multiturn import build_tiny_model
        return build_tiny_model(0)
    from tiered_kv.models import load_model

    model, _ = load_model(args.model, progress=False)
    return model


def ids_of(model, num_tokens: int, seed: int) -> torch.Tensor:
    return torch.randint(3, model.config.vocab_size, (1, num_tokens), generator=torch.Generator().manual_seed(seed))


def first_token(model, prompt: torch.Tensor, cache) -> tuple[int, float]:
    """(first generated token, seconds from before attach to it)."""
    start = time.perf_counter()
    if isinstance(cache, tiered_kv.CacheBank):
        cache.attach(prompt)
    with torch.no_grad():
        out = model.generate(prompt, cache=cache, attention_mask=torch.ones_like(prompt), max_new_tokens=1,
                             min_new_tokens=1, do_sample=False)
    return int(out[0, -1]), time.perf_counter() - start


def throttle_cold(store, mb_per_s: float) -> None:
    """Cold reads take at least bytes / (mb_per_s MB/s): a disk under contention (a harness, here)."""
    cold = store.tiers[COLD]
    real = cold.read_blocks
    block_bytes = cold.layout.block_bytes

    def slow(slots, *args, **kwargs):
        start = time.perf_counter()
        out = real(slots, *args, **kwargs)
        left = len(slots) * block_bytes / (mb_per_s * 1e6) - (time.perf_counter() - start)
        if left > 0:
            time.sleep(left)
        return out
    cold.read_blocks = slow


def store_config(args, cold_dir: str, mode: str, blocks: int, background: bool = False, engine: str = "auto") -> dict:
    return {"block_size": args.block_size,
            "hot": {"device": "cpu", "capacity_blocks": blocks, "high_watermark": 1.0, "low_watermark": 1.0},
            "warm": {"capacity_blocks": 2}, "cold": {"capacity_blocks": blocks, "path": cold_dir, "write_behind_s": 0},
            "scheduler": {"restore": mode, "background": background}, "copies": {"engine": engine}}


def section_restore(model, args, workdir: str) -> dict:
    out = {}
    for mbps in (args.cold_mbps, None):
        for prefix in args.prefix_list:
            history = ids_of(model, prefix, 1)

            def prompt_of(r: int) -> torch.Tensor:  # a new message every round: only the history is stored
                return torch.cat([history, ids_of(model, args.turn_tokens, 100 + r)], 1)
            blocks = 2 * (prefix + args.turn_tokens) // args.block_size + 8
            stores = {}
            for mode in ("always", "auto"):
                store = tiered_kv.TierStore(store_config(args, os.path.join(workdir, f"r-{mbps}-{prefix}-{mode}"),
                                                         mode, blocks))
                keeper = tiered_kv.CacheBank(model, store=store)
                with torch.no_grad():
                    model(input_ids=history, cache=keeper, use_cache=True)  # the history, and a prefill rate
                if mbps is not None:
                    throttle_cold(store, mbps)
                keeper.offload("cold")
                warm_up = tiered_kv.CacheBank(model, store=store)
                first_token(model, prompt_of(-1), warm_up)  # one restore: the store measures its cold tier's rate
                warm_up.close()
                stores[mode] = (store, keeper)
            times, tokens, restored = {"always": [], "auto": [], "recompute": []}, {}, {}
            for r in range(args.rounds):
                prompt = prompt_of(r)
                order = ["always", "auto", "recompute"]
                order = order[r % 3:] + order[:r % 3]
                for system in order:
                    if system == "recompute":
                        token, seconds = first_token(model, prompt, DynamicCache(config=model.config))
                    else:
                        store, keeper = stores[system]
                        keeper.offload("cold")  # the history back in cold (the last round brought it up)
                        bank = tiered_kv.CacheBank(model, store=store)
                        token, seconds = first_token(model, prompt, bank)
                        restored[system] = bank.stats()["restore"]
                        bank.close()
                    times[system].append(seconds)
                    tokens.setdefault(r, set()).add(token)
            row = {system: statistics.median(ts) for system, ts in times.items()}
            best = min(row["always"], row["recompute"])
            row.update(auto_vs_best=row["auto"] / best, target_met=row["auto"] / best <= TARGET_RATIO,
                       tokens_equal=all(len(t) == 1 for t in tokens.values()),
                       auto_restore_stats=restored.get("auto"), rounds=args.rounds)
            out[f"{'cold_' + str(int(mbps)) + 'MBps' if mbps else 'cold_unthrottled'}/prefix{prefix}"] = row
            for store, keeper in stores.values():
                keeper.close()
                store.close()
    out["target_met"] = all(v["target_met"] for v in out.values() if isinstance(v, dict))
    return out


def section_background(model, args, workdir: str) -> dict:
    out = {}
    tokens = args.background_tokens
    for engine in ("sync", "thread"):
        rows = {"idle": [], "busy": []}
        for r in range(args.rounds):
            for load_kind in (("idle", "busy") if r % 2 == 0 else ("busy", "idle")):
                blocks_per_chat = tokens // args.block_size + 4
                cfg = {"block_size": args.block_size,
                       "hot": {"device": "cpu", "capacity_blocks": 2 * blocks_per_chat},
                       "warm": {"capacity_blocks": (args.background_chats + 2) * blocks_per_chat},
                       "cold": {"capacity_blocks": 0, "path": os.path.join(workdir, f"b-{engine}-{r}-{load_kind}")},
                       "scheduler": {"mover_interval_s": 0.001}, "copies": {"engine": engine}}
                store = tiered_kv.TierStore(cfg)
                chats = []
                with torch.no_grad():
                    for c in range(args.background_chats + 1):
                        bank = tiered_kv.CacheBank(model, store=store)
                        model(input_ids=ids_of(model, tokens, 10 + c), cache=bank, use_cache=True)
                        bank.offload("warm")
                        chats.append(bank)
                store.wait_for_background(60)
                measured, others = chats[0], chats[1:]
                if load_kind == "busy":
                    for bank in others:  # the mover is busy bringing these up while the turn starts
                        bank.prefetch()
                before = measured.stats()["critical_path"]["move_s"]
                prompt = torch.cat([ids_of(model, tokens, 10), ids_of(model, args.turn_tokens, 99)], 1)
                _, ttft = first_token(model, prompt, measured)
                rows[load_kind].append({"move_s": measured.stats()["critical_path"]["move_s"] - before, "ttft_s": ttft})
                store.wait_for_background(60)
                for bank in chats:
                    bank.close()
                store.close()
        out[engine] = {kind: {"move_s": statistics.median(x["move_s"] for x in v),
                              "ttft_s": statistics.median(x["ttft_s"] for x in v)} for kind, v in rows.items()}
        out[engine]["busy_over_idle_ttft"] = out[engine]["busy"]["ttft_s"] / out[engine]["idle"]["ttft_s"]
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.manual_seed(0)
    model = load(args)
    model.generation_config.eos_token_id = None
    result = {"model": "tiny random Llama" if args.tiny else (args.model or "SmolLM2-135M-Instruct (bundled)"),
              "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
              "load_average_before": os.getloadavg()}
    with tempfile.TemporaryDirectory(prefix="tiered_kv-bench-restore-") as workdir:
        for name in args.section_list:
            started = time.perf_counter()
            if name == "restore":
                result[name] = section_restore(model, args, workdir)
            elif name == "background":
                result[name] = section_background(model, args, workdir)
            else:
                raise SystemExit(f"bench: unknown section {name!r}; allowed: restore, background")
            result[name]["seconds"] = time.perf_counter() - started
            print(f"[{name}] {json.dumps(result[name], default=str)}", flush=True)
    result["load_average_after"] = os.getloadavg()
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str) + "\n")
    return result


if __name__ == "__main__":
    main()
