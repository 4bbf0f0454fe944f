"""Batched hot<->warm moves (hw/block_copy.py, through store/copies.py): byte-identical blocks
after moves with scattered slots, in batches larger than the staging chunk."""

from __future__ import annotations

import pytest
import torch

import tiered_kv
from tiered_kv.blocks import KVLayout
from tiered_kv.hw.block_copy import BlockCopier, slot_runs
from tiered_kv.scheduler import HOT, WARM
from tiered_kv.tiers import HotTier, WarmTier

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype_name="float32")
HAS_CUDA = torch.cuda.is_available()


def test_slot_runs_follow_both_sides():
    assert slot_runs([0, 1, 2, 7, 8], [5, 6, 9, 10, 11]) == [(0, 5, 2), (2, 9, 1), (7, 10, 2)]
    assert slot_runs(range(3), [4, 5, 6]) == [(0, 4, 3)]
    assert slot_runs([], []) == []


@pytest.mark.parametrize("to_device", [True, False])
def test_staged_copy_on_cpu_tensors_in_chunks(to_device):
    """The staged path (what runs between a CUDA hot tier and pinned warm) driven with CPU
    tensors: scattered slots, 10 blocks through a 6-block staging (two halves of 3 blocks, used
    in turn: double-buffered), both directions."""
    torch.manual_seed(0)
    hot = HotTier(LAYOUT, 16, torch.device("cpu"), torch.float32)
    warm = WarmTier(LAYOUT, 16, torch.float32, pinned=False)
    hot.slab.normal_()
    warm.slab.normal_()
    hot_slots = [15, 2, 7, 3, 9, 0, 11, 4, 13, 6]
    warm_slots = [1, 2, 3, 10, 11, 5, 0, 14, 8, 9]  # runs and gaps, not in order
    if to_device:
        dst, dst_slots, src, src_slots = hot.slots_view(), hot_slots, warm.slots_view(), warm_slots
    else:
        dst, dst_slots, src, src_slots = warm.slots_view(), warm_slots, hot.slots_view(), hot_slots
    expected = {d: src[s].clone() for d, s in zip(dst_slots, src_slots)}
    untouched = {d: dst[d].clone() for d in range(16) if d not in expected}
    copier = BlockCopier(torch.empty((6, *LAYOUT.record_shape())))
    copier.staged(dst, dst_slots, src, src_slots, to_device=to_device)
    assert copier.num_chunks == 4
    for d, block in expected.items():
        assert torch.equal(dst[d], block), d
    for d, block in untouched.items():
        assert torch.equal(dst[d], block), d


def test_direct_copy_merges_runs():
    torch.manual_seed(1)
    src = torch.randn(12, *LAYOUT.record_shape())
    dst = torch.zeros_like(src)
    copier = BlockCopier()
    copier.copy(dst, [4, 5, 6, 0, 11], src, [1, 2, 3, 9, 0])
    for d, s in zip([4, 5, 6, 0, 11], [1, 2, 3, 9, 0]):
        assert torch.equal(dst[d], src[s])
    assert not dst[[1, 2, 3, 7, 8, 9, 10]].any()


# ---- through a store ----------------------------------------------------------------------
def _store(device: str, num_hot: int = 16, num_warm: int = 16, dtype=torch.float32, warm_layout: str = "auto"):
    full = {"high_watermark": 1.0, "low_watermark": 1.0}
    store = tiered_kv.TierStore({"block_size": LAYOUT.block_size,
                                 "hot": {"device": device, "capacity_blocks": num_hot, **full},
                                 "warm": {"capacity_blocks": num_warm, "pinned": "auto", "layout": warm_layout, **full},
                                 "cold": {"capacity": 0}, "scheduler": {"background": False}})
    name = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]
    store.bind(KVLayout(LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim, LAYOUT.block_size, name), dtype)
    return store


def _blocks(store, block_ids) -> dict[int, torch.Tensor]:
    """Each block's bytes, read block by block where it lies now (on the CPU)."""
    store.copy_engine.synchronize()
    tiers, slots = store.placements(block_ids)
    return {b: store.tiers[int(t)].block_view(int(s)).cpu().clone() for b, t, s in zip(block_ids, tiers, slots)}


def _check_moves(store):
    """Scattered demotions and promotions (each batch larger than the 3-block chunk); every block
    keeps its bytes, the counters add up as block by block."""
    _copier(store).chunk_blocks = 3
    store.tiers[HOT].slab.normal_()
    block_ids = store.allocate(16)
    before = _blocks(store, block_ids)
    rounds = [("demote", block_ids[1::2]),  # 8 scattered hot slots -> warm
              ("demote", block_ids[0::4]),  # 4 more, warm slots after the first 8
              ("promote", [block_ids[i] for i in (9, 0, 3, 12, 5, 15, 8)]),  # scattered warm slots, mixed order
              ("demote", [block_ids[i] for i in (2, 6, 10, 14, 9, 3)]),  # into the warm slots freed between
              ("promote", list(block_ids))]
    bytes_before = dict(store.stats()["bytes_moved"])
    moved = {"hot->warm": 0, "warm->hot": 0}
    for kind, ids in rounds:
        tiers_before, _ = store.placements(ids)
        if kind == "demote":
            assert store.demote(ids, WARM) == []
            moved["hot->warm"] += int((tiers_before == HOT).sum())
        else:
            assert store.promote(ids) == []
            moved["warm->hot"] += int((tiers_before == WARM).sum())
        tiers, _ = store.placements(ids)
        assert (tiers == (WARM if kind == "demote" else HOT)).all(), (kind, tiers)
        after = _blocks(store, block_ids)
        for b in block_ids:
            assert torch.equal(after[b], before[b]), (kind, b)
    stats = store.stats()["bytes_moved"]
    for direction, blocks in moved.items():
        assert stats[direction] - bytes_before[direction] == blocks * store.layout.block_bytes
    return _copier(store)


