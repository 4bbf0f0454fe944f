"""Placement: the moves a caller asks for by name — promote, prefetch, demote, undo a failed step's
moves, check cold blocks against their checksums.

Each is a plan remade every round from the store as it is (demand.py); the caller waits for its
own copies, never for the lock. A block whose copy fails stays where it was and is not planned
again in that call; a block found corrupt on the way is never served (returned to the caller).
"""

from __future__ import annotations

import time

import numpy as np

from ..blocks import COLD
from ..scheduler import MemScheduler, Move, Plan
from ..scheduler.access_log import AccessLog
from ..scheduler.arrays import as_ids, contains_mask
from .allocation import pseudo_owner
from .compaction import HotCompaction
from .copies import BACKUP
from .demand import DemandMoves, DemandResult
from .life import StoreLife
from .lock import StoreLock
from .mover import Mover
from .state import StoreState

WAIT_FOR_LANDING_S = 30.0  # how long a promotion waits for blocks a background move has in flight


class Placement:
    def __init__(self, lock: StoreLock, life: StoreLife, state: StoreState, scheduler: MemScheduler,
                 access_log: AccessLog, compaction: HotCompaction, demand: DemandMoves, mover: Mover | None):
        self.lock, self.life, self.state = lock, life, state
        self.scheduler, self.access_log, self.compaction = scheduler, access_log, compaction
        self.demand = demand
        self.mover = mover  # None: scheduler.background is off
        self.attention_shares: dict[str, float] = {}  # share of the sampled attention mass each tier served (latest)

    def record_attention(self, block_ids, masses, decay: float, tier_shares: dict[str, float]) -> None:
        """A sampled step's attention mass per block (bank/attention_stats.py), for the policies'
        `attention_weight`; `tier_shares` is where that mass lay (the metrics' gauge)."""
        with self.lock:
            self.access_log.record_attention(block_ids, masses, decay)
            self.attention_shares = dict(tier_shares)

    def promote(self, block_ids: list[int], owner: int | None = None) -> list[int]:
        """Bring blocks up (hot first), now: the caller waits. Returns ids found corrupt on the
        way. `owner`'s pending background prefetch is taken over: blocks it has in flight are
        waited for, the rest planned here."""
        mover = self.mover
        with self.lock:
            self.life.check_open()
            if owner is not None:  # its turn is coming: the policy counts it now (access_log.py)
                self.access_log.announce_turn(owner, block_ids)
                if mover is not None:
                    mover.drop_requests(owner)
        ids = as_ids(block_ids)
        self._wait_for_flights(ids)
        corrupt = self.bring_up(ids, self.state.is_pinned).corrupt
        if mover is not None and owner is not None:
            with self.lock:  # its step comes next: no optional move takes them down before it
                mover.expect(owner, block_ids)
        return corrupt

    def bring_up(self, block_ids: np.ndarray, leave_alone, result: DemandResult | None = None) -> DemandResult:
        """Promote `block_ids` (hot first) in rounds, now, leaving alone the blocks `leave_alone`
        names (blocks gone from the index meanwhile: the planner leaves them out)."""
        state = self.state

        def make_plan(result: DemandResult) -> Plan:
            return self.scheduler.plan_promotion(_without(block_ids, result.failed_blocks), state.index,
                                                 state.free_slots(), state.capacities, leave_alone)

        return self.demand.carry_out(make_plan, leave_alone, result)

    def _wait_for_flights(self, block_ids: np.ndarray) -> None:
        """Until none of `block_ids` is in flight (charged to the caller as promote seconds)."""
        changes = self.state.changes
        start_s = time.perf_counter()
        deadline = time.monotonic() + WAIT_FOR_LANDING_S
        waited = False
        while True:
            version = changes.version
            with self.lock:
                in_flight = self.state.in_flight  # (a backup does not move its block: no wait for it)
                if not in_flight or not any(in_flight[b].kind != BACKUP for b in
                                            block_ids[in_flight.contains_mask(block_ids.tolist())].tolist()):
                    break
            waited = True
            if not changes.wait(version, deadline - time.monotonic()):
                break  # they are still where their entries say: the promotion plans around them
        if waited:
            self.demand.charge_wait("promote", time.perf_counter() - start_s)

    def prefetch(self, owner: int, block_ids: list[int], deadline_s: float | None = None) -> None:
        """Bring `owner`'s blocks up in the background (most wanted first) and return at once,
        giving up `deadline_s` from now; without a mover (scheduler.background false), promote
        them now (all of them)."""
        with self.lock:
            self.life.check_open()
            self.access_log.announce_turn(owner, block_ids)  # its user is typing: the turn counts now
            if self.mover is not None:
                deadline = None if deadline_s is None else time.monotonic() + deadline_s
                self.mover.request_prefetch(owner, block_ids, deadline)
                return
        self.promote(block_ids, owner)

    def demote(self, block_ids: list[int], dst_tier: int) -> list[int]:
        """Move blocks down to `dst_tier` (WARM or COLD) as far as room allows (a move whose copy
        fails leaves its block where it was). Returns the ids found corrupt on the way."""
        state, targets = self.state, as_ids(block_ids)

        def make_plan(result: DemandResult) -> Plan:
            return self.scheduler.plan_demotion(_without(targets, result.failed_blocks), dst_tier, state.index,
                                                state.free_slots(), state.capacities, state.is_pinned)

        return self.demand.carry_out(make_plan, state.is_pinned).corrupt

    def undo_moves(self, moves: list[Move]) -> None:
        """Put blocks back where they were before `moves` (newest first), as far as each block is
        still where the move left it, unpinned, and its old tier has room."""
        state = self.state
        undone: set[int] = set()

        def make_plan(result: DemandResult) -> Plan:
            undone.update(result.committed.block_ids().tolist())
            back, free, tier_now = [], state.free_slots(), {}
            for move in reversed(moves):
                b = move.block_id
                if b in undone or b in result.failed_blocks or b not in state.index or state.is_pinned(b):
                    continue
                tier = tier_now.get(b, state.index.get(b).tier)
                if tier != move.dst_tier or free[move.src_tier] == 0:
                    continue
                back.append(Move(b, move.dst_tier, move.src_tier))
                tier_now[b] = move.src_tier
                free[move.src_tier] -= 1
                free[move.dst_tier] += 1
            return Plan(moves=back)

        self.demand.carry_out(make_plan, state.is_pinned)

    def verify(self, block_ids: list[int]) -> list[int]:
        """Check the cold blocks among `block_ids` against their checksums (the one tier whose bytes
        can rot outside this process), reading outside the lock. Failing ones are marked corrupt
        and returned."""
        state = self.state
        owner = pseudo_owner()
        with self.lock:
            cold = state.tiers[COLD]
            if cold is None or self.life.is_closing:
                return []
            by_slot = {}
            for block_id in block_ids:
                entry = state.index.get(block_id)
                if entry.tier == COLD and block_id not in state.in_flight:
                    by_slot[entry.slot] = block_id
            if not by_slot:
                return []
            state.pin(owner, set(by_slot.values()))
        bad: list[int] = []
        try:
            bad = [by_slot[slot] for slot in cold.verify(list(by_slot))]
        finally:
            with self.lock:
                state.unpin(owner)
                for block_id in bad:
                    if block_id in state.index:
                        state.mark_corrupt(block_id)
        return bad

    def wait_for_background(self, timeout_s: float) -> bool:
        """Until the mover has no request, no batch in flight and no compaction to do (False: not in time)."""
        mover = self.mover
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                if mover is None or self.life.is_closing or (not mover.pending_requests and not mover.busy
                                                             and not self.compaction.pending()):
                    return True
                mover.wake()
            time.sleep(0.005)
        return False


def _without(block_ids: np.ndarray, failed: set[int]) -> np.ndarray:
    """`block_ids` less the ones in `failed` (blocks whose move failed this call), in order."""
    if not failed:
        return block_ids
    return block_ids[~contains_mask(failed, block_ids.tolist())]
