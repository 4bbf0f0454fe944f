"""Placement policies (lru, lfu, fifo, turns) and the signals behind them: exact plans on small pools.

No torch: an AccessLog records which blocks each store step read, a BlockIndex says where they
are, and every case asserts the whole move list the MemScheduler returns.
"""
import numpy as np
import pytest

from tiered_kv.block_index import BlockIndex
from tiered_kv.config import ConfigError, SchedulerConfig, load_config
from tiered_kv.scheduler import COLD, DROPPED, HOT, WARM, MemScheduler, Move
from tiered_kv.scheduler.access_log import RECENT_SPEAKERS, AccessLog
from tiered_kv.scheduler.mem_scheduler import Watermarks


def scheduler(policy: str, window: int = 10, **settings) -> MemScheduler:
    cfg = SchedulerConfig(policy=policy, ali_window=window, **settings)
    return MemScheduler(cfg, AccessLog.from_settings(cfg))


def fill(index: BlockIndex, tier: int, num_blocks: int, clock: int = 0) -> list[int]:
    index.clock = clock
    return [index.add(tier, slot) for slot in range(num_blocks)]


def step(sched: MemScheduler, index: BlockIndex, owner: int, block_ids, cs: float | None = None) -> None:
    """One store step of chat `owner` reading `block_ids` (as TierStore.begin_step records it)."""
    sched.access_log.record_step(owner, set(block_ids), None, cs)
    index.touch(block_ids)
    index.clock = sched.access_log.now


def victims(sched: MemScheduler, index: BlockIndex, capacities, num_new: int = 1):
    free = [c - index.count_in(t) for t, c in enumerate(capacities)]
    return sched.plan_new_blocks(num_new, index, free, capacities).moves


# --- the access log ------------------------------------------------------------------------------

def test_ali_is_the_share_of_the_window_that_read_the_block():
    log = AccessLog(window_steps=4)
    log.record_step(1, {0, 1})
    log.record_step(2, {2})
    log.record_step(1, {0, 1})
    assert log.steps_in_window == 3
    # the share of the steps since each block was first read: 2 of 3, 2 of 3, 1 of 2; never read: 0
    assert log.ali([0, 1, 2, 3]).tolist() == pytest.approx([2 / 3, 2 / 3, 1 / 2, 0.0])
    log.record_step(2, {2})
    log.record_step(2, {2})  # the first step (0, 1) leaves the window
    assert log.window_reads([0, 1, 2]).tolist() == [1, 1, 3]
    assert log.ali([0, 1, 2]).tolist() == pytest.approx([0.25, 0.25, 0.75])
    assert log.num_reads([0, 1, 2]).tolist() == [2, 2, 3]
    assert log.last_read_step([0, 2, 99]).tolist() == [2, 4, -1]
    assert log.chat_ali(1) == pytest.approx(0.25) and log.chat_ali(2) == pytest.approx(0.75)


def test_block_cost_sensitivity_is_the_highest_of_its_readers_within_the_window():
    log = AccessLog(window_steps=2, default_cs=0.5)
    assert log.cost_sensitivity([7]).tolist() == [0.5]  # never read: the default
    log.record_step(1, {0, 1}, cost_sensitivity=0.9)
    log.record_step(2, {1}, cost_sensitivity=0.1)  # a shared prefix keeps its premium reader's CS
    assert log.cost_sensitivity([0, 1]).tolist() == pytest.approx([0.9, 0.9])
    log.record_step(2, {2}, cost_sensitivity=0.1)
    log.record_step(2, {2}, cost_sensitivity=0.1)
    log.record_step(2, {1}, cost_sensitivity=0.1)  # unread for a whole window: its readers start afresh
    assert log.cost_sensitivity([1]).tolist() == pytest.approx([0.1])


def test_forgetting_a_chat_drops_its_record():
    log = AccessLog(window_steps=3)
    log.record_step(5, {0}, tables=[[0]], cost_sensitivity=0.7)
    assert log.chats[5].tables == [[0]] and log.chats[5].cost_sensitivity == 0.7 and log.chats[5].last_step == 0
    log.forget_chat(5)
    assert 5 not in log.chats


# --- victims per policy ----------------------------------------------------------------------------

