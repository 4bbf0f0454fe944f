"""native/ kernels and their Python side (tiered_kv.kernels).

CPU: every .cu compiles with nvcc (when on PATH); the torch reference matches sdpa over the
dense K/V; merge/gather/scatter semantics; the layout contracts; the CUDA wrappers' launch
arguments against the header (with a recording launcher, so nothing launches); the kernels
themselves, built for the host with g++ (tests/kernel_emulation.py), against the reference. GPU (CUDA +
cupy): each kernel against the torch reference over dtypes x block sizes x tiers, and the split
decode over long rows.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tiered_kv.errors import LayoutError
import kernel_emulation as emulation
from tiered_kv.kernels import backend, contracts, cuda, reference
from tiered_kv.kernels.cases import TIERS, build_decode_case, make_sources
from tiered_kv.kernels.selfcheck import max_abs_error, packed_mismatches, selfcheck
from tiered_kv.kernels.sources import HEADER_NAME, KERNEL_FILES, native_dir, read_source

NATIVE = native_dir()
CU_FILES = sorted(p.name for p in NATIVE.glob("*.cu"))


def _has_cupy() -> bool:
    try:
        import cupy  # noqa: F401
    except Exception:
        return False
    return True


GPU = torch.cuda.is_available() and _has_cupy()
needs_gpu = pytest.mark.skipif(not GPU, reason="needs torch CUDA and cupy")
needs_host_build = pytest.mark.skipif(emulation.unavailable_reason() is not None,
                                      reason=f"kernel emulation: {emulation.unavailable_reason()}")


# ---------------------------------------------------------------- native sources

def test_native_folder_lists_one_kernel_per_file_and_declares_each():
    assert CU_FILES == sorted(KERNEL_FILES), "every .cu file is registered in sources.KERNEL_FILES"
    header = (NATIVE / HEADER_NAME).read_text()
    assert header.splitlines()[0].startswith("// Device code (CUDA)")
    for file_name, kernel_names in KERNEL_FILES.items():
        text = (NATIVE / file_name).read_text()
        assert text.splitlines()[0].startswith("// Device code (CUDA)"), file_name
        defined = re.findall(r'extern "C" __global__ void (\w+)\(', text)
        assert sorted(defined) == sorted(kernel_names), file_name
        # instantiations of one kernel: a single template implementation, or a single plain kernel
        assert len(re.findall(r"__device__ __forceinline__ void \w+_impl", text)) == (len(kernel_names) > 1)
        for name in kernel_names:
            assert re.search(rf'extern "C" __global__ void {name}\(', header), f"{name} not declared in the header"


def test_read_source_inlines_local_includes_once():
    text = read_source("paged_decode.cu")
    assert not re.search(r"^\s*#\s*include", text, re.M)
    assert text.count("struct tkv_half {") == 1  # header reached through two includes, inlined once
    assert "paged_decode_impl" in text


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH (CUDA toolkit absent)")
@pytest.mark.parametrize("file_name", CU_FILES)
def test_cu_file_compiles_with_nvcc(file_name, tmp_path):
    # the inlined text is exactly what NVRTC gets at run time; ptxas runs too (--cubin)
    source = tmp_path / file_name
    source.write_text(read_source(file_name))
    cubin = tmp_path / "out.cubin"
    result = subprocess.run(
        ["nvcc", "-std=c++17", "-arch=sm_90", "--cubin", "-Werror", "all-warnings", "-o", str(cubin), str(source)],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    data = cubin.read_bytes()
    for name in KERNEL_FILES[file_name]:
        assert name.encode() + b"\x00" in data, f"{name} missing from the cubin"


# ---------------------------------------------------------------- reference vs sdpa

def _expected(case):
    """sdpa over the dense K/V (float32) and the float64 logsumexp of the scaled scores."""
    q = case.query.float().cpu()
    groups = q.shape[1] // case.keys.shape[1]
    keys = case.keys.repeat_interleave(groups, dim=1)
    values = case.values.repeat_interleave(groups, dim=1)
    mask = case.valid[:, None, None, :]
    out = F.scaled_dot_product_attention(q[:, :, None, :], keys, values, attn_mask=mask, scale=case.scale)[:, :, 0]
    scores = torch.einsum("bhd,bhtd->bht", q.double(), keys.double()) * case.scale
    lse = torch.logsumexp(scores.masked_fill(~case.valid[:, None, :], float("-inf")), dim=-1)
    return out, lse


TIER_MIXES = [("hot",), ("hot", "warm"), ("hot", "warm", "staging")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("tiers", TIER_MIXES, ids=["+".join(t) for t in TIER_MIXES])
@pytest.mark.parametrize("left_pad", [True, False], ids=["leftpad", "nopad"])
@pytest.mark.parametrize("groups", [1, 3], ids=["mha", "gqa3"])
def test_reference_paged_decode_matches_sdpa(dtype, block_size, tiers, left_pad, groups):
    case = build_decode_case(dtype=dtype, block_size=block_size, tiers=tiers, left_pad=left_pad, groups=groups,
                             head_dim=32, max_tokens=70, seed=block_size + groups)
    out, lse = reference.paged_decode(*case.args())
    want_out, want_lse = _expected(case)
    assert out.dtype == dtype and out.shape == case.query.shape
    assert lse.dtype == torch.float32 and lse.shape == case.query.shape[:2]
    if dtype == torch.float32:
        torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(out.float(), want_out.to(dtype).float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)


def test_reference_case_spreads_blocks_over_every_tier_and_pads():
    case = build_decode_case(tiers=("hot", "warm", "staging"), block_size=8, max_tokens=70, seed=1)
    used = case.tier_tags[case.block_table >= 0]
    assert set(used.tolist()) == {0, 1, 2}
    assert int(case.start_offsets[0]) > 8 and int(case.block_table[0, 0]) == -1  # a whole padding block


def test_reference_tags_none_int32_tags_and_empty_and_poisoned_rows():
    case = build_decode_case(tiers=("hot",), block_size=8, batch=3, seed=2)
    want_out, want_lse = reference.paged_decode(*case.args())
    args = list(case.args())
    args[3] = None  # no tags: every entry is source 0
    out, lse = reference.paged_decode(*args)
    torch.testing.assert_close(out, want_out, atol=0, rtol=0)
    args[3] = case.tier_tags.to(torch.int32)
    torch.testing.assert_close(reference.paged_decode(*args)[0], want_out, atol=0, rtol=0)

    starts = case.start_offsets.clone()
    starts[1] = case.seq_lens[1]  # row 1 empty
    table = case.block_table.clone()
    first_block = int(case.start_offsets[2]) // 8
    table[2, first_block] = case.sources[0][0].shape[0]  # row 2 names a slot past its source
    out, lse = reference.paged_decode(case.query, case.sources, table, case.tier_tags, starts, case.seq_lens,
                                      case.scale)
    torch.testing.assert_close(out[0], want_out[0], atol=0, rtol=0)
    assert bool((out[1] == 0).all()) and bool((lse[1] == float("-inf")).all())
    assert bool(out[2].isnan().all()) and bool(lse[2].isnan().all())


def test_reference_seq_lens_past_the_table_are_clamped():
    case = build_decode_case(tiers=("hot",), block_size=8, batch=1, left_pad=False, max_tokens=16, seed=3)
    table = case.block_table[:, :2].contiguous()  # exactly the row's two blocks
    tags = case.tier_tags[:, :2].contiguous()
    got = reference.paged_decode(case.query, case.sources, table, tags, case.start_offsets, case.seq_lens + 5,
                                 case.scale)
    want = reference.paged_decode(case.query, case.sources, table, tags, case.start_offsets, case.seq_lens,
                                  case.scale)
    torch.testing.assert_close(got[0], want[0], atol=0, rtol=0)


# ---------------------------------------------------------------- merge_states

def _split_runs(case, split: int, decode=reference.paged_decode):
    """Row b over [start, split) and over [split, end): two disjoint partials of the same row."""
    split_t = torch.full_like(case.seq_lens, split)
    first = decode(case.query, case.sources, case.block_table, case.tier_tags, case.start_offsets,
                   torch.minimum(split_t, case.seq_lens), case.scale)
    second = decode(case.query, case.sources, case.block_table, case.tier_tags,
                    torch.maximum(split_t, case.start_offsets), case.seq_lens, case.scale)
    return first, second


@pytest.mark.parametrize("split", [0, 9, 25, 50])
def test_merge_of_two_split_runs_equals_full_attention(split):
    case = build_decode_case(tiers=("hot", "warm"), block_size=8, max_tokens=50, groups=2, seed=4)
    (out_a, lse_a), (out_b, lse_b) = _split_runs(case, split)
    out, lse = reference.merge_states(out_a, lse_a, out_b, lse_b)
    want_out, want_lse = reference.paged_decode(*case.args())
    torch.testing.assert_close(out, want_out, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse, atol=2e-6, rtol=1e-6)


def test_merge_with_empty_sides():
    out_a = torch.randn(1, 3, 4)
    out_b = torch.randn(1, 3, 4)
    lse_a = torch.tensor([[float("-inf"), 0.5, float("-inf")]])
    lse_b = torch.tensor([[1.0, float("-inf"), float("-inf")]])
    out, lse = reference.merge_states(out_a, lse_a, out_b, lse_b)
    torch.testing.assert_close(out[0, 0], out_b[0, 0])
    torch.testing.assert_close(out[0, 1], out_a[0, 1])
    assert bool((out[0, 2] == 0).all())
    torch.testing.assert_close(lse, torch.tensor([[1.0, 0.5, float("-inf")]]))


# ---------------------------------------------------------------- gather / scatter

@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int16], ids=["fp32", "bf16", "int16"])
def test_reference_gather_scatter_round_trip(tier, dtype):
    gen = torch.Generator().manual_seed(5)
    tag = TIERS.index(tier)
    (layout, _), = make_sources(tag + 1, 10, 2, 8, 16, torch.float32, torch.device("cpu"), fill=0.0)[tag:]
    slab = _like_layout(layout, dtype)  # the tier's slot strides, in `dtype`
    slab.copy_((torch.randn(slab.shape, generator=gen) * 100).to(dtype))
    slots = torch.tensor([7, 2, 9, 0], dtype=torch.int32)
    staging = torch.zeros(6, 2, 8, 16, dtype=dtype)  # larger than the list: the tail is untouched
    reference.gather_blocks(staging, slab, slots)
    for i, slot in enumerate(slots.tolist()):
        assert torch.equal(staging[i], slab[slot])
    assert bool((staging[4:] == 0).all())

    target = torch.zeros_like(slab)
    reference.scatter_blocks(target, staging, slots)
    for slot in range(slab.shape[0]):
        want = slab[slot] if slot in slots.tolist() else torch.zeros_like(slab[slot])
        assert torch.equal(target[slot], want), slot


def _like_layout(view: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed tensor of `dtype` with `view`'s shape and strides (a tier's slot layout), same memory kind."""
    storage_numel = sum(s * (n - 1) for s, n in zip(view.stride(), view.shape)) + 1
    pinned = view.device.type == "cpu" and contracts._is_pinned(view)
    base = torch.zeros(storage_numel, dtype=dtype, device=view.device, pin_memory=pinned)
    return base.as_strided(view.shape, view.stride())


