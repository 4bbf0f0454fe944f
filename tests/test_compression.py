"""Compressed lower tiers (issue 21): the codecs' error bounds, the packed warm and cold tiers, the
v2 cold format beside v1, capacity, and chats through compressed tiers (reuse, restart, corruption)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from transformers import DynamicCache

import tiered_kv
from helpers import flip_cold_byte, greedy, rand_ids, tier_config, tiny_model
from tiered_kv.blocks import KVLayout
from tiered_kv.compression import MODES, packed_layer_bytes
from tiered_kv.compression import codec
from tiered_kv.errors import ConfigError, CorruptBlockError, LayoutError
from tiered_kv.remote import codec as remote_codec
from tiered_kv.tiers import ColdTier
from tiered_kv.tiers import cold_format as fmt
from tiered_kv.tiers.cold_files import open_cold_directory
from tiered_kv.tiers.compressed import CompressedColdTier, CompressedWarmTier

COMPRESSED = MODES[1:]
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype_name="float32")
SMOLLM2 = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype_name="float32")
ROOT = bytes.fromhex("a1" * 16)


def kv_like(shape, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    """Random KV with what real keys have: an outlier channel and a per-channel offset."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * 2
    x[..., 0, :, :, 1] += 15  # keys: one large channel
    x[..., 0, :, :, :] += torch.linspace(-3, 3, shape[-1])
    return x.to(dtype)


def blocks(n: int, layout: KVLayout = LAYOUT, seed: int = 0) -> torch.Tensor:
    return kv_like((n, *layout.record_shape()), seed)


# ---- codecs ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16))
@pytest.mark.parametrize("mode", COMPRESSED)
def test_round_trip_error_is_within_the_mode_bound(mode, dtype):
    x = kv_like((6, 3, 2, 4, 16, 64), seed=1, dtype=dtype)
    packed = codec.encode(x, mode)
    assert packed.dtype == torch.uint8 and packed.shape == (6, 3, packed_layer_bytes(4, 16, 64, mode))
    y = codec.decode(packed, mode, 4, 16, 64, dtype)
    assert y.dtype == dtype and y.shape == x.shape
    err = (y.float() - x.float()).abs()
    slack = x.float().abs() * (2 ** -7 if dtype == torch.bfloat16 else 2 ** -10)  # the output's own rounding
    assert bool((err <= codec.error_bound(x, mode) + slack).all()), float(err.max())
    assert float(err.max()) > 0  # it is lossy: a bound that holds for a no-op codec proves nothing


@pytest.mark.parametrize("mode", COMPRESSED)
def test_zeros_and_unwritten_bytes_decode_to_zeros_and_no_value_saturates(mode):
    zeros = torch.zeros(2, 2, 3, 8, 16)
    assert torch.equal(codec.decode(codec.encode(zeros, mode), mode, 3, 8, 16), zeros)
    unwritten = torch.zeros(2, packed_layer_bytes(3, 8, 16, mode), dtype=torch.uint8)
    assert torch.equal(codec.decode(unwritten, mode, 3, 8, 16), zeros)
    big = kv_like((1, 2, 3, 8, 16)) * 1000  # far beyond e4m3's 448 and int8's 127: scales take it
    back = codec.decode(codec.encode(big, mode), mode, 3, 8, 16)
    assert float((back - big).abs().max()) < 0.1 * float(big.abs().max())


def test_fp8_is_scaled_not_a_bare_cast():
    x = torch.full((1, 2, 1, 4, 8), 1e-3)
    back = codec.decode(codec.encode(x, "fp8"), "fp8", 1, 4, 8)
    assert torch.allclose(back, x, rtol=2 ** -4)  # a bare e4m3 cast of 1e-3 is off by ~2%, below 2^-9 it is 0


@pytest.mark.parametrize("mode", COMPRESSED)
def test_capacity_targets_for_the_bundled_model(mode):
    """The same bytes hold >= 1.9x the blocks with fp8 / int8 and >= 3.5x with int4 (SmolLM2, fp32)."""
    ratio = SMOLLM2.block_bytes / SMOLLM2.stored(mode).block_bytes
    assert ratio >= (3.5 if mode == "int4" else 1.9), ratio


