"""CacheBank: a transformers `Cache` whose KV lives in a TierStore's blocks.

One bank per chat (or per batch of sequences generated together). It keeps, per batch row, a
block table (logical block ids, in token order) and the token ids it knows; the store decides
which tier each block sits in. The model calls `update(k, v, layer_idx)` once per layer; at
layer 0 the bank plans the step (allocates blocks for the new tokens, maps every token to its
tier and slot) and every layer reuses that plan: write the new K/V where their blocks live,
read the layer's whole K/V back on the compute device.

Multi-turn: `generate(whole_conversation_ids, cache=bank)` computes only the tokens past
`get_seq_length()`. `attach(ids)` first checks that the bank's tokens are a prefix of `ids`
(cropping to the longest match) or, on a fresh bank, reuses the longest stored prefix by
content hash, and brings those blocks up the tiers.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .blocks import KVLayout, layout_from_model_config, num_blocks_for
from .config import Config, load_config
from .errors import CapacityError, CorruptBlockError, LayoutError
from .scheduler import HOT, TIER_NAMES
from .store import TierRun, TierStore

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float64: "float64"}


def chain_hashes(token_ids: list[int], block_size: int, num_blocks: int) -> list[bytes]:
    """Content hash of each full block: a chain, so a block's hash names its whole prefix."""
    hashes, previous = [], b"tiered_kv/v1"
    for i in range(num_blocks):
        chunk = token_ids[i * block_size:(i + 1) * block_size]
        previous = hashlib.sha256(previous + b"|" + ",".join(map(str, chunk)).encode()).digest()
        hashes.append(previous)
    return hashes


@dataclass
class _Step:
    """What layer 0 decided for one forward pass, reused by every layer."""

    num_new_tokens: int
    num_tokens: int
    write_runs: list[list[TierRun]]  # per row
    read_runs: list[list[TierRun]]  # per row


class _BankLayer(CacheLayerMixin):
    """Per-layer face that transformers' generic Cache code expects; state lives in the bank."""

    is_sliding = False
    is_compileable = False
    is_croppable = True
    supports_early_init = False

    def __init__(self, bank: "CacheBank", layer_idx: int):
        super().__init__()
        self._bank = bank
        self.layer_idx = layer_idx

    def lazy_initialization(self, key_states, value_states) -> None:  # state is allocated by the store
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        return self._bank.update(key_states, value_states, self.layer_idx)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._bank.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self._bank.get_seq_length()

    def get_max_length(self) -> int:
        return -1

    @property
    def batch_size(self) -> int:
        return len(self._bank._tables) or -1


