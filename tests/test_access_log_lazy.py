"""AccessLog records a run of repeated steps in O(1) and folds it in lazily: every signal, read at any
moment, is bitwise what the eager log (ReferenceAccessLog below, the class as it was) gives, on random
traces of chats that interleave, repeat steps with the same array, grow their arrays, share blocks,
take and announce turns, close, and whose blocks the store frees. No torch."""
from __future__ import annotations

import copy
import math
import random
from collections import OrderedDict, deque

import numpy as np
import pytest

from tiered_kv.scheduler.access_log import PREDICTOR_EWMA, RECENT_SPEAKERS, AccessLog, ChatRecord
from tiered_kv.scheduler.access_rows import MIN_ROWS, BlockRows, add_ones

class ReferenceAccessLog:
    """tiered_kv.scheduler.access_log.AccessLog as it was before runs of repeated steps were folded in
    lazily (and before removed blocks were forgotten): every step recorded eagerly, per block id."""

    def __init__(self, window_steps: int = 100, default_cs: float = 0.5, half_life_turns: float = 16.0,
                 lfu_half_life_turns: float = 16.0):
        if window_steps < 1:
            raise ValueError(f"window_steps must be >= 1, got {window_steps}")
        if not half_life_turns > 0 or not lfu_half_life_turns > 0:
            raise ValueError(f"half_life_turns and lfu_half_life_turns must be > 0, got {half_life_turns}, "
                             f"{lfu_half_life_turns}")
        self.window_steps = window_steps
        self.default_cs = default_cs
        self.half_life_turns = float(half_life_turns)
        self.lfu_half_life_turns = float(lfu_half_life_turns)
        self.now = 0  # store steps recorded so far
        self.turns = 0  # turns begun so far (steps with new_turn, or announced by prefetch / attach)
        # how badly each predictor ranked the chats that then took a turn (EWMA of the share of
        # other chats ranked above the speaker): `ali` follows the better one
        self.heat_miss = 0.5
        self.recency_miss = 0.5
        self.chats: dict[int, ChatRecord] = {}
        self._recent_speakers: OrderedDict[int, None] = OrderedDict()  # the last RECENT_SPEAKERS chats to take a turn
        self._window: deque[np.ndarray] = deque()  # block ids read by each of the last window_steps steps
        self._window_owners: deque[int] = deque()  # and whose step each was
        self._owner_window_steps: dict[int, int] = {}
        self._last_read = np.full(0, -1, dtype=np.int64)
        self._first_read = np.full(0, -1, dtype=np.int64)
        self._num_reads = np.zeros(0, dtype=np.float64)  # decayed read count as of _reads_turn
        self._reads_turn = np.zeros(0, dtype=np.float64)  # the turn clock at the block's last read
        self._window_reads = np.zeros(0, dtype=np.int64)
        self._cs = np.zeros(0, dtype=np.float64)
        self._heat = np.full(0, -np.inf, dtype=np.float64)
        self._awaited: dict[int, tuple[int, np.ndarray]] = {}  # owner -> (step announced, its block ids)

    @classmethod
    def from_settings(cls, settings) -> "ReferenceAccessLog":
        """The log a store's scheduler settings (a SchedulerConfig) describe."""
        return cls(settings.ali_window, settings.default_cost_sensitivity, settings.half_life_turns,
                   settings.lfu_half_life_turns)

    # ---- recording -------------------------------------------------------------------------
    def record_step(self, owner: int, block_ids, tables: list[list[int]] | None = None,
                    cost_sensitivity: float | None = None, new_turn: bool = False) -> None:
        """One store step of chat `owner` read `block_ids` (any iterable of ints, each once);
        `new_turn`: it begins one of the chat's turns (a prefill)."""
        cs = self.default_cs if cost_sensitivity is None else float(cost_sensitivity)
        ids = np.fromiter(block_ids, dtype=np.int64)
        chat = self.chats.setdefault(owner, ChatRecord())
        self._awaited.pop(owner, None)  # its step reads them now: recency and use take over
        if new_turn and not chat.turn_announced:
            self._count_turn(owner, chat)
        chat.turn_announced = False  # any step of its own ends the announced turn's wait
        if len(ids):
            self._grow(int(ids.max()) + 1)
            self._heat[ids] = np.maximum(self._heat[ids], chat.heat_key)
            last = self._last_read[ids]
            recent = (last >= 0) & (last >= self.now - self.window_steps)
            self._cs[ids] = np.where(recent, np.maximum(self._cs[ids], cs), cs)
            self._last_read[ids] = self.now
            first = self._first_read[ids]
            self._first_read[ids] = np.where(first < 0, self.now, first)
            age_turns = self.turns - self._reads_turn[ids]
            self._num_reads[ids] = self._num_reads[ids] * np.exp2(-age_turns / self.lfu_half_life_turns) + 1.0
            self._reads_turn[ids] = self.turns
            self._window_reads[ids] += 1
        self._window.append(ids)
        self._window_owners.append(owner)
        self._owner_window_steps[owner] = self._owner_window_steps.get(owner, 0) + 1
        if len(self._window) > self.window_steps:
            self._window_reads[self._window.popleft()] -= 1
            gone = self._window_owners.popleft()
            left = self._owner_window_steps[gone] - 1
            if left:
                self._owner_window_steps[gone] = left
            else:
                del self._owner_window_steps[gone]
        if tables is not None:
            chat.tables = tables
        chat.cost_sensitivity = cs
        chat.last_step = self.now
        chat.num_steps += 1
        self.now += 1

    def announce_turn(self, owner: int, block_ids) -> None:
        """`owner`'s next turn is coming (its prefetch, or attach): counted now, for its blocks too;
        the turn's first step does not count it again."""
        chat = self.chats.setdefault(owner, ChatRecord())
        if not chat.turn_announced:
            self._count_turn(owner, chat)
            chat.turn_announced = True
        ids = np.fromiter(block_ids, dtype=np.int64)
        self._awaited[owner] = (self.now, ids)
        if len(ids):
            self._grow(int(ids.max()) + 1)
            self._heat[ids] = np.maximum(self._heat[ids], chat.heat_key)

    def _count_turn(self, owner: int, chat: ChatRecord) -> None:
        """chat's heat: decayed to now, plus one; the store's turn clock advances. First, how well
        each predictor saw this turn coming: the share of the other recent speakers (at most
        RECENT_SPEAKERS: O(1) per turn however many chats are open) it ranked above this one."""
        others = [c for o in self._recent_speakers if o != owner and (c := self.chats.get(o)) is not None
                  and c.last_step >= 0]
        self._recent_speakers[owner] = None
        self._recent_speakers.move_to_end(owner)
        if len(self._recent_speakers) > RECENT_SPEAKERS:
            self._recent_speakers.popitem(last=False)
        if others and chat.last_step >= 0:
            by_heat = sum(c.heat_key > chat.heat_key for c in others) / len(others)
            by_recency = sum(c.last_step > chat.last_step for c in others) / len(others)
            self.heat_miss += PREDICTOR_EWMA * (by_heat - self.heat_miss)
            self.recency_miss += PREDICTOR_EWMA * (by_recency - self.recency_miss)
        now = self.turns / self.half_life_turns
        decayed = 2.0 ** (chat.heat_key - now) if chat.heat_key > float("-inf") else 0.0
        chat.heat_key = math.log2(decayed + 1.0) + now
        self.turns += 1

    def forget_chat(self, owner: int) -> None:
        """The chat's bank closed or was collected: its tables are no longer a layout to keep."""
        self.chats.pop(owner, None)
        self._awaited.pop(owner, None)
        self._recent_speakers.pop(owner, None)

    def _grow(self, size: int) -> None:
        if size <= len(self._last_read):
            return
        new_size = max(size, 2 * len(self._last_read), 1024)
        extra = new_size - len(self._last_read)
        self._last_read = np.concatenate((self._last_read, np.full(extra, -1, dtype=np.int64)))
        self._first_read = np.concatenate((self._first_read, np.full(extra, -1, dtype=np.int64)))
        self._num_reads = np.concatenate((self._num_reads, np.zeros(extra, dtype=np.float64)))
        self._reads_turn = np.concatenate((self._reads_turn, np.zeros(extra, dtype=np.float64)))
        self._window_reads = np.concatenate((self._window_reads, np.zeros(extra, dtype=np.int64)))
        self._cs = np.concatenate((self._cs, np.full(extra, self.default_cs, dtype=np.float64)))
        self._heat = np.concatenate((self._heat, np.full(extra, -np.inf, dtype=np.float64)))

    # ---- signals (arrays aligned with `ids`) ----------------------------------------------------
    def _take(self, array: np.ndarray, ids: np.ndarray, missing) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        out = np.full(len(ids), missing, dtype=array.dtype)
        known = ids < len(array)
        out[known] = array[ids[known]]
        return out

    def last_read_step(self, ids) -> np.ndarray:
        return self._take(self._last_read, ids, -1)

    def num_reads(self, ids) -> np.ndarray:
        """Reads of each block, each one halved for every `lfu_half_life_turns` turns since it."""
        age_turns = self.turns - self._take(self._reads_turn, ids, 0.0)
        return self._take(self._num_reads, ids, 0.0) * np.exp2(-age_turns / self.lfu_half_life_turns)

    def window_reads(self, ids) -> np.ndarray:
        return self._take(self._window_reads, ids, 0)

    @property
    def steps_in_window(self) -> int:
        """The window's length so far: `window_steps` once that many steps were recorded."""
        return max(1, min(self.now, self.window_steps))

    def ali(self, ids) -> np.ndarray:
        """Access locality index: the share of the last `window_steps` store steps that read
        each block, counting only steps since the block was first read (a block cannot be read
        before it exists: a chat's newest block, read by every step since, scores like its
        oldest one)."""
        ids = np.asarray(ids, dtype=np.int64)
        first = self._take(self._first_read, ids, -1)
        steps = np.clip(np.minimum(self.now - first, self.window_steps), 1, None)
        return np.where(first < 0, 0.0, self.window_reads(ids) / steps)

    def heat(self, ids) -> np.ndarray:
        """Each block's heat key (module docstring): higher is hotter, comparable across blocks at
        any moment; -inf for blocks no chat's turn has touched (never read yet)."""
        return self._take(self._heat, ids, -np.inf)

    @property
    def heat_predicts_better(self) -> bool:
        """Whether turn heat has ranked the chats that then spoke above the others better than
        recency has, lately (`ali` then orders victims by heat first, else by recency first)."""
        return self.heat_miss < self.recency_miss

    @property
    def active_chats(self) -> int:
        """Chats with a step among the last `window_steps` store steps (stepping concurrently)."""
        return len(self._owner_window_steps)

    def heat_now(self, ids) -> np.ndarray:
        """The heat itself: decayed turn counts now (for reports and tests)."""
        keys = self.heat(ids)
        return np.where(np.isfinite(keys), np.exp2(keys - self.turns / self.half_life_turns), 0.0)

    def awaited(self, ids) -> np.ndarray:
        """Whether each block belongs to a chat whose announced turn has not read it yet (module
        docstring); announcements older than the window lapse (a user who never sent the turn)."""
        ids = np.asarray(ids, dtype=np.int64)
        oldest = self.now - self.window_steps
        for owner in [o for o, (since, _) in self._awaited.items() if since < oldest]:
            del self._awaited[owner]
        if not self._awaited:
            return np.zeros(len(ids), dtype=bool)
        return np.isin(ids, np.concatenate([b for _, b in self._awaited.values()]))

    def cost_sensitivity(self, ids) -> np.ndarray:
        return self._take(self._cs, ids, self.default_cs)

    def chat_ali(self, owner: int) -> float:
        """The share of the window's store steps that were this chat's."""
        return self._owner_window_steps.get(owner, 0) / self.steps_in_window


