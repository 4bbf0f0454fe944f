"""Attention mass per block, measured on sampled decode steps (issue 37; config `attention`).

A sampled step is a one-token decode step of one row over one full-attention layer group, whose
forward the hooks serve (tiered_kv.hooks: their attention functions see the queries). On it, the
sampled layers (`attention.sample_layers` of them, spread evenly) compute the step's attention
probabilities once more, softmax(q.K / sqrt(d)) over the chat's tokens averaged over the query
heads, and sum them per block: each block's share of the step's attention. The shares, averaged
over the step's sampled layers, go to the scheduler's access log at the step's last sampled layer
(ids and floats: `Placement.record_attention`), where `scheduler.attention_weight` places by them.
Steps are picked deterministically, `sample_steps` of the decode steps (every 20th at 0.05).

Reported: `stats()["attention"]` (sampled steps, the share of the mass each tier served, averaged
like a block's), `tiered-kv diagnose`, the metrics gauge `tiered_kv_attention_mass_share{tier}`.

The probe rides the same thread-local as a paged step's plan (plan.py `expected_plans.probe`): set
when a step is prepared, cleared when it commits or is rolled back.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..blocks import TIER_NAMES
from .plan import expected_plans


def sampled_layers(num_layers: int, share: float) -> frozenset[int]:
    """`share` of the layers, spread evenly (layer 0 first); none at share 0."""
    count = min(num_layers, int(math.ceil(share * num_layers))) if share > 0 else 0
    if not count:
        return frozenset()
    return frozenset(int(i * num_layers / count) for i in range(count))


class StepProbe:
    """One sampled step: the row's blocks, and the mass the sampled layers found on them."""

    def __init__(self, sampler: "AttentionSampler", table: list[int], tiers: np.ndarray, num_tokens: int,
                 layers: frozenset[int]):
        self.sampler, self.table, self.tiers, self.num_tokens = sampler, table, tiers, num_tokens
        self.layers, self.last_layer = layers, max(layers)
        self.total: torch.Tensor | None = None  # per block, summed over the layers seen (on the device)
        self.counts: torch.Tensor | None = None  # per block, the layers that measured it
        self.seen = 0

    def wants(self, layer: int) -> bool:
        return layer in self.layers

    def observe(self, layer: int, query: torch.Tensor, key: torch.Tensor, scale: float,
                block_positions: torch.Tensor | None = None) -> None:
        """`query` `[1, Hq, q, D]` (its last position is the step's token), `key` `[1, H, n, D]`:
        the chat's n tokens in order, or (`block_positions`) the tokens of those blocks, in order
        (a sparse step's: the blocks it skipped drew nothing this step)."""
        if layer not in self.layers:
            return
        heads = key.shape[1]
        q = query[0, :, -1, :].float()
        groups = q.shape[0] // heads
        scores = torch.matmul(q.view(heads, groups, -1), key[0].float().transpose(1, 2)) * scale  # [H, g, n]
        probs = torch.softmax(scores, dim=-1).mean(dim=(0, 1))  # [n]
        bs = self.sampler.block_size
        num_blocks = len(self.table)
        if block_positions is None:
            padded = torch.zeros(num_blocks * bs, dtype=probs.dtype, device=probs.device)
            padded[:probs.shape[0]] = probs[:num_blocks * bs]
            per_block = padded.view(num_blocks, bs).sum(dim=1)
        else:  # the tokens of `block_positions` (in that order), the last block possibly partial
            owner = torch.repeat_interleave(block_positions, bs)[:probs.shape[0]]
            per_block = torch.zeros(num_blocks, dtype=probs.dtype, device=probs.device)
            per_block.index_add_(0, owner, probs)
        seen = torch.ones(num_blocks, dtype=probs.dtype, device=probs.device)
        if block_positions is not None:  # a sparse step: the blocks it skipped were not measured (not 0)
            seen.zero_()[block_positions] = 1
        self.total = per_block if self.total is None else self.total + per_block
        self.counts = seen if self.counts is None else self.counts + seen
        self.seen += 1
        if layer == self.last_layer:
            self.sampler.record(self)


class AttentionSampler:
    """A bank's sampling of its decode steps and what it reports (module docstring)."""

    def __init__(self, config, store, num_layers: int, block_size: int):
        self.config, self.store, self.block_size = config, store, block_size
        self.layers = sampled_layers(num_layers, config.sample_layers)
        self.decode_steps = 0
        self.sampled_steps = 0
        self.tier_shares = {name: 0.0 for name in TIER_NAMES}

    def probe_for(self, table: list[int], tiers: np.ndarray, num_tokens: int) -> StepProbe | None:
        """A probe when this decode step is sampled, else None (counts the step)."""
        share = self.config.sample_steps
        n = self.decode_steps
        self.decode_steps += 1
        if not self.layers or share <= 0 or math.floor((n + 1) * share) == math.floor(n * share) or not table:
            return None
        return StepProbe(self, table, tiers, num_tokens, self.layers)

    def record(self, probe: StepProbe) -> None:
        counts = probe.counts.cpu().numpy()
        measured = counts > 0
        masses = (probe.total.cpu().numpy().astype(np.float64) / np.maximum(counts, 1))[measured]
        tiers = probe.tiers[:len(counts)][measured]
        total = float(masses.sum())
        shares = {name: float(masses[tiers == tier].sum()) / total if total > 0 else 0.0
                  for tier, name in enumerate(TIER_NAMES)}
        self.store.placement.record_attention(np.asarray(probe.table, dtype=np.int64)[measured], masses,
                                              self.config.decay, shares)
        weight = max(1.0 - self.config.decay, 1.0 / (self.sampled_steps + 1))
        for name, value in shares.items():
            self.tier_shares[name] += (value - self.tier_shares[name]) * weight
        self.sampled_steps += 1

    def report(self) -> dict:
        return {"sample_steps": self.config.sample_steps, "sampled_layers": sorted(self.layers),
                "decode_steps": self.decode_steps, "sampled_steps": self.sampled_steps,
                "mass_share_by_tier": dict(self.tier_shares) if self.sampled_steps else {}}


def set_probe(probe: StepProbe | None) -> None:
    expected_plans.probe = probe


__all__ = ["AttentionSampler", "StepProbe", "set_probe", "sampled_layers"]
