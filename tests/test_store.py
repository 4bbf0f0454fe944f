"""TierStore: placement, data through every move, capacity, caching, corruption and stats, on CPU."""
import types

import numpy as np
import pytest
import torch

from tiered_kv import CapacityError, CorruptBlockError, LayoutError, TierStore
from tiered_kv.blocks import KVLayout
from tiered_kv.scheduler import Move
from tiered_kv.store import StepRequest
from tiered_kv.store.token_map import raise_if_corrupt
from tiered_kv.scheduler import COLD, HOT, WARM

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype_name="float32")
BLOCK_BYTES = 512
STRIDE_BYTES = 4096  # one cold record per 4 KiB page
NO_BYTES_MOVED = {"hot->warm": 0, "hot->cold": 0, "warm->hot": 0, "warm->cold": 0, "cold->hot": 0, "cold->warm": 0}


@pytest.fixture
def make_store(tmp_path):
    stores = []

    def make(hot, warm, cold, bind=True):
        store = TierStore({
            "block_size": LAYOUT.block_size,
            "hot": {"device": "cpu", "capacity_blocks": hot},
            "warm": {"capacity_blocks": warm, "pinned": False},
            "cold": {"capacity_blocks": cold, "path": str(tmp_path / f"cold{len(stores)}"), "backend": "posix"},
        })
        stores.append(store)
        if bind:
            store.bind(LAYOUT, torch.float32)
        return store

    yield make
    for store in stores:
        store.close()


def allocate_one_by_one(store, count):
    return [store.allocate(1)[0] for _ in range(count)]


def tiers_of(store, block_ids):
    return [store.index.get(b).tier for b in block_ids]


def used(store):
    return [store.stats()["tiers"][name]["used_blocks"] for name in ("hot", "warm", "cold")]


