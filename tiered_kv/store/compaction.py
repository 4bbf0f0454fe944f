"""HotCompaction: where the hot blocks lie (contiguity, fragmentation) and compaction plans.

A component of the TierStore; its callers hold the store lock. The policy itself is
scheduler/compaction.py (ids only); this side gathers its inputs from the index, the access log
(each live chat's block tables in token order), the pins and the hot pool, and caches what it found.
The mover carries its plans out like any other background move (transfers.py).

Cheap when nothing changed: the mover asks for a compaction plan whenever it is idle (after
every step). Contiguity can only break when a block changes tier or slot (`placement_version`),
when a hot block is allocated anywhere but right after its predecessor, when a bank takes up
blocks it did not allocate (attach, deepcopy), or when the set of chats changes; the store
counts the middle two as layout events. While none of these happened since every chat was
found contiguous, `plan_compaction` returns at once; likewise while neither they nor the running
steps' pins changed since a plan found nothing it could repair.
"""

from __future__ import annotations

from ..blocks import HOT
from ..scheduler import Plan
from ..scheduler.compaction import (MAX_OPEN_DEPTH, NO_BLOCK, RESERVED, RowLayout, chat_contiguity, fragmentation,
                                   plan_compaction)


class HotCompaction:
    def __init__(self, state, access_log, settings) -> None:
        self.state = state
        self.index = state.index
        self.access_log = access_log
        self.settings = settings  # SchedulerConfig: max_fragmentation, min_contiguity
        self._layout_events = 0
        self._layout_rows: tuple[object, list[RowLayout]] | None = None  # (key, rows) cache
        self._contiguous_key = None  # layout key when every live sequence was found contiguous
        self._stuck_key = None  # (layout key, pins) when nothing could be repaired
        self._repairing: tuple[int, int] | None = None  # the sequence compaction works on
        self._repair_moves: dict[tuple[int, int], int] = {}  # moves spent on each unfinished repair
        self._given_up: dict[tuple[int, int], int] = {}  # sequence -> free hot slots when given up

    def note_layout_change(self) -> None:
        """A hot block landed somewhere its sequence may not continue (see the module docstring)."""
        self._layout_events += 1

    @property
    def _pool(self):
        return self.state.pools[HOT]

    def _layout_key(self) -> tuple:
        return self.index.placement_version, self._layout_events, tuple(self.access_log.chats)

    def _row_layouts(self) -> list[RowLayout]:
        """Every live chat's rows: their hot blocks in token order and slots (cached)."""
        key = (self._layout_key(), self._pool.version)
        if self._layout_rows is not None and self._layout_rows[0] == key:
            return self._layout_rows[1]
        index, rows = self.index, []
        for owner, chat in self.access_log.chats.items():
            for r, table in enumerate(chat.tables):
                block_ids, slots = [], []
                for block_id in table:
                    if block_id in index:  # a table recorded before a crop may name freed blocks
                        entry = index.get(block_id)
                        if entry.tier == HOT:
                            block_ids.append(block_id)
                            slots.append(entry.slot)
                rows.append(RowLayout(owner, r, tuple(block_ids), tuple(slots)))
        self._layout_rows = (key, rows)
        return rows

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
        (`spend` False: only asking, the moves are not made).

        A sequence whose repair has taken more moves than `_repair_budget` without making it
        contiguous is given up (so compaction can never churn forever) until the hot pool has
        more free slots than then, or the set of chats changes."""
        pool = self._pool
        if not pool.num_slots:
            return None
        layout_key = self._layout_key()
        if layout_key == self._contiguous_key:
            return None
        stuck_key = (layout_key, self.state.pins_key(), tuple(self._given_up))
        if stuck_key == self._stuck_key:
            return None
        rows = self._row_layouts()
        if all(row.longest_run() == row.num_blocks for row in rows):
            self._contiguous_key = layout_key
            self._repair_moves.clear()
            self._given_up.clear()
            return None
        self._forget_repairs(rows, pool.num_free)
        result = plan_compaction(
            self._hot_block_at(), rows, self.state.pinned_now(), self._shared_hot_blocks(rows),
            pool_fragmentation=fragmentation(pool.num_free, pool.largest_free_run()),
            max_fragmentation=self.settings.max_fragmentation, min_contiguity=self.settings.min_contiguity,
            max_moves=max_moves, prefer=self._repairing, skip=frozenset(self._given_up))
        self._repairing = result.repairing
        if not result.moves:
            if not result.waiting:
                self._stuck_key = stuck_key
            return None
        if spend:
            spent = self._repair_moves.get(result.repairing, 0) + len(result.moves)
            self._repair_moves[result.repairing] = spent
            if spent > self._repair_budget(rows):
                self._given_up[result.repairing] = pool.num_free
                self._repairing = None
        return Plan(moves=result.moves)

    def pending(self) -> bool:
        """The mover would find compaction work now."""
        return self.plan(1, spend=False) is not None

    @staticmethod
    def _repair_budget(rows: list[RowLayout]) -> int:
        """Moves one repair may take: the sequence twice over, and the longest one moved aside
        for it at each level it may open room (see scheduler/compaction.py)."""
        return (2 + MAX_OPEN_DEPTH) * max(row.num_blocks for row in rows)

    def _forget_repairs(self, rows: list[RowLayout], num_free: int) -> None:
        """Sequences now contiguous start afresh; given-up ones get another chance once the pool
        has more free slots than when they were given up (or they are gone)."""
        live = {row.key for row in rows if row.longest_run() < row.num_blocks}
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
        return {b for row in rows for b in row.block_ids if index.get(b).ref_count > 1}
