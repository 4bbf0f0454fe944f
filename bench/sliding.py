#!/usr/bin/env python
"""Sliding-window hybrid models (issue 18): memory, decode speed and next-turn TTFT against DynamicCache.

A Gemma-3-shaped random-weight model (5 sliding-window layers to 1 full, SmolLM2's widths by
default), one chat of `--context` seeded random tokens, prefilled once into a DynamicCache (the
baseline, its sliding layers keeping `window - 1` tokens) and once into a CacheBank whose hot
tier holds the chat. Reported:

  memory   the bank's `stats()["kv_bytes"]`: bytes per layer type, and their share of what one
           DynamicLayer per layer would hold (issue target: ~1/6 + 5/6 * window/context)
  decode   greedy decode steps right after the prefill, DynamicCache and bank alternated step by
           step (`--rounds` x `--decode-steps` each); per-step medians, their ratio (target >= 1.0x)
  ttft     the next turn (`--turn-tokens` new tokens, one step): a DynamicCache kept in memory
           against the bank after `offload("cold")` sent its history to the cold tier (the turn's
           step brings it up, then prefills and gives the first token; target: within 1.5x)

Every round checks that both caches produce the same tokens (`tokens_equal`).

    python bench/sliding.py --json bench/results/sliding_cpu.json     # 4k context, window 512
    python bench/sliding.py --tiny --rounds 1                         # smoke size
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
from transformers import DynamicCache, Gemma3ForCausalLM, Gemma3TextConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import tiered_kv  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--context", type=int, default=4096, help="tokens of history")
    p.add_argument("--window", type=int, default=512, help="sliding window of the sliding layers")
    p.add_argument("--layers", type=int, default=30, help="decoder layers (every 6th is full attention)")
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--decode-steps", type=int, default=8, help="decode steps per cache per round")
    p.add_argument("--turn-tokens", type=int, default=32, help="new tokens of the next turn (ttft)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--tiny", action="store_true", help="smoke size: 256 tokens, window 32, 6 small layers")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    if args.tiny:
        args.context, args.window, args.layers, args.hidden, args.heads, args.kv_heads, args.head_dim = \
            256, 32, 6, 64, 4, 2, 16
        args.vocab, args.decode_steps, args.turn_tokens = 256, 4, 8
    return args


def build_model(args):
    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
                              num_hidden_layers=args.layers, num_attention_heads=args.heads,
                              num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
                              sliding_window=args.window, query_pre_attn_scalar=args.head_dim,
                              max_position_embeddings=max(8192, 2 * args.context))
    model = Gemma3ForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    return model


def bank_config(args, cold_dir: str, model) -> dict:
    bytes_per_token_layer = 2 * args.kv_heads * args.head_dim * 4
    full_kv = (args.context + args.decode_steps * args.rounds + 4 * args.turn_tokens) * args.layers \
        * bytes_per_token_layer
    return {"block_size": args.block_size,
            "hot": {"device": "cpu", "capacity": int(full_kv * 1.1)},  # all hot, as a kept DynamicCache
            "warm": {"capacity": int(full_kv * 0.1)},
            "cold": {"capacity": int(full_kv * 1.1), "path": cold_dir}}


@torch.no_grad()
def step(model, cache, ids: torch.Tensor) -> torch.Tensor:
    """One forward over `ids` through `cache`; the greedy next token, `[1, 1]`."""
    out = model(input_ids=ids, cache=cache, use_cache=True)
    return out.logits[:, -1:].argmax(-1)


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    model = build_model(args)
    generator = torch.Generator().manual_seed(1)
    context = torch.randint(3, args.vocab, (1, args.context), generator=generator)
    result = {"args": vars(args), "load_avg_before": os.getloadavg()}
    with tempfile.TemporaryDirectory() as cold_dir:
        bank = tiered_kv.CacheBank(model, bank_config(args, cold_dir, model))
        dynamic = DynamicCache(config=model.config)
        t0 = time.perf_counter()
        next_dyn = step(model, dynamic, context)
        result["prefill_dynamic_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        next_bank = step(model, bank, context)
        result["prefill_bank_s"] = time.perf_counter() - t0
        equal = bool(torch.equal(next_dyn, next_bank))
        kv = bank.stats()["kv_bytes"]
        result["memory"] = {**kv, "share_of_full": kv["total"] / kv["full_attention_equivalent"],
                            "expected_share": 1 / 6 + 5 / 6 * min(1.0, args.window / args.context)
                            if args.layers % 6 == 0 else None}
        decode_dyn, decode_bank, ttft_dyn, ttft_bank = [], [], [], []
        for _ in range(args.rounds * args.decode_steps):  # decode steps, alternated step by step
            t0 = time.perf_counter()
            next_dyn = step(model, dynamic, next_dyn)
            decode_dyn.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            next_bank = step(model, bank, next_bank)
            decode_bank.append(time.perf_counter() - t0)
            equal &= bool(torch.equal(next_dyn, next_bank))
        for _ in range(args.rounds):
            # the next turn: new tokens over the history; the bank's history all in cold first
            turn = torch.randint(3, args.vocab, (1, args.turn_tokens), generator=generator)
            bank.offload("cold")
            result.setdefault("cold_blocks_before_turn", []).append(bank.stats()["bank_blocks"]["cold"])
            t0 = time.perf_counter()
            next_dyn = step(model, dynamic, torch.cat([next_dyn, turn], 1))
            ttft_dyn.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            next_bank = step(model, bank, torch.cat([next_bank, turn], 1))
            ttft_bank.append(time.perf_counter() - t0)
            equal &= bool(torch.equal(next_dyn, next_bank))
        bank.close()
    med = statistics.median
    result["decode"] = {"dynamic_ms": 1e3 * med(decode_dyn), "bank_ms": 1e3 * med(decode_bank),
                        "bank_vs_dynamic": med(decode_dyn) / med(decode_bank)}
    result["ttft"] = {"dynamic_kept_s": med(ttft_dyn), "bank_from_cold_s": med(ttft_bank),
                      "bank_over_dynamic": med(ttft_bank) / med(ttft_dyn)}
    result["tokens_equal"] = equal
    result["load_avg_after"] = os.getloadavg()
    print(json.dumps({k: result[k] for k in ("memory", "decode", "ttft", "tokens_equal")}, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
