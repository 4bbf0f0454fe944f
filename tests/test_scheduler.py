"""MemScheduler: ids in, an exact Plan out. No torch; every case asserts the whole move list."""
import pytest

from tiered_kv.block_index import BlockIndex
from tiered_kv.scheduler import (ALLOWED_POLICIES, COLD, DROPPED, HOT, WARM, MemScheduler, Move,
                                 Plan)


def make_index(blocks):
    """blocks: list of (tier, last_access) or (tier, last_access, ref_count[, key]).

    Block i gets id i and slot = its position within its tier; blocks are then touched in order
    of last_access (ties by id), which sets each tier's recency order."""
    index = BlockIndex()
    next_slot = [0, 0, 0]
    for spec in blocks:
        tier, last_access, *rest = spec
        ref_count = rest[0] if rest else 1
        key = rest[1] if len(rest) > 1 else None
        block_id = index.add(tier, next_slot[tier])
        next_slot[tier] += 1
        for _ in range(1 - ref_count):
            index.decref(block_id)
        if key is not None:
            index.publish(block_id, key)
    for block_id in sorted(range(len(blocks)), key=lambda b: (blocks[b][1], b)):
        index.touch([block_id])
    return index


def recency(index, tier):
    return list(index.recency(tier))


def free_of(index, capacities):
    used = [len(index.blocks_in(t)) for t in (HOT, WARM, COLD)]
    return [c - u for c, u in zip(capacities, used)]


def plan_new(index, num_new, capacities):
    return MemScheduler().plan_new_blocks(num_new, index, free_of(index, capacities), capacities)


def test_make_index_helper():
    index = make_index([(HOT, 5), (COLD, 3, 0, b"h"), (HOT, 2)])
    assert (index.get(0).tier, index.get(0).slot, index.get(0).ref_count) == (HOT, 0, 1)
    assert (index.get(1).tier, index.get(1).ref_count) == (COLD, 0)
    assert recency(index, HOT) == [2, 0]
    assert list(index.unreferenced(COLD)) == [1]
    assert index.lookup(b"h") == 1


# --- plan_new_blocks -------------------------------------------------------------------------

def test_room_in_hot_needs_no_moves():
    index = make_index([(HOT, 1)])
    plan = plan_new(index, 2, [4, 2, 2])
    assert plan == Plan(moves=[], new_block_tiers=[HOT, HOT])
    assert not plan.is_empty()


def test_zero_new_blocks_is_an_empty_plan():
    plan = plan_new(make_index([]), 0, [1, 1, 1])
    assert plan == Plan()
    assert plan.is_empty()


def test_full_hot_demotes_its_least_recently_used_block_to_warm():
    index = make_index([(HOT, 30), (HOT, 10), (HOT, 20)])
    plan = plan_new(index, 1, [3, 2, 2])
    assert plan.moves == [Move(1, HOT, WARM)]
    assert plan.new_block_tiers == [HOT]


def test_two_new_blocks_demote_two_lru_blocks_in_order():
    index = make_index([(HOT, 30), (HOT, 10), (HOT, 20)])
    plan = plan_new(index, 2, [3, 4, 0])
    assert plan.moves == [Move(1, HOT, WARM), Move(2, HOT, WARM)]
    assert plan.new_block_tiers == [HOT, HOT]
    assert plan.count(HOT, WARM) == 2 and plan.count(WARM, COLD) == 0


def test_equal_access_times_break_ties_by_block_id():
    index = make_index([(HOT, 7), (HOT, 7)])
    assert plan_new(index, 1, [2, 1, 0]).moves == [Move(0, HOT, WARM)]


def test_full_hot_and_warm_cascade_warm_lru_to_cold_first():
    # hot: 0 (t=5), 1 (t=2); warm: 2 (t=4), 3 (t=1); cold: 4 (t=0), one free slot
    index = make_index([(HOT, 5), (HOT, 2), (WARM, 4), (WARM, 1), (COLD, 0)])
    plan = plan_new(index, 1, [2, 2, 2])
    assert plan.moves == [Move(3, WARM, COLD), Move(1, HOT, WARM)]
    assert plan.new_block_tiers == [HOT]
    assert [str(m) for m in plan.moves] == ["block 3: warm -> cold", "block 1: hot -> warm"]


def test_a_demoted_block_enters_the_tier_below_as_its_most_recent():
    # a block pushed out of hot counts as just arrived in warm: warm's own LRU block goes first.
    # (Hot evicts in LRU order, so arrivals into warm come in LRU order too; keeping arrival
    # order avoids sorting a tier on every move.)
    index = make_index([(HOT, 1), (WARM, 5), (WARM, 6)])
    plan = plan_new(index, 2, [1, 2, 4])
    assert plan.moves == [Move(1, WARM, COLD), Move(0, HOT, WARM), Move(2, WARM, COLD)]
    assert plan.new_block_tiers == [HOT, WARM]


def test_more_new_blocks_than_hot_holds_spill_to_warm_then_cold():
    plan = plan_new(make_index([]), 6, [2, 3, 4])
    assert plan.moves == []
    assert plan.new_block_tiers == [HOT, HOT, WARM, WARM, WARM, COLD]


