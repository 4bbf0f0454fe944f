"""One TierStore, many threads (issue 5, defect 3): a server-like stress test.

One model instance, one store with hot and warm squeezed to a few blocks (so blocks move every turn)
and a cold tier that holds everything, 8 chats (half of them sharing a system prefix) driven from 4
threads for 3 turns each. A chat's turns may run on different threads. Every chat's greedy tokens
must equal its own DynamicCache run (computed single-threaded first), no thread may raise, a sampler
thread must never see a tier over its capacity, and the whole run must end (join timeouts: a
deadlock fails the test instead of hanging it; the threads are daemons).
"""

from __future__ import annotations

import queue
import random
import threading
import time
from dataclasses import dataclass, field

import pytest
import torch
from transformers import DynamicCache

import tiered_kv
from helpers import greedy, make_bank, rand_ids, tier_config, tiny_model

NUM_CHATS, NUM_THREADS, NUM_TURNS = 8, 4, 3
JOIN_TIMEOUT_S = 300.0  # a deadlock detector, generous: a loaded 2-core machine runs 10x slower
SEEDS = range(10)


@dataclass
class Chat:
    prompt: torch.Tensor
    users: list  # the user turns after the first, [1, n] each
    new_tokens: list  # max_new_tokens per turn
    outputs: list = field(default_factory=list)
    bank: object = None
    model: object = None

    def next_ids(self, outputs: list) -> torch.Tensor:
        turn = len(outputs)
        return self.prompt if turn == 0 else torch.cat([outputs[-1], self.users[turn - 1]], 1)


def _chats(seed: int) -> list[Chat]:
    rng = random.Random(seed)
    system = rand_ids(10_000 + seed, 8)  # half the chats share it: their first blocks are shared
    chats = []
    for i in range(NUM_CHATS):
        own = rand_ids(100 * seed + i, rng.randint(3, 9))
        prompt = torch.cat([system, own], 1) if i % 2 == 0 else own
        users = [rand_ids(100_000 + 100 * seed + 10 * i + t, rng.randint(2, 6)) for t in range(NUM_TURNS - 1)]
        chats.append(Chat(prompt, users, [rng.randint(3, 6) for _ in range(NUM_TURNS)]))
    return chats


def _reference(model, chat: Chat) -> list[torch.Tensor]:
    cache, outputs = DynamicCache(config=model.config), []
    for turn in range(NUM_TURNS):
        outputs.append(greedy(model, chat.next_ids(outputs), cache, chat.new_tokens[turn]))
    return outputs


def _squeezed_config(tmp_path, engine: str = "auto", delay_us: int = 0) -> dict:
    config = tier_config("forces_cold", tmp_path, engine=engine, delay_us=delay_us)
    config["hot"]["capacity_blocks"] = 3
    config["warm"]["capacity_blocks"] = 4
    config["cold"]["capacity_blocks"] = 256
    return config


def _run_threaded(store, chats: list[Chat], form: str, seed: int, prefetch: bool = False):
    """Drive every chat's turns from NUM_THREADS worker threads. Returns (errors, overflows, alive)."""
    tasks: queue.Queue = queue.Queue()
    order = list(range(len(chats)))
    random.Random(seed).shuffle(order)
    for i in order:
        tasks.put(i)
    lock = threading.Lock()
    finished = [0]
    errors, overflows = [], []
    stop = threading.Event()

    def worker():
        while True:
            with lock:
                if finished[0] == len(chats) or errors:
                    return
            try:
                i = tasks.get(timeout=0.005)
            except queue.Empty:
                continue
            chat = chats[i]
            model = chat.model
            try:
                if chat.bank is None:
                    chat.bank = make_bank(form, model, store=store, cost_sensitivity=(i % 3) / 2)
                elif prefetch:  # "the user starts typing": the mover brings the history up meanwhile
                    chat.bank.prefetch()
                ids = chat.next_ids(chat.outputs)
                chat.bank.attach(ids)
                chat.outputs.append(greedy(model, ids, chat.bank, chat.new_tokens[len(chat.outputs)]))
                if len(chat.outputs) == NUM_TURNS:
                    chat.bank.close()
                    with lock:
                        finished[0] += 1
                else:
                    tasks.put(i)  # its next turn may run on another thread
            except BaseException as error:  # noqa: BLE001 - reported by the test
                with lock:
                    errors.append(f"chat {i} turn {len(chat.outputs)}: {type(error).__name__}: {error}")
                return

    def sampler():
        while not stop.is_set():
            try:
                for name, tier in store.stats()["tiers"].items():
                    if tier["used_blocks"] > tier["capacity_blocks"]:
                        overflows.append(f"{name}: {tier['used_blocks']} > {tier['capacity_blocks']}")
            except BaseException as error:  # noqa: BLE001
                errors.append(f"sampler: store.stats() raised {type(error).__name__}: {error}")
                return
            time.sleep(0.002)

    watcher = threading.Thread(target=sampler, daemon=True, name="stats-sampler")
    workers = [threading.Thread(target=worker, daemon=True, name=f"chat-worker-{n}") for n in range(NUM_THREADS)]
    watcher.start()
    for thread in workers:
        thread.start()
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    for thread in workers:
        thread.join(max(0.0, deadline - time.monotonic()))
    stop.set()
    watcher.join(5.0)
    alive = [thread.name for thread in workers + [watcher] if thread.is_alive()]
    return errors, overflows, alive


