#!/usr/bin/env python
"""Block size: decode speed, bytes moved between tiers and wasted slots per block size, on a short
and a long chat (bundled SmolLM2-135M-Instruct, CacheBank, greedy generate).

Per block size (`--block-sizes`, default 8,16,32) one config, the same bytes for every size:
  hot  = `--hot-share` (default 1/4) of the long chat's KV, so the long chat spills and its decode
         reads warm blocks (the short chat fits hot);
  warm = room for the rest of the long chat and all its decode rounds; cold off.
Each chat's first C-1 tokens (C = `--short-tokens` or `--long-tokens`, chat-template text from
bench/multiturn.py) are prefilled once into a DynamicCache, the baseline (`--no-baseline` leaves
it out of the rounds); each (block size, chat) gets its own CacheBank (and store) with that config,
holding the same K/V, written per layer in one step as a prefill writes it.
Then the chats continue for `--rounds` rounds, block sizes interleaved (8 16 32 [DC] 8 16 32 [DC]
...): each round every cache generates `--decode-tokens` + 1 greedy tokens from where its
conversation stands (no crop: a crop would hand back the blocks a decode took and hide the moves
of a growing chat); the store is settled (wait_for_background) before each timed decode.
Reported per (block size, chat):
  * decode tok/s: tokens after the first / time after the first (streamer timestamps), the median
    over rounds;
  * bytes moved between tiers per decoded token over all rounds (bank.stats()["bytes_moved"], all
    directions; "on demand" = the part on the critical path, bytes_on_demand) and block moves
    per 100 tokens. A prefill writes what hot cannot hold straight into warm and a decode reads
    warm blocks in place, so moves are mostly demotions as new blocks enter a full hot tier;
    beside them the bytes read in place from warm per token (warm hits x block bytes);
  * wasted slots: allocated token slots (the bank's blocks in every tier x block size) minus its
    tokens, as a share of the slots, after the prefill and the mean after each round (read from
    the bank), beside the mean a chat of that length wastes over a block's worth of lengths
    ((block size - 1) / 2 slots);
  * which block size `block_size: auto` picks for that context with the default classes.
Greedy tokens must be identical for every block size and the DynamicCache (exit status 2 if not).

    python bench/blocksize.py                                # SmolLM2, short 300 / long 3000 tokens
    python bench/blocksize.py --long-tokens 4000 --block-sizes 16,32 --json /tmp/bs.json
    python bench/blocksize.py --tiny                         # tiny random Llama: smoke-test size
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

# measure the tiered_kv of this checkout, not whichever one an editable install points at
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import tiered_kv  # noqa: E402
from tiered_kv.blocks import layout_from_model_config, num_blocks_for  # noqa: E402
from tiered_kv.config import BlockSizeAutoConfig  # noqa: E402

CHATS = ("short", "long")
SIZES = {"short_tokens": 300, "long_tokens": 3000, "decode_tokens": 24, "rounds": 5}
TINY_SIZES = {"short_tokens": 40, "long_tokens": 160, "decode_tokens": 4, "rounds": 2}  # --tiny


def _load_multiturn():
    spec = importlib.util.spec_from_file_location("bench_multiturn", Path(__file__).resolve().parent / "multiturn.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


multiturn = _load_multiturn()  # TurnMaker (exact-length chat turns), timed_generate, the tiny model


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--block-sizes", default="8,16,32", help="comma-separated block sizes (powers of two)")
    for name, text in (("short_tokens", "context of the short chat"), ("long_tokens", "context of the long chat"),
                       ("decode_tokens", "tokens generated per timed decode"),
                       ("rounds", "interleaved rounds (medians are reported)")):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None,
                            help=f"{text} (default {SIZES[name]}; with --tiny {TINY_SIZES[name]})")
    parser.add_argument("--hot-share", type=float, default=0.25, help="hot tier, as a share of the long chat's KV")
    parser.add_argument("--max-seconds", type=float, default=0.0,
                        help="start no new round after this many seconds of the run (0: no limit); "
                             "the rounds done are reported")
    parser.add_argument("--no-baseline", action="store_true", help="skip the DynamicCache baseline")
    parser.add_argument("--tiny", action="store_true",
                        help="tiny random Llama and smoke-test sizes (explicit options still win)")
    parser.add_argument("--model", default=None, help="local HF model folder or .gguf (default: bundled SmolLM2)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--seed", type=int, default=0, help="seed for the tiny model and the chat text offsets")
    parser.add_argument("--json", default=None, metavar="PATH", help="write all results to this JSON file")
    args = parser.parse_args(argv)
    if args.tiny and args.model:
        parser.error("--tiny and --model exclude each other")
    for name, value in (TINY_SIZES if args.tiny else SIZES).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    try:
        args.sizes = [int(s) for s in args.block_sizes.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--block-sizes: got {args.block_sizes!r}; allowed: comma-separated powers of two, e.g. 8,16,32")
    if not args.sizes or len(set(args.sizes)) != len(args.sizes) or any(s < 1 or s & (s - 1) for s in args.sizes):
        parser.error(f"--block-sizes: got {args.block_sizes!r}; allowed: distinct powers of two, e.g. 8,16,32")
    for name in ("short_tokens", "long_tokens", "decode_tokens", "rounds"):
        if getattr(args, name) < (2 if name.endswith("_tokens") else 1):
            parser.error(f"--{name.replace('_', '-')} must be at least {2 if name.endswith('_tokens') else 1}")
    if not args.short_tokens < args.long_tokens:
        parser.error("--short-tokens must be below --long-tokens")
    if not 0 < args.hot_share < 1 or args.threads < 0 or args.max_seconds < 0:
        parser.error("--hot-share must be between 0 and 1 (exclusive); --threads and --max-seconds >= 0")
    return args


def load(args):
    """(model, tokenizer or None, name), greedy generation that never stops early."""
    if args.tiny:
        return multiturn.build_tiny_model(args.seed), None, "tiny random Llama"
    from tiered_kv.models import load_model

    model, tokenizer = load_model(args.model, progress=False)
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.eos_token_id
    model.generation_config.eos_token_id = None  # every decode the full length
    return model, tokenizer, args.model or "SmolLM2-135M-Instruct (bundled)"


def tier_config(block_size: int, args, device: str) -> dict:
    """The same hot and warm bytes for every block size: hot a share of the long chat, warm the rest."""
    hot_tokens = int(args.long_tokens * args.hot_share)
    all_tokens = args.long_tokens + (args.rounds + 1) * (args.decode_tokens + 1) + 2  # warm-up and rounds
    return {"block_size": block_size,
            "hot": {"device": device, "capacity_blocks": max(1, hot_tokens // block_size)},
            "warm": {"capacity_blocks": num_blocks_for(all_tokens, block_size) + 2},
            "cold": {"capacity": 0}}


def moved(bank) -> dict:
    """Bytes moved between tiers so far (all directions, on demand, background, per direction), and
    bytes read in place from warm: warm hits (a block read by a step) x block bytes."""
    stats = bank.stats()
    return {"total": sum(stats["bytes_moved"].values()), "on_demand": stats["bytes_on_demand"],
            "background": stats["bytes_background"], **stats["bytes_moved"],
            "warm_read": stats["hits"]["warm"] * bank.store.layout.block_bytes,
            "moves": stats["moves"]["promotions"] + stats["moves"]["demotions"] + stats["moves"]["evictions"]}


def waste(bank, block_size: int) -> dict:
    stats = bank.stats()
    slots = sum(stats["bank_blocks"].values()) * block_size
    tokens = stats["seq_tokens"]
    return {"tokens": tokens, "slots": slots, "wasted_slots": slots - tokens,
            "wasted_share": (slots - tokens) / slots if slots else 0.0, "blocks": stats["bank_blocks"]}


def mean_waste_share(context_tokens: int, block_size: int) -> float:
    """Wasted share of a chat near `context_tokens`, averaged over a block's worth of lengths."""
    wasted = (block_size - 1) / 2
    return wasted / (context_tokens + wasted)