def test_lru_demotes_the_block_read_longest_ago():
    sched, index = scheduler("lru"), BlockIndex()
    a, b, c = fill(index, HOT, 3)
    step(sched, index, 1, [a, b, c])
    step(sched, index, 1, [a, c])
    step(sched, index, 1, [c, a])
    assert victims(sched, index, [3, 3, 0]) == [Move(b, HOT, WARM)]


def test_fifo_demotes_the_block_that_entered_its_tier_first_whatever_was_read_since():
    sched, index = scheduler("fifo"), BlockIndex()
    first = fill(index, HOT, 1, clock=0)[0]
    index.clock = 5
    index.add(HOT, 1), index.add(HOT, 2)  # two blocks that arrive later
    step(sched, index, 1, [first])  # reading it does not refresh its arrival
    assert victims(sched, index, [3, 3, 0]) == [Move(first, HOT, WARM)]


def test_lfu_demotes_the_least_read_block_ties_by_recency():
    sched, index = scheduler("lfu"), BlockIndex()
    a, b, c = fill(index, HOT, 3)
    for _ in range(3):
        step(sched, index, 1, [a])
    step(sched, index, 2, [b])
    step(sched, index, 3, [c])  # b and c were read once each: b longer ago goes first
    assert victims(sched, index, [3, 3, 0], num_new=2) == [Move(b, HOT, WARM), Move(c, HOT, WARM)]


def test_ali_forgets_reads_that_left_the_window_unlike_lfu():
    index = BlockIndex()
    a, b = fill(index, HOT, 2)
    plans = {}
    for policy in ("lfu", "turns"):
        sched = scheduler(policy, window=3)
        for _ in range(5):  # a was read a lot, long ago
            sched.access_log.record_step(1, {a})
        for _ in range(3):  # b is what the last 3 steps read
            sched.access_log.record_step(2, {b})
        plans[policy] = victims(sched, index, [2, 2, 0])
    assert plans == {"lfu": [Move(b, HOT, WARM)], "turns": [Move(a, HOT, WARM)]}


@pytest.mark.parametrize("policy", ["lru", "lfu", "fifo", "turns"])
def test_cost_sensitivity_makes_a_premium_chat_the_last_victim(policy):
    """Same access pattern, one chat at CS 1.0, the other at 0.0: the cheap one goes first under
    every policy, though it was read more recently, more often and arrived later."""
    sched, index = scheduler(policy, window=10, cs_weight=1.0), BlockIndex()
    premium = fill(index, HOT, 2, clock=0)
    index.clock = 1
    cheap = [index.add(HOT, 2), index.add(HOT, 3)]
    step(sched, index, 1, premium, cs=1.0)
    step(sched, index, 2, cheap, cs=0.0)
    step(sched, index, 2, cheap, cs=0.0)
    assert victims(sched, index, [4, 4, 0], num_new=2) == [Move(cheap[0], HOT, WARM), Move(cheap[1], HOT, WARM)]


@pytest.mark.parametrize("policy", ["lru", "lfu", "fifo", "turns"])
def test_without_cost_sensitivity_differences_ties_fall_back_to_lru_order(policy):
    sched, index = scheduler(policy), BlockIndex()
    blocks = fill(index, HOT, 3)
    index.touch([blocks[2]])
    index.touch([blocks[0]])  # recency: 1, 2, 0 ; no step recorded: every value ties
    assert victims(sched, index, [3, 3, 0], num_new=3) == [Move(1, HOT, WARM), Move(2, HOT, WARM), Move(0, HOT, WARM)]


def test_cs_weight_zero_ignores_cost_sensitivity():
    sched, index = scheduler("lru", cs_weight=0.0), BlockIndex()
    a, b = fill(index, HOT, 2)
    step(sched, index, 1, [a], cs=1.0)
    step(sched, index, 2, [b], cs=0.0)
    assert victims(sched, index, [2, 2, 0]) == [Move(a, HOT, WARM)]


# --- background plans --------------------------------------------------------------------------------

def marks(high, low) -> Watermarks:
    return Watermarks(high_blocks=tuple(high), low_blocks=tuple(low))


