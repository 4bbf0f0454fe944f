"""A prepared step: what every layer of one forward pass does, decided once before layer 0.

invariant 9 (docs/design.md). The bank opens a step's lease before layer 0 (the model's forward pre-hook
runs there) and builds a StepPlan from it: where the new tokens' K/V go and what each layer reads,
as index tensors or views on the compute device. A layer is then a fixed handful of tensor ops,
with no Python per block, no lock and no host sync:

writes (the new tokens of a layer)
  slice    one row, its new tokens one run of the device slab: two copies into prepared views
  index    every new token on the device slab: index_copy_ (one row) / index_put_ (rows), K and V
  staged   through the lease's token runs (a tail in cold, compressed or records-layout warm)
reads (the layer's K/V handed to attention)
  view     one row whose tokens are one run of the device slab (consecutive hot slots; on a CPU
           store hot and warm share the slab): prepared views, nothing copied. Not on CUDA unless
           the hooks' merge mode runs: SDPA there may pick another kernel for a strided view, and
           exact K/V must be laid out as DynamicCache hands them
  gather   every token on the device slab: one gather per layer into a buffer the bank reuses
  paged    (tiered_kv.hooks merge mode; native kernels) one new token per row, every block in a
           tier the paged decode kernel reads in place: attention runs the kernel over a prepared
           block table; update() hands back only the new tokens
  staged   anything else: blocks in cold, compressed warm, a sliding group's gap, several layer
           groups (each layer reads and writes through the lease, as a step did before plans)
The device slab (store/device_slab.py) is hot on CUDA, and hot and paged warm on CPU.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from ..blocks import COLD
from ..store.device_slab import DeviceSlab, is_run
from .partial import attend_split, prepare_split

KINDS = ("view", "gather", "split", "paged", "staged", "sparse")


class GatherBuffer:
    """Where a bank's gathered reads land, reused by every step (it only grows), with the views of
    it kept while the steps' shape stays (a decode step's adds a block every block_size tokens)."""

    def __init__(self):
        self._flat: torch.Tensor | None = None
        self._views: tuple = (None, None)  # (shape, views)
        self.num_allocations = 0

    def views(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, make):
        """`make(out)`'s views of a `shape` buffer, from the last call when shape, dtype and device are the same."""
        key = (shape, dtype, device)
        if self._views[0] == key:
            return self._views[1]
        numel = int(np.prod(shape))
        flat = self._flat
        if flat is None or flat.numel() < numel or flat.dtype != dtype or flat.device != device:
            grown = numel if flat is None or flat.dtype != dtype else max(numel, flat.numel() + flat.numel() // 4)
            flat = self._flat = torch.empty(grown, dtype=dtype, device=device)
            self.num_allocations += 1
        views = make(flat[:numel].view(shape))
        self._views = (key, views)
        return views

    @property
    def num_bytes(self) -> int:
        return self._flat.numel() * self._flat.element_size() if self._flat is not None else 0


class StepPlan:
    """Built by `prepare` (below) from a step's lease; the bank calls `layer` from update()."""

    def __init__(self, lease, num_layers: int, on_last_layer, guard):
        self.lease = lease
        self.num_layers = num_layers
        self.last_layer = num_layers - 1
        self.on_last_layer = on_last_layer  # the bank's commit (or, paged: after the last attention)
        self.guard = guard  # a context that rolls the step back on any error (a staged read may find a bad block)
        self.read_kind = self.write_kind = "staged"
        self.is_grouped = False  # several layer groups: the bank's own grouped path serves every layer
        self.clone_last = False  # the last layer's views are copied (nobody says when attention read them)
        self.detach = torch.is_grad_enabled()
        self.layer = self._staged_layer
        self.kernel_args = None  # paged: (block table, tags, starts, lens)
        self.buffer = None  # the bank's GatherBuffer: a staged step's one row is read into it, layer after layer
        self.sparse = self.probe = None  # a sparse step's reads; a sampled step's probe (attention_steps.py)

    # ---- layers ------------------------------------------------------------------------------------
    def _write(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        if self.detach:  # (a forward with autograd on: the blocks never join its graph)
            key, value = key.detach(), value.detach()
        kind = self.write_kind
        if kind == "index":
            self.write_k[layer].index_copy_(2, self.write_index, key)
            self.write_v[layer].index_copy_(2, self.write_index, value)
        elif kind == "put":
            self.write_k[layer].index_put_(self.write_index, key)
            self.write_v[layer].index_put_(self.write_index, value)
        else:
            lease = self.lease
            with self.guard():
                for r in range(key.shape[0]):
                    lease.write_layer(layer, r, torch.stack((key[r], value[r])))

    def _view_layer(self, layer: int, key: torch.Tensor, value: torch.Tensor, seam):
        if self.write_kind == "index" and not self.detach:  # (the usual write, inline: one call less a layer)
            self.write_k[layer].index_copy_(2, self.write_index, key)
            self.write_v[layer].index_copy_(2, self.write_index, value)
        else:
            self._write(layer, key, value)
        if layer == self.last_layer:
            self.on_last_layer()
            if self.clone_last:
                return self.read_k[layer].clone(), self.read_v[layer].clone()
        return self.read_k[layer], self.read_v[layer]

    def _gather_layer(self, layer: int, key: torch.Tensor, value: torch.Tensor, seam):
        if self.write_kind == "index" and not self.detach:
            self.write_k[layer].index_copy_(2, self.write_index, key)
            self.write_v[layer].index_copy_(2, self.write_index, value)
        else:
            self._write(layer, key, value)
        torch.index_select(self.gather_sources[layer], 0, self.gather_index, out=self.gather_out)
        if layer == self.last_layer:
            self.on_last_layer()
        return self.read_k, self.read_v

    def _gather_rows_layer(self, layer: int, key: torch.Tensor, value: torch.Tensor, seam):
        self._write(layer, key, value)
        torch.ops.aten.index.Tensor_out(self.gather_sources[layer], self.gather_index, out=self.gather_out)
        if layer == self.last_layer:
            self.on_last_layer()
        return self.read_k, self.read_v

    def _paged_layer(self, layer: int, key: torch.Tensor, value: torch.Tensor, seam):
        self._write(layer, key, value)
        if seam is None:
            raise MissingPlan(f"tiered_kv.hooks merge: layer {layer} called cache.update() without the kwargs dict it "
                              "hands its attention function, so attention cannot find the step's block table; this "
                              "model does not fit the hooks' merge mode (use exact, or no hooks)")
        seam[PAGED_KEY] = self  # the attention function (tiered_kv.hooks merge) runs the kernel
        return key, value  # the step commits once the last layer's attention is done

    def _staged_layer(self, layer: int, key: torch.Tensor, value: torch.Tensor, seam):
        self._write(layer, key, value)
        lease = self.lease
        out = None
        if key.shape[0] == 1 and self.buffer is not None and not self.detach:  # (autograd may keep a layer's K/V)
            row = lease.rows[0]
            out = self.buffer.views((2, key.shape[1], row.num_tokens, key.shape[3]), key.dtype, key.device, _same)
        with self.guard():
            rows = [lease.read_layer(layer, r, out) for r in range(key.shape[0])]
        kv = rows[0].unsqueeze(1) if len(rows) == 1 else torch.stack(rows, dim=1)
        if layer == self.last_layer:
            self.on_last_layer()
            if self.clone_last:
                kv = kv.clone()
        return kv[0], kv[1]

    def attend(self, module, query: torch.Tensor, attention_mask, scale: float) -> torch.Tensor:
        """A paged or split step's attention for one layer (hooks merge mode calls it), `[B, q, Hq, D]`
        as transformers' attention functions return it: the paged kernel over the rows' blocks where
        they lie, or one partial attention per run of the CPU slab merged by log-sum-exp (partial.py)."""
        layer = module.layer_idx
        if self.read_kind == "sparse":
            out = self.sparse.attend(self, module, query, attention_mask, scale)
        elif self.read_kind == "split":
            out = attend_split(self, module, query, attention_mask, scale)
        else:
            sources = self.kernel_sources[layer]
            out = self.kernels.paged_decode(query[:, :, 0].contiguous(), sources, *self.kernel_args, scale)[0]
            out = out.unsqueeze(1)
        if layer == self.last_layer:
            self.on_last_layer()
        return out


# ---- the contract with tiered_kv.hooks' attention functions ------------------------------------------
PAGED_KEY = "tiered_kv_paged"  # where a paged step leaves its plan in the kwargs the model hands attention
HOOKS_MODES = {"tiered_kv_exact": "exact", "tiered_kv_merge": "merge"}  # attention implementation -> hooks mode
PAGED_ON_CPU = False  # tests set it to run the paged path through the kernels' torch reference

expected_plans = threading.local()  # `.plan`: the plan of a paged step running on this thread


class MissingPlan(RuntimeError):
    """A paged step's attention cannot find its plan (the model hands attention another kwargs dict)."""


def expect_paged(plan) -> None:
    """A paged step starts on this thread: its attention must get `plan` (in the model's kwargs)."""
    expected_plans.plan = plan


def clear_expected() -> None:
    """The step on this thread ended or was rolled back: no plan is owed any more."""
    expected_plans.plan = None


def paged_kernels():
    """The native ops (cupy) when chosen at start, else None; on CPU (tests) the torch reference."""
    from ..kernels import ops
    if ops.backend == "cuda" or PAGED_ON_CPU:
        return ops
    return None


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def prepare(plan: StepPlan, slab: DeviceSlab | None, buffer: GatherBuffer, dtype: torch.dtype, *,
            allow_views: bool, paged_kernels=None, mask_starts=None, split: bool = False,
            traced=None) -> StepPlan:
    """Fill `plan` for its lease (one layer group): the kinds of write and read its placement
    allows, and their tensors (module docstring). `allow_views`: a layer may hand attention strided
    views of the slab; `paged_kernels`: the native ops when a paged read may serve the step (merge
    mode); `mask_starts`: per row, where its attention mask's ones begin (a device int32 tensor);
    `split`: a decode step over a few runs of the slab may attend to each in place (merge mode on
    a CPU: partial.py); `traced`: a compiled step's preparation (compiled.prepare_traced)."""
    lease = plan.lease
    rows = lease.rows
    plan.buffer = buffer
    if slab is None or any(row.skipped_new_tokens for row in rows):
        return plan
    blocks = [slab.block_positions(row.tiers, row.slots, row.num_tokens) for row in rows]
    device = slab.device
    written = [slab.block_positions(row.tiers, row.slots, row.write_end) for row in rows]
    if all(w is not None for w in written):
        writes = [slab.token_positions(w, row.write_start, row.write_end) for w, row in zip(written, rows)]
        if len(rows) == 1:
            plan.write_index = torch.from_numpy(writes[0]).to(device, non_blocking=True)
            plan.write_k, plan.write_v, plan.write_kind = slab.layers_k1, slab.layers_v1, "index"
        else:
            heads = slab.layers_k[0].shape[0]
            plan.write_index = (torch.arange(heads, device=device).view(1, heads, 1),
                                torch.from_numpy(np.stack(writes)).to(device, non_blocking=True).unsqueeze(1))
            plan.write_k, plan.write_v, plan.write_kind = slab.layers_k, slab.layers_v, "put"
    if paged_kernels is not None and lease.num_new_tokens == 1 and _prepare_paged(plan, slab, mask_starts):
        plan.kernels = paged_kernels
        return plan
    if any(b is None for b in blocks):
        return plan
    num_tokens = lease.rows[0].num_tokens
    if traced is not None:  # a compiled step: the graph slices and gathers the one slab tensor itself
        traced(plan, slab, blocks, num_tokens, device, allow_views)
        return plan
    if len(rows) == 1 and allow_views and is_run(blocks[0]):
        first = int(blocks[0][0]) * slab.block_size
        views = slab.flat[:, :, first:first + num_tokens].unsqueeze(1).unbind(0)
        plan.read_k, plan.read_v = views[0::2], views[1::2]
        plan.read_kind, plan.layer = "view", plan._view_layer
        return plan
    if split and len(rows) == 1 and lease.num_new_tokens == 1 and plan.write_kind == "index" and \
            prepare_split(plan, slab, blocks[0], num_tokens):
        plan.layer = plan._paged_layer  # (writes, then attention finds the plan in the kwargs)
        return plan
    if allow_views:
        _prepare_block_gather(plan, slab, buffer, blocks, num_tokens, dtype, device)
    else:
        _prepare_token_gather(plan, slab, buffer, blocks, num_tokens, dtype, device)
    plan.read_kind = "gather"
    plan.layer = plan._gather_layer if len(rows) == 1 else plan._gather_rows_layer
    return plan


def _prepare_block_gather(plan: StepPlan, slab: DeviceSlab, buffer: GatherBuffer, blocks: list[np.ndarray],
                          num_tokens: int, dtype, device) -> None:
    """Whole blocks gathered (a block's tokens of one head are contiguous: memcpy-speed copies);
    attention gets the first `num_tokens` of them as a view."""
    num_rows, num_blocks = len(blocks), len(blocks[0])
    (heads, _, dim), bs = slab.layers_k[0].shape, slab.block_size

    def make(out):  # out [2, B, H, blocks, bs * D]: what the gather fills, then K and V by token
        tokens = out.view(2, num_rows, heads, num_blocks * bs, dim)
        gather_out = out.view(2 * heads * num_blocks, bs * dim) if num_rows == 1 else out
        return gather_out, tokens[0], tokens[1]

    plan.gather_out, keys, values = buffer.views((2, num_rows, heads, num_blocks, bs * dim), dtype, device, make)
    plan.read_k, plan.read_v = keys[:, :, :num_tokens], values[:, :, :num_tokens]
    if num_rows == 1:  # rows of whole blocks: (K or V, head, block) -> a row of the slab's block rows
        plan.gather_sources = slab.layers_block_rows
        plan.gather_index = _row_index(blocks[0], heads, slab.num_slots, device)
        return
    plan.gather_sources = slab.layers_blocks
    _set_gather_index(plan, blocks, heads, device)


def _prepare_token_gather(plan: StepPlan, slab: DeviceSlab, buffer: GatherBuffer, blocks: list[np.ndarray],
                          num_tokens: int, dtype, device) -> None:
    """Token by token, into K and V each contiguous (as DynamicCache lays them out: CUDA exact)."""
    num_rows, (heads, _, dim) = len(blocks), slab.layers_k[0].shape

    def make(out):  # out [2, B, H, T, D]: what the gather fills, then K and V
        return (out.view(2 * heads * num_tokens, dim) if num_rows == 1 else out), out[0], out[1]

    plan.gather_out, plan.read_k, plan.read_v = buffer.views((2, num_rows, heads, num_tokens, dim), dtype, device,
                                                             make)
    positions = [slab.token_positions(b, 0, num_tokens) for b in blocks]
    if num_rows == 1:  # rows of one token's K or V of one head: (K or V, head, token) -> a slab row
        plan.gather_sources = slab.layers_token_rows
        plan.gather_index = _row_index(positions[0], heads, slab.num_tokens, device)
        return
    plan.gather_sources = slab.layers_kv
    _set_gather_index(plan, positions, heads, device)


def _row_index(positions: np.ndarray, heads: int, rows_per_head: int, device) -> torch.Tensor:
    """One row's gather index into a layer's slab seen as rows `[2 * H * rows_per_head, ...]` (K's
    heads, then V's): `positions` (blocks or tokens) of every head of K, then of V."""
    rows = np.arange(2 * heads, dtype=np.int64)[:, None] * rows_per_head + positions[None, :]
    return torch.from_numpy(rows.reshape(-1)).to(device, non_blocking=True)


def _set_gather_index(plan: StepPlan, positions: list[np.ndarray], heads: int, device) -> None:
    """Several rows' gather: an advanced index giving `[2, B, H, n, ...]` (K and V, the rows, the heads)."""
    plan.gather_index = [torch.arange(2, device=device).view(2, 1, 1, 1),
                         torch.arange(heads, device=device).view(1, 1, heads, 1),
                         torch.from_numpy(np.stack(positions)).to(device, non_blocking=True).view(1, len(positions), 1, -1)]


def _prepare_paged(plan: StepPlan, slab: DeviceSlab, mask_starts) -> bool:
    """The paged read when every block the step reads lies in a tier the kernel reads in place."""
    lease = plan.lease
    rows = lease.rows
    sources = slab.kernel_sources
    readable = len(sources[0]) if sources else 0
    bs = slab.block_size
    needed = -(-lease.num_tokens // bs)
    table = np.zeros((len(rows), needed), dtype=np.int32)
    tags = np.zeros((len(rows), needed), dtype=np.int8)
    for r, row in enumerate(rows):
        tiers = row.tiers[:needed]
        if len(tiers) < needed or (tiers < 0).any() or (tiers >= min(readable, COLD)).any():
            return False
        table[r], tags[r] = row.slots[:needed], tiers
    device = lease.device
    starts = mask_starts if mask_starts is not None else torch.zeros(len(rows), dtype=torch.int32, device=device)
    lens = torch.full((len(rows),), lease.num_tokens, dtype=torch.int32, device=device)
    plan.kernel_sources = sources
    plan.kernel_args = (torch.from_numpy(table).to(device, non_blocking=True),
                        torch.from_numpy(tags).to(device, non_blocking=True), starts, lens)
    plan.read_kind, plan.layer, plan.returns_views = "paged", plan._paged_layer, False
    return True


__all__ = ["StepPlan", "GatherBuffer", "prepare", "KINDS", "PAGED_KEY", "HOOKS_MODES", "MissingPlan", "expect_paged",
           "clear_expected", "expected_plans", "paged_kernels"]
