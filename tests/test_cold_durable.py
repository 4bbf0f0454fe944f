"""The durable cold tier (issue 6, tier level): records persisted by one ColdTier come back in the
next, intact; damaged, foreign, stale or half-written records are dropped at open or caught on read,
never served. Real files, real processes, real SIGKILLs."""
import errno
import os
import random
import select
import signal
import sqlite3
import stat
import time

import numpy as np
import pytest
import torch

from tiered_kv import ConfigError, CorruptBlockError
from tiered_kv.blocks import KVLayout
from tiered_kv.hw import block_io
from tiered_kv.hw.block_io import ColdWriteError
from tiered_kv.tiers import ColdTier
from tiered_kv.tiers import cold_format as fmt
from tiered_kv.tiers.cold_files import LOCK_NAME, open_cold_directory

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype_name="float32")  # 512 B, 4 KiB
WIDE = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_size=4, dtype_name="float32")  # 16 KiB, 20 KiB
ROOT = b"model-fingerpr-1"


def key_of(n: int) -> bytes:
    return n.to_bytes(16, "little")


def data_for(key: bytes, layout=LAYOUT) -> torch.Tensor:
    """Deterministic block contents derived from the key (what the killed child wrote for it)."""
    seed = int.from_bytes(key[:8], "little") % 100_003
    values = (np.arange(int(np.prod(layout.record_shape())), dtype=np.float32) * 0.5 + seed) % 977
    return torch.from_numpy(values.reshape(1, *layout.record_shape()))


class Cold:
    """Open / reopen a ColdTier on one directory, as successive processes would."""

    def __init__(self, path):
        self.path = str(path)
        self.directory = self.tier = None

    def open(self, layout=LAYOUT, num_slots=8, fsync=True):
        self.close()
        self.directory = open_cold_directory(self.path)
        self.tier = ColdTier(layout, num_slots, self.directory, backend="posix", fsync=fsync)
        return self.tier

    def close(self):
        if self.tier is not None:
            self.tier.close()
        if self.directory is not None:
            self.directory.close()
        self.tier = self.directory = None


@pytest.fixture
def cold(tmp_path):
    opened = Cold(tmp_path / "cold")
    yield opened
    opened.close()


def write_and_persist(tier, slot, n, layout=LAYOUT):
    tier.write_blocks([slot], data_for(key_of(n), layout))
    tier.persist(slot, key_of(n), ROOT)


def flip_byte(path, offset_bytes):
    with open(path, "r+b") as f:
        f.seek(offset_bytes)
        old = f.read(1)
        f.seek(offset_bytes)
        f.write(bytes([old[0] ^ 0x10]))


# --- round trip across processes -------------------------------------------------------------

def test_persisted_records_come_back_intact_least_recently_used_first(cold):
    tier = cold.open()
    for slot, n in [(3, 30), (0, 10), (5, 50)]:
        write_and_persist(tier, slot, n)
    tier.write_blocks([6], data_for(key_of(60)))  # written, never persisted: not durable
    tier.flush()
    tier.read_blocks([3])  # touched last
    tier.flush()
    index_path = tier.index.path
    assert os.path.basename(index_path) == f"kv-v1-{fmt.layout_signature(LAYOUT)[3:]}.index"
    assert stat.S_IMODE(os.stat(index_path).st_mode) == 0o600
    tier = cold.open()
    assert tier.durable_records() == [(0, key_of(10), ROOT), (5, key_of(50), ROOT), (3, key_of(30), ROOT)]
    assert torch.equal(tier.read_blocks([0, 5, 3]), torch.cat([data_for(key_of(n)) for n in (10, 50, 30)]))
    assert tier.read_tokens(1, tier.token_index([5], [2])).shape == (2, 2, 1, 4)
    assert tier.verify([0, 3, 5]) == []
    with pytest.raises(CorruptBlockError, match="slot 6 layer 0 holds no written data"):
        tier.read_tokens(0, tier.token_index([6], [0]))
    with sqlite3.connect(index_path) as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_a_tier_that_never_persists_leaves_no_index(cold, tmp_path):
    tier = cold.open()
    tier.write_blocks([1], data_for(key_of(1)))
    tier.forget([1])
    tier.flush()
    assert sorted(os.listdir(tmp_path / "cold")) == sorted([LOCK_NAME, fmt.block_file_name(LAYOUT)])


