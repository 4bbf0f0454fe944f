"""Hot / warm / cold tiers: one batch interface, exact round trips, and the cold file's contract."""
import os
import shutil
import stat

import numpy as np
import pytest
import torch

from tiered_kv import ConfigError, CorruptBlockError
from tiered_kv.blocks import KVLayout
from tiered_kv.hw.block_io import kvikio_usable
from tiered_kv.tiers import ColdTier, HotTier, WarmTier
from tiered_kv.tiers.cold import ALIGN_BYTES, layout_signature
from tiered_kv.tiers.cold_files import LOCK_NAME, open_cold_directory

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype_name="float32")
NUM_SLOTS = 6
TIER_KINDS = ["hot", "warm", "cold"]


def layout_for(dtype_name):
    return KVLayout(LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim, LAYOUT.block_size, dtype_name)


@pytest.fixture
def cold_directory(tmp_path):
    """open_cold_directory(path=tmp_path/"cold"), closed after the test (after its tiers)."""
    opened = []

    def open_directory(path=None):
        directory = open_cold_directory(str(path or tmp_path / "cold"))
        opened.append(directory)
        return directory

    yield open_directory
    for directory in opened:
        directory.close()


@pytest.fixture
def make_tier(cold_directory):
    made = []
    directories = []

    def make(kind, layout=LAYOUT, num_slots=NUM_SLOTS):
        dtype = getattr(torch, layout.dtype_name)
        if kind == "hot":
            tier = HotTier(layout, num_slots, torch.device("cpu"), dtype)
        elif kind == "warm":
            tier = WarmTier(layout, num_slots, dtype, pinned=False)
        else:
            directories[:] = directories or [cold_directory()]
            tier = ColdTier(layout, num_slots, directories[0], backend="posix")
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()


def random_blocks(num_blocks, layout=LAYOUT, seed=0):
    generator = torch.Generator().manual_seed(seed)
    data = torch.randn((num_blocks, *layout.record_shape()), generator=generator)
    return data.to(getattr(torch, layout.dtype_name))


def random_tokens(num_tokens, layout=LAYOUT, seed=1):
    generator = torch.Generator().manual_seed(seed)
    data = torch.randn((2, layout.num_kv_heads, num_tokens, layout.head_dim), generator=generator)
    return data.to(getattr(torch, layout.dtype_name))


def flip_byte(path, offset_bytes):
    with open(path, "r+b") as f:
        f.seek(offset_bytes)
        old = f.read(1)
        f.seek(offset_bytes)
        f.write(bytes([old[0] ^ 0xFF]))


# --- the shared batch interface --------------------------------------------------------------

def test_layout_sizes():
    assert LAYOUT.record_shape() == (2, 2, 2, 4, 4)
    assert (LAYOUT.layer_bytes, LAYOUT.block_bytes, LAYOUT.bytes_per_token) == (256, 512, 128)


