"""Token writes into compressed warm and cold tiers (defect: "compressed warm re-quantizes from stale
bytes"). A block still being filled is kept at full precision beside the packed bytes (open_blocks.py):

- its stored bytes never depend on what its slot held before (the old block's bytes, huge or not);
- written one token at a time, or in any chunks, it ends with exactly the bytes that writing it at once
  (write_tokens of all its tokens, or write_blocks) produces: earlier tokens are never re-quantized
  from already-quantized values;
- reads see the right values at every moment: its tokens at full precision, its packed and whole-block
  reads (what moves to cold, remote and durable records carry) encoded from its present tokens only;
- the open blocks stay bounded, and a slot's open state goes when the slot is written whole or freed.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from transformers import DynamicCache

import tiered_kv
from helpers import greedy, rand_ids, tier_config, tiny_model
from tiered_kv.blocks import KVLayout
from tiered_kv.compression import MODES
from tiered_kv.compression import codec
from tiered_kv.tiers.cold_files import open_cold_directory
from tiered_kv.tiers.compressed import CompressedColdTier, CompressedWarmTier

COMPRESSED = MODES[1:]
BS = 8
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=BS, dtype_name="float32")
KINDS = ("warm", "cold")


def sequence(num_tokens: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    """`[L, 2, H, T, D]` of KV with an outlier key channel and per-channel offsets, as real keys have."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(LAYOUT.num_layers, 2, LAYOUT.num_kv_heads, num_tokens, LAYOUT.head_dim, generator=g)
    x[:, 0, :, :, 1] += 6
    x[:, 0] += torch.linspace(-2, 2, LAYOUT.head_dim)
    return x * scale


def as_blocks(kv: torch.Tensor) -> torch.Tensor:
    """`[L, 2, H, n * bs, D]` as whole blocks `[n, L, 2, H, bs, D]`."""
    n = kv.shape[3] // BS
    return kv.unflatten(3, (n, BS)).permute(3, 0, 1, 2, 4, 5).contiguous()


@pytest.fixture
def make_tier(tmp_path):
    made = []

    def make(kind: str, mode: str, num_slots: int = 8):
        stored = LAYOUT.stored(mode)
        if kind == "warm":
            tier = CompressedWarmTier(stored, num_slots, torch.float32, pinned=False)
        else:
            directory = open_cold_directory(str(tmp_path / f"cold{len(made)}"))
            tier = CompressedColdTier(stored, num_slots, directory, backend="posix")
            made.append(directory)
        made.append(tier)
        return tier

    yield make
    for thing in reversed(made):
        thing.close()


def write_span(tier, block_slots: list[int], kv: torch.Tensor, start: int, count: int, base: int = 0) -> None:
    """Tokens [start, start + count) of a sequence (`kv` holds tokens from `base` on) whose blocks lie in
    `block_slots` (from token `base`), every layer, as a step writes them."""
    slots = np.repeat(np.asarray(block_slots, dtype=np.int64), BS)[start - base:start - base + count]
    offsets = np.arange(start, start + count, dtype=np.int64) % BS
    index = tier.token_index(slots, offsets)
    for layer in range(LAYOUT.num_layers):
        tier.write_tokens(layer, index, kv[layer][:, :, start - base:start - base + count])


def read_span(tier, block_slots: list[int], start: int, count: int, layer: int) -> torch.Tensor:
    slots = np.repeat(np.asarray(block_slots, dtype=np.int64), BS)[start:start + count]
    offsets = np.arange(start, start + count, dtype=np.int64) % BS
    return tier.read_tokens(layer, tier.token_index(slots, offsets))


def packed(tier, slots: list[int]) -> torch.Tensor:
    return torch.as_tensor(np.asarray(tier.read_packed(slots))).clone()


def chunked(total: int, sizes: tuple[int, ...]) -> list[tuple[int, int]]:
    spans, at = [], 0
    while at < total:
        for size in sizes:
            size = min(size, total - at)
            if size:
                spans.append((at, size))
                at += size
    return spans


# ---- 1. a block's bytes never depend on what its slot held before ------------------------------------