def test_reference_copies_reject_out_of_range_slots():
    slab = torch.zeros(4, 1, 8, 4)
    staging = torch.zeros(2, 1, 8, 4)
    with pytest.raises(LayoutError, match=r"gather_blocks: `slots`.*\[0, 4\)"):
        reference.gather_blocks(staging, slab, torch.tensor([1, 4], dtype=torch.int32))
    with pytest.raises(LayoutError, match=r"scatter_blocks: `slots`"):
        reference.scatter_blocks(slab, staging, torch.tensor([-1, 0], dtype=torch.int32))


def test_copy_vector_bytes():
    assert contracts.copy_vector_bytes(256, 0x1000, 4096, 512) == 16
    assert contracts.copy_vector_bytes(24, 0x1000, 48) == 8
    assert contracts.copy_vector_bytes(256, 0x1004, 4096) == 4
    assert contracts.copy_vector_bytes(6, 0x1000, 6) == 2
    assert contracts.copy_vector_bytes(3, 0x1000) == 1


# ---------------------------------------------------------------- contracts

def _decode_args(**changes):
    case = build_decode_case(tiers=("hot", "warm"), block_size=8, batch=2, max_tokens=20, head_dim=16, seed=6)
    args = dict(zip(["query", "sources", "block_table", "tier_tags", "start_offsets", "seq_lens", "scale"],
                    case.args()))
    for key, change in changes.items():
        args[key] = change(args[key]) if callable(change) else change
    return args


def _replace_source(index, part, fn):
    def change(sources):
        sources = [list(pair) for pair in sources]
        for which in (0, 1) if part is None else (part,):  # None: both k and v
            sources[index][which] = fn(sources[index][which])
        return [tuple(pair) for pair in sources]
    return change


BAD_DECODE = {
    "query dtype": (dict(query=lambda q: q.double()), "query", "float32 or float16 or bfloat16"),
    "query D stride": (dict(query=lambda q: q.transpose(1, 2).contiguous().transpose(1, 2)), "query", "D stride 1"),
    "query head_dim": (dict(query=lambda q: torch.zeros(q.shape[0], q.shape[1], 300)), "query", "D <= 256"),
    "GQA groups": (dict(query=lambda q: torch.zeros(q.shape[0], 3, q.shape[2])), "query", "multiple"),
    "block_table int64": (dict(block_table=lambda t: t.long()), "block_table", "int32"),
    "block_table 1-d": (dict(block_table=lambda t: t[0]), "block_table", "int32 [B, max_blocks]"),
    "block_table rows": (dict(block_table=lambda t: t[:1]), "block_table", "int32 [2, max_blocks]"),
    "tier_tags int16": (dict(tier_tags=lambda t: t.to(torch.int16)), "tier_tags", "int8 or int32"),
    "tier_tags shape": (dict(tier_tags=lambda t: t[:, :1].contiguous()), "tier_tags", "[2, 4]"),
    "start_offsets int64": (dict(start_offsets=lambda t: t.long()), "start_offsets", "int32 [2]"),
    "seq_lens shape": (dict(seq_lens=lambda t: torch.zeros(3, dtype=torch.int32)), "seq_lens", "int32 [2]"),
    "seq_lens not contiguous": (dict(seq_lens=lambda t: torch.zeros(4, dtype=torch.int32)[::2]), "seq_lens",
                                "contiguous"),
    "source dtype": (dict(sources=_replace_source(1, 0, lambda k: k.half())), "sources[1].k", "float32"),
    "source D stride": (dict(sources=_replace_source(0, 0, lambda k: k.transpose(2, 3))), "sources[0].k",
                        "D stride 1"),
    "v shape": (dict(sources=_replace_source(0, 1, lambda v: v[:, :1])), "sources[0].v", "per slot"),
    "v slots": (dict(sources=_replace_source(0, 1, lambda v: v[:-1])), "sources[0].v", "slots"),
    "source 3-d": (dict(sources=_replace_source(1, 0, lambda k: k[0])), "sources[1].k", "[num_slots"),
    "source device": (dict(sources=_replace_source(1, 0, lambda k: torch.empty(k.shape, device="meta"))),
                      "sources[1].k", "on cpu"),
    "source block size": (dict(sources=_replace_source(1, None, lambda k: k[:, :, :4])), "sources[1].k",
                          "like `sources[0].k`"),
    "four sources": (dict(sources=lambda s: list(s) * 2), "sources", "1 to 3"),
    "source not a pair": (dict(sources=lambda s: [s[0][0]]), "sources[0]", "(k, v) pair"),
    "scale nan": (dict(scale=float("nan")), "scale", "finite"),
}


@pytest.mark.parametrize("name", BAD_DECODE)
def test_paged_decode_contract_rejects(name):
    changes, tensor, expected = BAD_DECODE[name]
    args = _decode_args(**changes)
    with pytest.raises(LayoutError, match=re.escape(f"paged_decode: `{tensor}` must be")) as info:
        contracts.check_paged_decode(**args)
    assert expected in str(info.value)
    assert "; got " in str(info.value) or tensor in ("sources", "sources[0]", "scale")
    with pytest.raises(LayoutError, match=re.escape(f"`{tensor}`")):  # the CPU path runs the same check
        reference.paged_decode(**args)


def test_paged_decode_contract_accepts_the_repo_layouts_and_names_cuda():
    shape = contracts.check_paged_decode(**_decode_args())
    assert (shape.batch, shape.num_q_heads, shape.num_kv_heads, shape.head_dim, shape.block_size) == (2, 4, 2, 16, 8)
    with pytest.raises(LayoutError, match=r"paged_decode: `query` must be on a CUDA device"):
        contracts.check_paged_decode(**_decode_args(), require_cuda=True)


BAD_MERGE = {
    "lse dtype": (lambda a, la, b, lb: (a, la.half(), b, lb), "lse_a", "float32 [2, 3]"),
    "lse shape": (lambda a, la, b, lb: (a, la, b, lb[:1]), "lse_b", "float32 [2, 3]"),
    "out_b dtype": (lambda a, la, b, lb: (a, la, b.half(), lb), "out_b", "float32 [2, 3, 8]"),
    "out_b shape": (lambda a, la, b, lb: (a, la, b[:, :2], lb), "out_b", "float32 [2, 3, 8]"),
    "out_a int": (lambda a, la, b, lb: (a.int(), la, b, lb), "out_a", "[B, H, D]"),
    "out_a D stride": (lambda a, la, b, lb: (a.transpose(1, 2).contiguous().transpose(1, 2), la, b, lb), "out_a",
                       "D stride 1"),
}


@pytest.mark.parametrize("name", BAD_MERGE)
def test_merge_contract_rejects(name):
    change, tensor, expected = BAD_MERGE[name]
    args = change(torch.randn(2, 3, 8), torch.randn(2, 3), torch.randn(2, 3, 8), torch.randn(2, 3))
    with pytest.raises(LayoutError, match=re.escape(f"merge_states: `{tensor}` must be")) as info:
        contracts.check_merge_states(*args)
    assert expected in str(info.value)
    with pytest.raises(LayoutError, match=re.escape(f"`{tensor}`")):
        reference.merge_states(*args)


BAD_COPY = {
    "slots int64": (lambda d, s, i: (d, s, i.long()), "slots", "int32"),
    "slots 2-d": (lambda d, s, i: (d, s, i[None]), "slots", "int32 [n]"),
    "dtype mismatch": (lambda d, s, i: (d, s.half(), i), "src", "like `dst`"),
    "shape mismatch": (lambda d, s, i: (d, s[:, :, :4], i), "src", "like `dst`"),
    "D stride": (lambda d, s, i: (d, s.transpose(2, 3), i), "src", "D stride 1"),
    "dst 3-d": (lambda d, s, i: (d[0], s, i), "dst", "[N, H, block_size, D]"),
}


@pytest.mark.parametrize("op", ["gather_blocks", "scatter_blocks"])
@pytest.mark.parametrize("name", BAD_COPY)
def test_copy_contract_rejects(op, name):
    change, tensor, expected = BAD_COPY[name]
    dst, src, slots = change(torch.zeros(4, 2, 8, 8), torch.zeros(4, 2, 8, 8), torch.tensor([1, 3], dtype=torch.int32))
    with pytest.raises(LayoutError, match=re.escape(f"{op}: `{tensor}` must be")) as info:
        contracts.check_block_copy(op, dst, src, slots)
    assert expected in str(info.value)
    with pytest.raises(LayoutError, match=re.escape(f"`{tensor}`")):
        getattr(reference, op)(dst, src, slots)


