"""A BankBatch whose rows' steps are all paged (hooks merge mode: every block where the native
paged decode kernel reads it) attends every row in one kernel launch per layer, with each row's
own block table and length. The kernel's torch reference runs here (same signature as native/)."""

from __future__ import annotations

import pytest
import torch
from helpers import VOCAB, tier_config, tiny_model

import tiered_kv
from tiered_kv import hooks
from tiered_kv.bank import batch_attention, plan


@pytest.fixture
def model():
    m = tiny_model("llama")
    yield m
    hooks.uninstall(m)


def _prompt(seed: int, length: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


def _decode_alone(model, store, ids, steps: int) -> list[torch.Tensor]:
    bank = tiered_kv.CacheBank(model, store=store)
    out = []
    with torch.no_grad():
        logits = model(ids, cache=bank, use_cache=True, logits_to_keep=1).logits[:, -1]
        for _ in range(steps):
            out.append(logits[0])
            logits = model(logits.argmax(-1, keepdim=True), cache=bank, use_cache=True).logits[:, -1]
    bank.close()
    return out


@pytest.mark.parametrize("kind", ("all_hot", "forces_warm"))
def test_paged_rows_attend_in_one_launch_a_layer(kind, model, tmp_path, monkeypatch):
    monkeypatch.setattr(plan, "PAGED_ON_CPU", True)
    store = tiered_kv.TierStore(tier_config(kind, tmp_path))
    prompts = [_prompt(seed, length) for seed, length in ((1, 19), (2, 33), (3, 7))]
    steps = 6
    first = tiered_kv.CacheBank(model, store=store)
    hooks.install(model, first, mode="merge")
    first.close()
    expected = [_decode_alone(model, store, ids, steps) for ids in prompts]

    launches = []
    from tiered_kv.kernels import ops
    real = ops.paged_decode

    def counted(query, *args, **kwargs):
        launches.append(query.shape[0])
        return real(query, *args, **kwargs)

    import dataclasses

    from tiered_kv.bank import steps as steps_module
    counting = dataclasses.replace(ops, paged_decode=counted)
    monkeypatch.setattr(steps_module, "paged_kernels", lambda: counting)
    banks = [tiered_kv.CacheBank(model, store=store) for _ in prompts]
    logits = []
    with torch.no_grad():
        for bank, ids in zip(banks, prompts):
            logits.append(model(ids, cache=bank, use_cache=True, logits_to_keep=1).logits[0, -1])
        got = [[] for _ in prompts]
        for _ in range(steps):
            for r, row in enumerate(logits):
                got[r].append(row)
            ids = torch.stack([row.argmax(-1) for row in logits])[:, None]
            out = tiered_kv.forward_rows(model, banks, ids)
            assert out.rows == [0, 1, 2] and not out.failed
            logits = list(out.logits[:, -1])
    for r in range(len(prompts)):
        for a, b in zip(got[r], expected[r]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    layers = model.config.num_hidden_layers
    assert launches == [3] * (steps * layers)  # one launch a layer for all three rows
    assert all(bank.stats()["hooks"]["steps_by_read"]["paged"] == steps for bank in banks)
    assert [bank.get_seq_length() for bank in banks] == [p.shape[1] + steps for p in prompts]
    for bank in banks:
        bank.close()
    store.close()


def test_rows_not_all_paged_attend_one_by_one(model, tmp_path):
    """Without the paged kernel, each row's sdpa over its own K/V (no joined launch)."""
    store = tiered_kv.TierStore(tier_config("all_hot", tmp_path))
    banks = [tiered_kv.CacheBank(model, store=store) for _ in range(2)]
    with torch.no_grad():
        for bank, ids in zip(banks, (_prompt(5, 9), _prompt(6, 12))):
            model(ids, cache=bank, use_cache=True)
        batch = tiered_kv.BankBatch(banks)
        rows = batch_attention.RowsForAttention(batch)
        rows.fill(0, torch.zeros(2, 2, 1, 16), torch.zeros(2, 2, 1, 16))
        assert rows._join_paged() is False
    for bank in banks:
        bank.steps.abandon()
        bank.close()
    store.close()
