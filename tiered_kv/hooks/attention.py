"""The attention functions registered by `install`: exact and merge.

A CacheBank prepares each step before layer 0 (bank/plan.py) and hands every layer's whole K/V
back from `update()`: views of the blocks where they lie when a row's tokens are one run of the
device slab, else one gather per layer into a buffer it reuses. Attention over them is
transformers' own sdpa, so both functions below are sdpa for every step but one kind:

exact: sdpa over the K/V the cache returned. On CUDA the bank lays them out as DynamicCache does
(contiguous; a strided view of the hot slab may make SDPA pick another kernel, and the logits
differ in the last bits), so the logits are bitwise equal to sdpa over a DynamicCache.

merge: on CUDA the bank may hand strided views (no copy of a contiguous history), and a decode step
whose blocks lie in hot and page-locked warm runs the native paged decode kernel: it reads every
block where it lies (warm through UVA), one launch per layer, and `update()` returned only the
new token. The step's plan travels to attention in the kwargs dict the model passes to both
(`PAGED_KEY`); should the model hand attention another dict, attention over the new token alone
would be silently wrong, so that raises (`MissingPlan`). Each row's mask must be one run of ones
after its left padding, as generate() makes it. Float32 accumulation: equal to exact within ~1e-6
relative, not bitwise. On CPU (no native kernels) merge is exact.

Both functions attend a BankBatch's rows each over its own K/V (`BATCH_KEY`: bank/batch_attention.py).
"""

from __future__ import annotations

from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ..bank.batch_attention import BATCH_KEY
from ..bank.plan import PAGED_KEY, MissingPlan, expected_plans


def exact_attention(module, query, key, value, attention_mask, **kwargs):
    rows = kwargs.pop(BATCH_KEY, None)
    if rows is not None:  # a BankBatch: each row over its own K/V (bank/batch_attention.py)
        return rows.attend(module, query, **kwargs), None
    if getattr(expected_plans, "plan", None) is not None:  # (a paged step's: see the module docstring)
        _missing_plan(module)
    if getattr(expected_plans, "probe", None) is not None:  # a sampled step (no call a layer otherwise)
        _observe(module, query, key, kwargs.get("scaling"))
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def merge_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    rows = kwargs.pop(BATCH_KEY, None)
    if rows is not None:  # a BankBatch: each row over its own K/V (bank/batch_attention.py)
        return rows.attend(module, query, dropout=dropout, scaling=scaling, **kwargs), None
    plan = kwargs.pop(PAGED_KEY, None)
    if plan is None:
        if getattr(expected_plans, "plan", None) is not None:
            _missing_plan(module)
        if getattr(expected_plans, "probe", None) is not None:
            _observe(module, query, key, scaling)
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return plan.attend(module, query, attention_mask, scale), None


def _observe(module, query, key, scaling) -> None:
    """A sampled step's layer (bank/attention_stats.py) measures its attention mass per block."""
    probe, layer = expected_plans.probe, getattr(module, "layer_idx", None)
    if probe.wants(layer) and key.shape[0] == 1 and key.shape[-2] == probe.num_tokens:
        probe.observe(layer, query, key, scaling if scaling is not None else query.shape[-1] ** -0.5)


def _missing_plan(module) -> None:
    raise MissingPlan(
            f"tiered_kv.hooks: layer {getattr(module, 'layer_idx', '?')}'s attention did not get its step's plan, "
            "which the CacheBank left in the kwargs passed to cache.update() (the model handed attention another "
            "kwargs dict); the K/V it got hold only the new tokens. This model does not fit the hooks' merge mode: "
            "install them with mode='exact' or uninstall them (tiered_kv.hooks.uninstall(model))")


__all__ = ["exact_attention", "merge_attention", "MissingPlan"]
