#!/usr/bin/env python
"""The cache's own per-step cost: decode step time of an all-hot CacheBank beside DynamicCache.

The model has SmolLM2-135M's KV shape (30 layers, 9 heads, 3 KV heads, head_dim 64, fp32: 46 KiB
of KV per token) but almost no compute (hidden size 72, vocab 256, random weights), so a decode
step is mostly the cache's work: appending one token and handing every layer its whole K/V.

Per context C, the caches are filled directly with the same seeded random K/V
(`cache.update(k, v, layer)` in chunks, every layer per chunk, so a bank sees whole steps):
  * alone    - a CacheBank alone in its TierStore;
  * idle<N>  - a CacheBank in a TierStore that also holds N other chats' blocks
               (`--idle-tokens-per-chat` each), as a server with many open chats has, for each N
               of `--idle-chats` (a comma-separated list); the mover runs as configured by default;
  * dynamic  - transformers' DynamicCache (appends with torch.cat, copying the layer each step).
All stores are configured alike (all hot, the hot tier twice what it holds, so no watermark is
crossed and the background mover has nothing to do but look; 2,000 idle chats of 64 tokens take
12 GB of RAM). Each round times `--steps`
one-token forwards `model(ids, cache=cache)` per cache, then crops back to C; rounds rotate the
order of the caches. Reported: median per-step seconds, DynamicCache step / bank step (>1: the bank
is faster) and the slowdown of a step caused by the idle chats.

    python bench/overhead.py                                   # 2k, 8k, 32k; 50 idle chats
    python bench/overhead.py --contexts 1024 --idle-chats 400,2000 --idle-tokens-per-chat 64   # many idle chats
    python bench/overhead.py --contexts 64 --idle-chats 2 --rounds 1 --steps 2   # smoke size
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

# measure the tiered_kv of this checkout, not whichever one an editable install points at
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import tiered_kv  # noqa: E402

SPEED_TARGET_RATIO, SPEED_TARGET_CONTEXT_TOKENS = 1.5, 32768
IDLE_TARGET_SLOWDOWN, IDLE_TARGET_CONTEXT_TOKENS = 0.05, 2048


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--contexts", default="2048,8192,32768", help="context lengths in tokens, comma-separated")
    parser.add_argument("--idle-chats", default="50",
                        help="other chats holding blocks in an 'idle' store, comma-separated: one store per count")
    parser.add_argument("--idle-tokens-per-chat", type=int, default=512, help="tokens of KV per idle chat")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per cache (the median is reported)")
    parser.add_argument("--steps", type=int, default=8, help="decode steps per round")
    parser.add_argument("--chunk-tokens", type=int, default=1024, help="tokens per update() when filling a cache")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--seed", type=int, default=0, help="seed for the weights and the random K/V")
    parser.add_argument("--json", default=None, metavar="PATH", help="write all results to this JSON file")
    args = parser.parse_args(argv)
    try:
        args.context_tokens = [int(c) for c in args.contexts.split(",")]
    except ValueError:
        parser.error(f"--contexts: got {args.contexts!r}; allowed: comma-separated token counts like 2048,8192")
    try:
        args.idle_counts = [int(c) for c in str(args.idle_chats).split(",")]
    except ValueError:
        parser.error(f"--idle-chats: got {args.idle_chats!r}; allowed: comma-separated chat counts like 400,2000")
    if min(args.idle_counts) < 1 or len(set(args.idle_counts)) != len(args.idle_counts):
        parser.error(f"--idle-chats: got {args.idle_chats!r}; each count must be at least 1 and appear once")
    for name in ("idle_tokens_per_chat", "rounds", "steps", "chunk_tokens", "block_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if min(args.context_tokens) < 1 or args.threads < 0:
        parser.error("--contexts must be positive and --threads 0 or more")
    return args


def build_model(seed: int, max_tokens: int) -> LlamaForCausalLM:
    """SmolLM2-135M's KV shape with next to no compute."""
    torch.manual_seed(seed)
    # hidden_size must be a multiple of the 9 heads; head_dim stays 64 explicitly
    config = LlamaConfig(vocab_size=256, hidden_size=72, intermediate_size=128, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                         max_position_embeddings=max_tokens)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    return model


def make_bank(model, cfg: dict, store: tiered_kv.TierStore) -> tiered_kv.CacheBank:
    return tiered_kv.CacheBank(model, cfg, store=store)


class MoverClock:
    """CPU seconds the store's background mover spends in its passes (its own thread's time, so
    what the machine's other load does is not counted): the cost idle chats put on a busy one."""

    def __init__(self, store):
        self.cpu_s = 0.0
        mover = store.mover
        if mover is None:
            return
        one_batch = mover._one_batch

        def timed():
            start = time.thread_time()
            try:
                return one_batch()
            finally:
                self.cpu_s += time.thread_time() - start

        mover._one_batch = timed


