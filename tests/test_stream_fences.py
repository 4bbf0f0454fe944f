"""GPU stream order (issue 34): a step's slots stay in use until the stream its forward ran on
passed the step's completion fence, whichever thread later frees, moves or copies them.

On a GPU a forward returns to Python before its kernels ran; on CPU it never does. The CPU copy
engines take an emulated compute stream per thread (`engine.use_stream(EmulatedStream())`, as
`torch.cuda.stream(s)`): work a "step" queues on it (here: a late write of the step's K/V into its
hot slots, queued before the forward returns) completes only when the test runs the stream. With
the thread copy engine (`copies.engine: thread`) every copy also runs later, on the engine's
thread, so the order of copies, frees and compute is observable:

(a) a hot slot a step read is handed out again (another chat's new block, a move's destination)
    only after the step's fence passed;
(b) a block the mover moves down right after a step ends is copied (and its slot freed) only
    after that step's fence passed: the copy carries the step's late writes;
(c) the fence is the one of the stream the forward ran on, not of the thread that submits the copy;
(d) greedy tokens equal DynamicCache's with a compute that lags the host, in the squeezed tiers.
The CUDA tests at the end run the same rules on a GPU (events on the forward's stream, the copy
engine's side stream waiting on them); they are skipped without one.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

import tiered_kv
from helpers import BLOCK_SIZE, greedy, rand_ids, reference, tier_config, tiny_model
from tiered_kv import hooks
from tiered_kv.blocks import HOT, WARM
from tiered_kv.hw.copy_engine import ThreadCopyEngine
from tiered_kv.hw.emulated_stream import EmulatedStream

HAS_CUDA = torch.cuda.is_available()


def config(tmp_path, hot: int, warm: int = 64, watermarks: dict | None = None, **scheduler) -> dict:
    return {"block_size": BLOCK_SIZE,
            "hot": {"device": "cpu", "capacity_blocks": hot, **(watermarks or {})},
            "warm": {"capacity_blocks": warm, "layout": "records"},
            "cold": {"capacity": 0, "path": str(tmp_path / "cold")},
            "copies": {"engine": "thread", "delay_us": 0},
            "scheduler": {"background": False, **scheduler}}


def step(model, bank, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, cache=bank, use_cache=True).logits


def hot_blocks(store) -> dict[int, int]:
    """block id -> hot slot, for every block in hot."""
    with store.lock:
        return {b: e.slot for b, e in store.index.items() if e.tier == HOT}


def until(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


class LateWrites:
    """What a GPU step leaves behind: writes into the step's hot slots still queued on its stream
    when the forward returns. Installed on the model's final norm (after every layer, before the
    forward's end commits the step), it queues on `stream` a write of known bytes into every hot
    slot in use; `expected[block]` is what each block must hold once the stream ran."""

    def __init__(self, model, store, stream: EmulatedStream):
        self.store, self.stream, self.expected = store, stream, {}
        self.armed = False
        self._handle = model.model.norm.register_forward_hook(self._queue)

    def _queue(self, module, args, output):
        if not self.armed:
            return
        self.armed = False
        hot = self.store.tiers[HOT]
        for block_id, slot in hot_blocks(self.store).items():
            data = torch.full((1, *self.store.layout.record_shape()), float(1000 + block_id))
            self.expected[block_id] = data
            self.stream.enqueue(lambda slot=slot, data=data: hot.write_blocks([slot], data))

    def remove(self):
        self._handle.remove()


def read_block(store, block_id: int) -> torch.Tensor:
    with store.lock:
        entry = store.index.get(block_id)
    return store.tiers[entry.tier].read_blocks([entry.slot]).to("cpu")


# ---- the engines' streams -------------------------------------------------------------------------------
def test_a_thread_engine_unit_waits_for_the_fences_it_is_given_on_the_engines_thread():
    engine, stream = ThreadCopyEngine(), EmulatedStream()
    try:
        order = []
        stream.enqueue(lambda: order.append("compute"))
        fence = engine.record_fence(stream)
        event = engine.submit(lambda: order.append("copy"), after=(fence,))
        time.sleep(0.05)
        assert not event.done() and order == []  # the copy waits for the compute queued before the fence
        stream.run()
        event.wait()
        assert order == ["compute", "copy"]
        assert engine.record_fence(None) is None  # no stream: compute already done, nothing to wait for
    finally:
        stream.release()
        engine.close()


def test_a_thread_without_a_stream_computes_synchronously_and_streams_are_per_thread():
    engine, stream = ThreadCopyEngine(), EmulatedStream()
    try:
        assert engine.current_stream() is None
        seen = {}
        with engine.use_stream(stream):
            other = threading.Thread(target=lambda: seen.update(other=engine.current_stream()))
            other.start()
            other.join()
            assert engine.current_stream() is stream
        assert seen == {"other": None} and engine.current_stream() is None
    finally:
        engine.close()


# ---- (a) a slot a step read is not handed out before its fence ------------------------------------------
@pytest.mark.parametrize("by", ("allocation", "move"))
def test_a_hot_slot_a_step_read_is_handed_out_again_only_after_the_steps_fence_passed(tmp_path, by):
    """Chat A's step (14 tokens: 4 hot blocks, hot is full) runs on a held stream; A closes (its
    tail is freed, its 3 full blocks stay cached). Chat B then needs hot room: for a new block of
    its own ("allocation") or for its history coming up from warm ("move"). Until A's fence passed,
    no block but A's own lies in a slot A's step read; once it passed, B gets its room."""
    store = tiered_kv.TierStore(config(tmp_path, hot=4))
    model = tiny_model("llama")
    stream = EmulatedStream()
    engine = store.copy_engine
    bank_b = tiered_kv.CacheBank(model, store=store)
    try:
        ids_b = rand_ids(2, 6)
        if by == "move":
            step(model, bank_b, ids_b)
            bank_b.offload("warm")
            assert set(bank_b.stats()["bank_blocks"].items()) >= {("hot", 0)}
        bank_a = tiered_kv.CacheBank(model, store=store)
        with engine.use_stream(stream):
            step(model, bank_a, rand_ids(1, 14))
        slots_a = hot_blocks(store)
        assert len(slots_a) == 4
        bank_a.close()
        follow = torch.cat([ids_b, rand_ids(3, 3)], 1)
        done = {}

        def chat_b():
            if by == "move":
                bank_b.prefetch()  # no mover: the blocks come up now
                done["out"] = greedy(model, follow, bank_b, 2)
            else:
                done["out"] = greedy(model, ids_b, bank_b, 2)

        worker = threading.Thread(target=chat_b, daemon=True)
        worker.start()
        worker.join(0.5)  # B runs (or waits for room) while A's compute is still queued
        taken = {b: s for b, s in hot_blocks(store).items() if s in set(slots_a.values()) and b not in slots_a}
        assert taken == {}, f"slots A's step read were handed out before its fence passed: {taken}"
        assert stream.num_fences >= 1
        stream.release()
        worker.join(30)
        assert not worker.is_alive() and "out" in done
        expected = reference(model, follow if by == "move" else ids_b, 2)
        assert torch.equal(done["out"], expected)
        assert store.check_consistency() == []
    finally:
        stream.release()
        bank_b.close()
        store.close()


# ---- (b) the mover copies a block only after the step's fence ------------------------------------------
def test_a_block_the_mover_moves_down_right_after_a_step_carries_the_steps_late_writes(tmp_path):
    """Chat A's step fills 6 hot blocks on a held stream; chat B's steps (no stream) then make A
    idle (idle_steps 2), and the mover moves A's blocks down to warm while A's compute is still
    queued. Every copy of it must wait for A's fence on the engine's thread, so what lands in
    warm is what A's compute wrote last, and the hot slots A leaves are freed only after that."""
    store = tiered_kv.TierStore(config(tmp_path, hot=16, background=True, mover_interval_s=0.001, idle_steps=2,
                                       cs_weight=0.0))
    model = tiny_model("llama")
    stream = EmulatedStream()
    bank_a, bank_b = tiered_kv.CacheBank(model, store=store), tiered_kv.CacheBank(model, store=store)
    late = LateWrites(model, store, stream)
    try:
        late.armed = True
        with store.copy_engine.use_stream(stream):
            step(model, bank_a, rand_ids(4, 22))  # 6 blocks, all hot
        slots = hot_blocks(store)
        assert len(slots) == 6 and set(late.expected) == set(slots)
        step(model, bank_b, rand_ids(5, 5))
        for _ in range(40):  # B's steps age A's blocks until the mover takes them down
            step(model, bank_b, torch.tensor([[7]]))
            if until(lambda: store.mover.busy or store.mover.num_batches > 0, 0.02):
                break
        assert store.mover.busy or store.mover.num_batches > 0, "the mover never started"
        time.sleep(0.1)  # the mover has had every chance to copy and commit
        assert {b: s for b, s in hot_blocks(store).items() if b in slots} == slots, \
            "blocks left hot before the fence of the step that wrote them passed"
        assert all(store.pools[HOT].is_used(s) for s in slots.values())
        stream.run()  # A's compute completes: its late writes land, then its fence passes
        assert store.wait_for_background(30)
        assert not set(hot_blocks(store)) & set(slots), "the mover did not move A's blocks down"
        for block_id, data in late.expected.items():
            assert torch.equal(read_block(store, block_id), data), f"block {block_id} lost the step's last writes"
        assert store.check_consistency() == []
    finally:
        late.remove()
        stream.release()
        bank_a.close()
        bank_b.close()
        store.close()


