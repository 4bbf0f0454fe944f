"""What each layer's attention reads in a hooked step, planned once per step: view, gather,
stream or the paged kernel.

With hooks installed, `CacheBank.update` writes the new K/V into their blocks through the step's
lease and leaves a per-layer `LayerReads` handle in the model's kwargs; the attention function
(attention.py) asks it for the layer's K/V. `StepReads` decides, when the step opens:

- view: one row whose tokens sit in consecutive hot slots: a zero-copy view of the hot slab;
- paged (merge mode, one new token per row, blocks in tiers a kernel reads in place: hot, and warm
  when page-locked on CUDA): the native paged decode kernel reads every block where it lies. Such
  a step fetches nothing ahead; should its mask not qualify, its layers are gathered instead;
- split (merge mode, one row, at most SPLIT_MAX_NEW_TOKENS new tokens): each large run of the
  row's blocks in consecutive slots of a paged slab on the compute device (hot; warm on a CPU
  store) read as a view, the rest gathered, the partial attentions merged by log-sum-exp;
- otherwise the history is gathered into one of two stream buffers the bank reuses (layer i uses
  buffer i % 2), the new tokens copied from the model's own K/V. When some of it is below hot,
  layer i+2's history is fetched into its buffer by the store's stream worker as soon as layer
  i's attention is done with it, so lower-tier reads overlap the layers in between.
Every read goes through the lease (store/leases.py): the step's blocks are pinned and read
without the store's lock; nothing here touches a slab.
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch

from ..blocks import COLD, HOT

# merge mode splits decode-sized steps only: a prefill's many queries make the one gather of
# the exact path cheap beside its compute, and its partial scores (q x keys each) large
SPLIT_MAX_NEW_TOKENS = 16
MAX_VIEW_PARTS = 8  # views of one split step (each one more partial attention to merge)
SMALL_VIEW_TOKENS = 64  # a shorter segment is cheaper copied into the gathered part than attended apart
CPU_STREAMING = "auto"  # "auto" | "on" | "off": fetch a layer ahead in a thread on CPU (bench switch)


def streaming_pays(device: torch.device) -> bool:
    """Whether fetching a layer ahead in the worker overlaps anything. On CUDA the copies run on
    a side stream beside the compute: always. On CPU only with a core that the model's own
    intra-op threads leave free: on 2 cores with torch on 2 threads the worker's copies slowed
    25%-hot decode from 0.62x to 0.45x of all-hot (bench/hooks.py), so there the history is
    gathered in the model's thread, with the same straight-into-the-buffer copies."""
    if device.type == "cuda" or CPU_STREAMING == "on":
        return True
    if CPU_STREAMING == "off":
        return False
    return torch.get_num_threads() < (os.cpu_count() or 1)