def _copier(store):
    """The BlockCopier of the store's on-demand moves (store.transfers' on-demand staging set)."""
    return store.transfers.staging["on_demand"].copier


@pytest.mark.parametrize("warm_layout", ["paged", "records"])
def test_store_moves_keep_every_block_on_cpu(warm_layout):
    store = _store("cpu", warm_layout=warm_layout)
    try:
        copier = _check_moves(store)
        assert copier.staging is None and copier.num_calls >= 5
    finally:
        store.close()


def test_store_moves_through_the_staged_path_on_cpu(monkeypatch):
    """The staged path (CUDA's) through the store's executor, with a CPU staging of 3 blocks."""
    store = _store("cpu")
    try:
        copier = _copier(store)
        copier.staging = torch.empty((3, *store.layout.record_shape()))
        hot_ptr = store.tiers[HOT].slab.data_ptr()

        def staged(dst, dst_slots, src, src_slots):
            copier.num_calls += 1
            copier.staged(dst, list(dst_slots), src, list(src_slots), to_device=dst.data_ptr() == hot_ptr)

        monkeypatch.setattr(copier, "copy", staged)
        _check_moves(store)
        assert copier.num_chunks >= 12  # 8 + 4 + 7 + 6 + 12 blocks, 3 a chunk
    finally:
        store.close()


def test_a_move_whose_block_is_not_where_the_plan_says_is_left_out_of_its_batch():
    """A stale or repeated move does not fail the others: prepare leaves it out, the rest move."""
    from tiered_kv.metrics.registry import ON_DEMAND
    from tiered_kv.scheduler import Move

    store = _store("cpu")
    try:
        block_ids = store.allocate(4)
        moves = [Move(block_ids[0], HOT, WARM), Move(block_ids[1], HOT, WARM), Move(block_ids[1], HOT, WARM),
                 Move(block_ids[2], WARM, HOT)]  # block 2 is in hot, not warm: stale
        with store.lock:
            batch = store.transfers.prepare(moves, ON_DEMAND)
        assert [t.block_id for t in batch.transfers] == block_ids[:2]
        store.demand.run_batch(batch)
        tiers, _ = store.placements(block_ids)
        assert tiers.tolist() == [WARM, WARM, HOT, HOT]
        assert store.check_consistency() == []
    finally:
        store.close()


@pytest.mark.parametrize("warm_layout", ["paged", "records"])
def test_a_batch_copies_as_one_run_enters_in_plan_order_and_counts_once(warm_layout, monkeypatch):
    """Issue 17, item 3: a batch takes its destination slots in runs (48 blocks demoted in the
    reverse of their hot order still copy as ONE run), its blocks enter warm's recency order in
    plan order (the victims' LRU order) and hot's in token order, and its bookkeeping is per batch (metric calls do not grow with
    the blocks), with every byte kept both ways."""
    from tiered_kv.hw import block_copy
    from tiered_kv.metrics.registry import Counter

    store = _store("cpu", num_hot=64, num_warm=64, warm_layout=warm_layout)
    try:
        store.tiers[HOT].slab.normal_()
        block_ids = store.allocate(48)
        before = _blocks(store, block_ids)
        runs, incs = [], [0]
        real_runs, real_inc = block_copy.slot_runs, Counter.inc
        monkeypatch.setattr(block_copy, "slot_runs", lambda *a: (lambda r: (runs.append(len(r)), r)[1])(real_runs(*a)))
        monkeypatch.setattr(Counter, "inc", lambda self, *a, **k: (incs.__setitem__(0, incs[0] + 1),
                                                                  real_inc(self, *a, **k))[1])
        plan_order = block_ids[::-1]
        assert store.demote(plan_order, WARM) == []
        assert runs == [1], runs
        assert list(store.state.index.recency(WARM)) == plan_order
        assert incs[0] <= 12, incs  # a handful per batch, not per block
        runs.clear()
        assert store.promote(plan_order) == []  # (most recent first, as a new turn asks)
        assert runs == [1], runs
        assert list(store.state.index.recency(HOT)) == block_ids  # into hot in token order: oldest first out
        assert _blocks(store, block_ids).keys() == before.keys()
        for b, data in _blocks(store, block_ids).items():
            assert torch.equal(data, before[b]), b
        assert store.check_consistency() == []
    finally:
        store.close()


def test_a_paged_warm_slab_is_refused_beside_a_gpu_hot_tier():
    from tiered_kv.errors import ConfigError
    from tiered_kv.tiers.warm import PagedWarmTier, WarmTier
    from tiered_kv.tiers.warm_factory import warm_tier

    with pytest.raises(ConfigError, match="warm.layout"):
        warm_tier(LAYOUT, 4, torch.float32, False, "paged", "cuda:0")
    assert isinstance(warm_tier(LAYOUT, 4, torch.float32, False, "auto", "cuda:0"), WarmTier)
    assert isinstance(warm_tier(LAYOUT, 4, torch.float32, False, "auto", "cpu"), PagedWarmTier)


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_store_moves_keep_every_block_on_cuda():
    store = _store("cuda", dtype=torch.bfloat16)
    try:
        assert store.tiers[WARM].slab.is_pinned()
        copier = _check_moves(store)
        assert copier.staging is not None and copier.staging.is_cuda
        assert copier.num_chunks >= 12
    finally:
        store.close()