def test_new_blocks_push_old_blocks_down_before_spilling():
    index = make_index([(HOT, 1)])
    plan = plan_new(index, 3, [2, 2, 2])
    assert plan.moves == [Move(0, HOT, WARM)]
    assert plan.new_block_tiers == [HOT, HOT, WARM]


def test_infeasible_when_every_tier_is_full_of_referenced_blocks():
    index = make_index([(HOT, 3), (WARM, 2), (COLD, 1)])
    assert plan_new(index, 1, [1, 1, 1]) is None


def test_infeasible_when_asking_for_more_than_the_free_total():
    index = make_index([(HOT, 3)])
    assert plan_new(index, 3, [1, 1, 1]) is None
    # the second new block is newer than block 0, so it takes warm and block 0 goes on to cold
    assert plan_new(index, 2, [1, 1, 1]) == Plan(moves=[Move(0, HOT, WARM), Move(0, WARM, COLD)],
                                                 new_block_tiers=[HOT, WARM])


def test_unreferenced_hashed_block_at_the_bottom_is_dropped():
    index = make_index([(HOT, 9), (WARM, 8), (COLD, 1, 0, b"cached")])
    plan = plan_new(index, 1, [1, 1, 1])
    assert plan.moves == [Move(2, COLD, DROPPED), Move(1, WARM, COLD), Move(0, HOT, WARM)]
    assert plan.new_block_tiers == [HOT]
    assert plan.moves[0].is_eviction and not plan.moves[1].is_eviction
    assert str(plan.moves[0]) == "block 2: cold -> dropped"


def test_unreferenced_block_that_is_not_the_lru_is_still_dropped():
    """Cold holds an old referenced block and a newer unreferenced cached one: dropping the cached
    one makes room, so the request is feasible (only referenced blocks make a plan infeasible)."""
    index = make_index([(HOT, 9), (WARM, 8), (COLD, 1), (COLD, 2, 0, b"cached")])
    plan = plan_new(index, 1, [1, 1, 2])
    assert plan is not None
    assert plan.moves == [Move(3, COLD, DROPPED), Move(1, WARM, COLD), Move(0, HOT, WARM)]
    assert plan.new_block_tiers == [HOT]


def test_unreferenced_block_is_dropped_where_it_cannot_move_down():
    # warm's LRU is cached and cold is full of referenced blocks: warm drops it
    index = make_index([(HOT, 9), (WARM, 2, 0, b"c"), (COLD, 1)])
    plan = plan_new(index, 1, [1, 1, 1])
    assert plan.moves == [Move(1, WARM, DROPPED), Move(0, HOT, WARM)]
    assert plan.new_block_tiers == [HOT]


def test_unreferenced_block_moves_down_while_there_is_room():
    index = make_index([(HOT, 1, 0, b"c")])
    plan = plan_new(index, 1, [1, 1, 1])
    assert plan.moves == [Move(0, HOT, WARM)]


def test_warm_capacity_zero_demotes_hot_straight_to_cold():
    index = make_index([(HOT, 2), (HOT, 1)])
    plan = plan_new(index, 1, [2, 0, 3])
    assert plan.moves == [Move(1, HOT, COLD)]
    assert plan.new_block_tiers == [HOT]


def test_warm_capacity_zero_spills_new_blocks_to_cold():
    plan = plan_new(make_index([]), 3, [1, 0, 5])
    assert plan.new_block_tiers == [HOT, COLD, COLD]


def test_cold_capacity_zero_drops_cached_warm_blocks():
    index = make_index([(HOT, 5), (WARM, 1, 0, b"c")])
    plan = plan_new(index, 1, [1, 1, 0])
    assert plan.moves == [Move(1, WARM, DROPPED), Move(0, HOT, WARM)]


def test_protected_blocks_are_never_moved():
    index = make_index([(HOT, 1), (HOT, 2)])
    plan = MemScheduler().plan_new_blocks(1, index, [0, 1, 1], [2, 1, 1], protect=frozenset({0}))
    assert plan.moves == [Move(1, HOT, WARM)]


def test_planning_does_not_change_the_index():
    index = make_index([(HOT, 5), (HOT, 2), (WARM, 4), (WARM, 1), (COLD, 0)])
    before = {b: (e.tier, e.slot, e.ref_count) for b, e in index.items()}
    before_order = [recency(index, t) for t in (HOT, WARM, COLD)]
    free = [0, 0, 1]
    plan_new_blocks = MemScheduler().plan_new_blocks(1, index, free, [2, 2, 2])
    assert plan_new_blocks is not None
    assert free == [0, 0, 1]
    assert {b: (e.tier, e.slot, e.ref_count) for b, e in index.items()} == before
    assert [recency(index, t) for t in (HOT, WARM, COLD)] == before_order


# --- plan_promotion --------------------------------------------------------------------------

def test_promotion_of_hot_blocks_is_empty():
    index = make_index([(HOT, 1), (HOT, 2)])
    plan = MemScheduler().plan_promotion([0, 1], index, [0, 1, 1], [2, 1, 1])
    assert plan == Plan()