@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", COMPRESSED)
def test_a_reused_slot_never_folds_its_old_block_into_the_new_one(make_tier, kind, mode):
    """Slot 2 held a block of huge values (written whole), then is freed and a new block of small
    values is written there token by token: at every token its packed bytes and its reads equal those
    of the same writes into a fresh tier, and once full the bytes are exactly encode(block)."""
    used, fresh = make_tier(kind, mode), make_tier(kind, mode)
    used.write_blocks([2], as_blocks(sequence(BS, seed=1, scale=1000.0) + 500.0))
    if kind == "cold":
        used.forget([2])  # the store frees a cold slot so (warm's pool frees without telling the tier)
    kv = sequence(BS, seed=2)
    for t in range(BS):
        write_span(used, [2], kv, t, 1)
        write_span(fresh, [2], kv, t, 1)
        assert torch.equal(packed(used, [2]), packed(fresh, [2])), f"token {t}"
        for layer in range(LAYOUT.num_layers):
            assert torch.equal(read_span(used, [2], 0, t + 1, layer), read_span(fresh, [2], 0, t + 1, layer))
    assert torch.equal(packed(used, [2])[0], codec.encode(as_blocks(kv)[0], mode))


@pytest.mark.parametrize("mode", COMPRESSED)
def test_a_warm_slot_left_half_written_starts_over_for_its_next_block(make_tier, mode):
    """The old block was itself being filled (huge tokens written one by one, never finished) when its
    slot was freed: the next block written there from its first token is not mixed with it."""
    used, fresh = make_tier("warm", mode), make_tier("warm", mode)
    old = sequence(BS, seed=3, scale=800.0)
    for t in range(BS - 2):
        write_span(used, [5], old, t, 1)
    kv = sequence(BS, seed=4)
    for start, count in chunked(BS, (2, 1, 3)):
        write_span(used, [5], kv, start, count)
        write_span(fresh, [5], kv, start, count)
        assert torch.equal(packed(used, [5]), packed(fresh, [5]))
        assert torch.equal(read_span(used, [5], 0, start + count, 1), kv[1][:, :, :start + count]) or \
            start + count == BS
    assert torch.equal(packed(used, [5])[0], codec.encode(as_blocks(kv)[0], mode))


# ---- 2. token by token (or in chunks) ends with the bytes of one write ----------------------------------

@pytest.mark.parametrize("sizes", ((1,), (3, 5), (5, 11), (2, 7, 1), (16,)), ids=lambda s: "+".join(map(str, s)))
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", COMPRESSED)
def test_blocks_written_in_any_chunks_end_with_the_bytes_of_one_write(make_tier, kind, mode, sizes):
    """Two blocks (slots 4 and 1) written in chunks that cross their boundary: each ends bitwise equal
    to encode(block), to write_blocks of it, and to write_tokens of all its tokens at once."""
    kv = sequence(2 * BS, seed=5)
    want = codec.encode(as_blocks(kv), mode)
    tier = make_tier(kind, mode)
    for start, count in chunked(2 * BS, sizes):
        write_span(tier, [4, 1], kv, start, count)
    assert torch.equal(packed(tier, [4, 1]), want)
    whole, at_once = make_tier(kind, mode), make_tier(kind, mode)
    whole.write_blocks([4, 1], as_blocks(kv))
    write_span(at_once, [4, 1], kv, 0, 2 * BS)
    assert torch.equal(packed(whole, [4, 1]), want) and torch.equal(packed(at_once, [4, 1]), want)
    assert torch.equal(tier.read_blocks([4, 1]), whole.read_blocks([4, 1]))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", COMPRESSED)