def background(sched, index, capacities, watermarks, **kw):
    free = [c - index.count_in(t) for t, c in enumerate(capacities)]
    return sched.plan_background(index, free, capacities, watermarks, **kw).moves


def test_over_the_high_watermark_hot_demotes_by_policy_down_to_the_low_one():
    sched, index = scheduler("lru", window=100, idle_steps=0), BlockIndex()
    blocks = fill(index, HOT, 5)
    for owner, block_id in enumerate(blocks):  # five chats, one block each, read in turn
        step(sched, index, owner, [block_id])
    # ALI of each is 1/5 + cs bonus 0.25 -> 0.45: warm, so hot may give them up early
    moves = background(sched, index, [5, 10, 0], marks([4, 9, 0], [2, 8, 0]))
    assert moves == [Move(blocks[0], HOT, WARM), Move(blocks[1], HOT, WARM), Move(blocks[2], HOT, WARM)]


@pytest.mark.parametrize("policy", ["lru", "lfu", "fifo", "turns"])
def test_a_chat_whose_turn_is_announced_keeps_its_blocks_until_its_step_reads_them(policy):
    """A prefetch announces chat 0's turn while its user types. Its blocks (hot already, read
    longest ago) are what every policy would demote first; the watermark demotion and a new
    block's room take the others', and once chat 0's step reads them the policy orders them again."""
    sched, index = scheduler(policy, window=100, idle_steps=0, cs_weight=0.0), BlockIndex()
    blocks = fill(index, HOT, 5)
    for owner, block_id in enumerate(blocks):  # five chats, one block each; chat 0 read first
        step(sched, index, owner, [block_id])
    sched.access_log.announce_turn(0, [blocks[0]])
    assert sched.access_log.awaited(blocks).tolist() == [True, False, False, False, False]
    moves = background(sched, index, [5, 10, 0], marks([4, 9, 0], [2, 8, 0]))
    assert [m.block_id for m in moves] == blocks[1:4] and all(m.dst_tier == WARM for m in moves)
    assert victims(sched, index, [5, 10, 0]) == [Move(blocks[1], HOT, WARM)]
    step(sched, index, 0, [blocks[0]])  # its turn reads it: no longer awaited
    assert not sched.access_log.awaited(blocks).any()


def test_an_announced_turn_that_never_comes_lapses_after_the_window():
    sched, index = scheduler("lru", window=3, idle_steps=0), BlockIndex()
    blocks = fill(index, HOT, 2)
    sched.access_log.announce_turn(7, [blocks[0]])
    for _ in range(3):
        step(sched, index, 1, [blocks[1]])
    assert sched.access_log.awaited(blocks).tolist() == [True, False]
    step(sched, index, 1, [blocks[1]])
    assert sched.access_log.awaited(blocks).tolist() == [False, False]
    assert victims(sched, index, [2, 10, 0]) == [Move(blocks[0], HOT, WARM)]


def test_under_the_high_watermark_nothing_moves():
    sched, index = scheduler("lru", idle_steps=0), BlockIndex()
    fill(index, HOT, 4)
    assert background(sched, index, [5, 10, 0], marks([4, 9, 0], [2, 8, 0])) == []


def test_a_working_set_is_never_demoted_early():
    """One chat reads all its blocks every step: ALI 1.0 says hot, so the watermark leaves them."""
    sched, index = scheduler("lru", idle_steps=0), BlockIndex()
    blocks = fill(index, HOT, 5)
    for _ in range(3):
        step(sched, index, 1, blocks)
    assert background(sched, index, [5, 10, 0], marks([4, 9, 0], [2, 8, 0])) == []


def test_watermark_demotion_goes_one_tier_down_even_when_ali_says_cold():
    """The next tier is the cheapest to fetch back from; cold only when warm is full."""
    sched, index = scheduler("turns", window=10, idle_steps=0, cs_weight=0.0), BlockIndex()
    old, busy = fill(index, HOT, 2)
    step(sched, index, 1, [old])
    for _ in range(9):
        step(sched, index, 2, [busy])  # old: ALI 0.1 (cold by score) ; busy: 0.9 -> stays hot
    assert background(sched, index, [2, 4, 4], marks([1, 4, 4], [1, 3, 4])) == [Move(old, HOT, WARM)]
    index.clock = 0
    for slot in range(4):
        index.add(WARM, slot)  # warm full: now the block goes on to cold
    assert background(sched, index, [2, 4, 4], marks([1, 4, 4], [1, 4, 4])) == [Move(old, HOT, COLD)]


