"""A multi-turn chat: each turn reuses the KV of every earlier turn, from whatever tier holds it.

    python examples/chat_loop.py
"""
import tempfile

import torch

import tiered_kv
from tiered_kv.chat import first_turn_ids, next_turn_ids, reply_closing_ids
from tiered_kv.models import load_model

MESSAGES = ["Hi! In one sentence, what is a KV cache?", "Why does it grow with the conversation?",
            "How can it be kept when GPU memory is small?"]

model, tokenizer = load_model()
stop_ids = {tokenizer.eos_token_id}
with tempfile.TemporaryDirectory() as cold_dir:
    # hot holds 4 blocks (64 tokens): the history soon lives in warm, and comes back for each turn
    config = tiered_kv.load_config({"hot": {"capacity_blocks": 4}, "warm": {"capacity": "32MiB"},
                                    "cold": {"path": cold_dir, "capacity": "128MiB"}})
    bank = tiered_kv.CacheBank(model, config)
    seen: list[int] = []  # every token the model has seen: never re-tokenize the history
    for turn, message in enumerate(MESSAGES):
        seen += first_turn_ids(tokenizer, message) if turn == 0 else next_turn_ids(tokenizer, message)
        ids = torch.tensor([seen])
        reused = bank.attach(ids)  # the stored prefix of `ids`: only the rest is computed
        out = model.generate(ids, cache=bank, attention_mask=torch.ones_like(ids), max_new_tokens=32,
                             do_sample=False)
        reply = out[0, ids.shape[1]:].tolist()
        seen += reply + reply_closing_ids(tokenizer, reply, stop_ids)  # the template's end of a reply
        tiers = {tier: use["used_blocks"] for tier, use in bank.stats()["tiers"].items()}
        print(f"turn {turn + 1}: computed {ids.shape[1] - reused} of {ids.shape[1]} prompt tokens, "
              f"blocks per tier {tiers}")
        print("  ", tokenizer.decode(reply, skip_special_tokens=True))
        if turn > 0 and reused == 0:
            raise SystemExit("the earlier turns were not reused")
    bank.close()