def block_data(seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn((1, *LAYOUT.record_shape()), generator=generator)


def write_block(store, block_id, data):
    entry = store.index.get(block_id)
    store.tiers[entry.tier].write_blocks([entry.slot], data)


def read_block(store, block_id):
    entry = store.index.get(block_id)
    return store.tiers[entry.tier].read_blocks([entry.slot]).to("cpu")


def flip_cold_byte(store, block_id, byte_in_record=7):
    entry = store.index.get(block_id)
    assert entry.tier == COLD
    with open(store.tiers[COLD].file_path, "r+b") as f:
        f.seek(entry.slot * STRIDE_BYTES + byte_in_record)
        old = f.read(1)
        f.seek(entry.slot * STRIDE_BYTES + byte_in_record)
        f.write(bytes([old[0] ^ 0xFF]))


def map_tokens(store, block_ids, offsets):
    """TierRuns for arbitrary tokens given as (block, offset in block), through the store's
    mapper (what a step's lease maps once, at its start)."""
    tiers, slots = store.placements(block_ids)
    raise_if_corrupt(tiers, np.asarray(block_ids, dtype=np.int64), "blocks")
    return store.mapper.group_by_tier(tiers, slots, np.asarray(offsets, dtype=np.int64))


def lease_on(store, block_id, owner=999):
    """A step's lease over one block of 4 tokens: 3 in it already, the 4th is the new one."""
    return store.open_step(StepRequest(owner, [[block_id]], {block_id}, LAYOUT.block_size - 1, 1))


def check_pools_match_index(store):
    for tier in (HOT, WARM, COLD):
        slots = sorted(e.slot for _, e in store.index.items() if e.tier == tier)
        assert slots == [s for s in range(store.pools[tier].num_slots) if store.pools[tier].is_used(s)]


# --- binding ---------------------------------------------------------------------------------

def test_bind_preallocates_every_tier(make_store, tmp_path):
    store = make_store(2, 3, 4)
    assert store.is_bound
    assert store.capacities == [2, 3, 4]
    assert store.state.free_slots() == [2, 3, 4]
    assert store.total_capacity_blocks == 9
    assert store.tiers[HOT].slab.shape == (2, 2, 2, 8, 4)
    assert store.tiers[WARM].slab.shape == (2, 2, 2, 12, 4)  # a CPU store: paged, as hot (warm.layout auto)
    assert store.tiers[COLD].num_slots == 4
    assert str(tmp_path / "cold0") in store.tiers[COLD].file_path


def _paths_to(target, roots: dict) -> list[str]:
    """The attribute paths from `roots` by which `target` is reached: instance attributes and slots,
    container items, bound methods' objects, closures' cells (not modules, classes or weak references)."""
    seen, found, stack = set(), [], list(roots.items())
    while stack:
        path, obj = stack.pop()
        if obj is target:
            found.append(path)
            continue
        if id(obj) in seen or isinstance(obj, (type, types.ModuleType, torch.Tensor, np.ndarray, str, bytes, int)):
            continue
        seen.add(id(obj))
        if isinstance(obj, dict):
            stack += [(f"{path}[{key!r}]", value) for key, value in obj.items()]
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack += [(f"{path}[{i}]", value) for i, value in enumerate(obj)]
        elif isinstance(obj, types.MethodType):
            stack.append((f"{path}.__self__", obj.__self__))
        elif isinstance(obj, types.FunctionType):
            stack += [(f"{path}<closure>", cell.cell_contents) for cell in obj.__closure__ or ()]
        if hasattr(obj, "__dict__") and not isinstance(obj, types.FunctionType):
            stack += [(f"{path}.{name}", value) for name, value in vars(obj).items()]
        stack += [(f"{path}.{name}", getattr(obj, name)) for name in getattr(type(obj), "__slots__", ())
                  if hasattr(obj, name)]
    return found


def test_no_component_reaches_the_store(tmp_path):
    """The façade hands each component what it uses (docs/design.md): none holds the store, by an
    attribute or a callable's closure (tests/test_structure.py checks the source)."""
    store = TierStore({"block_size": LAYOUT.block_size, "hot": {"device": "cpu", "capacity_blocks": 2},
                       "warm": {"capacity_blocks": 2, "pinned": False}, "scheduler": {"background": True},
                       "cold": {"capacity_blocks": 2, "path": str(tmp_path / "cold"), "backend": "posix"}})
    try:
        store.bind(LAYOUT, torch.float32)
        assert store.mover is not None and store.opening is not None
        assert _paths_to(store, {name: value for name, value in vars(store).items()}) == []
    finally:
        store.close()


def test_bind_again_with_the_same_layout_is_a_no_op(make_store):
    store = make_store(2, 2, 2)
    (block,) = store.allocate(1)
    hot = store.tiers[HOT]
    store.bind(LAYOUT, torch.float32)
    assert store.tiers[HOT] is hot
    assert block in store.index


@pytest.mark.parametrize("layout, dtype", [
    (KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, block_size=4, dtype_name="float32"), torch.float32),
    (KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype_name="float16"), torch.float16),
    (LAYOUT, torch.float16),
])
def test_bind_with_another_layout_raises_layout_error(make_store, layout, dtype):
    store = make_store(2, 2, 2)
    with pytest.raises(LayoutError, match=r"this TierStore serves KV layout .*Use one store per model shape and dtype"):
        store.bind(layout, dtype)
    assert store.layout == LAYOUT and store.dtype == torch.float32


def test_disabled_warm_and_cold_tiers(make_store):
    store = make_store(2, 0, 0)
    assert store.tiers[COLD] is None
    assert store.allocate(2) == [0, 1]
    with pytest.raises(CapacityError):
        store.allocate(1)
    assert store.stats()["tiers"]["cold"]["device"] == "disabled"


# --- allocation and LRU demotion ---------------------------------------------------------------