def test_unreferenced_cached_blocks_with_nowhere_to_go_are_dropped():
    sched, index = scheduler("lru", idle_steps=0), BlockIndex()
    cached, held = fill(index, WARM, 2)
    index.decref(cached)
    step(sched, index, 1, [held])
    sched.access_log.record_step(2, set())  # another chat's step: held's ALI falls to 0.5 + bonus
    moves = background(sched, index, [0, 2, 0], marks([0, 1, 0], [0, 1, 0]))
    assert moves == [Move(cached, WARM, DROPPED)]


def test_idle_hot_blocks_go_to_warm_after_idle_steps_scaled_by_cs():
    sched, index = scheduler("lru", window=100, idle_steps=4), BlockIndex()
    cheap, premium, busy = fill(index, HOT, 3)
    step(sched, index, 1, [cheap], cs=0.0)
    step(sched, index, 2, [premium], cs=1.0)  # may idle 4 * (1 + 1.0) = 8 steps
    for _ in range(6):
        step(sched, index, 3, [busy])
    no_marks = marks([3, 3, 0], [3, 3, 0])
    assert background(sched, index, [3, 3, 0], no_marks) == [Move(cheap, HOT, WARM)]
    for _ in range(3):
        step(sched, index, 3, [busy])
    assert background(sched, index, [3, 3, 0], no_marks) == [Move(cheap, HOT, WARM), Move(premium, HOT, WARM)]


def test_ali_brings_blocks_it_scores_hot_up_while_under_the_low_watermark():
    """With scheduler.ali_promote (off by default: on the replayed 16-chat trace these speculative
    moves undid prefetches and moved 2.5x lru's bytes)."""
    sched, index = scheduler("turns", window=4, idle_steps=0, cs_weight=0.0, ali_promote=True), BlockIndex()
    (hot_block,) = fill(index, HOT, 1)
    index.clock = 0
    spilled = [index.add(WARM, 0), index.add(WARM, 1), index.add(COLD, 0)]
    for _ in range(4):
        step(sched, index, 1, spilled)  # read every step while spilled: ALI 1.0
    moves = background(sched, index, [4, 4, 4], marks([3, 4, 4], [2, 4, 4]))
    # hot fills only to its low mark (2 of 4: room stays for new turns); the cold one reaches warm
    assert moves == [Move(spilled[0], WARM, HOT), Move(spilled[2], COLD, WARM)]
    off = scheduler("turns", window=4, idle_steps=0, cs_weight=0.0)  # the default: no speculative promotion
    for _ in range(4):
        step(off, index, 1, spilled)
    assert background(off, index, [4, 4, 4], marks([3, 4, 4], [2, 4, 4])) == []


def test_background_plans_respect_max_moves_and_pins():
    sched, index = scheduler("lru", idle_steps=0), BlockIndex()
    blocks = fill(index, HOT, 6)
    for owner, block_id in enumerate(blocks):
        step(sched, index, owner, [block_id])
    moves = background(sched, index, [6, 10, 0], marks([4, 9, 0], [1, 8, 0]), max_moves=2,
                       is_pinned=lambda b: b == blocks[0])
    assert moves == [Move(blocks[1], HOT, WARM), Move(blocks[2], HOT, WARM)]


# --- bad settings -----------------------------------------------------------------------------------

@pytest.mark.parametrize("section, key, value, allowed", [
    ("scheduler", "policy", "mru", "'lru', 'lfu', 'fifo' or 'turns'"),
    ("scheduler", "ali_hot", 1.2, "a number from 0 to 1"),
    ("scheduler", "bs_threshold", -0.1, "a number from 0 to 1"),
    ("scheduler", "cs_weight", "high", "a number from 0 to 1"),
    ("scheduler", "ali_window", -5, "an integer >= 1"),
    ("scheduler", "ali_window", 0, "an integer >= 1"),
    ("scheduler", "idle_steps", -1, "an integer >= 0"),
    ("hot", "high_watermark", 1.5, "a number from 0 to 1"),
    ("warm", "low_watermark", True, "a number from 0 to 1"),
])
def test_bad_scheduler_settings_name_key_value_and_what_is_allowed(section, key, value, allowed):
    with pytest.raises(ConfigError) as error:
        load_config({section: {key: value}})
    message = str(error.value)
    assert f"'{section}.{key}'" in message and repr(value) in message and allowed in message


