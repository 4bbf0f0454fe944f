"""TierStore: one budget of hot/warm/cold blocks shared by every CacheBank that uses it.

It owns the tiers, their slot pools, the BlockIndex and the MemScheduler. Banks ask it for new
blocks, hand blocks back, and read/write one layer of tokens at a time; the scheduler decides
placement and returns a Plan, which `apply` carries out move by move (each move allocates its
destination slot, copies, then frees its source slot, so a plan never needs spare room).
The tiers are created when the first bank binds the store to a KV layout (model shape and
dtype), because block size in bytes is unknown until then.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .block_index import NO_TIER, BlockIndex
from .blocks import KVLayout
from .config import Config, load_config
from .errors import CapacityError, CorruptBlockError, LayoutError
from .hw.copy_engine import make_copy_engine
from .hw.devices import resolve_device, resolve_pinned
from .hw.link_monitor import make_link_monitor
from .pool import SlotPool
from .scheduler import COLD, DROPPED, HOT, TIER_NAMES, WARM, MemScheduler, Plan
from .tiers import ColdTier, HotTier, WarmTier
from .tiers.cold_files import ColdDirectory, open_cold_directory


STAGING_BYTES = 32 * 2**20  # host staging for cold-tier batches


@dataclass
class TierRun:
    """Tokens of one request that live in one tier: the tier's own index and where they go."""

    tier: int
    index: object  # the tier's token_index
    positions: torch.Tensor | None  # positions within the request; None = all of them, in order


