"""Hot-pool compaction: exact plans on 12-slot pools (ids only, no torch), then a store whose
mover compacts two chats written in interleaved turns while generate() stays exact."""
import time

import pytest
import torch

import tiered_kv
from tiered_kv.blocks import KVLayout
from tiered_kv.scheduler import HOT, WARM, Move
from tiered_kv.scheduler.compaction import (MAX_OPEN_DEPTH, NO_BLOCK, RESERVED, RowLayout, chat_contiguity,
                                            fragmentation, longest_run, plan_compaction)

from helpers import greedy, rand_ids, reference, tiny_model

_ = NO_BLOCK
THRESHOLDS = dict(pool_fragmentation=0.0, max_fragmentation=0.5, min_contiguity=0.9)


def layout(block_at: list[int], chats: dict[int, list[int]]) -> list[RowLayout]:
    """One row per chat (owner -> its block ids in token order), slots read off `block_at`."""
    slot_of = {b: s for s, b in enumerate(block_at) if b >= 0}
    return [RowLayout(owner, 0, tuple(ids), tuple(slot_of[b] for b in ids)) for owner, ids in chats.items()]


def plan(block_at, chats, pinned=(), shared=(), max_moves=12, prefer=None, **thresholds):
    return plan_compaction(block_at, layout(block_at, chats), set(pinned), set(shared), max_moves=max_moves,
                           prefer=prefer, **{**THRESHOLDS, **thresholds})


def apply(block_at: list[int], moves: list[Move]) -> list[int]:
    """The pool after `moves` (each into a slot free before it)."""
    after = list(block_at)
    for move in moves:
        assert move.src_tier == move.dst_tier == HOT and after[move.dst_slot] == NO_BLOCK, move
        after[after.index(move.block_id)] = NO_BLOCK
        after[move.dst_slot] = move.block_id
    return after


def hot(block_id: int, slot: int) -> Move:
    return Move(block_id, HOT, HOT, dst_slot=slot)


# --- figures -------------------------------------------------------------------------------------

def test_runs_contiguity_and_fragmentation():
    assert longest_run([]) == 0 and longest_run([7]) == 1
    assert longest_run([3, 4, 5, 9, 10]) == 3
    assert longest_run([5, 4, 3]) == 1  # consecutive slots, but not in token order
    row = RowLayout(1, 0, (0, 1, 2, 3), (3, 4, 8, 9))
    assert row.contiguity() == 0.5
    assert chat_contiguity([row, RowLayout(1, 1, (4, 5), (0, 1))]) == pytest.approx(4 / 6)
    assert chat_contiguity([RowLayout(1, 0, (), ())]) is None
    assert fragmentation(0, 0) == 0.0
    assert fragmentation(8, 8) == 0.0
    assert fragmentation(8, 2) == 0.75


# --- plans -----------------------------------------------------------------------------------------

def test_nothing_to_do_when_every_chat_is_contiguous():
    block_at = [10, 11, 12, _, _, 0, 1, _, _, 20, _, _]  # 20 belongs to no chat; gaps between chats
    result = plan(block_at, {1: [0, 1], 2: [10, 11, 12]}, pool_fragmentation=0.8)
    assert (result.moves, result.repairing, result.waiting) == ([], None, False)


def test_a_fragmented_chat_moves_into_a_free_run_then_the_other_is_repaired_in_place():
    # chats 1 and 2 written turn by turn, interleaved; slots 6..11 free
    block_at = [0, 10, 1, 11, 2, 12, _, _, _, _, _, _]
    chats = {1: [0, 1, 2], 2: [10, 11, 12]}
    first = plan(block_at, chats)
    # chat 1 first (equal contiguity and length: lower owner); it may not displace chat 2 (not
    # smaller), so it goes to the free run, in the middle of the windows with headroom after
    assert first.moves == [hot(0, 7), hot(1, 8), hot(2, 9)]
    assert first.repairing == (1, 0)
    block_at = apply(block_at, first.moves)
    assert block_at == [_, 10, _, 11, _, 12, _, 0, 1, 2, _, _]
    second = plan(block_at, chats)
    assert second.moves == [hot(10, 2), hot(12, 4)]  # chat 2 keeps block 11 where it is
    block_at = apply(block_at, second.moves)
    assert block_at == [_, _, 10, 11, 12, _, _, 0, 1, 2, _, _]
    assert plan(block_at, chats).moves == []