def fill(caches: list, num_tokens: int, model_config, chunk_tokens: int, seed: int) -> None:
    """Append `num_tokens` of seeded random K/V to every cache: the same tensors to each."""
    generator = torch.Generator().manual_seed(seed)
    shape = (1, model_config.num_key_value_heads, 0, model_config.head_dim)
    for start in range(0, num_tokens, chunk_tokens):
        chunk_shape = (*shape[:2], min(chunk_tokens, num_tokens - start), shape[3])
        for layer in range(model_config.num_hidden_layers):
            k, v = torch.randn(chunk_shape, generator=generator), torch.randn(chunk_shape, generator=generator)
            for cache in caches:
                cache.update(k, v, layer)


def measure_context(model, context_tokens: int, args) -> dict:
    """Fill the three caches to `context_tokens`, then time rounds of decode steps."""
    block_size, seed = args.block_size, args.seed + context_tokens
    bank_blocks = math.ceil((context_tokens + args.steps) / block_size)
    idle_names = [f"idle{n}" for n in args.idle_counts]
    idle_blocks = {name: n * math.ceil(args.idle_tokens_per_chat / block_size)
                   for name, n in zip(idle_names, args.idle_counts)}

    def config_for(blocks: int) -> dict:  # the hot tier half empty: under every watermark, room to grow
        return {"block_size": block_size, "hot": {"device": "cpu", "capacity_blocks": 2 * blocks + 2},
                "warm": {"capacity": 0}, "cold": {"capacity": 0}}

    configs = {"alone": config_for(bank_blocks)}
    configs.update({name: config_for(bank_blocks + idle_blocks[name]) for name in idle_names})
    stores = {name: tiered_kv.TierStore(cfg) for name, cfg in configs.items()}
    started = time.perf_counter()
    idle_banks = []
    for name, count in zip(idle_names, args.idle_counts):  # the other chats were there first
        banks = [make_bank(model, configs[name], stores[name]) for _ in range(count)]
        for i, bank in enumerate(banks):
            fill([bank], args.idle_tokens_per_chat, model.config, args.chunk_tokens, seed + 1 + i)
        idle_banks += banks
    caches = {name: make_bank(model, configs[name], store) for name, store in stores.items()}
    caches["dynamic"] = DynamicCache(config=model.config)
    names = list(caches)
    bank_names = [n for n in names if n != "dynamic"]
    fill(list(caches.values()), context_tokens, model.config, args.chunk_tokens, seed)
    for store in stores.values():
        store.wait_for_background(60)
    fill_s = time.perf_counter() - started
    ids = torch.randint(0, model.config.vocab_size, (1, 1), generator=torch.Generator().manual_seed(seed))
    samples_s = {name: [] for name in names}
    clocks = {name: MoverClock(store) for name, store in stores.items()}
    mover_cpu_s = {name: 0.0 for name in stores}
    with torch.no_grad():
        # warm-up step per cache (first-call costs stay out); its logits must agree
        logits = {name: model(input_ids=ids, cache=cache, use_cache=True).logits for name, cache in caches.items()}
        for cache in caches.values():
            cache.crop(-1)
        max_logit_diff = max((logits[n] - logits["dynamic"]).abs().max().item() for n in bank_names)
        for round_idx in range(args.rounds):
            shift = round_idx % len(names)
            for name in names[shift:] + names[:shift]:
                cache = caches[name]
                gc.collect()
                cpu_before = clocks[name].cpu_s if name in clocks else 0.0
                start = time.perf_counter()
                for _ in range(args.steps):
                    model(input_ids=ids, cache=cache, use_cache=True)
                samples_s[name].append((time.perf_counter() - start) / args.steps)
                if name in clocks:
                    mover_cpu_s[name] += clocks[name].cpu_s - cpu_before
                cache.crop(-args.steps)
    step_s = {name: statistics.median(values) for name, values in samples_s.items()}
    row = {
        "context_tokens": context_tokens, "fill_s": fill_s, "hot_capacity_blocks": {n: s.capacities[0] for n, s in stores.items()},
        "bank_blocks": {n: caches[n].stats()["bank_blocks"] for n in bank_names},
        "store_used_blocks": {n: stores[n].stats()["tiers"]["hot"]["used_blocks"] for n in stores},
        "max_logit_diff": max_logit_diff, "logits_match": max_logit_diff <= 1e-4,
        "dynamic_step_s": step_s["dynamic"], "dynamic_samples_s": samples_s["dynamic"],
        "stores": {n: {"bank_step_s": step_s[n], "bank_samples_s": samples_s[n],
                       "speed_ratio": step_s["dynamic"] / step_s[n]} for n in bank_names},
        "idle_slowdown": {n: step_s[n] / step_s["alone"] - 1 for n in idle_names},
        "mover_batches": {n: stores[n].mover.num_batches if stores[n].mover else 0 for n in stores},
        # the mover's CPU time while its bank's steps ran, per step
        "mover_cpu_ms_per_step": {n: 1e3 * mover_cpu_s[n] / (args.rounds * args.steps) for n in stores},
    }
    for bank in [*(caches[n] for n in bank_names), *idle_banks]:
        bank.close()
    for store in stores.values():
        store.close()
    del caches, idle_banks, stores, logits
    gc.collect()
    return row