class TierStore:
    def __init__(self, config: Config | dict | str | None = None):
        self.config = load_config(config if config is not None else {})
        self.device = resolve_device(self.config.hot.device)
        self.pinned = resolve_pinned(self.config.warm.pinned, self.device)
        self.layout: KVLayout | None = None
        self.dtype: torch.dtype | None = None
        self.tiers: list = []
        self.pools: list[SlotPool] = []
        self.index = BlockIndex()
        self.scheduler = MemScheduler(self.config.scheduler.policy)
        self.copy_engine = make_copy_engine(self.device)
        self.link_monitor = make_link_monitor(self.device)
        self.corrupt_block_ids: set[int] = set()
        self.bytes_moved = {f"{a}->{b}": 0 for a in TIER_NAMES for b in TIER_NAMES if a != b}
        self.hits = {name: 0 for name in TIER_NAMES}
        self.misses = 0
        self._closed = False
        self._cold_directory: ColdDirectory | None = None
        if self.config.cold.capacity_blocks != 0 and self.config.cold.capacity_bytes != 0:
            # fail at start, not at the first spill, when the cold directory is unusable or taken
            self._cold_directory = open_cold_directory(self.config.cold.path)

    # ---- binding ---------------------------------------------------------------------------
    @property
    def is_bound(self) -> bool:
        return self.layout is not None

    def bind(self, layout: KVLayout, dtype: torch.dtype) -> None:
        """Preallocate every tier for `layout`. A store serves one KV layout for its lifetime."""
        if self.layout is not None:
            if layout != self.layout or dtype != self.dtype:
                raise LayoutError(
                    f"this TierStore serves KV layout {self.layout} ({self.dtype}); got {layout} ({dtype}). "
                    "Use one store per model shape and dtype"
                )
            return
        cfg = self.config
        capacities = [
            cfg.hot.resolve_blocks(layout.block_bytes),
            cfg.warm.resolve_blocks(layout.block_bytes),
            cfg.cold.resolve_blocks(layout.block_bytes),
        ]
        if capacities[HOT] < 1:
            raise LayoutError(
                f"config key 'hot.capacity': holds {capacities[HOT]} blocks of {layout.block_bytes} bytes; "
                "allowed: at least one block"
            )
        tiers = [HotTier(layout, capacities[HOT], self.device, dtype), WarmTier(layout, capacities[WARM], dtype, self.pinned)]
        if capacities[COLD] > 0:
            tiers.append(ColdTier(layout, capacities[COLD], self._cold_directory, cfg.cold.backend, cfg.cold.fsync))
        else:
            tiers.append(None)
        self.tiers = tiers
        self.pools = [SlotPool(n, TIER_NAMES[t]) for t, n in enumerate(capacities)]
        # host buffer for moves into and out of cold, preallocated (and touched) once: batches
        # go through it in chunks, so no move faults in fresh pages
        staging_blocks = max(1, min(STAGING_BYTES // layout.block_bytes, max(capacities)))
        self._staging = torch.zeros((staging_blocks, *layout.record_shape()), dtype=dtype, pin_memory=self.pinned)
        self.layout, self.dtype = layout, dtype

    @property
    def capacities(self) -> list[int]:
        return [pool.num_slots for pool in self.pools]

    def free_slots(self) -> list[int]:
        return [pool.num_free for pool in self.pools]

    @property
    def total_capacity_blocks(self) -> int:
        return sum(self.capacities)

    # ---- block lifecycle -------------------------------------------------------------------
    def allocate(self, num_blocks: int) -> list[int]:
        """New blocks, placed as high as possible; raises CapacityError (changing nothing) when
        all tiers together cannot hold them."""
        if num_blocks == 0:
            return []
        plan = self.scheduler.plan_new_blocks(num_blocks, self.index, self.free_slots(), self.capacities)
        if plan is None:
            referenced = sum(1 for _, e in self.index.items() if e.ref_count > 0)
            raise CapacityError(
                f"need {num_blocks} more blocks of {self.layout.block_size} tokens "
                f"({self.layout.block_bytes} bytes each) but all tiers together hold {self.total_capacity_blocks} "
                f"(hot {self.capacities[HOT]}, warm {self.capacities[WARM]}, cold {self.capacities[COLD]}) and "
                f"{referenced} are in use; raise a tier's capacity or shorten the conversation"
            )
        self.apply(plan)
        now = self.index.tick()
        block_ids = []
        for tier in plan.new_block_tiers:
            (slot,) = self.pools[tier].allocate(1)
            block_id = self.index.add(tier, slot)
            self.index.touch([block_id], now)
            block_ids.append(block_id)
        return block_ids

    def retain(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            self.index.incref(block_id)

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference each. Unreferenced hashed blocks stay as reusable cache."""
        for block_id in block_ids:
            if self.index.decref(block_id) == 0 and self.index.get(block_id).content_hash is None:
                self._free(block_id)

    def _free(self, block_id: int) -> None:
        entry = self.index.remove(block_id)
        if entry.tier >= 0:  # a corrupt block already gave its slot back
            self._free_slot(entry.tier, entry.slot)
        self.corrupt_block_ids.discard(block_id)

    def _free_slot(self, tier: int, slot: int) -> None:
        self.pools[tier].free([slot])
        if tier == COLD:
            self.tiers[COLD].forget([slot])

    def copy_block(self, block_id: int) -> int:
        """Copy-on-write: a new block with the same content (the caller releases the old one)."""
        if block_id in self.corrupt_block_ids:
            raise CorruptBlockError(f"block {block_id} failed its checksum; it cannot be copied")
        (new_id,) = self.allocate(1)
        src, dst = self.index.get(block_id), self.index.get(new_id)
        self._copy_data(src.tier, src.slot, dst.tier, dst.slot)
        return new_id

    # ---- content addressing ----------------------------------------------------------------
    def register_hash(self, block_id: int, content_hash: bytes) -> int:
        return self.index.set_hash(block_id, content_hash)

    def unregister_hash(self, block_id: int) -> None:
        self.index.clear_hash(block_id)

    def lookup(self, content_hash: bytes) -> int | None:
        block_id = self.index.lookup(content_hash)
        return None if block_id is None or block_id in self.corrupt_block_ids else block_id

    # ---- placement -------------------------------------------------------------------------
    def promote(self, block_ids: list[int]) -> list[int]:
        """Bring blocks up (hot first). Returns ids found corrupt on the way (never served)."""
        plan = self.scheduler.plan_promotion(block_ids, self.index, self.free_slots(), self.capacities)
        return self.apply(plan)

    def demote(self, block_ids: list[int], dst_tier: int) -> list[int]:
        """Move blocks down to `dst_tier` (WARM or COLD) as far as room allows."""
        plan = self.scheduler.plan_demotion(block_ids, dst_tier, self.index, self.free_slots(), self.capacities)
        return self.apply(plan)

    def apply(self, plan: Plan, batch_cold_reads: bool = True) -> list[int]:
        """Carry out a plan's moves in order. Returns the ids of blocks that failed a checksum
        while being moved; those are marked corrupt, keep no data, and must be recomputed."""
        corrupt: list[int] = []
        moves = list(plan.moves)
        while moves:
            batch = self._take_cold_batch(moves) if batch_cold_reads else []
            if batch:
                corrupt += self._apply_batch(batch)
                continue
            move = moves.pop(0)
            entry = self.index.get(move.block_id)
            if entry.tier != move.src_tier:
                raise RuntimeError(f"plan is stale: {move}, but block {move.block_id} is in {TIER_NAMES[entry.tier]}")
            if move.dst_tier == DROPPED:
                self._free(move.block_id)
                continue
            allocated = self.pools[move.dst_tier].allocate(1)
            if allocated is None:
                raise RuntimeError(f"plan is infeasible: {move} but {TIER_NAMES[move.dst_tier]} is full")
            (dst_slot,) = allocated
            try:
                self._copy_data(move.src_tier, entry.slot, move.dst_tier, dst_slot)
            except CorruptBlockError:
                self._free_slot(move.dst_tier, dst_slot)
                self._mark_corrupt(move.block_id)  # frees its source slot, as the plan expects
                corrupt.append(move.block_id)
                continue
            self._free_slot(move.src_tier, entry.slot)
            self.index.move(move.block_id, move.dst_tier, dst_slot)
        self.copy_engine.before_device_use()
        if self.tiers and self.tiers[COLD] is not None:
            self.tiers[COLD].flush()
        return corrupt

    def _take_cold_batch(self, moves: list) -> list:
        """Pop the leading run of moves into or out of the cold tier between the same two tiers
        (a chat offloaded or promoted whole), to go through the staging buffer in chunks."""
        first = moves[0]
        if COLD not in (first.src_tier, first.dst_tier) or first.dst_tier == DROPPED:
            return []
        count = 1
        while count < len(moves) and (moves[count].src_tier, moves[count].dst_tier) == (first.src_tier, first.dst_tier):
            count += 1
        if count < 2:
            return []
        batch = moves[:count]
        del moves[:count]
        return batch

    def _apply_batch(self, batch: list) -> list[int]:
        """Moves between cold and another tier, `len(staging)` blocks at a time: one preadv per
        run of slots into the preallocated staging buffer, then one copy to the destination."""
        src_tier, dst_tier = batch[0].src_tier, batch[0].dst_tier
        src, dst = self.tiers[src_tier], self.tiers[dst_tier]
        corrupt: list[int] = []
        chunk_blocks = self._staging.shape[0]
        for start in range(0, len(batch), chunk_blocks):
            chunk = batch[start:start + chunk_blocks]
            src_slots = [self.index.get(m.block_id).slot for m in chunk]
            staging = self._staging[:len(chunk)]
            self.copy_engine.before_host_read()
            if src_tier == COLD:
                try:
                    src.read_blocks(src_slots, out=staging)
                except CorruptBlockError:  # find the bad ones block by block; the good ones still move
                    corrupt += self.apply(Plan(moves=chunk), batch_cold_reads=False)
                    continue
            else:
                for i, slot in enumerate(src_slots):
                    self.copy_engine.copy(staging[i], src.block_view(slot))
                self.copy_engine.before_host_read()
            dst_slots = self.pools[dst_tier].allocate(len(chunk))
            if dst_slots is None:
                raise RuntimeError(f"plan is infeasible: {len(chunk)} moves into {TIER_NAMES[dst_tier]} but it is full")
            dst.write_blocks(dst_slots, staging)
            for move, src_slot, dst_slot in zip(chunk, src_slots, dst_slots):
                self._free_slot(src_tier, src_slot)
                self.index.move(move.block_id, dst_tier, dst_slot)
            num_bytes = len(chunk) * self.layout.block_bytes
            self.bytes_moved[f"{TIER_NAMES[src_tier]}->{TIER_NAMES[dst_tier]}"] += num_bytes
            if HOT in (src_tier, dst_tier):
                self.link_monitor.record(num_bytes)
        return corrupt

    def verify(self, block_ids: list[int]) -> list[int]:
        """Check the cold blocks among `block_ids` against their checksums (the only tier whose
        bytes can rot outside this process). Failing ones are marked corrupt and returned."""
        if not self.tiers or self.tiers[COLD] is None:
            return []
        cold_ids = [b for b in block_ids if self.index.get(b).tier == COLD and b not in self.corrupt_block_ids]
        by_slot = {self.index.get(b).slot: b for b in cold_ids}
        bad = [by_slot[slot] for slot in self.tiers[COLD].verify(list(by_slot))]
        for block_id in bad:
            self._mark_corrupt(block_id)
        return bad

    def _block_at(self, tier: int, slot: int) -> int | None:
        return next((b for b, e in self.index.items() if e.tier == tier and e.slot == slot), None)

    def _mark_corrupt(self, block_id: int) -> None:
        """A corrupt block keeps its id (banks still list it) but no hash, no data and no slot."""
        entry = self.index.get(block_id)
        self.index.clear_hash(block_id)
        self.corrupt_block_ids.add(block_id)
        if entry.tier >= 0:
            self._free_slot(entry.tier, entry.slot)
            self.index.move(block_id, NO_TIER, -1)

    def _copy_data(self, src_tier: int, src_slot: int, dst_tier: int, dst_slot: int) -> None:
        src, dst = self.tiers[src_tier], self.tiers[dst_tier]
        if hasattr(src, "block_view") and hasattr(dst, "block_view"):
            self.copy_engine.copy(dst.block_view(dst_slot), src.block_view(src_slot))
        else:
            # host code is about to touch host memory a side-stream copy may still be using
            self.copy_engine.before_host_read()
            dst.write_blocks([dst_slot], src.read_blocks([src_slot]))
        num_bytes = self.layout.block_bytes
        if src_tier == dst_tier:  # a copy-on-write inside one tier moves nothing between tiers
            return
        self.bytes_moved[f"{TIER_NAMES[src_tier]}->{TIER_NAMES[dst_tier]}"] += num_bytes
        if HOT in (src_tier, dst_tier):
            self.link_monitor.record(num_bytes)

    # ---- per-step token access -------------------------------------------------------------
    def map_tokens(self, block_ids: list[int], offsets: list[int]) -> list[TierRun]:
        """Group tokens (given as block id + offset in block) by the tier holding them."""
        entries = [self.index.get(b) for b in block_ids]
        self._check_not_corrupt(block_ids, entries)
        return self._group_by_tier(
            np.fromiter((e.tier for e in entries), dtype=np.int64, count=len(entries)),
            np.fromiter((e.slot for e in entries), dtype=np.int64, count=len(entries)),
            np.asarray(offsets, dtype=np.int64),
        )

    def map_range(self, block_ids: list[int], start_token: int, end_token: int) -> list[TierRun]:
        """map_tokens for tokens [start_token, end_token) of a block table, built per block
        (numpy), not per token: this runs every decode step over the whole context."""
        bs = self.layout.block_size
        first, last = start_token // bs, (end_token - 1) // bs
        blocks = block_ids[first:last + 1]
        entries = [self.index.get(b) for b in blocks]
        self._check_not_corrupt(blocks, entries)
        lo, hi = start_token - first * bs, end_token - first * bs
        block_tiers = np.fromiter((e.tier for e in entries), dtype=np.int64, count=len(entries))
        block_slots = np.fromiter((e.slot for e in entries), dtype=np.int64, count=len(entries))
        if (block_tiers == HOT).all() and (np.diff(block_slots) == 1).all():
            base = int(block_slots[0]) * bs  # consecutive hot slots: one slice of the slab
            return [TierRun(HOT, slice(base + lo, base + hi), None)]
        return self._group_by_tier(
            np.repeat(block_tiers, bs)[lo:hi],
            np.repeat(block_slots, bs)[lo:hi],
            np.tile(np.arange(bs, dtype=np.int64), len(blocks))[lo:hi],
        )

    @staticmethod
    def _check_not_corrupt(block_ids: list[int], entries) -> None:
        if any(e.tier == NO_TIER for e in entries):
            bad = sorted({b for b, e in zip(block_ids, entries) if e.tier == NO_TIER})
            raise CorruptBlockError(f"blocks {bad} failed their checksum and must be recomputed")

    def _group_by_tier(self, token_tiers: np.ndarray, slots: np.ndarray, offsets: np.ndarray) -> list[TierRun]:
        """One TierRun per tier holding some of the tokens (positions None when one tier holds all)."""
        if (token_tiers == token_tiers[0]).all():
            tier = int(token_tiers[0])
            return [TierRun(tier, self.tiers[tier].token_index(slots, offsets), None)]
        runs = []
        for tier in (HOT, WARM, COLD):
            picked = np.nonzero(token_tiers == tier)[0]
            if len(picked):
                index = self.tiers[tier].token_index(slots[picked], offsets[picked])
                runs.append(TierRun(tier, index, torch.from_numpy(picked).to(self.device)))
        return runs

    def read_layer(self, layer: int, runs: list[TierRun], num_tokens: int) -> torch.Tensor:
        """`[2, H, num_tokens, D]` on the compute device: one layer's K/V of the mapped tokens."""
        if len(runs) == 1 and runs[0].positions is None:
            data = self._read_tokens(runs[0].tier, layer, runs[0].index)
            return data if runs[0].tier == HOT else data.to(self.device, non_blocking=True)
        out = torch.empty(
            (2, self.layout.num_kv_heads, num_tokens, self.layout.head_dim), dtype=self.dtype, device=self.device
        )
        for run in runs:
            data = self._read_tokens(run.tier, layer, run.index)
            out.index_copy_(2, run.positions, data.to(self.device, non_blocking=True))
        return out

    def _read_tokens(self, tier: int, layer: int, index) -> torch.Tensor:
        if tier != HOT:
            self.copy_engine.before_host_read()
        try:
            return self.tiers[tier].read_tokens(layer, index)
        except CorruptBlockError as error:
            block_id = self._block_at(tier, getattr(error, "slot", -1))
            if block_id is not None:
                self._mark_corrupt(block_id)
                error.block_id = block_id
            raise

    def write_layer(self, layer: int, runs: list[TierRun], kv: torch.Tensor) -> None:
        """Store `kv` (`[2, H, t, D]`) for the mapped tokens of one layer, wherever they live."""
        for run in runs:
            part = kv if run.positions is None else kv.index_select(2, run.positions)
            if run.tier != HOT:
                self.copy_engine.before_host_read()
            self.tiers[run.tier].write_tokens(layer, run.index, part)

    def count_hits(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            tier = self.index.get(block_id).tier
            if tier >= 0:
                self.hits[TIER_NAMES[tier]] += 1

    def end_step(self) -> None:
        """After the last layer of a forward pass: make cold writes durable."""
        if self.tiers and self.tiers[COLD] is not None:
            self.tiers[COLD].flush()

    # ---- reporting / teardown --------------------------------------------------------------
    def stats(self) -> dict:
        tiers = {}
        for t, name in enumerate(TIER_NAMES):
            if not self.is_bound or self._closed:
                tiers[name] = {"used_blocks": 0, "capacity_blocks": 0, "used_bytes": 0, "capacity_bytes": 0,
                               "device": str(self.device) if t == HOT else "cpu" if t == WARM else "file"}
                continue
            pool = self.pools[t]
            tiers[name] = {
                "used_blocks": pool.num_used,
                "capacity_blocks": pool.num_slots,
                "used_bytes": pool.num_used * self.layout.block_bytes,
                "capacity_bytes": pool.num_slots * self.layout.block_bytes,
                "device": str(self.device) if t == HOT else ("cpu (pinned)" if self.pinned else "cpu") if t == WARM
                else getattr(self.tiers[COLD], "file_path", "disabled"),
            }
        return {
            "tiers": tiers,
            "hits": dict(self.hits),
            "misses": self.misses,
            "bytes_moved": dict(self.bytes_moved),
            "link_saturation": self.link_monitor.saturation(),
        }

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for tier in self.tiers:
            if tier is not None:
                tier.close()
        self.tiers = []
        if self._cold_directory is not None:
            self._cold_directory.close()  # releases the lock; keeps the durable block files
            self._cold_directory = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