def test_allocate_fills_hot_then_demotes_the_least_recently_used(make_store):
    store = make_store(2, 2, 2)
    assert store.allocate(0) == []
    assert store.allocate(2) == [0, 1]
    assert [store.index.get(b).slot for b in (0, 1)] == [0, 1]
    assert used(store) == [2, 0, 0]
    store.index.touch([0])  # block 1 is now the least recently used
    assert store.allocate(1) == [2]
    assert tiers_of(store, [0, 1, 2]) == [HOT, WARM, HOT]
    assert store.index.get(2).slot == 1  # reuses the slot block 1 left
    assert used(store) == [2, 1, 0]
    assert store.stats()["bytes_moved"] == {**NO_BYTES_MOVED, "hot->warm": BLOCK_BYTES}
    # two more: block 0 (touched before 2 was made) goes down, then 2; warm's 1 goes on to cold
    assert store.allocate(2) == [3, 4]
    assert tiers_of(store, [0, 1, 2, 3, 4]) == [WARM, COLD, WARM, HOT, HOT]
    assert used(store) == [2, 2, 1]
    assert store.stats()["bytes_moved"] == {**NO_BYTES_MOVED, "hot->warm": 3 * BLOCK_BYTES,
                                            "warm->cold": BLOCK_BYTES}
    check_pools_match_index(store)


def test_allocate_more_than_hot_holds_spills_new_blocks_down(make_store):
    store = make_store(2, 2, 2)
    assert store.allocate(5) == [0, 1, 2, 3, 4]
    assert tiers_of(store, range(5)) == [HOT, HOT, WARM, WARM, COLD]
    assert used(store) == [2, 2, 1]
    assert store.stats()["bytes_moved"] == NO_BYTES_MOVED


def test_capacity_error_changes_nothing(make_store):
    store = make_store(1, 1, 1)
    assert allocate_one_by_one(store, 3) == [0, 1, 2]
    before_stats = store.stats()
    before_index = {b: (e.tier, e.slot, e.ref_count) for b, e in store.index.items()}
    before_order = [list(store.index.recency(t)) for t in (HOT, WARM, COLD)]
    with pytest.raises(CapacityError, match=r"need 1 more blocks of 4 tokens \(512 bytes each\) but all tiers "
                                            r"together hold 3 \(hot 1, warm 1, cold 1\) and 3 are in use"):
        store.allocate(1)
    assert used(store) == [1, 1, 1]
    assert store.stats()["bytes_moved"] == before_stats["bytes_moved"]
    assert {b: (e.tier, e.slot, e.ref_count) for b, e in store.index.items()} == before_index
    assert [list(store.index.recency(t)) for t in (HOT, WARM, COLD)] == before_order


def test_capacity_error_for_a_request_larger_than_every_tier(make_store):
    store = make_store(1, 1, 1)
    with pytest.raises(CapacityError, match=r"need 4 more blocks"):
        store.allocate(4)
    assert used(store) == [0, 0, 0]
    assert len(store.index) == 0
    assert store.allocate(3) == [0, 1, 2]


def test_cached_block_behind_a_referenced_lru_block_is_dropped(make_store):
    """Cold: block 0 (old, referenced) and block 1 (newer, unreferenced cache). Dropping block 1
    makes room, so the allocation must succeed and only block 1 disappears."""
    store = make_store(1, 1, 2)
    assert allocate_one_by_one(store, 4) == [0, 1, 2, 3]
    assert tiers_of(store, [0, 1, 2, 3]) == [COLD, COLD, WARM, HOT]
    assert store.publish(1, b"cached")
    store.release([1])
    assert store.allocate(1) == [4]
    assert 1 not in store.index
    assert tiers_of(store, [0, 2, 3, 4]) == [COLD, COLD, WARM, HOT]


# --- release, retain and the content cache -------------------------------------------------------

