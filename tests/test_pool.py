"""SlotPool and BlockIndex: pure-id policy code, tested exactly on CPU (exact ids, exact order)."""
import pytest

from tiered_kv.block_index import BlockEntry, BlockIndex
from tiered_kv.pool import SlotPool

# --- SlotPool --------------------------------------------------------------------------------


def test_fresh_pool_hands_out_ascending_slots():
    pool = SlotPool(11, "hot")
    assert pool.free_order() == list(range(11))
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) == [3, 4]
    assert pool.free_order() == [5, 6, 7, 8, 9, 10]
    assert (pool.num_slots, pool.num_used, pool.num_free) == (11, 5, 6)


def test_freed_slots_are_reused_last_in_first_out():
    pool = SlotPool(11)
    assert pool.allocate(5) == [0, 1, 2, 3, 4]
    pool.free([1, 3])
    assert pool.free_order() == [3, 1, 5, 6, 7, 8, 9, 10]
    pool.free([0])
    assert pool.free_order() == [0, 3, 1, 5, 6, 7, 8, 9, 10]
    assert pool.allocate(4) == [0, 3, 1, 5]
    assert pool.free_order() == [6, 7, 8, 9, 10]
    assert (pool.num_used, pool.num_free) == (6, 5)


def test_allocate_is_all_or_nothing():
    pool = SlotPool(4)
    assert pool.allocate(3) == [0, 1, 2]
    pool.free([1])
    before = pool.free_order()
    assert before == [1, 3]
    assert pool.can_allocate(2) is True
    assert pool.can_allocate(3) is False
    assert pool.allocate(3) is None
    assert pool.free_order() == before
    assert (pool.num_used, pool.num_free) == (2, 2)
    assert [pool.is_used(s) for s in range(4)] == [True, False, True, False]


def test_allocate_zero_and_whole_pool():
    pool = SlotPool(3)
    assert pool.allocate(0) == []
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.free_order() == []
    assert pool.allocate(1) is None
    assert pool.can_allocate(0) is True


def test_empty_pool_hands_out_nothing():
    pool = SlotPool(0, "warm")
    assert (pool.num_slots, pool.num_used, pool.num_free) == (0, 0, 0)
    assert pool.allocate(1) is None
    assert pool.allocate(0) == []


def test_negative_size_raises_naming_the_pool():
    with pytest.raises(ValueError, match=r"cold: num_slots must be >= 0, got -1"):
        SlotPool(-1, "cold")


def test_double_free_raises_naming_the_slot():
    pool = SlotPool(4, "hot")
    pool.allocate(2)
    pool.free([1])
    with pytest.raises(ValueError, match=r"^hot: double free of slot 1$"):
        pool.free([1])
    with pytest.raises(ValueError, match=r"^hot: double free of slot 3$"):
        pool.free([3])  # never handed out
    assert pool.free_order() == [1, 2, 3]
    assert pool.num_used == 1


@pytest.mark.parametrize("slot", [4, 100, -1])
def test_out_of_range_free_raises(slot):
    pool = SlotPool(4, "warm")
    pool.allocate(4)
    with pytest.raises(ValueError, match=rf"^warm: slot {slot} is out of range 0\.\.3$"):
        pool.free([slot])
    assert pool.num_used == 4
    assert pool.free_order() == []


def test_is_used_tracks_allocate_and_free():
    pool = SlotPool(3)
    assert [pool.is_used(s) for s in range(3)] == [False, False, False]
    pool.allocate(2)
    assert [pool.is_used(s) for s in range(3)] == [True, True, False]
    pool.free([0])
    assert [pool.is_used(s) for s in range(3)] == [False, True, False]


def test_take_marks_particular_slots_and_allocate_skips_them():
    pool = SlotPool(6, "hot")
    pool.take([2, 4])
    assert (pool.num_used, pool.num_free) == (2, 4)
    assert pool.free_order() == [0, 1, 3, 5]
    with pytest.raises(ValueError, match=r"^hot: slot 4 cannot be taken \(out of range or in use\)$"):
        pool.take([0, 4])
    assert pool.free_order() == [0, 1, 3, 5]  # a refused take takes nothing
    assert pool.allocate(3) == [0, 1, 3]
    pool.free([4, 1])
    assert pool.free_order() == [1, 4, 5]
    assert pool.allocate(3) == [1, 4, 5]
    assert pool.allocate(1) is None