# ---- (c) the fence of the forward's stream, not the submitter's ------------------------------------------
@pytest.mark.parametrize("submitter", ("runs_at_once", "held"))
def test_the_fence_comes_from_the_stream_the_forward_ran_on_not_the_submitting_threads(tmp_path, submitter):
    """The step runs on thread T1 over a held stream S1; the offload that copies its blocks down is
    submitted from thread T2, whose own stream S2 runs at once, or is held too. The copies wait for
    S1's fence, and for S1's only: nothing is recorded on S2 (it ran no step)."""
    store = tiered_kv.TierStore(config(tmp_path, hot=16))
    model = tiny_model("llama")
    engine = store.copy_engine
    s1, s2 = EmulatedStream(name="s1"), EmulatedStream(name="s2")
    if submitter == "runs_at_once":
        s2.release()
    bank = tiered_kv.CacheBank(model, store=store)
    late = LateWrites(model, store, s1)
    try:
        def run_step():
            late.armed = True
            with engine.use_stream(s1):
                step(model, bank, rand_ids(5, 18))

        t1 = threading.Thread(target=run_step)
        t1.start()
        t1.join(30)
        assert len(late.expected) == 5

        def offload():
            with engine.use_stream(s2):
                bank.offload("warm")

        t2 = threading.Thread(target=offload, daemon=True)
        t2.start()
        t2.join(0.3)
        assert len(hot_blocks(store)) == 5, "blocks moved before the fence of the stream their step ran on"
        assert s2.num_fences == 0 and s1.num_fences >= 1
        s1.run()
        t2.join(10)
        assert not t2.is_alive(), "the copies waited for the submitting thread's stream"
        assert hot_blocks(store) == {}
        for block_id, data in late.expected.items():
            assert torch.equal(read_block(store, block_id), data), f"block {block_id} lost the step's last writes"
        assert store.check_consistency() == []
    finally:
        late.remove()
        s1.release()
        s2.release()
        bank.close()
        store.close()