def test_release_frees_the_slot(make_store):
    store = make_store(3, 1, 1)
    assert store.allocate(3) == [0, 1, 2]
    store.release([1])
    assert 1 not in store.index
    assert used(store) == [2, 0, 0]
    assert store.pools[HOT].free_order() == [1]
    assert store.allocate(1) == [3]
    assert store.index.get(3).slot == 1


def test_retain_keeps_a_block_until_the_last_release(make_store):
    store = make_store(2, 1, 1)
    (block,) = store.allocate(1)
    store.retain([block])
    store.release([block])
    assert block in store.index and store.index.get(block).ref_count == 1
    store.release([block])
    assert block not in store.index
    with pytest.raises(KeyError, match=r"block 0 is not in the index"):
        store.release([block])


def test_released_cold_block_is_forgotten(make_store):
    store = make_store(1, 1, 1)
    allocate_one_by_one(store, 3)
    cold_slot = store.index.get(0).slot
    write_block(store, 0, block_data(1))
    assert store.tiers[COLD].valid[cold_slot].all()
    store.release([0])
    assert not store.tiers[COLD].valid[cold_slot].any()
    assert used(store) == [1, 1, 0]


def test_hashed_block_without_references_stays_cached(make_store):
    store = make_store(2, 1, 1)
    assert store.allocate(2) == [0, 1]
    assert store.publish(0, b"prefix")
    assert not store.publish(1, b"prefix")  # the first block keeps the key
    store.release([0])
    assert 0 in store.index and store.index.get(0).ref_count == 0
    assert store.index.lookup(b"prefix") == 0
    assert used(store) == [2, 0, 0]
    assert store.lookup_and_retain([b"prefix", b"missing"]) == [0]  # reused through the cache
    assert store.index.get(0).ref_count == 1
    assert store.stats()["misses"] == 1
    store.index.unpublish(0)
    assert store.index.lookup(b"prefix") is None


def test_cached_block_is_dropped_when_space_is_needed(make_store):
    store = make_store(1, 1, 1)
    assert allocate_one_by_one(store, 3) == [0, 1, 2]
    assert tiers_of(store, [0, 1, 2]) == [COLD, WARM, HOT]
    store.publish(0, b"old")
    store.release([0])
    assert store.index.lookup(b"old") == 0
    assert store.allocate(1) == [3]
    assert 0 not in store.index
    assert store.index.lookup(b"old") is None
    assert tiers_of(store, [1, 2, 3]) == [COLD, WARM, HOT]
    assert used(store) == [1, 1, 1]
    check_pools_match_index(store)


# --- data through moves ------------------------------------------------------------------------

def test_block_data_survives_demotion_to_cold_and_promotion_back(make_store):
    store = make_store(1, 1, 2)
    data = [block_data(seed) for seed in range(3)]
    (b0,) = store.allocate(1)
    write_block(store, b0, data[0])
    (b1,) = store.allocate(1)
    write_block(store, b1, data[1])
    assert tiers_of(store, [b0, b1]) == [WARM, HOT]
    assert torch.equal(read_block(store, b0), data[0])
    (b2,) = store.allocate(1)
    write_block(store, b2, data[2])
    assert tiers_of(store, [b0, b1, b2]) == [COLD, WARM, HOT]
    for block, expected in zip((b0, b1, b2), data):
        assert torch.equal(read_block(store, block), expected)

    assert store.promote([b0]) == []
    assert tiers_of(store, [b0, b1, b2]) == [HOT, COLD, WARM]
    for block, expected in zip((b0, b1, b2), data):
        assert torch.equal(read_block(store, block), expected)
    assert store.stats()["bytes_moved"] == {**NO_BYTES_MOVED, "hot->warm": 3 * BLOCK_BYTES,
                                            "warm->cold": 2 * BLOCK_BYTES, "cold->hot": BLOCK_BYTES}
    check_pools_match_index(store)


