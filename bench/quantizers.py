#!/usr/bin/env python
"""Which quantizer holds quality on any text (issue 36): candidates measured side by side.

Each candidate is a round trip (quantize, then dequantize) of whole blocks `[n, 2, H, bs, D]`, with
scales and zeros rounded to float16 as the packed layout stores them. A teacher-forced pass reads the
text in chunks of 64 tokens through a cache that rounds every block once it falls below the hot
window (the chunk plus 2 blocks, as `tiered-kv quality` places it), so ~95% of the history each
position reads is the candidate's; the reference is the same pass with no rounding. Reported per
candidate, model and text: next-token argmax agreement and the perplexity ratio; and per candidate
the worst of them, and its bytes per block against float32.

This compares candidates quickly; the codec chosen from it is measured through a real CacheBank by
`bench/compression.py --quality` (the figures the closing note reports).

    python bench/quantizers.py --json bench/results/quantizers_cpu.json
    python bench/quantizers.py --tokens 512 --models smollm2 --texts prose --candidates int4-v32
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import quality_models  # noqa: E402
import quality_texts  # noqa: E402

F16_MAX = 65504.0


def _f16(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-F16_MAX, F16_MAX).half().float()


def _groups(x: torch.Tensor, axis: str, group: int | None) -> torch.Tensor:
    """`x` `[n, H, bs, D]` viewed so the last dim is one quantization group.
    axis 'channel': over the block's tokens per (head, channel); 'token': over D (or groups of D)."""
    if axis == "channel":
        return x.transpose(-1, -2)  # [n, H, D, bs]
    g = group or x.shape[-1]
    return x.unflatten(-1, (x.shape[-1] // g, g))


def _ungroup(y: torch.Tensor, axis: str) -> torch.Tensor:
    return y.transpose(-1, -2) if axis == "channel" else y.flatten(-2)


def _round(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Round trip of float32 groups `[..., g]` (the last dim one group) in `fmt`."""
    if fmt == "none":
        return x
    if fmt == "f16":
        return _f16(x)
    low, high = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    if fmt == "int8":  # symmetric
        scale = _f16(torch.maximum(-low, high) / 127)
        inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
        return (x * inv).round().clamp(-127, 127) * scale
    if fmt in ("int4", "int8a", "int3", "int2"):  # asymmetric with a zero point
        levels = {"int4": 15.0, "int8a": 255.0, "int3": 7.0, "int2": 3.0}[fmt]
        zero = _f16(low)
        scale = _f16((high - zero) / levels)
        inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
        return ((x - zero) * inv).round().clamp(0, levels) * scale + zero
    if fmt == "e4m3m":  # centred on the group's mean
        zero = _f16(x.mean(-1, keepdim=True))
        amax = (x - zero).abs().amax(-1, keepdim=True)
        scale = _f16(amax / 448.0)
        inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
        return ((x - zero) * inv).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale + zero
    if fmt in ("e4m3", "e5m2", "e4m3c", "e5m2c"):  # c: centred on the group's midpoint first
        centred = fmt.endswith("c")
        dtype, top = (torch.float8_e4m3fn, 448.0) if fmt.startswith("e4m3") else (torch.float8_e5m2, 57344.0)
        zero = _f16((low + high) / 2) if centred else torch.zeros_like(low)
        amax = torch.maximum(zero - low, high - zero)
        scale = _f16(amax / top)
        inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
        return ((x - zero) * inv).clamp(-top, top).to(dtype).float() * scale + zero
    raise ValueError(fmt)


def _bytes_per_group(fmt: str) -> int:
    """float16 side data per group: a scale, plus a zero for asymmetric and centred formats."""
    return 2 if fmt in ("int8", "e4m3", "e5m2") else 4


def _code_bits(fmt: str) -> int:
    return {"none": 32, "f16": 16, "int8": 8, "int8a": 8, "int4": 4, "int3": 3, "int2": 2}.get(fmt, 8)


class Candidate:
    """Keys: `k_fmt` per channel over the block's tokens, the `k_outliers` largest channels of each
    (block, head) kept in float16 (an index byte each). Values: `v_fmt` per token in groups of
    `v_group` along head_dim (None: all of it)."""

    def __init__(self, name, k_fmt, v_fmt, v_group=None, k_outliers=0, k_axis="channel", k_group=None,
                 exact_first_block=False, exact_first_token="", outlier_token=False, first_row_fmt=None):
        self.name, self.k_fmt, self.v_fmt, self.v_group = name, k_fmt, v_fmt, v_group
        self.k_outliers, self.k_axis, self.k_group = k_outliers, k_axis, k_group
        self.exact_first_block = exact_first_block
        self.exact_first_token = exact_first_token  # "kv" or "k": position 0 kept exact (emulation only)
        self.outlier_token = outlier_token  # per (block, head) the key of largest norm kept in float16
        self.first_row_fmt = first_row_fmt  # each block's token 0: K and V per token in this format

    def roundtrip(self, blocks: torch.Tensor) -> torch.Tensor:
        if self.first_row_fmt:
            first = _round(blocks[:, :, :, :1].float(), self.first_row_fmt)  # per token over D, K and V
            rest = self._roundtrip(blocks[:, :, :, 1:])
            return torch.cat((first.to(blocks.dtype), rest), dim=3)
        return self._roundtrip(blocks)

    def _roundtrip(self, blocks: torch.Tensor) -> torch.Tensor:
        keys, values = blocks[:, 0].float(), blocks[:, 1].float()
        if self.outlier_token:
            norms = keys.norm(dim=-1)  # [n, H, bs]
            top = norms.argmax(-1, keepdim=True)  # [n, H, 1]
            is_top = torch.zeros_like(norms, dtype=torch.bool).scatter_(-1, top, True)[..., None].expand_as(keys)
            # the outlier is replaced by its block's channel mean of the others for the ranges, then restored
            others_mean = (keys.masked_fill(is_top, 0).sum(-2, keepdim=True) / (keys.shape[-2] - 1)).expand_as(keys)
            filled = torch.where(is_top, others_mean, keys)
            k = _ungroup(_round(_groups(filled, self.k_axis, self.k_group), self.k_fmt), self.k_axis)
            k = torch.where(is_top, _f16(keys), k)
        else:
            k = _ungroup(_round(_groups(keys, self.k_axis, self.k_group), self.k_fmt), self.k_axis)
        if self.k_outliers:
            mag = keys.abs().amax(dim=-2, keepdim=True)  # [n, H, 1, D]
            top = mag.topk(self.k_outliers, dim=-1).indices
            mask = torch.zeros_like(mag, dtype=torch.bool).scatter_(-1, top, True).expand_as(keys)
            k = torch.where(mask, _f16(keys), k)
        v = _ungroup(_round(_groups(values, "token", self.v_group), self.v_fmt), "token")
        return torch.stack((k, v), dim=1).to(blocks.dtype)

    def block_bytes(self, heads: int, bs: int, dim: int) -> int:
        k_codes = heads * bs * dim * _code_bits(self.k_fmt) / 8
        v_codes = heads * bs * dim * _code_bits(self.v_fmt) / 8
        k_groups = heads * dim if self.k_axis == "channel" else heads * bs * dim // (self.k_group or dim)
        v_groups = heads * bs * dim // (self.v_group or dim)
        side = k_groups * _bytes_per_group(self.k_fmt) + v_groups * _bytes_per_group(self.v_fmt)
        outliers = heads * self.k_outliers * (bs * 2 + 1) + (heads * (dim * 2 + 1) if self.outlier_token else 0)
        if self.first_row_fmt:  # token 0: 2 x H x D codes at 8 bits instead of the codes' bits, and 2 x H scales
            outliers += 2 * heads * dim * (8 - _code_bits(self.v_fmt)) / 8 + 2 * heads * _bytes_per_group(self.first_row_fmt)
        return int(math.ceil(k_codes + v_codes + side + outliers))


CANDIDATES = {c.name: c for c in [
    # int8
    Candidate("int8", "int8", "int8"),  # the shipped codec: K per channel, V per token
    Candidate("int8-v32", "int8", "int8", v_group=32),
    Candidate("int8-v16", "int8", "int8", v_group=16),
    Candidate("int8a-v32", "int8a", "int8a", v_group=32),
    Candidate("int8-o2", "int8", "int8", k_outliers=2),
    Candidate("int8-v32-o2", "int8", "int8", v_group=32, k_outliers=2),
    # fp8
    Candidate("fp8", "e4m3c", "e4m3"),  # the shipped codec
    Candidate("fp8-v32", "e4m3c", "e4m3", v_group=32),
    Candidate("fp8-k5m2", "e5m2c", "e4m3"),
    Candidate("fp8-kint8", "int8", "e4m3"),
    Candidate("fp8-vc32", "e4m3c", "e4m3c", v_group=32),
    Candidate("fp8-o2", "e4m3c", "e4m3", k_outliers=2),
    # int4
    Candidate("int4", "int4", "int4"),  # the shipped codec
    Candidate("int4-v32", "int4", "int4", v_group=32),
    Candidate("int4-v16", "int4", "int4", v_group=16),
    Candidate("int4-o1", "int4", "int4", k_outliers=1),
    Candidate("int4-v32-o1", "int4", "int4", v_group=32, k_outliers=1),
    Candidate("int4-v32-o2", "int4", "int4", v_group=32, k_outliers=2),
    Candidate("int4-v16-o2", "int4", "int4", v_group=16, k_outliers=2),
    # ablations: which half costs int4 its agreement, and the first block (attention sinks) kept exact
    Candidate("int4-keys-only", "int4", "none"),
    Candidate("int4-values-only", "none", "int4"),
    Candidate("int4-ktok16", "int4", "int4", k_axis="token", k_group=16),
    Candidate("int4-sink", "int4", "int4", exact_first_block=True),
    Candidate("int4-v16-sink", "int4", "int4", v_group=16, exact_first_block=True),
    Candidate("fp8-sink", "e4m3c", "e4m3", exact_first_block=True),
    Candidate("int8-sink", "int8", "int8", exact_first_block=True),
    Candidate("int4-tok0", "int4", "int4", exact_first_token="kv"),
    Candidate("int4-tok0k", "int4", "int4", exact_first_token="k"),
    Candidate("int4-ot", "int4", "int4", outlier_token=True),
    Candidate("int4-ot-v32", "int4", "int4", v_group=32, outlier_token=True),
    Candidate("int8a", "int8a", "int8a"),
    Candidate("int8a-ot", "int8a", "int8a", outlier_token=True),
    Candidate("int8-ot", "int8", "int8", outlier_token=True),
    Candidate("fp8-ot", "e4m3c", "e4m3", outlier_token=True),
    Candidate("fp8-kint8a-ot", "int8a", "e4m3", outlier_token=True),
    Candidate("int4-r0", "int4", "int4", first_row_fmt="int8"),
    Candidate("int4-r0-v32", "int4", "int4", v_group=32, first_row_fmt="int8"),
    Candidate("int8-ka", "int8a", "int8"),
    Candidate("int8-va", "int8", "int8a"),
    Candidate("fp8-r0", "e4m3c", "e4m3", first_row_fmt="int8"),
    Candidate("int4-r0f-v32", "int4", "int4", v_group=32, first_row_fmt="e4m3"),
    Candidate("fp8-r0f", "e4m3c", "e4m3", first_row_fmt="e4m3"),
    Candidate("int8-ka-r0", "int8a", "int8", first_row_fmt="int8"),
    Candidate("int8-ka-r0f", "int8a", "int8", first_row_fmt="e4m3"),
    Candidate("fp8-r0h", "e4m3c", "e4m3", first_row_fmt="f16"),
    Candidate("fp8-r0h-mean", "e4m3m", "e4m3", first_row_fmt="f16"),
    # keys quantized before the rotary embedding (Llama layouts: the cache rotates them back and again)
    Candidate("int4-r0f-v32-prerope", "int4", "int4", v_group=32, first_row_fmt="e4m3"),
    Candidate("int8-ka-prerope", "int8a", "int8"),
    Candidate("fp8-r0h-prerope", "e4m3c", "e4m3", first_row_fmt="f16"),
]}


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


# what bench/results/quantizers_cpu.json compares: issue 21's codec, the variants that moved it, and what
# shipped as codec version 3 (int8-ka, fp8-r0h, int4-r0f-v32)
REPORTED = ("int8", "int8a", "int8-ka", "int8-ka-prerope", "fp8", "fp8-k5m2", "fp8-r0", "fp8-r0h", "fp8-r0h-prerope",
            "int4", "int4-v32", "int4-v32-o2", "int4-r0-v32", "int4-r0f-v32", "int4-r0f-v32-prerope")


class RoundingCache(DynamicCache):
    """A DynamicCache (full layers only: sliding windows come from the mask) whose blocks are
    replaced by a candidate's round trip once, when they fall `hot_tokens` behind the end."""

    def __init__(self, candidate: Candidate | None, block_size: int, hot_tokens: int, rotary=None):
        super().__init__()
        self.candidate, self.block_size, self.hot_tokens = candidate, block_size, hot_tokens
        self.rotary = rotary  # the model's rotary embedding: keys are quantized before it (un-rotated, then again)
        self.done: dict[int, int] = {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if self.candidate is None:
            return keys, values
        total = keys.shape[-2]
        bs = self.block_size
        target = max(0, (total - self.hot_tokens) // bs * bs)
        done = self.done.get(layer_idx, 0)
        if target > done:
            k, v = keys[0, :, done:target], values[0, :, done:target]  # [H, T, D]
            if self.rotary is not None:
                cos, sin = self.rotary(v[None], torch.arange(done, target)[None])
                cos, sin = cos[0].float(), sin[0].float()  # [T, D]
                k = k * cos - _rotate_half(k) * sin  # rotated back by -angle: the key before RoPE
            blocks = torch.stack((k, v)).unflatten(2, (-1, bs)).permute(2, 0, 1, 3, 4)  # [n, 2, H, bs, D]
            rounded = self.candidate.roundtrip(blocks)
            if self.candidate.exact_first_block and done == 0:
                rounded[0] = blocks[0]
            if self.candidate.exact_first_token and done == 0:
                rounded[0, 0, :, 0] = blocks[0, 0, :, 0]
                if self.candidate.exact_first_token == "kv":
                    rounded[0, 1, :, 0] = blocks[0, 1, :, 0]
            out = rounded.permute(1, 2, 0, 3, 4).flatten(2, 3)
            if self.rotary is not None:
                out[0] = out[0] * cos + _rotate_half(out[0]) * sin
            keys[0, :, done:target] = out[0]
            values[0, :, done:target] = out[1]
            self.done[layer_idx] = target
        return keys, values


def chunked_logits(model, ids: torch.Tensor, cache, chunk: int) -> torch.Tensor:
    out = []
    with torch.no_grad():
        for start in range(0, ids.shape[1], chunk):
            out.append(model(input_ids=ids[:, start:start + chunk], past_key_values=cache,
                             use_cache=True).logits[0].float())
    return torch.cat(out)


def score(reference: torch.Tensor, got: torch.Tensor, target: torch.Tensor, first: int) -> dict:
    ref, out, tgt = reference[first:], got[first:], target[first:]
    log_ref, log_out = F.log_softmax(ref, -1), F.log_softmax(out, -1)
    nll_ref = float(-log_ref.gather(1, tgt[:, None]).mean())
    nll_out = float(-log_out.gather(1, tgt[:, None]).mean())
    return {"agreement": float((ref.argmax(-1) == out.argmax(-1)).float().mean()),
            "ppl_ratio": math.exp(nll_out - nll_ref),
            "kl": float((log_ref.exp() * (log_ref - log_out)).sum(-1).mean())}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default=",".join(quality_models.NAMES))
    p.add_argument("--texts", default=",".join(quality_texts.NAMES))
    p.add_argument("--candidates", default=",".join(REPORTED))
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--hot-spare-blocks", type=int, default=2)
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    torch.manual_seed(0)
    names = args.candidates.split(",")
    rows = []
    for model_name in args.models.split(","):
        model, tokenizer = quality_models.load(model_name)
        cfg = model.config
        heads = cfg.num_key_value_heads
        dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        for text_name in args.texts.split(","):
            ids = tokenizer(quality_texts.load(text_name), return_tensors="pt").input_ids[:, :args.tokens + 1]
            prefix, target = ids[:, :-1], ids[0, 1:]
            hot = args.chunk + args.hot_spare_blocks * args.block_size
            started = time.perf_counter()
            reference = chunked_logits(model, prefix, RoundingCache(None, args.block_size, hot), args.chunk)
            for name in names:
                if name.endswith("-prerope") and cfg.model_type != "llama":
                    continue  # one rotary embedding for every layer: Llama layouts only
                cand = CANDIDATES[name]
                rotary = model.model.rotary_emb if name.endswith("-prerope") else None
                got = chunked_logits(model, prefix, RoundingCache(cand, args.block_size, hot, rotary), args.chunk)
                row = {"model": model_name, "text": text_name, "candidate": name,
                       **score(reference, got, target, args.chunk),
                       "capacity_x_fp32": 2 * heads * args.block_size * dim * 4
                       / cand.block_bytes(heads, args.block_size, dim)}
                rows.append(row)
                print(f"{model_name:<12} {text_name:<9} {name:<14} agree {row['agreement']:.4f}  "
                      f"ppl x{row['ppl_ratio']:.4f}  kl {row['kl']:.5f}  cap {row['capacity_x_fp32']:.2f}x",
                      flush=True)
            print(f"  ({time.perf_counter() - started:.0f} s)", flush=True)
    worst = {}
    for name in names:
        mine = [r for r in rows if r["candidate"] == name]
        if not mine:
            continue
        worst[name] = {"worst_agreement": min(r["agreement"] for r in mine),
                       "worst_ppl_ratio": max(r["ppl_ratio"] for r in mine),
                       "capacity_x_fp32": min(r["capacity_x_fp32"] for r in mine)}
        print(f"WORST {name:<14} agree {worst[name]['worst_agreement']:.4f}  ppl x{worst[name]['worst_ppl_ratio']:.4f}"
              f"  cap {worst[name]['capacity_x_fp32']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows, "worst": worst}, indent=1) + "\n")


if __name__ == "__main__":
    main()
