#!/usr/bin/env python
"""`tiered-kv serve` under simulated users: what reuse buys a chat server, and what the server costs.

users: `--users` (16) simulated users, each a thread with the real `openai` client, chat
`--turns` (6) turns with a think time between (`--think-s`, uniform 0..x), streaming each reply
(`--new-tokens`, greedy) and sending the whole conversation back each turn, as OpenAI clients do.
The same users run twice against a fresh server on the same model, in one run: with reuse (each
request `attach()`es its stored prefix) and with every turn re-prefilled (`reuse=False`). Reported
per mode: TTFT p50 / p95 of later turns (2..N), decode tok/s after the first token, the cached share
of prompt tokens (`usage.prompt_tokens_details.cached_tokens`), failed requests; and whether every
conversation's tokens equal the same conversation run locally through a CacheBank (greedy).

overhead: one conversation, `--overhead-tokens` (128) new tokens, decode tok/s through the server
(streaming) vs `model.generate(cache=bank)` in this process; rounds interleaved, medians.

    python bench/serve.py                                  # SmolLM2, 16 users x 6 turns, then the overhead
    python bench/serve.py --users 2 --turns 2 --new-tokens 4 --overhead-tokens 8 --rounds 1   # smoke size
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TOPICS = ("the sea", "mountains", "cities", "music", "gardens", "trains", "the moon", "bread", "rivers", "libraries",
          "clocks", "bridges", "forests", "deserts", "islands", "winter")
MODEL = "SmolLM2-135M-Instruct"
RULES = ("Answer in plain English and keep each answer short.", "Be kind, calm and precise.",
         "If a question is unclear, say what you assume before you answer.", "Never invent facts or sources.",
         "Prefer concrete examples over general statements.", "Do not repeat what the user already said.",
         "When you list things, give at most three.", "Say so when you do not know something.")


def system_prompt(words: int) -> str:
    """A deployment's fixed instructions, `words` long (0: none), the same for every user."""
    out, i = [], 0
    while sum(len(r.split()) for r in out) < words:
        out.append(f"Rule {i + 1}: {RULES[i % len(RULES)]}")
        i += 1
    return " ".join(out)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--users", type=int, default=16)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens per reply")
    parser.add_argument("--system-words", type=int, default=200,
                        help="a system prompt of about this many words, the same for every user (0: none)")
    parser.add_argument("--think-s", type=float, default=2.0, help="a user's think time: uniform 0..this")
    parser.add_argument("--max-active", type=int, default=16, help="requests the server generates at once")
    parser.add_argument("--overhead-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="overhead rounds (medians)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--json", default=None, metavar="PATH")
    return parser.parse_args(argv)


def config(cold_dir: str) -> dict:
    return {"block_size": 16, "hot": {"device": "cpu", "capacity": "256MiB"}, "warm": {"capacity": "256MiB"},
            "cold": {"capacity": "1GiB", "path": cold_dir}}


def stream_turn(client, messages, new_tokens: int) -> dict:
    """One streamed reply: its text, TTFT, decode tok/s after the first token, usage."""
    start = time.perf_counter()
    first = None
    pieces, usage = [], None
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, max_tokens=new_tokens, temperature=0,
                                                stream=True, stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    end = time.perf_counter()
    completion = usage.completion_tokens if usage else 0
    return {"text": "".join(pieces), "ttft_s": (first or end) - start,
            "decode_tok_s": (completion - 1) / (end - first) if first and completion > 1 and end > first else None,
            "prompt_tokens": usage.prompt_tokens if usage else 0,
            "cached_tokens": usage.prompt_tokens_details.cached_tokens if usage else 0}


def run_users(model, tokenizer, args, reuse: bool) -> dict:
    import openai

    from tiered_kv.serve.background import BackgroundServer
    from tiered_kv.serve.engine import ChatEngine
    with tempfile.TemporaryDirectory(prefix="tiered_kv-serve-") as cold_dir:
        server = BackgroundServer(ChatEngine(model, tokenizer, config(cold_dir), MODEL, max_active=args.max_active,
                                             reuse=reuse, max_queue=4 * args.users))
        records, failures, conversations = [], [], {}
        try:
            def user(u: int) -> None:
                rng = random.Random(u)
                client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=600)
                system = system_prompt(args.system_words)
                messages = [{"role": "system", "content": system}] if system else []
                for turn in range(args.turns):
                    messages.append({"role": "user", "content": f"Tell me one more thing about {TOPICS[u % 16]} "
                                                                f"(part {turn + 1})."})
                    try:
                        record = stream_turn(client, messages, args.new_tokens)
                    except Exception as error:  # noqa: BLE001 - counted and reported
                        failures.append(f"user {u} turn {turn}: {type(error).__name__}: {error}")
                        return
                    record.update(user=u, turn=turn)
                    records.append(record)
                    messages.append({"role": "assistant", "content": record["text"]})
                    time.sleep(rng.uniform(0, args.think_s))
                conversations[u] = messages

            threads = [threading.Thread(target=user, args=(u,)) for u in range(args.users)]
            started = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall_s = time.perf_counter() - started
        finally:
            server.stop()
    later = [r for r in records if r["turn"] > 0]
    ttfts = sorted(r["ttft_s"] for r in later)
    decode = [r["decode_tok_s"] for r in records if r["decode_tok_s"]]
    prompt, cached = sum(r["prompt_tokens"] for r in records), sum(r["cached_tokens"] for r in records)
    return {"reuse": reuse, "requests": len(records), "failed": len(failures), "failures": failures[:5],
            "later_ttft_p50_s": statistics.median(ttfts) if ttfts else None,
            "later_ttft_p95_s": ttfts[max(0, math.ceil(0.95 * len(ttfts)) - 1)] if ttfts else None,
            "decode_tok_s_median": statistics.median(decode) if decode else None,
            "cached_share": cached / prompt if prompt else 0.0, "wall_s": wall_s,
            "conversations": conversations}