def test_low_watermark_above_high_is_refused():
    with pytest.raises(ConfigError, match=r"'hot.low_watermark': got 0.9, above 'hot.high_watermark' 0.5"):
        load_config({"hot": {"high_watermark": 0.5, "low_watermark": 0.9}})


def test_ali_warm_above_ali_hot_is_refused():
    with pytest.raises(ConfigError, match=r"'scheduler.ali_warm'.*allowed: ali_warm <= ali_hot"):
        load_config({"scheduler": {"ali_hot": 0.2, "ali_warm": 0.5}})


def test_target_tiers_follow_the_ali_thresholds():
    sched = scheduler("turns", window=10, cs_weight=0.0)
    sched.access_log.record_step(1, {0, 1})
    for _ in range(7):
        sched.access_log.record_step(1, {0})
    for _ in range(2):
        sched.access_log.record_step(2, {0})
    # block 0: read by all 10 steps; block 1: by 1 of the 10 since it was first read; 2: never
    assert sched.target_tiers([0, 1, 2]).tolist() == [HOT, COLD, COLD]
    for _ in range(4):
        sched.access_log.record_step(3, {1})  # block 1: 4 of the last 10 -> warm
    assert sched.target_tiers(np.array([1])).tolist() == [WARM]


def test_a_chats_newest_block_scores_like_its_oldest():
    """Every step of a chat reads all its blocks: ALI counts only the steps since a block was
    first read, so a block allocated late is not a victim before the chat's older ones."""
    log = AccessLog(window_steps=10)
    for step_no in range(6):
        log.record_step(1, {0, 1} | ({2} if step_no >= 4 else set()))
    assert log.ali([0, 1, 2]).tolist() == pytest.approx([1.0, 1.0, 1.0])


# --- turns: turn heat, and which predictor it follows (issue 22) -------------------------------------

def test_ali_is_accepted_as_the_former_name_of_turns_and_plans_alike():
    config = load_config({"scheduler": {"policy": "ali"}})
    assert config.scheduler == SchedulerConfig(policy="turns") and config.scheduler.policy == "turns"
    assert load_config(config.to_dict()) == config
    plans = {}
    for name in ("ali", "turns"):
        sched, index = scheduler(name, window=4, idle_steps=0, cs_weight=0.0), BlockIndex()
        blocks = fill(index, HOT, 4)
        for owner in (0, 1, 0, 2, 0, 3, 1):  # chat 0 is the hottest
            turn(sched.access_log, owner, [blocks[owner]])
        plans[name] = victims(sched, index, [4, 4, 0], num_new=2)
    assert plans["ali"] == plans["turns"] and blocks[0] not in [m.block_id for m in plans["turns"]]


def turn(log: AccessLog, owner: int, block_ids, decode_steps: int = 0) -> None:
    """One turn of chat `owner`: a prefill step, then `decode_steps` one-token steps."""
    log.record_step(owner, set(block_ids), new_turn=True)
    for _ in range(decode_steps):
        log.record_step(owner, set(block_ids))


def test_turn_heat_counts_turns_not_steps_and_halves_every_half_life():
    log = AccessLog(window_steps=10, half_life_turns=1.0)
    turn(log, 1, [0], decode_steps=5)  # a long reply: still one turn
    turn(log, 2, [1])
    assert log.turns == 2 and log.now == 7
    assert log.heat_now([0, 1, 9]).tolist() == pytest.approx([0.25, 0.5, 0.0])
    turn(log, 1, [0, 2])  # 0.25 decayed to 0.25 at its turn (2 turns after its first), plus one
    assert log.heat_now([0, 2]).tolist() == pytest.approx([0.625, 0.625])  # its new block shares it


