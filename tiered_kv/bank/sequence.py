"""A bank's sequences: its rows, their length and the blocks they hold. Ids only, no torch.

One Row (rows.py) per batch row and layer group (layer_groups.py; one group for a full-attention
model), batch-row-major; every row holds `num_tokens` tokens (a sliding group's row only the
blocks its window still reads). `block_set` is every block a row references: what a step pins.
The step machine (steps.py) changes these only when a step commits or rolls back; the bank's
public operations (truncate, batch selection, attach) change them between steps.
"""

from __future__ import annotations

import itertools

from .rows import Row


class Sequence:
    def __init__(self, layer_groups, block_size: int):
        self.layer_groups = layer_groups
        self.block_size = block_size
        self.rows: list[Row] = []
        self.num_tokens = 0
        self.block_set: set[int] = set()  # every block any row references (pinned during a step)
        self.left_window: list[int] = []  # blocks sliding rows left, freed for good once their step ended

    @property
    def num_groups(self) -> int:
        return len(self.layer_groups)

    @property
    def batch_size(self) -> int:
        return len(self.rows) // self.num_groups or -1

    def rows_and_groups(self):
        """`(row, its LayerGroup)` for every row (batch-row-major, a group each)."""
        return zip(self.rows, itertools.cycle(self.layer_groups.groups))

    def block_table(self, row: int, group: int) -> list[int]:
        index = row * self.num_groups + group
        return list(self.rows[index].table) if index < len(self.rows) else []

    def changed(self) -> None:
        """The rows' tables changed outside a step: the pinned set follows."""
        self.block_set = {b for row in self.rows for b in row.table}

    def all_blocks(self) -> list[int]:
        return [b for row in self.rows for b in row.table]

    # ---- lengths a sliding window still serves ------------------------------------------------
    def servable_length(self, num_tokens: int) -> int:
        """`num_tokens` when every sliding row still holds the window a sequence of that length
        needs, else 0 (the whole sequence is recomputed)."""
        bs = self.block_size
        for row, group in self.rows_and_groups():
            if group.is_sliding and row.first_block * bs > max(0, num_tokens - (group.window - 1)):
                return 0
        return num_tokens

    def shortest_servable(self) -> int:
        bs = self.block_size
        return max([row.first_block * bs + group.window - 1 for row, group in self.rows_and_groups()
                    if group.is_sliding and row.first_block] or [0])

    # ---- changes between steps ----------------------------------------------------------------
    def truncate(self, num_tokens: int) -> list[int]:
        """Keep the first `num_tokens` tokens of every row; returns the block ids let go."""
        dropped = [b for row in self.rows for b in row.truncate(num_tokens, self.block_size)]
        self.num_tokens = num_tokens
        if num_tokens == 0:
            self.rows = []
        self.changed()
        return dropped

    def select(self, row_indices: list[int]) -> list[Row]:
        """New batch rows: copies of old ones by index (their blocks shared); returns the old rows."""
        old_rows, num_groups = self.rows, self.num_groups
        self.rows = [old_rows[r * num_groups + g].copy() for r in row_indices for g in range(num_groups)]
        self.changed()
        return old_rows

    def promotion_order(self, rows: list[Row] | None = None) -> list[int]:
        """Block ids most recent first (likeliest to be read again soon), each once: by sequence
        position, so a sliding group's window comes up with the full groups' newest blocks."""
        rows = self.rows if rows is None else rows
        end = max((row.end_block for row in rows), default=0)
        return list(dict.fromkeys(row.block_at(p) for p in range(end - 1, -1, -1) for row in rows
                                  if row.first_block <= p < row.end_block))

    # ---- a step's commit -----------------------------------------------------------------------
    def apply_lease(self, lease, num_tokens: int) -> tuple[list[int], list[int]]:
        """The tables as `lease` left them once its step ran: copies on write, new blocks, what
        sliding rows left behind. Returns (tails replaced by their copies, blocks that left a
        window); the bank's length becomes `num_tokens`."""
        replaced, left_window, bs, before = [], [], self.block_size, self.num_tokens
        for leased, (row, group) in zip(lease.rows, self.rows_and_groups()):
            if leased.tail_copy is not None:
                old_tail, row.table[-1] = leased.tail_copy
                replaced.append(old_tail)
            if leased.skipped_new_tokens:  # gapped: what it held is out of the window
                left_window += row.restart_at((before + leased.skipped_new_tokens) // bs)
            if leased.new_blocks:
                row.table.extend(leased.new_blocks)
            if group.is_sliding:  # what the window left is never read again: not published, freed
                left_window += row.drop_before(group.first_needed_block(num_tokens, bs))
        self.num_tokens = num_tokens
        if replaced or left_window:
            self.changed()
        else:
            self.block_set.update(lease.allocated_block_ids)
        self.left_window += left_window
        return replaced, left_window

    def record_inputs(self, inputs, num_tokens_before: int, num_tokens_after: int) -> None:
        """A committed step's token ids (`inputs[batch row]`: RowInputs), and whether they are
        verified, appended to rows that held exactly the tokens before it."""
        num_groups = self.num_groups
        for s, row in enumerate(self.rows):
            given = inputs[s // num_groups]
            if given.token_ids is not None and len(row.token_ids) == num_tokens_before:
                row.token_ids.extend(given.token_ids)
                if given.verified and row.num_verified_tokens == num_tokens_before:
                    row.num_verified_tokens = num_tokens_after

    def publishable(self, root_of_group) -> list[tuple[int, bytes, bytes]]:
        """Every row's newly full, verified blocks with their keys (chained from
        `root_of_group(group index)`), O(new blocks); they count as published from here on."""
        bs, num_groups, items = self.block_size, self.num_groups, []
        for s, row in enumerate(self.rows):
            root = root_of_group(s % num_groups)
            row.extend_keys(root, bs)
            publishable = row.num_publishable_blocks(bs)
            items += [(row.block_at(i), row.keys[i], root) for i in range(max(row.num_published_blocks, row.first_block),
                                                                          publishable)]
            row.num_published_blocks = max(row.num_published_blocks, publishable)
        return items

    def kv_bytes(self, layout, num_layers: int) -> dict:
        """Bytes of KV the rows hold, per layer type, beside what one DynamicLayer per layer
        (every token of every layer) would hold: `full_attention_equivalent`."""
        if layout is None:
            return {"total": 0, "full_attention_equivalent": 0}
        layer_bytes = layout.layer_bytes
        out: dict[str, int] = {}
        for row, group in self.rows_and_groups():
            out[group.layer_type] = out.get(group.layer_type, 0) + len(row.table) * len(group.layers) * layer_bytes
        out["total"] = sum(out.values())
        per_token_layer = layer_bytes // layout.block_size
        out["full_attention_equivalent"] = \
            self.batch_size * self.num_tokens * num_layers * per_token_layer if self.rows else 0
        return out


__all__ = ["Sequence"]