def prepare(model, tokenizer, args) -> tuple[dict, dict]:
    """Each chat's ids and, per (cache name, chat), a cache holding all but its last token's KV.

    Each chat is prefilled once, into its DynamicCache (the baseline); every bank then gets those
    K/V tensors per layer in one update step, as a prefill forward would write them (a bank made
    from the model accepts updates outside a forward), so a run pays for one prefill per chat, not
    one per block size."""
    device = str(model.device)
    chat_ids = {chat: multiturn.TurnMaker(tokenizer, model.config.vocab_size, args.seed + i).next_turn(
        getattr(args, f"{chat}_tokens"), first=True).to(model.device) for i, chat in enumerate(CHATS)}
    names = [str(s) for s in args.sizes] + ([] if args.no_baseline else ["dynamic"])
    caches, prefill = {}, {}
    for chat, ids in chat_ids.items():
        dynamic = DynamicCache(config=model.config)
        started = time.perf_counter()
        with torch.no_grad():
            model(input_ids=ids[:, :-1], cache=dynamic, use_cache=True)
        prefill["dynamic", chat] = {"prefill_s": time.perf_counter() - started}
        print(f"  prefilled {chat:>5}: {ids.shape[1] - 1} tokens in {prefill['dynamic', chat]['prefill_s']:.1f} s",
              flush=True)
        for size in args.sizes:
            bank = tiered_kv.CacheBank(model, tier_config(size, args, device))
            started = time.perf_counter()
            with torch.no_grad():
                for layer_idx, layer in enumerate(dynamic.layers):
                    bank.update(layer.keys, layer.values, layer_idx)
            row = {"write_s": time.perf_counter() - started}
            bank.store.wait_for_background(10.0)
            row["moved_bytes"] = moved(bank)
            row["waste"] = waste(bank, size)
            caches[str(size), chat], prefill[str(size), chat] = bank, row
        if not args.no_baseline:
            caches["dynamic", chat] = dynamic
    caches = {(name, chat): caches[name, chat] for name in names for chat in CHATS}  # round order
    return chat_ids, {"caches": caches, "prefill": prefill, "names": names}


