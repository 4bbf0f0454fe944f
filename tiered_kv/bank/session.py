"""A bank's chat-level operations: attach to a conversation, prefetch, offload, promote.

`attach(ids)` reuses only KV whose token ids are known to equal `ids`: the bank's own tokens as
far as their ids match (verified ids for a bank built from a model), then, on a block boundary,
blocks other banks published under the same model-fingerprinted chain keys. It never adopts the
caller's ids for tokens whose ids the bank did not see, except in a bank built from a config
alone, which cannot see any and keeps that trust to itself (it never publishes).

A model of several layer groups (layer_groups.py) resumes at a block boundary where every group
has what the next token reads: a full group every block before it, a sliding group its window's
blocks just before it (blocks older than a window were freed, so a hybrid chat resumes where a
stored conversation ended, not at any earlier boundary).

Functions of the bank (cache_bank.py): its sequence (sequence.py), step machine (steps.py),
store, identity and turn.
"""

from __future__ import annotations

import time

import torch

from ..blocks import DROPPED, HOT, TIER_NAMES
from ..identity import chain_keys, refresh_for_attach
from ..scheduler.restore import is_worth_recomputing, restore_blocks
from ..store.reporting import count_turn_start
from .rows import Row, common_prefix_length
from .step import moved_seconds


def _truncate(bank, num_tokens: int) -> None:
    """Cut every row to `num_tokens` (servable already) and let the dropped blocks go."""
    dropped = bank.seq.truncate(num_tokens)
    bank.steps.rows_changed()
    bank.store.release(dropped)


def attach(bank, ids) -> int:
    """Reuse as much stored KV as matches `ids` (the whole conversation, one sequence).

    Returns the number of leading tokens whose KV is reused; generate() computes the rest.
    At least one token is always left to compute."""
    bank.check_open()
    bank.steps.abandon()
    refresh_for_attach(bank)  # KV of weights (adapters) no longer acting is dropped, not reused
    started_s = time.perf_counter()
    token_ids = _as_token_list(ids)
    if bank.seq.batch_size > 1:
        raise ValueError(f"attach() serves one sequence; this bank holds {bank.seq.batch_size} (call reset())")
    bank.check_fits(1, len(token_ids))  # fail before generate() runs any forward pass
    limit = len(token_ids) - 1
    block_size = bank.config.block_size
    if bank.seq.rows:
        row = bank.seq.rows[0]
        if not bank.verifies_token_ids and len(row.token_ids) < bank.seq.num_tokens:
            # a config-only bank never sees generated ids: trust the caller, privately
            for group_row in bank.seq.rows:
                group_row.token_ids.extend(token_ids[len(group_row.token_ids):bank.seq.num_tokens])
        match = common_prefix_length(row.token_ids[:bank.seq.num_tokens], token_ids)
        _truncate(bank, bank.seq.servable_length(min(match, limit, bank.seq.num_tokens)))
    if not bank.seq.rows:
        _extend_from_store(bank, [Row() for _ in range(bank.seq.num_groups)], token_ids, limit)
    elif bank.seq.num_tokens % block_size == 0:
        _extend_from_store(bank, bank.seq.rows, token_ids, limit)
    stored = bank.seq.num_tokens
    if bank.seq.rows and _restores_by_choice(bank):
        _recompute_what_loads_slower(bank)
    metrics = bank.store.metrics
    metrics.restore_choice.inc(("restored",), bank.seq.num_tokens)
    metrics.restore_choice.inc(("recomputed",), stored - bank.seq.num_tokens)
    if bank.seq.rows:
        _promote_all(bank, turn_start=True)
        bank.turn.counted = True  # the step that follows is this same turn
    metrics.turns.inc()
    metrics.tokens_reused.inc((), bank.seq.num_tokens)
    bank.turn.started_s = started_s  # time to first token runs to the end of the next forward
    return bank.seq.num_tokens

def _restores_by_choice(bank) -> bool:
    """scheduler.restore auto, on a model of one full-attention group (a hybrid model resumes
    only where every group's window is stored: it restores all it can)."""
    return bank.config.scheduler.restore == "auto" and bank.layer_groups.is_single_full