def test_promotion_with_every_tier_full_moves_nothing(make_store):
    store = make_store(1, 1, 1)
    data = [block_data(seed) for seed in (10, 11, 12)]
    for seed_data, block in zip(data, allocate_one_by_one(store, 3)):
        write_block(store, block, seed_data)
    assert tiers_of(store, [0, 1, 2]) == [COLD, WARM, HOT]
    # hot holds a wanted block and warm's block has no free cold slot to go to (moves never swap)
    assert store.promote([2, 0]) == []
    assert tiers_of(store, [0, 1, 2]) == [COLD, WARM, HOT]
    for block, expected in zip((0, 1, 2), data):
        assert torch.equal(read_block(store, block), expected)


def test_block_moved_twice_in_one_plan_keeps_its_data(make_store):
    store = make_store(1, 1, 1)
    (b0,) = store.allocate(1)
    data = block_data(30)
    write_block(store, b0, data)
    assert store.allocate(2) == [1, 2]
    # block 0 went hot -> warm for the first new block, then warm -> cold for the second
    assert tiers_of(store, [0, 1, 2]) == [COLD, HOT, WARM]
    assert torch.equal(read_block(store, b0), data)
    assert store.stats()["bytes_moved"] == {**NO_BYTES_MOVED, "hot->warm": BLOCK_BYTES, "warm->cold": BLOCK_BYTES}


def test_warm_block_promoted_to_free_hot_slot(make_store):
    store = make_store(1, 1, 1)
    data = block_data(31)
    (b0,) = store.allocate(1)
    write_block(store, b0, data)
    store.allocate(1)
    store.release([1])
    assert tiers_of(store, [b0]) == [WARM] and used(store) == [0, 1, 0]
    assert store.promote([b0]) == []
    assert tiers_of(store, [b0]) == [HOT] and used(store) == [1, 0, 0]
    assert torch.equal(read_block(store, b0), data)
    assert store.stats()["bytes_moved"] == {**NO_BYTES_MOVED, "hot->warm": BLOCK_BYTES, "warm->hot": BLOCK_BYTES}


def test_without_warm_hot_and_cold_swap_directly(make_store):
    store = make_store(1, 0, 2)
    data = [block_data(32), block_data(33)]
    (b0,) = store.allocate(1)
    write_block(store, b0, data[0])
    (b1,) = store.allocate(1)
    write_block(store, b1, data[1])
    assert tiers_of(store, [b0, b1]) == [COLD, HOT]
    assert store.promote([b0]) == []
    assert tiers_of(store, [b0, b1]) == [HOT, COLD]
    assert torch.equal(read_block(store, b0), data[0])
    assert torch.equal(read_block(store, b1), data[1])
    assert store.stats()["bytes_moved"] == {**NO_BYTES_MOVED, "hot->cold": 2 * BLOCK_BYTES, "cold->hot": BLOCK_BYTES}


def test_tokens_written_per_layer_survive_moves(make_store):
    store = make_store(1, 1, 1)
    (b0,) = store.allocate(1)
    runs = map_tokens(store, [b0] * 4, [0, 1, 2, 3])
    kv = [torch.randn(2, 2, 4, 4, generator=torch.Generator().manual_seed(layer)) for layer in (0, 1)]
    for layer in (0, 1):
        store.mapper.write_layer(layer, runs, kv[layer])
    allocate_one_by_one(store, 2)
    assert tiers_of(store, [b0]) == [COLD]
    cold_runs = map_tokens(store, [b0] * 4, [0, 1, 2, 3])
    for layer in (0, 1):
        assert torch.equal(store.mapper.read_layer(layer, cold_runs, 4), kv[layer])
    store.release([1])  # frees warm, so hot's block 2 can step down for block 0
    assert store.promote([b0]) == []
    assert tiers_of(store, [b0]) == [HOT]
    hot_runs = map_tokens(store, [b0] * 4, [0, 1, 2, 3])
    for layer in (0, 1):
        assert torch.equal(store.mapper.read_layer(layer, hot_runs, 4), kv[layer])