# ---- the differential test ------------------------------------------------------------------------
ARRAY_SIGNALS = ("last_read_step", "num_reads", "window_reads", "ali", "heat", "heat_now", "cost_sensitivity")


def same(a: np.ndarray, b: np.ndarray) -> bool:
    """Bitwise equal (floats included: -inf, -0.0 and all)."""
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def check_equal(log: AccessLog, ref: ReferenceAccessLog, live: list[int], freed: list[int], owners) -> None:
    """Every public signal of `log` (a copy: reading it folds pending steps in) equals the reference's."""
    ids = np.asarray(live, dtype=np.int64)
    for name in ARRAY_SIGNALS + ("awaited",):
        got, want = getattr(log, name)(ids), getattr(ref, name)(ids)
        assert same(got, want), (name, ids[got != want][:5], got[got != want][:5], want[got != want][:5])
    never = ReferenceAccessLog(ref.window_steps, ref.default_cs, ref.half_life_turns, ref.lfu_half_life_turns)
    never.now, never.turns = ref.now, ref.turns
    for name in ARRAY_SIGNALS:  # a removed block reads as a block never read
        assert same(getattr(log, name)(freed), getattr(never, name)(freed)), name
    for name in ("now", "turns", "heat_miss", "recency_miss", "steps_in_window", "active_chats",
                 "heat_predicts_better", "window_steps", "default_cs"):
        assert getattr(log, name) == getattr(ref, name), name
    assert log.chats.keys() == ref.chats.keys()
    for owner, chat in ref.chats.items():
        mine = log.chats[owner]
        assert mine.tables is chat.tables or mine.tables == chat.tables
        assert (mine.cost_sensitivity, mine.last_step, mine.num_steps, mine.turn_announced) == \
               (chat.cost_sensitivity, chat.last_step, chat.num_steps, chat.turn_announced)
        assert same(np.float64(mine.heat_key), np.float64(chat.heat_key))
    for owner in owners:
        assert log.chat_ali(owner) == ref.chat_ali(owner)