def summarize(rows: list[dict]) -> dict:
    by_context = {r["context_tokens"]: r for r in rows}
    speed = by_context.get(SPEED_TARGET_CONTEXT_TOKENS)
    idle = by_context.get(IDLE_TARGET_CONTEXT_TOKENS)
    speed_ratio = speed["stores"]["alone"]["speed_ratio"] if speed else None
    return {
        "speed_target": {"target": f"bank decode >= {SPEED_TARGET_RATIO}x DynamicCache at "
                                   f"{SPEED_TARGET_CONTEXT_TOKENS} tokens", "ratio": speed_ratio,
                         "met": None if speed is None else speed_ratio >= SPEED_TARGET_RATIO},
        "idle_target": {"target": f"idle chats slow a step by <= {IDLE_TARGET_SLOWDOWN:.0%} at "
                                  f"{IDLE_TARGET_CONTEXT_TOKENS} tokens",
                        "slowdown": max(idle["idle_slowdown"].values()) if idle else None,
                        "met": None if idle is None else max(idle["idle_slowdown"].values()) <= IDLE_TARGET_SLOWDOWN},
        "logits_match_everywhere": all(r["logits_match"] for r in rows),
    }


def print_table(rows: list[dict], summary: dict, args) -> None:
    print(f"\nmedian per-step ms over {args.rounds} rounds x {args.steps} steps; ratio = DynamicCache step / "
          f"bank step (>1: bank faster); idleN = the bank's store also holds N chats x "
          f"{args.idle_tokens_per_chat} tokens; slowdown = idleN step / alone step - 1; mover = the "
          f"background mover's CPU ms per step while that bank stepped")
    idle_names = [f"idle{n}" for n in args.idle_counts]
    print(f"{'context':>8} {'DC ms':>8} {'alone ms':>9} {'ratio':>6} "
          + " ".join(f"{n + ' ms':>11} {'slowdown':>9} {'mover':>6}" for n in idle_names) + f" {'logits':>6}")
    for r in rows:
        alone = r["stores"]["alone"]
        print(f"{r['context_tokens']:>8} {r['dynamic_step_s'] * 1e3:>8.2f} {alone['bank_step_s'] * 1e3:>9.2f} "
              f"{alone['speed_ratio']:>5.2f}x "
              + " ".join(f"{r['stores'][n]['bank_step_s'] * 1e3:>11.2f} {r['idle_slowdown'][n]:>+8.1%} "
                         f"{r['mover_cpu_ms_per_step'][n]:>6.3f}" for n in idle_names)
              + f" {'same' if r['logits_match'] else 'DIFFER':>6}")
    verdict = {True: "MET", False: "NOT MET", None: "not measured"}
    s, i = summary["speed_target"], summary["idle_target"]
    print(f"target: {s['target']}: " + (f"{s['ratio']:.2f}x -> " if s["ratio"] else "") + verdict[s["met"]])
    print(f"target: {i['target']}: " + (f"{i['slowdown']:+.1%} -> " if i["slowdown"] is not None else "")
          + verdict[i["met"]])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    started = time.perf_counter()
    model = build_model(args.seed, max(args.context_tokens) + 2 * args.steps + 2)
    print(f"{torch.get_num_threads()} torch threads, {os.cpu_count()} cores, load average "
          f"{load_before[0]:.1f}; contexts {args.context_tokens}", flush=True)
    rows = []
    for context_tokens in args.context_tokens:
        rows.append(measure_context(model, context_tokens, args))
        r = rows[-1]
        print(f"  {context_tokens} tokens: filled in {r['fill_s']:.1f} s, DC {r['dynamic_step_s'] * 1e3:.2f} ms, "
              f"bank alone {r['stores']['alone']['bank_step_s'] * 1e3:.2f} ms, "
              + ", ".join(f"{n} {r['stores'][n]['bank_step_s'] * 1e3:.2f} ms" for n in r["idle_slowdown"]), flush=True)
    summary = summarize(rows)
    wall_s, load_after = time.perf_counter() - started, os.getloadavg()
    print_table(rows, summary, args)
    print(f"wall time {wall_s:.0f} s; load average {load_before[0]:.1f} before, {load_after[0]:.1f} after "
          f"on {os.cpu_count()} cores")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"cpu_count": os.cpu_count(), "threads": torch.get_num_threads(),
                       "load_average_before": load_before, "load_average_after": load_after,
                       "torch": torch.__version__, "args": vars(args), "contexts": rows, "summary": summary,
                       "wall_s": wall_s}, f, indent=2)
    if not summary["logits_match_everywhere"]:
        print("ERROR: a bank's logits differ from DynamicCache's (see the table)", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
