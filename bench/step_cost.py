#!/usr/bin/env python
"""What one decode step costs the host: aten ops, Python calls and seconds, bank against DynamicCache.

On a GPU an eager decode step of a small model is host-bound (DESIGN.md: ~10.7 us of host time per
aten op on the H200), so every op and call the cache adds per layer is paid in full there. This bench
counts them on CPU with a model of SmolLM2-135M's KV shape (30 layers, 9 heads, 3 KV heads, head_dim
64) and almost no compute (hidden 180, vocab 256, random weights), where the counts are the same as on
a GPU and the time is mostly the cache's.

Cases (each cache holds the same `--context` tokens, prefilled through the model):
  dynamic         transformers' DynamicCache
  hot             CacheBank, all hot, no hooks
  hot-<mode>      all hot, tiered_kv.hooks installed in <mode> (exact / merge ...)
  spill           CacheBank, hot = `--hot-share` of the chat's blocks, the rest warm, no hooks
  spill-<mode>    the same split under the hooks in <mode>
Counted on one decode step `model(input_ids=tok, cache=cache)` after warm-up steps: aten ops (a
TorchDispatchMode that counts each dispatched op) and Python calls (sys.setprofile 'call' events).
Timed: `--steps` decode steps per round, rounds interleaved in rotating order, medians reported.

    python bench/step_cost.py --json bench/results/step_cost_cpu.json       # 4k, every case
    python bench/step_cost.py --context 64 --rounds 1 --steps 2              # smoke size
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import tiered_kv  # noqa: E402
from tiered_kv import hooks  # noqa: E402
from tiered_kv.blocks import num_blocks_for  # noqa: E402

HOOK_MODES = tuple(hooks.MODES)
CASES = ("dynamic", "hot", *(f"hot-{m}" for m in HOOK_MODES), "spill", *(f"spill-{m}" for m in HOOK_MODES))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--context", type=int, default=4096, help="tokens of history before the counted step")
    p.add_argument("--hot-share", type=float, default=0.25, help="hot capacity / the chat's blocks (spill cases)")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {','.join(CASES)}")
    p.add_argument("--rounds", type=int, default=7, help="timed rounds per case (medians reported)")
    p.add_argument("--steps", type=int, default=16, help="decode steps per timed round")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args(argv)
    args.case_list = [c for c in args.cases.split(",") if c]
    unknown = sorted(set(args.case_list) - set(CASES))
    if unknown:
        p.error(f"--cases: unknown {unknown}; allowed: {','.join(CASES)}")
    if args.context < 1 or args.rounds < 1 or args.steps < 1 or not 0 < args.hot_share <= 1:
        p.error("--context, --rounds and --steps must be at least 1 and --hot-share in (0, 1]")
    return args


def build_model(seed: int, num_layers: int, max_tokens: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=256, hidden_size=180, intermediate_size=256, num_hidden_layers=num_layers,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                         max_position_embeddings=max(2048, max_tokens))
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    return model


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def count_step(model, cache, token) -> tuple[int, int]:
    """(aten ops, Python calls) of one decode step; the step is kept (the caller crops)."""
    calls = [0]

    def profile(frame, event, arg):
        if event == "call":
            calls[0] += 1

    with torch.no_grad():
        counter = OpCounter()
        with counter:
            model(input_ids=token, cache=cache, use_cache=True)
        sys.setprofile(profile)
        try:
            model(input_ids=token, cache=cache, use_cache=True)
        finally:
            sys.setprofile(None)
    return counter.count, calls[0]


def make_cache(case: str, model, args, cold_dir: str):
    if case == "dynamic":
        return DynamicCache(config=model.config)
    blocks = num_blocks_for(args.context + 4 * args.steps + 8, args.block_size)
    hot = blocks + 8 if case.startswith("hot") else max(2, int(blocks * args.hot_share))
    cfg = {"block_size": args.block_size, "hot": {"device": "cpu", "capacity_blocks": hot},
           "warm": {"capacity_blocks": 0 if case.startswith("hot") else blocks + 8},
           "cold": {"capacity_blocks": 0, "path": cold_dir}, "scheduler": {"background": False}}
    return tiered_kv.CacheBank(model, cfg)


def mode_of(case: str) -> str | None:
    return case.split("-", 1)[1] if "-" in case else None


def cut_back(cache, num_tokens: int) -> None:
    cache.crop(num_tokens - cache.get_seq_length())


def main(argv=None) -> dict:
    args = parse_args(argv)
    model = build_model(args.seed, args.layers, args.context + 8 * args.steps)
    generator = torch.Generator().manual_seed(args.seed + 1)
    history = torch.randint(3, 256, (1, args.context), generator=generator)
    token = torch.randint(3, 256, (1, 1), generator=generator)
    tmp = tempfile.mkdtemp(prefix="tkv-step-cost-")
    caches, placement = {}, {}
    with torch.no_grad():
        for case in args.case_list:
            cache = make_cache(case, model, args, os.path.join(tmp, case))
            model(input_ids=history, cache=cache, use_cache=True)
            caches[case] = cache
            if hasattr(cache, "stats"):
                placement[case] = cache.stats()["bank_blocks"]

    def run(case: str, fn):
        mode = mode_of(case)
        if mode is not None:
            hooks.install(model, caches[case], mode=mode)
        try:
            return fn(caches[case])
        finally:
            if mode is not None:
                hooks.uninstall(model)

    counts, logits = {}, {}
    for case in args.case_list:
        def counted(cache):
            with torch.no_grad():
                out = model(input_ids=token, cache=cache, use_cache=True).logits  # warm-up, and the logits
                model(input_ids=token, cache=cache, use_cache=True)
            ops, calls = count_step(model, cache, token)
            cut_back(cache, args.context)
            return out, ops, calls
        logits[case], ops, calls = run(case, counted)
        counts[case] = {"aten_ops": ops, "python_calls": calls}

    samples = {case: [] for case in args.case_list}
    load_before = os.getloadavg()
    for r in range(args.rounds):
        shift = r % len(args.case_list)
        for case in args.case_list[shift:] + args.case_list[:shift]:
            def timed(cache):
                gc.collect()
                with torch.no_grad():
                    start = time.perf_counter()
                    for _ in range(args.steps):
                        model(input_ids=token, cache=cache, use_cache=True)
                    seconds = (time.perf_counter() - start) / args.steps
                cut_back(cache, args.context)
                return seconds
            samples[case].append(run(case, timed))
    load_after = os.getloadavg()
    step_s = {case: statistics.median(v) for case, v in samples.items()}
    reference = logits.get("dynamic")
    max_logit_diff = {case: float((logits[case] - reference).abs().max()) for case in args.case_list
                      if reference is not None and case != "dynamic"}
    layers = args.layers

    def per_layer(case, base, key):
        if case in counts and base in counts:
            return (counts[case][key] - counts[base][key]) / layers
        return None

    summary = {}
    for case in args.case_list:
        if case == "dynamic":
            continue
        spill = case.startswith("spill")
        all_hot = "hot" + case[len("spill"):] if spill else None
        summary[case] = {
            "aten_ops_per_layer_vs_dynamic": per_layer(case, "dynamic", "aten_ops"),
            "python_calls_per_layer_vs_dynamic": per_layer(case, "dynamic", "python_calls"),
            "aten_ops_per_layer_vs_all_hot": per_layer(case, all_hot, "aten_ops") if spill else None,
            "speed_vs_dynamic": step_s["dynamic"] / step_s[case] if "dynamic" in step_s else None,
            "speed_vs_all_hot": step_s[all_hot] / step_s[case] if spill and all_hot in step_s else None,
        }
    result = {
        "context_tokens": args.context, "layers": layers, "hot_share": args.hot_share, "rounds": args.rounds,
        "steps": args.steps, "block_size": args.block_size, "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(), "load_average_before": load_before, "load_average_after": load_after,
        "counts": counts, "step_s": step_s, "samples_s": samples, "placement": placement,
        "max_logit_diff": max_logit_diff, "summary": summary,
    }
    # how each bank's steps read (views of one run of the slab, a gather, ...): the crop between rounds
    # leaves a cut-off full block cached where the next one would have gone, so later rounds gather
    result["steps_by_read"] = {case: cache.stats()["hooks"]["steps_by_read"] for case, cache in caches.items()
                               if hasattr(cache, "stats")}
    for cache in caches.values():
        if hasattr(cache, "close"):
            cache.close()
    print(json.dumps({k: result[k] for k in ("counts", "step_s", "summary", "max_logit_diff", "steps_by_read")}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