def test_int4_needs_an_even_head_dim():
    with pytest.raises(LayoutError, match="even"):
        KVLayout(1, 1, 7, 4, "float32").stored("int4")


# ---- config ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("section", ("warm", "cold", "remote"))
def test_unknown_compression_names_the_key_and_the_allowed_values(section):
    with pytest.raises(ConfigError) as info:
        tiered_kv.load_config({section: {"compression": "zstd"}})
    message = str(info.value)
    assert f"{section}.compression" in message and all(repr(m) in message for m in MODES)


def test_a_paged_warm_tier_cannot_be_compressed():
    with pytest.raises(ConfigError, match="warm.layout.*warm.compression"):
        tiered_kv.load_config({"warm": {"compression": "int8", "layout": "paged"}})


# ---- the packed tiers ------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", COMPRESSED)
def test_compressed_warm_tier_blocks_and_tokens(mode):
    stored = LAYOUT.stored(mode)
    tier = CompressedWarmTier(stored, 6, torch.float32, pinned=False)
    assert tier.kernel_view(0, torch.device("cpu")) is None
    assert tier.reserved_bytes == 6 * stored.block_bytes < 6 * LAYOUT.block_bytes
    data = blocks(3)
    tier.write_blocks([4, 1, 2], data)
    expected = codec.decode(codec.encode(data, mode), mode, 2, 4, 8)
    assert torch.equal(tier.read_blocks([4, 1, 2]), expected)
    # tokens 2..9 of the blocks in slots 4, 1, 2 (whole-block runs) and a scattered pick
    slots = np.array([4, 4, 1, 1, 1, 1, 2, 2]); offsets = np.array([2, 3, 0, 1, 2, 3, 0, 1])
    whole = expected.permute(1, 2, 3, 0, 4, 5).reshape(2, 2, 2, 12, 8)  # [L, 2, H, 3 * bs, D]
    assert torch.equal(tier.read_tokens(1, tier.token_index(slots, offsets)), whole[1][:, :, 2:10])
    picked = tier.token_index(np.array([2, 4]), np.array([3, 0]))
    assert torch.equal(tier.read_tokens(0, picked), torch.stack((whole[0][:, :, 11], whole[0][:, :, 0]), 2))
    # a token write re-encodes its block's slice; the block's other tokens keep their values
    new = torch.full((2, 2, 1, 8), 0.5)
    tier.write_tokens(0, tier.token_index(np.array([1]), np.array([2])), new)
    after = tier.read_blocks([1])[0, 0]
    want = expected[1, 0].clone()
    want[:, :, 2:3] = new
    assert bool(((after - want).abs() <= 2 * codec.error_bound(want, mode) + 1e-3).all())
    assert not torch.equal(after, expected[1, 0])


@pytest.fixture
def cold_dir(tmp_path):
    directory = open_cold_directory(str(tmp_path / "cold"))
    yield directory
    directory.close()