def test_map_tokens_across_tiers_round_trips(make_store):
    store = make_store(1, 1, 1)
    assert allocate_one_by_one(store, 3) == [0, 1, 2]
    assert tiers_of(store, [0, 1, 2]) == [COLD, WARM, HOT]
    block_ids, offsets = [0, 1, 2, 0, 2], [0, 1, 2, 3, 0]
    runs = map_tokens(store, block_ids, offsets)
    # one run per range of consecutive positions in a tier, each read straight into its place
    assert [(run.tier, run.positions.tolist(), run.span) for run in runs] == [
        (HOT, [2], (2, 3)), (HOT, [4], (4, 5)), (WARM, [1], (1, 2)), (COLD, [0], (0, 1)), (COLD, [3], (3, 4))]
    kv = torch.randn(2, 2, 5, 4, generator=torch.Generator().manual_seed(5))
    store.mapper.write_layer(1, runs, kv)
    assert torch.equal(store.mapper.read_layer(1, runs, 5), kv)
    assert torch.equal(store.mapper.read_layer(0, runs, 5), torch.zeros(2, 2, 5, 4))
    # each token landed in its block at its offset
    for position, (block, offset) in enumerate(zip(block_ids, offsets)):
        assert torch.equal(read_block(store, block)[0, 1, :, :, offset, :], kv[:, :, position, :])


def test_single_hot_run_of_consecutive_slots_is_read_without_copy(make_store):
    store = make_store(2, 1, 1)
    assert store.allocate(2) == [0, 1]
    runs = map_tokens(store, [0] * 4 + [1] * 4, [0, 1, 2, 3] * 2)
    assert len(runs) == 1 and runs[0].tier == HOT and runs[0].positions is None
    assert runs[0].index == slice(0, 8)
    out = store.mapper.read_layer(0, runs, 8)
    assert out.untyped_storage().data_ptr() == store.tiers[HOT].slab.untyped_storage().data_ptr()


def test_copy_block_within_hot_copies_content(make_store):
    store = make_store(2, 1, 1)
    (source,) = store.allocate(1)
    data = block_data(7)
    write_block(store, source, data)
    copy = store.allocation.copy_block(source)
    assert copy == 1
    assert tiers_of(store, [source, copy]) == [HOT, HOT]
    assert torch.equal(read_block(store, copy), data)
    write_block(store, source, block_data(8))  # the copy is independent
    assert torch.equal(read_block(store, copy), data)
    assert store.stats()["bytes_moved"] == NO_BYTES_MOVED  # nothing crossed a tier boundary


def test_copy_block_from_cold_into_hot_copies_content(make_store):
    store = make_store(1, 1, 1)
    data = block_data(9)
    (source,) = store.allocate(1)
    write_block(store, source, data)
    allocate_one_by_one(store, 2)
    assert tiers_of(store, [source]) == [COLD]
    store.release([1, 2])
    copy = store.allocation.copy_block(source)
    assert tiers_of(store, [source, copy]) == [COLD, HOT]
    assert torch.equal(read_block(store, copy), data)
    assert store.stats()["bytes_moved"]["cold->hot"] == BLOCK_BYTES


# --- corruption --------------------------------------------------------------------------------

def test_corrupt_cold_block_found_by_promote_is_never_served(make_store):
    store = make_store(1, 1, 2)
    assert allocate_one_by_one(store, 3) == [0, 1, 2]
    assert tiers_of(store, [0, 1, 2]) == [COLD, WARM, HOT]
    write_block(store, 0, block_data(1))
    store.publish(0, b"h0")
    flip_cold_byte(store, 0)
    assert store.promote([0]) == [0]
    assert store.index.get(0).is_corrupt
    assert store.index.lookup(b"h0") is None
    assert store.index.get(0).key is None
    with pytest.raises(CorruptBlockError, match=r"blocks \[0\] failed their checksum"):
        map_tokens(store, [2, 0], [0, 0])
    # the moves that made room went through; the corrupt block gave its cold slot back and
    # holds no tier (-1) until its bank releases it
    assert tiers_of(store, [0, 1, 2]) == [-1, COLD, WARM]
    assert used(store) == [0, 1, 1]
    check_pools_match_index(store)
    # releasing it forgets it
    store.release([0])
    assert 0 not in store.index
    assert used(store) == [0, 1, 1]