def test_a_prefetch_counts_the_coming_turn_once_and_a_shared_prefix_keeps_the_hottest_heat():
    log = AccessLog(window_steps=10, half_life_turns=100.0)
    for _ in range(3):
        turn(log, 1, [0, 1])  # chat 1 (three turns) shares block 0 with chat 2
    log.announce_turn(2, [0, 2])  # chat 2's user starts typing: its turn counts now
    turn(log, 2, [0, 2])  # ... not again at its first step
    assert log.turns == 4
    heat = log.heat_now([0, 1, 2])
    assert heat[0] == pytest.approx(heat[1]) and heat[1] > 2.9 and heat[2] == pytest.approx(1.0, rel=0.02)


def _skewed_and_bursty(policy_log: AccessLog, pattern: list[int]) -> None:
    for owner in pattern:
        turn(policy_log, owner, [100 + owner])


def test_ali_follows_heat_where_popular_chats_keep_chatting_and_recency_where_they_leave():
    # skew: chat 0 speaks every other turn between one-off chats -> heat predicts better
    skew = scheduler("turns", window=4, idle_steps=0, cs_weight=0.0, half_life_turns=8.0)
    _skewed_and_bursty(skew.access_log, [0, 1, 0, 2, 0, 3, 0, 4, 0, 5, 0, 6, 0, 7, 0, 8])
    assert skew.access_log.heat_predicts_better
    # bursts: each chat speaks a few times, then leaves for good -> recency predicts better
    bursts = scheduler("turns", window=4, idle_steps=0, cs_weight=0.0, half_life_turns=8.0)
    _skewed_and_bursty(bursts.access_log, [1] * 4 + [2] * 4 + [3] * 4 + [4] * 4 + [5] * 4)
    assert not bursts.access_log.heat_predicts_better
    # a full hot tier of 3: a block chat 0 (popular under skew) read longest ago, then a block of a
    # one-off chat, then one of the last speaker (in use: read within a quarter of the window, kept
    # by both): LRU takes the first, heat the one-off chat's
    for sched, popular_owner, lru_wins in ((skew, 0, False), (bursts, 6, True)):
        index = BlockIndex()
        first, one_off, last = index.add(HOT, 0), index.add(HOT, 1), index.add(HOT, 2)
        turn(sched.access_log, popular_owner, [first])
        turn(sched.access_log, 9, [one_off])
        turn(sched.access_log, 10, [last])
        assert victims(sched, index, [3, 3, 0]) == [Move(first if lru_wins else one_off, HOT, WARM)]


def test_an_announced_turn_resumed_without_a_prefill_does_not_swallow_the_next_turn():
    log = AccessLog(window_steps=10, half_life_turns=100.0)
    log.announce_turn(1, [0])  # attach() of a stored chat: its turn counts now
    log.record_step(1, {0})  # only its last token was left to compute: a one-token step
    log.record_step(1, {0}, new_turn=True)  # its next turn: counted, not taken for the announced one
    assert log.turns == 2


def test_a_speaker_is_ranked_against_the_recent_speakers_only():
    """The predictors' score costs O(RECENT_SPEAKERS) a turn, however many chats are open."""
    log = AccessLog(window_steps=10)
    for owner in range(3 * RECENT_SPEAKERS):
        turn(log, owner, [owner])
    assert list(log._recent_speakers) == list(range(2 * RECENT_SPEAKERS, 3 * RECENT_SPEAKERS))
    turn(log, 2 * RECENT_SPEAKERS, [0])  # speaks again: the most recent now
    assert next(reversed(log._recent_speakers)) == 2 * RECENT_SPEAKERS
    log.forget_chat(2 * RECENT_SPEAKERS)
    assert 2 * RECENT_SPEAKERS not in log._recent_speakers and len(log._recent_speakers) == RECENT_SPEAKERS - 1


