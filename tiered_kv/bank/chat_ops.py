"""Chat-level operations of a CacheBank: attach to a conversation, prefetch, offload.

`attach(ids)` reuses only KV whose token ids are known to equal `ids`: the bank's own tokens as
far as their ids match (verified ids for a bank built from a model), then, on a block boundary,
blocks other banks published under the same model-fingerprinted chain keys. It never adopts the
caller's ids for tokens whose ids the bank did not see, except in a bank built from a config
alone, which cannot see any and keeps that trust to itself (it never publishes).

A model of several layer groups (layer_groups.py) resumes at a block boundary where every group
has what the next token reads: a full group every block before it, a sliding group its window's
blocks just before it (blocks older than a window were freed, so a hybrid chat resumes where a
stored conversation ended, not at any earlier boundary).
"""

from __future__ import annotations

import time

import torch

from ..blocks import DROPPED, HOT, TIER_NAMES
from ..identity import chain_keys, refresh_for_attach
from ..scheduler.restore import is_worth_recomputing, restore_blocks
from ..store.reporting import count_turn_start
from .rows import Row, common_prefix_length


class ChatOps:
    """Mixed into CacheBank; uses its rows, store, fingerprint and step machinery."""

    def attach(self, ids) -> int:
        """Reuse as much stored KV as matches `ids` (the whole conversation, one sequence).

        Returns the number of leading tokens whose KV is reused; generate() computes the rest.
        At least one token is always left to compute."""
        self._check_open()
        self._abandon_step()
        refresh_for_attach(self)  # KV of weights (adapters) no longer acting is dropped, not reused
        started_s = time.perf_counter()
        token_ids = self._as_token_list(ids)
        if self.batch_size > 1:
            raise ValueError(f"attach() serves one sequence; this bank holds {self.batch_size} (call reset())")
        self._check_fits(1, len(token_ids))  # fail before generate() runs any forward pass
        limit = len(token_ids) - 1
        block_size = self.config.block_size
        if self._rows:
            row = self._rows[0]
            if not self.verifies_token_ids and len(row.token_ids) < self._seq_len:
                # a config-only bank never sees generated ids: trust the caller, privately
                for group_row in self._rows:
                    group_row.token_ids.extend(token_ids[len(group_row.token_ids):self._seq_len])
            match = common_prefix_length(row.token_ids[:self._seq_len], token_ids)
            self._truncate_rows(self._servable_length(min(match, limit, self._seq_len)))
        if not self._rows:
            self._extend_from_store([Row() for _ in range(self._num_groups)], token_ids, limit)
        elif self._seq_len % block_size == 0:
            self._extend_from_store(self._rows, token_ids, limit)
        stored = self._seq_len
        if self._rows and self._restores_by_choice:
            self._recompute_what_loads_slower()
        metrics = self.store.metrics
        metrics.restore_choice.inc(("restored",), self._seq_len)
        metrics.restore_choice.inc(("recomputed",), stored - self._seq_len)
        if self._rows:
            self._promote_all(turn_start=True)
            self._turn_counted = True  # the step that follows is this same turn
        metrics.turns.inc()
        metrics.tokens_reused.inc((), self._seq_len)
        self._turn_started_s = started_s  # time to first token runs to the end of the next forward
        return self._seq_len

    @property
    def _restores_by_choice(self) -> bool:
        """scheduler.restore auto, on a model of one full-attention group (a hybrid model resumes
        only where every group's window is stored: it restores all it can)."""
        return self.config.scheduler.restore == "auto" and self.layer_groups.is_single_full

    def _recompute_what_loads_slower(self) -> None:
        """Keep the leading blocks whose load beats recomputing them; release the rest, which the
        turn's prefill computes (scheduler/restore.py, from the store's measured rates)."""
        store, block_size = self.store, self.config.block_size
        per_block = store.rates.recompute_seconds(block_size)
        if per_block is None:
            return
        table = self._rows[0].table
        tiers, _ = store.placements(table)
        cost = {}  # per tier: seconds to bring one block of it up (None: not measured yet)
        for tier in set(tiers.tolist()):
            name = TIER_NAMES[tier] if tier != DROPPED else None
            cost[tier] = 0.0 if tier == HOT or name is None else \
                store.rates.load_seconds(name, store.tiers[tier].layout.block_bytes)
        keep = restore_blocks([cost[t] for t in tiers.tolist()], per_block)
        if keep < len(table):
            self._truncate_rows(self._servable_length(keep * block_size))

    def _can_look_up(self) -> bool:
        return self.fingerprint.is_shareable and self.store.is_bound

    def _extend_from_store(self, rows: list[Row], token_ids: list[int], limit: int) -> None:
        """Append to `rows` (one per layer group, of one sequence) the longest run of published
        blocks that continues them within `ids` and gives every group what the next token reads.
        Only rows whose every id is verified may continue with shared blocks."""
        block_size = self.config.block_size
        row0 = rows[0]
        start = len(row0.token_ids) // block_size  # the sequence's blocks so far
        if not self._can_look_up() or row0.num_verified_tokens != len(row0.token_ids) \
                or len(row0.token_ids) != start * block_size or limit // block_size <= start:
            return
        wanted = limit // block_size - start
        groups = self.layer_groups.groups
        keys = []
        for g, row in enumerate(rows):
            root = self._root_key(g)
            row.extend_keys(root, block_size)
            previous = row.keys[-1] if row.keys else root
            keys.append(chain_keys(previous, token_ids, block_size, start, wanted))
        # full groups: the leading run of blocks each holds; the sequence can resume at the shortest
        found: dict[int, list[int]] = {}
        end = start + wanted
        for g, group in enumerate(groups):
            if not group.is_sliding:
                found[g] = self._look_up(keys[g], g)
                end = min(end, start + len(found[g]))
        if len(found) == 0:  # every group sliding: the last boundary where all windows are stored
            end = self._last_stored_window_end(keys, start, block_size)
        # sliding groups: the blocks their window needs before `end` (those before `start` they hold)
        firsts: dict[int, int] = {}
        for g, group in enumerate(groups):
            if group.is_sliding and end > start:
                firsts[g] = first = max(start, group.window_start_block(end * block_size, block_size))
                found[g] = self._look_up(keys[g][first - start:end - start], g)
                if len(found[g]) < end - first:
                    end = start  # no stored window there: nothing is reused beyond what the rows hold
        if end <= start:
            self.store.release([b for blocks in found.values() for b in blocks])
            return
        surplus = [b for g, blocks in found.items() if not groups[g].is_sliding for b in blocks[end - start:]]
        if surplus:
            self.store.release(surplus)
        num_tokens = end * block_size
        left_window = []
        for g, row in enumerate(rows):
            if groups[g].is_sliding:
                if firsts[g] > row.end_block or not row.table:  # what it held is out of the window at `end`
                    left_window += row.restart_at(firsts[g])
                row.table.extend(found[g])
                left_window += row.drop_before(groups[g].first_needed_block(num_tokens, block_size))
            else:
                row.table.extend(found[g][:end - start])
            row.token_ids = list(token_ids[:num_tokens])
            row.num_verified_tokens = num_tokens  # a published key names exactly these ids
            row.keys.extend(keys[g][:end - start])
            row.num_published_blocks = end
        if left_window:
            self.store.release(left_window, for_good=True)
        if not self._rows:
            self._rows = rows
        self._seq_len = num_tokens
        self._structure_changed()

    def _last_stored_window_end(self, keys: list[list[bytes]], start: int, block_size: int) -> int:
        """For a model of sliding groups only (no full chain caps the resume point): the last block
        boundary after `start` at which every group's window blocks are in the store, else `start`."""
        groups = self.layer_groups.groups
        held = [self.store.holds(group_keys) for group_keys in keys]
        for end in range(start + len(keys[0]), start, -1):
            if all(all(held[g][max(start, group.window_start_block(end * block_size, block_size)) - start:end - start])
                   for g, group in enumerate(groups)):
                return end
        return start

    def _look_up(self, keys: list[bytes], group: int) -> list[int]:
        """The leading run of `keys` the store holds, then the shared remote tier, each retained."""
        if not keys:
            return []
        found = self.store.lookup_and_retain(keys)
        if len(found) < len(keys):  # the rest of the chain may be on the other processes' files or the remote tier
            missing = len(keys) - len(found)
            if self._restores_by_choice and self._fetch_is_slower(missing):
                # (they may not all be there: counted apart from the local choices)
                self.store.metrics.restore_choice.inc(("not_fetched",), missing * self.config.block_size)
                return found
            found += self.store.fetch_remote(keys[len(found):], self._root_key(group))
        return found

    def _fetch_is_slower(self, num_blocks: int) -> bool:
        """Whether fetching `num_blocks` from the other processes' cold files and the remote tier
        would take longer than recomputing them, by every rate measured (an unmeasured source is
        tried: that measures it)."""
        store = self.store
        recompute = store.rates.recompute_seconds(num_blocks * self.config.block_size)
        if recompute is None:
            return False
        estimates = []
        if store.peers is not None:
            estimates.append(store.rates.load_seconds("peer", num_blocks * store.peers.layout.block_bytes))
        if store.remote is not None:
            estimates.append(store.rates.load_seconds("remote", num_blocks * store.remote.value_bytes))
        return bool(estimates) and all(e is not None and is_worth_recomputing(e, recompute) for e in estimates)

    def prefetch(self, deadline_s: float | None = None) -> None:
        """Bring this chat's blocks up the tiers ahead of its next turn (call it when the user
        starts typing). Returns at once: the store's background mover moves them, most recent
        first, ahead of its other background work, and gives up `deadline_s` seconds from now
        (None: once all are up). A turn that begins meanwhile takes the prefetch over: it waits
        for the blocks in flight and moves the rest itself. With `scheduler.background: false`
        the blocks come up before this returns."""
        self._check_open()
        self._abandon_step()
        if deadline_s is not None and not deadline_s >= 0:
            raise ValueError(f"prefetch(deadline_s={deadline_s!r}): allowed None or seconds >= 0")
        if self._rows:
            self.store.prefetch(self._step_owner, self._promotion_order(self._rows), deadline_s)

    def offload(self, tier: str = "warm") -> dict:
        """Move this idle chat's blocks down to `tier` ("warm" or "cold"), freeing the tiers
        above for other chats; its next turn (or prefetch) brings them back. Returns
        stats()["bank_blocks"] afterwards: blocks that found no room stay where they were."""
        if tier not in ("warm", "cold"):
            raise ValueError(f"offload(tier={tier!r}): allowed 'warm' or 'cold'")
        self._check_open()
        self._abandon_step()
        blocks = list(dict.fromkeys(b for row in self._rows for b in row.table))
        if blocks:
            self.store.demote(blocks, TIER_NAMES.index(tier))
        return self.stats()["bank_blocks"]

    def _promote_all(self, turn_start: bool = False) -> None:
        self._promote_rows(self._rows, turn_start)
        self._drop_from_first_corrupt()

    @staticmethod
    def _promotion_order(rows: list[Row]) -> list[int]:
        """Block ids most recent first (likeliest to be read again soon), each once: by sequence
        position, so a sliding group's window comes up with the full groups' newest blocks."""
        end = max((row.end_block for row in rows), default=0)
        return list(dict.fromkeys(row.block_at(p) for p in range(end - 1, -1, -1) for row in rows
                                  if row.first_block <= p < row.end_block))

    def _promote_rows(self, rows: list[Row], turn_start: bool = False) -> None:
        """Move these blocks up the tiers now, then check whatever stays cold against its
        checksums rather than mid-forward. At a turn's start, first count where they were (the
        store's per-tier hit rates)."""
        order = self._promotion_order(rows)
        if not order:
            return
        store = self.store
        tiers, _ = store.placements(order)
        if turn_start:
            count_turn_start(store.metrics, tiers)
        if (tiers == HOT).all():
            return
        before = self._thread_move_seconds()
        store.promote(order, owner=self._step_owner)
        store.verify(order)
        self._add_critical_path(before)

    def _thread_move_seconds(self) -> dict:
        """Seconds this thread has waited for the store's demand moves so far, by direction."""
        demand = self.store.demand
        return dict(demand.thread_seconds()) if demand is not None else {"demote": 0.0, "promote": 0.0}

    def _add_critical_path(self, before: dict) -> None:
        """Charge this bank the seconds its thread spent moving blocks since `before`."""
        after = self._thread_move_seconds()
        for direction in ("demote", "promote"):
            self._critical_path[f"{direction}_s"] += after[direction] - before[direction]

    def _drop_from_first_corrupt(self) -> int | None:
        """Truncate every row before its first corrupt block. Returns that token position, or None."""
        first_bad = None
        for row in self._rows:
            tiers, _ = self.store.placements(row.table)
            bad = next((row.first_block + i for i, tier in enumerate(tiers) if tier == DROPPED), None)
            if bad is not None:
                first_bad = bad if first_bad is None else min(first_bad, bad)
        if first_bad is None:
            return None
        keep = self._servable_length(min(self._seq_len, first_bad * self.config.block_size))
        self._truncate_rows(keep)
        return keep

    @staticmethod
    def _as_token_list(ids) -> list[int]:
        if isinstance(ids, torch.Tensor):
            if ids.dim() == 2:
                if ids.shape[0] != 1:
                    raise ValueError(f"attach() takes one sequence; got ids of shape {tuple(ids.shape)}")
                ids = ids[0]
            return [int(x) for x in ids.tolist()]
        return [int(x) for x in ids]