def test_corrupt_block_does_not_derail_the_rest_of_a_promotion(make_store):
    """Promoting [0, 1] where block 0 fails its checksum: the plan counted on 0's cold slot being
    freed, so later moves must not find cold full. Block 0 is reported, block 1 keeps its data."""
    store = make_store(1, 1, 3)
    assert allocate_one_by_one(store, 4) == [0, 1, 2, 3]
    assert tiers_of(store, [0, 1, 2, 3]) == [COLD, COLD, WARM, HOT]
    data1 = block_data(21)
    write_block(store, 0, block_data(20))
    write_block(store, 1, data1)
    flip_cold_byte(store, 0)
    assert store.promote([0, 1]) == [0]
    assert [store.index.get(b).is_corrupt for b in (0, 1)] == [True, False]
    assert torch.equal(read_block(store, 1), data1)
    check_pools_match_index(store)


def test_corrupt_block_read_through_map_tokens_raises(make_store):
    store = make_store(1, 1, 1)
    allocate_one_by_one(store, 3)
    write_block(store, 0, block_data(3))
    flip_cold_byte(store, 0)
    runs = map_tokens(store, [0], [1])
    with pytest.raises(CorruptBlockError, match=r"slot 0 layer 0"):
        store.mapper.read_layer(0, runs, 1)


# --- stats -------------------------------------------------------------------------------------

def test_stats_report_every_tier(make_store):
    store = make_store(2, 3, 4)
    store.allocate(4)
    store.metrics.hits.inc(("hot",), 2)
    store.metrics.hits.inc(("warm",), 1)
    stats = store.stats()
    assert set(stats) == {"tiers", "hits", "misses", "bytes_moved", "link_saturation",  # today's keys, and
                          "hit_rate", "turn_blocks", "moves", "bytes_on_demand", "bytes_background",
                          "critical_path", "scheduler", "fragmentation", "contiguity", "contiguity_min", "durability",
                          "block_size", "metrics", "remote", "copies", "restore", "compression"}
    assert stats["block_size"] == {"tokens": store.config.block_size, "auto": False}
    plain = {"block_bytes": 512, "compression": "none"}  # as each tier stores a block
    assert stats["tiers"]["hot"] == {"used_blocks": 2, "capacity_blocks": 2, "used_bytes": 1024,
                                     "capacity_bytes": 1024, "device": "cpu", **plain}
    assert stats["tiers"]["warm"] == {"used_blocks": 2, "capacity_blocks": 3, "used_bytes": 1024,
                                      "capacity_bytes": 1536, "device": "cpu", **plain}
    assert stats["tiers"]["cold"] == {"used_blocks": 0, "capacity_blocks": 4, "used_bytes": 0,
                                      "capacity_bytes": 2048, "device": store.tiers[COLD].file_path,
                                      "copies_blocks": 0, **plain}
    assert stats["hits"] == {"hot": 2, "warm": 1, "cold": 0}
    assert stats["misses"] == 0
    assert stats["bytes_moved"] == NO_BYTES_MOVED
    assert isinstance(stats["link_saturation"], float)
    assert stats["link_saturation"] == 0.0
    # hot is full (nothing free to fragment) and no chat ran a step
    assert (stats["fragmentation"], stats["contiguity"], stats["contiguity_min"]) == (0.0, 1.0, 1.0)