def test_persist_of_an_unwritten_record_or_a_bad_key_raises(cold):
    tier = cold.open()
    with pytest.raises(ValueError, match=r"slot 2: cannot persist a record whose layers \[0, 1\] were never"):
        tier.persist(2, key_of(1), ROOT)
    tier.write_blocks([2], data_for(key_of(1)))
    with pytest.raises(ValueError, match="key must be 16 bytes"):
        tier.persist(2, b"short", ROOT)


def test_other_layouts_and_format_versions_are_ignored_and_left_alone(cold, tmp_path):
    tier = cold.open()
    write_and_persist(tier, 1, 11)
    cold.close()
    foreign = {"kv-v9-0123456789abcdef.blocks": os.urandom(8192), "kv-v9-0123456789abcdef.index": b"garbage",
               "kv-0123456789abcdef.blocks": os.urandom(4096)}  # a version-0 name
    for name, content in foreign.items():
        (tmp_path / "cold" / name).write_bytes(content)
        os.chmod(tmp_path / "cold" / name, 0o600)
    other = cold.open(layout=KVLayout(2, 2, 4, 4, "float16"))
    assert other.durable_records() == []
    tier = cold.open()
    assert tier.durable_records() == [(1, key_of(11), ROOT)]
    for name, content in foreign.items():
        assert (tmp_path / "cold" / name).read_bytes() == content


def test_an_unusable_index_starts_empty_and_is_not_deleted(cold):
    tier = cold.open()
    write_and_persist(tier, 1, 11)
    path = tier.index.path
    cold.close()
    for suffix in ("-wal", "-shm"):
        if os.path.exists(path + suffix):
            os.remove(path + suffix)
    with open(path, "wb") as f:
        f.write(b"not a database" * 100)
    tier = cold.open()
    assert tier.durable_records() == []
    tier.write_blocks([1], data_for(key_of(12)))
    tier.persist(1, key_of(12), ROOT)  # durability is off for this tier: a no-op, never an error
    tier.flush()
    assert open(path, "rb").read(14) == b"not a database"


def test_a_symlink_at_the_index_name_is_refused_and_left_alone(cold, tmp_path):
    tier = cold.open()
    name = os.path.basename(tier.index.path)
    cold.close()
    target = tmp_path / "elsewhere.db"
    target.write_bytes(b"someone else's")
    os.symlink(target, tmp_path / "cold" / name)
    with pytest.raises(ConfigError, match="is a symbolic link"):
        cold.open()
    assert target.read_bytes() == b"someone else's" and os.path.islink(tmp_path / "cold" / name)


# --- off the caller's thread, batched --------------------------------------------------------

@pytest.mark.parametrize("fsync", [True, False])
def test_persist_returns_at_once_and_a_batch_shares_one_fdatasync(cold, monkeypatch, fsync):
    syncs = []
    real_sync = block_io.os.fdatasync

    def slow_sync(fd):
        syncs.append(fd)
        time.sleep(0.2)
        real_sync(fd)

    monkeypatch.setattr(block_io.os, "fdatasync", slow_sync)
    tier = cold.open(num_slots=40, fsync=fsync)
    started = time.perf_counter()
    for slot in range(40):
        write_and_persist(tier, slot, 300 + slot)
    assert time.perf_counter() - started < 0.15  # no fdatasync on the caller's thread
    tier.flush()
    assert 1 <= len(syncs) <= 3 if fsync else syncs == []  # 40 records: one fdatasync per batch
    monkeypatch.undo()
    assert [r[0] for r in cold.open(num_slots=40).durable_records()] == list(range(40))