def test_a_growing_tail_block_is_never_requantized(make_tier, kind, mode):
    """Tokens that grow in magnitude (each one widens the key scales of its block): the first tokens
    keep full precision until the block is full, so the final bytes still equal one encode."""
    kv = sequence(BS, seed=6) * torch.linspace(0.1, 3.0, BS).view(1, 1, 1, BS, 1)
    tier = make_tier(kind, mode)
    for t in range(BS):
        write_span(tier, [3], kv, t, 1)
    assert torch.equal(packed(tier, [3])[0], codec.encode(as_blocks(kv)[0], mode))
    assert len(tier.open_blocks) == 0  # a full block keeps no full-precision copy


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", COMPRESSED)
def test_scattered_token_writes_and_a_retried_step_end_with_the_bytes_of_one_write(make_tier, kind, mode):
    """Writes whose tokens do not run in order through their blocks (a per-token index, two blocks in
    one call; each block still filled from its first token on, as a sequence is), and tokens written
    again with new values (a step that failed and ran again): the final bytes are those of one write
    of the final values."""
    kv = sequence(2 * BS, seed=12)
    tier = make_tier(kind, mode)
    order = [(0, BS), (BS + 1, 1), (3, 2), (4, 5), (BS + 2, 6), (7, BS + 3), (BS + 4, BS + 5)]
    for a, b in order:  # token a and token b in one scattered write
        slots, offsets = np.array([(7, 2)[a // BS], (7, 2)[b // BS]]), np.array([a % BS, b % BS])
        index = tier.token_index(slots, offsets)
        for layer in range(LAYOUT.num_layers):
            tier.write_tokens(layer, index, torch.stack((kv[layer][:, :, a], kv[layer][:, :, b]), 2))
    wrong = sequence(2 * BS, seed=13) * 40  # a step wrote tokens 14, 15 at layer 0, failed at layer 1, ran again
    index = tier.token_index(np.array([2, 2]), np.array([6, 7]))
    tier.write_tokens(0, index, wrong[0][:, :, 14:16])
    write_span(tier, [7, 2], kv, 14, 2)
    assert torch.equal(packed(tier, [7, 2]), codec.encode(as_blocks(kv), mode))


@pytest.mark.parametrize("mode", COMPRESSED)
def test_a_block_that_came_in_whole_and_goes_on_is_quantized_once_more_at_most(make_tier, mode):
    """A partial tail block moved into the tier whole (its first tokens real), then continued token by
    token: its earlier tokens are decoded once, never again per token, so one token at a time ends
    with the bytes of one write of the rest."""
    start = as_blocks(sequence(BS, seed=14))
    kv = sequence(BS, seed=15) * 3
    one_by_one, at_once = make_tier("warm", mode), make_tier("warm", mode)
    for tier in (one_by_one, at_once):
        tier.write_blocks([1], start)
    for t in range(5, BS):
        write_span(one_by_one, [1], kv, t, 1)
    write_span(at_once, [1], kv, 5, BS - 5)
    assert torch.equal(packed(one_by_one, [1]), packed(at_once, [1]))
    assert len(one_by_one.open_blocks) == len(at_once.open_blocks) == 0


@pytest.mark.parametrize("mode", COMPRESSED)
def test_a_bfloat16_block_written_token_by_token_ends_with_the_bytes_of_one_write(make_tier, mode):
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=BS, dtype_name="bfloat16")
    kv = sequence(BS, seed=16).to(torch.bfloat16)
    tier = CompressedWarmTier(layout.stored(mode), 4, torch.bfloat16, pinned=False)
    for t in range(BS):
        write_span(tier, [3], kv, t, 1)
    assert torch.equal(packed(tier, [3])[0], codec.encode(as_blocks(kv)[0], mode))
    assert torch.equal(read_span(tier, [3], 0, BS, 0),
                       codec.decode(codec.encode(as_blocks(kv)[0], mode), mode, 2, BS, 8, torch.bfloat16)[0])


@pytest.mark.parametrize("kind", KINDS)
def test_chats_filling_their_tail_blocks_in_threads_end_with_the_bytes_of_one_write(make_tier, kind):
    """Four threads each fill their own block token by token (as banks in threads do) while another
    reads them: every block ends bitwise equal to one encode, and no open block is left."""
    tier = make_tier(kind, "int8")
    data = {slot: sequence(BS, seed=20 + slot) for slot in (0, 2, 4, 6)}
    errors = []

    def fill(slot):
        try:
            for t in range(BS):
                write_span(tier, [slot], data[slot], t, 1)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=fill, args=(slot,)) for slot in data]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    for slot, kv in data.items():
        assert torch.equal(packed(tier, [slot])[0], codec.encode(as_blocks(kv)[0], "int8"))
    assert len(tier.open_blocks) == 0


# ---- 3. reads are right at every moment -----------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", COMPRESSED)
def test_reads_of_a_block_being_filled_are_right_at_every_moment(make_tier, kind, mode):
    """After every chunk: tokens of the open (tail) block read back exactly as written, full blocks as
    decode(encode); whole-block and packed reads (what a move carries) encode the present tokens only,
    within the mode's bound of them; read_tokens_into a strided buffer agrees with read_tokens."""
    kv = sequence(2 * BS, seed=7)
    full = codec.decode(codec.encode(as_blocks(kv), mode), mode, LAYOUT.num_kv_heads, BS, LAYOUT.head_dim)
    tier = make_tier(kind, mode)
    for start, count in chunked(2 * BS, (3,)):
        write_span(tier, [6, 0], kv, start, count)
        end = start + count
        closed = end // BS  # whole blocks so far
        for layer in range(LAYOUT.num_layers):
            got = read_span(tier, [6, 0], 0, end, layer)
            for b in range(closed):
                assert torch.equal(got[:, :, b * BS:(b + 1) * BS], full[b, layer])
            assert torch.equal(got[:, :, closed * BS:end], kv[layer][:, :, closed * BS:end])
            strided = torch.zeros(2, LAYOUT.num_kv_heads, end + 3, LAYOUT.head_dim)[:, :, 2:end + 2]
            slots = np.repeat(np.array([6, 0]), BS)[:end]
            tier.read_tokens_into(layer, tier.token_index(slots, np.arange(end) % BS), strided)
            assert torch.equal(strided, got)
        if end % BS:
            present = kv[:, :, :, closed * BS:end]
            slot = (6, 0)[closed]
            moved = tier.read_blocks([slot])[0][:, :, :, :end - closed * BS]
            unpacked = codec.decode(packed(tier, [slot]), mode, LAYOUT.num_kv_heads, BS, LAYOUT.head_dim)[0]
            assert torch.equal(unpacked[:, :, :, :end - closed * BS], moved)
            slack = present.abs() * 2 ** -10  # float16 zeros: a one-token key channel has no range to hide them in
            # what was packed: absent tokens as the last present one (open_blocks.absent_filled)
            encoded = torch.cat([present] + [present[..., -1:, :]] * (BS - present.shape[-2]), dim=-2)
            bound = codec.error_bound(encoded, mode)[..., :end - closed * BS, :]
            assert bool(((moved - present).abs() <= bound + slack + 1e-6).all())