@pytest.mark.parametrize("kind", TIER_KINDS)
def test_fresh_tier_reads_zeros(make_tier, kind):
    tier = make_tier(kind)
    assert tier.num_slots == NUM_SLOTS
    assert tier.capacity_bytes == NUM_SLOTS * 512
    out = tier.read_blocks(list(range(NUM_SLOTS)))
    assert out.shape == (NUM_SLOTS, 2, 2, 2, 4, 4)
    assert out.dtype == torch.float32
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("dtype_name", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("kind", TIER_KINDS)
def test_write_blocks_read_blocks_round_trip(make_tier, kind, dtype_name):
    layout = layout_for(dtype_name)
    tier = make_tier(kind, layout)
    data = random_blocks(3, layout)
    tier.write_blocks([3, 0, 5], data)
    tier.flush()
    out = tier.read_blocks([3, 0, 5])
    assert out.dtype == getattr(torch, dtype_name)
    assert torch.equal(out, data)
    # a different order and a subset read back the matching records
    assert torch.equal(tier.read_blocks([5, 3]), data[[2, 0]])
    # untouched slots stay zero
    untouched = tier.read_blocks([1, 2, 4])
    assert torch.equal(untouched, torch.zeros_like(untouched))


@pytest.mark.parametrize("kind", TIER_KINDS)
def test_overwrite_replaces_a_block(make_tier, kind):
    tier = make_tier(kind)
    first, second = random_blocks(1, seed=1), random_blocks(1, seed=2)
    tier.write_blocks([2], first)
    tier.write_blocks([2], second)
    assert torch.equal(tier.read_blocks([2]), second)


@pytest.mark.parametrize("kind", TIER_KINDS)
def test_tokens_round_trip_for_scattered_slots_and_offsets(make_tier, kind):
    tier = make_tier(kind)
    slots = [2, 0, 2, 5, 4, 0]
    offsets = [3, 1, 0, 2, 3, 0]
    kv = random_tokens(len(slots))
    index = tier.token_index(slots, offsets)
    tier.write_tokens(1, index, kv)
    tier.flush()
    out = tier.read_tokens(1, tier.token_index(slots, offsets))
    assert out.shape == (2, 2, 6, 4)
    assert torch.equal(out, kv)
    # the same tokens seen through whole blocks: [slot, layer, kv, head, offset, dim]
    blocks = tier.read_blocks([0, 2, 4, 5])
    row = {0: 0, 2: 1, 4: 2, 5: 3}
    for position, (slot, offset) in enumerate(zip(slots, offsets)):
        assert torch.equal(blocks[row[slot], 1, :, :, offset, :], kv[:, :, position, :])
    # layer 0 and the untouched token positions are still zero
    assert torch.equal(blocks[:, 0], torch.zeros_like(blocks[:, 0]))
    assert torch.equal(blocks[row[2], 1, :, :, [1, 2], :], torch.zeros(2, 2, 2, 4))


@pytest.mark.parametrize("kind", TIER_KINDS)
def test_write_tokens_keeps_the_rest_of_a_written_block(make_tier, kind):
    tier = make_tier(kind)
    data = random_blocks(1)
    tier.write_blocks([1], data)
    kv = random_tokens(2)
    tier.write_tokens(0, tier.token_index([1, 1], [2, 0]), kv)
    expected = data.clone()
    expected[0, 0, :, :, 2, :] = kv[:, :, 0, :]
    expected[0, 0, :, :, 0, :] = kv[:, :, 1, :]
    assert torch.equal(tier.read_blocks([1]), expected)


@pytest.mark.parametrize("kind", TIER_KINDS)
def test_read_tokens_agrees_with_read_blocks(make_tier, kind):
    tier = make_tier(kind)
    data = random_blocks(2)
    tier.write_blocks([4, 1], data)
    slots, offsets = [1, 4, 4, 1], [0, 3, 1, 2]
    for layer in range(LAYOUT.num_layers):
        out = tier.read_tokens(layer, tier.token_index(slots, offsets))
        expected = torch.stack([data[0 if s == 4 else 1, layer, :, :, o, :] for s, o in zip(slots, offsets)], dim=2)
        assert torch.equal(out, expected)


# --- hot tier: contiguous runs are views -----------------------------------------------------

def test_hot_token_index_is_a_slice_for_consecutive_slots(make_tier):
    tier = make_tier("hot")
    index = tier.token_index([1, 1, 1, 1, 2, 2], [0, 1, 2, 3, 0, 1])
    assert index == slice(4, 10)
    assert tier.token_index([3], [2]) == slice(14, 15)


@pytest.mark.parametrize("slots, offsets, flat", [
    ([1, 3], [3, 0], [7, 12]),          # slot gap
    ([2, 2], [1, 0], [9, 8]),           # backwards
    ([0, 0, 0], [0, 1, 1], [0, 1, 1]),  # repeat
    ([0, 2], [1, 0], [1, 8]),
])
def test_hot_token_index_is_a_tensor_otherwise(make_tier, slots, offsets, flat):
    tier = make_tier("hot")
    index = tier.token_index(slots, offsets)
    assert isinstance(index, torch.Tensor)
    assert index.dtype == torch.long
    assert index.tolist() == flat


def test_hot_read_tokens_on_a_slice_is_a_view_of_the_slab(make_tier):
    tier = make_tier("hot")
    data = random_blocks(2)
    tier.write_blocks([1, 2], data)
    index = tier.token_index([1, 1, 1, 1, 2, 2, 2, 2], [0, 1, 2, 3, 0, 1, 2, 3])
    assert index == slice(4, 12)
    view = tier.read_tokens(1, index)
    assert view.untyped_storage().data_ptr() == tier.slab.untyped_storage().data_ptr()
    assert torch.equal(view, torch.cat([data[0, 1], data[1, 1]], dim=2))
    tier.slab[1, 0, 0, 4, 0] = 123.0  # slot 1, offset 0, K, head 0, dim 0 of layer 1
    assert view[0, 0, 0, 0].item() == 123.0


def test_hot_slab_layout_puts_slot_tokens_on_the_token_axis(make_tier):
    tier = make_tier("hot")
    assert tier.slab.shape == (2, 2, 2, NUM_SLOTS * 4, 4)
    data = random_blocks(1)
    tier.write_blocks([3], data)
    assert torch.equal(tier.slab[:, :, :, 12:16, :], data[0])
    assert torch.equal(tier.block_view(3), data[0])


def test_warm_slab_holds_one_record_per_slot(make_tier):
    tier = make_tier("warm")
    assert tier.slab.shape == (NUM_SLOTS, 2, 2, 2, 4, 4)
    data = random_blocks(1)
    tier.write_blocks([4], data)
    assert torch.equal(tier.slab[4], data[0])
    assert tier.block_view(4).data_ptr() == tier.slab[4].data_ptr()


# --- cold tier: the file ---------------------------------------------------------------------

def test_cold_file_mode_size_and_directory_mode(make_tier, tmp_path):
    tier = make_tier("cold")
    assert tier.record_stride_bytes == 4096
    assert tier.io.name == "posix"
    assert tier.file_path == str(tmp_path / "cold" / f"kv-{layout_signature(LAYOUT)}.blocks")
    assert layout_signature(LAYOUT).startswith("v1-") and len(layout_signature(LAYOUT)) == 19  # format version
    file_stat = os.stat(tier.file_path)
    assert stat.S_IMODE(file_stat.st_mode) == 0o600
    assert file_stat.st_size == NUM_SLOTS * 4096
    assert stat.S_IMODE(os.stat(tmp_path / "cold").st_mode) == 0o700
    assert stat.S_IMODE(os.stat(tmp_path / "cold" / LOCK_NAME).st_mode) == 0o600
    assert sorted(os.listdir(tmp_path / "cold")) == sorted([LOCK_NAME, os.path.basename(tier.file_path)])


def test_cold_uses_an_existing_directory_of_ours_without_chmod(cold_directory, tmp_path):
    """Readable by others is allowed; the store never chmods a directory it did not create."""
    path = tmp_path / "shared"
    path.mkdir()
    os.chmod(path, 0o755)
    tier = ColdTier(LAYOUT, 1, cold_directory(path), backend="posix")
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o755
    finally:
        tier.close()


@pytest.mark.parametrize("num_layers, head_dim, stride", [
    (2, 4, 4096),      # 512-byte blocks
    (8, 64, 36864),    # 32 KiB blocks fill their pages: one more for the header
    (9, 8, 8192),      # 4608-byte blocks and a 512-byte header round up to two pages
])
def test_cold_record_stride_is_4096_aligned(cold_directory, num_layers, head_dim, stride):
    layout = KVLayout(num_layers, 2, head_dim, 4, "float32")
    tier = ColdTier(layout, 3, cold_directory(), backend="posix")
    try:
        assert tier.record_stride_bytes == stride
        assert stride % ALIGN_BYTES == 0
        assert os.path.getsize(tier.file_path) == 3 * stride
    finally:
        tier.close()


def test_cold_record_lies_at_slot_times_stride(make_tier):
    tier = make_tier("cold")
    data = random_blocks(1)
    tier.write_blocks([3], data)
    tier.flush()
    on_disk = np.fromfile(tier.file_path, dtype=np.float32, count=128, offset=3 * 4096)
    assert np.array_equal(on_disk, data[0].reshape(-1).numpy())
    before = np.fromfile(tier.file_path, dtype=np.uint8, count=3 * 4096)
    assert not before.any()


@pytest.mark.parametrize("layer", [0, 1])
def test_cold_flipped_byte_raises_corrupt_block_error_naming_the_slot(make_tier, layer):
    tier = make_tier("cold")
    data = random_blocks(2)
    tier.write_blocks([2, 4], data)
    tier.flush()
    flip_byte(tier.file_path, 2 * 4096 + layer * LAYOUT.layer_bytes + 10)
    with pytest.raises(CorruptBlockError, match=rf"cold tier slot 2 layer {layer} failed its checksum"):
        tier.read_blocks([2])
    with pytest.raises(CorruptBlockError, match=rf"slot 2 layer {layer}"):
        tier.read_blocks([4, 2])
    with pytest.raises(CorruptBlockError, match=rf"slot 2 layer {layer}"):
        tier.read_tokens(layer, tier.token_index([4, 2], [0, 3]))
    # the other layer of the slot and the other slot still pass their checks
    other = 1 - layer
    assert torch.equal(tier.read_tokens(other, tier.token_index([2], [1])), data[0, other, :, :, 1:2, :])
    assert torch.equal(tier.read_blocks([4]), data[1:2])


def test_cold_write_tokens_into_a_corrupt_slice_raises(make_tier):
    tier = make_tier("cold")
    tier.write_blocks([1], random_blocks(1))
    flip_byte(tier.file_path, 1 * 4096)
    with pytest.raises(CorruptBlockError, match=r"slot 1 layer 0"):
        tier.write_tokens(0, tier.token_index([1], [0]), random_tokens(1))


def test_cold_rewriting_a_corrupt_block_heals_it(make_tier):
    tier = make_tier("cold")
    tier.write_blocks([1], random_blocks(1, seed=3))
    flip_byte(tier.file_path, 1 * 4096 + 5)
    fresh = random_blocks(1, seed=4)
    tier.write_blocks([1], fresh)
    assert torch.equal(tier.read_blocks([1]), fresh)


def test_cold_never_written_and_forgotten_slots_move_as_zeros_but_are_never_served(make_tier):
    tier = make_tier("cold")
    tier.write_blocks([0, 1], random_blocks(2))
    tier.forget([1])
    # a whole-block move of a slot taken but not yet written (a block allocated this step) moves zeros
    out = tier.read_blocks([1, 5])
    assert torch.equal(out, torch.zeros_like(out))
    # a forgotten slot is not checked: damage to its old bytes goes unnoticed by moves
    flip_byte(tier.file_path, 1 * 4096)
    assert torch.equal(tier.read_blocks([1]), torch.zeros(1, 2, 2, 2, 4, 4))
    # but tokens are served only from written slices: a slice without data is a corrupt block
    with pytest.raises(CorruptBlockError, match=r"slot 5 layer 0 holds no written data") as caught:
        tier.read_tokens(0, tier.token_index([5, 1], [0, 3]))
    assert caught.value.slot == 5
    assert tier.read_tokens(0, tier.token_index([0], [2])).shape == (2, 2, 1, 4)


def test_cold_write_tokens_on_a_fresh_slot_zero_fills_the_rest(make_tier):
    tier = make_tier("cold")
    kv = random_tokens(1)
    tier.write_tokens(1, tier.token_index([3], [2]), kv)
    expected = torch.zeros(1, 2, 2, 2, 4, 4)
    expected[0, 1, :, :, 2, :] = kv[:, :, 0, :]
    assert torch.equal(tier.read_blocks([3]), expected)


def test_cold_path_under_a_regular_file_raises_config_error(tmp_path):
    regular = tmp_path / "not-a-dir"
    regular.write_text("x")
    with pytest.raises(ConfigError, match=r"config key 'cold\.path': got .*not-a-dir/cold.*not a writable directory"):
        open_cold_directory(str(regular / "cold"))


def test_cold_path_that_is_a_regular_file_raises_config_error(tmp_path):
    regular = tmp_path / "file"
    regular.write_text("x")
    with pytest.raises(ConfigError, match=r"'cold\.path'.*not a writable directory"):
        open_cold_directory(str(regular))


def test_stores_on_one_path_each_claim_a_block_file_and_a_free_one_is_taken_over(tmp_path):
    """Two tiers on one directory (two stores) write files 0 and 1; once the first closes, a third
    takes file 0 over, with the records the first made durable there."""
    first_dir, second_dir = open_cold_directory(str(tmp_path / "cold")), open_cold_directory(str(tmp_path / "cold"))
    first = ColdTier(LAYOUT, 2, first_dir, backend="posix")
    second = ColdTier(LAYOUT, 2, second_dir, backend="posix")
    assert (first.file_number, second.file_number) == (0, 1) and first.file_path != second.file_path
    first.write_blocks([1], torch.ones((1, *LAYOUT.record_shape())))
    first.persist(1, b"k" * 16, b"r" * 16)
    first.flush()
    first.close()
    first_dir.close()
    third_dir = open_cold_directory(str(tmp_path / "cold"))
    third = ColdTier(LAYOUT, 2, third_dir, backend="posix")
    try:
        assert third.file_number == 0 and third.durable_records() == [(1, b"k" * 16, b"r" * 16)]
    finally:
        for tier, directory in ((second, second_dir), (third, third_dir)):
            tier.close()
            directory.close()


def test_cold_tiers_of_different_layouts_share_a_directory(cold_directory):
    directory = cold_directory()
    a = ColdTier(LAYOUT, 1, directory, backend="posix")
    b = ColdTier(layout_for("float16"), 1, directory, backend="posix")
    try:
        assert a.file_path != b.file_path
    finally:
        a.close()
        b.close()


def test_kvikio_backend_is_used_where_it_works_and_refused_where_not(cold_directory, tmp_path):
    directory = cold_directory()
    if kvikio_usable():  # a GPU machine with the [gpu] extra
        tier = ColdTier(LAYOUT, 2, directory, backend="kvikio")
        assert tier.io.name == "kvikio"
        data = random_blocks(1)
        tier.write_blocks([1], data)
        assert torch.equal(tier.read_blocks([1]), data)
        tier.close()
        return
    with pytest.raises(ConfigError, match=r"config key 'cold\.backend': got 'kvikio'.*allowed here: 'auto', 'posix'"):
        ColdTier(LAYOUT, 2, directory, backend="kvikio")
    assert os.listdir(tmp_path / "cold") == [LOCK_NAME]  # checked before the block file is created


def test_cold_capacity_beyond_the_disk_raises_config_error(cold_directory, tmp_path):
    usage = shutil.disk_usage(tmp_path)
    # far more than the disk holds (and than ext4's largest file): refused before fallocate
    num_slots = max(usage.total * 1024, 2**60) // 4096
    directory = cold_directory()
    with pytest.raises(ConfigError, match=rf"config key 'cold\.capacity': {num_slots * 4096} bytes do not fit"):
        ColdTier(LAYOUT, num_slots, directory, backend="posix")
    assert os.listdir(tmp_path / "cold") == [LOCK_NAME]  # the block file it made is gone
    # a small tier in the same directory opens
    tier = ColdTier(LAYOUT, 2, directory, backend="posix")
    tier.close()


def test_cold_close_is_idempotent_and_flushes(make_tier):
    tier = make_tier("cold")
    tier.write_blocks([0], random_blocks(1))
    assert tier._dirty is True
    tier.flush()
    assert tier._dirty is False
    tier.close()
    tier.close()
    assert tier._fd is None


@pytest.mark.parametrize("kind", TIER_KINDS)
@pytest.mark.parametrize("first, count", [(0, 12), (2, 7), (3, 1)])
def test_runs_through_whole_blocks_read_and_write_like_scattered_tokens(make_tier, kind, first, count):
    """A run of tokens through blocks in order (what a step maps) gives the same data as the
    per-token path; the warm tier serves such runs with a block-level gather."""
    tier = make_tier(kind)
    data = random_blocks(3)
    block_slots = [5, 0, 3]
    tier.write_blocks(block_slots, data)
    positions = range(first, first + count)
    slots = [block_slots[p // 4] for p in positions]
    offsets = [p % 4 for p in positions]
    index = tier.token_index(slots, offsets)
    if kind == "warm":
        assert index[0] == "blocks"
    for layer in range(LAYOUT.num_layers):
        expected = torch.stack([data[p // 4, layer, :, :, p % 4, :] for p in positions], dim=2)
        assert torch.equal(tier.read_tokens(layer, index), expected)
    fresh = random_tokens(count, seed=7)
    tier.write_tokens(1, index, fresh)
    assert torch.equal(tier.read_tokens(1, index), fresh)
    assert torch.equal(tier.read_tokens(0, index), torch.stack([data[p // 4, 0, :, :, p % 4, :] for p in positions], 2))


def test_a_few_runs_of_slots_copy_run_by_run_and_equal_a_gather():
    """Tokens lying in a few runs of consecutive slots (a sliding window's row after its slab
    filled around it) are one SliceRuns index: read, read_into and write agree with a per-token
    gather of the same positions."""
    from tiered_kv.tiers.paged import SliceRuns

    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype_name="float32")
    hot = HotTier(layout, 16, torch.device("cpu"), torch.float32)
    hot.slab.copy_(torch.randn_like(hot.slab))
    slots = np.repeat(np.array([3, 4, 5, 6, 7, 9, 10, 11, 12, 13]), 4)[2:]
    offsets = np.tile(np.arange(4), 10)[2:]
    index = hot.token_index(slots, offsets)
    assert isinstance(index, SliceRuns) and len(index) == 2
    flat = torch.from_numpy(slots * 4 + offsets)
    expected = hot.slab[1].index_select(2, flat)
    assert torch.equal(hot.read_tokens(1, index), expected)
    out = torch.empty_like(expected)
    hot.read_tokens_into(1, index, out)
    assert torch.equal(out, expected)
    new = torch.randn_like(expected)
    hot.write_tokens(0, index, new)
    assert torch.equal(hot.slab[0].index_select(2, flat), new)
    scattered = hot.token_index(np.array([1, 7, 2, 9]), np.array([0, 1, 2, 3]))
    assert isinstance(scattered, torch.Tensor)  # short scattered tokens: one gather
