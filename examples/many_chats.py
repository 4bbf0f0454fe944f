"""Many chats on one store: one memory budget, the MemScheduler deciding whose blocks stay hot.

    python examples/many_chats.py
"""
import tempfile
from concurrent.futures import ThreadPoolExecutor

import torch

import tiered_kv
from tiered_kv.chat import first_turn_ids, next_turn_ids, reply_closing_ids
from tiered_kv.models import load_model

TOPICS = ["the sea", "mountains", "a library", "trains"]

model, tokenizer = load_model()
stop_ids = {tokenizer.eos_token_id}
with tempfile.TemporaryDirectory() as cold_dir:
    # 12 hot blocks for four chats: at each turn the chats not speaking give way to the one that is
    config = tiered_kv.load_config({"hot": {"capacity_blocks": 12}, "warm": {"capacity": "64MiB"},
                                    "cold": {"path": cold_dir, "capacity": "128MiB"}})
    store = tiered_kv.TierStore(config)
    chats = [{"bank": tiered_kv.CacheBank(model, config, store=store, cost_sensitivity=0.9 if i == 0 else 0.5),
              "seen": []} for i in range(len(TOPICS))]  # chat 0 pays for a tighter SLA: it stays hot longer

    def turn(index: int, message: str) -> int:
        chat = chats[index]
        chat["seen"] += next_turn_ids(tokenizer, message) if chat["seen"] else first_turn_ids(tokenizer, message)
        ids = torch.tensor([chat["seen"]])
        reused = chat["bank"].attach(ids)
        out = model.generate(ids, cache=chat["bank"], attention_mask=torch.ones_like(ids), max_new_tokens=16,
                             do_sample=False)
        reply = out[0, ids.shape[1]:].tolist()
        chat["seen"] += reply + reply_closing_ids(tokenizer, reply, stop_ids)
        return reused

    with ThreadPoolExecutor(max_workers=2) as pool:  # banks of one store may run in different threads
        for round_ in range(2):
            asks = [f"Write one line about {topic}." if round_ == 0 else "Another line, please." for topic in TOPICS]
            reused = list(pool.map(turn, range(len(TOPICS)), asks))
            # round 1: a chat may reuse another's blocks of the same system prompt; round 2: its own history
            print(f"round {round_ + 1}: prompt tokens reused per chat {reused}")
    if min(reused) == 0:
        raise SystemExit("a chat's history was not reused")
    stats = store.stats()
    print("store:", {tier: f"{use['used_blocks']}/{use['capacity_blocks']} blocks" for tier, use in stats["tiers"].items()})
    for chat in chats:
        chat["bank"].close()
    store.close()