def local_replies(model, tokenizer, conversation: list[dict], new_tokens: int, store) -> list[str]:
    """The assistant turns of `conversation` recomputed locally: each user turn through a CacheBank,
    greedy, over the same chat template."""
    import torch

    import tiered_kv
    replies, messages = [], []
    for message in conversation:
        if message["role"] == "assistant":
            continue
        messages.append(message)
        if message["role"] != "user":
            continue
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
        bank = tiered_kv.CacheBank(model, store=store)
        bank.attach(ids)
        with torch.no_grad():
            out = model.generate(ids, cache=bank, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 do_sample=False)
        bank.close()
        new = [t for t in out[0, ids.shape[1]:].tolist() if t != model.generation_config.eos_token_id]
        reply = tokenizer.decode(new, skip_special_tokens=True)
        replies.append(reply)
        messages.append({"role": "assistant", "content": reply})
    return replies


def run_overhead(model, tokenizer, args) -> dict:
    import openai
    import torch

    import tiered_kv
    from tiered_kv.serve.background import BackgroundServer
    from tiered_kv.serve.engine import ChatEngine
    messages = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    rows = []
    with tempfile.TemporaryDirectory(prefix="tiered_kv-serve-overhead-") as cold_dir:
        for round_index in range(args.rounds):
            for mode in (("server", "local") if round_index % 2 == 0 else ("local", "server")):
                if mode == "server":
                    server = BackgroundServer(ChatEngine(model, tokenizer,
                                                         config(os.path.join(cold_dir, f"s{round_index}")), MODEL,
                                                         reuse=False))
                    try:
                        client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=600)
                        record = stream_turn(client, messages, args.overhead_tokens)
                    finally:
                        server.stop()
                    rate = record["decode_tok_s"]
                else:
                    store = tiered_kv.TierStore(config(os.path.join(cold_dir, f"l{round_index}")))
                    bank = tiered_kv.CacheBank(model, store=store)
                    times = []

                    class Timer:
                        def put(self, value):
                            times.append(time.perf_counter())

                        def end(self):
                            pass

                    with torch.no_grad():
                        model.generate(ids, cache=bank, attention_mask=torch.ones_like(ids), do_sample=False,
                                       max_new_tokens=args.overhead_tokens, min_new_tokens=args.overhead_tokens,
                                       streamer=Timer())
                    bank.close()
                    store.close()
                    rate = (len(times) - 2) / (times[-1] - times[1]) if len(times) > 2 else None
                rows.append({"round": round_index, "mode": mode, "decode_tok_s": rate})
                print(f"  overhead round {round_index} {mode:6}: {rate:.1f} tok/s" if rate else
                      f"  overhead round {round_index} {mode}: no rate", flush=True)
    medians = {m: statistics.median(r["decode_tok_s"] for r in rows if r["mode"] == m and r["decode_tok_s"])
               for m in ("server", "local")}
    return {"rows": rows, "median_tok_s": medians, "ratio_server_over_local": medians["server"] / medians["local"]}


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    import tiered_kv
    from tiered_kv.models import load_model
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(None, progress=False)
    load_before, started = os.getloadavg(), time.perf_counter()
    modes = {}
    for reuse in (True, False):
        modes["reuse" if reuse else "no_reuse"] = result = run_users(model, tokenizer, args, reuse)
        print(f"{'with reuse' if reuse else 're-prefilled'}: {result['requests']} requests, {result['failed']} failed; "
              f"later-turn TTFT p50 {result['later_ttft_p50_s']:.3f} s, p95 {result['later_ttft_p95_s']:.3f} s; "
              f"decode {result['decode_tok_s_median']:.1f} tok/s; cached {result['cached_share']:.0%} of prompt "
              f"tokens; {result['wall_s']:.0f} s", flush=True)
    with tempfile.TemporaryDirectory(prefix="tiered_kv-serve-local-") as cold_dir:
        store = tiered_kv.TierStore(config(cold_dir))
        try:
            mismatches = [u for u, conv in modes["reuse"]["conversations"].items()
                          if [m["content"] for m in conv if m["role"] == "assistant"]
                          != local_replies(model, tokenizer, conv, args.new_tokens, store)]
        finally:
            store.close()
    ratio = modes["no_reuse"]["later_ttft_p50_s"] / modes["reuse"]["later_ttft_p50_s"]
    print(f"later-turn TTFT p50: {ratio:.1f}x lower with reuse (target >= 5x); cached share "
          f"{modes['reuse']['cached_share']:.0%} (target >= 80%); failed {modes['reuse']['failed']} + "
          f"{modes['no_reuse']['failed']}; conversations equal to a local CacheBank run: "
          f"{len(modes['reuse']['conversations']) - len(mismatches)} of {len(modes['reuse']['conversations'])}")
    overhead = run_overhead(model, tokenizer, args)
    print(f"one conversation's decode through the server {overhead['median_tok_s']['server']:.1f} tok/s vs in process "
          f"{overhead['median_tok_s']['local']:.1f} tok/s -> {overhead['ratio_server_over_local']:.2f}x (target >= 0.9x)")
    load_after = os.getloadavg()
    print(f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after, {os.cpu_count()} cores, "
          f"{time.perf_counter() - started:.0f} s")
    if args.json:
        for result in modes.values():
            result["conversations"] = len(result["conversations"])
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), **modes, "ttft_ratio_no_reuse_over_reuse": ratio,
                       "mismatched_conversations": mismatches, "overhead": overhead,
                       "load_average": [load_before[0], load_after[0]]}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