def decode_once(model, cache, ids: torch.Tensor, num_tokens: int, block_size: int | None) -> dict:
    """Continue the chat: the cache holds all of `ids` but the last token; generate `num_tokens` + 1
    tokens (the first computes the last id, `num_tokens` are timed). Afterwards the cache holds all
    of the returned `out` but its last token again, so `out` is the next call's `ids`."""
    bank = None if block_size is None else cache
    if bank is not None:
        bank.store.wait_for_background(5.0)  # moves from earlier rounds stay out of this one's counters
        before = moved(bank)
    result = multiturn.timed_generate(model, ids, cache, num_tokens + 1)
    row = {"decode_tok_s": result.decode_tok_s, "out": result.out, "context_tokens": ids.shape[1]}
    if bank is not None:
        after = moved(bank)
        row["moved_bytes"] = {k: after[k] - before[k] for k in after}
        row["waste"] = waste(bank, block_size)
    return row


def run(model, tokenizer, args, deadline: float) -> dict:
    chat_ids, prepared = prepare(model, tokenizer, args)
    caches, names = prepared["caches"], prepared["names"]
    ids = {key: chat_ids[key[1]] for key in caches}  # each cache's conversation so far
    samples = {key: [] for key in caches}
    tokens_match = {chat: True for chat in CHATS}

    def step(num_tokens: int) -> dict:
        rows = {}
        for name in names:  # A B C [DC] A B C [DC] ...
            for chat in CHATS:
                key = (name, chat)
                rows[key] = decode_once(model, caches[key], ids[key], num_tokens,
                                        None if name == "dynamic" else int(name))
                ids[key] = rows[key].pop("out")
        for chat in CHATS:  # every cache continued the same conversation
            first = ids[names[0], chat]
            tokens_match[chat] &= all(torch.equal(ids[name, chat], first) for name in names)
        return rows

    step(2)  # untimed warm-up: first-call costs stay out
    for round_idx in range(args.rounds):
        if round_idx and time.perf_counter() > deadline:
            print(f"  --max-seconds reached: {round_idx} of {args.rounds} rounds done", flush=True)
            break
        for key, row in step(args.decode_tokens).items():
            samples[key].append(row)
        print(f"  round {round_idx + 1}/{args.rounds}: " + ", ".join(
            f"{name}/{chat} {samples[name, chat][-1]['decode_tok_s']:.1f}" for name in names for chat in CHATS)
            + " tok/s", flush=True)
    rows = []
    auto = BlockSizeAutoConfig()
    rounds_done = len(next(iter(samples.values())))
    decoded_tokens = rounds_done * (args.decode_tokens + 1)
    for chat in CHATS:
        context = getattr(args, f"{chat}_tokens")
        dynamic = (statistics.median(r["decode_tok_s"] for r in samples["dynamic", chat])
                   if not args.no_baseline else None)
        for size in args.sizes:
            runs = samples[str(size), chat]
            rate = statistics.median(r["decode_tok_s"] for r in runs)
            config = tier_config(size, args, str(model.device))
            total = {k: sum(r["moved_bytes"][k] for r in runs) for k in runs[0]["moved_bytes"]}
            rows.append({
                "chat": chat, "block_size": size, "context_tokens": context,
                "round_context_tokens": [r["context_tokens"] for r in runs],
                "hot_capacity_blocks": config["hot"]["capacity_blocks"],
                "warm_capacity_blocks": config["warm"]["capacity_blocks"],
                "decode_tok_s": rate, "decode_samples_tok_s": [r["decode_tok_s"] for r in runs],
                "decode_dynamic_tok_s": dynamic, "decode_ratio": rate / dynamic if dynamic else None,
                "decoded_tokens": decoded_tokens,
                "moved_bytes_total": total,
                "moved_bytes_per_token": total["total"] / decoded_tokens,
                "on_demand_bytes_per_token": total["on_demand"] / decoded_tokens,
                "warm_read_bytes_per_token": total["warm_read"] / decoded_tokens,
                "moves_per_100_tokens": 100 * total["moves"] / decoded_tokens,
                "moved_bytes_samples": [r["moved_bytes"] for r in runs],
                "prefill": prepared["prefill"][str(size), chat],
                "waste_after_prefill": prepared["prefill"][str(size), chat]["waste"],
                "waste_after_rounds": [r["waste"] for r in runs],
                "wasted_share_mean": statistics.fmean(r["waste"]["wasted_share"] for r in runs),
                "mean_waste_share": mean_waste_share(context, size),
                "auto_pick": auto.pick(context), "tokens_match": tokens_match[chat],
            })
        if dynamic:
            rows.append({"chat": chat, "block_size": None, "context_tokens": context, "decode_tok_s": dynamic,
                         "decode_samples_tok_s": [r["decode_tok_s"] for r in samples["dynamic", chat]],
                         "prefill": prepared["prefill"]["dynamic", chat], "tokens_match": tokens_match[chat]})
    for (name, _), cache in caches.items():
        if name != "dynamic":
            cache.close()
    return {"rows": rows, "tokens_match": tokens_match, "rounds_done": rounds_done}