@pytest.mark.parametrize("mode", COMPRESSED)
def test_compressed_cold_records_are_durable_checked_and_never_read_as_another_mode(mode, cold_dir):
    stored = LAYOUT.stored(mode)
    tier = CompressedColdTier(stored, 8, cold_dir, backend="posix")
    assert os.path.basename(tier.file_path).startswith("kv-v3-")
    assert tier.record_stride_bytes == fmt.record_stride_bytes(stored)
    data = blocks(2, seed=3)
    tier.write_blocks([3, 5], data)
    expected = codec.decode(codec.encode(data, mode), mode, 2, 4, 8)
    assert torch.equal(tier.read_blocks([3, 5]), expected)
    index = tier.token_index(np.array([5, 5, 3]), np.array([1, 2, 0]))
    assert torch.equal(tier.read_tokens(1, index), torch.stack(
        (expected[1, 1][:, :, 1], expected[1, 1][:, :, 2], expected[0, 1][:, :, 0]), 2))
    tier.persist(3, b"k" * 16, ROOT)
    tier.persist(5, b"j" * 16, ROOT)
    tier.flush()
    tier.close()
    # the same mode finds both records after a "restart"; v1 (none) and another mode see none of them
    again = CompressedColdTier(stored, 8, cold_dir, backend="posix")
    assert sorted(slot for slot, _, _ in again.durable_records()) == [3, 5]
    assert torch.equal(again.read_blocks([5]), expected[1:])
    again.close()
    other = "int8" if mode != "int8" else "int4"
    for tier_other in (ColdTier(LAYOUT, 8, cold_dir, backend="posix"),
                       CompressedColdTier(LAYOUT.stored(other), 8, cold_dir, backend="posix")):
        assert tier_other.durable_records() == [] and tier_other.file_path != again.file_path
        tier_other.close()
    # a flipped byte of the packed bytes fails the checksum: CorruptBlockError naming the slot, never data
    again = CompressedColdTier(stored, 8, cold_dir, backend="posix")
    with open(again.file_path, "r+b") as f:
        f.seek(5 * again.record_stride_bytes + 7)
        byte = f.read(1)
        f.seek(5 * again.record_stride_bytes + 7)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(CorruptBlockError) as info:
        again.read_blocks([5])
    assert info.value.slot == 5
    assert again.verify([3, 5]) == [5]
    again.close()


def test_a_header_of_another_compression_is_a_format_error():
    header = fmt.pack_header(LAYOUT.stored("int8"), 2, b"k" * 16, ROOT, [1, 2])
    with pytest.raises(fmt.FormatError, match="compression"):
        fmt.unpack_header(LAYOUT.stored("fp8"), 2, header)
    with pytest.raises(fmt.FormatError, match="version"):
        fmt.unpack_header(LAYOUT, 2, header[:fmt.header_bytes(LAYOUT)])
    assert fmt.layout_from_text(fmt.layout_text(LAYOUT.stored("int4"))) == LAYOUT.stored("int4")


@pytest.mark.parametrize("mode", COMPRESSED)
def test_remote_values_carry_packed_bytes_checked_by_their_checksums(mode):
    stored = LAYOUT.stored(mode)
    block = blocks(1, seed=4)[0]
    raw = block.numpy().view(np.uint8).reshape(-1)
    value = remote_codec.encode(stored, b"k" * 16, ROOT, raw)
    assert len(value) == remote_codec.value_bytes(stored) < remote_codec.value_bytes(LAYOUT)
    data, why = remote_codec.decode(stored, b"k" * 16, ROOT, value)
    expected = codec.decode(codec.encode(block, mode), mode, 2, 4, 8).numpy().view(np.uint8).reshape(-1)
    assert why == "" and np.array_equal(data, expected)
    flipped = bytearray(value)
    flipped[-3] ^= 1
    assert remote_codec.decode(stored, b"k" * 16, ROOT, bytes(flipped))[0] is None
    other = LAYOUT.stored("int8" if mode != "int8" else "fp8")
    assert remote_codec.remote_key("p:", other, ROOT, b"k" * 16) != remote_codec.remote_key("p:", stored, ROOT, b"k" * 16)


# ---- chats through compressed tiers ----------------------------------------------------------------

def compressed_config(kind: str, tmp_path, mode: str, engine: str = "auto") -> dict:
    config = tier_config(kind, tmp_path / "cold", engine=engine, delay_us=300 if engine == "thread" else 0)
    config["warm"].update(compression=mode, layout="auto")
    config["cold"]["compression"] = mode
    return config