def test_max_moves_is_respected_and_the_next_call_continues():
    block_at = [0, 10, 1, 11, 2, 12, _, _, _, _, _, _]
    chats = {1: [0, 1, 2], 2: [10, 11, 12]}
    first = plan(block_at, chats, max_moves=2)
    assert first.moves == [hot(0, 7), hot(1, 8)]
    block_at = apply(block_at, first.moves)
    # chat 2 is the least contiguous now, but the repair under way goes on first
    assert plan(block_at, chats, max_moves=2, prefer=first.repairing).moves == [hot(2, 9)]


def test_no_free_run_is_big_enough_so_blocks_in_the_way_are_packed_first():
    # chat 1 (blocks 0..3) scattered between blocks of no chat (20..23); free slots 2, 5, 8, 11
    block_at = [0, 20, _, 1, 21, _, 2, 22, _, 3, 23, _]
    chats = {1: [0, 1, 2, 3]}
    first = plan(block_at, chats)
    # window 2..5 keeps block 1 in place: block 21 leaves for the smallest gap, blocks 0 and 3 move in;
    # block 2 waits for slot 4 to empty
    assert first.moves == [hot(21, 8), hot(0, 2), hot(3, 5)]
    block_at = apply(block_at, first.moves)
    second = plan(block_at, chats)
    assert second.moves == [hot(2, 4)]
    block_at = apply(block_at, second.moves)
    assert block_at == [_, 20, 0, 1, 2, 3, _, 22, 21, _, 23, _]
    assert plan(block_at, chats).moves == []


def test_pinned_blocks_stay_where_they_are():
    block_at = [0, 20, _, 1, 21, _, 2, 22, _, 3, 23, _]
    chats = {1: [0, 1, 2, 3]}
    result = plan(block_at, chats, pinned={21})  # a running step reads block 21: window 2..5 is out
    assert result.moves == [hot(20, 5), hot(2, 2)]
    assert all(m.block_id != 21 and m.dst_slot != 4 for m in result.moves)
    waiting = plan(block_at, chats, pinned={2})  # the chat itself runs a step: ask again later
    assert (waiting.moves, waiting.waiting) == ([], True)


def test_shared_and_reserved_slots_are_never_moved_or_taken():
    # block 1 is shared with another chat: the window must keep it at slot 3; slot 4 is reserved
    block_at = [0, _, _, 1, RESERVED, _, 2, _, _, _, _, _]
    assert plan(block_at, {1: [0, 1, 2]}, shared={1}).moves == []
    block_at[4] = NO_BLOCK
    assert plan(block_at, {1: [0, 1, 2]}, shared={1}).moves == [hot(0, 2), hot(2, 4)]


def test_thresholds_decide_when_a_chat_needs_repair():
    block_at = [0, 1, 2, _, 3, _, _, _, _, _, _, _]  # contiguity 3/4
    chats = {1: [0, 1, 2, 3]}
    assert plan(block_at, chats, min_contiguity=0.7).moves == []  # tolerated while the pool is not fragmented
    assert plan(block_at, chats, min_contiguity=0.7, pool_fragmentation=0.6).moves == [hot(3, 3)]
    assert plan(block_at, chats, min_contiguity=0.8).moves == [hot(3, 3)]


def repair(block_at: list[int], chats: dict[int, list[int]], max_calls: int = 20) -> tuple[list[int], int]:
    """Plan and apply until nothing is left to do, as the mover would: (final pool, moves made)."""
    num_moves, prefer = 0, None
    for _ in range(max_calls):
        result = plan(block_at, chats, prefer=prefer)
        if not result.moves:
            return block_at, num_moves
        block_at, num_moves, prefer = apply(block_at, result.moves), num_moves + len(result.moves), result.repairing
    raise AssertionError(f"still moving blocks after {max_calls} calls: {block_at}")


def test_a_larger_chat_may_displace_a_smaller_one():
    # chat 1 (6 blocks) ran into chat 2 (2 blocks) and continued at slot 7; 4 slots free
    block_at = [0, 1, 2, 3, 4, 10, 11, 5, _, _, _, _]
    chats = {1: [0, 1, 2, 3, 4, 5], 2: [10, 11]}
    assert plan(block_at, chats).moves == [hot(10, 11)]  # chat 2's first block makes way
    block_at, num_moves = repair(block_at, chats)
    assert block_at == [0, 1, 2, 3, 4, 5, _, 10, 11, _, _, _] and num_moves == 4  # then chat 2 relocates