def print_table(rows: list[dict], args, rounds_done: int) -> None:
    print(f"\nthe chats continue for {rounds_done} interleaved rounds of {args.decode_tokens} timed decode tokens; "
          f"tok/s: median over rounds; hot = {args.hot_share:g} of the long chat's KV, warm the rest.\n"
          "KiB/tok: bytes moved between tiers per decoded token (on demand = on the critical path); "
          "moves/100: block moves per 100 tokens; warm rd: KiB read in place from warm per token; "
          "wasted: allocated slots - tokens as a share of slots, after prefill / mean after each round "
          "(mean: expected over lengths); auto: what block_size: auto picks for this context")
    print(f"{'chat':>5} {'ctx':>5} {'bs':>4} {'hot/warm':>9} {'tok/s':>7} {'vs DC':>6} {'KiB/tok':>8} "
          f"{'on dem.':>8} {'moves/100':>9} {'warm rd':>8} {'wasted prefill/rounds':>22} {'(mean)':>7} "
          f"{'auto':>4} tokens")
    for r in rows:
        if r["block_size"] is None:
            print(f"{r['chat']:>5} {r['context_tokens']:>5} {'DC':>4} {'':>9} {r['decode_tok_s']:>7.1f}")
            continue
        blocks = r["waste_after_rounds"][-1]["blocks"]
        ratio = "-" if r["decode_ratio"] is None else f"{r['decode_ratio']:.2f}x"
        print(f"{r['chat']:>5} {r['context_tokens']:>5} {r['block_size']:>4} "
              f"{str(blocks['hot']) + '/' + str(blocks['warm']):>9} {r['decode_tok_s']:>7.1f} {ratio:>6} "
              f"{r['moved_bytes_per_token'] / 1024:>8.1f} {r['on_demand_bytes_per_token'] / 1024:>8.1f} "
              f"{r['moves_per_100_tokens']:>9.1f} {r['warm_read_bytes_per_token'] / 1024:>8.0f} "
              f"{r['waste_after_prefill']['wasted_share']:>10.1%} / {r['wasted_share_mean']:>9.1%} "
              f"{r['mean_waste_share']:>7.1%} {r['auto_pick']:>4} {'same' if r['tokens_match'] else 'DIFFER'}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    started = time.perf_counter()
    model, tokenizer, model_name = load(args)
    gc.collect()
    gc.freeze()  # the model and the imports are not garbage: keep the collections before each decode short
    layout = layout_from_model_config(model.config, 1)
    print(f"model: {model_name} on {model.device}, {torch.get_num_threads()} threads, load average "
          f"{load_before[0]:.2f} on {os.cpu_count()} cores; block sizes {args.sizes}; chats {args.short_tokens} / "
          f"{args.long_tokens} tokens; KV {layout.bytes_per_token} bytes per token", flush=True)
    result = run(model, tokenizer, args, started + args.max_seconds if args.max_seconds else math.inf)
    wall_s, load_after = time.perf_counter() - started, os.getloadavg()
    print_table(result["rows"], args, result["rounds_done"])
    print(f"wall time {wall_s:.0f} s; load average {load_before[0]:.2f} before, {load_after[0]:.2f} after "
          f"(1/5/15 min {load_after[0]:.2f}/{load_after[1]:.2f}/{load_after[2]:.2f}) on {os.cpu_count()} cores")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"model": model_name, "device": str(model.device), "threads": torch.get_num_threads(),
                       "cpu_count": os.cpu_count(), "torch": torch.__version__,
                       "load_average_before": load_before, "load_average_after": load_after,
                       "kv_bytes_per_token": layout.bytes_per_token,
                       "auto_default_classes": [list(c) for c in BlockSizeAutoConfig().classes],
                       "args": {k: v for k, v in vars(args).items()}, **result, "wall_s": wall_s}, f, indent=2)
    if not all(result["tokens_match"].values()):
        print("ERROR: greedy tokens differ between block sizes or from DynamicCache", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
