#!/usr/bin/env python
"""What a crash costs, and what many processes on one cold directory share (issue 19).

kill (default): `--kills` times, a child process chats (`--conversations` chats turn by turn, some
left open, some offloaded: history in hot, warm and cold) on one cold.path and is SIGKILLed at a
random moment. After each kill a fresh store in this process attaches the last turn the child
finished at least `--settle-s` (2 s) before the kill, continues it, and checks:
  - the continuation equals DynamicCache computing the whole conversation fresh;
  - the share of that turn's history reattached, in full blocks (what a turn publishes; target: >= 80%
    every time);
  - `tiered-kv inspect --verify` finds no bad record.

share: `--processes` children chat on one cold.path for `--seconds`; each turn continues a
conversation any process began (attach reuses the others' durable records, live) and is checked
against DynamicCache in the child; children are SIGKILLed at random and restarted. At the end:
no wrong token, no corrupt record (inspect --verify), how much each attach reused, and, after the
last kill, how much of the conversations durable by then a fresh store reattaches.

The model is SmolLM2-135M's KV shape with next to no compute (bench/overhead.py), random weights,
greedy decoding: deterministic, so a parent knows every token.

    python bench/crash.py --kills 50
    python bench/crash.py --mode share --processes 4 --seconds 60
    python bench/crash.py --kills 2 --conversations 2 --json out.json        # smallest (the smoke test)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import tiered_kv  # noqa: E402
from bench.overhead import build_model  # noqa: E402
from tiered_kv.tools.cold_scan import scan  # noqa: E402
from transformers import DynamicCache  # noqa: E402

BLOCK_SIZE = 16
USER_TOKENS, NEW_TOKENS, CONTINUE_TOKENS = 48, 16, 4
MAX_TOKENS = 4096


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--mode", choices=("kill", "share"), default="kill")
    parser.add_argument("--kills", type=int, default=50, help="kill: children killed")
    parser.add_argument("--conversations", type=int, default=4, help="chats per child")
    parser.add_argument("--settle-s", type=float, default=2.0, help="kill: a turn this old at the kill is checked")
    parser.add_argument("--processes", type=int, default=4, help="share: children at once")
    parser.add_argument("--seconds", type=float, default=60.0, help="share: how long they chat")
    parser.add_argument("--json", default=None, metavar="PATH")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: JSON of the child's job
    return parser.parse_args(argv)


def store_config(cold_dir: str) -> dict:
    """Hot and warm far smaller than the chats: history lives in all three tiers."""
    return {"block_size": BLOCK_SIZE, "hot": {"device": "cpu", "capacity_blocks": 24},
            "warm": {"capacity_blocks": 24}, "cold": {"capacity": "256MiB", "path": cold_dir}}


def user_ids(conversation: int, turn: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * conversation + turn)
    return torch.randint(1, 256, (1, USER_TOKENS), generator=generator)


def generate(model, ids: torch.Tensor, cache, new_tokens: int) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, cache=cache, max_new_tokens=new_tokens, do_sample=False,
                              attention_mask=torch.ones_like(ids))


# ---- the child -----------------------------------------------------------------------------------

def run_child(job: dict) -> None:
    """Chat until killed; one journal line (flushed) per finished turn."""
    torch.set_num_threads(1)
    model = build_model(0, MAX_TOKENS)
    store = tiered_kv.TierStore(store_config(job["cold"]))
    rng = random.Random(job["seed"])
    journal = open(job["journal"], "a", buffering=1)
    banks: dict[int, tuple] = {}
    while True:
        if job["mode"] == "share":  # continue the conversation another process (or this one) left
            conversation, ids = _pick_shared(job, rng)
            bank = tiered_kv.CacheBank(model, store=store)
            reused = bank.attach(ids)
            banks_here = None
        else:
            conversation = rng.randrange(job["conversations"]) + 100 * job["seed"]
            bank, ids = banks.get(conversation, (None, None))
            reused = None
            if bank is None:
                bank = tiered_kv.CacheBank(model, store=store)
                ids = torch.zeros((1, 0), dtype=torch.long)
            banks_here = banks
        turn = ids.shape[1] // (USER_TOKENS + NEW_TOKENS)
        if ids.shape[1] + USER_TOKENS + NEW_TOKENS + CONTINUE_TOKENS + 8 >= MAX_TOKENS:
            ids = torch.zeros((1, 0), dtype=torch.long)  # this chat is full: a new one under the same name
            conversation += 10**6
            turn = 0
        ids = torch.cat([ids, user_ids(conversation, turn)], 1)
        out = generate(model, ids, bank, NEW_TOKENS)
        if job["mode"] == "share":  # every answer is checked here, against DynamicCache
            expected = generate(model, ids, DynamicCache(config=model.config), NEW_TOKENS)
            if not torch.equal(out, expected):
                journal.write(json.dumps({"wrong": True, "conversation": conversation, "turn": turn}) + "\n")
                os._exit(3)
        journal.write(json.dumps({"conversation": conversation, "turn": turn, "ids": out[0].tolist(),
                                  "reused": reused, "history": ids.shape[1] - USER_TOKENS, "t": time.time(),
                                  "pid": os.getpid()}) + "\n")
        if banks_here is None:
            bank.close()
            continue
        banks_here[conversation] = (bank, out)
        roll = rng.random()
        if roll < 0.3:
            bank.offload("cold")
        elif roll < 0.5:
            bank.offload("warm")
        while len(banks_here) > 3:  # some chats stay open, the oldest close
            oldest = next(iter(banks_here))
            banks_here.pop(oldest)[0].close()


def _pick_shared(job: dict, rng: random.Random) -> tuple[int, torch.Tensor]:
    """A conversation from the shared journal (any process's), or a new one."""
    lines = _journal(job["journal"])
    if lines and rng.random() < 0.8:
        line = rng.choice(lines[-20:])
        return line["conversation"], torch.tensor([line["ids"]])
    return rng.randrange(10**6) + 10**7 * job["seed"], torch.zeros((1, 0), dtype=torch.long)


def _journal(path: str) -> list[dict]:
    try:
        with open(path) as f:
            lines = [json.loads(line) for line in f if line.strip().endswith("}")]
    except FileNotFoundError:
        return []
    return [line for line in lines if "ids" in line]


def _spawn(job: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, "--child", json.dumps(job)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _kill(child: subprocess.Popen) -> None:
    child.send_signal(signal.SIGKILL)
    child.wait()


def _bad_records(cold_dir: str) -> list:
    found = scan(cold_dir, verify=True)
    return [(f.name, slot, why) for f in found.files for slot, why in (f.bad or [])]


# ---- kill ------------------------------------------------------------------------------------------

def run_kills(args, workdir: str) -> dict:
    model = build_model(0, MAX_TOKENS)
    rng = random.Random(19)
    trials = []
    cold_dir = None
    for trial in range(args.kills):
        if trial % 10 == 0:  # a fresh directory now and then; otherwise the last one, reused
            cold_dir = os.path.join(workdir, f"cold{trial}")
        journal = os.path.join(workdir, f"journal{trial}.jsonl")
        child = _spawn({"mode": "kill", "cold": cold_dir, "journal": journal, "seed": trial,
                        "conversations": args.conversations})
        deadline = time.monotonic() + 120
        while not _journal(journal):  # it chats: its first turn is done
            if child.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"trial {trial}: the child ended early: {child.stderr.read()[-2000:]}")
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 3.0 + args.settle_s))
        killed_at = time.time()
        _kill(child)
        lines = _journal(journal)
        settled = [line for line in lines if line["t"] <= killed_at - args.settle_s]
        target = (settled or lines)[-1]
        ids = torch.tensor([target["ids"]])
        follow = torch.cat([ids, torch.tensor([[5, 6, 7]])], 1)
        store = tiered_kv.TierStore(store_config(cold_dir))
        try:
            bank = tiered_kv.CacheBank(model, store=store)
            reused = bank.attach(follow)
            out = generate(model, follow, bank, CONTINUE_TOKENS)
            bank.close()
        finally:
            store.close()
        correct = torch.equal(out, generate(model, follow, DynamicCache(config=model.config), CONTINUE_TOKENS))
        # what the turn made publishable: its full blocks of computed tokens (its last token was generated,
        # not computed; the chat's next turn may have computed it, so `reused` can exceed this by a block)
        history = (ids.shape[1] - 1) // BLOCK_SIZE * BLOCK_SIZE
        share = min(1.0, reused / history)
        bad = _bad_records(cold_dir)
        trials.append({"trial": trial, "settled": bool(settled), "reused": reused, "history": history,
                       "tokens": ids.shape[1], "share": share, "correct": correct, "bad_records": len(bad),
                       "turns_journaled": len(lines)})
        print(f"  kill {trial}: {len(lines)} turns; {'settled' if settled else 'unsettled'} turn of {ids.shape[1]} "
              f"tokens ({history} in full blocks), {reused} reattached ({share:.0%}), continuation "
              f"{'correct' if correct else 'WRONG'}, {len(bad)} bad records", flush=True)
    settled = [t for t in trials if t["settled"]]
    shares = [t["share"] for t in settled]
    return {"trials": trials, "kills": len(trials), "wrong": sum(not t["correct"] for t in trials),
            "bad_records": sum(t["bad_records"] for t in trials), "settled": len(settled),
            "settled_at_least_80_percent": sum(s >= 0.8 for s in shares),
            "settled_share_min": min(shares) if shares else None,
            "settled_share_median": statistics.median(shares) if shares else None}


