"""Wrap a model's KV cache with CacheBank and call generate() as usual.

    python examples/wrap_generate.py
"""
import tempfile

import torch

import tiered_kv
from tiered_kv.models import load_model

model, tokenizer = load_model()  # the bundled SmolLM2-135M-Instruct, offline
with tempfile.TemporaryDirectory() as cold_dir:
    # a small hot tier (2 MiB: 2 blocks of SmolLM2's fp32 KV) so the prompt spills into warm. A key
    # left out takes the library's default (warm 2 GiB, cold 8 GiB), not configs/default.yaml's: say them
    config = tiered_kv.load_config({"hot": {"capacity": "2MiB"}, "warm": {"capacity": "64MiB"},
                                    "cold": {"path": cold_dir, "capacity": 0}})
    bank = tiered_kv.CacheBank(model, config)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Name three uses of a cache."}],
                                        add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    out = model.generate(ids, cache=bank, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)
    print(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))

    # the same tokens as transformers' own DynamicCache
    plain = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)
    assert torch.equal(out, plain), "CacheBank's greedy tokens differ from DynamicCache's"

    for tier, use in bank.stats()["tiers"].items():
        print(f"{tier:>5}: {use['used_blocks']} of {use['capacity_blocks']} blocks")
    bank.close()