class Trace:
    """Random steps of a few chats on one log and its reference, the same calls to both."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        rng = self.rng
        settings = (rng.choice([1, 2, 3, 5, 8, 30]), rng.choice([0.5, 0.2, 0.0, 1.0]),
                    rng.choice([0.5, 1.0, 16.0]), rng.choice([0.25, 1.0, 3.0, 16.0]))
        self.log, self.ref = AccessLog(*settings), ReferenceAccessLog(*settings)
        self.num_chats = rng.randint(1, 5)
        self.next_id = 0
        self.arrays: dict[int, np.ndarray] = {}  # each chat's latest array (the object both logs got)
        self.tables: dict[int, list] = {}
        self.cs = {owner: rng.choice([None, 0.1, 0.5, 0.9]) for owner in range(self.num_chats)}
        self.live: set[int] = set()
        self.reserved: list[int] = []  # allocated, not read yet
        self.freed: list[int] = []
        self.seen = {"max_steps": 0, "shared": 0, "gap": 0}

    def new_ids(self, count: int) -> list[int]:
        """Fresh block ids; some allocated earlier and first read only now (below ids read already)."""
        if self.reserved and self.rng.random() < 0.5:
            ids, self.reserved = self.reserved[:count], self.reserved[count:]
            return ids
        extra = count if self.rng.random() < 0.3 else 0
        ids = list(range(self.next_id, self.next_id + count + extra))
        self.next_id += count + extra
        self.live.update(ids)
        self.reserved += ids[:extra]
        return ids[extra:]

    def both(self, method: str, *args, **kwargs) -> None:
        getattr(self.log, method)(*args, **kwargs)
        getattr(self.ref, method)(*args, **kwargs)

    def step(self, owner: int, decoding: bool = False) -> None:
        rng = self.rng
        old = self.arrays.get(owner)
        kinds = ["same", "equal", "grow", "iterable", "share", "fresh", "crop"]
        if old is None:
            kind = rng.choice(["fresh", "share"])
        else:
            kind = "same" if decoding and rng.random() < 0.9 else rng.choices(kinds, [50, 4, 8, 3, 3, 2, 2])[0]
        if kind == "same":
            ids = old
        elif kind == "equal":
            ids = old.copy()
        elif kind == "grow":
            ids = np.concatenate((old, np.asarray(self.new_ids(rng.randint(1, 3)), dtype=np.int64)))
        elif kind == "iterable":
            ids = rng.choice([list, set, iter, tuple])(old.tolist())
        elif kind == "crop":
            ids = old[:rng.randint(0, len(old))].copy()
        else:  # a new chat's ids, from scratch or sharing another chat's prefix
            donors = [a for o, a in self.arrays.items() if o != owner and len(a)]
            prefix = donors[rng.randrange(len(donors))][:rng.randint(1, 6)].tolist() if kind == "share" and donors \
                else []
            ids = np.asarray(prefix + self.new_ids(rng.randint(0, 12)), dtype=np.int64)
        if isinstance(ids, np.ndarray):
            self.arrays[owner] = ids  # (an iterable of the old array's ids: the reference gets the old array)
        if rng.random() < 0.3:
            self.tables[owner] = [list(self.arrays[owner])]
        if rng.random() < 0.05:
            self.cs[owner] = rng.choice([None, 0.1, 0.5, 0.9])
        tables = self.tables.get(owner) if rng.random() < 0.7 else None
        new_turn = not decoding and rng.random() < 0.06
        self.log.record_step(owner, ids, tables, self.cs[owner], new_turn)
        self.ref.record_step(owner, ids if isinstance(ids, np.ndarray) else self.arrays[owner], tables,
                             self.cs[owner], new_turn)

    def free(self) -> None:
        """The store removes some blocks: no chat holds them any more (each holder's next array lacks them)."""
        rng = self.rng
        if not self.live:
            return
        gone = set(rng.sample(sorted(self.live), rng.randint(1, min(6, len(self.live)))))
        self.reserved = [b for b in self.reserved if b not in gone]
        for owner, array in list(self.arrays.items()):
            if gone & set(array.tolist()):
                self.arrays[owner] = np.asarray([b for b in array.tolist() if b not in gone], dtype=np.int64)
        self.live -= gone
        self.freed += sorted(gone)
        if rng.random() < 0.5:
            self.log.forget_blocks(sorted(gone))
        else:
            for block_id in gone:
                self.log.forget_block(block_id)

    def op(self) -> None:
        rng = self.rng
        owner = rng.randrange(self.num_chats)
        what = rng.choices(["step", "burst", "announce", "forget_chat", "free", "read"], [60, 10, 3, 2, 5, 4])[0]
        if what == "step":
            self.step(owner)
        elif what == "burst":  # one chat decodes a while (its run grows long)
            for _ in range(rng.randint(2, 3 * self.log.window_steps + 2)):
                self.step(owner, decoding=True)
        elif what == "announce":
            ids = self.arrays.get(owner, np.zeros(0, dtype=np.int64))
            self.both("announce_turn", owner, ids[:rng.randint(0, len(ids))].tolist())
        elif what == "forget_chat":
            self.both("forget_chat", owner)
            self.arrays.pop(owner, None)
        elif what == "free":
            self.free()
        else:  # a policy reads signals now (folds pending runs in), on the log itself
            self.log.ali(sorted(self.live)[:rng.randint(0, len(self.live))])
        for lane in self.log._lanes.values():
            self.seen["max_steps"] = max(self.seen["max_steps"], lane.steps)
            self.seen["shared"] += bool(len(lane.eager_rows))
            self.seen["gap"] += lane.gap

    def check(self) -> None:
        live = sorted(self.live) + [self.next_id, self.next_id + 7]  # (and ids never seen)
        check_equal(copy.deepcopy(self.log), self.ref, live, self.freed, range(self.num_chats + 1))


@pytest.mark.parametrize("seed", range(40))
def test_lazy_runs_read_exactly_as_eager_recording(seed):
    trace = Trace(seed)
    for _ in range(150):
        trace.op()
        trace.check()
    check_equal(trace.log, trace.ref, sorted(trace.live), trace.freed, range(trace.num_chats + 1))
    assert trace.log.num_rows <= 1024


def test_the_traces_exercise_long_runs_shared_blocks_and_gaps():
    seen = {"max_steps": 0, "shared": 0, "gap": 0}
    for seed in range(40):
        trace = Trace(seed)
        for _ in range(150):
            trace.op()
        for key in seen:
            seen[key] = max(seen[key], trace.seen[key]) if key == "max_steps" else seen[key] + trace.seen[key]
    assert seen["max_steps"] >= 20 and seen["shared"] > 0 and seen["gap"] > 0, seen


def test_long_runs_count_reads_exactly_across_powers_of_two():
    """A long run's reads add 1 each, rounding where the count crosses a power of two (1 + 5 ulp plus
    7 is 8 read by read, 8 + 1 ulp at once): blocks with many read histories, runs of many lengths."""
    rng = random.Random(7)
    log, ref = AccessLog(1000, 0.5, 16.0, 3.0), ReferenceAccessLog(1000, 0.5, 16.0, 3.0)
    blocks = list(range(300))
    for _ in range(40):
        ids = np.asarray(sorted(rng.sample(blocks, rng.randint(1, 300))), dtype=np.int64)
        for step in range(rng.choice([1, 2, 5, 9, 40, 130])):
            log.record_step(1, ids, new_turn=step == 0)
            ref.record_step(1, ids, new_turn=step == 0)
        assert same(log.num_reads(blocks), ref.num_reads(blocks))


def test_add_ones_rounds_as_repeated_adds():
    rng = np.random.default_rng(0)
    ulp = 2.0 ** -52
    assert add_ones(np.array([1 + 5 * ulp]), 7)[0] == 8.0 != (1 + 5 * ulp) + 7
    values = np.concatenate((1 + ulp * np.arange(64), 2 + 2 * ulp * np.arange(64), 3 - ulp * np.arange(1, 64),
                             rng.random(200) * 3, rng.random(100) * 1e-3, [0.0, 0.5, 1.0, 1.5, 2.0 - 2 ** -52, 3.0],
                             2.0 ** rng.integers(0, 60, 100) * (1 + rng.random(100)),
                             [2.0 ** 53 - 1, 2.0 ** 53, 2.0 ** 53 + 2, 2.0 ** 54 + 4, 2.0 ** 60],
                             np.exp2(rng.random(200) * 20)))
    for count in (0, 1, 2, 3, 5, 7, 8, 13, 30, 100, 1000, 5000):
        want = values.copy()
        for _ in range(count):
            want = want + 1.0
        assert same(add_ones(values, count), want), count


def test_a_repeated_step_is_recorded_without_touching_the_rows():
    log = AccessLog(window_steps=100)
    ids = np.arange(4000, dtype=np.int64)
    log.record_step(1, ids, new_turn=True)
    before = {name: getattr(log._rows, name).copy() for name in ("last_read", "num_reads", "window_reads", "cs")}
    for _ in range(50):
        log.record_step(1, ids)
    assert all(same(getattr(log._rows, name), array) for name, array in before.items())  # pending, in O(1)
    assert log.last_read_step(ids[:2]).tolist() == [50, 50] and log.window_reads(ids[:1]).tolist() == [51]
    assert log.num_reads(ids[-1:]).tolist() == [51.0]


def test_rows_map_ids_to_rows_like_a_dict():
    """Ids in any order, removed, read again (a row anew), many times over: the sorted map with its
    tombstones agrees with a dict, rows are never shared, and the arrays stay near the live count."""
    rng = random.Random(3)
    rows, model, next_id = BlockRows(0.5, 10, 16.0), {}, 0
    for _ in range(3000):
        if rng.random() < 0.5 or not model:
            fresh = list(range(next_id, next_id + rng.randint(1, 40)))
            next_id += len(fresh)
            again = rng.sample(sorted(set(range(next_id)) - set(model)), min(3, next_id - len(model)))
            ids = np.asarray(rng.sample(fresh, len(fresh)) + again, dtype=np.int64)  # (not sorted)
            got = rows.rows_for(ids)
            for block_id, row in zip(ids.tolist(), got.tolist()):
                assert model.setdefault(block_id, row) == row
        else:
            gone = rng.sample(sorted(model), rng.randint(1, len(model)))
            if rng.random() < 0.5:
                rows.forget(np.asarray(gone + [next_id + 5], dtype=np.int64))
            else:
                for block_id in gone + [next_id + 5]:
                    rows.forget_one(block_id)
            for block_id in gone:
                del model[block_id]
        assert len(set(model.values())) == len(model) == rows.num_live
        probe = np.asarray(sorted(model) + [next_id, next_id + 1], dtype=np.int64)
        assert rows.find(probe).tolist() == [model[b] for b in sorted(model)] + [-1, -1]
        assert (rows.block_id[list(model.values())] == list(model)).all() if model else True
    assert rows.capacity <= 2 * max(MIN_ROWS, rows.num_live) and len(rows._keys) <= 8 * MIN_ROWS
