"""Restart the process and pick the conversation up from the cold tier instead of re-prefilling it.

    python examples/restart_reattach.py            # a first process chats, then a second one resumes

The first process runs a turn and closes its store (blocks reach the cold tier's files, fsynced;
a crash would lose at most `cold.write_behind_s` of them). A second process, with the same config,
attaches the conversation's ids and computes only the new message.
"""
import json
import subprocess
import sys
import tempfile
import time

import torch

import tiered_kv
from tiered_kv.chat import first_turn_ids, next_turn_ids, reply_closing_ids
from tiered_kv.models import load_model


def config(cold_dir: str):
    return tiered_kv.load_config({"hot": {"capacity_blocks": 8}, "warm": {"capacity_blocks": 8},
                                  "cold": {"path": cold_dir, "capacity": "256MiB"}})


def first_process(cold_dir: str, history_file: str) -> None:
    model, tokenizer = load_model()
    bank = tiered_kv.CacheBank(model, config(cold_dir))
    ids = torch.tensor([first_turn_ids(tokenizer, "Tell me a short story about a lighthouse keeper.")])
    out = model.generate(ids, cache=bank, attention_mask=torch.ones_like(ids), max_new_tokens=96, do_sample=False)
    reply = out[0, ids.shape[1]:].tolist()
    seen = ids[0].tolist() + reply + reply_closing_ids(tokenizer, reply, {tokenizer.eos_token_id})
    bank.close()  # the store writes what is not durable yet, then releases the cold directory
    with open(history_file, "w") as f:
        json.dump(seen, f)  # an application keeps its conversations' token ids (or their text)
    print(f"first process: {len(seen)} tokens of conversation, stored")


def second_process(cold_dir: str, history_file: str) -> None:
    model, tokenizer = load_model()
    with open(history_file) as f:
        seen = json.load(f)
    seen += next_turn_ids(tokenizer, "How does it end?")
    ids = torch.tensor([seen])
    bank = tiered_kv.CacheBank(model, config(cold_dir))
    began = time.perf_counter()
    reused = bank.attach(ids)  # read back from the cold files, checksums checked
    out = model.generate(ids, cache=bank, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)
    print(f"second process: reused {reused} of {ids.shape[1]} prompt tokens from cold, "
          f"first token after {time.perf_counter() - began:.2f} s")
    print("  ", tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    bank.close()
    if reused < len(seen) // 2:
        raise SystemExit("the stored conversation was not reused")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--resume":
        second_process(sys.argv[2], sys.argv[3])
    else:
        with tempfile.TemporaryDirectory() as work:
            cold_dir, history = f"{work}/cold", f"{work}/history.json"
            first_process(cold_dir, history)
            subprocess.run([sys.executable, __file__, "--resume", cold_dir, history], check=True)
