"""Placement policies: each one's value of a block (higher = keep), and the victim order they give.
Ids only, no torch.

Every policy answers one question, `values(ids)`: what each block is worth keeping where it is, read
from the BlockIndex (tiers, arrival steps) and the AccessLog (reads, heat, cost sensitivity); a
policy may add a second key, `tiebreak(ids)`, for blocks of equal value (None: recency order).

  lru   the last store step that read it or brought it into its tier
  fifo  the store step it entered its current tier
  lfu   how many store steps read it, each read halved every `lfu_half_life_turns` store turns
  turns the turn heat of the hottest chat that read it (access_log.py: each chat's turns, each
        decaying by half every `half_life_turns` turns of the store: LRFU in turns), blocks read
        in the last quarter of the ALI window above any heat, while heat has predicted the next
        speaker better than recency; else lru's value. The other key breaks ties (recency under
        heat, heat under recency). Config `policy: ali` names it too (its former name)

plus a cost-sensitivity bonus of `cs_weight * CS` (in the policy's own unit: `* ali_window` for
the step-valued ones), so a high-CS chat's blocks go last and a low-CS chat's first.

`VictimOrder` turns a policy into the order victims are taken in: least valuable first, ties in
least-recently-used order, and above every value the blocks of a chat whose turn was announced
(prefetch, attach) and has not read them yet, under every policy.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from ..config import POLICY_ALIASES
from .index_view import IndexView

_IN_USE = 1e9  # added to the heat of blocks a chat is using now
_AWAITED = 1e15  # added to the value of blocks an announced turn awaits (above any other value)
_NEVER_READ = -1e9  # the heat value of a block no turn touched yet (below any real one; exact + CS bonus)


class Policy(Protocol):
    """What a placement policy tells the scheduler about blocks (arrays aligned with `ids`)."""

    def values(self, ids: np.ndarray) -> np.ndarray:
        """Each block's value: higher is kept longer."""

    def tiebreak(self, ids: np.ndarray) -> np.ndarray | None:
        """A second key for blocks of equal value (higher is kept longer); None: recency order."""


class _PolicyBase:
    """The signals every policy reads: the index (where blocks are, since when), the access log
    and the weight of a block's cost sensitivity."""

    def __init__(self, index: IndexView, log, cs_weight: float, attention_weight: float = 0.0):
        self.index, self.log, self.cs_weight, self.attention_weight = index, log, cs_weight, attention_weight

    def _recency(self, ids: np.ndarray) -> np.ndarray:
        """The last store step that read each block or brought it into its tier."""
        return np.maximum(self.log.last_read_step(ids), np.asarray(self.index.arrival_steps(ids), dtype=np.int64))

    def _with_cs(self, base: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """`base` plus the CS bonus in store steps (`cs_weight * ali_window * CS`) and the attention
        bonus (`attention_weight * ali_window * mass`, mass the block's share of its chat's attention)."""
        values = base + self.cs_weight * self.log.window_steps * self.log.cost_sensitivity(ids)
        if self.attention_weight:
            values = values + self.attention_weight * self.log.window_steps * self.log.attention_mass(ids)
        return values

    def tiebreak(self, ids: np.ndarray) -> np.ndarray | None:
        return None


class Lru(_PolicyBase):
    """Least recently used first."""

    def values(self, ids: np.ndarray) -> np.ndarray:
        return self._with_cs(self._recency(ids), ids)


class Fifo(_PolicyBase):
    """Longest in its tier first."""

    def values(self, ids: np.ndarray) -> np.ndarray:
        return self._with_cs(np.asarray(self.index.arrival_steps(ids), dtype=np.int64), ids)


class Lfu(_PolicyBase):
    """Least read first, each read halved every `lfu_half_life_turns` turns of the store."""

    def values(self, ids: np.ndarray) -> np.ndarray:
        return self._with_cs(self.log.num_reads(ids), ids)


class TurnHeat(_PolicyBase):
    """The coldest chat first (`turns`): the turn heat of the hottest chat that read each block while
    heat has predicted the next speaker better than recency lately, else recency; the other key
    breaks ties."""

    def values(self, ids: np.ndarray) -> np.ndarray:
        if self.log.heat_predicts_better:
            values = self._heat(ids) + self.cs_weight * self.log.cost_sensitivity(ids)
            if self.attention_weight:
                values = values + self.attention_weight * self.log.attention_mass(ids)
            return values
        return self._with_cs(self._recency(ids), ids)  # while recency predicts turns better: LRU, ties by heat

    def tiebreak(self, ids: np.ndarray) -> np.ndarray:
        """Heat under recency and recency under heat."""
        if self.log.heat_predicts_better:
            return self._recency(ids)
        return self._heat(ids)

    def _heat(self, ids: np.ndarray) -> np.ndarray:
        """Turn heat, and above every heat the blocks a chat is using now: read within the last
        quarter of the ALI window, or within two rounds of the chats stepping now when more of
        them take turns (each then steps once per round): a chat mid-turn keeps its blocks
        whatever its heat."""
        log = self.log
        heat = log.heat(ids)
        heat = np.where(np.isfinite(heat), heat, _NEVER_READ)
        span = max(1, log.window_steps // 4, 2 * log.active_chats)
        last = log.last_read_step(ids)
        in_use = (last >= 0) & (last >= log.now - span)
        return np.where(in_use, heat + _IN_USE, heat)


POLICIES: dict[str, type[_PolicyBase]] = {"lru": Lru, "lfu": Lfu, "fifo": Fifo, "turns": TurnHeat}


def policy_for(name: str, index: IndexView, log, cs_weight: float, attention_weight: float = 0.0) -> Policy:
    """The policy called `name` (a SchedulerConfig's `policy`, or a former name of one) over this
    index and log."""
    return POLICIES[POLICY_ALIASES.get(name, name)](index, log, cs_weight, attention_weight)


class VictimOrder:
    """Blocks in the order a policy gives them up: least valuable first; ties by the policy's
    second key, then least recently used first; the blocks an announced turn awaits last."""

    def __init__(self, policy: Policy, index: IndexView, log):
        self.policy, self.index, self.log = policy, index, log

    def of(self, ids: np.ndarray) -> np.ndarray:
        """Each block's value (primary key; `order` breaks its ties by the policy's `tiebreak`); the
        blocks an announced turn awaits above all others."""
        value = self.policy.values(ids)
        return np.where(self.log.awaited(ids), value + _AWAITED, value)

    def _sorted(self, ids: np.ndarray) -> list[int]:
        second = self.policy.tiebreak(ids)
        if second is None:
            return ids[np.argsort(self.of(ids), kind="stable")].tolist()
        return ids[np.lexsort((second, self.of(ids)))].tolist()  # (lexsort is stable: recency order last)

    def order(self, tier: int) -> list[int]:
        """Blocks of `tier`, least valuable first (ties: least recently used first)."""
        ids = np.fromiter(self.index.recency(tier), dtype=np.int64, count=self.index.count_in(tier))
        if not len(ids):
            return []
        return self._sorted(ids)

    def unreferenced_order(self, tier: int) -> list[int]:
        """The blocks of `tier` no chat holds (droppable), least valuable first."""
        ids = np.fromiter(self.index.unreferenced(tier), dtype=np.int64)
        if not len(ids):
            return []
        return self._sorted(ids)