def _recompute_what_loads_slower(bank) -> None:
    """Keep the leading blocks whose load beats recomputing them; release the rest, which the
    turn's prefill computes (scheduler/restore.py, from the store's measured rates)."""
    store, block_size = bank.store, bank.config.block_size
    per_block = store.rates.recompute_seconds(block_size)
    if per_block is None:
        return
    table = bank.seq.rows[0].table
    tiers, _ = store.placements(table)
    cost = {}  # per tier: seconds to bring one block of it up (None: not measured yet)
    for tier in set(tiers.tolist()):
        name = TIER_NAMES[tier] if tier != DROPPED else None
        cost[tier] = 0.0 if tier == HOT or name is None else \
            store.rates.load_seconds(name, store.tiers[tier].layout.block_bytes)
    keep = restore_blocks([cost[t] for t in tiers.tolist()], per_block)
    if keep < len(table):
        _truncate(bank, bank.seq.servable_length(keep * block_size))


def _can_look_up(bank) -> bool:
    return bank.fingerprint.is_shareable and bank.store.is_bound


def _extend_from_store(bank, rows: list[Row], token_ids: list[int], limit: int) -> None:
    """Append to `rows` (one per layer group, of one sequence) the longest run of published
    blocks that continues them within `ids` and gives every group what the next token reads.
    Only rows whose every id is verified may continue with shared blocks."""
    block_size = bank.config.block_size
    row0 = rows[0]
    start = len(row0.token_ids) // block_size  # the sequence's blocks so far
    if not _can_look_up(bank) or row0.num_verified_tokens != len(row0.token_ids) \
            or len(row0.token_ids) != start * block_size or limit // block_size <= start:
        return
    wanted = limit // block_size - start
    groups = bank.layer_groups.groups
    keys = []
    for g, row in enumerate(rows):
        root = bank.root_key(g)
        row.extend_keys(root, block_size)
        previous = row.keys[-1] if row.keys else root
        keys.append(chain_keys(previous, token_ids, block_size, start, wanted))
    # full groups: the leading run of blocks each holds; the sequence can resume at the shortest
    found: dict[int, list[int]] = {}
    end = start + wanted
    for g, group in enumerate(groups):
        if not group.is_sliding:
            found[g] = _look_up(bank, keys[g], g)
            end = min(end, start + len(found[g]))
    if len(found) == 0:  # every group sliding: the last boundary where all windows are stored
        end = _last_stored_window_end(bank, keys, start, block_size)
    # sliding groups: the blocks their window needs before `end` (those before `start` they hold)
    firsts: dict[int, int] = {}
    for g, group in enumerate(groups):
        if group.is_sliding and end > start:
            firsts[g] = first = max(start, group.window_start_block(end * block_size, block_size))
            found[g] = _look_up(bank, keys[g][first - start:end - start], g)
            if len(found[g]) < end - first:
                end = start  # no stored window there: nothing is reused beyond what the rows hold
    if end <= start:
        bank.store.release([b for blocks in found.values() for b in blocks])
        return
    surplus = [b for g, blocks in found.items() if not groups[g].is_sliding for b in blocks[end - start:]]
    if surplus:
        bank.store.release(surplus)
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
        bank.store.release(left_window, for_good=True)
    if not bank.seq.rows:
        bank.seq.rows = rows
    bank.seq.num_tokens = num_tokens
    bank.steps.rows_changed()


def _last_stored_window_end(bank, keys: list[list[bytes]], start: int, block_size: int) -> int:
    """For a model of sliding groups only (no full chain caps the resume point): the last block
    boundary after `start` at which every group's window blocks are in the store, else `start`."""
    groups = bank.layer_groups.groups
    held = [bank.store.holds(group_keys) for group_keys in keys]
    for end in range(start + len(keys[0]), start, -1):
        if all(all(held[g][max(start, group.window_start_block(end * block_size, block_size)) - start:end - start])
               for g, group in enumerate(groups)):
            return end
    return start


def _look_up(bank, keys: list[bytes], group: int) -> list[int]:
    """The leading run of `keys` the store holds, then the shared remote tier, each retained."""
    if not keys:
        return []
    found = bank.store.lookup_and_retain(keys)
    if len(found) < len(keys):  # the rest of the chain may be on the other processes' files or the remote tier
        missing = len(keys) - len(found)
        if _restores_by_choice(bank) and _fetch_is_slower(bank, missing):
            # (they may not all be there: counted apart from the local choices)
            bank.store.metrics.restore_choice.inc(("not_fetched",), missing * bank.config.block_size)
            return found
        found += bank.store.fetch_remote(keys[len(found):], bank.root_key(group))
    return found