# --- damage ----------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", [LAYOUT, WIDE], ids=["padded", "packed"])
def test_bit_flips_in_data_are_caught_on_read_and_in_headers_at_open(cold, layout):
    tier = cold.open(layout)
    for slot in range(4):
        write_and_persist(tier, slot, 100 + slot, layout)
    path, stride = tier.file_path, tier.record_stride_bytes
    cold.close()
    flip_byte(path, 1 * stride + layout.layer_bytes + 3)  # slot 1, layer 1 data
    flip_byte(path, 2 * stride + fmt.header_offset_bytes(layout) + 70)  # slot 2 header: the key
    flip_byte(path, 3 * stride + fmt.header_offset_bytes(layout) + 100)  # slot 3 header: a checksum
    flip_byte(path, 0 * stride + fmt.header_offset_bytes(layout) + 400)  # slot 0 header: the zero tail
    tier = cold.open(layout)
    assert [r[0] for r in tier.durable_records()] == [1]
    assert not tier.valid[[0, 2, 3]].any()
    with pytest.raises(CorruptBlockError, match="slot 1 layer 1 failed its checksum") as caught:
        tier.read_blocks([1])
    assert caught.value.slot == 1
    with pytest.raises(CorruptBlockError, match="slot 2 layer 0 holds no written data"):
        tier.read_tokens(0, tier.token_index([2], [0]))
    assert tier.verify([1]) == [1]
    cold.close()
    assert [r[0] for r in cold.open(layout).durable_records()] == [1]  # dropped rows stay dropped


def test_truncation_drops_the_records_it_cuts(cold):
    tier = cold.open(WIDE, num_slots=4)
    for slot in range(4):
        write_and_persist(tier, slot, 200 + slot, WIDE)
    path, stride = tier.file_path, tier.record_stride_bytes
    cold.close()
    os.truncate(path, 2 * stride + 100)
    tier = cold.open(WIDE, num_slots=4)  # regrown to 4 slots, the cut ones as zeros
    assert [r[0] for r in tier.durable_records()] == [0, 1]
    assert torch.equal(tier.read_blocks([0, 1]), torch.cat([data_for(key_of(n), WIDE) for n in (200, 201)]))


def test_a_row_whose_data_was_overwritten_is_never_served(cold):
    """A crash between reusing a slot and committing the deletion of its row: the header still
    matches the row, the data does not; the read checks the data."""
    tier = cold.open()
    write_and_persist(tier, 2, 21)
    path = tier.file_path
    cold.close()
    with open(path, "r+b") as f:  # the new block's bytes, as the reusing process wrote them
        f.seek(2 * 4096)
        f.write(data_for(key_of(22)).numpy().tobytes())
    tier = cold.open()
    assert tier.durable_records() == [(2, key_of(21), ROOT)]
    with pytest.raises(CorruptBlockError, match="slot 2 layer 0 failed its checksum"):
        tier.read_blocks([2])


# --- forget and reuse ------------------------------------------------------------------------

@pytest.mark.parametrize("flush_between", [True, False])
def test_forget_then_reuse_never_leaves_a_stale_row(cold, flush_between):
    tier = cold.open()
    write_and_persist(tier, 4, 41)
    write_and_persist(tier, 5, 51)
    if flush_between:
        tier.flush()
    tier.forget([4])
    tier.write_blocks([4], data_for(key_of(42)))  # reused, not (yet) persisted
    tier.write_blocks([5], data_for(key_of(52)))  # rewritten in place without a forget
    tier.flush()
    assert cold.open().durable_records() == []
    tier = cold.tier
    write_and_persist(tier, 4, 43)
    tier.forget([4])
    write_and_persist(tier, 4, 44)  # the queued persist of 43 is superseded
    tier.write_tokens(0, tier.token_index([5], [0]), data_for(key_of(1))[0, 0, :, :, :1, :])
    tier = cold.open()
    assert tier.durable_records() == [(4, key_of(44), ROOT)]
    assert torch.equal(tier.read_blocks([4]), data_for(key_of(44)))


# --- write failures --------------------------------------------------------------------------