@pytest.mark.parametrize("engine", ("auto", "thread"))
@pytest.mark.parametrize("kind", ("forces_warm", "forces_cold"))
@pytest.mark.parametrize("mode", ("int8", "fp8"))
def test_a_multiturn_chat_through_compressed_tiers_reuses_its_history(mode, kind, engine, tmp_path):
    """History in compressed warm / cold: reused (not recomputed) and, for 8-bit modes on this model,
    the same greedy tokens as DynamicCache; bytes per block and compression reported per tier."""
    model = tiny_model("llama")
    bank = tiered_kv.CacheBank(model, compressed_config(kind, tmp_path, mode, engine))
    dynamic = DynamicCache(config=model.config)
    ids_bank = ids_dyn = rand_ids(0, 13)
    for turn in range(3):
        reused = bank.attach(ids_bank)
        assert reused == (0 if turn == 0 else ids_bank.shape[1] - 7)
        out_bank = greedy(model, ids_bank, bank, 9)
        out_dyn = greedy(model, ids_dyn, dynamic, 9)
        assert torch.equal(out_bank, out_dyn), f"turn {turn}"
        user = rand_ids(turn + 1, 6)
        ids_bank, ids_dyn = torch.cat([out_bank, user], 1), torch.cat([out_dyn, user], 1)
    stats = bank.stats()
    lower = "cold" if kind == "forces_cold" else "warm"
    assert stats["bank_blocks"][lower] > 0
    layout = bank.store.layout
    assert stats["tiers"]["hot"]["block_bytes"] == layout.block_bytes
    for name in ("warm", "cold"):
        assert stats["tiers"][name]["compression"] == mode
        assert stats["tiers"][name]["block_bytes"] == layout.stored(mode).block_bytes < layout.block_bytes
    assert bank.store.check_consistency() == []
    bank.close()


def test_int4_chat_runs_and_reuses_and_capacity_counts_compressed_blocks(tmp_path):
    model = tiny_model("llama")
    config = compressed_config("forces_cold", tmp_path, "int4")
    config["warm"] = {"capacity": 3 * 2048, "compression": "int4"}  # bytes: more int4 blocks than fp32 ones
    bank = tiered_kv.CacheBank(model, config)
    ids = rand_ids(2, 30)
    out = greedy(model, ids, bank, 6)
    layout = bank.store.layout
    assert bank.stats()["tiers"]["warm"]["capacity_blocks"] == 3 * 2048 // layout.stored("int4").block_bytes
    assert bank.stats()["tiers"]["warm"]["capacity_blocks"] > 3 * 2048 // layout.block_bytes
    follow = torch.cat([out, rand_ids(3, 4)], 1)
    assert bank.attach(follow) == out.shape[1] - 1  # its own history, the partial block too
    assert greedy(model, follow, bank, 4).shape[1] == follow.shape[1] + 4
    bank.close()


def test_a_restart_picks_the_chat_up_from_compressed_cold_and_an_uncompressed_store_does_not(tmp_path):
    model = tiny_model("llama")
    config = compressed_config("forces_cold", tmp_path, "int8")
    ids = rand_ids(5, 33)
    bank = tiered_kv.CacheBank(model, config)
    out = greedy(model, ids, bank, 5)
    bank.close()
    follow = torch.cat([out, rand_ids(6, 4)], 1)
    stored_tokens = (out.shape[1] - 1) // 4 * 4
    plain = tiered_kv.CacheBank(model, tier_config("forces_cold", tmp_path / "cold"))
    assert plain.attach(follow) == 0  # v1 records only: the int8 file is never read as float32
    plain.close()
    bank = tiered_kv.CacheBank(model, config)
    assert bank.attach(follow) == stored_tokens
    assert torch.equal(greedy(model, follow, bank, 5), greedy(model, follow, DynamicCache(config=model.config), 5))
    bank.close()


def test_a_corrupt_compressed_cold_block_is_recomputed_not_served(tmp_path):
    model = tiny_model("llama")
    bank = tiered_kv.CacheBank(model, compressed_config("forces_cold", tmp_path, "int8"))
    ids = rand_ids(15, 30)
    out = greedy(model, ids, bank, 4)
    store = bank.store
    cold_blocks = [b for b in bank.block_table(0) if store.index.get(b).tier == 2]
    assert cold_blocks
    victim = cold_blocks[0]
    position = bank.block_table(0).index(victim)
    flip_cold_byte(store, victim, 5)  # a code byte of layer 0's packed keys
    follow_ids = torch.cat([out, rand_ids(16, 3)], 1)
    assert bank.attach(follow_ids) == position * 4  # everything before the corrupt block, nothing after
    follow = greedy(model, follow_ids, bank, 5)
    assert torch.equal(follow, greedy(model, follow_ids, DynamicCache(config=model.config), 5))
    bank.close()