def test_a_chat_with_no_window_has_a_longer_one_shifted_aside():
    # chat 1 (6 blocks) ran into chat 2 (7 blocks, the longer) and went on after it; 3 slots free:
    # chat 2 moves one slot right, its stray block first out of the way, then chat 1 closes up
    block_at = [0, 1, 2, 3, 4, 10, 11, 12, 13, 14, 15, 16, 5, _, _, _]
    chats = {1: [0, 1, 2, 3, 4, 5], 2: [10, 11, 12, 13, 14, 15, 16]}
    first = plan(block_at, chats)
    assert first.moves == [hot(5, 15)] and first.repairing == (1, 0)
    block_at, num_moves = repair(block_at, chats)
    assert block_at == [0, 1, 2, 3, 4, 5, 10, 11, 12, 13, 14, 15, 16, _, _, _]
    assert num_moves == 1 + 7 + 1  # chat 1's stray block twice, each of chat 2's once


def test_a_chat_whose_blocks_are_out_of_order_moves_one_out_of_the_way():
    block_at = [1, 0, 2, _, _, _, _, _, _, _, _, 30]  # consecutive slots, wrong token order
    chats = {1: [0, 1, 2]}
    result = plan(block_at, chats)
    block_at = apply(block_at, result.moves)
    for _round in range(4):
        result = plan(block_at, chats)
        if not result.moves:
            break
        block_at = apply(block_at, result.moves)
    slots = [block_at.index(b) for b in (0, 1, 2)]
    assert slots == list(range(slots[0], slots[0] + 3))


# --- placement by the store --------------------------------------------------------------------------

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype_name="float32")


def small_store(hot_blocks: int, warm_blocks: int = 0) -> tiered_kv.TierStore:
    store = tiered_kv.TierStore({"block_size": 4, "hot": {"device": "cpu", "capacity_blocks": hot_blocks},
                                 "warm": {"capacity_blocks": warm_blocks, "pinned": False}, "cold": {"capacity": 0},
                                 "scheduler": {"background": False}})
    store.bind(LAYOUT, torch.float32)
    return store


def slots_of(store, block_ids):
    return [store.index.get(b).slot for b in block_ids]


def test_new_blocks_continue_their_sequence_in_the_hot_slab():
    store = small_store(16)
    a = store.allocate(2, follow=[(2, None)])
    b = store.allocate(2, follow=[(2, None)])
    assert slots_of(store, a) == [0, 1] and slots_of(store, b) == [8, 9]  # b in the middle of the free run
    for _ in range(3):  # decode steps of two chats, interleaved: each keeps growing in place
        a += store.allocate(1, follow=[(1, a[-1])])
        b += store.allocate(1, follow=[(1, b[-1])])
    both = store.allocate(3, follow=[(1, a[-1]), (2, b[-1])])  # one bank, two rows
    a, b = a + both[:1], b + both[1:]
    assert slots_of(store, a) == [0, 1, 2, 3, 4, 5] and slots_of(store, b) == [8, 9, 10, 11, 12, 13, 14]
    assert store.stats()["fragmentation"] == pytest.approx(1 - 2 / 3)  # free: 6, 7 and 15
    store.release([a[2]])
    assert slots_of(store, store.allocate(1)) == [2]  # no follow: the most recently freed slot, as before
    with pytest.raises(ValueError, match=r"covers 2 blocks, not 3"):
        store.allocate(3, follow=[(2, None)])
    store.close()


def test_a_chat_promoted_block_by_block_lands_in_consecutive_slots_in_token_order():
    store = small_store(8, 8)
    chat = store.allocate(4, follow=[(4, None)])
    store.allocate(2, follow=[(2, None)])  # another chat's blocks in the middle of the slab
    store.demote(chat[::-1], WARM)  # frees slots 3, 2, 1, 0: the free list alone would reverse them
    assert [store.index.get(b).tier for b in chat] == [WARM] * 4
    store.promote(chat[::-1])  # most recent first, as a bank asks
    slots = slots_of(store, chat)
    assert [store.index.get(b).tier for b in chat] == [HOT] * 4
    assert slots == list(range(slots[0], slots[0] + 4))
    store.close()