# ---- share -----------------------------------------------------------------------------------------

def run_share(args, workdir: str) -> dict:
    cold_dir, journal = os.path.join(workdir, "cold"), os.path.join(workdir, "journal.jsonl")
    rng = random.Random(23)
    seeds = iter(range(1, 10**6))
    children = [_spawn({"mode": "share", "cold": cold_dir, "journal": journal, "seed": next(seeds)})
                for _ in range(args.processes)]
    kills, failures = 0, []
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        time.sleep(rng.uniform(1.0, 6.0))
        for i, child in enumerate(children):
            if child.poll() is not None:  # it ended by itself: a wrong token (3) or an error
                failures.append(f"exit {child.returncode}: {child.stderr.read()[-1500:]}")
                children[i] = _spawn({"mode": "share", "cold": cold_dir, "journal": journal, "seed": next(seeds)})
        victim = rng.randrange(len(children))
        _kill(children[victim])
        kills += 1
        children[victim] = _spawn({"mode": "share", "cold": cold_dir, "journal": journal, "seed": next(seeds)})
    ended_at = time.time()
    for child in children:
        _kill(child)
    final = _final_checks(cold_dir, journal, ended_at - 2.0)
    with open(journal) as f:
        wrong = sum(1 for line in f if '"wrong"' in line)
    lines = [line for line in _journal(journal) if line["reused"] is not None and line["history"] > 0]
    shares = [line["reused"] / line["history"] for line in lines]
    bad = _bad_records(cold_dir)
    pids = {line["pid"] for line in _journal(journal)}
    return {"processes": args.processes, "seconds": args.seconds, "kills": kills, "turns": len(_journal(journal)),
            "processes_that_chatted": len(pids), "wrong": wrong, "failures": failures, "bad_records": len(bad),
            "continued_turns": len(lines), "reuse_share_median": statistics.median(shares) if shares else None,
            "reuse_share_at_least_90_percent": sum(s >= 0.9 for s in shares), "final_checks": final}


