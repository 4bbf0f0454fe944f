"""What a bank's steps do for attention-aware tiers (issue 37): the step machine asks once per step.

`prepare` runs after a step's plan is made: a sampled decode step gets its probe
(attention_stats.py); with `attention.sparse` on, every step of one row over one full-attention
group writes its keys' summaries (sparse.py), and a one-token decode step in the hooks' merge mode
whose history lies partly below hot and is all summarised becomes a sparse step (`plan.read_kind`
"sparse": update() hands back the new token, attention reads the blocks it picks). `committed` and
`rolled_back` end the step.
"""

from __future__ import annotations

import numpy as np

from ..blocks import DROPPED, HOT
from .attention_stats import AttentionSampler, set_probe
from .plan import expect_paged
from .sparse import KeySummaries, SparseStep


class AttentionSteps:
    def __init__(self, bank):
        self.bank = bank
        self.config = bank.config.attention
        self.sampler: AttentionSampler | None = None  # made at the first step (the layer count is known)
        self.summaries = KeySummaries(bank.num_layers, bank.config.block_size) if self.config.sparse.enabled else None
        self.sparse_report = {"steps": 0, "blocks_below_hot": 0, "blocks_read_below_hot": 0}
        self._pending: tuple[int, int, bool] | None = None  # the open step's summary writes (start, end, whole)
        self._whole_done = False  # the open step summarised the whole row from what it read
        self._known_table: list[int] = []  # the row's block ids the summaries describe, by position
        self._pending_table: list[int] = []  # the open step's (known once it commits)

    def prepare(self, step, plan, mode: str | None) -> None:
        set_probe(None)
        self._pending = None
        plan.probe = None
        if plan.is_grouped or step.num_rows != 1 or step.compiled:
            return
        row = plan.lease.rows[0]
        table, tiers = list(row.table), np.asarray(row.tiers)
        probe = None
        if step.num_new_tokens == 1 and mode is not None and step.forward_seen:
            if self.sampler is None:
                self.sampler = AttentionSampler(self.config, self.bank.store, self.bank.num_layers,
                                                self.bank.config.block_size)
            probe = self.sampler.probe_for(table, tiers, row.num_tokens)
            set_probe(probe)
            plan.probe = probe
        if self.summaries is None or row.skipped_new_tokens:
            return
        whole = self._summarise(row, table)
        layer = plan.layer
        if step.num_new_tokens == 1 and mode == "merge" and step.forward_seen and not whole \
                and bool((tiers != HOT).any()) and not bool((tiers == DROPPED).any()):
            plan.sparse = SparseStep(self.summaries, self.config.sparse, self.bank.store.opening.mapper, row,
                                     self.sparse_report, probe, self.bank.store.device_slab)
            plan.read_kind, layer = "sparse", plan._paged_layer
            expect_paged(plan)  # attention without the plan would see only the new token: it raises
            step.expects_paged = True
        plan.layer = _summarising(self, layer, row)

    def _summarise(self, row, table: list[int]) -> bool:
        """The step's summary writes (`_pending`); True when some earlier block has no summary
        (restored by attach, or its block changed): then a step that reads the whole row summarises
        every block from what it read."""
        summaries, bs = self.summaries, self.bank.config.block_size
        start, end = row.write_start, row.write_end
        changed = [i for i, (a, b) in enumerate(zip(table, self._known_table)) if a != b]  # (attach, another chat's rows)
        if changed:
            summaries.forget(changed)
        self._pending_table = table
        first = start // bs
        whole = not summaries.complete(first) or (start % bs != 0 and not summaries.complete(first + 1))
        self._pending = (start, end, whole)
        return whole

    def committed(self) -> None:
        set_probe(None)
        if self._pending is not None:
            start, end, whole = self._pending
            self.summaries.committed(start, end, whole and self._whole_done)
            self._known_table = self._pending_table
        self._pending = None

    def rolled_back(self) -> None:  # (summaries it widened still bound their blocks)
        set_probe(None)
        self._pending = None

    def report(self) -> dict:
        out = self.sampler.report() if self.sampler is not None else \
            {"sample_steps": self.config.sample_steps, "decode_steps": 0, "sampled_steps": 0, "mass_share_by_tier": {}}
        if self.summaries is not None:
            r = self.sparse_report
            out["sparse"] = {"budget": self.config.sparse.budget, **r,
                             "read_share_below_hot": r["blocks_read_below_hot"] / r["blocks_below_hot"]
                             if r["blocks_below_hot"] else None}
        return out


def _summarising(steps: AttentionSteps, inner, row):
    """`inner` (a plan's layer function), writing the layer's new keys into the summaries first and,
    for a step that must summarise the whole row, from the K it returns when that is the whole row."""
    start, num_tokens, last = row.write_start, row.num_tokens, steps.bank.num_layers - 1
    steps._whole_done = False

    def layer(layer_idx, key, value, seam):
        if key.shape[0] == 1:
            steps.summaries.write(layer_idx, start, key)
        out = inner(layer_idx, key, value, seam)
        if steps._pending is not None and steps._pending[2] and out[0].shape[-2] == num_tokens and out[0].shape[0] == 1:
            steps.summaries.write(layer_idx, 0, out[0])
            if layer_idx == last:
                steps._whole_done = True
        return out

    return layer


__all__ = ["AttentionSteps"]
