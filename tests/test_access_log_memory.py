"""The access log's memory follows the live blocks, not every block ever allocated (block ids are
never reused: a log indexed by id grows without bound on a server that runs for days)."""
import numpy as np
import torch

from tiered_kv import TierStore
from tiered_kv.blocks import KVLayout
from tiered_kv.scheduler.access_log import AccessLog

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, block_size=4, dtype_name="float32")


def array_elements(log: AccessLog) -> int:
    """The longest numpy array the log keeps (on itself or one level down): its memory in rows."""
    arrays = [a for a in vars(log).values() if isinstance(a, np.ndarray)]
    for part in vars(log).values():
        if hasattr(part, "__dict__") and not isinstance(part, type):
            arrays += [a for a in vars(part).values() if isinstance(a, np.ndarray)]
    return max((len(a) for a in arrays), default=0)


def test_allocating_and_freeing_many_blocks_keeps_the_log_bounded_by_the_live_ones():
    log = AccessLog(window_steps=8)
    held = np.arange(10, dtype=np.int64)  # a long-lived prefix: the lowest ids stay live throughout
    log.record_step(0, held)
    for round_no in range(1000):  # 100,000 blocks allocated and freed in rounds of 100
        ids = np.arange(10 + 100 * round_no, 10 + 100 * (round_no + 1), dtype=np.int64)
        log.record_step(1 + round_no % 3, ids, new_turn=round_no % 7 == 0)
        log.record_step(1 + round_no % 3, ids)  # a repeated step (the same array)
        if round_no % 5 == 0:
            log.announce_turn(0, held)
            log.record_step(0, held)
        assert log.window_reads(ids).tolist() == [2] * 100  # (read while live)
        log.forget_blocks(ids.tolist())
        assert log.last_read_step(ids).tolist() == [-1] * 100  # a freed block reads as never read
    assert array_elements(log) <= 2048
    assert log.num_reads(held)[0] > 0 and (log.last_read_step(held) >= 0).all()
    fresh = AccessLog(window_steps=8)
    for name in ("last_read_step", "num_reads", "window_reads", "ali", "heat", "cost_sensitivity"):
        assert getattr(log, name)([20, 99_999]).tolist() == getattr(fresh, name)([20, 99_999]).tolist(), name


def test_a_store_that_frees_its_blocks_makes_the_log_forget_them(tmp_path):
    store = TierStore({"block_size": 4, "hot": {"device": "cpu", "capacity_blocks": 256},
                       "warm": {"capacity_blocks": 0}, "cold": {"capacity_blocks": 0, "path": str(tmp_path / "c")}})
    store.bind(LAYOUT, torch.float32)
    try:
        kept = store.allocate(4)
        for round_no in range(300):  # 30,000 blocks through the store, 100 at a time
            blocks = store.allocate(100)
            ids = np.asarray(kept + blocks, dtype=np.int64)
            store.access_log.record_step(1, ids, [kept + blocks])  # as a step's lease records it
            store.access_log.record_step(1, ids, [kept + blocks])
            store.release(blocks)  # unpublished and unreferenced: freed
        assert max(blocks) >= 30_000
        assert array_elements(store.access_log) <= 2048
        assert store.access_log.last_read_step(blocks).tolist() == [-1] * 100  # freed: never read
        assert (store.access_log.last_read_step(kept) == store.access_log.now - 1).all()
    finally:
        store.close()


def test_runs_the_log_keeps_are_bounded_by_the_window_and_the_chats_without_reads():
    log = AccessLog(window_steps=16)
    ids = np.arange(8, dtype=np.int64)
    for step in range(5000):  # no signal read: every change of ids closes a run that waits to be folded in
        ids = np.append(ids, 8 + step) if step % 2 else ids
        log.record_step(step % 3, ids)
    assert len(log._pending) <= 3 and len(log._window_due) <= 16 + 3 and len(log._window) == 16
    assert log.window_reads(ids[:1]).tolist() == [16]
