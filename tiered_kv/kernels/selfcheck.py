"""Runs each op once per dtype / block size / tier through `ops` and the reference; reports max abs errors.

For a GPU check script: `tiered_kv.kernels.selfcheck("cuda")` compares the CUDA kernels with the
torch reference on small random inputs (on a CPU-only machine both sides are the reference,
so every error is 0). Errors are max |ops - reference| over elements, where equal infinities
and NaN on both sides count as 0.
"""

from __future__ import annotations

import time

import torch

from ..compression import MODES, layout_parts
from ..compression.packing import encode
from . import reference
from .backend import get_ops
from .cases import TIERS, build_decode_case, make_sources

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BLOCK_SIZES = (8, 16, 32)
TIER_MIXES = (("hot",), ("warm",), ("staging",), ("hot", "warm", "staging"))
SPLIT_TOKENS = 1200  # > cuda.PARTITION_MIN_TOKENS: several partitions and the merge kernel


def max_abs_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().float().cpu(), want.detach().float().cpu()
    same = (got == want) | (torch.isnan(got) & torch.isnan(want))
    diff = torch.where(same, torch.zeros_like(got), (got - want).abs())
    return float(diff.max()) if diff.numel() else 0.0


def packed_mismatches(got: torch.Tensor, want: torch.Tensor, mode: str, heads: int, block_size: int,
                      head_dim: int) -> int:
    """How many bytes of packed slices `[..., P]` differ, a zero scale's sign aside: for a group of
    zeros packing.encode's torch.maximum gives -0 or +0 by the group's place in its vector loop,
    native/quant_blocks.cu always +0 (the same decoded values)."""
    parts = layout_parts(mode, heads, block_size, head_dim)
    got, want = got.detach().cpu().clone(), want.detach().cpu().clone()
    for packed in (got, want):
        for name in ("k_scale", "v_scale", "r0_scale"):
            if name in parts:
                halves = packed[..., parts[name][0]:parts[name][1]].view(torch.int16)
                halves.masked_fill_(halves == -32768, 0)
    return int((got != want).sum())


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def selfcheck(device="cuda", dtypes=DTYPES, block_sizes=BLOCK_SIZES, tier_mixes=TIER_MIXES,
              head_dim: int = 128, seed: int = 0, split_tokens: int | None = SPLIT_TOKENS) -> dict:
    """{"backend", "fallback_reason", "seconds", op: {"dtype/bsN/tiers": error or {"out", "lse"}}}.

    With `split_tokens`, paged_decode also runs once per dtype over rows of that many positions
    (block_sizes[0], tier_mixes[-1], GQA group 4: "dtype/bsN/tiers/splitT"), long enough for the CUDA
    path to split them into partitions and merge them.
    """
    started = time.perf_counter()
    ops = get_ops()
    device = torch.device(device)
    report: dict = {"backend": ops.backend, "fallback_reason": ops.fallback_reason,
                    "paged_decode": {}, "merge_states": {}, "gather_blocks": {}, "scatter_blocks": {},
                    "dequant_blocks": {}, "quant_blocks": {}}
    for dtype in dtypes:
        for block_size in block_sizes:
            for tiers in tier_mixes:
                case = build_decode_case(dtype=dtype, block_size=block_size, tiers=tiers, head_dim=head_dim,
                                         device=device, seed=seed)
                out, lse = ops.paged_decode(*case.args())
                want_out, want_lse = reference.paged_decode(*case.args())
                report["paged_decode"][f"{_name(dtype)}/bs{block_size}/{'+'.join(tiers)}"] = {
                    "out": max_abs_error(out, want_out), "lse": max_abs_error(lse, want_lse)}
                _check_copies(report, ops, dtype, block_size, head_dim, device, seed)
        if split_tokens:
            block_size, tiers = block_sizes[0], tier_mixes[-1]
            case = build_decode_case(dtype=dtype, block_size=block_size, tiers=tiers, head_dim=head_dim, groups=4,
                                     num_kv_heads=2, max_tokens=split_tokens, device=device, seed=seed)
            out, lse = ops.paged_decode(*case.args())
            want_out, want_lse = reference.paged_decode(*case.args())
            report["paged_decode"][f"{_name(dtype)}/bs{block_size}/{'+'.join(tiers)}/split{split_tokens}"] = {
                "out": max_abs_error(out, want_out), "lse": max_abs_error(lse, want_lse)}
        _check_merge(report, ops, dtype, head_dim, device, seed)
        _check_dequant(report, ops, dtype, block_sizes[0], head_dim, device, seed)
        _check_quant(report, ops, dtype, block_sizes[0], head_dim, device, seed)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    report["seconds"] = time.perf_counter() - started
    return report