def test_copy_contract_list_side_too_short_and_cuda_required():
    slots = torch.tensor([0, 1, 2], dtype=torch.int32)
    with pytest.raises(LayoutError, match=r"gather_blocks: `dst` must be at least len\(slots\) = 3"):
        contracts.check_block_copy("gather_blocks", torch.zeros(2, 1, 8, 4), torch.zeros(4, 1, 8, 4), slots)
    with pytest.raises(LayoutError, match=r"scatter_blocks: `src` must be at least len\(slots\) = 3"):
        contracts.check_block_copy("scatter_blocks", torch.zeros(4, 1, 8, 4), torch.zeros(2, 1, 8, 4), slots)
    with pytest.raises(LayoutError, match=r"gather_blocks: `dst` must be on a CUDA device"):
        contracts.check_block_copy("gather_blocks", torch.zeros(4, 1, 8, 4), torch.zeros(4, 1, 8, 4), slots,
                                   require_cuda=True)


# ---------------------------------------------------------------- CUDA wrappers, driven without a GPU

_C_TYPES = {"long long": np.int64, "int": np.int32, "float": np.float32}


def _header_param_types(macro: str) -> list:
    """numpy types of a TKV_*_PARAMS macro's parameters, as the launch must pass them."""
    header = (NATIVE / HEADER_NAME).read_text()
    body = re.search(rf"#define {macro}(?:\(T\))?\s*\\\n(.*?)\n\n", header, re.S).group(1)
    params = [p.strip() for p in body.replace("\\\n", " ").replace("\\", " ").split(",")]
    types = []
    for param in params:
        declared = param.rsplit(" ", 1)[0].replace("const ", "").strip()
        types.append(np.uint64 if declared.endswith("*") else _C_TYPES[declared])
    return types


@pytest.fixture
def recorded_launches(monkeypatch):
    calls = []
    monkeypatch.setattr(cuda, "_REQUIRE_CUDA", False)
    monkeypatch.setattr(cuda, "_takes_cuda_path", lambda *tensors: True)
    monkeypatch.setattr(cuda, "_ptr", lambda t: np.uint64(0 if t is None else t.data_ptr()))
    monkeypatch.setattr(cuda, "_launch", lambda *args: calls.append(args))
    return calls


def _assert_args_match(args, macro):
    types = _header_param_types(macro)
    assert len(args) == len(types), f"{len(args)} arguments for {len(types)} parameters of {macro}"
    for index, (arg, expected) in enumerate(zip(args, types)):
        assert type(arg) is expected, f"{macro} parameter {index}: {type(arg).__name__}, want {expected.__name__}"


@pytest.mark.parametrize("num_sources", [1, 3])
def test_cuda_paged_decode_launch_matches_the_header(recorded_launches, num_sources):
    tiers = ("hot", "warm", "staging")[:num_sources]
    case = build_decode_case(tiers=tiers, block_size=8, batch=2, groups=3, head_dim=16, dtype=torch.bfloat16)
    out, lse = cuda.paged_decode(*case.args())
    # a table of 64 positions: one partition, no workspace, no merge; group 3 -> tile 4, 16-byte loads
    (file_name, kernel, grid, block, args, _), = recorded_launches
    assert (file_name, kernel, grid, block) == ("paged_decode.cu", "paged_decode_g4_bf16", (1, 2, 2), (128, 1, 1))
    _assert_args_match(args, "TKV_DECODE_PARAMS")
    assert int(args[0]) == out.data_ptr() and int(args[1]) == lse.data_ptr()
    k0 = case.sources[0][0]
    assert [int(a) for a in args[7:10]] == list(k0.stride()[:3])  # hot view strides (bs*D, S*bs*D, D)
    assert [int(a) for a in args[-10:-5]] == [2, 3, 16, 8, case.block_table.shape[1]]
    assert [int(a) for a in args[-4:]] == [0, 0, 1, 64]  # no workspace, 1 partition of the table's 64 positions


def test_cuda_paged_decode_split_launches_match_the_header(recorded_launches, monkeypatch):
    monkeypatch.setattr(cuda, "DECODE_PARTITION_TOKENS", 20)  # rounded up to 24 (block_size 8)
    case = build_decode_case(tiers=("hot", "warm"), block_size=8, batch=2, groups=3, head_dim=16,
                             dtype=torch.float16, max_tokens=50)
    max_tokens = case.block_table.shape[1] * 8  # 64
    out, lse = cuda.paged_decode(*case.args())
    (decode, merge) = recorded_launches
    assert decode[:4] == ("paged_decode.cu", "paged_decode_g4_f16", (3, 2, 2), (128, 1, 1))
    assert merge[:4] == ("merge_partitions.cu", "merge_partitions_f16", (6, 2, 1), (128, 1, 1))
    _assert_args_match(decode[4], "TKV_DECODE_PARAMS")
    _assert_args_match(merge[4], "TKV_PARTITION_MERGE_PARAMS")
    part_out, part_lse, num_partitions, partition_size = (int(a) for a in decode[4][-4:])
    assert part_out and part_lse and (num_partitions, partition_size) == (3, 24)
    merge_args = [int(a) for a in merge[4]]
    assert merge_args[:4] == [out.data_ptr(), lse.data_ptr(), part_out, part_lse]
    assert merge_args[4:6] == [case.start_offsets.data_ptr(), case.seq_lens.data_ptr()]
    assert merge_args[6:] == [6, 16, 3, 24, max_tokens]


def test_cuda_paged_decode_picks_scalar_loads_and_group_tiles(recorded_launches):
    case = build_decode_case(tiers=("hot",), block_size=8, batch=2, groups=12, num_kv_heads=1, head_dim=16)
    cuda.paged_decode(*case.args())
    (k, v) = case.sources[0]
    shifted = torch.zeros(k.numel() + 1)[1:].view(k.shape)  # 4 bytes off 16-byte alignment
    cuda.paged_decode(case.query, [(shifted, v)], *case.args()[2:])
    odd = build_decode_case(tiers=("hot",), block_size=8, batch=2, groups=1, head_dim=6, dtype=torch.float16)
    cuda.paged_decode(*odd.args())  # 6 halves: 12-byte rows
    (tiled, misaligned, narrow) = recorded_launches
    assert tiled[1:3] == ("paged_decode_g8_f32", (1, 2, 2))  # 12 q heads per kv head: 2 tiles of 8
    assert misaligned[1:3] == ("paged_decode_scalar_f32", (1, 2, 2))
    assert narrow[1:3] == ("paged_decode_scalar_f16", (1, 2, 2))
    for call in recorded_launches:
        _assert_args_match(call[4], "TKV_DECODE_PARAMS")


def test_decode_group_tile():
    assert [cuda.decode_group_tile(g) for g in (1, 2, 3, 4, 5, 8, 9, 16, 32)] == [1, 2, 4, 4, 8, 8, 8, 8, 8]