def test_allocate_run_continues_after_a_slot_or_places_a_new_run_where_both_can_grow():
    pool = SlotPool(12, "hot")
    assert pool.allocate_run(3) == [0, 1, 2]  # an empty pool: from its start
    assert pool.allocate_run(2) == [6, 7]  # the middle of free slots 3..11: room for both runs
    assert pool.allocate_run(2, after=2) == [3, 4]  # the first run grows in place
    assert pool.allocate_run(1, after=7) == [8]
    assert pool.allocate_run(2, after=4) == [9, 10]  # slot 6 is taken: the largest free run, 9..11
    assert pool.allocate_run(2, after=8) is None  # only single free slots are left (5 and 11)
    assert pool.free_runs()[0].tolist() == [5, 11] and pool.largest_free_run() == 1
    assert pool.allocate_run(0) == []
    assert pool.free_order() == [5, 11]  # allocate still hands out the rest
    assert pool.allocate(2) == [5, 11]


def test_allocate_run_after_the_last_slot_or_a_full_run_looks_elsewhere():
    pool = SlotPool(8)
    assert pool.allocate_run(8) == list(range(8))
    pool.free([7, 0, 1])
    assert pool.allocate_run(1, after=7) == [0]  # nothing after slot 7: the largest free run
    assert pool.allocate_run(1, after=6) == [7]
    assert pool.allocate_run(2, after=-1) is None  # slot 0 is taken and no run of 2 is free
    assert pool.allocate_run(1, after=-1) == [1]


def test_allocate_runs_continues_in_place_as_far_as_it_can_then_fills_the_largest_runs():
    pool = SlotPool(12)
    assert pool.allocate_run(8) == list(range(8))
    pool.free([2, 3, 5])
    assert pool.allocate_runs(6, after=1) == [2, 3, 8, 9, 10, 11]
    assert pool.free_order() == [5]
    assert pool.allocate_runs(2) is None  # all or nothing
    assert pool.allocate_runs(1, after=11) == [5]  # nothing after the last slot


def test_many_takes_and_frees_keep_the_free_list_exact():
    pool = SlotPool(5)
    for _ in range(100):  # stale entries of taken slots never come back out of the free list
        pool.take([1, 3])
        pool.free([3, 1])
    assert pool.free_order() == [1, 3, 0, 2, 4]
    assert len(pool._free_stack) <= 2 * 5 + 64
    assert pool.allocate(5) == [1, 3, 0, 2, 4]
    assert pool.num_free == 0 and pool.largest_free_run() == 0


# --- BlockIndex ------------------------------------------------------------------------------


def test_add_gives_sequential_ids_and_fresh_entries():
    index = BlockIndex()
    assert index.add(0, 5) == 0
    assert index.add(2, 7) == 1
    assert index.get(0) == BlockEntry(tier=0, slot=5, ref_count=1, key=None)
    assert index.get(1) == BlockEntry(tier=2, slot=7, ref_count=1, key=None)
    assert len(index) == 2
    assert 1 in index and 2 not in index
    assert index.blocks_in(0) == [0]
    assert index.blocks_in(1) == []
    assert index.blocks_in(2) == [1]


def test_ids_are_not_reused_after_remove():
    index = BlockIndex()
    index.add(0, 0)
    index.remove(0)
    assert index.add(0, 0) == 1
    assert 0 not in index


def test_incref_and_decref_track_the_unreferenced_order():
    index = BlockIndex()
    block, other = index.add(0, 0), index.add(0, 1)
    index.incref(block)
    assert index.get(block).ref_count == 2
    assert index.decref(block) == 1
    assert list(index.unreferenced(0)) == []
    assert index.decref(other) == 0
    assert index.decref(block) == 0
    assert list(index.unreferenced(0)) == [other, block]
    with pytest.raises(ValueError, match=r"^block 0: released more often than retained \(ref_count 0\)$"):
        index.decref(block)
    index.incref(other)
    assert list(index.unreferenced(0)) == [block]


