"""HotCompaction: where the hot blocks lie (contiguity, fragmentation) and compaction plans.

A component of the TierStore; its callers hold the store lock. The policy itself is
scheduler/compaction.py (ids only); this side gathers its inputs from the index, the access log
(each live chat's block tables in token order), the pins and the hot pool, and caches what it found.
The mover carries its plans out like any other background move (transfers.py).

Cheap when nothing changed (the mover asks every interval, whatever the number of chats): the
rows (each live chat's hot blocks in token order, and their slots) are kept, and laid out again
only for the chats whose rows may have changed: a chat that began a step (its tables grew), a
chat any of whose table's blocks changed hot placement (a move committed, a crop or release
freeing it: `BlockIndex.take_hot_changes`; a shared block names every chat that holds it), or all
of them after a layout event (a bank taking up blocks it did not allocate: attach, deepcopy, a
prefix lookup).
Only rows not in one run of slots are looked at to decide there is nothing to do; the policy runs
only when a sequence needs repair, its chat is not busy stepping, and the last plan that found
nothing (`_Stuck`) does not cover what is there now.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ..blocks import HOT
from ..scheduler import Plan
from ..scheduler.compaction import (MAX_OPEN_DEPTH, NO_BLOCK, RESERVED, RowLayout, chat_contiguity, fragmentation,
                                   needs_repair, plan_compaction)

# a chat that began a step less than max(BUSY_S, BUSY_STEPS x its last step interval) ago, capped
# at BUSY_MAX_S, is not compacted: its next step would cancel the moves
BUSY_S, BUSY_STEPS, BUSY_MAX_S = 0.05, 3, 2.0


class HotCompaction:
    def __init__(self, state, access_log, settings) -> None:
        self.state = state
        self.index = state.index
        self.access_log = access_log
        self.settings = settings  # SchedulerConfig: max_fragmentation, min_contiguity
        self._layout_events = 0
        # rows of every live chat, laid out again only for the chats that stepped since (or all
        # of them once a block changed tier or slot, a layout event happened or a chat came or went)
        self._rows_key = None
        self._owners_of: dict[int, set[int]] = {}  # block -> the chats whose tables named it when laid out
        self._rows_by_owner: dict[int, list[RowLayout]] = {}
        self._broken: dict[tuple[int, int], RowLayout] = {}  # rows not in one run of slots
        # chats to lay out again -> their rows' (table, tiers, slots) from their step, or None (read the index)
        self._stepped: dict[int, list | None] = {}
        self._busy_until_s: dict[int, float] = {}  # until when each chat counts as busy
        self._step_started_s: dict[int, float] = {}  # when each chat last began a step
        self._stuck: _Stuck | None = None  # what nothing could be repaired with (see plan)
        self._repairing: tuple[int, int] | None = None  # the sequence compaction works on
        self._repair_moves: dict[tuple[int, int], int] = {}  # moves spent on each unfinished repair
        self._given_up: dict[tuple[int, int], int] = {}  # sequence -> free hot slots when given up

    def note_layout_change(self, owner: int | None = None) -> None:
        """A hot block landed somewhere its sequence may not continue (see the module docstring):
        for `owner`'s step (only that chat's rows are laid out again), or anywhere."""
        if owner is None:
            self._layout_events += 1
        elif owner in self.access_log.chats:  # (a new chat's first step is laid out by note_step)
            self._stepped[owner] = None

    def note_step(self, owner: int, placed: list | None = None) -> None:
        """The chat began a step (its tables may have grown): its rows are laid out again (from
        `placed`, each row's (table, tiers, slots) as the step found them, when given and no
        block changed place since), and it is not compacted until it has been quiet a while
        (see BUSY_S)."""
        self._stepped[owner] = (placed, self.index.placement_version) if placed is not None else None
        now = time.monotonic()
        interval = now - self._step_started_s.get(owner, now)
        self._step_started_s[owner] = now
        interval = interval if interval < BUSY_MAX_S else 0.0  # a turn began after a pause
        self._busy_until_s[owner] = now + min(BUSY_MAX_S, max(BUSY_S, BUSY_STEPS * interval))

    def forget(self, owner: int) -> None:
        """The chat is gone (store.forget_chat): its rows are no layout to keep."""
        for row in self._rows_by_owner.pop(owner, ()):
            self._broken.pop(row.key, None)
        self._stepped.pop(owner, None)
        self._step_started_s.pop(owner, None)
        self._busy_until_s.pop(owner, None)

    @property
    def _pool(self):
        return self.state.pools[HOT]

    def _layout_key(self) -> tuple:
        return self._layout_events

    def _refresh(self) -> None:
        """Bring the rows up to date: O(rows of the chats that stepped) unless a block moved."""
        key = self._layout_key()
        if key != self._rows_key:
            self._rows_key = key
            self._rows_by_owner.clear()
            self._broken.clear()
            self._stepped.clear()
            live = self.access_log.chats
            self._step_started_s = {o: t for o, t in self._step_started_s.items() if o in live}
            self._busy_until_s = {o: t for o, t in self._busy_until_s.items() if o in live}
            self._owners_of.clear()
            self.index.take_hot_changes()
            for owner in live:
                self._lay_out(owner)
            return
        stepped, self._stepped = self._stepped, {}
        changed = self.index.take_hot_changes()  # moves, and crops or releases freeing a row's tail
        if changed is None:  # too many to have kept: every row
            self._rows_key = None
            return self._refresh()
        owners_of, index = self._owners_of, self.index
        for block_id in changed:
            for owner in owners_of.get(block_id, ()):
                stepped[owner] = None  # its step's placements are out of date
            if block_id not in index:
                owners_of.pop(block_id, None)
        if len(owners_of) > 2 * len(index) + 1024:  # entries of chats gone: start afresh
            self._rows_key = None
            return self._refresh()
        for owner, placed in stepped.items():
            self._lay_out(owner, placed)

    def _lay_out(self, owner: int, placed: tuple | None = None) -> None:
        owners_of = self._owners_of
        for row in self._rows_by_owner.pop(owner, ()):
            self._broken.pop(row.key, None)
        chat = self.access_log.chats.get(owner)
        if chat is None:
            return
        index, rows = self.index, []
        if placed is not None:  # a step's placements, good while no block changed place since
            placed = placed[0] if placed[1] == index.placement_version else None
        for r, table in enumerate(chat.tables):
            for block_id in table:
                owners = owners_of.get(block_id)
                if owners is None:
                    owners_of[block_id] = {owner}
                elif owner not in owners:
                    owners.add(owner)
            if placed is not None and r < len(placed) and placed[r][0] is table:
                _, tiers, slots = placed[r]
                hot = tiers == HOT
                if hot.all():
                    block_ids, slots = table, slots.tolist()
                else:
                    block_ids, slots = np.asarray(table, dtype=np.int64)[hot].tolist(), slots[hot].tolist()
            else:
                block_ids, slots = [], []
                for block_id in table:
                    if block_id in index:  # a table recorded before a crop may name freed blocks
                        entry = index.get(block_id)
                        if entry.tier == HOT:
                            block_ids.append(block_id)
                            slots.append(entry.slot)
            row = RowLayout(owner, r, tuple(block_ids), tuple(slots))
            rows.append(row)
            if row.longest_run() < row.num_blocks:
                self._broken[row.key] = row
        self._rows_by_owner[owner] = rows

    def _row_layouts(self) -> list[RowLayout]:
        """Every live chat's rows: their hot blocks in token order and slots."""
        self._refresh()
        return [row for rows in self._rows_by_owner.values() for row in rows]

    def hot_fragmentation(self) -> float:
        """1 - largest free run / free slots of the hot pool (0.0 when no slot is free)."""
        pool = self._pool
        return fragmentation(pool.num_free, pool.largest_free_run())

    def contiguity(self, tables: list[list[int]]) -> float:
        """One chat's contiguity: the share of its rows' hot blocks that lie in each row's longest
        run of consecutive slots, in token order (1.0 when it has no hot block)."""
        rows = []
        for table in tables:
            tiers, slots = self.state.placements(table)
            hot = tiers == HOT
            rows.append(RowLayout(-1, len(rows), tuple(table[i] for i in hot.nonzero()[0].tolist()),
                                  tuple(slots[hot].tolist())))
        value = chat_contiguity(rows)
        return 1.0 if value is None else value

    def layout_stats(self) -> dict:
        """fragmentation of the hot pool; contiguity (mean over live chats with hot blocks, 1.0
        when none) and contiguity_min."""
        by_chat: dict[int, list[RowLayout]] = {}
        for row in self._row_layouts():
            by_chat.setdefault(row.owner, []).append(row)
        values = [v for v in map(chat_contiguity, by_chat.values()) if v is not None]
        return {"fragmentation": self.hot_fragmentation(),
                "contiguity": sum(values) / len(values) if values else 1.0,
                "contiguity_min": min(values, default=1.0)}

    def plan(self, max_moves: int, spend: bool = True) -> Plan | None:
        """Moves within the hot tier, each to a free slot, toward every live chat's hot blocks
        in consecutive slots in token order (scheduler/compaction.py); None when nothing needs
        or can get repair now. For the mover, which calls it whenever it has nothing else to do
        (`spend` False: only asking, the moves are not made; a chat that is busy counts too).

        Cheap when nothing changed (the mover asks every interval): O(rows of the chats that
        stepped) while no block moved, and O(rows not in one run) to find that none of them can
        be repaired now. A chat that is busy stepping (see BUSY_S) is left alone. A sequence
        whose repair has taken more moves than `_repair_budget` without making it contiguous is
        given up (so compaction can never churn forever) until the hot pool has more free slots
        than then, or the set of chats changes."""
        pool = self._pool
        if not pool.num_slots:
            return None
        self._refresh()
        if not self._broken:
            self._repair_moves.clear()
            self._given_up.clear()
            return None
        self._forget_repairs(pool.num_free)
        pool_fragmentation = fragmentation(pool.num_free, pool.largest_free_run())
        settings, now = self.settings, time.monotonic()
        self._busy_until_s = {o: until for o, until in self._busy_until_s.items() if now < until}
        busy = set(self._busy_until_s) if spend else set()
        needy = [row for row in self._broken.values() if row.key not in self._given_up and row.owner not in busy
                 and needs_repair(row, pool_fragmentation, settings.max_fragmentation, settings.min_contiguity)]
        if not needy:
            return None
        pinned = self.state.pinned_now()
        # nothing can be repaired when last time found nothing with the same layout and given-up
        # sequences, and no other rows in need, no slot freed since, no fewer pins or busy chats
        stuck = _Stuck(self._rows_key, frozenset(self._given_up), frozenset(needy), pool.occupancy(),
                       frozenset(pinned), frozenset(busy))
        if self._stuck is not None and self._stuck.covers(stuck):
            return None
        rows = self._row_layouts()
        fixed = pinned | {b for row in rows if row.owner in busy for b in row.block_ids}
        result = plan_compaction(
            self._hot_block_at(), rows, fixed, self._shared_hot_blocks(rows),
            pool_fragmentation=pool_fragmentation, max_fragmentation=settings.max_fragmentation,
            min_contiguity=settings.min_contiguity, max_moves=max_moves, prefer=self._repairing,
            skip=frozenset(self._given_up) | {row.key for row in self._broken.values() if row.owner in busy})
        self._repairing = result.repairing
        if not result.moves:
            if not result.waiting:
                self._stuck = stuck
            return None
        self._stuck = None
        if spend:
            spent = self._repair_moves.get(result.repairing, 0) + len(result.moves)
            self._repair_moves[result.repairing] = spent
            if spent > self._repair_budget(rows):
                self._given_up[result.repairing] = pool.num_free
                self._repairing = None
        return Plan(moves=result.moves)

    def pending(self) -> bool:
        """The mover would find compaction work now, or once the chats that are busy go quiet."""
        return self.plan(1, spend=False) is not None

    @staticmethod
    def _repair_budget(rows: list[RowLayout]) -> int:
        """Moves one repair may take: the sequence twice over, and the longest one moved aside
        for it at each level it may open room (see scheduler/compaction.py)."""
        return (2 + MAX_OPEN_DEPTH) * max(row.num_blocks for row in rows)

    def _forget_repairs(self, num_free: int) -> None:
        """Sequences now contiguous start afresh; given-up ones get another chance once the pool
        has more free slots than when they were given up (or they are gone)."""
        live = self._broken
        self._repair_moves = {key: n for key, n in self._repair_moves.items() if key in live}
        self._given_up = {key: free for key, free in self._given_up.items() if key in live and num_free <= free}

    def _hot_block_at(self) -> list[int]:
        """The block in each hot slot: NO_BLOCK when free, RESERVED when the pool holds it for
        no block of the index (a corrupt block's quarantined slot, a copy's reservation)."""
        block_at = [NO_BLOCK if not used else RESERVED for used in self._pool.occupancy()]
        index = self.index
        for block_id in index.recency(HOT):
            block_at[index.get(block_id).slot] = block_id
        return block_at

    def _shared_hot_blocks(self, rows: list[RowLayout]) -> set[int]:
        """Hot blocks of live sequences that more than one bank table holds."""
        index = self.index
        return {b for row in rows for b in row.block_ids if b in index and index.get(b).ref_count > 1}


@dataclass(frozen=True)
class _Stuck:
    """What a compaction plan that found nothing to do saw."""

    layout_key: object
    given_up: frozenset
    needy: frozenset  # the rows in need of repair (their blocks and slots)
    in_use: bytes  # the hot pool's occupancy
    pinned: frozenset
    busy: frozenset  # chats left alone while they step

    def covers(self, now: "_Stuck") -> bool:
        """`now` can repair nothing either: no other row in need, no slot free that was in use
        then (blocks may have come in, none left), no block that may move that was fixed then."""
        if not (now.layout_key == self.layout_key and now.given_up == self.given_up and now.needy <= self.needy
                and now.pinned >= self.pinned and now.busy >= self.busy and len(now.in_use) == len(self.in_use)):
            return False
        then_used = np.frombuffer(self.in_use, dtype=np.uint8)
        return not np.any(then_used > np.frombuffer(now.in_use, dtype=np.uint8))