def test_a_step_whose_compute_lags_leaves_its_freed_slots_deferred_without_waiting(tmp_path):
    """No host wait on the step's path: the step returns while its fence is pending; slots it
    released wait in the deferred list, and drain frees them once the fence passed."""
    store = tiered_kv.TierStore(config(tmp_path, hot=16))
    model = tiny_model("llama")
    stream = EmulatedStream()
    bank = tiered_kv.CacheBank(model, store=store)
    try:
        with store.copy_engine.use_stream(stream):
            step(model, bank, rand_ids(6, 10))  # 3 blocks; the tail (2 tokens) is never published
        bank.reset()  # the tail is freed: its slot waits for the step's fence
        assert store.state.num_deferred_frees == 1
        stream.run()
        with store.lock:
            store.state.drain()
        assert store.state.num_deferred_frees == 0 and store.check_consistency() == []
    finally:
        stream.release()
        bank.close()
        store.close()


def test_a_rolled_back_step_still_fences_the_slots_it_wrote(tmp_path):
    """A step that fails in its last layer is rolled back: the blocks it allocated are released at
    once, but its compute (queued up to the failure) may still write them: their slots wait too."""
    store = tiered_kv.TierStore(config(tmp_path, hot=16))
    model = tiny_model("llama")
    stream = EmulatedStream()
    bank = tiered_kv.CacheBank(model, store=store)

    def fails(module, args, output):
        raise RuntimeError("injected: the last layer failed")

    handle = model.model.layers[-1].register_forward_hook(fails)
    try:
        with store.copy_engine.use_stream(stream), pytest.raises(RuntimeError, match="injected"):
            step(model, bank, rand_ids(8, 10))
        assert store.state.num_deferred_frees == 3 and store.pools[HOT].num_free == 13
        stream.run()
        with store.lock:
            store.state.drain()
        assert store.pools[HOT].num_free == 16 and store.check_consistency() == []
    finally:
        handle.remove()
        stream.release()
        bank.close()
        store.close()