def _stress(form: str, seed: int, tmp_path, scheduler: dict | None = None, prefetch: bool = False,
            engine: str = "auto", delay_us: int = 0, models: tuple = (), compression: str = "none"):
    model = tiny_model("llama")  # one model instance serves every chat, like a server
    chats = _chats(seed)
    for i, chat in enumerate(chats):  # with `models`, chats alternate between models of one KV shape
        chat.model = ([model, *models])[i % (1 + len(models))]
    expected = [_reference(chat.model, chat) for chat in chats]  # single-threaded, before
    config = _squeezed_config(tmp_path, engine, delay_us)
    if compression != "none":  # warm and cold packed alike: blocks cross between them as they are
        config["warm"].update(compression=compression, layout="records")
        config["cold"]["compression"] = compression
    if scheduler is not None:
        config["scheduler"] = scheduler
        # watermarks low enough that the mover demotes in the background all the time
        config["hot"].update(high_watermark=0.34, low_watermark=0.0)
        config["warm"].update(high_watermark=0.5, low_watermark=0.25)
    store = tiered_kv.TierStore(config)
    errors, overflows, alive = _run_threaded(store, chats, form, seed, prefetch)
    assert not alive, f"deadlock: threads {alive} still running after {JOIN_TIMEOUT_S} s"
    assert not errors, errors
    assert not overflows, f"tiers over capacity: {sorted(set(overflows))}"
    for i, (chat, want) in enumerate(zip(chats, expected)):
        assert len(chat.outputs) == NUM_TURNS, f"chat {i} ran {len(chat.outputs)} turns"
        for turn, (got, ref) in enumerate(zip(chat.outputs, want)):
            assert torch.equal(got, ref), f"chat {i} turn {turn}: {got.tolist()} != {ref.tolist()}"
    stats = store.stats()
    moved = stats["bytes_moved"]
    assert sum(moved.values()) > 0, f"the squeezed tiers moved no block: {moved}"
    if scheduler is not None:
        assert stats["bytes_background"] > 0, f"the mover moved nothing: {stats['scheduler']}"
    assert store.wait_for_background(60) and store.check_consistency() == []
    assert not store.state.has_pins and not store.state.in_flight
    store.close()


@pytest.mark.parametrize("seed", SEEDS)
def test_many_chats_from_many_threads_on_one_store(seed, tmp_path):
    _stress("model", seed, tmp_path)


@pytest.mark.parametrize("policy", ["lru", "lfu", "fifo", "turns"])
def test_every_policy_with_the_mover_and_prefetch_from_many_threads(policy, tmp_path):
    """Issue 7: greedy tokens equal DynamicCache's under every policy, chats driven from 4 threads
    while the background mover prefetches, demotes past the watermarks and compacts."""
    _stress("model", 0, tmp_path, scheduler={"policy": policy, "ali_window": 8, "idle_steps": 6,
                                             "mover_interval_s": 0.001}, prefetch=True)


@pytest.mark.parametrize("delay_us", (100, 500))
@pytest.mark.parametrize("seed", SEEDS[:2])
def test_many_chats_from_many_threads_with_copies_held_back(seed, delay_us, tmp_path):
    """Issue 16: every copy runs later, on the thread engine; two models of one KV shape (different
    weights: they never share a block) on one store, the mover prefetching and demoting."""
    from helpers import same_shape_model

    _stress("model", seed, tmp_path, scheduler={"policy": "lru", "ali_window": 8, "idle_steps": 6,
                                                "mover_interval_s": 0.001}, prefetch=True,
            engine="thread", delay_us=delay_us, models=(same_shape_model(tiny_model("llama"), 99),))


@pytest.mark.parametrize("engine", ("auto", "thread"))
def test_many_chats_from_many_threads_through_compressed_warm_and_cold(engine, tmp_path):
    """Issue 21: the same with warm and cold int8 (packed blocks between them, decoded into hot and
    into each step's reads), the mover on; int8 keeps this model's greedy tokens equal to
    DynamicCache's (tests/test_compression.py), so every chat must still match its reference."""
    _stress("model", 1, tmp_path, scheduler={"policy": "lru", "ali_window": 8, "idle_steps": 6,
                                             "mover_interval_s": 0.001}, prefetch=True,
            engine=engine, delay_us=300 if engine == "thread" else 0, compression="int8")


@pytest.mark.parametrize("seed", SEEDS[:3])
def test_many_config_banks_from_many_threads_on_one_store(seed, tmp_path):
    """The same with banks built from model.config (no id recording; the store's locking alone)."""
    _stress("config", seed, tmp_path)


def test_threads_harness_with_dynamic_cache_matches_single_threaded():
    """Control: the harness itself (one model, 4 threads) is deterministic without any CacheBank."""
    model = tiny_model("llama")
    chats = _chats(0)
    expected = [_reference(model, chat) for chat in chats]
    results: dict = {}

    def run(i):
        results[i] = _reference(model, chats[i])

    threads = [threading.Thread(target=lambda n=n: [run(i) for i in range(n, NUM_CHATS, NUM_THREADS)], daemon=True)
               for n in range(NUM_THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(JOIN_TIMEOUT_S)
    assert not any(thread.is_alive() for thread in threads)
    for i in range(NUM_CHATS):
        assert all(torch.equal(a, b) for a, b in zip(results[i], expected[i])), f"chat {i}"