class StreamBuffers:
    """Two flat device buffers reused by every step of one bank; they only grow."""

    def __init__(self, device: torch.device, dtype: torch.dtype):
        self.device, self.dtype = device, dtype
        self._flat: list[torch.Tensor | None] = [None, None]
        self.num_allocations = 0

    def get(self, index: int, shape: tuple[int, ...]) -> torch.Tensor:
        numel = math.prod(shape)
        flat = self._flat[index]
        if flat is None or flat.numel() < numel:
            grown = numel if flat is None else max(numel, flat.numel() + flat.numel() // 4)
            flat = self._flat[index] = torch.empty(grown, dtype=self.dtype, device=self.device)
            self.num_allocations += 1
        return flat[:numel].view(shape)

    @property
    def num_bytes(self) -> int:
        return sum(f.numel() * f.element_size() for f in self._flat if f is not None)


class StepReads:
    """Per hooked step: the read plan, and the fetches in flight."""

    def __init__(self, lease, mode: str, buffers: StreamBuffers, counts: dict, num_layers: int, worker, layout,
                 paged_kernels):
        self.lease, self.mode, self.buffers, self.counts = lease, mode, buffers, counts
        self.num_layers = num_layers
        self._worker = worker  # a callable returning the store's stream worker (started on first use)
        self._paged_kernels = paged_kernels  # the native ops when this machine runs them, else None
        rows = lease.rows
        self.num_rows = len(rows)
        self.num_tokens = lease.num_tokens
        self.num_history = lease.num_tokens - lease.num_new_tokens
        self._heads, self._dim, self._block_size = layout.num_kv_heads, layout.head_dim, layout.block_size
        runs = rows[0].read_runs
        self.is_view = self.num_rows == 1 and len(runs) == 1 and runs[0].tier == HOT and runs[0].positions is None
        self._split = None
        self._paged = None  # None: not tried yet; False: not this step; else the kernel's tables
        self.streams = False
        self._fetches: dict[int, object] = {}
        if self.is_view:
            return
        self.paged_candidate = self._paged_candidate()
        if mode == "merge" and self.num_rows == 1 and lease.num_new_tokens <= SPLIT_MAX_NEW_TOKENS:
            self._split = self._merge_split()
        if self._split is not None:
            self._lower_views = sum(run.tier != HOT for run, _ in self._split[0])
            self._buffer_shape = (2, 1, self._heads, sum(count for _, count, _ in self._split[1]), self._dim)
        else:
            # per row: its history as segments of one tier, each copied straight into its slice
            self._history = [lease.segments(r, 0, self.num_history) if self.num_history else []
                             for r in range(self.num_rows)]
            self._buffer_shape = (2, self.num_rows, self._heads, self.num_tokens, self._dim)
        # the paged kernel reads blocks in place: nothing is fetched ahead for a step it may serve
        self.streams = not self.paged_candidate and streaming_pays(lease.device) and \
            any(run.tier != HOT for run in self._gathered_runs())
        for index in range(2):
            buffers.get(index, self._buffer_shape)  # grown here, never while a fetch runs
        if self.streams:
            for layer in range(min(2, self.num_layers)):
                self._start_fetch(layer)

    def _paged_candidate(self) -> bool:
        """merge mode, one new token per row, native kernels, every block in a tier a kernel reads in place."""
        lease = self.lease
        if self.mode != "merge" or lease.num_new_tokens != 1 or self._paged_kernels is None:
            return False
        readable = len(lease.kernel_views(0))  # tiers 0..readable-1 can be read in place
        return all((row.tiers[:self._needed_blocks()] < readable).all() and (row.tiers >= 0).all()
                   for row in lease.rows)

    def _needed_blocks(self) -> int:
        return -(-self.num_tokens // self._block_size)

    # ---- what attention asks for -----------------------------------------------------------
    def full_kv(self, layer: int, key_new: torch.Tensor, value_new: torch.Tensor):
        """`(K, V)`, each `[B, H, T, D]`, of this layer: a view, or a stream buffer."""
        if self.is_view:
            self.counts["layers_view"] += 1
            kv = self.lease.read_layer(layer, 0)
            return kv[0].unsqueeze(0), kv[1].unsqueeze(0)
        buffer = self._filled_buffer(layer)
        buffer[0, :, :, self.num_history:].copy_(key_new)
        buffer[1, :, :, self.num_history:].copy_(value_new)
        return buffer[0], buffer[1]

    def parts(self, layer: int):
        """merge mode: `[(K, V, key positions)]` per part, or None when the step is not split:
        each run that is one slice of a paged slab (hot; warm on a CPU store) as a view of it,
        and the rest gathered into a stream buffer."""
        if self._split is None:
            return None
        views, gathered = self._split
        counts = self.counts
        counts["layers_merged"] += 1
        counts["lower_runs_in_place"] += self._lower_views
        parts = [(kv[0].unsqueeze(0), kv[1].unsqueeze(0), positions)  # views of the slabs
                 for kv, (_, positions) in zip(self.lease.read_views(layer, [run for run, _ in views]), views)]
        if gathered:
            buffer = self._filled_buffer(layer)
            parts.append((buffer[0], buffer[1], torch.cat([p for _, _, p in gathered])))
        return parts

    def paged_decode(self, layer: int, query: torch.Tensor, attention_mask, scale: float):
        """The paged decode kernel over every block where it lies: `(out [B, Hq, D], lse)`, or
        None when this step does not qualify (see the module docstring)."""
        if self._paged is None:
            self._paged = (self.paged_candidate and self._paged_tables(attention_mask, query.device)) or False
        if self._paged is False:
            return None
        self.counts["layers_paged"] += 1
        table, tags, starts, lens = self._paged
        sources = self.lease.kernel_views(layer)
        return self._paged_kernels.paged_decode(query, sources, table, tags, starts, lens, scale)

    def _paged_tables(self, attention_mask, device):
        # tags are the kernel's source indices, a tier's position in lease.kernel_views: HOT 0, WARM 1
        needed = self._needed_blocks()
        rows = self.lease.rows
        table = torch.zeros((len(rows), needed), dtype=torch.int32)
        tags = torch.zeros((len(rows), needed), dtype=torch.int8)
        for r, row in enumerate(rows):
            tiers, slots = row.tiers[:needed], row.slots[:needed]
            if len(tiers) < needed or (tiers >= COLD).any() or (tiers < 0).any():
                return None
            table[r] = torch.from_numpy(slots.astype("int32"))
            tags[r] = torch.from_numpy(tiers.astype("int8"))
        starts = torch.zeros(len(rows), dtype=torch.int32)
        if attention_mask is not None:
            mask = attention_mask[:, 0, -1, -self.num_tokens:]
            mask = mask if mask.dtype == torch.bool else mask == 0
            first = mask.int().argmax(dim=1)
            runs = mask.sum(dim=1)
            if not bool(((self.num_tokens - first) == runs).all()):
                return None  # not one left-padding run per row
            starts = first.to(torch.int32).cpu()
        lens = torch.full((len(rows),), self.num_tokens, dtype=torch.int32)
        return table.to(device), tags.to(device), starts.to(device), lens.to(device)

    def done(self, layer: int) -> None:
        """Layer `layer`'s attention no longer needs its buffer: fetch layer + 2 into it."""
        if self.streams and layer + 2 < self.num_layers:
            self._start_fetch(layer + 2)

    def finish(self) -> None:
        """Wait for every fetch still in flight (before the step's lease may end)."""
        for future in list(self._fetches.values()):
            try:
                ready = future.result()
            except BaseException:  # noqa: BLE001 - the step is ending either way; the error was raised to it
                continue
            # on CUDA a fetch nobody read may still be writing its buffer on the worker's stream: the
            # compute stream (which reuses the buffer next) and the step's end fence come after it
            self._worker().wait_ready(ready)
        self._fetches.clear()

    # ---- filling buffers ---------------------------------------------------------------------
    def _filled_buffer(self, layer: int) -> torch.Tensor:
        buffer = self.buffers.get(layer % 2, self._buffer_shape)
        self.counts["layers_streamed" if self.streams else "layers_gathered"] += 1
        if self.streams:
            future = self._fetches.pop(layer)
            ready = future.result()  # re-raises a failed read (a corrupt block) here
            self._worker().wait_ready(ready)
        else:
            self._fill(layer, buffer)
        return buffer

    def _start_fetch(self, layer: int) -> None:
        buffer = self.buffers.get(layer % 2, self._buffer_shape)
        self._fetches[layer] = self._worker().submit(self._fill, layer, buffer)

    def _fill(self, layer: int, buffer: torch.Tensor) -> None:
        """Gather the layer's history (or, split, its non-view tokens) into `buffer`."""
        if self._split is not None:  # packed one after another, in the order of their positions
            items, start = [], 0
            for run, count, _ in self._split[1]:
                items.append((run, buffer[:, 0, :, start:start + count], None))
                start += count
        else:
            items = [(run, buffer[:, r, :, first:first + count], None)
                     for r, segments in enumerate(self._history) for run, first, count in segments]
        self.lease.read_into(layer, items)

    def _merge_split(self):
        """([(view run, positions)], [(run, count, positions)] to gather) when attention can be
        split. The row's blocks fall into runs of consecutive slots of one tier; each such run in
        a paged slab on the compute device (hot; warm on a CPU store) can be read as a view. The
        largest become views (at most MAX_VIEW_PARTS); the other tokens are gathered, one run
        per tier, into the buffer. A fetch ahead (the stream worker) could run before a layer
        wrote its new tokens: then every new token must lie in a view (else None: the exact path
        serves the step). When the model's thread gathers at attention time instead, runs
        shorter than SMALL_VIEW_TOKENS (all but the largest) are gathered too, new tokens
        included: one copy beats one more partial attention."""
        lease, bs = self.lease, self._block_size
        row, num_tokens, num_history = lease.rows[0], self.num_tokens, self.num_history
        num_blocks = -(-num_tokens // bs)
        tiers, slots = row.tiers[:num_blocks], row.slots[:num_blocks]
        if len(tiers) < num_blocks or (tiers < 0).any():
            return None  # (a corrupt block: the exact path raises for it)
        in_thread = not streaming_pays(lease.device)
        bounds = [0, *(np.flatnonzero((np.diff(tiers) != 0) | (np.diff(slots) != 1)) + 1).tolist(), num_blocks]
        in_place = {tier: lease.reads_in_place(tier) for tier in set(tiers.tolist())}
        runs = [(min(b1 * bs, num_tokens) - b0 * bs, b0 * bs, min(b1 * bs, num_tokens))
                for b0, b1 in zip(bounds[:-1], bounds[1:]) if in_place[int(tiers[b0])]]
        if not runs:
            return None
        runs.sort(reverse=True)  # largest first
        must = [] if in_thread else [r for r in runs if r[2] > num_history]
        views = must + [r for r in runs if r not in must][:max(0, MAX_VIEW_PARTS - len(must))]
        if in_thread:
            views = views[:1] + [r for r in views[1:] if r[0] >= SMALL_VIEW_TOKENS]
        if len(views) > MAX_VIEW_PARTS:
            return None
        token_tiers = np.repeat(tiers, bs)[:num_tokens]
        token_slots = np.repeat(slots, bs)[:num_tokens]
        offsets = np.tile(np.arange(bs, dtype=np.int64), num_blocks)[:num_tokens]
        rest = np.ones(num_tokens, dtype=bool)
        view_parts = []
        for _, lo, hi in sorted(views, key=lambda r: r[1]):
            rest[lo:hi] = False
            run = lease.run_of(int(token_tiers[lo]), token_slots[lo:hi], offsets[lo:hi])
            view_parts.append((run, torch.arange(lo, hi, device=lease.device)))
        if not in_thread and rest[num_history:].any():
            return None
        gathered = []
        for tier in np.unique(token_tiers[rest]).tolist():
            picked = np.flatnonzero(rest & (token_tiers == tier))
            gathered.append((lease.run_of(tier, token_slots[picked], offsets[picked]), len(picked),
                             torch.from_numpy(picked).to(lease.device)))
        return view_parts, gathered

    def _gathered_runs(self) -> list:
        """Every run this step gathers into a buffer."""
        if self._split is not None:
            return [run for run, _, _ in self._split[1]]
        return [run for segments in self._history for run, _, _ in segments]


class LayerReads:
    """The handle one layer's attention gets (kwargs[LAYER_KEY]); see StepReads. `bank` provides
    `_rolled_back_on_error()` (a context that rolls its step back on any error) and
    `_layer_attended(layer)` (the layer's attention is done)."""

    __slots__ = ("_step_reads", "_bank", "layer", "_key", "_value", "num_tokens")

    def __init__(self, step_reads: StepReads, bank, layer: int, key_new, value_new):
        self._step_reads, self._bank, self.layer = step_reads, bank, layer
        self._key, self._value = key_new, value_new
        self.num_tokens = step_reads.num_tokens

    @property
    def is_view(self) -> bool:
        """The layer's K/V is one zero-copy view of consecutive hot slots (nothing to gather)."""
        return self._step_reads.is_view

    def full_kv(self):
        with self._bank._rolled_back_on_error():
            return self._step_reads.full_kv(self.layer, self._key, self._value)

    def parts(self):
        with self._bank._rolled_back_on_error():
            return self._step_reads.parts(self.layer)

    def paged_decode(self, query, attention_mask, scale):
        with self._bank._rolled_back_on_error():
            return self._step_reads.paged_decode(self.layer, query, attention_mask, scale)

    def done(self) -> None:
        self._step_reads.done(self.layer)
        self._bank._layer_attended(self.layer)


__all__ = ["StreamBuffers", "StepReads", "LayerReads", "streaming_pays"]