def test_a_copy_through_a_warm_slot_a_pending_step_used_makes_the_host_wait(tmp_path):
    """A step's hot slots are ordered on the device (the side stream waits on its event); its warm
    slots may be read or written by a unit's host code (a gather into cold's staging), so a copy
    through one gets a HostFence, which even the CUDA engine waits for on the host."""
    from types import SimpleNamespace

    from tiered_kv.hw.copy_engine import HostFence

    store = tiered_kv.TierStore(config(tmp_path, hot=2))
    model = tiny_model("llama")
    stream = EmulatedStream()
    bank = tiered_kv.CacheBank(model, store=store)
    try:
        with store.copy_engine.use_stream(stream):
            step(model, bank, rand_ids(7, 14))  # 4 blocks: 2 hot, 2 warm
        with store.lock:
            placed = {e.tier: e.slot for _, e in store.index.items()}  # (one slot per tier)
            warm_used = {e.slot for _, e in store.index.items() if e.tier == WARM}
        fences = store.state.step_fences

        def copy(tier):
            return fences.for_transfers([SimpleNamespace(src_tier=tier, src_slot=placed[tier], dst_tier=2, dst_slot=0)])

        through_hot, through_warm = copy(HOT), copy(WARM)
        assert len(through_hot) == 1 and not isinstance(through_hot[0], HostFence)
        assert len(through_warm) == 1 and isinstance(through_warm[0], HostFence)
        unused = SimpleNamespace(src_tier=WARM, src_slot=63, dst_tier=2, dst_slot=1)
        assert 63 not in warm_used and fences.for_transfers([unused]) == ()  # a slot it never used
        stream.run()
        assert copy(HOT) == copy(WARM) == ()
    finally:
        stream.release()
        bank.close()
        store.close()


# ---- (d) tokens equal DynamicCache's while compute lags the host -----------------------------------------
@pytest.mark.parametrize("hooked", (False, True), ids=("plain", "hooks"))
@pytest.mark.parametrize("kind", ("forces_warm", "forces_cold"))
def test_greedy_tokens_equal_dynamic_cache_while_compute_lags_the_host(tmp_path, kind, hooked):
    """Every step's compute completes 2 ms after it returned (a timed stream): frees wait for
    fences, copies wait for them on the engine's thread; two turns and a second chat on another
    thread and stream still give DynamicCache's tokens."""
    model = tiny_model("llama")
    bank = tiered_kv.CacheBank(model, tier_config(kind, tmp_path, engine="thread", delay_us=300))
    if hooked:
        hooks.install(model, bank)
    engine = bank.store.copy_engine
    streams = [EmulatedStream(delay_us=2000, name=f"chat{i}") for i in range(2)]
    other = tiered_kv.CacheBank(model, store=bank.store)
    try:
        results = {}

        def chat(i, cache, seed):
            with engine.use_stream(streams[i]):
                ids = rand_ids(seed, 17)
                out = greedy(model, ids, cache, 5)
                follow = torch.cat([out, rand_ids(seed + 1, 4)], 1)
                results[i] = (ids, out, follow, greedy(model, follow, cache, 5))

        worker = threading.Thread(target=chat, args=(1, other, 20))
        worker.start()
        chat(0, bank, 10)
        worker.join(120)
        assert not worker.is_alive()
        for ids, out, follow, out2 in results.values():
            assert torch.equal(out, reference(model, ids, 5))
            assert torch.equal(out2, reference(model, follow, 5))
        assert all(s.num_fences > 0 for s in streams)
        assert bank.store.check_consistency() == []
    finally:
        if hooked:
            hooks.uninstall(model)
        other.close()
        bank.close()
        for s in streams:
            s.close()