def _final_checks(cold_dir: str, journal: str, before: float, count: int = 10) -> dict:
    """After every process was killed: a fresh store reattaches the last `count` conversations whose
    turn finished before `before` (durable by then) and continues each; what they reused, and whether
    every continuation equals DynamicCache's."""
    model = build_model(0, MAX_TOKENS)
    latest: dict[int, dict] = {}
    for line in _journal(journal):
        if line["t"] <= before:
            latest[line["conversation"]] = line
    chosen = sorted(latest.values(), key=lambda line: line["t"])[-count:]
    store = tiered_kv.TierStore(store_config(cold_dir))
    shares, wrong = [], 0
    try:
        for line in chosen:
            ids = torch.tensor([line["ids"]])
            follow = torch.cat([ids, torch.tensor([[5, 6, 7]])], 1)
            bank = tiered_kv.CacheBank(model, store=store)
            reused = bank.attach(follow)
            out = generate(model, follow, bank, CONTINUE_TOKENS)
            bank.close()
            wrong += not torch.equal(out, generate(model, follow, DynamicCache(config=model.config), CONTINUE_TOKENS))
            shares.append(min(1.0, reused / max(1, (ids.shape[1] - 1) // BLOCK_SIZE * BLOCK_SIZE)))
    finally:
        store.close()
    return {"conversations": len(chosen), "wrong": wrong, "share_min": min(shares) if shares else None,
            "share_median": statistics.median(shares) if shares else None}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        run_child(json.loads(args.child))
        return 0
    torch.set_num_threads(1)
    load_before, started = os.getloadavg(), time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tiered_kv-crash-") as workdir:
        result = run_kills(args, workdir) if args.mode == "kill" else run_share(args, workdir)
    result.update(mode=args.mode, load_average=[load_before[0], os.getloadavg()[0]],
                  seconds_total=time.perf_counter() - started)
    if args.mode == "kill":
        print(f"{result['kills']} kills: {result['wrong']} wrong continuations, {result['bad_records']} bad records; "
              f"{result['settled_at_least_80_percent']} of {result['settled']} settled turns reattached >= 80% "
              f"(min {result['settled_share_min']}, median {result['settled_share_median']})")
    else:
        print(f"{result['processes']} processes x {result['seconds']:.0f} s, {result['kills']} kills, "
              f"{result['turns']} turns by {result['processes_that_chatted']} processes: {result['wrong']} wrong, "
              f"{result['bad_records']} bad records, {len(result['failures'])} failures; "
              f"{result['reuse_share_at_least_90_percent']} of {result['continued_turns']} continued turns reused "
              f">= 90% (median {result['reuse_share_median']})")
    print(f"load average {result['load_average'][0]:.1f} before, {result['load_average'][1]:.1f} after, "
          f"{os.cpu_count()} cores, {result['seconds_total']:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), **result}, f, indent=2)
    if args.mode == "share":
        final = result["final_checks"]
        print(f"after the last kill: {final['conversations']} conversations durable by then reattached, share min "
              f"{final['share_min']}, median {final['share_median']}, {final['wrong']} wrong continuations")
    wrong = result["wrong"] + (result["final_checks"]["wrong"] if args.mode == "share" else 0)
    return 0 if wrong == 0 and result["bad_records"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