def test_a_failed_data_write_raises_cold_write_error_and_leaves_no_record(cold, monkeypatch):
    tier = cold.open()
    write_and_persist(tier, 1, 11)
    tier.flush()

    def full_disk(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(block_io.os, "pwritev", full_disk)
    with pytest.raises(ColdWriteError, match="No space left") as caught:
        tier.write_blocks([1], data_for(key_of(12)))
    assert isinstance(caught.value, OSError) and caught.value.errno == errno.ENOSPC
    assert not tier.valid[1].any()
    with pytest.raises(ValueError, match="never written"):
        tier.persist(1, key_of(12), ROOT)
    monkeypatch.undo()
    assert cold.open().durable_records() == []  # the old row was withdrawn before the write


def test_a_failed_header_write_or_sync_raises_at_flush_and_commits_no_row(cold, monkeypatch):
    tier = cold.open()
    write_and_persist(tier, 1, 11)
    tier.flush()
    tier.write_blocks([2], data_for(key_of(21)))

    def broken_sync(fd):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(block_io.os, "fdatasync", broken_sync)
    tier.persist(2, key_of(21), ROOT)
    with pytest.raises(ColdWriteError, match="Input/output error"):
        tier.flush()
    monkeypatch.undo()
    tier.flush()  # reported once
    assert cold.open().durable_records() == [(1, key_of(11), ROOT)]


# --- SIGKILL of a writer at random points ----------------------------------------------------

def _child(path, trial, layout, num_slots, fsync, ready_fd):
    """Loop: forget a slot, write a block derived from a fresh key into it, persist; flush now and
    then, telling the parent (one byte on `ready_fd`) after the first flush. Runs until killed."""
    directory = open_cold_directory(path)
    tier = ColdTier(layout, num_slots, directory, backend="posix", fsync=fsync)
    for i in range(10**9):
        n = trial * 1_000_000 + i
        slot = i % num_slots
        tier.forget([slot])
        tier.write_blocks([slot], data_for(key_of(n), layout))
        tier.persist(slot, key_of(n), ROOT)
        if i % 7 == 6:
            tier.flush()
            if i == 6:
                os.write(ready_fd, b"r")


def _open_after_kill(path, layout, num_slots):
    for _ in range(200):  # the killed child's lock goes with its last fd
        try:
            directory = open_cold_directory(path)
            return directory, ColdTier(layout, num_slots, directory, backend="posix")
        except Exception as exc:  # noqa: BLE001
            if "in use" not in str(exc):
                raise
            time.sleep(0.01)
    raise AssertionError("the killed writer's lock was never released")


@pytest.mark.parametrize("layout", [LAYOUT, WIDE], ids=["padded", "packed"])
def test_sigkill_of_a_writer_at_random_points_leaves_only_intact_records(tmp_path, layout):
    rng = random.Random(6 if layout is LAYOUT else 7)
    path, num_slots, trials, seen = str(tmp_path / "cold"), 6, 30, 0
    waited, waited_with_records = 0, 0
    for trial in range(trials):
        fsync = trial % 2 == 0
        ready_r, ready_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child never returns into pytest
            try:
                os.close(ready_r)
                _child(path, trial, layout, num_slots, fsync, ready_w)
            finally:
                os._exit(0)
        os.close(ready_w)
        # half the kills land anywhere from the start; the other half after the child's first
        # flush (however slow a loaded machine makes it), while it keeps writing and persisting
        wait_for_flush = trial % 4 >= 2
        if wait_for_flush:
            assert select.select([ready_r], [], [], 60.0)[0], "the writer never flushed"
            waited += 1
        time.sleep(rng.uniform(0.0, 0.04) if wait_for_flush else rng.uniform(0.005, 0.08))
        os.kill(pid, signal.SIGKILL)
        os.close(ready_r)
        assert os.waitpid(pid, 0)[1] & 0x7F == signal.SIGKILL
        directory, tier = _open_after_kill(path, layout, num_slots)
        try:
            records = tier.durable_records()
            seen += len(records)
            waited_with_records += bool(wait_for_flush and records)
            for slot, key, root in records:
                n = int.from_bytes(key, "little")
                assert root == ROOT and n // 1_000_000 <= trial and (n % 1_000_000) % num_slots == slot
                assert torch.equal(tier.read_blocks([slot]), data_for(key, layout)), (trial, slot, n)
            assert tier.verify([slot for slot, _, _ in records]) == []
        finally:
            tier.close()
            directory.close()
    # the test can fail: kills must also land after records became durable, not only before
    assert seen > 0 and waited_with_records >= waited // 3, (seen, waited_with_records, waited)