def test_promotion_into_free_hot_slots():
    index = make_index([(COLD, 1), (WARM, 2)])
    plan = MemScheduler().plan_promotion([0, 1], index, [2, 0, 0], [2, 1, 1])
    assert plan.moves == [Move(0, COLD, HOT), Move(1, WARM, HOT)]
    assert plan.new_block_tiers == []


def test_promotion_demotes_only_blocks_that_are_not_wanted():
    # hot: 0 (t=1, oldest, but wanted), 1 (t=5); cold: 2 (wanted)
    index = make_index([(HOT, 1), (HOT, 5), (COLD, 3)])
    plan = MemScheduler().plan_promotion([2, 0], index, [0, 2, 1], [2, 2, 2])
    assert plan.moves == [Move(1, HOT, WARM), Move(2, COLD, HOT)]


def test_promotion_cascades_down_to_make_room():
    # hot: 0; warm: 1 (full); cold: 2 (wanted), one free cold slot
    index = make_index([(HOT, 4), (WARM, 3), (COLD, 9)])
    plan = MemScheduler().plan_promotion([2], index, [0, 0, 1], [1, 1, 2])
    assert plan.moves == [Move(1, WARM, COLD), Move(0, HOT, WARM), Move(2, COLD, HOT)]


def test_promotion_goes_to_warm_when_hot_is_full_of_wanted_blocks():
    # hot: 0, 1 (wanted); cold: 2, 3 (wanted); warm has one free slot
    index = make_index([(HOT, 1), (HOT, 2), (COLD, 3), (COLD, 4)])
    plan = MemScheduler().plan_promotion([0, 1, 2, 3], index, [0, 1, 0], [2, 1, 2])
    assert plan.moves == [Move(2, COLD, WARM)]


def test_promotion_to_warm_pushes_unwanted_warm_blocks_to_cold():
    # hot full of wanted 0; warm full of unwanted 1; cold: wanted 2 and a free slot
    index = make_index([(HOT, 1), (WARM, 2), (COLD, 3)])
    plan = MemScheduler().plan_promotion([0, 2], index, [0, 0, 1], [1, 1, 2])
    assert plan.moves == [Move(1, WARM, COLD), Move(2, COLD, WARM)]


def test_warm_block_stays_when_hot_is_full_of_wanted_blocks():
    index = make_index([(HOT, 1), (WARM, 2)])
    plan = MemScheduler().plan_promotion([0, 1], index, [0, 0, 1], [1, 1, 1])
    assert plan.moves == []


def test_promotion_with_hot_and_warm_full_of_wanted_leaves_cold_blocks():
    index = make_index([(HOT, 1), (WARM, 2), (COLD, 3)])
    plan = MemScheduler().plan_promotion([0, 1, 2], index, [0, 0, 0], [1, 1, 1])
    assert plan.moves == []


def test_promotion_with_warm_disabled_goes_straight_to_hot():
    index = make_index([(HOT, 5), (COLD, 1)])
    plan = MemScheduler().plan_promotion([1], index, [0, 0, 0], [1, 0, 2])
    # hot's unwanted block can only go to cold, where the wanted block still sits: no room
    assert plan.moves == []
    plan = MemScheduler().plan_promotion([1], index, [0, 0, 1], [1, 0, 3])
    assert plan.moves == [Move(0, HOT, COLD), Move(1, COLD, HOT)]


# --- policy ----------------------------------------------------------------------------------

def test_allowed_policies():
    assert ALLOWED_POLICIES == ("lru", "lfu", "fifo", "turns")
    assert MemScheduler().policy == "lru"


def test_ali_is_the_former_name_of_the_turns_policy():
    assert MemScheduler("ali").policy == MemScheduler("turns").policy == "turns"


@pytest.mark.parametrize("policy", ["lfru", "", "LRU"])
def test_unknown_policy_raises_naming_it(policy):
    with pytest.raises(ValueError, match=rf"scheduler\.policy {policy!r} is not known; allowed: \('lru', 'lfu'"):
        MemScheduler(policy)


def test_promotion_leaves_a_block_that_another_running_step_pins():
    # block 1 is shared with another chat whose forward pass is reading it in warm right now
    index = make_index([(HOT, 1), (WARM, 2), (WARM, 3)])
    plan = MemScheduler().plan_promotion([1, 2], index, [0, 1, 4], [1, 3, 4], is_pinned=lambda b: b == 1)
    assert plan.moves == [Move(0, HOT, WARM), Move(2, WARM, HOT)]


def test_pinned_blocks_are_never_victims_or_drops():
    index = make_index([(HOT, 1, 0), (HOT, 2, 0)])  # both unreferenced, the LRU one pinned
    plan = MemScheduler().plan_new_blocks(1, index, [0, 0, 0], [2, 0, 0], is_pinned=lambda b: b == 0)
    assert plan.moves == [Move(1, HOT, DROPPED)]
    assert MemScheduler().plan_new_blocks(2, index, [0, 0, 0], [2, 0, 0], is_pinned=lambda b: b == 0) is None
