"""Token-to-slot mapping for staged steps: where a step's tokens live, and one layer's K/V read
and written there through each tier's own token index.

A prepared step (bank/plan.py) addresses blocks on the device slab with index tensors; a step
whose blocks it cannot address so (some in cold, in compressed or records-layout warm, a sliding
group's gap, several layer groups) maps its tokens once, on first use, into `TierRun`s, one per
tier holding some of them; every layer then reads and writes through those runs, without the
store lock. The mapping stays valid for the whole step because the step's blocks are pinned (no
other thread may move them until its lease ends), and every move into them completed before the
lease was handed out.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..blocks import COLD, DROPPED, HOT, TIER_NAMES, WARM
from ..errors import CorruptBlockError
from ..metrics.registry import Metrics

MAX_SPANS_PER_TIER = 8  # a tier's tokens in more ranges than this are gathered as one run (index_copy_)


def raise_if_corrupt(block_tiers: np.ndarray, labels: np.ndarray, what: str) -> None:
    """CorruptBlockError naming the corrupt ones (their `labels`) when any block holds no data."""
    bad = block_tiers == DROPPED
    if bad.any():
        raise CorruptBlockError(f"{what} {sorted(set(labels[bad].tolist()))} failed their checksum and must be "
                                "recomputed")


@dataclass
class TierRun:
    """Tokens of one request that live in one tier: the tier's own index and where they go."""

    tier: int
    index: object  # the tier's token_index
    positions: torch.Tensor | None  # positions within the request; None = all of them, in order
    span: tuple[int, int] | None = None  # (first, end) when `positions` is that one consecutive range


class TokenMapper:
    """Builds TierRuns from block placements and moves one layer's K/V through them."""

    def __init__(self, tiers: list, layout, device: torch.device, dtype: torch.dtype, metrics: Metrics | None = None):
        self.tiers = tiers
        self.metrics = metrics if metrics is not None else Metrics(enabled=False)
        self.layout = layout
        self.device = device
        self.dtype = dtype

    def map_range(self, tiers: np.ndarray, slots: np.ndarray, start_token: int, end_token: int) -> list[TierRun]:
        """Runs for tokens [start_token, end_token) of a sequence whose blocks lie at
        (`tiers[i]`, `slots[i]`), built per block with numpy, not per token."""
        bs = self.layout.block_size
        first, last = start_token // bs, (end_token - 1) // bs
        block_tiers, block_slots = tiers[first:last + 1], slots[first:last + 1]
        raise_if_corrupt(block_tiers, np.arange(first, last + 1), "blocks at positions")
        lo, hi = start_token - first * bs, end_token - first * bs
        if (block_tiers == HOT).all() and (len(block_slots) == 1 or (np.diff(block_slots) == 1).all()):
            base = int(block_slots[0]) * bs  # consecutive hot slots: one slice of the slab
            return [TierRun(HOT, slice(base + lo, base + hi), None)]
        num_blocks = len(block_tiers)
        return self.group_by_tier(
            np.repeat(block_tiers, bs)[lo:hi],
            np.repeat(block_slots, bs)[lo:hi],
            np.tile(np.arange(bs, dtype=np.int64), num_blocks)[lo:hi],
        )

    def group_by_tier(self, token_tiers: np.ndarray, slots: np.ndarray, offsets: np.ndarray) -> list[TierRun]:
        """One TierRun per tier holding some of the tokens (positions None when one tier holds all);
        a tier whose tokens form a few ranges of consecutive positions (hot holding a chat's newest
        blocks and some of its first ones, say) gets one run per range, each read straight into
        its place in the step's buffer instead of gathered and index-copied."""
        if (token_tiers == token_tiers[0]).all():
            tier = int(token_tiers[0])
            return [TierRun(tier, self.tiers[tier].token_index(slots, offsets), None)]
        runs = []
        for tier in (HOT, WARM, COLD):
            picked = np.nonzero(token_tiers == tier)[0]
            if not len(picked):
                continue
            bounds = [0, *(np.flatnonzero(np.diff(picked) != 1) + 1).tolist(), len(picked)]
            ranges = list(zip(bounds[:-1], bounds[1:])) if len(bounds) <= MAX_SPANS_PER_TIER + 1 else [(0, len(picked))]
            for a, b in ranges:
                part = picked[a:b]
                index = self.tiers[tier].token_index(slots[part], offsets[part])
                first, end = int(part[0]), int(part[-1]) + 1
                span = (first, end) if end - first == len(part) else None
                runs.append(TierRun(tier, index, torch.from_numpy(part).to(self.device), span))
        return runs

    def read_layer(self, layer: int, runs: list[TierRun], num_tokens: int, out: torch.Tensor | None = None
                   ) -> torch.Tensor:
        """`[2, H, num_tokens, D]` on the compute device: one layer's K/V of the mapped tokens, in
        `out` when given (a buffer the caller reuses) and the tokens lie in more than one run."""
        if len(runs) == 1 and runs[0].positions is None:
            return self.read_run(layer, runs[0])
        shape = (2, self.layout.num_kv_heads, num_tokens, self.layout.head_dim)
        if out is None or tuple(out.shape) != shape or out.dtype != self.dtype or out.device != self.device:
            out = torch.empty(shape, dtype=self.dtype, device=self.device)
        for run in runs:
            if run.span is not None:  # read (decoded) straight into its place: no temporary
                self._read_tokens(run.tier, layer, run.index, out[:, :, run.span[0]:run.span[1]])
            else:
                data = self._read_tokens(run.tier, layer, run.index)
                out.index_copy_(2, run.positions, data.to(self.device, non_blocking=True))
        return out

    def read_run(self, layer: int, run: TierRun) -> torch.Tensor:
        """One run's `[2, H, n, D]` on the compute device (a view for a hot slice)."""
        data = self._read_tokens(run.tier, layer, run.index)
        return data if run.tier == HOT else data.to(self.device, non_blocking=True)

    def _read_tokens(self, tier: int, layer: int, index, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """The tokens of `index` (`[2, H, n, D]`; a view for hot), or None once read into `out`."""
        start = None
        if tier != HOT:
            start = self.metrics.read_seconds.start()
        try:
            if out is None:
                data = self.tiers[tier].read_tokens(layer, index)
            else:
                data = self.tiers[tier].read_tokens_into(layer, index, out)
        except CorruptBlockError as error:
            error.tier = tier  # with error.slot: the store finds the block and marks it
            raise
        if start is not None:  # a timed read of a lower tier
            self.metrics.read_seconds.stop((TIER_NAMES[tier],), start)
        return data

    def write_layer(self, layer: int, runs: list[TierRun], kv: torch.Tensor) -> None:
        """Store `kv` (`[2, H, t, D]`) for the mapped tokens of one layer, wherever they live."""
        for run in runs:
            if run.positions is None:
                part = kv
            elif run.span is not None:
                part = kv[:, :, run.span[0]:run.span[1]]
            else:
                part = kv.index_select(2, run.positions)
            self.tiers[run.tier].write_tokens(layer, run.index, part)