def test_ali_keeps_a_chat_mid_turn_when_more_chats_step_than_a_quarter_window():
    """Six chats decode round-robin (each reads its blocks every 6th step, beyond a quarter of the
    8-step window): the new one among them keeps its block; the popular chat that went idle is
    the victim, though its heat is higher."""
    sched = scheduler("turns", window=8, idle_steps=0, cs_weight=0.0, half_life_turns=8.0)
    log, index = sched.access_log, BlockIndex()
    popular = index.add(HOT, 0)
    for owner in [0, 1, 0, 2, 0, 3, 0, 4, 0, 5, 0, 6, 0, 7]:
        turn(log, owner, [popular] if owner == 0 else [])
    decoding = {owner: index.add(HOT, slot) for slot, owner in enumerate(range(20, 26), start=1)}
    for owner, block in decoding.items():
        log.record_step(owner, {block}, new_turn=True)
    for _ in range(2):
        for owner, block in decoding.items():
            log.record_step(owner, {block})
    assert log.heat_predicts_better and log.active_chats == 6
    assert log.now - log.last_read_step([decoding[20]])[0] == 6 > 8 // 4
    assert victims(sched, index, [7, 7, 0]) == [Move(popular, HOT, WARM)]


def test_lfu_counts_halve_every_lfu_half_life_turns():
    log = AccessLog(window_steps=10, lfu_half_life_turns=2.0)
    turn(log, 1, [0], decode_steps=3)  # four reads of block 0 in turn 1
    turn(log, 2, [1])  # turn 2: one read of block 1
    turn(log, 2, [1])  # turn 3: its first read is half a half-life old
    assert log.num_reads([0, 1, 7]).tolist() == pytest.approx([4 * 2 ** -1, 2 ** -0.5 + 1, 0.0])


def test_lfu_lets_a_chat_busy_long_ago_go_before_one_busy_now():
    """Block 0 was read 12 times long ago, block 1 five times lately: with aging block 0 goes
    first (without it, block 1 would)."""
    for half_life, first_victim in ((2.0, 0), (1e9, 1)):
        sched = scheduler("lfu", window=4, idle_steps=0, cs_weight=0.0, lfu_half_life_turns=half_life)
        index = BlockIndex()
        blocks = [index.add(HOT, 0), index.add(HOT, 1)]
        turn(sched.access_log, 1, [blocks[0]], decode_steps=11)
        for _ in range(5):
            turn(sched.access_log, 2, [blocks[1]])
        for owner in range(3, 9):  # others speak, reading no hot block
            turn(sched.access_log, owner, [])
        assert victims(sched, index, [2, 2, 0]) == [Move(blocks[first_victim], HOT, WARM)], half_life


def test_lfu_with_its_default_aging_lets_a_conversation_that_ended_go_before_one_going_on():
    """The sessions bench's closed trace in small: a chat of 12 turns (5 reads each) ends, then
    others chat for 64 turns, one of them 3 times. With the default aging (16 turns) the ended
    chat's 60 old reads count less than the 15 recent ones (with 1,000, they held hot forever)."""
    sched = scheduler("lfu", window=4, idle_steps=0, cs_weight=0.0)
    assert sched.settings.lfu_half_life_turns == 16.0
    index = BlockIndex()
    ended, going_on = index.add(HOT, 0), index.add(HOT, 1)
    for _ in range(12):
        turn(sched.access_log, 1, [ended], decode_steps=4)
    for owner in range(3, 64):  # others speak, reading no hot block
        turn(sched.access_log, owner, [])
    for _ in range(3):
        turn(sched.access_log, 2, [going_on], decode_steps=4)
    assert victims(sched, index, [2, 2, 0]) == [Move(ended, HOT, WARM)]


def test_half_life_and_restore_settings_are_checked():
    # restore is always by default: a stored prefix is restored, as before there was a choice
    assert SchedulerConfig().restore == "always" and SchedulerConfig(restore="auto").restore == "auto"
    with pytest.raises(ConfigError, match=r"'scheduler.half_life_turns'.*from 0.5"):
        load_config({"scheduler": {"half_life_turns": 0}})
    with pytest.raises(ConfigError, match=r"'scheduler.lfu_half_life_turns'.*from 1 to"):
        load_config({"scheduler": {"lfu_half_life_turns": "often"}})
    with pytest.raises(ConfigError, match=r"'scheduler.restore': got 'sometimes'.*'auto' or 'always'"):
        load_config({"scheduler": {"restore": "sometimes"}})
    with pytest.raises(ConfigError, match=r"'scheduler.ali_promote'"):
        load_config({"scheduler": {"ali_promote": "yes"}})