# ---- 4. bounded, and dropped with the slot --------------------------------------------------------------

@pytest.mark.parametrize("mode", ("int8", "int4"))
def test_open_blocks_are_bounded_and_go_with_their_slot(make_tier, mode):
    tier = make_tier("warm", mode, num_slots=120)
    cap = tier.open_blocks.max_open
    kv = sequence(BS, seed=8)
    for slot in range(100):  # 100 chats' tail blocks, one token each: never more than the cap open
        write_span(tier, [slot], kv, 0, 2)
        assert len(tier.open_blocks) <= cap
    assert cap < 100
    for slot in (0, 50, 99):  # evicted or not, every block reads right
        got = read_span(tier, [slot], 0, 2, 1)
        assert bool(((got - kv[1][:, :, :2]).abs() <= codec.error_bound(kv[:, :, :, :2], mode)[1] + 1e-6).all())
    assert 99 in tier.open_blocks
    tier.write_blocks([99], as_blocks(sequence(BS, seed=9)))  # a block moved into the slot
    assert 99 not in tier.open_blocks
    tier.forget([98])  # a freed slot (the store tells cold; warm offers the same)
    assert 98 not in tier.open_blocks


@pytest.mark.parametrize("mode", COMPRESSED)
def test_a_forgotten_cold_slot_drops_its_open_block(make_tier, mode):
    tier = make_tier("cold", mode)
    write_span(tier, [1], sequence(BS, seed=10, scale=300.0), 0, 3)
    assert 1 in tier.open_blocks
    tier.forget([1])
    assert 1 not in tier.open_blocks
    kv = sequence(BS, seed=11)
    write_span(tier, [1], kv, 0, BS)
    assert torch.equal(packed(tier, [1])[0], codec.encode(as_blocks(kv)[0], mode))


# ---- 5. end to end: decode tokens written into a compressed warm tier ----------------------------------

def test_decode_tokens_written_into_int8_warm_store_the_bytes_of_one_encode(tmp_path):
    """A tiny hot tier makes a chat's prefill tail and decode tokens land in warm (int8), one token
    a step: the greedy tokens still equal DynamicCache's, and every full warm block written that way
    holds exactly encode() of its layer-0 KV (which does not depend on the history's quantization)."""
    model = tiny_model("llama")
    config = tier_config("forces_warm", tmp_path / "cold")
    config["warm"].update(compression="int8", layout="auto")
    bank = tiered_kv.CacheBank(model, config)
    warm = bank.store.tiers[1]
    written = set()
    real = warm.write_tokens

    def write_tokens(layer, index, kv):
        slots = index[1].tolist()
        written.update(slots)
        return real(layer, index, kv)

    warm.write_tokens = write_tokens
    dynamic = DynamicCache(config=model.config)
    ids = rand_ids(0, 13)
    out = greedy(model, ids, bank, 20)
    assert torch.equal(out, greedy(model, ids, dynamic, 20))
    bs = bank.store.layout.block_size
    keys, values = dynamic.layers[0].keys[0], dynamic.layers[0].values[0]  # [H, T, D]
    checked = 0
    for position, block_id in enumerate(bank.block_table(0)):
        entry = bank.store.index.get(block_id)
        if entry.tier != 1 or entry.slot not in written or (position + 1) * bs > keys.shape[1]:
            continue
        span = slice(position * bs, (position + 1) * bs)
        want = codec.encode(torch.stack((keys[:, span], values[:, span])), "int8")
        assert torch.equal(warm.read_packed([entry.slot])[0, 0], want), f"block {position}"
        checked += 1
    assert checked >= 1
    assert len(warm.open_blocks) <= 1  # at most the chat's tail block
    bank.close()