# ---- CUDA: the same rules on a GPU (skipped here) ----------------------------------------------------------
@pytest.mark.skipif(not HAS_CUDA, reason="needs a GPU (runs on the lent H200)")
def test_cuda_side_stream_copies_wait_for_a_fence_recorded_on_another_stream():
    from tiered_kv.hw.copy_engine import CudaCopyEngine

    device = torch.device("cuda")
    engine, compute = CudaCopyEngine(device), torch.cuda.Stream(device)
    src = torch.zeros(1 << 20, device=device)
    dst = torch.empty_like(src)
    with torch.cuda.stream(compute):
        torch.cuda._sleep(100_000_000)  # the compute lags: the write below lands long after submit
        src.fill_(7.0)
    fence = engine.record_fence(compute)  # recorded by this thread, whose current stream is the default one
    event = engine.submit(lambda: dst.copy_(src, non_blocking=True), after=(fence,))
    event.wait()
    assert bool((dst == 7.0).all())
    engine.close()


@pytest.mark.skipif(not HAS_CUDA, reason="needs a GPU (runs on the lent H200)")
def test_cuda_a_step_on_another_stream_is_fenced_before_its_blocks_move():
    """`with torch.cuda.stream(s): model(...)` for a decode step whose last layer waits behind a
    long kernel, so its K/V land well after the forward returned; its blocks are offloaded at once
    from the default stream. The copies wait for the step's fence on s (the old code waited for
    the offloading thread's current stream only): warm holds DynamicCache's K/V for the step's
    token, and the next turn gives DynamicCache's tokens."""
    from transformers import DynamicCache

    model = tiny_model("llama").cuda()
    bank = tiered_kv.CacheBank(model, {"block_size": BLOCK_SIZE, "hot": {"capacity_blocks": 64},
                                       "warm": {"capacity_blocks": 64}, "cold": {"capacity": 0},
                                       "scheduler": {"background": False}})
    lag = {"armed": False}

    def last_layer_waits(module, args):
        if lag["armed"]:
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the last layer's K/V write

    handle = model.model.layers[-1].register_forward_pre_hook(last_layer_waits)
    try:
        ids = rand_ids(3, 22).cuda()
        step(model, bank, ids[:, :21])
        torch.cuda.synchronize()
        stream = torch.cuda.Stream()
        lag["armed"] = True
        with torch.cuda.stream(stream):
            step(model, bank, ids[:, 21:])  # a decode step: no host sync, it returns long before its K/V land
        lag["armed"] = False
        assert bank.steps.last_lease.stream == stream
        bank.offload("warm")  # from the default stream, at once
        torch.cuda.synchronize()
        assert bank.stats()["bank_blocks"]["hot"] == 0
        expected = DynamicCache(config=model.config)
        with torch.no_grad():
            model(ids, cache=expected, use_cache=True)
        store, last = bank.store, len(expected.layers) - 1
        _, slots = store.placements(bank.seq.rows[0].table)
        stored = store.tiers[WARM].read_blocks(slots.tolist()).to("cpu")  # [blocks, L, 2, H, bs, D]
        for kv, name in ((0, "keys"), (1, "values")):
            want = getattr(expected.layers[last], name)[0, :, 21].cpu()
            got = stored[21 // BLOCK_SIZE, last, kv, :, 21 % BLOCK_SIZE]
            assert torch.allclose(got, want, atol=1e-3), f"the step's {name} never reached warm"
        follow = torch.cat([ids, rand_ids(4, 3).cuda()], 1)
        assert torch.equal(greedy(model, follow, bank, 4), reference(model, follow, 4))
    finally:
        handle.remove()
        bank.close()