def test_a_repair_that_takes_too_many_moves_is_given_up_until_the_pool_has_more_room():
    store = small_store(12)
    chat = store.allocate(3)  # no follow: the free list's slots 0, 1, 2
    other = store.allocate(3)
    store.release([chat[1]])
    chat[1:2] = store.allocate(1, follow=[(1, other[-1])])  # slot 6: chat 1 is scattered
    store.access_log.record_step(1, set(chat), [chat])  # two chats' steps, as their leases record them
    store.access_log.record_step(2, set(other), [other])
    assert slots_of(store, chat) == [0, 6, 2] and store.stats()["contiguity_min"] == pytest.approx(1 / 3)
    budget = (2 + MAX_OPEN_DEPTH) * 3
    num_moves = 0
    while num_moves <= budget:  # the mover would carry each plan out; here nothing moves
        repair = store_compaction_plan(store, 12)
        assert repair is not None and {m.block_id for m in repair.moves} <= set(chat)
        num_moves += len(repair.moves)
    assert store_compaction_plan(store, 12) is None and compaction_pending(store) is False  # given up
    store.release([other[-1]])  # more room than when it was given up: another chance
    assert store_compaction_plan(store, 12) is not None
    store.close()


def store_compaction_plan(store, max_moves: int):
    """The store's compaction plan now (the mover asks the same, under the store's lock)."""
    with store.lock:
        return store.compaction.plan(max_moves)


def compaction_pending(store) -> bool:
    with store.lock:
        return store.compaction.pending()


# --- a store and its mover ---------------------------------------------------------------------------

HOT_BLOCKS = 48
# chat 0 grows by 14 tokens a turn, chat 1 by 1: chat 0 soon runs into chat 1's slots
NEW_TOKENS = (14, 1)


def _interleaved_turns(background: bool):
    model = tiny_model("llama")
    # min_contiguity 1: every chat is repaired until it is one run (the default tolerates 0.9)
    cfg = {"block_size": 4, "hot": {"device": "cpu", "capacity_blocks": HOT_BLOCKS}, "warm": {"capacity": 0},
           "cold": {"capacity": 0}, "scheduler": {"background": background, "min_contiguity": 1.0}}
    store = tiered_kv.TierStore(cfg)
    banks = [tiered_kv.CacheBank(model, cfg, store=store) for _ in range(2)]
    conversations = [rand_ids(1, 10), rand_ids(2, 30)]
    for turn in range(5):
        for chat, bank in enumerate(banks):
            out = greedy(model, conversations[chat], bank, 6)
            assert torch.equal(out, reference(model, conversations[chat], 6)), f"turn {turn} chat {chat}"
            conversations[chat] = torch.cat([out, rand_ids(10 * turn + chat, NEW_TOKENS[chat])], dim=1)
    return store, banks


def test_interleaved_chats_fragment_without_the_mover():
    store, banks = _interleaved_turns(background=False)
    stats = store.stats()
    assert stats["contiguity_min"] < 1.0  # what the mover has to repair in the next test
    assert 0.0 <= stats["fragmentation"] <= 1.0
    assert min(bank.stats()["contiguity"] for bank in banks) == stats["contiguity_min"]
    deadline = time.monotonic() + 10  # no mover carries it out, but it can be planned once the chats are quiet
    while (repair := store_compaction_plan(store, 64)) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert repair is not None and repair.moves
    assert all(m.src_tier == m.dst_tier == HOT and not store.pools[HOT].is_used(m.dst_slot) for m in repair.moves)
    store.close()


def test_the_mover_lays_interleaved_chats_out_contiguously_and_generation_stays_exact():
    store, banks = _interleaved_turns(background=True)
    deadline = time.monotonic() + 30  # the mover has settled, and compaction counts as pending work
    while time.monotonic() < deadline:
        assert store.wait_for_background(30)
        if store.stats()["contiguity_min"] == 1.0:
            break
        time.sleep(0.05)
    stats = store.stats()
    assert (stats["contiguity"], stats["contiguity_min"]) == (1.0, 1.0)
    assert [bank.stats()["contiguity"] for bank in banks] == [1.0, 1.0]
    for bank in banks:  # each chat's blocks in consecutive slots, in token order
        slots = [store.index.get(b).slot for b in bank.block_table()]
        assert slots == list(range(slots[0], slots[0] + len(slots)))
    assert store.metrics.relocations.value() > 0
    store.close()