def test_decode_partitions():
    sms = 132
    # a table of at most 256 positions (or one block): one partition covering it, no merge
    assert cuda.decode_partitions(160, 8, 4, sms) == (160, 1)
    assert cuda.decode_partitions(256, 16, 4, sms) == (256, 1)
    assert cuda.decode_partitions(1024, 1024, 4, sms) == (1024, 1)
    # long rows, few CTAs per partition: 256-position partitions
    assert cuda.decode_partitions(3008, 16, 2, sms) == (256, 12)
    # many rows: partitions grow until the grid fits 32 CTAs per SM; a big batch needs no split
    size, count = cuda.decode_partitions(131072, 16, 64 * 8, sms)
    assert count * 64 * 8 <= cuda.PARTITION_CTAS_PER_SM * sms < 2 * count * 64 * 8 and size * count >= 131072
    assert cuda.decode_partitions(4096, 16, 8192, sms) == (4096, 1)
    for max_tokens, block_size, row_ctas in ((3000 // 32 * 32, 32, 3), (70000, 512, 16), (9000, 8, 1000)):
        size, count = cuda.decode_partitions(max_tokens, block_size, row_ctas, sms)
        assert size % block_size == 0 and size >= cuda.PARTITION_MIN_TOKENS and (count - 1) * size < max_tokens
        assert count * size >= max_tokens
    # forced (tests): rounded up to whole blocks
    assert cuda.decode_partitions(64, 8, 4, sms, forced=20) == (24, 3)
    assert cuda.decode_partitions(64, 8, 4, sms, forced=64) == (64, 1)


def test_decode_vector_loads():
    k = torch.zeros(4, 2, 8, 16, dtype=torch.float16)
    pair = [(k, k)]
    aligned = [(0x1000, 0x2000)]
    assert cuda.decode_vector_loads(pair, aligned, 16, 2)
    assert not cuda.decode_vector_loads(pair, [(0x1008, 0x2000)], 16, 2)  # base not 16-byte aligned
    assert not cuda.decode_vector_loads([(k[..., :12], k[..., :12])], aligned, 12, 2)  # D not a multiple of 8
    strided = torch.zeros(4, 2, 9, 16, dtype=torch.float16)[:, :, :8]  # token stride 16, head stride 144
    assert cuda.decode_vector_loads([(strided, strided)], aligned, 16, 2)
    odd_head = torch.zeros(4, 1, 8, 18, dtype=torch.float32)[..., :16]  # token stride 18: 72 bytes
    assert not cuda.decode_vector_loads([(odd_head, odd_head)], aligned, 16, 4)
    one_head = torch.zeros(4, 3, 8, 16)[:, 1:2]  # H_kv = 1: its stride never moves a pointer
    assert one_head.stride(1) % 4 == 0 and cuda.decode_vector_loads([(one_head, one_head)], aligned, 16, 4)
    weird = one_head.as_strided(one_head.shape, (one_head.stride(0), 3, 16, 1))
    assert cuda.decode_vector_loads([(weird, weird)], aligned, 16, 4)


def test_cuda_merge_and_copy_launches_match_the_header(recorded_launches):
    out_a = torch.randn(2, 3, 8, dtype=torch.float16)
    cuda.merge_states(out_a, torch.zeros(2, 3), out_a.clone(), torch.zeros(2, 3))
    slab = make_sources(1, 6, 2, 8, 16, torch.float32, torch.device("cpu"), fill=0.0)[0][0]
    staging = torch.zeros(3, 2, 8, 16)
    slots = torch.tensor([5, 0, 3], dtype=torch.int32)
    cuda.gather_blocks(staging, slab, slots)
    cuda.scatter_blocks(slab, staging, slots)
    (merge, gather, scatter) = recorded_launches
    assert merge[:4] == ("merge_states.cu", "merge_states_f16", (3, 2, 1), (128, 1, 1))
    _assert_args_match(merge[4], "TKV_MERGE_PARAMS")
    for call, op in ((gather, "gather_blocks"), (scatter, "scatter_blocks")):
        assert call[:4] == (f"{op}.cu", op, (3, 2, 1), (128, 1, 1))
        _assert_args_match(call[4], "TKV_COPY_PARAMS")
        assert int(call[4][-1]) == 16 and int(call[4][-2]) == 64  # 16-byte units, rows of 16 fp32
    assert [int(a) for a in gather[4][5:8]] == [s * 4 for s in slab.stride()[:3]]  # src strides in bytes


@pytest.mark.parametrize("name", ["block_table int64", "source D stride", "tier_tags int16"])
def test_cuda_wrapper_never_launches_on_a_failed_check(recorded_launches, name):
    changes, tensor, _ = BAD_DECODE[name]
    with pytest.raises(LayoutError, match=re.escape(f"`{tensor}`")):
        cuda.paged_decode(**_decode_args(**changes))
    with pytest.raises(LayoutError, match=r"`slots`"):
        cuda.gather_blocks(torch.zeros(2, 1, 8, 4), torch.zeros(4, 1, 8, 4), torch.tensor([0, 1]))
    with pytest.raises(LayoutError, match=r"`lse_a`"):
        cuda.merge_states(torch.zeros(1, 1, 4), torch.zeros(1, 1).half(), torch.zeros(1, 1, 4), torch.zeros(1, 1))
    assert recorded_launches == []


def test_cuda_wrapper_refuses_cpu_tensors_when_a_launch_would_follow(monkeypatch):
    calls = []
    monkeypatch.setattr(cuda, "_takes_cuda_path", lambda *tensors: True)
    monkeypatch.setattr(cuda, "_launch", lambda *args: calls.append(args))
    with pytest.raises(LayoutError, match=r"paged_decode: `query` must be on a CUDA device"):
        cuda.paged_decode(**_decode_args())
    assert calls == []


# ---------------------------------------------------------------- kernels emulated on the CPU (g++ host build)

@pytest.fixture
def emulated(monkeypatch):
    """cuda's wrappers launch the host build of native/*.cu (emulation.py) on CPU tensors."""
    emulation.route(monkeypatch.setattr)
    calls = []
    monkeypatch.setattr(cuda, "_launch", lambda *args: (calls.append(args[1:3]), emulation.launch(*args))[1])
    return calls


def _poison_rows(case, block_size):
    """Row 1 empty, row 2 a slot past its source in its last block, row 3 an unknown tag in its last block."""
    starts = case.start_offsets.clone()
    starts[1] = case.seq_lens[1]
    table, tags = case.block_table.clone(), case.tier_tags.clone()
    table[2, (int(case.seq_lens[2]) - 1) // block_size] = case.sources[0][0].shape[0] + 5
    tags[3, (int(case.seq_lens[3]) - 1) // block_size] = len(case.sources)
    return case.query, case.sources, table, tags, starts, case.seq_lens, case.scale


def _assert_poisoned_rows(out, lse):
    assert bool((out[1] == 0).all()) and bool((lse[1] == float("-inf")).all())
    for row in (2, 3):
        assert bool(out[row].isnan().all()) and bool(lse[row].isnan().all())
    assert not out[0].isnan().any() and not lse[0].isnan().any()


@needs_host_build
@pytest.mark.parametrize("partition", [None, 32], ids=["one_partition", "split"])
def test_emulated_paged_decode_matches_reference(emulated, monkeypatch, partition):
    # fp16, GQA 3 (tile 4), D 80: 16-byte loads, 10 units per row (16-lane slices with 6 idle lanes)
    monkeypatch.setattr(cuda, "DECODE_PARTITION_TOKENS", partition)
    case = build_decode_case(dtype=torch.float16, block_size=16, tiers=("hot", "warm", "staging"), groups=3,
                             head_dim=80, batch=5, max_tokens=90, seed=11)
    out, lse = cuda.paged_decode(*case.args())
    want_out, want_lse = reference.paged_decode(*case.args())
    torch.testing.assert_close(out.float(), want_out.float(), atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-5)
    args = _poison_rows(case, 16)
    out, lse = cuda.paged_decode(*args)
    _assert_poisoned_rows(out, lse)
    want_out, want_lse = reference.paged_decode(*args)
    torch.testing.assert_close(out[[0, 4]].float(), want_out[[0, 4]].float(), atol=2e-3, rtol=2e-3)
    kernels = [name for name, _ in emulated]
    assert set(kernels) == ({"paged_decode_g4_f16"} if partition is None
                            else {"paged_decode_g4_f16", "merge_partitions_f16"})


@needs_host_build
def test_emulated_paged_decode_scalar_loads_and_group_tiles(emulated, monkeypatch):
    # bf16 D 36 (not whole 16-byte units): element loads; 12 q heads per kv head: two tiles of 8
    monkeypatch.setattr(cuda, "DECODE_PARTITION_TOKENS", 16)
    case = build_decode_case(dtype=torch.bfloat16, block_size=8, tiers=("hot", "warm"), groups=12, num_kv_heads=1,
                             head_dim=36, batch=2, max_tokens=40, seed=12)
    out, lse = cuda.paged_decode(*case.args())
    want_out, want_lse = reference.paged_decode(*case.args())
    torch.testing.assert_close(out.float(), want_out.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-5)
    assert emulated[0] == ("paged_decode_scalar_bf16", (3, 2, 2))


@needs_host_build
def test_emulated_paged_decode_wide_rows_no_tags(emulated, monkeypatch):
    # fp32 D 256 (two 16-byte units per lane), MHA, tags None (all hot), partitions of one block
    monkeypatch.setattr(cuda, "DECODE_PARTITION_TOKENS", 8)
    case = build_decode_case(dtype=torch.float32, block_size=8, tiers=("hot",), groups=1, head_dim=256, batch=2,
                             max_tokens=30, seed=13)
    args = (case.query, case.sources, case.block_table, None, case.start_offsets, case.seq_lens, case.scale)
    out, lse = cuda.paged_decode(*args)
    want_out, want_lse = _expected(case)
    torch.testing.assert_close(out, want_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)
    assert emulated[0][0] == "paged_decode_g1_f32" and emulated[1][0] == "merge_partitions_f32"


@needs_host_build
def test_emulated_merge_and_copies_match_reference(emulated):
    gen = torch.Generator().manual_seed(14)
    out_a, out_b = (torch.randn(2, 3, 40, generator=gen).half() for _ in (0, 1))
    lse_a, lse_b = (torch.randn(2, 3, generator=gen) for _ in (0, 1))
    lse_a[0, 0] = float("-inf")
    lse_a[1, 1] = lse_b[1, 1] = float("-inf")
    got, want = cuda.merge_states(out_a, lse_a, out_b, lse_b), reference.merge_states(out_a, lse_a, out_b, lse_b)
    torch.testing.assert_close(got[0], want[0], atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(got[1], want[1], atol=1e-6, rtol=1e-6)
    slab = torch.randn(6, 2, 8, 12, generator=gen)
    slots = torch.tensor([4, 0, 5], dtype=torch.int32)
    got, want = torch.zeros(3, 2, 8, 12), torch.zeros(3, 2, 8, 12)
    cuda.gather_blocks(got, slab, slots)
    reference.gather_blocks(want, slab, slots)
    assert torch.equal(got, want)
    target, expected = torch.zeros_like(slab), torch.zeros_like(slab)
    cuda.scatter_blocks(target, got, slots)
    reference.scatter_blocks(expected, got, slots)
    assert torch.equal(target, expected)


# ---------------------------------------------------------------- backend choice and self-check

def test_backend_choice_without_cuda_is_the_reference(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with caplog.at_level("INFO", logger="tiered_kv.kernels.backend"):
        ops = backend.choose_ops()
    assert ops.backend == "torch" and ops.paged_decode is reference.paged_decode
    assert ops.fallback_reason == "torch.cuda.is_available() is False"
    assert "torch reference ops (torch.cuda.is_available() is False)" in caplog.text
    monkeypatch.setenv(backend.FORCE_ENV, "torch")
    assert backend.choose_ops().fallback_reason == f"{backend.FORCE_ENV}=torch"


def test_ops_is_chosen_once():
    import tiered_kv.kernels as kernels

    assert kernels.ops is kernels.ops is backend.get_ops()
    assert kernels.ops.backend in ("cuda", "torch")
    assert (kernels.ops.backend == "cuda") == GPU or kernels.ops.fallback_reason


def test_selfcheck_on_cpu_reports_every_op():
    report = selfcheck("cpu", dtypes=(torch.float32,), block_sizes=(8,), tier_mixes=(("hot", "warm"),),
                       head_dim=16)
    assert set(report["paged_decode"]) == {"float32/bs8/hot+warm", "float32/bs8/hot+warm/split1200"}
    assert set(report["gather_blocks"]) == {f"float32/bs8/{t}" for t in TIERS}
    assert set(report["merge_states"]) == {"float32"}
    assert set(report["dequant_blocks"]) == {f"float32/bs8/{m}" for m in ("fp8", "int8", "int4")}
    assert set(report["quant_blocks"]) == {f"float32/bs8/{m}" for m in ("fp8", "int8", "int4")}
    if report["backend"] == "torch":
        assert all(error == 0.0 for error in report["dequant_blocks"].values())
        assert all(mismatches == 0 for mismatches in report["quant_blocks"].values())
        assert report["paged_decode"]["float32/bs8/hot+warm"] == {"out": 0.0, "lse": 0.0}


def test_max_abs_error_counts_matching_infinities_and_nans_as_equal():
    a = torch.tensor([1.0, float("-inf"), float("nan"), 2.0])
    assert max_abs_error(a, a.clone()) == 0.0
    assert max_abs_error(a, torch.tensor([1.0, float("-inf"), float("nan"), 2.5])) == 0.5
    assert max_abs_error(a, torch.tensor([1.0, 0.0, float("nan"), 2.0])) == float("inf")


# ---------------------------------------------------------------- GPU: kernels vs the torch reference

GPU_DTYPES = [torch.float16, torch.bfloat16, torch.float32]
OUT_TOL = {torch.float16: 2e-3, torch.bfloat16: 2e-2, torch.float32: 2e-5}
GPU_TIERS = [("hot",), ("warm",), ("staging",), ("hot", "warm", "staging")]


@needs_gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("tiers", GPU_TIERS, ids=["+".join(t) for t in GPU_TIERS])
def test_gpu_paged_decode_matches_reference(dtype, block_size, tiers):
    case = build_decode_case(dtype=dtype, block_size=block_size, tiers=tiers, groups=4, num_kv_heads=2,
                             head_dim=128, batch=4, max_tokens=150, device="cuda", seed=block_size)
    out, lse = cuda.paged_decode(*case.args())
    want_out, want_lse = reference.paged_decode(*case.args())
    torch.cuda.synchronize()
    assert out.dtype == dtype and lse.dtype == torch.float32 and not out.isnan().any()
    torch.testing.assert_close(out.float(), want_out.float(), atol=OUT_TOL[dtype], rtol=OUT_TOL[dtype])
    torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-5)


@needs_gpu
@pytest.mark.parametrize("head_dim", [64, 80, 256])
@pytest.mark.parametrize("tag_dtype", [torch.int8, torch.int32], ids=["tags8", "tags32"])
def test_gpu_paged_decode_head_dims_and_tag_types(head_dim, tag_dtype):
    case = build_decode_case(dtype=torch.float32, block_size=16, tiers=("hot", "warm", "staging"), groups=3,
                             head_dim=head_dim, tag_dtype=tag_dtype, device="cuda", seed=head_dim)
    out, lse = cuda.paged_decode(*case.args())
    want_out, want_lse = _expected(case)
    torch.testing.assert_close(out.cpu(), want_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse.cpu().double(), want_lse, atol=1e-4, rtol=1e-5)


@needs_gpu
def test_gpu_paged_decode_empty_poisoned_and_untagged_rows():
    case = build_decode_case(tiers=("hot",), block_size=8, batch=3, device="cuda", seed=7)
    want_out, _ = reference.paged_decode(*case.args())
    starts = case.start_offsets.clone()
    starts[1] = case.seq_lens[1]
    table = case.block_table.clone()
    table[2, int(case.start_offsets[2]) // 8] = case.sources[0][0].shape[0]
    out, lse = cuda.paged_decode(case.query, case.sources, table, None, starts, case.seq_lens, case.scale)
    torch.testing.assert_close(out[0], want_out[0], atol=2e-5, rtol=2e-5)
    assert bool((out[1] == 0).all()) and bool((lse[1] == float("-inf")).all())
    assert bool(out[2].isnan().all()) and bool(lse[2].isnan().all())


@needs_gpu
def test_gpu_paged_decode_runs_on_the_current_stream():
    case = build_decode_case(tiers=("hot", "warm"), block_size=16, device="cuda", seed=8)
    want_out, _ = reference.paged_decode(*case.args())
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out, _ = cuda.paged_decode(*case.args())
        out = out.clone()  # ordered after the kernel only when both ran on `side`
    side.synchronize()
    torch.testing.assert_close(out, want_out, atol=2e-5, rtol=2e-5)


@needs_gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=["fp16", "bf16", "fp32"])
def test_gpu_merge_states_matches_reference_and_full_attention(dtype):
    case = build_decode_case(dtype=dtype, tiers=("hot", "warm"), block_size=16, max_tokens=90, groups=2,
                             device="cuda", seed=9)
    (out_a, lse_a), (out_b, lse_b) = _split_runs(case, 40, decode=cuda.paged_decode)
    out, lse = cuda.merge_states(out_a, lse_a, out_b, lse_b)
    want_out, want_lse = reference.merge_states(out_a, lse_a, out_b, lse_b)
    torch.testing.assert_close(out.float(), want_out.float(), atol=OUT_TOL[dtype], rtol=OUT_TOL[dtype])
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-6)
    full_out, full_lse = cuda.paged_decode(*case.args())
    torch.testing.assert_close(out.float(), full_out.float(), atol=2 * OUT_TOL[dtype], rtol=2 * OUT_TOL[dtype])
    torch.testing.assert_close(lse, full_lse, atol=1e-4, rtol=1e-5)
    lse_a[0, 0] = lse_b[0, 0] = float("-inf")  # both sides empty
    out, lse = cuda.merge_states(out_a, lse_a, out_b, lse_b)
    assert bool((out[0, 0] == 0).all()) and float(lse[0, 0]) == float("-inf")


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.uint8],
                         ids=["fp16", "bf16", "fp32", "u8"])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("tier", TIERS)
def test_gpu_gather_scatter_match_reference(dtype, block_size, tier):
    gen = torch.Generator().manual_seed(block_size)
    tag = TIERS.index(tier)
    head_dim = 13 if dtype == torch.uint8 else 64  # 13 bytes: the byte-by-byte path
    (layout, _), = make_sources(tag + 1, 9, 3, block_size, head_dim, torch.float32, torch.device("cuda"),
                                fill=0.0)[tag:]
    slab = _like_layout(layout, dtype)
    slab.copy_((torch.randn(slab.shape, generator=gen) * 50).to(dtype))
    slots = torch.tensor([4, 8, 0, 5], dtype=torch.int32, device="cuda")
    staging = torch.zeros(5, 3, block_size, head_dim, dtype=dtype, device="cuda")
    cuda.gather_blocks(staging, slab, slots)
    want = torch.zeros_like(staging)
    reference.gather_blocks(want, slab, slots)
    torch.cuda.synchronize()
    assert torch.equal(staging.cpu(), want.cpu())

    source = (torch.randn(staging.shape, generator=gen) * 50).to(dtype).cuda()
    got_slab, want_slab = _like_layout(layout, dtype), _like_layout(layout, dtype)
    got_slab.copy_(slab)
    want_slab.copy_(slab)
    cuda.scatter_blocks(got_slab, source, slots)
    reference.scatter_blocks(want_slab, source, slots)
    torch.cuda.synchronize()
    assert torch.equal(got_slab.cpu(), want_slab.cpu())


@needs_gpu
def test_gpu_copies_skip_out_of_range_slots():
    slab = torch.arange(4 * 8 * 4, dtype=torch.float32, device="cuda").view(4, 1, 8, 4)
    staging = torch.full((2, 1, 8, 4), -1.0, device="cuda")
    cuda.gather_blocks(staging, slab, torch.tensor([1, 4], dtype=torch.int32, device="cuda"))
    torch.cuda.synchronize()
    assert torch.equal(staging[0], slab[1]) and bool((staging[1] == -1).all())


@needs_gpu
def test_gpu_ops_backend_and_selfcheck():
    import tiered_kv.kernels as kernels

    assert kernels.ops.backend == "cuda", kernels.ops.fallback_reason
    report = selfcheck("cuda", head_dim=128)
    for key, errors in report["paged_decode"].items():
        tol = OUT_TOL[getattr(torch, key.split("/")[0])]
        assert errors["out"] <= tol and errors["lse"] <= 1e-4, (key, errors)
    for op in ("gather_blocks", "scatter_blocks", "dequant_blocks", "quant_blocks"):
        assert all(error == 0 for error in report[op].values()), report[op]
    for name, errors in report["merge_states"].items():
        assert errors["out"] <= OUT_TOL[getattr(torch, name)] and errors["lse"] <= 1e-5, (name, errors)


# ---------------------------------------------------------------- GPU: the split decode (partitions + merge)

def _launch_names(monkeypatch):
    """(kernel, grid) of every launch from cuda's wrappers; each still launches."""
    calls = []
    real = cuda._launch

    def launch(file_name, kernel, grid, block, args, device):
        calls.append((kernel, grid))
        real(file_name, kernel, grid, block, args, device)

    monkeypatch.setattr(cuda, "_launch", launch)
    return calls


@needs_gpu
@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
@pytest.mark.parametrize("groups", [1, 3, 8], ids=["mha", "gqa3", "gqa8"])
def test_gpu_paged_decode_long_rows_split_into_partitions(monkeypatch, head_dim, groups):
    calls = _launch_names(monkeypatch)
    case = build_decode_case(dtype=torch.float32, block_size=16, tiers=("hot", "warm", "staging"), groups=groups,
                             num_kv_heads=2, head_dim=head_dim, batch=3, max_tokens=3000, device="cuda",
                             seed=head_dim + groups)
    out, lse = cuda.paged_decode(*case.args())
    want_out, want_lse = _expected(case)
    torch.testing.assert_close(out.cpu(), want_out, atol=5e-5, rtol=5e-5)
    torch.testing.assert_close(lse.cpu().double(), want_lse, atol=1e-4, rtol=1e-5)
    (decode, grid), (merge, _) = calls
    assert decode == f"paged_decode_g{cuda.decode_group_tile(groups)}_f32" and merge == "merge_partitions_f32"
    assert grid[0] > 1  # several partitions


@needs_gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("groups", [1, 3, 8], ids=["mha", "gqa3", "gqa8"])
def test_gpu_paged_decode_long_rows_dtypes(dtype, groups):
    case = build_decode_case(dtype=dtype, block_size=32, tiers=("hot", "warm", "staging"), groups=groups,
                             num_kv_heads=2, head_dim=128, batch=3, max_tokens=3000, device="cuda", seed=groups)
    out, lse = cuda.paged_decode(*case.args())
    want_out, want_lse = reference.paged_decode(*case.args())
    torch.cuda.synchronize()
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), want_out.float(), atol=OUT_TOL[dtype], rtol=OUT_TOL[dtype])
    torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-5)