def _fetch_is_slower(bank, num_blocks: int) -> bool:
    """Whether fetching `num_blocks` from the other processes' cold files and the remote tier
    would take longer than recomputing them, by every rate measured (an unmeasured source is
    tried: that measures it)."""
    store = bank.store
    recompute = store.rates.recompute_seconds(num_blocks * bank.config.block_size)
    if recompute is None:
        return False
    estimates = []
    if store.peers is not None:
        estimates.append(store.rates.load_seconds("peer", num_blocks * store.peers.layout.block_bytes))
    if store.remote is not None:
        estimates.append(store.rates.load_seconds("remote", num_blocks * store.remote.value_bytes))
    return bool(estimates) and all(e is not None and is_worth_recomputing(e, recompute) for e in estimates)


def prefetch(bank, deadline_s: float | None = None) -> None:
    """Bring this chat's blocks up the tiers ahead of its next turn (call it when the user
    starts typing). Returns at once: the store's background mover moves them, most recent
    first, ahead of its other background work, and gives up `deadline_s` seconds from now
    (None: once all are up). A turn that begins meanwhile takes the prefetch over: it waits
    for the blocks in flight and moves the rest itself. With `scheduler.background: false`
    the blocks come up before this returns."""
    bank.check_open()
    bank.steps.abandon()
    if deadline_s is not None and not deadline_s >= 0:
        raise ValueError(f"prefetch(deadline_s={deadline_s!r}): allowed None or seconds >= 0")
    if bank.seq.rows:
        bank.store.prefetch(bank.owner, bank.seq.promotion_order(), deadline_s)


def offload(bank, tier: str = "warm") -> dict:
    """Move this idle chat's blocks down to `tier` ("warm" or "cold"), freeing the tiers
    above for other chats; its next turn (or prefetch) brings them back. Returns
    stats()["bank_blocks"] afterwards: blocks that found no room stay where they were."""
    if tier not in ("warm", "cold"):
        raise ValueError(f"offload(tier={tier!r}): allowed 'warm' or 'cold'")
    bank.check_open()
    bank.steps.abandon()
    blocks = list(dict.fromkeys(b for row in bank.seq.rows for b in row.table))
    if blocks:
        bank.store.demote(blocks, TIER_NAMES.index(tier))
    return bank.stats()["bank_blocks"]


def _promote_all(bank, turn_start: bool = False) -> None:
    promote_rows(bank, bank.seq.rows, turn_start)
    drop_from_first_corrupt(bank)


def promote_rows(bank, rows: list[Row], turn_start: bool = False) -> None:
    """Move these blocks up the tiers now, then check whatever stays cold against its
    checksums rather than mid-forward. At a turn's start, first count where they were (the
    store's per-tier hit rates)."""
    order = bank.seq.promotion_order(rows)
    if not order:
        return
    store = bank.store
    tiers, _ = store.placements(order)
    if turn_start:
        count_turn_start(store.metrics, tiers)
    if (tiers == HOT).all():
        return
    before = moved_seconds(bank.store)
    store.promote(order, owner=bank.owner)
    store.verify(order)
    bank.turn.charge_moves(bank.store, before)


def drop_from_first_corrupt(bank) -> int | None:
    """Truncate every row before its first corrupt block. Returns that token position, or None."""
    first_bad = None
    for row in bank.seq.rows:
        tiers, _ = bank.store.placements(row.table)
        bad = next((row.first_block + i for i, tier in enumerate(tiers) if tier == DROPPED), None)
        if bad is not None:
            first_bad = bad if first_bad is None else min(first_bad, bad)
    if first_bad is None:
        return None
    keep = bank.seq.servable_length(min(bank.seq.num_tokens, first_bad * bank.config.block_size))
    _truncate(bank, keep)
    return keep


def _as_token_list(ids) -> list[int]:
    if isinstance(ids, torch.Tensor):
        if ids.dim() == 2:
            if ids.shape[0] != 1:
                raise ValueError(f"attach() takes one sequence; got ids of shape {tuple(ids.shape)}")
            ids = ids[0]
        return [int(x) for x in ids.tolist()]
    return [int(x) for x in ids]


__all__ = ["attach", "prefetch", "offload", "promote_rows", "drop_from_first_corrupt"]
