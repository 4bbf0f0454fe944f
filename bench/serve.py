#!/usr/bin/env python
"""`tiered-kv serve` under simulated users: what batching and reuse buy a chat server, and what it costs.

users: `--users` (16) simulated users, each a thread with the real `openai` client, chat
`--turns` (6) turns with a think time between (`--think-s`, uniform 0..x), streaming each reply
(`--new-tokens`, greedy) and sending the whole conversation back each turn, as OpenAI clients do.
The same users run against a fresh server per mode (`--modes`), on the same model, in one run:
  batched      the default engine: one forward pass a tick for every decoding conversation
               (tiered_kv.BankBatch), prompts in chunks of `--prefill-chunk` tokens; reuse on
  per_request  the engine of earlier releases (`batch=False`): one forward pass per request,
               prompts first; reuse on. The baseline of the batching ratios
  no_reuse     per_request with every turn re-prefilled (`reuse=False`): the baseline of reuse
Reported per mode: TTFT p50 / p95 of later turns (2..N); per-user decode tok/s (a reply's tokens
after its first over the time after its first: the median over replies); TOTAL decode tok/s (every
reply's tokens after its first, summed, over the time during which at least one reply was past its
first token: the union of the replies' decode intervals); the cached share of prompt tokens
(`usage.prompt_tokens_details.cached_tokens`); failed requests; and how many conversations'
tokens equal the same conversation run locally through a CacheBank (greedy).

streams: `--stream-users` (8) users each stream one reply of `--stream-tokens` (96) tokens on the
batched engine, twice: alone (A), and (B) with one request of a `--long-prompt-tokens` (2,000)
token prompt sent once every stream has `--warmup-tokens` (8) tokens. The inter-token gap is the
time between two content chunks of a stream; reported over every gap after the warm-up tokens,
the same indices in A and B, p50 / p95, the ratio B / A of the p95 (target <= 2), and the long
prompt's TTFT.

overhead: one conversation, `--overhead-tokens` (128) new tokens, decode tok/s through the server
(batched engine, streaming) vs `model.generate(cache=bank)` in this process; rounds interleaved, medians.

    python bench/serve.py --json bench/results/serve_batched_cpu.json   # SmolLM2, 16 users x 6 turns, ...
    python bench/serve.py --users 2 --turns 2 --new-tokens 4 --overhead-tokens 8 --rounds 1 \
        --stream-users 2 --stream-tokens 12 --long-prompt-tokens 200   # smoke size
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
    parser.add_argument("--modes", default="batched,per_request",
                        help="comma-separated: batched, per_request, no_reuse (the first two give the ratios)")
    parser.add_argument("--prefill-chunk", type=int, default=None, help="the batched engine's (default: its own)")
    parser.add_argument("--stream-users", type=int, default=8, help="streams of the interference run (0: skip it)")
    parser.add_argument("--stream-tokens", type=int, default=96, help="tokens each of those streams asks for")
    parser.add_argument("--warmup-tokens", type=int, default=8, help="tokens every stream has before the long prompt")
    parser.add_argument("--long-prompt-tokens", type=int, default=2000, help="the long prompt's size in tokens")
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
    return {"text": "".join(pieces), "ttft_s": (first or end) - start, "first_at": first, "end_at": end,
            "decode_tokens": max(0, completion - 1),
            "decode_tok_s": (completion - 1) / (end - first) if first and completion > 1 and end > first else None,
            "prompt_tokens": usage.prompt_tokens if usage else 0,
            "cached_tokens": usage.prompt_tokens_details.cached_tokens if usage else 0}


MODES = {"batched": {"batch": True, "reuse": True}, "per_request": {"batch": False, "reuse": True},
         "no_reuse": {"batch": False, "reuse": False}}


def engine_kwargs(args, mode: str) -> dict:
    kwargs = dict(MODES[mode])
    if kwargs["batch"] and args.prefill_chunk:
        kwargs["prefill_chunk"] = args.prefill_chunk
    return kwargs


def decode_union_s(records: list[dict]) -> float:
    """Seconds during which at least one reply was past its first token."""
    spans = sorted((r["first_at"], r["end_at"]) for r in records if r.get("first_at") and r["end_at"] > r["first_at"])
    total, current = 0.0, None
    for start, end in spans:
        if current is None or start > current[1]:
            if current is not None:
                total += current[1] - current[0]
            current = [start, end]
        else:
            current[1] = max(current[1], end)
    return total + (current[1] - current[0] if current is not None else 0.0)


def percentile(values: list[float], q: float) -> float | None:
    values = sorted(values)
    return values[max(0, math.ceil(q * len(values)) - 1)] if values else None


def run_users(model, tokenizer, args, mode: str) -> dict:
    import openai

    from tiered_kv.serve.background import BackgroundServer
    from tiered_kv.serve.engine import ChatEngine
    with tempfile.TemporaryDirectory(prefix="tiered_kv-serve-") as cold_dir:
        server = BackgroundServer(ChatEngine(model, tokenizer, config(cold_dir), MODEL, max_active=args.max_active,
                                             max_queue=4 * args.users, **engine_kwargs(args, mode)))
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
    union_s = decode_union_s(records)
    return {"mode": mode, **MODES[mode], "requests": len(records), "failed": len(failures), "failures": failures[:5],
            "later_ttft_p50_s": statistics.median(ttfts) if ttfts else None,
            "later_ttft_p95_s": percentile(ttfts, 0.95),
            "decode_tok_s_median": statistics.median(decode) if decode else None,
            "decode_tokens": sum(r["decode_tokens"] for r in records), "decode_union_s": union_s,
            "total_decode_tok_s": sum(r["decode_tokens"] for r in records) / union_s if union_s else None,
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


def long_message(tokenizer, num_tokens: int) -> str:
    """A user message whose chat-templated prompt is about `num_tokens` tokens."""
    sentence = "The committee read the long report on coastal erosion, harbour silt and river flow once more. "
    per = len(tokenizer(sentence, add_special_tokens=False)["input_ids"])
    text = sentence * max(1, num_tokens // per)
    return text + "Summarise it in one sentence."


def run_streams(model, tokenizer, args, long_prompt: bool) -> dict:
    """`--stream-users` streams on the batched engine, with or without one long prompt arriving."""
    import openai

    from tiered_kv.serve.background import BackgroundServer
    from tiered_kv.serve.engine import ChatEngine
    arrivals: dict[int, list[float]] = {u: [] for u in range(args.stream_users)}
    long_record: dict = {}
    with tempfile.TemporaryDirectory(prefix="tiered_kv-serve-streams-") as cold_dir:
        server = BackgroundServer(ChatEngine(model, tokenizer, config(cold_dir), MODEL, max_active=args.max_active,
                                             max_queue=4 * args.stream_users, **engine_kwargs(args, "batched")))
        try:
            def stream(u: int) -> None:
                client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=600)
                messages = [{"role": "user", "content": f"Write a long story about {TOPICS[u % 16]}."}]
                for chunk in client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                                            max_tokens=args.stream_tokens, stream=True):
                    if chunk.choices and chunk.choices[0].delta.content:
                        arrivals[u].append(time.perf_counter())

            def send_long() -> None:
                while any(len(a) < args.warmup_tokens for a in arrivals.values()) and \
                        any(t.is_alive() for t in threads):
                    time.sleep(0.005)
                client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=600)
                messages = [{"role": "user", "content": long_message(tokenizer, args.long_prompt_tokens)}]
                long_record["sent_at"] = time.perf_counter()
                long_record.update(stream_turn(client, messages, 4))

            threads = [threading.Thread(target=stream, args=(u,)) for u in range(args.stream_users)]
            for t in threads:
                t.start()
            sender = threading.Thread(target=send_long) if long_prompt else None
            if sender is not None:
                sender.start()
            for t in threads:
                t.join()
            if sender is not None:
                sender.join()
        finally:
            server.stop()
    gaps = [b - a for times in arrivals.values() for a, b in zip(times[args.warmup_tokens - 1:], times[args.warmup_tokens:])]
    out = {"long_prompt": long_prompt, "tokens_streamed": [len(a) for a in arrivals.values()],
           "gap_p50_s": statistics.median(gaps) if gaps else None, "gap_p95_s": percentile(gaps, 0.95),
           "gaps": len(gaps)}
    if long_prompt and long_record:
        first = long_record["sent_at"] + long_record["ttft_s"]
        during = [b - a for times in arrivals.values() for a, b in zip(times, times[1:])
                  if long_record["sent_at"] <= b <= first]
        out.update(long_prompt_tokens=long_record["prompt_tokens"], long_prompt_ttft_s=long_record["ttft_s"],
                   gap_p95_while_long_prefills_s=percentile(during, 0.95), gaps_while_long_prefills=len(during))
    return out


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
                                                         reuse=False, **{k: v for k, v in engine_kwargs(
                                                             args, "batched").items() if k != "reuse"}))
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
    for mode in args.modes.split(","):
        if mode not in MODES:
            raise SystemExit(f"--modes: unknown mode {mode!r}; allowed: {', '.join(MODES)}")
        modes[mode] = result = run_users(model, tokenizer, args, mode)
        print(f"{mode}: {result['requests']} requests, {result['failed']} failed; later-turn TTFT p50 "
              f"{result['later_ttft_p50_s']:.3f} s, p95 {result['later_ttft_p95_s']:.3f} s; decode per user "
              f"{result['decode_tok_s_median']:.2f} tok/s, total {result['total_decode_tok_s']:.1f} tok/s; cached "
              f"{result['cached_share']:.0%} of prompt tokens; {result['wall_s']:.0f} s", flush=True)
    mismatches = {}
    with tempfile.TemporaryDirectory(prefix="tiered_kv-serve-local-") as cold_dir:
        store = tiered_kv.TierStore(config(cold_dir))
        try:
            for mode, result in modes.items():
                if mode == "no_reuse":
                    continue
                mismatches[mode] = [u for u, conv in result["conversations"].items()
                                    if [m["content"] for m in conv if m["role"] == "assistant"]
                                    != local_replies(model, tokenizer, conv, args.new_tokens, store)]
        finally:
            store.close()
    ratios = {}
    if "batched" in modes and "per_request" in modes:
        b, p = modes["batched"], modes["per_request"]
        ratios = {"total_decode_batched_over_per_request": b["total_decode_tok_s"] / p["total_decode_tok_s"],
                  "per_user_decode_batched_over_per_request": b["decode_tok_s_median"] / p["decode_tok_s_median"],
                  "later_ttft_p50_batched_over_per_request": b["later_ttft_p50_s"] / p["later_ttft_p50_s"]}
        print(f"batched / per-request: total decode {ratios['total_decode_batched_over_per_request']:.2f}x (target >= 4), "
              f"per-user decode {ratios['per_user_decode_batched_over_per_request']:.2f}x (target >= 3), later-turn "
              f"TTFT p50 {ratios['later_ttft_p50_batched_over_per_request']:.2f}x (target <= 1)")
    if "no_reuse" in modes and "per_request" in modes:
        ratios["later_ttft_p50_no_reuse_over_reuse"] = (modes["no_reuse"]["later_ttft_p50_s"]
                                                        / modes["per_request"]["later_ttft_p50_s"])
    for mode, bad in mismatches.items():
        print(f"{mode}: conversations equal to a local CacheBank run: {len(modes[mode]['conversations']) - len(bad)} "
              f"of {len(modes[mode]['conversations'])}")
    streams = {}
    if args.stream_users:
        streams = {"alone": run_streams(model, tokenizer, args, False),
                   "with_long_prompt": run_streams(model, tokenizer, args, True)}
        a, b = streams["alone"], streams["with_long_prompt"]
        streams["gap_p95_ratio"] = b["gap_p95_s"] / a["gap_p95_s"]
        print(f"{args.stream_users} streams: inter-token gap p95 {a['gap_p95_s'] * 1e3:.0f} ms alone, "
              f"{b['gap_p95_s'] * 1e3:.0f} ms with a {b.get('long_prompt_tokens')}-token prompt arriving "
              f"({streams['gap_p95_ratio']:.2f}x, target <= 2; while it prefilled: "
              f"{(b.get('gap_p95_while_long_prefills_s') or 0) * 1e3:.0f} ms); its TTFT "
              f"{b.get('long_prompt_ttft_s', float('nan')):.2f} s", flush=True)
    overhead = run_overhead(model, tokenizer, args)
    print(f"one conversation's decode through the server {overhead['median_tok_s']['server']:.1f} tok/s vs in process "
          f"{overhead['median_tok_s']['local']:.1f} tok/s -> {overhead['ratio_server_over_local']:.2f}x (target >= 0.95x)")
    load_after = os.getloadavg()
    print(f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after, {os.cpu_count()} cores, "
          f"{time.perf_counter() - started:.0f} s")
    if args.json:
        for result in modes.values():
            result["conversations"] = len(result["conversations"])
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), **modes, "ratios": ratios, "streams": streams,
                       "mismatched_conversations": mismatches, "overhead": overhead,
                       "load_average": [load_before[0], load_after[0]]}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