@needs_gpu
def test_gpu_paged_decode_padding_and_ends_across_partition_boundaries():
    case = build_decode_case(dtype=torch.float16, block_size=16, tiers=("hot", "warm", "staging"), groups=3,
                             num_kv_heads=2, head_dim=128, batch=1, max_tokens=3000, left_pad=False, device="cuda",
                             seed=22)
    # row 0 of the case has all 3000 positions: every row below reads a window of it
    windows = [(700, 3000), (2999, 3000), (0, 257), (256, 512), (1000, 1000), (255, 769), (0, 3000)]
    pick = [0] * len(windows)
    starts = torch.tensor([w[0] for w in windows], dtype=torch.int32, device="cuda")
    ends = torch.tensor([w[1] for w in windows], dtype=torch.int32, device="cuda")
    args = (case.query[pick].contiguous(), case.sources, case.block_table[pick].contiguous(),
            case.tier_tags[pick].contiguous(), starts, ends, case.scale)
    out, lse = cuda.paged_decode(*args)
    want_out, want_lse = reference.paged_decode(*args)
    torch.testing.assert_close(out.float(), want_out.float(), atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-5)
    assert bool((out[4] == 0).all()) and bool((lse[4] == float("-inf")).all())  # the empty window


@needs_gpu
@pytest.mark.parametrize("partition", [8, 24, None], ids=["per_block", "3_blocks", "auto"])
def test_gpu_paged_decode_split_empty_poisoned_and_untagged_rows(monkeypatch, partition):
    monkeypatch.setattr(cuda, "DECODE_PARTITION_TOKENS", partition)
    case = build_decode_case(tiers=("hot", "warm"), block_size=8, batch=5, max_tokens=60, groups=2, device="cuda",
                             seed=23)
    want_out, want_lse = reference.paged_decode(*case.args())
    out, lse = cuda.paged_decode(*case.args())
    torch.testing.assert_close(out, want_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)
    out, lse = cuda.paged_decode(*_poison_rows(case, 8))
    _assert_poisoned_rows(out, lse)
    torch.testing.assert_close(out[[0, 4]], want_out[[0, 4]], atol=2e-5, rtol=2e-5)
    hot = build_decode_case(tiers=("hot",), block_size=8, batch=3, max_tokens=60, device="cuda", seed=24)
    args = (hot.query, hot.sources, hot.block_table, None, hot.start_offsets, hot.seq_lens, hot.scale)
    torch.testing.assert_close(cuda.paged_decode(*args)[0], reference.paged_decode(*args)[0], atol=2e-5, rtol=2e-5)


