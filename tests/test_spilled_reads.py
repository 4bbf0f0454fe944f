"""A decode step over history spread over tiers (issue 36): each tier's tokens, when they form a
few ranges of consecutive positions, are read (decoded) straight into their place in the step's
buffer, never gathered into a temporary and index-copied; and a staged step reads every layer into
one buffer the bank reuses, not a fresh one per layer."""

from __future__ import annotations

import pytest
import torch
from helpers import greedy, rand_ids, tier_config, tiny_model

import tiered_kv
from tiered_kv.store import token_map
from tiered_kv.store.token_map import TokenMapper


def compressed_warm(tmp_path, mode: str) -> dict:
    config = tier_config("forces_warm", tmp_path / "cold")
    config["hot"]["capacity_blocks"] = 4
    config["warm"].update(compression=mode, layout="auto")
    return config


def gathered(mapper: TokenMapper, layer: int, runs, num_tokens: int) -> torch.Tensor:
    """What the step buffer must hold: every run read on its own and index-copied into place."""
    out = torch.full((2, mapper.layout.num_kv_heads, num_tokens, mapper.layout.head_dim), float("nan"))
    for run in runs:
        data = mapper.tiers[run.tier].read_tokens(layer, run.index)
        positions = run.positions if run.positions is not None else torch.arange(num_tokens)
        out[:, :, positions] = data  # (index_put_: the tests count index_copy_ calls)
    return out


@pytest.mark.parametrize("mode", ("none", "int8", "int4"))
def test_each_tiers_ranges_are_read_into_place(mode, tmp_path, monkeypatch):
    model = tiny_model("llama")
    config = compressed_warm(tmp_path, mode) if mode != "none" else tier_config("forces_warm", tmp_path / "c",
                                                                                 engine="thread", delay_us=0)
    bank = tiered_kv.CacheBank(model, config)
    reads, copies = [], []
    real_read = TokenMapper.read_layer

    def read_layer(self, layer, runs, num_tokens, out=None):
        result = real_read(self, layer, runs, num_tokens, out)
        if len(runs) > 1:
            reads.append((layer, [(r.tier, r.span) for r in runs], result.data_ptr()))
            assert torch.equal(result, gathered(self, layer, runs, num_tokens)), layer
        return result

    real_copy = torch.Tensor.index_copy_

    def index_copy_(tensor, *args, **kwargs):
        copies.append(args[1].numel())
        return real_copy(tensor, *args, **kwargs)

    monkeypatch.setattr(TokenMapper, "read_layer", read_layer)
    with torch.no_grad():
        ids = rand_ids(4, 37)
        greedy(model, ids, bank, 1)  # the prompt: its blocks spill into warm
        monkeypatch.setattr(torch.Tensor, "index_copy_", index_copy_)
        out = greedy(model, torch.cat([ids, rand_ids(5, 1)], 1), bank, 6)
    bank.close()
    assert reads, "no decode step read history from more than one run"
    assert all(span is not None for _, runs, _ in reads for _, span in runs)  # every range straight into place
    assert max(copies, default=0) <= 1  # only the new token's write (index_copy_ of 1 position), no gathered history
    one_step = [pointer for layer, _, pointer in reads[:model.config.num_hidden_layers]]
    assert len(set(one_step)) == 1  # the layers of a step share the bank's buffer
    assert out.shape[1] == 38 + 6


def test_too_many_ranges_are_gathered_as_one_run(tmp_path, monkeypatch):
    """More ranges than MAX_SPANS_PER_TIER in one tier: one gathered run (index_copy_), same K/V."""
    model = tiny_model("llama")
    monkeypatch.setattr(token_map, "MAX_SPANS_PER_TIER", 0)
    results = []
    real_read = TokenMapper.read_layer

    def read_layer(self, layer, runs, num_tokens, out=None):
        result = real_read(self, layer, runs, num_tokens, out)
        if len(runs) > 1:
            assert all(r.positions is not None for r in runs)
            assert torch.equal(result, gathered(self, layer, runs, num_tokens))
            results.append(layer)
        return result

    monkeypatch.setattr(TokenMapper, "read_layer", read_layer)
    bank = tiered_kv.CacheBank(model, compressed_warm(tmp_path, "int8"))
    with torch.no_grad():
        gathered_tokens = greedy(model, rand_ids(4, 37), bank, 6)
    bank.close()
    assert results
    monkeypatch.setattr(token_map, "MAX_SPANS_PER_TIER", 8)
    bank = tiered_kv.CacheBank(model, compressed_warm(tmp_path / "b", "int8"))
    with torch.no_grad():
        assert torch.equal(greedy(model, rand_ids(4, 37), bank, 6), gathered_tokens)
    bank.close()


def test_with_autograd_on_every_layer_gets_its_own_tensor(tmp_path):
    """A forward with gradients on may keep each layer's K/V for backward: no shared buffer then."""
    model = tiny_model("llama")
    bank = tiered_kv.CacheBank(model, compressed_warm(tmp_path, "int8"))
    ids = rand_ids(4, 37)
    with torch.no_grad():
        model(input_ids=ids, cache=bank, use_cache=True)
    seen = []
    real_read = TokenMapper.read_layer

    def read_layer(self, layer, runs, num_tokens, out=None):
        assert out is None
        result = real_read(self, layer, runs, num_tokens, out)
        seen.append(result.data_ptr())
        return result

    TokenMapper.read_layer = read_layer
    try:
        logits = model(input_ids=rand_ids(5, 1), cache=bank, use_cache=True).logits
        logits.sum().backward()  # every saved K/V still as attention read it
    finally:
        TokenMapper.read_layer = real_read
        bank.close()
    assert len(seen) == model.config.num_hidden_layers and len(set(seen)) == len(seen)
