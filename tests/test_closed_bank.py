"""A bank used after close() raises a clear error (issue 5, defect 6), whether or not its store is
still open for other banks."""

from __future__ import annotations

import pytest
import torch

import tiered_kv
from helpers import FORMS, greedy, make_bank, rand_ids, reference, tier_config, tiny_model

CLOSED = r"(?i)\bclosed\b"


@pytest.mark.parametrize("store_mode", ("own", "shared"))
@pytest.mark.parametrize("form", FORMS)
def test_a_closed_bank_raises_a_clear_error_on_use(form, store_mode, tmp_path):
    model = tiny_model("llama")
    config = tier_config("forces_cold", tmp_path)
    store = tiered_kv.TierStore(config) if store_mode == "shared" else None
    bank = make_bank(form, model, config if store is None else None, store=store)
    ids = rand_ids(1, 18)
    out = greedy(model, ids, bank, 4)
    bank.close()
    bank.close()  # closing twice is fine

    k = torch.zeros(1, model.config.num_key_value_heads, 1, model.config.head_dim)
    with pytest.raises(RuntimeError, match=CLOSED):
        bank.update(k, k, 0)
    with pytest.raises(RuntimeError, match=CLOSED):
        bank.attach(out)
    with pytest.raises(RuntimeError, match=CLOSED):
        greedy(model, torch.cat([out, rand_ids(2, 3)], 1), bank, 3)

    if store is not None:  # the store still serves other banks
        other = make_bank(form, model, store=store)
        follow = torch.cat([out, rand_ids(3, 3)], 1)
        assert torch.equal(greedy(model, follow, other, 3), reference(model, follow, 3))
        other.close()
        store.close()