@needs_gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("head_dim", [64, 34, 3])  # 34, 3: rows never whole 16-byte units
def test_gpu_paged_decode_scalar_loads(monkeypatch, dtype, head_dim):
    calls = _launch_names(monkeypatch)
    case = build_decode_case(dtype=dtype, block_size=16, tiers=("hot", "warm"), groups=3, head_dim=head_dim,
                             batch=3, max_tokens=700, device="cuda", seed=head_dim)
    sources = list(case.sources)
    if head_dim == 64:  # whole 16-byte units, but source 0 one element off 16-byte alignment
        def shifted(t):
            base = torch.full((t.numel() + 1,), float("nan"), dtype=t.dtype, device=t.device)
            view = base[1:].view(t.shape)
            view.copy_(t)
            return view
        sources[0] = tuple(shifted(t) for t in sources[0])
    args = (case.query, sources, case.block_table, case.tier_tags, case.start_offsets, case.seq_lens, case.scale)
    out, lse = cuda.paged_decode(*args)
    want_out, want_lse = reference.paged_decode(*args)
    torch.testing.assert_close(out.float(), want_out.float(), atol=OUT_TOL[dtype], rtol=OUT_TOL[dtype])
    torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-5)
    assert calls[0][0] == f"paged_decode_scalar_{cuda._DTYPE_SUFFIX[dtype]}"