# ---- moves between tiers: quantized once, decoded where the block lands ------------------------------

def compressed_store(tmp_path, warm_mode: str, cold_mode: str, engine: str, hot: int = 2, warm: int = 2,
                     cold: int = 8):
    copies = {"engine": engine, "delay_us": 200} if engine == "thread" else {"engine": engine}
    store = tiered_kv.TierStore({
        "block_size": LAYOUT.block_size,
        "hot": {"device": "cpu", "capacity_blocks": hot, "high_watermark": 1.0, "low_watermark": 1.0},
        "warm": {"capacity_blocks": warm, "pinned": False, "compression": warm_mode,
                 "high_watermark": 1.0, "low_watermark": 1.0},
        "cold": {"capacity_blocks": cold, "path": str(tmp_path / "cold"), "backend": "posix",
                 "compression": cold_mode, "write_behind_s": 0},
        "scheduler": {"background": False},
        "copies": copies})
    store.bind(LAYOUT, torch.float32)
    return store


def read_block(store, block_id: int) -> torch.Tensor:
    entry = store.index.get(block_id)
    return store.tiers[entry.tier].read_blocks([entry.slot]).to("cpu")


@pytest.mark.parametrize("engine", ("sync", "thread"))
@pytest.mark.parametrize("modes", (("int8", "int8"), ("fp8", "fp8"), ("int4", "int4"), ("fp8", "int8"),
                                   ("none", "int4"), ("int8", "none")), ids=lambda m: "-".join(m))
def test_blocks_moving_down_and_back_up_are_quantized_once(tmp_path, modes, engine):
    """hot -> warm -> cold -> warm -> hot: where warm and cold share a mode the packed bytes move as
    they are, so a block that went down and came back holds exactly decode(encode(x)) of its first
    compression: no drift from re-quantizing on every move. Mixed modes go through the model's dtype
    (each compression's own error, within the sum of both bounds)."""
    warm_mode, cold_mode = modes
    store = compressed_store(tmp_path, warm_mode, cold_mode, engine)
    try:
        data = blocks(1, seed=7)
        (block_id,) = store.allocate(1)
        entry = store.index.get(block_id)
        assert entry.tier == 0
        store.tiers[0].write_blocks([entry.slot], data)
        first = warm_mode if warm_mode != "none" else cold_mode
        once = codec.decode(codec.encode(data, first), first, 2, 4, 8)
        store.demote([block_id], 1)
        assert store.index.get(block_id).tier == 1
        assert torch.equal(read_block(store, block_id), data if warm_mode == "none" else once)
        store.demote([block_id], 2)
        assert store.index.get(block_id).tier == 2
        store.promote([block_id])
        assert store.index.get(block_id).tier == 0
        back = read_block(store, block_id)
        moved = store.stats()["bytes_moved"]  # a move carries the smaller of the two tiers' blocks
        warm_bytes, cold_bytes = (LAYOUT.stored(m).block_bytes for m in modes)
        assert moved["hot->warm"] == min(LAYOUT.block_bytes, warm_bytes)
        assert moved["warm->cold"] == min(warm_bytes, cold_bytes) and moved["cold->hot"] == cold_bytes
        if warm_mode == cold_mode or "none" in modes:
            assert torch.equal(back, once)
        else:
            bound = codec.error_bound(data, warm_mode) + codec.error_bound(once, cold_mode) + 1e-6
            assert bool(((back - data).abs() <= bound).all())
        assert store.check_consistency() == []
    finally:
        store.close()