class CacheBank(Cache):
    def __init__(self, model_config, config: Config | dict | str | None = None, *, store: TierStore | None = None):
        if store is not None and config is not None and load_config(config) != store.config:
            raise ValueError("CacheBank: `config` differs from the shared store's config; pass one or make them equal")
        self.store = store if store is not None else TierStore(config)
        self._owns_store = store is None
        self.config = self.store.config
        self._layout_no_dtype = layout_from_model_config(model_config, self.config.block_size)
        self.num_layers = self._layout_no_dtype.num_layers
        super().__init__(layers=[_BankLayer(self, i) for i in range(self.num_layers)])
        self._tables: list[list[int]] = []  # per row: block ids in token order
        self._token_ids: list[list[int]] = []  # per row: ids of the first len(...) tokens, when known
        self._seq_len = 0
        self._step: _Step | None = None
        self._closed = False

    # ---- transformers Cache contract -------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if layer_idx == 0 or self._step is None:
            self._begin_step(key_states)
        step = self._step
        kv_new = torch.stack((key_states, value_states))  # [2, B, H, t, D]
        rows = []
        try:
            for row in range(kv_new.shape[1]):
                self.store.write_layer(layer_idx, step.write_runs[row], kv_new[:, row])
                rows.append(self.store.read_layer(layer_idx, step.read_runs[row], step.num_tokens))
        except CorruptBlockError as error:
            # never serve it: drop the bank back to before the bad block so a retry recomputes it
            self._step = None
            first_bad = self._truncate_before_corrupt(step.num_tokens - step.num_new_tokens)
            raise CorruptBlockError(
                f"{error}; the bank dropped everything from token {first_bad} on. "
                "Call generate again with the whole conversation to recompute it"
            ) from error
        kv = rows[0].unsqueeze(1) if len(rows) == 1 else torch.stack(rows, dim=1)
        if layer_idx == self.num_layers - 1:
            self._end_step()
        return kv[0], kv[1]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._seq_len

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self._seq_len + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    @property
    def batch_size(self) -> int:
        return len(self._tables) or -1

    @property
    def is_compileable(self) -> bool:
        return False

    def crop(self, tokens_to_remove: int) -> None:
        """Drop `-tokens_to_remove` tokens from the end (transformers' convention: a negative count)."""
        if tokens_to_remove > 0:
            raise ValueError(
                f"CacheBank.crop({tokens_to_remove}): pass a negative count of tokens to remove (or use truncate(n))"
            )
        if tokens_to_remove < 0:
            self.truncate(max(0, self._seq_len + tokens_to_remove))

    def truncate(self, num_tokens: int) -> None:
        """Keep only the first `num_tokens` tokens of every row."""
        if not 0 <= num_tokens <= self._seq_len:
            raise ValueError(f"truncate({num_tokens}): allowed 0..{self._seq_len}")
        keep_blocks = num_blocks_for(num_tokens, self.config.block_size)
        for row, table in enumerate(self._tables):
            self.store.release(table[keep_blocks:])
            del table[keep_blocks:]
            del self._token_ids[row][num_tokens:]
        self._seq_len = num_tokens
        if num_tokens == 0:
            self._tables, self._token_ids = [], []
        self._step = None

    def reset(self) -> None:
        self.truncate(0)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select_rows([int(i) for i in beam_idx.tolist()])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select_rows([int(i) for i in torch.as_tensor(indices).tolist()])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select_rows([row for row in range(len(self._tables)) for _ in range(repeats)])

    def _select_rows(self, rows: list[int]) -> None:
        """New rows are copies of old rows by index; full blocks are shared (ref-counted) and a
        shared partial tail is copied before its next write (copy-on-write)."""
        if not self._tables:
            return
        new_tables = [list(self._tables[r]) for r in rows]
        new_token_ids = [list(self._token_ids[r]) for r in rows]
        for table in new_tables:
            self.store.retain(table)
        for table in self._tables:
            self.store.release(table)
        self._tables, self._token_ids = new_tables, new_token_ids

    # ---- one forward pass ------------------------------------------------------------------
    def _begin_step(self, key_states: torch.Tensor) -> None:
        batch_size, num_heads, num_new, head_dim = key_states.shape
        self._bind(key_states)
        if not self._tables:
            self._tables = [[] for _ in range(batch_size)]
            self._token_ids = [[] for _ in range(batch_size)]
        elif batch_size != len(self._tables):
            raise LayoutError(
                f"CacheBank holds {len(self._tables)} sequences but the model passed a batch of {batch_size}; "
                "use batch_select_indices / batch_repeat_interleave, or reset() the bank"
            )
        block_size = self.config.block_size
        num_tokens = self._seq_len + num_new
        self._check_fits(len(self._tables), num_tokens)
        self._prepare_tail_for_write()
        needed = [num_blocks_for(num_tokens, block_size) - len(table) for table in self._tables]
        new_ids = self.store.allocate(sum(needed))  # raises CapacityError with nothing changed
        for table, count in zip(self._tables, needed):
            table.extend(new_ids[:count])
            del new_ids[:count]
        if num_new > 1:  # a new turn: bring this chat's history up before reading it every layer
            self._promote_or_fail()
        write_runs, read_runs = [], []
        for table in self._tables:
            write_runs.append(self.store.map_range(table, self._seq_len, num_tokens))
            read_runs.append(self.store.map_range(table, 0, num_tokens))
        all_blocks = self._all_block_ids()
        self.store.index.touch(all_blocks)
        self.store.count_hits(all_blocks)
        self._seq_len = num_tokens
        self._step = _Step(num_new, num_tokens, write_runs, read_runs)

    def _all_block_ids(self) -> list[int]:
        """Every row's blocks, row after row (a block shared by rows appears once per row)."""
        return [b for table in self._tables for b in table]

    def _check_fits(self, num_rows: int, num_tokens: int) -> None:
        """CapacityError when `num_rows` sequences of `num_tokens` cannot fit in all tiers at once."""
        if not self.store.is_bound:
            return
        block_size = self.config.block_size
        total_blocks = num_rows * num_blocks_for(num_tokens, block_size)
        if total_blocks > self.store.total_capacity_blocks:
            hot, warm, cold = self.store.capacities
            raise CapacityError(
                f"this conversation needs {total_blocks} blocks ({num_rows} x {num_tokens} tokens, "
                f"{block_size} tokens per block) but hot+warm+cold hold {self.store.total_capacity_blocks} blocks "
                f"(hot {hot}, warm {warm}, cold {cold}); nothing was written. "
                "Raise a tier's capacity or shorten the conversation"
            )

    def _end_step(self) -> None:
        self._step = None
        self.store.end_step()
        self._hash_full_blocks()

    def _bind(self, key_states: torch.Tensor) -> None:
        dtype_name = _DTYPE_NAMES.get(key_states.dtype)
        if dtype_name is None:
            raise LayoutError(f"key_states dtype {key_states.dtype} is not supported; allowed: {list(_DTYPE_NAMES)}")
        base = self._layout_no_dtype
        layout = KVLayout(base.num_layers, base.num_kv_heads, base.head_dim, base.block_size, dtype_name)
        _, num_heads, _, head_dim = key_states.shape
        if (num_heads, head_dim) != (layout.num_kv_heads, layout.head_dim):
            raise LayoutError(
                f"key_states have {num_heads} heads x {head_dim} dims but the model config says "
                f"num_key_value_heads={layout.num_kv_heads}, head_dim={layout.head_dim}"
            )
        self.store.bind(layout, key_states.dtype)
        if key_states.device != self.store.device:
            raise LayoutError(
                f"the model runs on {key_states.device} but the hot tier is on {self.store.device}; "
                f"set hot.device to '{key_states.device}' or move the model"
            )

    def _prepare_tail_for_write(self) -> None:
        """A partly filled last block is about to change: copy it if shared, unhash it if cached."""
        if self._seq_len % self.config.block_size == 0:
            return
        for table in self._tables:
            tail = table[-1]
            entry = self.store.index.get(tail)
            if entry.ref_count > 1:
                table[-1] = self.store.copy_block(tail)
                self.store.release([tail])
            elif entry.content_hash is not None:
                self.store.unregister_hash(tail)

    def _hash_full_blocks(self) -> None:
        """Give every full block whose tokens are all known a content hash (for attach/reuse)."""
        block_size = self.config.block_size
        for table, token_ids in zip(self._tables, self._token_ids):
            num_full = min(len(token_ids), self._seq_len) // block_size
            pending = [i for i in range(num_full) if self.store.index.get(table[i]).content_hash is None]
            if not pending:
                continue
            hashes = chain_hashes(token_ids, block_size, num_full)
            for i in pending:
                self.store.register_hash(table[i], hashes[i])

    def _promote_or_fail(self) -> None:
        corrupt = self._promote()
        if corrupt is not None:
            raise CorruptBlockError(
                f"a stored block failed its checksum; the bank dropped everything from token {corrupt} on. "
                "Call generate again with the whole conversation to recompute it"
            )

    def _promote(self) -> int | None:
        """Move this bank's blocks up the tiers. Returns the first token position that had to be
        dropped because its block failed a checksum (the bank is truncated there), else None."""
        blocks = self._all_block_ids()
        if all(self.store.index.get(b).tier == HOT for b in blocks):
            return None
        # most recent blocks first: they are the likeliest to be read again soon
        order = [table[i] for i in range(max(map(len, self._tables)) - 1, -1, -1) for table in self._tables if i < len(table)]
        self.store.promote(order)
        self.store.verify(blocks)  # whatever stays cold is checked now, not mid-forward
        return self._truncate_before_corrupt(self._seq_len)

    def _truncate_before_corrupt(self, num_valid_tokens: int) -> int | None:
        """Truncate every row before its first corrupt block (and to at most `num_valid_tokens`).
        Returns the first dropped token position when a corrupt block was found, else None."""
        bad = self.store.corrupt_block_ids
        first_bad = min((i for table in self._tables for i, b in enumerate(table) if b in bad), default=None)
        keep = min(self._seq_len, num_valid_tokens)
        if first_bad is not None:
            keep = min(keep, first_bad * self.config.block_size)
        if keep < self._seq_len:
            self.truncate(keep)
        return None if first_bad is None else keep

    # ---- chat-level API --------------------------------------------------------------------
    def attach(self, ids) -> int:
        """Reuse as much stored KV as matches `ids` (the whole conversation, one sequence).

        Returns the number of leading tokens whose KV is reused; generate() computes the rest.
        At least one token is always left to compute. Tokens the bank computed but never saw
        (generated ones) are taken from `ids`, so pass the ids generate() returned."""
        token_ids = self._as_token_list(ids)
        if len(self._tables) > 1:
            raise ValueError(f"attach() serves one sequence; this bank holds {len(self._tables)} (call reset())")
        self._check_fits(1, len(token_ids))  # fail before generate() runs any forward pass
        limit = len(token_ids) - 1
        if self._tables:
            known = self._token_ids[0]
            if len(known) < self._seq_len:  # adopt the generated tokens' ids
                known.extend(token_ids[len(known):self._seq_len])
            match = 0
            for a, b in zip(known[: self._seq_len], token_ids):
                if a != b:
                    break
                match += 1
            self.truncate(min(match, limit, self._seq_len))
        if not self._tables:
            self._attach_from_store(token_ids, limit)
        elif self._seq_len % self.config.block_size == 0 and self._seq_len < limit:
            self._extend_from_store(token_ids, limit)
        if self._tables:
            self._hash_full_blocks()
            self._promote()
        return self._seq_len

    def _attach_from_store(self, token_ids: list[int], limit: int) -> None:
        self._tables, self._token_ids = [[]], [[]]
        self._extend_from_store(token_ids, limit)
        if not self._tables[0]:
            self._tables, self._token_ids = [], []

    def _extend_from_store(self, token_ids: list[int], limit: int) -> None:
        block_size = self.config.block_size
        table = self._tables[0]
        hashes = chain_hashes(token_ids, block_size, limit // block_size)
        found = []
        for content_hash in hashes[len(table):]:
            block_id = self.store.lookup(content_hash)
            if block_id is None:
                self.store.misses += 1
                break
            found.append(block_id)
        self.store.retain(found)
        table.extend(found)
        self._seq_len = len(table) * block_size
        self._token_ids[0] = list(token_ids[: self._seq_len])

    def prefetch(self) -> None:
        """Bring this chat's blocks up the tiers ahead of its next turn."""
        self._promote()

    def offload(self, tier: str = "warm") -> dict:
        """Move this idle chat's blocks down to `tier` ("warm" or "cold"), freeing the tiers
        above for other chats; its next turn (or prefetch) brings them back. Returns
        stats()["bank_blocks"] afterwards: blocks that found no room stay where they were."""
        if tier not in ("warm", "cold"):
            raise ValueError(f"offload(tier={tier!r}): allowed 'warm' or 'cold'")
        blocks = self._all_block_ids()
        if blocks:
            self.store.demote(blocks, TIER_NAMES.index(tier))
        return self.stats()["bank_blocks"]

    @staticmethod
    def _as_token_list(ids) -> list[int]:
        if isinstance(ids, torch.Tensor):
            if ids.dim() == 2:
                if ids.shape[0] != 1:
                    raise ValueError(f"attach() takes one sequence; got ids of shape {tuple(ids.shape)}")
                ids = ids[0]
            return [int(x) for x in ids.tolist()]
        return [int(x) for x in ids]

    # ---- reporting / teardown --------------------------------------------------------------
    def stats(self) -> dict:
        out = self.store.stats()
        per_tier = {name: 0 for name in TIER_NAMES}
        for table in self._tables:
            for block_id in table:
                tier = self.store.index.get(block_id).tier
                if tier >= 0:
                    per_tier[TIER_NAMES[tier]] += 1
        out["bank_blocks"] = per_tier
        out["seq_tokens"] = self._seq_len
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.store.is_bound and not getattr(self.store, "_closed", False):
            self.truncate(0)
        if self._owns_store:
            self.store.close()

    def __repr__(self) -> str:
        return f"CacheBank(rows={len(self._tables)}, tokens={self._seq_len}, block_size={self.config.block_size})"
