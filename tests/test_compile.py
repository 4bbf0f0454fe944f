"""Compiled decoding through transformers' own generate(compile_config=...) (issue 34, item 4).

The bank is compileable: generate() compiles the model's __call__ (forward hooks included) for
decode steps. Each step is prepared outside the graph (bank/compiled.py); the graph runs tensor
ops only, with no graph break (fullgraph=True), a handful of graphs over a growing chat, and the
same tokens as eager generate. Graphs are counted with a backend that records each one and runs
it as traced (seconds, not minutes); one test compiles with inductor for real.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch._dynamo
from transformers import DynamicCache
from transformers.generation.configuration_utils import CompileConfig

import tiered_kv
from helpers import rand_ids, tier_config, tiny_model

NEW_TOKENS = 64


class CountingBackend:
    """A torch.compile backend that keeps every graph Dynamo hands it and runs it as traced. (A
    function closing over its list: generate() deep-copies its config, backend included, and a
    function copies as itself.)"""

    def __init__(self):
        self.graphs = graphs = []

        def backend(graph_module, example_inputs, **kwargs):
            graphs.append(graph_module)
            return graph_module.forward
        self.backend = backend


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _compile_config(counting: CountingBackend) -> CompileConfig:
    config = CompileConfig(fullgraph=True, dynamic=True, backend=counting.backend)
    config._compile_all_devices = True  # (transformers compiles on CUDA only unless told)
    return config


def _eager(model, ids, new_tokens):
    return model.generate(ids, cache=DynamicCache(config=model.config), max_new_tokens=new_tokens, do_sample=False)


@pytest.mark.parametrize("hooks", (None, "exact"))
@pytest.mark.parametrize("kind", ("all_hot", "forces_warm"))
def test_generate_compiles_decode_into_few_graphs_without_a_break(kind, hooks, tmp_path):
    model = tiny_model("llama")
    bank = tiered_kv.CacheBank(model, tier_config(kind, tmp_path))
    if hooks:
        tiered_kv.hooks.install(model, bank, mode=hooks)
    assert bank.is_compileable
    backend = CountingBackend()
    ids = rand_ids(1, 23)
    try:
        out = model.generate(ids, cache=bank, max_new_tokens=NEW_TOKENS, do_sample=False,
                             compile_config=_compile_config(backend))
        assert 1 <= len(backend.graphs) <= 4, f"{len(backend.graphs)} graphs over {NEW_TOKENS} tokens"
        reads = bank.stats()["hooks"]["steps_by_read"]
        # the prefill and the decode steps, each counted once; none read through the lease
        assert sum(reads.values()) == NEW_TOKENS and reads["staged"] == 0, reads
        assert reads["view" if kind == "all_hot" else "gather"] >= NEW_TOKENS - 2, reads
        # the next turn, compiled again, over the grown chat
        follow = torch.cat([out, rand_ids(2, 5)], 1)
        bank.attach(follow)
        again = model.generate(follow, cache=bank, max_new_tokens=16, do_sample=False,
                               compile_config=_compile_config(backend))
        assert len(backend.graphs) <= 4, f"{len(backend.graphs)} graphs after a second turn"
    finally:
        tiered_kv.hooks.uninstall(model)
    assert torch.equal(out, _eager(model, ids, NEW_TOKENS))
    assert torch.equal(again, _eager(model, follow, 16))
    assert bank.get_seq_length() == follow.shape[1] + 15
    bank.close()


def test_compiled_steps_are_verified_and_published_for_other_banks(tmp_path):
    """The ids of compiled steps come out of the graph (copied into buffers by the forward
    hook, read after it): they are verified, so the blocks they fill are published."""
    model = tiny_model("llama")
    store = tiered_kv.TierStore(tier_config("all_hot", tmp_path))
    bank = tiered_kv.CacheBank(model, store=store)
    ids = rand_ids(3, 10)
    out = model.generate(ids, cache=bank, max_new_tokens=30, do_sample=False,
                         compile_config=_compile_config(CountingBackend()))
    other = tiered_kv.CacheBank(model, store=store)
    reused = other.attach(out)
    block_size = store.config.block_size
    assert reused == (out.shape[1] - 1) // block_size * block_size  # every full block, generated ones too
    assert other.block_table(0)[:reused // block_size] == bank.block_table(0)[:reused // block_size]
    other.close()
    bank.close()
    store.close()


def test_a_chat_the_device_cannot_hold_decodes_eagerly_and_says_so_once(tmp_path, caplog):
    """Blocks in cold (the chat outgrew hot and warm) are no graph's to read: each such step
    runs its forward eagerly instead (never a graph break under fullgraph), said once."""
    model = tiny_model("llama")
    bank = tiered_kv.CacheBank(model, tier_config("forces_cold", tmp_path))
    backend = CountingBackend()
    ids = rand_ids(4, 23)
    with caplog.at_level(logging.WARNING, logger="tiered_kv"):
        out = model.generate(ids, cache=bank, max_new_tokens=12, do_sample=False,
                             compile_config=_compile_config(backend))
    assert torch.equal(out, _eager(model, ids, 12))
    assert backend.graphs == []
    assert sum("runs eagerly" in r.getMessage() for r in caplog.records) == 1
    assert torch.compiler.is_compiling() is False
    follow = torch.cat([out, rand_ids(5, 3)], 1)
    assert torch.equal(model.generate(follow, cache=bank, max_new_tokens=4, do_sample=False), _eager(model, follow, 4))
    bank.close()


def test_a_bank_of_sliding_window_layers_is_not_compileable(tmp_path):
    model = tiny_model("mistral_sw")
    bank = tiered_kv.CacheBank(model, tier_config("all_hot", tmp_path))
    assert not bank.is_compileable
    config_bank = tiered_kv.CacheBank(tiny_model("llama").config, tier_config("all_hot", tmp_path / "c"))
    assert not config_bank.is_compileable  # (it sees no forward: nothing can prepare its steps)
    bank.close()
    config_bank.close()


def test_inductor_compiled_decode_equals_eager(tmp_path):
    """The real compiler (inductor, CPU code) over the bank's steps: the same greedy tokens."""
    model = tiny_model("llama")
    bank = tiered_kv.CacheBank(model, tier_config("forces_warm", tmp_path))
    ids = rand_ids(6, 21)
    config = CompileConfig(fullgraph=True, dynamic=True)
    config._compile_all_devices = True
    out = model.generate(ids, cache=bank, max_new_tokens=12, do_sample=False, compile_config=config)
    assert torch.equal(out, _eager(model, ids, 12))
    bank.close()