def test_same_mode_moves_to_and_from_cold_carry_the_packed_bytes(tmp_path, monkeypatch):
    """warm int8 <-> cold int8 never encodes or decodes: the packed records are written and read as they are."""
    store = compressed_store(tmp_path, "int8", "int8", "sync")
    try:
        (block_id,) = store.allocate(1)
        store.tiers[0].write_blocks([store.index.get(block_id).slot], blocks(1, seed=9))
        store.demote([block_id], 1)
        packed = store.tiers[1].read_packed([store.index.get(block_id).slot])
        calls = []
        for name in ("encode", "decode", "decode_into"):
            real = getattr(codec, name)
            monkeypatch.setattr(codec, name, lambda *a, _real=real, _name=name, **k: (calls.append(_name), _real(*a, **k))[1])
        store.demote([block_id], 2)
        assert np.array_equal(store.tiers[2].read_packed([store.index.get(block_id).slot])[0], packed[0].numpy())
        store.placement.promote([block_id])  # comes back up: hot has room, so it decodes once into hot
        assert calls == ["decode_into"]
    finally:
        store.close()


def test_a_second_store_on_the_same_compressed_cold_path_reads_the_first_ones_records(tmp_path):
    """Peers (issue 19) with compressed records: store B, open beside A on one int8 cold path,
    reattaches A's durable conversation from A's block file (checked packed bytes, decoded), and the
    tokens after it equal DynamicCache's."""
    model = tiny_model("llama")
    config = compressed_config("forces_cold", tmp_path, "int8")
    config["cold"]["write_behind_s"] = 0.05
    first = tiered_kv.TierStore(config)
    second = None
    try:
        bank = tiered_kv.CacheBank(model, store=first)
        ids = rand_ids(31, 29)
        out = greedy(model, ids, bank, 4)
        assert first.flush()
        second = tiered_kv.TierStore(config)
        other = tiered_kv.CacheBank(model, store=second)
        follow = torch.cat([out, rand_ids(32, 3)], 1)
        assert other.attach(follow) == (out.shape[1] - 1) // 4 * 4
        assert other.stats()["durability"]["peer_hits"] > 0
        assert torch.equal(greedy(model, follow, other, 4), greedy(model, follow, DynamicCache(config=model.config), 4))
        other.close()
        bank.close()
    finally:
        first.close()
        if second is not None:
            second.close()


@pytest.mark.parametrize("kind", ("forces_warm", "forces_cold"))
def test_compression_none_said_explicitly_is_bitwise_the_model_dtype(kind, tmp_path):
    """`none` keeps every tier in the model's dtype: tokens equal DynamicCache's every turn, and the
    KV the bank holds for the first turn is bitwise what DynamicCache holds."""
    model = tiny_model("llama")
    bank = tiered_kv.CacheBank(model, compressed_config(kind, tmp_path, "none"))
    dynamic = DynamicCache(config=model.config)
    ids = rand_ids(41, 17)
    out = greedy(model, ids, bank, 6)
    assert torch.equal(out, greedy(model, ids, dynamic, 6))
    stats = bank.stats()
    assert {stats["tiers"][t]["compression"] for t in ("hot", "warm", "cold")} == {"none"}
    assert stats["bank_blocks"]["warm" if kind == "forces_warm" else "cold"] > 0
    tokens = out.shape[1] - 1  # the last generated token is never fed back
    store = bank.store
    stored = torch.cat([store.tiers[store.index.get(b).tier].read_blocks([store.index.get(b).slot]).to("cpu")
                        for b in bank.block_table(0)])  # [n, L, 2, H, bs, D], read back from every tier
    kv = stored.permute(1, 2, 3, 0, 4, 5).flatten(3, 4)[..., :tokens, :]  # [L, 2, H, tokens, D]
    for layer in range(model.config.num_hidden_layers):
        assert torch.equal(kv[layer, 0], dynamic.layers[layer].keys[0, :, :tokens])
        assert torch.equal(kv[layer, 1], dynamic.layers[layer].values[0, :, :tokens])
    bank.close()
