"""Sparse reads of spilled history (issue 37; config `attention.sparse`, off unless a budget is set).

Per block, layer and KV head the bank keeps a summary of the block's keys, their channel-wise
minimum and maximum (Quest), on the compute device: `KeySummaries`, written from the K the model
hands `update()` as tokens are written (every step, whatever the block's tier). For a query q the
bound sum_c max(q_c min_c, q_c max_c) is at least q.k for every key k of the block, so it ranks
blocks by the largest attention score they can hold.

A sparse step is a one-token decode step of one row, over one full-attention layer group, in the
hooks' merge mode (attention sees the query), whose blocks all have summaries and some lie below hot.
Per layer, `SparseStep.attend` ranks the chat's blocks below hot (less the always-read first
`first_blocks` and last `recent_blocks`) by the bound of their best query head and keeps the top
`budget` of them (`attention.sparse.budget`: a share of the blocks below hot, or a count). It reads
every hot block, the kept ones and the always-read ones, nothing else: when they all lie in the device
slab (hot, and paged warm on a CPU store) the choice is made on the device (top-k, then the chosen
block indices sorted: their count is known on the host beforehand, so nothing is read back) and read
by one gather of whole blocks per layer; else through the lease's token runs (host I/O: positions on
the host);
attention is transformers' sdpa over those tokens, in position order. (Ranking hot blocks against
them, so that a budget spent on a hot block reads nothing, read 11% of the blocks below hot at a
budget of 25% and lost more: KL 0.0088 against 0.0051, SmolLM2, prose, 4k tokens, 64 positions.) A
budget that keeps every block reads every token: the same K/V in the same order as an exact step.
Prefill steps, the first step after `attach()` (its restored blocks have no summaries until a step
reads them whole), batches, several layer groups (sliding windows are read whole) and exact mode
(no hooks, or `mode="exact"`) read everything.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ..blocks import HOT
from .partial import _sees_every_key


_UNSEEN = object()


class KeySummaries:
    """Channel-wise min and max of each block's keys, per layer and KV head (module docstring)."""

    def __init__(self, num_layers: int, block_size: int):
        self.num_layers, self.block_size = num_layers, block_size
        self.low = self.high = None  # [L, capacity, H, D] float32 on the compute device
        self.valid = np.zeros(0, dtype=bool)  # per block: its summary covers every token it holds

    def reset(self) -> None:
        self.valid[:] = False

    def _ensure(self, num_blocks: int, like: torch.Tensor) -> None:
        capacity = 0 if self.low is None else self.low.shape[1]
        if num_blocks <= capacity and self.low.device == like.device:
            return
        size = max(num_blocks, 2 * capacity, 16)
        shape = (self.num_layers, size, like.shape[1], like.shape[3])
        low = torch.zeros(shape, dtype=torch.float32, device=like.device)
        high = torch.zeros(shape, dtype=torch.float32, device=like.device)
        if self.low is not None and self.low.device == like.device:
            low[:, :capacity], high[:, :capacity] = self.low, self.high
        self.low, self.high = low, high
        valid = np.zeros(size, dtype=bool)
        valid[:len(self.valid)] = self.valid
        self.valid = valid

    def write(self, layer: int, start: int, keys: torch.Tensor) -> None:
        """The new tokens' keys `[1, H, t, D]` at positions [start, start + t) of the row (a block
        they begin is summarised afresh, one they continue widened); `committed` says when the
        step that wrote them stands."""
        bs, count = self.block_size, keys.shape[2]
        end = start + count
        first, last = start // bs, (end - 1) // bs
        if layer == 0 or self.low is None:
            self._ensure(last + 1, keys)
        low, high = self.low[layer], self.high[layer]
        k = keys[0].float().transpose(0, 1)  # [t, H, D]
        head = min(end, (first + 1) * bs) - start  # the new tokens in the first block
        part_low, part_high = k[:head].amin(dim=0), k[:head].amax(dim=0)
        if start % bs:  # the block had tokens before these: widen its summary
            torch.minimum(low[first], part_low, out=low[first])
            torch.maximum(high[first], part_high, out=high[first])
        else:
            low[first], high[first] = part_low, part_high
        if last > first:  # the blocks after the first, the last possibly partial
            rest = k[head:]
            whole = (rest.shape[0] // bs) * bs
            if whole:
                blocks = rest[:whole].unflatten(0, (whole // bs, bs))
                low[first + 1:first + 1 + whole // bs] = blocks.amin(dim=1)
                high[first + 1:first + 1 + whole // bs] = blocks.amax(dim=1)
            if whole < rest.shape[0]:
                low[last], high[last] = rest[whole:].amin(dim=0), rest[whole:].amax(dim=0)

    def committed(self, start: int, end: int, whole: bool) -> None:
        """A step that wrote tokens [start, end) (`whole`: and summarised every block from the whole
        row's keys) committed: the blocks it began, and with `whole` every one, are summarised.
        (A step rolled back leaves wider summaries at worst: still bounds.)"""
        if end <= start and not whole:
            return
        bs = self.block_size
        first, last = start // bs, (max(end, 1) - 1) // bs
        if len(self.valid) <= last:
            return  # (never written: nothing summarised)
        if whole:
            self.valid[:last + 1] = True
            return
        self.valid[first + 1:last + 1] = True
        if start % bs == 0:
            self.valid[first] = True

    def forget(self, positions) -> None:
        """These blocks' summaries no longer describe the row's blocks there."""
        positions = [p for p in positions if p < len(self.valid)]
        self.valid[positions] = False

    def complete(self, num_blocks: int) -> bool:
        """Whether blocks [0, num_blocks) all have summaries."""
        return num_blocks <= len(self.valid) and bool(self.valid[:num_blocks].all())


class SparseStep:
    """One sparse decode step: its row's blocks and what it read (module docstring)."""

    def __init__(self, summaries: KeySummaries, sparse_config, mapper, row, report: dict, probe=None, slab=None):
        self.summaries, self.config, self.mapper, self.report = summaries, sparse_config, mapper, report
        self.probe = probe  # a sampled step's (attention_stats.py): it sees the tokens read
        tiers, self.slots = np.asarray(row.tiers), np.asarray(row.slots)
        self.num_blocks, self.num_tokens = len(tiers), row.num_tokens
        # every block on the device slab (hot, and paged warm on a CPU): one gather of whole blocks per
        # layer; else (cold, compressed or records-layout warm) through the lease's token runs
        self.slab_block_positions = slab.block_positions(tiers, self.slots, row.num_tokens) \
            if slab is not None else None
        self.device_slab = slab if self.slab_block_positions is not None else None  # (None: some block is off it)
        forced = np.zeros(len(tiers), dtype=bool)
        forced[:sparse_config.first_blocks] = True
        forced[max(0, len(tiers) - sparse_config.recent_blocks):] = True
        self.forced, self.tiers = forced, tiers
        self.hot = tiers == HOT
        self.candidates = np.flatnonzero(~forced & ~self.hot)  # the blocks below hot ranked by their bound
        self.below_hot = int((~self.hot).sum())
        self.keep = sparse_config.blocks(self.below_hot)
        self.reads_all = self.keep >= len(self.candidates)  # (a budget of every block below hot)
        self.fixed = np.flatnonzero(forced | self.hot)  # read whatever the ranking says
        # what a ranked layer reads, known before it ranks: no value of the ranking goes to the host
        self.num_read = len(self.fixed) + min(self.keep, len(self.candidates))
        self.read_below_hot = int((forced & ~self.hot).sum()) + min(self.keep, len(self.candidates))
        self.tail_fixed = bool(len(tiers)) and (forced[-1] or self.hot[-1])
        self._device: dict | None = None  # the step's index tensors, on the query's device (_indices)
        self._mask_checked, self._mask_visible = _UNSEEN, True
        report["steps"] += 1

    def selected(self, layer: int, query: torch.Tensor) -> np.ndarray:
        """The blocks this layer reads, in position order."""
        if self.reads_all:
            return np.arange(self.num_blocks)
        top = torch.topk(self.scores(layer, query), self.keep).indices.cpu().numpy()
        chosen = self.forced | self.hot
        chosen[self.candidates[top]] = True
        return np.flatnonzero(chosen)

    def _indices(self, device: torch.device) -> dict:
        """The step's block indices as tensors on `device`, made once: fixed, candidates, slab slots."""
        if self._device is None or self._device["fixed"].device != device:
            as_tensor = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
            self._device = {"fixed": as_tensor(self.fixed), "candidates": as_tensor(self.candidates),
                            "slots": as_tensor(self.slab_block_positions)
                            if self.slab_block_positions is not None else None}
        return self._device

    def scores(self, layer: int, query: torch.Tensor) -> torch.Tensor:
        """Per candidate block, the bound on its best query head's score (higher: read first)."""
        candidates = self._indices(query.device)["candidates"]
        low = self.summaries.low[layer].index_select(0, candidates).transpose(0, 1)  # [H, c, D]
        high = self.summaries.high[layer].index_select(0, candidates).transpose(0, 1)
        q = query[0, :, -1, :].float().view(low.shape[0], -1, low.shape[2]).transpose(1, 2)  # [H, D, g]
        # sum_c max(q_c lo_c, q_c hi_c) = q+ . hi + q- . lo: two small matmuls per layer
        bound = torch.matmul(high, q.clamp(min=0)).add_(torch.matmul(low, q.clamp(max=0)))  # [H, c, g]
        return bound.amax(dim=2).amax(dim=0)

    def device_blocks(self, layer: int, query: torch.Tensor) -> torch.Tensor:
        """`selected` as a tensor on the query's device, computed there: no host sync (invariant 9)."""
        indices = self._indices(query.device)
        top = torch.topk(self.scores(layer, query), min(self.keep, len(self.candidates))).indices
        return torch.cat([indices["fixed"], indices["candidates"][top]]).sort().values

    def _slab_blocks(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's K and V `[1, H, len(slots) x bs, D]` of whole blocks at slab `slots`, in order."""
        bs, flat = self.summaries.block_size, self.device_slab.flat
        heads, dim = flat.shape[1], flat.shape[3]
        by_block = flat.view(flat.shape[0], heads, -1, bs * dim)
        return (by_block[2 * layer].index_select(1, slots).view(1, heads, -1, dim),
                by_block[2 * layer + 1].index_select(1, slots).view(1, heads, -1, dim))

    def _attend_on_slab(self, module, query: torch.Tensor, layer: int, scale: float) -> torch.Tensor:
        """A ranked layer over the device slab: whole blocks gathered by device indices, position order."""
        blocks = self.device_blocks(layer, query)
        bs = self.summaries.block_size
        keys, values = self._slab_blocks(layer, self._device["slots"][blocks])
        mask, unwritten = None, self.num_blocks * bs - self.num_tokens  # the tail block's empty slots
        if unwritten and self.tail_fixed:  # the tail sorts last: cut its empty slots off
            keys, values = keys[:, :, :self.num_read * bs - unwritten], values[:, :, :self.num_read * bs - unwritten]
        elif unwritten:  # (the tail may or may not be read: mask its empty slots instead)
            positions = (blocks[:, None] * bs + torch.arange(bs, device=blocks.device)).reshape(1, 1, 1, -1)
            mask = positions < self.num_tokens
        self.report["blocks_below_hot"] += self.below_hot
        self.report["blocks_read_below_hot"] += self.read_below_hot
        if self.probe is not None:  # (a sampled layer; with the mask, its one host read of the step's layer)
            seen = keys if mask is None else keys[:, :, :int(mask.sum())]
            self.probe.observe(layer, query, seen, scale, blocks)
        return sdpa_attention_forward(module, query, keys, values, mask, scaling=scale)[0]

    def attend(self, plan, module, query: torch.Tensor, attention_mask, scale: float) -> torch.Tensor:
        layer = module.layer_idx
        if self._mask_checked is not attention_mask:  # (the step's one mask: looked at once, as partial.py does)
            self._mask_visible, self._mask_checked = _sees_every_key(attention_mask), attention_mask
        if self._mask_visible and not self.reads_all and self.device_slab is not None:
            return self._attend_on_slab(module, query, layer, scale)
        blocks = self.selected(layer, query) if self._mask_visible else np.arange(self.num_blocks)
        bs = self.summaries.block_size
        positions = (blocks[:, None] * bs + np.arange(bs)[None, :]).reshape(-1)
        positions = positions[positions < self.num_tokens]
        if self.device_slab is not None:  # whole blocks (bs x D elements each), the tail's extra cut off
            keys, values = self._slab_blocks(layer, torch.from_numpy(self.slab_block_positions[blocks]).to(query.device))
            keys, values = keys[:, :, :len(positions)], values[:, :, :len(positions)]
        else:
            token_blocks = positions // bs
            runs = self.mapper.group_by_tier(self.tiers[token_blocks], self.slots[token_blocks], positions % bs)
            with plan.guard():
                kv = plan.lease.read_runs(layer, runs, len(positions))
            keys, values = kv[0].unsqueeze(0), kv[1].unsqueeze(0)
        self.report["blocks_below_hot"] += self.below_hot
        self.report["blocks_read_below_hot"] += int((~self.hot[blocks]).sum())
        if self.probe is not None:
            self.probe.observe(layer, query, keys, scale, torch.from_numpy(blocks).to(query.device))
        mask = None if len(blocks) < self.num_blocks or attention_mask is None else attention_mask[..., :len(positions)]
        return sdpa_attention_forward(module, query, keys, values, mask, scaling=scale)[0]



__all__ = ["KeySummaries", "SparseStep"]