@needs_gpu
@pytest.mark.parametrize("groups", [12, 16])
def test_gpu_paged_decode_groups_larger_than_a_tile(monkeypatch, groups):
    calls = _launch_names(monkeypatch)
    case = build_decode_case(dtype=torch.float16, block_size=16, tiers=("hot", "warm", "staging"), groups=groups,
                             num_kv_heads=2, head_dim=128, batch=2, max_tokens=1500, device="cuda", seed=groups)
    out, lse = cuda.paged_decode(*case.args())
    want_out, want_lse = reference.paged_decode(*case.args())
    torch.testing.assert_close(out.float(), want_out.float(), atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-5)
    assert calls[0][0] == "paged_decode_g8_f16" and calls[0][1][1] == 2 * -(-groups // 8)


@needs_gpu
def test_gpu_split_paged_decode_runs_on_the_current_stream():
    case = build_decode_case(tiers=("hot", "warm"), block_size=16, max_tokens=1000, device="cuda", seed=25)
    want_out, _ = reference.paged_decode(*case.args())
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out, _ = cuda.paged_decode(*case.args())  # workspace and both kernels on `side`
        out = out.clone()
    side.synchronize()
    torch.testing.assert_close(out, want_out, atol=2e-5, rtol=2e-5)


# ---------------------------------------------------------------- dequant_blocks (compressed lower tiers)

DEQUANT_MODES = ("fp8", "int8", "int4")


def _dequant_case(mode: str, count: int = 3, layers: int = 2, heads: int = 2, block_size: int = 8, head_dim: int = 16,
                  seed: int = 0):
    """Packed slices of `count` blocks (with an outlier key channel and a wide value range, zeros in
    one block) and what the torch codec makes of them."""
    from tiered_kv.compression import codec

    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randn(count, layers, 2, heads, block_size, head_dim, generator=gen) * 3
    blocks[..., 0, :, :, 1] += 20
    blocks[..., 1, :, 2, :] *= 1e-4  # one value token tiny: fp8 subnormals
    blocks[-1] = 0
    return codec.encode(blocks, mode), blocks


def _hot_slot_view(num_slots: int, layers: int, heads: int, block_size: int, head_dim: int, dtype):
    """A hot slab `[L, 2, H, S*bs, D]` (NaN-filled) and its slot-major view `[S, L, 2, H, bs, D]`."""
    slab = torch.full((layers, 2, heads, num_slots * block_size, head_dim), float("nan"), dtype=dtype)
    return slab, slab.view(layers, 2, heads, num_slots, block_size, head_dim).permute(3, 0, 1, 2, 4, 5)


@needs_host_build
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("mode", DEQUANT_MODES)
def test_emulated_dequant_blocks_matches_the_torch_codec_bit_for_bit(emulated, mode, dtype):
    packed, _ = _dequant_case(mode)
    # straight into hot slots (a strided view), slot list with one out of range (skipped)
    slab, view = _hot_slot_view(6, 2, 2, 8, 16, dtype)
    want_slab, want_view = _hot_slot_view(6, 2, 2, 8, 16, dtype)
    slots = torch.tensor([4, 0, 9], dtype=torch.int32)
    cuda.dequant_blocks(view, packed, slots, mode)
    reference.dequant_blocks(want_view, packed[:2], slots[:2], mode)
    assert torch.equal(slab.isnan(), want_slab.isnan())  # slot 9 skipped; nothing else written
    assert torch.equal(slab.nan_to_num(), want_slab.nan_to_num())
    # into a contiguous staging buffer, no slot list
    staging, want = torch.zeros(3, 2, 2, 2, 8, 16, dtype=dtype), torch.zeros(3, 2, 2, 2, 8, 16, dtype=dtype)
    cuda.dequant_blocks(staging, packed, None, mode)
    reference.dequant_blocks(want, packed, None, mode)
    assert torch.equal(staging, want) and bool((staging[-1] == 0).all())
    assert [name for name, _ in emulated] == [f"dequant_blocks_{cuda._DTYPE_SUFFIX[dtype]}"] * 2


@needs_host_build
@pytest.mark.parametrize("mode", DEQUANT_MODES)
@pytest.mark.parametrize("block_size,head_dim", [(1, 8), (16, 64), (4, 34)], ids=["bs1", "bs16-d64", "bs4-d34"])
def test_emulated_dequant_follows_every_part_of_codec_version_3(emulated, mode, block_size, head_dim):
    """Token 0 apart (fp8, int4; none with one token a block), int4 values in groups of 32 channels
    (D 64) or whole (D 34), bit for bit the torch codec."""
    from tiered_kv.compression import codec

    blocks = torch.randn(2, 1, 2, 2, block_size, head_dim, generator=torch.Generator().manual_seed(5)) * 3
    blocks[..., 0, :, :, 1] += 20
    packed = codec.encode(blocks, mode)
    got = torch.zeros(2, 1, 2, 2, block_size, head_dim)
    want = torch.zeros_like(got)
    cuda.dequant_blocks(got, packed, None, mode)
    reference.dequant_blocks(want, packed, None, mode)
    assert torch.equal(got, want)


def test_reference_dequant_is_the_codec_and_within_the_modes_bound():
    from tiered_kv.compression import codec

    for mode in DEQUANT_MODES:
        packed, blocks = _dequant_case(mode, seed=3)
        got = torch.zeros_like(blocks)
        reference.dequant_blocks(got, packed, None, mode)
        assert torch.equal(got, codec.decode(packed, mode, 2, 8, 16))
        assert bool(((got - blocks).abs() <= codec.error_bound(blocks, mode) + 1e-6).all())


def test_cuda_dequant_launch_matches_the_header(recorded_launches):
    packed, _ = _dequant_case("int4", count=2, layers=3, heads=2, block_size=4, head_dim=8)
    _, view = _hot_slot_view(5, 3, 2, 4, 8, torch.bfloat16)
    cuda.dequant_blocks(view, packed, torch.tensor([3, 1], dtype=torch.int32), "int4")
    (call,) = recorded_launches
    assert call[:4] == ("dequant_blocks.cu", "dequant_blocks_bf16", (2, 3, 4), (128, 1, 1))
    _assert_args_match(call[4], "TKV_DEQUANT_PARAMS")
    assert [int(a) for a in call[4][1:6]] == list(view.stride()[:5]) and int(call[4][6]) == 5
    assert int(call[4][-10]) == contracts.DEQUANT_MODES["int4"] == 2
    assert [int(a) for a in call[4][-9:]] == list(contracts.dequant_layout_args("int4", 2, 4, 8))


DEQUANT_BAD = {
    "mode": (lambda d, s, sl: (d, s, sl, "int2"), r"`mode` must be one of"),
    "dst rank": (lambda d, s, sl: (d[0], s, sl, "int8"), r"`dst` must be float32"),
    "dst dtype": (lambda d, s, sl: (d.double(), s, sl, "int8"), r"`dst` must be float32"),
    "src bytes": (lambda d, s, sl: (d, s[..., 1:], sl, "int8"), r"`src` must be uint8 \[n, 2, "),
    "src dtype": (lambda d, s, sl: (d, s.to(torch.int16), sl, "int8"), r"`src` must be uint8"),
    "src odd": (lambda d, s, sl: (d, torch.zeros(s.numel() + 1, dtype=torch.uint8)[1:].view(s.shape), sl, "int8"),
                r"`src` must be .*even address"),
    "slots dtype": (lambda d, s, sl: (d, s, sl.long(), "int8"), r"`slots` must be int32"),
    "too few slots": (lambda d, s, sl: (d[:1], s, None, "int8"), r"`dst` must be at least n = 2"),
    "int4 odd D": (lambda d, s, sl: (d[..., :15], s, sl, "int4"), r"`dst` must be an even D"),
}


@pytest.mark.parametrize("name", sorted(DEQUANT_BAD))
def test_dequant_contract_rejects(recorded_launches, name):
    packed, blocks = _dequant_case("int8", count=2)
    make, message = DEQUANT_BAD[name]
    args = make(torch.zeros_like(blocks), packed, torch.tensor([1, 0], dtype=torch.int32))
    with pytest.raises(LayoutError, match=message):
        cuda.dequant_blocks(*args)
    with pytest.raises(LayoutError, match=message):
        reference.dequant_blocks(*args)
    assert recorded_launches == []


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("mode", DEQUANT_MODES)
def test_gpu_dequant_blocks_match_the_reference_from_device_and_pinned_memory(mode, dtype):
    packed, _ = _dequant_case(mode, count=5, layers=3, heads=3, block_size=16, head_dim=64, seed=5)
    want_slab, want_view = _hot_slot_view(7, 3, 3, 16, 64, dtype)
    slots = torch.tensor([6, 2, 0, 5, 3], dtype=torch.int32)
    reference.dequant_blocks(want_view, packed, slots, mode)
    for src in (packed.cuda(), packed.pin_memory()):  # device memory, and a pinned warm slab through UVA
        slab, view = _hot_slot_view(7, 3, 3, 16, 64, dtype)
        slab = slab.cuda()
        view = slab.view(3, 2, 3, 7, 16, 64).permute(3, 0, 1, 2, 4, 5)
        cuda.dequant_blocks(view, src, slots.cuda(), mode)
        torch.cuda.synchronize()
        got = slab.cpu()
        assert torch.equal(got.nan_to_num(), want_slab.nan_to_num()) and torch.equal(got.isnan(), want_slab.isnan())


# ---------------------------------------------------------------- quant_blocks (into compressed lower tiers)

QUANT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _quant_source(dtype, count: int = 5, layers: int = 2, heads: int = 2, block_size: int = 8, head_dim: int = 16,
                  seed: int = 0) -> torch.Tensor:
    """Blocks `[count, L, 2, H, bs, D]` of `dtype` (finite, no -0) covering the encode's edges: block 0 an
    outlier key channel, head 1 constant groups (its key channels over the tokens, its value rows), a
    value row whose magnitudes run from +-448 down to e4m3 subnormals and below (halves, ties); block 1
    tiny (float16 scales subnormal or 0), block 2 small, block 3 huge (scales and zeros past float16's
    range: clamped to 65504; within float16's own range for float16 blocks), block 4 zeros (the first
    `count` of them, then random blocks)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(max(count, 5), layers, 2, heads, block_size, head_dim, generator=gen) * 3
    x[0, :, 0, 0, :, 1] += 20
    x[0, :, 0, 1] = x[0, :, 0, 1, :1]  # constant key channels (head 1)
    x[0, :, 1, 1] = x[0, :, 1, 1, :, :1]  # constant value rows (head 1)
    edge = torch.tensor([448.0, -448.0, 447.0, 440.0, -432.0, 464.0] + [(-1) ** k * 2.0 ** (-k / 2) for k in range(60)])
    x[0, :, 1, 0, -1] = edge[:head_dim]
    x[1] *= 1e-6
    x[2] *= 1e-3
    x[3] *= 1e5
    x[4] = 0
    if dtype == torch.float16:
        x = x.clamp(-65000, 65000)
    return x[:count].to(dtype)


def _packed_like(mode: str, count: int, layers: int, heads: int, block_size: int, head_dim: int, fill: int = 0xAB):
    from tiered_kv.compression import packed_layer_bytes

    return torch.full((count, layers, packed_layer_bytes(heads, block_size, head_dim, mode)), fill, dtype=torch.uint8)


@needs_host_build
@pytest.mark.parametrize("head_dim", [8, 64, 34])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("dtype", QUANT_DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("mode", DEQUANT_MODES)
def test_emulated_quant_blocks_is_packing_encode_bit_for_bit(emulated, mode, dtype, block_size, head_dim):
    """Every byte packing.encode writes, the pad byte included (dst starts as 0xAB), a zero scale's sign
    aside (selfcheck.packed_mismatches); token 0 apart, int4 values in groups of 32 (D 64) or whole (8, 34)."""
    from tiered_kv.compression import packing

    x = _quant_source(dtype, layers=2, heads=2, block_size=block_size, head_dim=head_dim)
    got = _packed_like(mode, 5, 2, 2, block_size, head_dim)
    cuda.quant_blocks(got, x, None, mode)
    want = packing.encode(x, mode)
    assert packed_mismatches(got, want, mode, 2, block_size, head_dim) == 0
    assert [name for name, _ in emulated] == [f"quant_blocks_{cuda._DTYPE_SUFFIX[dtype]}"]


def test_packed_mismatches_ignore_only_the_sign_of_a_zero_scale():
    from tiered_kv.compression import layout_parts, packing

    x = torch.zeros(2, 1, 2, 2, 4, 8)
    x[0] = torch.randn(1, 2, 2, 4, 8)
    packed = packing.encode(x, "fp8")
    parts = layout_parts("fp8", 2, 4, 8)
    flipped = packed.clone()
    flipped[1, 0, parts["v_scale"][0] + 1] ^= 0x80  # block 1's first value scale (zero): -0
    assert packed_mismatches(flipped, packed, "fp8", 2, 4, 8) == 0
    flipped[0, 0, parts["v_scale"][0] + 1] ^= 0x80  # block 0's (not zero): a real difference
    flipped[1, 0, parts["k"][0]] ^= 0x80  # a code -0 vs +0: a real difference too
    assert packed_mismatches(flipped, packed, "fp8", 2, 4, 8) == 2


@needs_host_build
@pytest.mark.parametrize("mode", DEQUANT_MODES)
def test_emulated_quant_blocks_reads_hot_slots_through_a_slot_list(emulated, mode):
    """Out of a hot slab's slot-major view (NaN in the slots not listed), into strided packed rows; a slot
    out of range is skipped (its row untouched), and nothing past P is written."""
    from tiered_kv.compression import packing

    blocks = _quant_source(torch.bfloat16, count=2, layers=3, heads=2, block_size=8, head_dim=16, seed=2)
    slab, view = _hot_slot_view(6, 3, 2, 8, 16, torch.bfloat16)
    view[4], view[0] = blocks[0], blocks[1]
    packed_bytes = _packed_like(mode, 1, 3, 2, 8, 16).shape[-1]
    buffer = torch.full((3, 3, packed_bytes + 6), 0xAB, dtype=torch.uint8)
    dst = buffer[..., :packed_bytes]
    cuda.quant_blocks(dst, view, torch.tensor([4, 0, 9], dtype=torch.int32), mode)
    assert packed_mismatches(dst[:2], packing.encode(blocks, mode), mode, 2, 8, 16) == 0
    assert bool((buffer[2] == 0xAB).all()) and bool((buffer[..., packed_bytes:] == 0xAB).all())


def test_cuda_quant_launch_matches_the_header(recorded_launches):
    _, view = _hot_slot_view(5, 3, 2, 4, 8, torch.float16)
    dst = _packed_like("int4", 2, 3, 2, 4, 8)
    cuda.quant_blocks(dst, view, torch.tensor([3, 1], dtype=torch.int32), "int4")
    (call,) = recorded_launches
    assert call[:4] == ("quant_blocks.cu", "quant_blocks_f16", (2, 3, 4), (128, 1, 1))
    _assert_args_match(call[4], "TKV_QUANT_PARAMS")
    assert [int(a) for a in call[4][1:3]] == list(dst.stride()[:2])
    assert [int(a) for a in call[4][4:9]] == list(view.stride()[:5]) and int(call[4][9]) == 5
    assert [int(a) for a in call[4][11:14]] == [2, 4, 8] and int(call[4][14]) == contracts.DEQUANT_MODES["int4"]
    assert [int(a) for a in call[4][15:]] == list(contracts.quant_layout_args("int4", 2, 4, 8))


def test_quant_layout_args_name_the_pad_byte():
    """The pad byte (codes ending at an odd offset) is passed to the kernel, which writes it 0; codec
    version 3 never has one (K and V codes take as many bytes, token-0 codes 2 H D), so it is -1."""
    from tiered_kv.compression import layout_parts

    for mode in DEQUANT_MODES:
        for heads, block_size, head_dim in ((1, 1, 2), (1, 3, 6), (3, 2, 34), (2, 8, 16), (5, 16, 64)):
            parts = layout_parts(mode, heads, block_size, head_dim)
            args = contracts.quant_layout_args(mode, heads, block_size, head_dim)
            codes_end = max(end for _, end in parts.values() if end <= parts.first_half)
            assert args[-1] == (codes_end if codes_end % 2 else -1) == -1
            assert args[:-1] == contracts.dequant_layout_args(mode, heads, block_size, head_dim)


QUANT_BAD = {
    "mode": (lambda d, s, sl: (d, s, sl, "none"), r"`mode` must be one of"),
    "src rank": (lambda d, s, sl: (d, s[0], sl, "int8"), r"`src` must be float32"),
    "src dtype": (lambda d, s, sl: (d, s.double(), sl, "int8"), r"`src` must be float32"),
    "src D stride": (lambda d, s, sl: (d, s.transpose(-1, -2), sl, "int8"), r"`src` must be float32"),
    "dst bytes": (lambda d, s, sl: (d[..., 1:], s, sl, "int8"), r"`dst` must be uint8 \[n, 2, "),
    "dst dtype": (lambda d, s, sl: (d.to(torch.int16), s, sl, "int8"), r"`dst` must be uint8"),
    "dst odd": (lambda d, s, sl: (torch.zeros(d.numel() + 1, dtype=torch.uint8)[1:].view(d.shape), s, sl, "int8"),
                r"`dst` must be .*even address"),
    "slots dtype": (lambda d, s, sl: (d, s, sl.long(), "int8"), r"`slots` must be int32"),
    "slots length": (lambda d, s, sl: (d, s, sl[:1], "int8"), r"`slots` must be int32 \[2\]"),
    "too few blocks": (lambda d, s, sl: (d, s[:1], None, "int8"), r"`src` must be at least n = 2"),
    "int4 odd D": (lambda d, s, sl: (d, s[..., :15], sl, "int4"), r"`src` must be an even D"),
}


@pytest.mark.parametrize("name", sorted(QUANT_BAD))
def test_quant_contract_rejects(recorded_launches, name):
    blocks = _quant_source(torch.float32, count=2)
    make, message = QUANT_BAD[name]
    args = make(_packed_like("int8", 2, 2, 2, 8, 16), blocks, torch.tensor([1, 0], dtype=torch.int32))
    with pytest.raises(LayoutError, match=message):
        cuda.quant_blocks(*args)
    with pytest.raises(LayoutError, match=message):
        reference.quant_blocks(*args)
    assert recorded_launches == []


def test_reference_quant_blocks_is_packing_encode_and_names_a_bad_slot():
    from tiered_kv.compression import packing

    blocks = _quant_source(torch.bfloat16, count=3)
    dst = _packed_like("int4", 2, 2, 2, 8, 16)
    reference.quant_blocks(dst, blocks, torch.tensor([2, 0], dtype=torch.int32), "int4")
    assert torch.equal(dst, packing.encode(blocks[[2, 0]], "int4"))
    with pytest.raises(LayoutError, match=r"`slots` must name slots of `src` in \[0, 3\)"):
        reference.quant_blocks(dst, blocks, torch.tensor([3, 0], dtype=torch.int32), "int4")


# ---------------------------------------------------------------- codec.encode: the kernel on a GPU, torch elsewhere

@pytest.fixture
def native_codec(emulated, monkeypatch):
    """codec as on a GPU whose kernels run: its ops are the CUDA wrappers (launching the host build) and
    CPU tensors count as the kernels' device."""
    import dataclasses

    from tiered_kv.compression import codec

    ops = dataclasses.replace(backend.torch_ops(None), backend="cuda", quant_blocks=cuda.quant_blocks,
                              dequant_blocks=cuda.dequant_blocks)
    monkeypatch.setattr(codec, "get_ops", lambda: ops)
    monkeypatch.setattr(codec, "NATIVE_DEVICE_TYPES", ("cuda", "cpu"))
    return emulated


@needs_host_build
@pytest.mark.parametrize("mode", DEQUANT_MODES)
def test_codec_encode_takes_the_kernel_where_the_kernels_run(native_codec, mode):
    from tiered_kv.compression import codec, packing

    blocks = _quant_source(torch.float16, count=3, layers=2, heads=2, block_size=4, head_dim=16, seed=3)
    for x in (blocks, blocks[:, 1], blocks[1, 0], blocks.transpose(0, 1)):  # [n, L], [n], one slice, strided
        assert packed_mismatches(codec.encode(x, mode), packing.encode(x, mode), mode, 2, 4, 16) == 0
    slab = _packed_like(mode, 5, 2, 2, 4, 16)
    codec.encode_into(blocks, mode, slab[1:4])  # straight into a (warm) slab's rows
    assert packed_mismatches(slab[1:4], packing.encode(blocks, mode), mode, 2, 4, 16) == 0
    assert bool((slab[0] == 0xAB).all()) and bool((slab[4] == 0xAB).all())
    assert [name for name, _ in native_codec] == ["quant_blocks_f16"] * 5
    assert torch.equal(codec.encode(blocks.double(), mode), packing.encode(blocks.double(), mode))  # float64: torch
    assert len(native_codec) == 5
    with pytest.raises(ValueError, match=r"encode_into: out must be uint8"):
        codec.encode_into(blocks, mode, slab[:2])


@needs_host_build
def test_compressed_tiers_demote_through_the_kernel_where_the_kernels_run(native_codec, tmp_path):
    from tiered_kv.blocks import KVLayout
    from tiered_kv.compression import packing
    from tiered_kv.tiers.cold_files import open_cold_directory
    from tiered_kv.tiers.compressed import CompressedColdTier, CompressedWarmTier

    layout = KVLayout(2, 2, 16, 4, "bfloat16", "int8")
    blocks = _quant_source(torch.bfloat16, count=3, layers=2, heads=2, block_size=4, head_dim=16, seed=4)
    warm = CompressedWarmTier(layout, 6, torch.bfloat16, pinned=False)
    warm.write_blocks([5, 1, 2], blocks)
    assert packed_mismatches(warm.slab[[5, 1, 2]], packing.encode(blocks, "int8"), "int8", 2, 4, 16) == 0
    directory = open_cold_directory(str(tmp_path / "cold"))
    cold = CompressedColdTier(layout, 4, directory, backend="posix", fsync=False)
    try:
        cold.write_blocks([3, 0], blocks[:2])
        assert packed_mismatches(torch.from_numpy(cold.read_packed([3, 0])), packing.encode(blocks[:2], "int8"),
                                 "int8", 2, 4, 16) == 0
    finally:
        cold.close()
        directory.close()
    assert [name for name, _ in native_codec][:2] == ["quant_blocks_bf16"] * 2


def test_codec_encode_on_the_cpu_is_packing_encode(monkeypatch):
    """Where the kernels do not run on the data's device (the CPU, always here), encode is packing's,
    and never asks the kernels."""
    import dataclasses

    from tiered_kv.compression import codec, packing

    def refuse(*args):
        raise AssertionError("the CPU path launched a kernel")

    monkeypatch.setattr(codec, "get_ops", lambda: dataclasses.replace(backend.torch_ops(None), backend="cuda",
                                                                      quant_blocks=refuse))
    blocks = _quant_source(torch.float32, count=2)
    for mode in DEQUANT_MODES:
        assert torch.equal(codec.encode(blocks, mode), packing.encode(blocks, mode))
        out = _packed_like(mode, 2, 2, 2, 8, 16)
        codec.encode_into(blocks, mode, out)
        assert torch.equal(out, packing.encode(blocks, mode))


@needs_gpu
@pytest.mark.parametrize("dtype", QUANT_DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("mode", DEQUANT_MODES)
def test_gpu_quant_blocks_match_the_cpu_codec_into_device_and_pinned_memory(mode, dtype):
    """The kernel against packing.encode on the CPU (torch on CUDA divides by a constant as a product
    with its reciprocal, so its bits may differ from both), out of a hot slab's slots through a list,
    into device memory and into a pinned (warm) slab through UVA; and codec.encode takes it."""
    from tiered_kv.compression import codec, packing

    blocks = _quant_source(dtype, count=5, layers=3, heads=3, block_size=16, head_dim=64, seed=5)
    slab, view = _hot_slot_view(7, 3, 3, 16, 64, dtype)
    slots = torch.tensor([6, 2, 0, 5, 3], dtype=torch.int32)
    view[slots.long()] = blocks
    slab = slab.cuda()
    view = slab.view(3, 2, 3, 7, 16, 64).permute(3, 0, 1, 2, 4, 5)
    want = packing.encode(blocks, mode)
    for dst in (_packed_like(mode, 5, 3, 3, 16, 64).cuda(), _packed_like(mode, 5, 3, 3, 16, 64).pin_memory()):
        cuda.quant_blocks(dst, view, slots.cuda(), mode)
        torch.cuda.synchronize()
        assert packed_mismatches(dst, want, mode, 3, 16, 64) == 0
    assert packed_mismatches(codec.encode(blocks.cuda(), mode), want, mode, 3, 16, 64) == 0


@needs_gpu
@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "pageable"])
def test_gpu_demotion_into_a_compressed_warm_tier_packs_on_the_device(pinned):
    """write_blocks with blocks on the GPU: the kernel packs them there and the packed rows go straight
    into the slab (one copy per run of slots), the bytes of packing.encode on the CPU."""
    from tiered_kv.blocks import KVLayout
    from tiered_kv.compression import packing
    from tiered_kv.tiers.compressed import CompressedWarmTier

    layout = KVLayout(3, 2, 64, 16, "bfloat16", "int4")
    blocks = _quant_source(torch.bfloat16, count=6, layers=3, heads=2, block_size=16, head_dim=64, seed=6)
    warm = CompressedWarmTier(layout, 10, torch.bfloat16, pinned=pinned)
    slots = [7, 8, 9, 0, 4, 5]
    warm.write_blocks(slots, blocks.cuda())
    assert packed_mismatches(warm.slab[slots], packing.encode(blocks, "int4"), "int4", 2, 16, 64) == 0
    assert bool((warm.slab[[1, 2, 3, 6]] == 0).all())