def test_link_saturation_stays_in_unit_range_after_moves(make_store):
    store = make_store(1, 4, 1)
    allocate_one_by_one(store, 5)
    saturation = store.stats()["link_saturation"]
    assert isinstance(saturation, float)
    assert 0.0 <= saturation <= 1.0
    assert store.stats()["bytes_moved"]["hot->warm"] == 4 * BLOCK_BYTES


# --- pins, quarantine, undo ----------------------------------------------------------------------

def test_a_corrupt_block_a_running_step_pins_keeps_its_slot_until_the_step_ends(make_store):
    """Another thread finds the block corrupt while this step has it mapped: its slot must not be
    handed to a new block under the step's feet; the step reads the bad bytes and fails their check."""
    store = make_store(1, 1, 2)
    allocate_one_by_one(store, 3)
    write_block(store, 0, block_data(1))
    cold_slot = store.index.get(0).slot
    lease = lease_on(store, 0)
    assert lease.rows[0].tiers.tolist() == [COLD]
    flip_cold_byte(store, 0)
    assert store.verify([0]) == [0]  # e.g. another chat's attach checked the shared block
    assert store.index.get(0).is_corrupt
    assert store.pools[COLD].is_used(cold_slot)  # quarantined, not free
    new_block = store.allocate(1)[0]
    assert store.index.get(new_block).slot != cold_slot or store.index.get(new_block).tier != COLD
    with pytest.raises(CorruptBlockError, match=r"slot 0 layer 0"):
        lease.read_layer(0, 0)
    lease.abort()
    assert not store.pools[COLD].is_used(cold_slot)
    assert store.check_consistency() == []


def test_read_failure_marks_the_block_corrupt(make_store):
    store = make_store(1, 1, 1)
    allocate_one_by_one(store, 3)
    write_block(store, 0, block_data(3))
    lease = lease_on(store, 0)
    store.publish(0, b"k0")  # (after the lease opened: a published partial tail would be copied on write)
    flip_cold_byte(store, 0)
    with pytest.raises(CorruptBlockError) as caught:
        lease.read_layer(0, 0)
    assert caught.value.block_id == 0
    assert store.index.get(0).is_corrupt and store.index.lookup(b"k0") is None
    lease.abort()
    assert store.check_consistency() == []


def test_undo_moves_puts_blocks_back_where_they_were(make_store):
    store = make_store(1, 1, 2)
    data = block_data(5)
    (b0,) = store.allocate(1)
    write_block(store, b0, data)
    (b1,) = store.allocate(1)  # pushes b0 down to warm
    assert tiers_of(store, [b0, b1]) == [WARM, HOT]
    store.release([b1])
    store.placement.undo_moves([Move(b0, HOT, WARM)])
    assert tiers_of(store, [b0]) == [HOT]
    assert torch.equal(read_block(store, b0), data)
    check_pools_match_index(store)


def test_a_lease_asked_for_on_a_closed_store_raises_bank_closed(make_store):
    from tiered_kv import BankClosedError

    store = make_store(2, 2, 2)
    (block,) = store.allocate(1)
    store.close()
    with pytest.raises(BankClosedError, match="closed"):
        lease_on(store, block)


def test_a_lease_pins_its_blocks_and_its_end_unpins_them(make_store):
    store = make_store(2, 2, 2)
    (block,) = store.allocate(1)
    lease = lease_on(store, block)
    new_ids = lease.allocated_block_ids
    assert new_ids == [] and store.state.is_pinned(block)
    assert store.demote([block], WARM) == [] and tiers_of(store, [block]) == [HOT]  # pinned: stays
    lease.commit()
    assert not store.state.is_pinned(block)
    lease.commit()  # ends once
    store.demote([block], WARM)
    assert tiers_of(store, [block]) == [WARM]


def test_a_store_is_shared_by_copies_and_never_pickled(make_store):
    import copy
    import pickle

    store = make_store(1, 1, 1)
    assert copy.deepcopy(store) is store
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(store)
