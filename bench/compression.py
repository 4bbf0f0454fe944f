#!/usr/bin/env python
"""Compressed lower tiers (issue 21): capacity, codec speed, decode over compressed warm history,
restore from compressed cold, and values per token against per channel.

  capacity  bytes of one block as each mode stores it, and the blocks the same bytes hold, for
            the model's layout in float32 and bfloat16 (issue target: >= 1.9x with fp8 / int8 and
            >= 3.5x with int4, on the bundled model's float32 KV)
  codec     encode and decode_into of `--codec-blocks` random blocks, GB/s of model-dtype bytes
  decode    one chat of `--context` tokens per mode, hot holding `--hot-blocks` blocks (the history
            in warm), hooks merge (what `tiered-kv chat` runs on a CPU); rounds of `--decode-steps`
            greedy steps per mode, the modes' order rotated every round; per-step medians and the
            ratio to `none` (target: compressed >= 0.9x uncompressed warm). Tokens per mode are
            compared with `none`'s (lossy modes may differ; reported, not asserted)
  restore   the chat's history made durable in a cold tier of each mode, then per round and mode
            a new store on that directory (a restart), page cache dropped first: attach() +
            the first token of a `--turn-tokens` turn; cold bytes read per mode (target:
            compressed restores faster than uncompressed: fewer bytes read)
  values    teacher-forced next-token agreement with the uncompressed cache when the history's
            values are quantized per token (the codec) or per channel (the alternative), int8 and
            fp8, keys per channel in both (real model only; skipped with --tiny)

    python bench/compression.py --json bench/results/compression_cpu.json    # SmolLM2, 2,048 tokens
    python bench/compression.py --tiny --rounds 1                            # smoke size
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import tiered_kv  # noqa: E402
from tiered_kv.blocks import num_blocks_for  # noqa: E402
from tiered_kv.compression import MODES, codec  # noqa: E402

LOSSY = MODES[1:]
DECODE_TARGET, CAPACITY_TARGETS = 0.9, {"fp8": 1.9, "int8": 1.9, "int4": 3.5}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="local HF model folder or .gguf (default: bundled SmolLM2)")
    p.add_argument("--tiny", action="store_true", help="smoke size: a tiny random Llama, 96 tokens")
    p.add_argument("--context", type=int, default=2048, help="tokens of history")
    p.add_argument("--hot-blocks", type=int, default=8, help="hot capacity while decoding (the rest is warm)")
    p.add_argument("--decode-steps", type=int, default=8, help="greedy steps per mode per round")
    p.add_argument("--turn-tokens", type=int, default=16, help="new tokens of the restored turn")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--codec-blocks", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sections", default="capacity,codec,decode,restore,values")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    if args.tiny:
        args.context, args.hot_blocks, args.decode_steps, args.turn_tokens, args.codec_blocks = 96, 2, 3, 4, 4
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    return args


def load(args):
    from bench.multiturn import build_tiny_model
    if args.tiny:
        return build_tiny_model(args.seed), None
    from tiered_kv.models import load_model

    model, tokenizer = load_model(args.model, progress=False)
    model.generation_config.eos_token_id = None  # every mode decodes the same number of steps
    return model, tokenizer


def model_layout(model, block_size: int, dtype_name: str):
    from tiered_kv.blocks import layout_from_model_config

    return layout_from_model_config(model.config, block_size, dtype_name)


def history_ids(model, tokenizer, args) -> torch.Tensor:
    if tokenizer is None:
        return torch.randint(3, model.config.vocab_size, (1, args.context), generator=torch.Generator().manual_seed(1))
    from tiered_kv.tools.quality import default_text

    return tokenizer(default_text(), return_tensors="pt").input_ids[:, :args.context]


def rotated(items: list, round_index: int) -> list:
    k = round_index % len(items)
    return items[k:] + items[:k]


# ---- capacity ---------------------------------------------------------------------------------------
def section_capacity(model, args) -> dict:
    out = {}
    for dtype_name in ("float32", "bfloat16"):
        layout = model_layout(model, args.block_size, dtype_name)
        rows = {"none": {"block_bytes": layout.block_bytes, "ratio": 1.0}}
        for mode in LOSSY:
            stored = layout.stored(mode).block_bytes
            rows[mode] = {"block_bytes": stored, "ratio": layout.block_bytes / stored}
        out[dtype_name] = rows
    out["targets_met_float32"] = all(out["float32"][m]["ratio"] >= t for m, t in CAPACITY_TARGETS.items())
    return out


# ---- codec ---------------------------------------------------------------------------------------------
def section_codec(model, args) -> dict:
    layout = model_layout(model, args.block_size, "float32")
    x = torch.randn(args.codec_blocks, *layout.record_shape(), generator=torch.Generator().manual_seed(args.seed))
    model_bytes = x.numel() * x.element_size()
    out = {"blocks": args.codec_blocks, "model_bytes": model_bytes}
    for mode in LOSSY:
        packed = codec.encode(x, mode)
        target = torch.empty_like(x)
        encode_s, decode_s = [], []
        for _ in range(max(3, args.rounds)):
            start = time.perf_counter()
            codec.encode(x, mode)
            encode_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            codec.decode_into(packed, mode, target)
            decode_s.append(time.perf_counter() - start)
        out[mode] = {"encode_gbs": model_bytes / statistics.median(encode_s) / 1e9,
                     "decode_gbs": model_bytes / statistics.median(decode_s) / 1e9,
                     "packed_bytes": packed.numel(),
                     "max_abs_error": float((target - x).abs().max()),
                     "within_bound": bool(((target - x).abs() <= codec.error_bound(x, mode) + 1e-6).all())}
    return out


# ---- decode over compressed warm history ------------------------------------------------------------------
def decode_config(args, mode: str, cold_dir: str) -> dict:
    blocks = num_blocks_for(args.context + args.decode_steps * args.rounds + 8, args.block_size) + 4
    return {"block_size": args.block_size,
            "hot": {"device": "cpu", "capacity_blocks": args.hot_blocks, "high_watermark": 1.0, "low_watermark": 1.0},
            "warm": {"capacity_blocks": blocks, "compression": mode, "high_watermark": 1.0, "low_watermark": 1.0},
            "cold": {"capacity_blocks": 0, "path": cold_dir}, "scheduler": {"background": False},
            "compression": {"check_explicit": False}}


def section_decode(model, tokenizer, args, workdir: str) -> dict:
    ids = history_ids(model, tokenizer, args)
    banks, tokens, times = {}, {}, {m: [] for m in MODES}
    with torch.no_grad():
        for mode in MODES:
            bank = tiered_kv.CacheBank(model, decode_config(args, mode, os.path.join(workdir, f"decode-{mode}")))
            tiered_kv.hooks.install(model, bank, mode="merge")
            logits = model(input_ids=ids, cache=bank, use_cache=True).logits
            banks[mode] = [bank, logits[:, -1:].argmax(-1)]
            tokens[mode] = []
        where = {m: banks[m][0].stats()["bank_blocks"] for m in MODES}
        rounds = []
        for r in range(args.rounds):
            order = rotated(list(MODES), r)
            rounds.append(order)
            for mode in order:
                bank, token = banks[mode]
                tiered_kv.hooks.install(model, bank, mode="merge")
                for _ in range(args.decode_steps):
                    start = time.perf_counter()
                    token = model(input_ids=token, cache=bank, use_cache=True).logits[:, -1:].argmax(-1)
                    times[mode].append(time.perf_counter() - start)
                    tokens[mode].append(int(token))
                banks[mode][1] = token
    for bank, _ in banks.values():
        bank.close()
    tiered_kv.hooks.uninstall(model)
    base = statistics.median(times["none"])
    steps = args.decode_steps
    out = {"context": int(ids.shape[1]), "hot_blocks": args.hot_blocks, "bank_blocks_after_prefill": where,
           "rounds": rounds, "steps_per_mode": len(times["none"]),
           "method": "per round, each mode's median step; speed_vs_none: median over rounds of none's round "
                     "median / the mode's (paired: the same round, adjacent in time); step_ms: median of all steps"}
    for mode in MODES:
        step = statistics.median(times[mode])
        paired = [statistics.median(times["none"][r * steps:(r + 1) * steps])
                  / statistics.median(times[mode][r * steps:(r + 1) * steps]) for r in range(args.rounds)]
        out[mode] = {"step_ms": step * 1e3, "speed_vs_none": statistics.median(paired),
                     "speed_vs_none_rounds": paired, "speed_vs_none_all_steps": base / step,
                     "tokens_equal_none": tokens[mode] == tokens["none"],
                     "tokens_agree_with_none": sum(a == b for a, b in zip(tokens[mode], tokens["none"]))
                     / len(tokens["none"])}
    out["target_met"] = all(out[m]["speed_vs_none"] >= DECODE_TARGET for m in ("int8", "fp8"))
    return out


# ---- restore from compressed cold -------------------------------------------------------------------------
def drop_page_cache(directory: str) -> None:
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if os.path.isfile(path) and not os.path.islink(path):
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def restore_config(args, mode: str, directory: str, blocks: int, hot_blocks: int) -> dict:
    return {"block_size": args.block_size,
            "hot": {"device": "cpu", "capacity_blocks": hot_blocks},
            "warm": {"capacity_blocks": 2, "compression": mode},
            "cold": {"capacity_blocks": blocks, "path": directory, "compression": mode, "write_behind_s": 0},
            "scheduler": {"background": False}, "compression": {"check_explicit": False}}


def section_restore(model, tokenizer, args, workdir: str) -> dict:
    ids = history_ids(model, tokenizer, args)
    turn = torch.randint(3, model.config.vocab_size, (1, args.turn_tokens), generator=torch.Generator().manual_seed(2))
    blocks = num_blocks_for(ids.shape[1] + args.turn_tokens + 8, args.block_size) + 4
    directories, built = {}, {}
    with torch.no_grad():
        for mode in MODES:  # build: the history computed once per mode, sent down to cold, made durable
            directories[mode] = os.path.join(workdir, f"restore-{mode}")
            bank = tiered_kv.CacheBank(model, restore_config(args, mode, directories[mode], blocks, 2))
            model(input_ids=ids, cache=bank, use_cache=True)
            built[mode] = bank.offload("cold")
            bank.store.flush()
            bank.close()
            bank.store.close()
    prompt = torch.cat([ids, turn], 1)
    rows = {m: [] for m in MODES}
    for r in range(args.rounds):
        for mode in rotated(list(MODES), r):
            drop_page_cache(directories[mode])
            store = tiered_kv.TierStore(restore_config(args, mode, directories[mode], blocks, blocks))
            bank = tiered_kv.CacheBank(model, store=store)
            with torch.no_grad():
                start = time.perf_counter()
                reused = bank.attach(prompt)
                attach_s = time.perf_counter() - start
                out = model.generate(prompt, cache=bank, attention_mask=torch.ones_like(prompt), max_new_tokens=1,
                                     min_new_tokens=1, do_sample=False)
                ttft_s = time.perf_counter() - start
            stats = bank.stats()
            rows[mode].append({"reused": reused, "attach_s": attach_s, "ttft_s": ttft_s,
                               "cold_bytes_read": stats["bytes_moved"].get("cold->hot", 0),
                               "first_token": int(out[0, -1])})
            bank.close()
            store.close()
    out = {"context": int(ids.shape[1]), "turn_tokens": args.turn_tokens, "built": built}
    for mode in MODES:
        out[mode] = {"reused_tokens": rows[mode][0]["reused"],
                     "attach_s": statistics.median(r["attach_s"] for r in rows[mode]),
                     "ttft_s": statistics.median(r["ttft_s"] for r in rows[mode]),
                     "cold_bytes_read": rows[mode][0]["cold_bytes_read"],
                     "first_token_equal_none": rows[mode][0]["first_token"] == rows["none"][0]["first_token"]}
    for mode in LOSSY:
        out[mode]["attach_speed_vs_none"] = out["none"]["attach_s"] / out[mode]["attach_s"]
        out[mode]["ttft_speed_vs_none"] = out["none"]["ttft_s"] / out[mode]["ttft_s"]
    out["target_met"] = all(out[m]["attach_speed_vs_none"] > 1.0 for m in LOSSY)
    return out


# ---- values per token or per channel ------------------------------------------------------------------------
def _quantize(x: torch.Tensor, dim: int, mode: str, centred: bool = False) -> torch.Tensor:
    """Symmetric fake quantization of `x` over `dim` (fp8 e4m3 or int8), optionally centred first."""
    zero = (x.amin(dim, keepdim=True) + x.amax(dim, keepdim=True)) / 2 if centred else torch.zeros(())
    x = x - zero
    scale = x.abs().amax(dim, keepdim=True) / (codec.FP8_MAX if mode == "fp8" else codec.INT8_MAX)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    if mode == "fp8":
        return (x / scale).to(torch.float8_e4m3fn).float() * scale + zero
    return (x / scale).round().clamp(-127, 127) * scale + zero


def section_values(model, tokenizer, args) -> dict:
    import torch.nn.functional as F
    from transformers import DynamicCache

    ids = history_ids(model, tokenizer, args)[:, :1024]
    prefix, target, chunk, bs = ids[:, :-1], ids[0, 1:], 64, args.block_size

    def run(quantize) -> torch.Tensor:
        cache, logits, done = DynamicCache(config=model.config), [], 0
        with torch.no_grad():
            for s in range(0, prefix.shape[1], chunk):
                logits.append(model(input_ids=prefix[:, s:s + chunk], cache=cache, use_cache=True).logits[0].float())
                full = min(s + chunk, prefix.shape[1]) // bs * bs  # completed blocks: history, quantized once
                if quantize is not None and full > done:
                    for layer in cache.layers:
                        for kv, t in ((0, layer.keys), (1, layer.values)):
                            part = t[0, :, done:full].unflatten(1, (-1, bs))  # [H, blocks, bs, D]
                            t[0, :, done:full] = quantize(kv, part).flatten(1, 2)
                    done = full
        return torch.cat(logits)[chunk:]

    reference = run(None)
    log_ref = F.log_softmax(reference, -1)
    out = {"tokens": int(ids.shape[1])}
    for mode in ("int8", "fp8"):
        for values in ("per_token", "per_channel"):
            def quantize(kv, part, mode=mode, values=values):
                if kv == 0:  # keys per channel (over the block's tokens), fp8 centred as the codec does
                    return _quantize(part, 2, mode, centred=mode == "fp8")
                return _quantize(part, 3 if values == "per_token" else 2, mode)
            got = run(quantize)
            log_got = F.log_softmax(got, -1)
            out[f"{mode}/{values}"] = {
                "argmax_agreement": float((got.argmax(-1) == reference.argmax(-1)).float().mean()),
                "kl_nats": float((log_ref.exp() * (log_ref - log_got)).sum(-1).mean()),
                "perplexity_ratio": math.exp(float(-log_got.gather(1, target[chunk:, None]).mean()
                                                   + log_ref.gather(1, target[chunk:, None]).mean()))}
    return out


# ---- main ----------------------------------------------------------------------------------------------------
def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    load_before = os.getloadavg()
    model, tokenizer = load(args)
    result = {"model": "tiny random Llama" if args.tiny else (args.model or "SmolLM2-135M-Instruct (bundled)"),
              "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                          "platform": platform.platform()},
              "load_average_before": load_before}
    with tempfile.TemporaryDirectory(prefix="tiered_kv-bench-compression-") as workdir:
        for name in args.sections:
            started = time.perf_counter()
            if name == "capacity":
                result[name] = section_capacity(model, args)
            elif name == "codec":
                result[name] = section_codec(model, args)
            elif name == "decode":
                result[name] = section_decode(model, tokenizer, args, workdir)
            elif name == "restore":
                result[name] = section_restore(model, tokenizer, args, workdir)
            elif name == "values":
                if tokenizer is None:
                    result[name] = {"skipped": "needs the real model (not --tiny)"}
                    continue
                result[name] = section_values(model, tokenizer, args)
            else:
                raise SystemExit(f"bench: unknown section {name!r}; allowed: capacity, codec, decode, restore, values")
            result[name]["seconds"] = time.perf_counter() - started
            print(f"[{name}] {json.dumps(result[name], default=str)[:1500]}", flush=True)
    result["load_average_after"] = os.getloadavg()
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str) + "\n")
    return result


if __name__ == "__main__":
    main()