def test_touch_moves_blocks_to_the_recent_end_of_their_tier():
    index = BlockIndex()
    a, b, c, d = index.add(0, 0), index.add(0, 1), index.add(0, 2), index.add(1, 0)
    assert list(index.recency(0)) == [a, b, c]
    version = index.order_version
    index.touch([a, d])
    assert list(index.recency(0)) == [b, c, a]
    assert list(index.recency(1)) == [d]
    assert index.order_version > version


def test_move_changes_placement_and_enters_the_new_tier_as_most_recent():
    index = BlockIndex()
    block, other = index.add(0, 3), index.add(2, 0)
    index.publish(block, b"h")
    version = index.placement_version
    index.move(block, 2, 9)
    assert index.get(block) == BlockEntry(tier=2, slot=9, ref_count=1, key=b"h")
    assert index.blocks_in(0) == [] and index.blocks_in(2) == [other, block]
    assert index.placement_version > version


def test_publish_lookup_and_unpublish():
    index = BlockIndex()
    block = index.add(0, 0)
    assert index.lookup(b"abc") is None
    assert index.publish(block, b"abc")
    assert index.lookup(b"abc") == block
    assert index.get(block).key == b"abc"
    index.unpublish(block)
    assert index.lookup(b"abc") is None
    assert index.get(block).key is None


def test_second_block_with_same_key_does_not_steal_it():
    index = BlockIndex()
    first, second = index.add(0, 0), index.add(0, 1)
    assert index.publish(first, b"same")
    assert not index.publish(second, b"same")
    assert index.lookup(b"same") == first
    assert index.get(second).key is None
    index.unpublish(second)  # unpublishing the non-owner leaves the owner alone
    assert index.lookup(b"same") == first
    index.unpublish(first)  # once the owner gives it up, the other block can take it
    assert index.publish(second, b"same")
    assert index.lookup(b"same") == second


def test_remove_unpublishes_and_returns_the_entry():
    index = BlockIndex()
    block = index.add(1, 4)
    index.publish(block, b"h1")
    entry = index.remove(block)
    assert (entry.tier, entry.slot, entry.ref_count) == (1, 4, 1)
    assert index.lookup(b"h1") is None
    assert block not in index
    assert len(index) == 0
    assert index.blocks_in(1) == []


def test_republished_block_leaves_no_stale_key_behind():
    index = BlockIndex()
    block = index.add(0, 0)
    index.publish(block, b"old")
    index.publish(block, b"new")
    assert index.lookup(b"old") is None
    assert index.lookup(b"new") == block
    index.remove(block)
    assert index.lookup(b"new") is None


def test_corrupt_block_leaves_its_tier_and_its_key():
    index = BlockIndex()
    block = index.add(2, 3)
    index.publish(block, b"k")
    index.mark_corrupt(block)
    assert index.get(block).is_corrupt
    assert index.lookup(b"k") is None
    assert index.blocks_in(2) == []
    assert not index.publish(block, b"k")  # a corrupt block is never published again
    index.remove(block)
    assert block not in index


@pytest.mark.parametrize("call", [
    lambda index: index.get(7),
    lambda index: index.remove(7),
    lambda index: index.incref(7),
    lambda index: index.decref(7),
    lambda index: index.move(7, 0, 0),
    lambda index: index.publish(7, b"x"),
    lambda index: index.unpublish(7),
])
def test_unknown_block_raises_key_error_naming_it(call):
    index = BlockIndex()
    index.add(0, 0)
    with pytest.raises(KeyError, match=r"block 7 is not in the index \(freed or never allocated\)"):
        call(index)


def test_touch_of_unknown_block_names_it():
    index = BlockIndex()
    with pytest.raises(KeyError, match=r"7"):
        index.touch([7])
