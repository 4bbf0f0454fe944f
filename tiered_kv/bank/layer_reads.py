"""How a hooked step reads each layer's K/V for attention (tiered_kv.hooks), with layer streaming.

With hooks installed, `CacheBank.update` writes the new K/V into their blocks and returns at
once; the attention function then asks the step's `StepReads` (through a per-layer `LayerReads`
handle left in the model's kwargs) for the layer's K/V:
- a row whose tokens sit in consecutive hot slots: a zero-copy view of the hot slab;
- otherwise one of two stream buffers the bank owns and reuses (layer i uses buffer i % 2):
  the history is gathered into it, the new tokens are copied from the model's own K/V.
When some of the history is below hot (the chat is bigger than the hot budget), the history of
layer i+2 is fetched into its buffer by the store's stream worker (a thread; copies on a side
CUDA stream on GPU) as soon as layer i's attention is done with that buffer, so lower-tier reads
(warm copies, cold reads and their checksums) overlap the compute of the layers in between.
The two buffers are all the device memory used beyond the hot tier's budget (`stats()`).

merge mode asks for `parts()` instead: the hot run as a view, everything else gathered.
"""

from __future__ import annotations

import math
import os

import torch

from ..scheduler import HOT, WARM


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
    """Per hooked step: what each layer's attention reads, and the prefetches in flight."""

    def __init__(self, bank, step, mode: str, buffers: StreamBuffers, counts: dict):
        store = bank.store
        self.counts = counts  # the bank's per-layer tallies: view / gathered / streamed / merged
        self.store, self.step, self.mode, self.buffers = store, step, mode, buffers
        self.num_layers = bank.num_layers
        self.num_rows = len(step.read_runs)
        self.num_tokens = step.num_tokens
        self.num_history = step.num_tokens - step.num_new_tokens
        layout = store.layout
        self._heads, self._dim = layout.num_kv_heads, layout.head_dim
        runs = step.read_runs
        self.is_view = self.num_rows == 1 and len(runs[0]) == 1 and runs[0][0].tier == HOT \
            and runs[0][0].positions is None
        self._split = None
        self._paged = None
        self.streams = False
        self._fetches: dict[int, object] = {}
        if self.is_view:
            return
        if mode == "merge" and self.num_rows == 1:
            self._split = self._merge_split(step, store)
        if self._split is not None:
            self._buffer_shape = (2, 1, self._heads, sum(count for _, count, _ in self._split[1]), self._dim)
        else:
            # per row: its history as segments of one tier, each copied straight into its slice
            self._history = [store.map_segments(*step.placements[r], 0, self.num_history) if self.num_history else []
                             for r in range(self.num_rows)]
            self._buffer_shape = (2, self.num_rows, self._heads, self.num_tokens, self._dim)
        self.streams = any(run.tier != HOT for run in self._gathered_runs()) and streaming_pays(store.device)
        for index in range(2):
            buffers.get(index, self._buffer_shape)  # grown here, never while a fetch runs
        if self.streams:
            for layer in range(min(2, self.num_layers)):
                self._start_fetch(layer)

    # ---- what attention asks for -----------------------------------------------------------
    def full_kv(self, layer: int, key_new: torch.Tensor, value_new: torch.Tensor):
        """`(K, V)`, each `[B, H, T, D]`, of this layer: a view, or a stream buffer."""
        store, step = self.store, self.step
        if self.is_view:
            self.counts["layers_view"] += 1
            kv = store.read_layer(layer, step.read_runs[0], self.num_tokens)
            return kv[0].unsqueeze(0), kv[1].unsqueeze(0)
        buffer = self._filled_buffer(layer)
        buffer[0, :, :, self.num_history:].copy_(key_new)
        buffer[1, :, :, self.num_history:].copy_(value_new)
        return buffer[0], buffer[1]

    def parts(self, layer: int):
        """merge mode: `[(K, V, key positions)]` per part, or None when the step is not split:
        the hot run as a view of the slab, and the rest gathered into a stream buffer."""
        if self._split is None:
            return None
        hot_positions, gathered = self._split
        self.counts["layers_merged"] += 1
        hot_run = next(run for run in self.step.read_runs[0] if run.tier == HOT)
        kv = self.store.read_run(layer, hot_run)  # a view of the hot slab
        parts = [(kv[0].unsqueeze(0), kv[1].unsqueeze(0), hot_positions)]
        if gathered:
            buffer = self._filled_buffer(layer)
            parts.append((buffer[0], buffer[1], torch.cat([p for _, _, p in gathered])))
        return parts

    def paged_decode(self, layer: int, query: torch.Tensor, attention_mask, scale: float, kernels):
        """merge mode, one query token per row, blocks only in hot and warm: the native paged
        decode kernel reads every block where it lies (warm straight from pinned host memory
        through UVA), no gather. Returns `(out [B, Hq, D], lse)`, or None when the step does
        not qualify (cold blocks, a mask that is not one left-padding run per row)."""
        if self._paged is None:
            self._paged = self._paged_tables(attention_mask, query.device) or False
        if self._paged is False:
            return None
        self.counts["layers_paged"] += 1
        table, tags, starts, lens = self._paged
        store, bs = self.store, self.store.layout.block_size
        hot = store.tiers[HOT].slab  # [L, 2, H, S*bs, D] -> per K/V [S, H, bs, D]
        sources = [tuple(hot[layer, i].view(self._heads, -1, bs, self._dim).permute(1, 0, 2, 3) for i in (0, 1))]
        warm = store.tiers[WARM]
        if warm is not None and warm.num_slots:  # [S, L, 2, H, bs, D]; no tag 1 without it
            sources.append((warm.slab[:, layer, 0], warm.slab[:, layer, 1]))
        return kernels.paged_decode(query, sources, table, tags, starts, lens, scale)

    def _paged_tables(self, attention_mask, device):
        # tags are the kernel's source indices: HOT = 0 (the hot slab), WARM = 1 (the warm slab)
        rows = self.step.placements
        needed = -(-self.num_tokens // self.store.layout.block_size)
        table = torch.zeros((len(rows), needed), dtype=torch.int32)
        tags = torch.zeros((len(rows), needed), dtype=torch.int8)
        for r, (tiers, slots) in enumerate(rows):
            tiers, slots = tiers[:needed], slots[:needed]
            if len(tiers) < needed or (tiers > WARM).any() or (tiers < 0).any():
                return None  # cold (or missing) blocks: the gathering merge path serves them
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
        """Wait for every fetch still in flight (before the step's blocks may be released)."""
        for future in list(self._fetches.values()):
            try:
                future.result()
            except BaseException:
                pass
        self._fetches.clear()

    # ---- filling buffers ---------------------------------------------------------------------
    def _filled_buffer(self, layer: int) -> torch.Tensor:
        buffer = self.buffers.get(layer % 2, self._buffer_shape)
        self.counts["layers_streamed" if self.streams else "layers_gathered"] += 1
        if self.streams:
            future = self._fetches.pop(layer)
            ready = future.result()  # re-raises a failed read (a corrupt block) here
            self.store.stream_worker.wait_ready(ready)
        else:
            self._fill(layer, buffer)
        return buffer

    def _start_fetch(self, layer: int) -> None:
        buffer = self.buffers.get(layer % 2, self._buffer_shape)
        self._fetches[layer] = self.store.stream_worker.submit(self._fill, layer, buffer)

    def _fill(self, layer: int, buffer: torch.Tensor) -> None:
        """Gather the layer's history (or, split, its non-view tokens) into `buffer`."""
        store = self.store
        if self._split is not None:  # packed one after another, in the order of their positions
            items, start = [], 0
            for run, count, _ in self._split[1]:
                items.append((run, buffer[:, 0, :, start:start + count], None))
                start += count
        else:
            items = [(run, buffer[:, r, :, first:first + count], None)
                     for r, segments in enumerate(self._history) for run, first, count in segments]
        store.read_runs_into(layer, items)

    def _merge_split(self, step, store):
        """(hot positions, [(run, count, positions)] to gather) when attention can be split at
        the hot run (one slice of the slab holding every hot token, the new ones included);
        None otherwise (the exact path then serves the step). The rest is gathered as segments
        of one tier each, copied straight into consecutive slices of the buffer. (Reading whole
        warm blocks in place as a batch of one-block attentions was measured slower than this
        gather on CPU: 1.2 ms against 0.9 ms a layer at 3k tokens.)"""
        runs, write_runs = step.read_runs[0], step.write_runs[0]
        hot = [run for run in runs if run.tier == HOT and isinstance(run.index, slice)]
        if len(runs) < 2 or not hot or any(run.tier != HOT for run in write_runs):
            return None
        gathered = []
        for run, first, count in (store.map_segments(*step.placements[0], 0, self.num_history)
                                  if self.num_history else []):
            if run.tier != HOT:  # hot ones are inside the hot run's slice
                gathered.append((run, count, torch.arange(first, first + count, device=store.device)))
        return hot[0].positions, gathered

    def _gathered_runs(self) -> list:
        """Every run this step gathers into a buffer."""
        if self._split is not None:
            return [run for run, _, _ in self._split[1]]
        return [run for segments in self._history for run, _, _ in segments]


class LayerReads:
    """The handle one layer's attention gets (kwargs[LAYER_KEY]); see StepReads."""

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

    def paged_decode(self, query, attention_mask, scale, kernels):
        with self._bank._rolled_back_on_error():
            return self._step_reads.paged_decode(self.layer, query, attention_mask, scale, kernels)

    def done(self) -> None:
        self._step_reads.done(self.layer)
        self._bank._layer_attended(self.layer)


__all__ = ["StreamBuffers", "StepReads", "LayerReads", "streaming_pays"]
