#!/usr/bin/env python
"""Paged-attention hooks on SmolLM2: decode speed and next-turn time to first token, per tier split.

One model, one context of `--context` seeded random tokens, prefilled once with a DynamicCache;
every cache below is filled from that prefill's K/V (cache.update per layer), so all of them hold
identical history and must produce identical tokens (checked, reported as `tokens_equal`).

decode cases (each timed round: generate `--decode-tokens` greedy tokens continuing the context,
then crop back; rounds interleave the cases, medians reported):
  dynamic        DynamicCache (the baseline)
  bank           CacheBank, everything hot, no hooks
  hooks          CacheBank, everything hot, hooks installed (exact)
  split-nohooks  hot = `--hot-share` of the chat's KV, the rest warm, no hooks
  split-exact    same split, hooks exact (hot and warm history gathered by one index per layer)
  split-merge    same split, hooks merge (hot part read in place, partials merged by LSE)
ttft cases (each round: the next turn's `--turn-tokens` new tokens over the history, one generated
token, then the bank is cut back to the history):
  ttft-dynamic   a DynamicCache kept across turns (ideal in-memory reuse)
  ttft-nohooks / ttft-hooks / ttft-merge   hot and warm each `--low-share` of the history, the rest cold

    python bench/hooks.py --json out.json                      # 4k context, the issue's targets
    python bench/hooks.py --tiny --rounds 1                    # smoke size (random tiny model)
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
from tiered_kv import hooks  # noqa: E402
from tiered_kv.blocks import num_blocks_for  # noqa: E402

DECODE_CASES = ("dynamic", "bank", "hooks", "split-nohooks", "split-exact", "split-merge")
TTFT_CASES = ("ttft-dynamic", "ttft-nohooks", "ttft-hooks", "ttft-merge")
HOOK_MODE = {"hooks": "exact", "split-exact": "exact", "split-merge": "merge", "ttft-hooks": "exact",
             "ttft-merge": "merge"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--context", type=int, default=4096, help="tokens of history")
    p.add_argument("--decode-tokens", type=int, default=16, help="greedy tokens per timed decode round")
    p.add_argument("--turn-tokens", type=int, default=32, help="new tokens of the next turn (ttft cases)")
    p.add_argument("--hot-share", type=float, default=0.25, help="hot capacity / one chat's KV (split cases)")
    p.add_argument("--low-share", type=float, default=0.05, help="hot and warm capacity / history (ttft cases)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--cases", default=",".join(DECODE_CASES + TTFT_CASES))
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--tiny", action="store_true", help="a random 2-layer model (smoke test size)")
    p.add_argument("--json", default=None, metavar="PATH")
    return p.parse_args(argv)


def load(tiny: bool):
    if tiny:
        from transformers import LlamaConfig, LlamaForCausalLM
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 0
        return model.eval(), 256
    from tiered_kv.models import load_model
    model, tokenizer = load_model(progress=False, device="cpu")
    model.generation_config.eos_token_id = None  # every round decodes the same number of tokens
    return model, len(tokenizer)


def bank_config(blocks_total: int, hot_blocks: int, warm_blocks: int, cold_blocks: int, cold_dir: str, bs: int):
    return {"block_size": bs, "hot": {"device": "cpu", "capacity_blocks": hot_blocks},
            "warm": {"capacity_blocks": warm_blocks}, "cold": {"capacity_blocks": cold_blocks, "path": cold_dir},
            "scheduler": {"background": False}}


def fill(cache, past: DynamicCache) -> None:
    for layer, (k, v) in enumerate(zip(past.layers, past.layers)):
        cache.update(k.keys, v.values, layer)


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.manual_seed(0)
    cases = [c for c in args.cases.split(",") if c]
    model, vocab = load(args.tiny)
    n, bs = args.context, args.block_size
    ids = torch.randint(3, vocab, (1, n + args.turn_tokens + 1), generator=torch.Generator().manual_seed(1))
    history = ids[:, :n]
    with torch.no_grad():
        past = DynamicCache()
        model(history, cache=past, use_cache=True)
    blocks = num_blocks_for(n + args.turn_tokens + args.decode_tokens + 2, bs)
    tmp = tempfile.mkdtemp(prefix="tkv-hooks-bench-")
    caches = {}
    for case in cases:
        if case in ("dynamic", "ttft-dynamic"):
            cache = DynamicCache()
        else:
            if case in ("bank", "hooks"):
                sizes = (blocks + 8, 0, 0)
            elif case.startswith("split"):
                sizes = (max(2, int(blocks * args.hot_share)), blocks + 8, 0)
            else:
                low = max(2, int(num_blocks_for(n, bs) * args.low_share))
                sizes = (low, low, blocks + 8)
            cfg = bank_config(blocks, *sizes, os.path.join(tmp, case), bs)
            cache = tiered_kv.CacheBank(model, cfg)
        fill(cache, past)
        caches[case] = cache
    del past

    def run(case: str):
        cache = caches[case]
        mode = HOOK_MODE.get(case)
        if mode is not None:
            hooks.install(model, cache, mode=mode)
        try:
            if case.startswith("ttft"):
                inputs, new = ids[:, :n + args.turn_tokens], 1
            else:
                inputs, new = ids[:, :n + 1], args.decode_tokens
            start = time.perf_counter()
            out = model.generate(inputs, cache=cache, max_new_tokens=new, do_sample=False)
            seconds = time.perf_counter() - start
        finally:
            hooks.uninstall(model)
        stats = cache.stats() if hasattr(cache, "stats") else None
        cache.crop(n - cache.get_seq_length()) if isinstance(cache, DynamicCache) else cache.truncate(n)
        return seconds, out[:, inputs.shape[1]:], new, stats

    samples = {case: [] for case in cases}
    outputs, last_stats = {}, {}
    load_avg = []
    for r in range(args.rounds):
        order = cases if r % 2 == 0 else list(reversed(cases))
        for case in order:
            seconds, tokens, new, stats = run(case)
            samples[case].append(seconds if case.startswith("ttft") else new / seconds)
            outputs.setdefault(case, tokens)
            last_stats[case] = stats
        load_avg.append(os.getloadavg()[0])
    med = {case: statistics.median(v) for case, v in samples.items()}

    def ratio(a, b):
        return med[a] / med[b] if a in med and b in med else None

    result = {
        "context_tokens": n, "decode_tokens": args.decode_tokens, "turn_tokens": args.turn_tokens,
        "rounds": args.rounds, "block_size": bs,
        "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(), "tiny": args.tiny, "load_average": load_avg,
        "decode_tokens_per_s": {c: med[c] for c in cases if not c.startswith("ttft")},
        "ttft_s": {c: med[c] for c in cases if c.startswith("ttft")},
        "samples": samples,
        "ratios": {
            "hooks_vs_dynamic": ratio("hooks", "dynamic"),  # target >= 1.0
            "bank_vs_dynamic": ratio("bank", "dynamic"),
            "split_exact_vs_all_hot_hooks": ratio("split-exact", "hooks"),  # target >= 0.9
            "split_merge_vs_all_hot_hooks": ratio("split-merge", "hooks"),
            "split_nohooks_vs_all_hot_bank": ratio("split-nohooks", "bank"),
            "ttft_hooks_vs_dynamic": ratio("ttft-hooks", "ttft-dynamic"),  # target <= 1.25
            "ttft_merge_vs_dynamic": ratio("ttft-merge", "ttft-dynamic"),
            "ttft_nohooks_vs_dynamic": ratio("ttft-nohooks", "ttft-dynamic"),
        },
        "tokens_equal": {c: torch.equal(outputs[c], outputs["dynamic" if not c.startswith("ttft") else "ttft-dynamic"])
                         for c in cases if ("dynamic" in cases and not c.startswith("ttft"))
                         or ("ttft-dynamic" in cases and c.startswith("ttft"))},
        "hooks_stats": {c: s["hooks"] for c, s in last_stats.items() if s},
        "bank_blocks": {c: s["bank_blocks"] for c, s in last_stats.items() if s},
    }
    for cache in caches.values():
        if hasattr(cache, "close"):
            cache.close()
    print(json.dumps({k: result[k] for k in ("decode_tokens_per_s", "ttft_s", "ratios", "tokens_equal",
                                             "load_average")}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