def _check_merge(report: dict, ops, dtype, head_dim: int, device, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    out_a, out_b = (torch.randn(3, 4, head_dim, generator=gen).to(dtype).to(device) for _ in (0, 1))
    lse_a, lse_b = (torch.randn(3, 4, generator=gen).mul(4).to(device) for _ in (0, 1))
    lse_a[0, 0] = float("-inf")  # one side empty
    lse_a[1, 1] = lse_b[1, 1] = float("-inf")  # both empty
    got = ops.merge_states(out_a, lse_a, out_b, lse_b)
    want = reference.merge_states(out_a, lse_a, out_b, lse_b)
    report["merge_states"][_name(dtype)] = {"out": max_abs_error(got[0], want[0]),
                                            "lse": max_abs_error(got[1], want[1])}


def _check_copies(report: dict, ops, dtype, block_size: int, head_dim: int, device, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    num_slots, count, heads = 12, 5, 2
    slots = torch.randperm(num_slots, generator=gen)[:count].to(torch.int32).to(device)
    for tag, tier in enumerate(TIERS):
        (slab, _), = make_sources(tag + 1, num_slots, heads, block_size, head_dim, dtype, device, fill=0.0)[tag:]
        slab.copy_(torch.randn(slab.shape, generator=gen).to(dtype))
        staging = torch.randn(count, heads, block_size, head_dim, generator=gen).to(dtype).to(device)
        key = f"{_name(dtype)}/bs{block_size}/{tier}"
        got, want = torch.zeros_like(staging), torch.zeros_like(staging)
        ops.gather_blocks(got, slab, slots)
        reference.gather_blocks(want, slab, slots)
        report["gather_blocks"][key] = max_abs_error(got, want)
        got_slab, want_slab = slab.clone(), slab.clone()
        if tier == "warm" and device.type == "cuda":
            got_slab, want_slab = got_slab.pin_memory(), want_slab.pin_memory()
        ops.scatter_blocks(got_slab, staging, slots)
        reference.scatter_blocks(want_slab, staging, slots)
        report["scatter_blocks"][key] = max_abs_error(got_slab, want_slab)


def _check_dequant(report: dict, ops, dtype, block_size: int, head_dim: int, device, seed: int) -> None:
    """Each compression mode's packed blocks expanded into a hot slab's slots, against the reference
    (both compute the same float32 products, so the error should be exactly 0)."""
    gen = torch.Generator().manual_seed(seed)
    num_slots, count, layers, heads = 9, 4, 2, 2
    slots = torch.randperm(num_slots, generator=gen)[:count].to(torch.int32).to(device)
    for mode in MODES[1:]:
        packed = encode(torch.randn(count, layers, 2, heads, block_size, head_dim, generator=gen) * 4, mode)
        results = []
        for run in (ops.dequant_blocks, reference.dequant_blocks):
            slab = torch.zeros(layers, 2, heads, num_slots * block_size, head_dim, dtype=dtype, device=device)
            view = slab.view(layers, 2, heads, num_slots, block_size, head_dim).permute(3, 0, 1, 2, 4, 5)
            run(view, packed.to(device), slots, mode)
            results.append(slab)
        report["dequant_blocks"][f"{_name(dtype)}/bs{block_size}/{mode}"] = max_abs_error(*results)


def _check_quant(report: dict, ops, dtype, block_size: int, head_dim: int, device, seed: int) -> None:
    """Each compression mode packing blocks out of a hot slab's slots, against the torch codec on the
    CPU (the reference's bits: torch on CUDA divides by a constant as a product with its reciprocal);
    the number of bytes that differ, which should be 0."""
    gen = torch.Generator().manual_seed(seed)
    num_slots, count, layers, heads = 9, 4, 2, 2
    slots = torch.randperm(num_slots, generator=gen)[:count].to(torch.int32)
    slab = (torch.randn(layers, 2, heads, num_slots * block_size, head_dim, generator=gen) * 4).to(dtype)
    view, device_view = (s.view(layers, 2, heads, num_slots, block_size, head_dim).permute(3, 0, 1, 2, 4, 5)
                         for s in (slab, slab.to(device)))
    for mode in MODES[1:]:
        want = torch.empty(count, layers, layout_parts(mode, heads, block_size, head_dim).size, dtype=torch.uint8)
        got = want.to(device)
        reference.quant_blocks(want, view, slots, mode)
        ops.quant_blocks(got, device_view, slots.to(device), mode)
        report["quant_blocks"][f"{_name(dtype)}/bs{block_size}/{mode}"] = packed_mismatches(
            got, want, mode, heads, block_size, head_dim)
