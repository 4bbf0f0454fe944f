"""Compressed lower tiers: warm (and cold) store blocks packed as int8, fp8 or int4 with scales, so
the same memory holds several times the history. Lossy: measure what it costs your model.

    python examples/compression.py
    tiered-kv quality --compression int8 --tokens 1024      # the measurement, on the command line
"""
import tempfile

import torch

import tiered_kv
from tiered_kv.chat import first_turn_ids
from tiered_kv.models import load_model

model, tokenizer = load_model()
ids = torch.tensor([first_turn_ids(tokenizer, "List five facts about the Moon, one per line.")])
results = {}
for mode in ("none", "int8"):
    with tempfile.TemporaryDirectory() as cold_dir:
        # 2 hot blocks: nearly all of the chat is read back from warm, packed or not
        config = tiered_kv.load_config({"hot": {"capacity_blocks": 2}, "cold": {"path": cold_dir, "capacity": 0},
                                        "warm": {"capacity": "64MiB", "compression": mode}})
        bank = tiered_kv.CacheBank(model, config)
        out = model.generate(ids, cache=bank, attention_mask=torch.ones_like(ids), max_new_tokens=32,
                             do_sample=False)
        warm = bank.stats()["tiers"]["warm"]
        results[mode] = out
        print(f"warm {mode:>4}: 64 MiB holds {warm['capacity_blocks']} blocks "
              f"({warm['capacity_blocks'] * config.block_size} tokens); {warm['used_blocks']} in use")
        bank.close()
same = int((results["none"][0, ids.shape[1]:] == results["int8"][0, ids.shape[1]:]).sum())
print(f"greedy tokens equal to the uncompressed run: {same} of 32")
print(tokenizer.decode(results["int8"][0, ids.shape[1]:], skip_special_tokens=True))
