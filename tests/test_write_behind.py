"""Issue 19: a cold tier that loses nothing in a crash and serves every process on the machine.

- write-behind: a published block in hot or warm gets a durable copy in cold within
  `cold.write_behind_s`, so a process SIGKILLed with its chats open loses at most that interval;
- many processes on one `cold.path`: each writes its own block file, all share one index, and a
  process attaches what another one (alive or dead) made durable, token-identically;
- a failed cold write costs the copy, never the step.

The killed processes are forked children (as in test_crash_recovery.py): the parent computed the
reference conversations with DynamicCache before forking, so it knows every token they produce.
"""

from __future__ import annotations

import errno
import os
import signal
import time
import traceback

import pytest
import torch

import tiered_kv
from helpers import BLOCK_SIZE, greedy, tier_config, tiny_model
from test_crash_recovery import TURNS, Conversation, check_reattach
from tiered_kv.blocks import COLD, HOT
from tiered_kv.hw import block_io

WRITE_BEHIND_S = 0.2


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)  # before any torch work: forked children then run torch safely
    return tiny_model("llama")


@pytest.fixture(scope="module")
def conversations(model):
    return [Conversation(model, seed) for seed in (1, 2)]


def shared_config(cold_dir, kind: str = "all_hot", cold_blocks: int = 64, **cold) -> dict:
    config = tier_config(kind, cold_dir)
    config["cold"].update({"capacity_blocks": cold_blocks, "write_behind_s": WRITE_BEHIND_S, **cold})
    return config


def _chat(model, bank, conversation, offload: str | None = None) -> None:
    for turn in range(len(TURNS)):
        out = greedy(model, conversation.turn_inputs[turn], bank, TURNS[turn][1])
        assert torch.equal(out, conversation.turn_outputs[turn]), f"turn {turn}: wrong tokens"
        if offload and turn == 0:
            bank.offload(offload)  # the next turn brings the history back up from there


def _fork_chat_and_hang(model, conversation, config, marker: str, error_path: str, offload=None) -> int:
    """A child that chats `conversation` on its own store, writes `marker` and then waits, its bank
    open (its blocks where the chat left them), until it is killed."""
    pid = os.fork()
    if pid:
        return pid
    try:
        store = tiered_kv.TierStore(config)
        bank = tiered_kv.CacheBank(model, store=store)
        _chat(model, bank, conversation, offload)
        with open(marker, "w") as f:
            f.write("done")
        while True:
            time.sleep(1)
    except BaseException:  # noqa: BLE001
        with open(error_path, "w") as f:
            f.write(traceback.format_exc())
        os._exit(1)


def _wait_for(marker: str, error_path: str, pid: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(marker):
        if os.path.exists(error_path):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail(f"the child failed:\n{open(error_path).read()}")
        assert time.monotonic() < deadline, "the child never finished its chat"
        time.sleep(0.02)


def _kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status


def _full_blocks(tokens: int) -> int:
    return tokens // BLOCK_SIZE * BLOCK_SIZE


@pytest.mark.parametrize("kind,offload", [("all_hot", None), ("forces_warm", None), ("forces_cold", "cold")],
                         ids=["in_hot", "in_warm", "promoted_from_cold"])
def test_a_chat_killed_after_its_turn_is_reattached_from_its_durable_copies(model, conversations, tmp_path,
                                                                           kind, offload):
    conversation = conversations[0]
    config = shared_config(tmp_path / "cold", kind)
    marker, error_path = str(tmp_path / "done"), str(tmp_path / "child.err")
    pid = _fork_chat_and_hang(model, conversation, config, marker, error_path, offload)
    _wait_for(marker, error_path, pid)
    time.sleep(10 * WRITE_BEHIND_S)  # the turn finished well over the write-behind interval ago
    _kill(pid)
    store = tiered_kv.TierStore(config)
    try:
        reused, _ = check_reattach(model, store, conversation)
    finally:
        store.close()
    assert reused >= _full_blocks(int(0.8 * conversation.history)), (reused, conversation.history)


def test_promotion_keeps_the_durable_record_and_demotion_reuses_it(model, conversations, tmp_path):
    """A block promoted out of cold keeps its cold record (a copy beside it); going down again
    it takes that slot back without writing a byte."""
    conversation = conversations[0]
    store = tiered_kv.TierStore(shared_config(tmp_path / "cold", "all_hot"))
    try:
        bank = tiered_kv.CacheBank(model, store=store)
        _chat(model, bank, conversation)
        bank.offload("cold")
        store.flush()
        cold = store.tiers[COLD]
        written = cold.bytes_written
        table = bank.block_table()
        bank.prefetch()
        store.wait_for_background()
        store.promote(table)
        assert all(store.index.get(b).tier == HOT for b in table)
        published = [b for b in table if store.index.get(b).key is not None]
        assert len(published) == len(table) - 1  # all but the partly filled last block
        assert store.stats()["durability"]["copies_blocks"] == len(published)
        bank.offload("cold")
        assert all(store.index.get(b).tier == COLD for b in table)
        rewritten = cold.bytes_written - written  # only the partly filled block had no copy to take back
        assert rewritten == store.layout.block_bytes, "going down again rewrote blocks that had a durable copy"
        assert store.check_consistency() == []
        bank.close()
    finally:
        store.close()


def test_write_behind_copies_are_the_first_to_go_when_cold_needs_room(model, conversations, tmp_path):
    """Cold full of copies of blocks that live above: a demotion into cold reclaims copies, it
    never fails for want of room, and what it reclaims is the copies of the coldest blocks."""
    store = tiered_kv.TierStore(shared_config(tmp_path / "cold", "all_hot", cold_blocks=10))
    try:
        banks = []
        for conversation in conversations:
            bank = tiered_kv.CacheBank(model, store=store)
            _chat(model, bank, conversation)
            banks.append(bank)
        store.flush()
        assert store.stats()["durability"]["copies_blocks"] == 10  # cold holds copies only
        old, new = banks[0].block_table(), banks[1].block_table()
        banks[1].offload("cold")  # 9 blocks need room in cold
        assert all(store.index.get(b).tier == COLD for b in new)
        assert store.check_consistency() == []
        for bank in banks:
            bank.close()
        del old
    finally:
        store.close()


def test_a_second_store_on_a_busy_cold_path_reattaches_the_first_ones_live_chat(model, conversations, tmp_path):
    """Another process holds the chat open (its blocks in hot); this one, on the same cold.path,
    attaches >= 90% of it from the first one's durable copies and continues it token-identically."""
    conversation = conversations[1]
    config = shared_config(tmp_path / "cold", "all_hot")
    marker, error_path = str(tmp_path / "done"), str(tmp_path / "child.err")
    pid = _fork_chat_and_hang(model, conversation, config, marker, error_path)
    try:
        _wait_for(marker, error_path, pid)
        time.sleep(10 * WRITE_BEHIND_S)
        store = tiered_kv.TierStore(config)
        try:
            assert store.cold_unavailable is None, store.cold_unavailable
            reused, _ = check_reattach(model, store, conversation)
            assert reused >= _full_blocks(int(0.9 * conversation.history)), (reused, conversation.history)
        finally:
            store.close()
    finally:
        _kill(pid)


def test_two_stores_in_one_process_share_one_cold_directory(model, conversations, tmp_path):
    config = shared_config(tmp_path / "cold", "all_hot")
    first = tiered_kv.TierStore(config)
    second = None
    try:
        bank = tiered_kv.CacheBank(model, store=first)
        _chat(model, bank, conversations[0])
        first.flush()  # every published block durable now
        second = tiered_kv.TierStore(config)
        assert second.cold_unavailable is None
        reused, _ = check_reattach(model, second, conversations[0])
        assert reused == _full_blocks(conversations[0].history)
        files = sorted(name for name in os.listdir(tmp_path / "cold") if name.endswith(".blocks"))
        assert len(files) == 2, files  # one block file each
        bank.close()
    finally:
        first.close()
        if second is not None:
            second.close()


def test_a_failed_cold_write_costs_the_copy_never_the_step(model, conversations, tmp_path, monkeypatch):
    """Every write into the cold file fails (ENOSPC) from the second chat on: both chats still
    answer every turn correctly; cached blocks that could not go down are dropped instead, the
    failures are counted."""
    config = shared_config(tmp_path / "cold", "all_hot")
    config["hot"]["capacity_blocks"] = 4
    config["warm"]["capacity_blocks"] = 10
    store = tiered_kv.TierStore(config)
    try:
        bank = tiered_kv.CacheBank(model, store=store)
        _chat(model, bank, conversations[0])
        bank.close()

        def full_disk(*args):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(block_io.os, "pwritev", full_disk)
        monkeypatch.setattr(block_io.os, "pwrite", full_disk)
        bank = tiered_kv.CacheBank(model, store=store)
        _chat(model, bank, conversations[1])  # raises nothing
        bank.close()
        assert store.check_consistency() == []
        assert store.metrics.failed_moves.total() >= 1  # the writes did fail, and were counted
    finally:
        monkeypatch.undo()
        store.close()


def test_cold_admit_reused_copies_a_block_only_once_a_second_turn_reads_it(model, conversations, tmp_path):
    store = tiered_kv.TierStore(shared_config(tmp_path / "cold", "all_hot", admit="reused"))
    try:
        conversation = conversations[0]
        bank = tiered_kv.CacheBank(model, store=store)
        out = greedy(model, conversation.turn_inputs[0], bank, TURNS[0][1])
        assert store.flush()
        assert store.stats()["durability"]["copies_blocks"] == 0  # published, read by no second turn yet
        first_turn = [b for b in bank.block_table() if store.index.get(b).key is not None]
        assert torch.equal(out, conversation.turn_outputs[0])
        greedy(model, conversation.turn_inputs[1], bank, TURNS[1][1])
        assert store.flush()
        copied = set(store.state.copies.slot_of)
        assert copied == set(first_turn)  # the blocks the second turn read, and only those
        stats = store.stats()["durability"]
        assert stats["cold_bytes_written"] == len(first_turn) * store.layout.block_bytes
        assert stats["cold_bytes_per_token"] > 0
        bank.close()
    finally:
        store.close()


def test_write_behind_off_leaves_published_blocks_without_durable_copies(model, conversations, tmp_path):
    store = tiered_kv.TierStore(shared_config(tmp_path / "cold", "all_hot", write_behind_s=0))
    try:
        bank = tiered_kv.CacheBank(model, store=store)
        _chat(model, bank, conversations[0])
        time.sleep(5 * WRITE_BEHIND_S)
        assert store.flush()
        assert store.stats()["durability"]["copies_blocks"] == 0 and store.tiers[COLD].bytes_written == 0
        bank.close()
    finally:
        store.close()


def test_a_peer_record_that_fails_its_checks_is_never_served(model, conversations, tmp_path):
    """A bit flipped in another store's record: this store reuses the chain only up to it, and the
    continuation is still token-identical."""
    conversation = conversations[0]
    config = shared_config(tmp_path / "cold", "all_hot")
    first = tiered_kv.TierStore(config)
    second = None
    try:
        bank = tiered_kv.CacheBank(model, store=first)
        _chat(model, bank, conversation)
        assert first.flush()
        table = bank.block_table()
        copies = first.state.copies.slot_of
        cold = first.tiers[COLD]
        with open(cold.file_path, "r+b") as f:  # one byte of the 4th block's durable copy
            f.seek(copies[table[3]] * cold.record_stride_bytes + 5)
            byte = f.read(1)
            f.seek(copies[table[3]] * cold.record_stride_bytes + 5)
            f.write(bytes([byte[0] ^ 0xFF]))
        second = tiered_kv.TierStore(config)
        reused, _ = check_reattach(model, second, conversation)
        assert reused == 3 * BLOCK_SIZE
        assert second.stats()["durability"]["peer_hits"] >= 3
        bank.close()
    finally:
        first.close()
        if second is not None:
            second.close()


def test_inspect_shows_the_processes_attached(model, conversations, tmp_path, capsys):
    from tiered_kv.cli import main
    config = shared_config(tmp_path / "cold", "all_hot")
    stores = [tiered_kv.TierStore(config) for _ in range(2)]
    try:
        for store in stores:
            bank = tiered_kv.CacheBank(model, store=store)
            _chat(model, bank, conversations[0])
            assert store.flush()
            bank.close()
        assert main(["inspect", str(tmp_path / "cold"), "--json"]) == 0
        import json
        report = json.loads(capsys.readouterr().out)
        assert sorted(a["file"] for a in report["attached"]) == sorted(
            os.path.basename(s.tiers[COLD].file_path) for s in stores)
        assert {a["pid"] for a in report["attached"]} == {os.getpid()}
        assert main(["inspect", str(tmp_path / "cold")]) == 0
        assert "processes attached: 2" in capsys.readouterr().out
    finally:
        for store in stores:
            store.close()
    assert main(["inspect", str(tmp_path / "cold"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["attached"] == []


def test_a_tmpfs_filling_up_mid_chat_costs_only_durability(model, conversations, tmp_path, caplog):
    """A real full disk: the block file is preallocated at start, then a filler takes every free byte
    of the tmpfs, so the index (and its WAL) cannot grow. Write-behind keeps trying; every turn of
    both chats completes with DynamicCache's tokens, and the failures are logged."""
    from helpers import mount_tmpfs, umount_tmpfs
    mount = tmp_path / "mnt"
    why = mount_tmpfs(mount, "2m")
    if why:
        pytest.skip(f"{why}; test_a_failed_cold_write_costs_the_copy_never_the_step injects ENOSPC instead")
    try:
        config = shared_config(mount / "cold", "forces_warm", cold_blocks=64)
        store = tiered_kv.TierStore(config)
        try:
            bank = tiered_kv.CacheBank(model, store=store)
            greedy(model, conversations[0].turn_inputs[0], bank, TURNS[0][1])
            fd = os.open(mount / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                while True:
                    os.write(fd, b"\0" * 4096)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
            finally:
                os.close(fd)
            with caplog.at_level("WARNING", logger="tiered_kv"):
                for turn in range(1, len(TURNS)):
                    out = greedy(model, conversations[0].turn_inputs[turn], bank, TURNS[turn][1])
                    assert torch.equal(out, conversations[0].turn_outputs[turn])
                other = tiered_kv.CacheBank(model, store=store)
                _chat(model, other, conversations[1])
                store.flush(timeout_s=5)
            assert "No space left" in caplog.text or "disk is full" in caplog.text, caplog.text[-2000:]
            assert store.check_consistency() == []
            bank.close()
            other.close()
        finally:
            store.close()
    finally:
        umount_tmpfs(mount)


def test_the_owner_drops_a_record_only_once_a_peer_has_read_it(tmp_path):
    """A peer holds the shared record lock while it reads (cold_peers.py). The owner's forget of
    that slot returns at once (it runs under the store lock: it never waits); its writer thread
    zeroes the header only once the read ended."""
    from tiered_kv.blocks import KVLayout
    from tiered_kv.tiers import ColdTier
    from tiered_kv.tiers import cold_format as fmt
    from tiered_kv.tiers.cold_files import open_cold_directory
    from tiered_kv.tiers.cold_peers import record_lock, record_unlock
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype_name="float32")
    directory = open_cold_directory(str(tmp_path / "cold"))
    tier = ColdTier(layout, 4, directory, backend="posix")
    reader = None
    try:
        tier.write_blocks([2], torch.ones((1, *layout.record_shape())))
        tier.persist(2, b"k" * 16, b"r" * 16)
        tier.flush()
        reader = directory.open_read_only(os.path.basename(tier.file_path))
        stride, at = tier.record_stride_bytes, 2 * tier.record_stride_bytes + fmt.header_offset_bytes(layout)

        def header():
            page = torch.frombuffer(bytearray(os.pread(reader, fmt.header_bytes(layout), at)), dtype=torch.uint8)
            return fmt.unpack_header(layout, 2, page.numpy())

        assert record_lock(reader, 2, stride, exclusive=False, wait_s=0)
        tier.forget([2])  # returns at once
        time.sleep(0.1)
        assert header().key == b"k" * 16  # still there while the peer reads
        record_unlock(reader, 2, stride)
        tier.flush()
        with pytest.raises(fmt.FormatError):
            header()  # zeroed once the read ended
    finally:
        if reader is not None:
            os.close(reader)
        tier.close()
        directory.close()


def test_flush_says_so_when_cold_has_no_room_for_a_copy(model, conversations, tmp_path):
    """Cold full of a chat's own blocks (offloaded there): the other chat's blocks find no room for a
    copy; flush returns False at once instead of waiting out its timeout, and nothing is lost."""
    store = tiered_kv.TierStore(shared_config(tmp_path / "cold", "all_hot", cold_blocks=10))
    try:
        first = tiered_kv.CacheBank(model, store=store)
        _chat(model, first, conversations[0])
        assert store.flush()
        first.offload("cold")  # its 10 blocks take every cold slot (its 9 copies given back)
        second = tiered_kv.CacheBank(model, store=store)
        _chat(model, second, conversations[1])
        started = time.monotonic()
        assert store.flush(timeout_s=20) is False
        assert time.monotonic() - started < 10
        assert store.check_consistency() == []
        second.close()
        first.close()
    finally:
        store.close()


def test_admit_reused_forgets_blocks_that_are_gone(model, conversations, tmp_path):
    """Blocks waiting for a second reader (cold.admit: reused) are forgotten when they leave the
    store, copy or not."""
    store = tiered_kv.TierStore(shared_config(tmp_path / "cold", "all_hot", admit="reused"))
    try:
        bank = tiered_kv.CacheBank(model, store=store)
        greedy(model, conversations[0].turn_inputs[0], bank, TURNS[0][1])
        assert store.state.copies._waiting_for_reuse  # published, waiting for a second reader
        bank.close()  # its published blocks stay as cache
        with store.lock:  # drop the cache
            for block_id in [b for b, e in store.index.items() if e.ref_count == 0]:
                store.state.free_block(block_id)
        assert not store.state.copies._waiting_for_reuse and not store.state.copies.pending
    finally:
        store.close()


def test_a_failed_start_never_removes_a_block_file_another_store_claimed(tmp_path):
    import fcntl
    from tiered_kv.blocks import KVLayout
    from tiered_kv.tiers import cold_format as fmt
    from tiered_kv.tiers.cold_files import open_cold_directory
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype_name="float32")
    ours = open_cold_directory(str(tmp_path / "cold"))
    made = ours.open_file(fmt.block_file_name(layout, 0))  # this start made file 0 ...
    assert made.created
    theirs = os.open(made.path, os.O_RDWR)
    fcntl.flock(theirs, fcntl.LOCK_EX | fcntl.LOCK_NB)  # ... and another store claimed it first
    os.close(made.fd)
    try:
        file, number = ours.claim_block_file(lambda n: fmt.block_file_name(layout, n), 4096, fmt.MAX_FILES)
        assert number == 1
        os.close(file.fd)
        ours.abort()  # this start fails: it removes what it made and still owns, only that
        assert os.path.exists(made.path)
        assert not os.path.exists(tmp_path / "cold" / fmt.block_file_name(layout, 1))
    finally:
        os.close(theirs)


def test_a_store_that_cannot_get_the_directory_lock_in_time_runs_read_only_on_cold(model, conversations, tmp_path,
                                                                                  monkeypatch, caplog):
    """gc holds the directory exclusively past the (bounded) wait: the store says so, writes
    nothing there, and still reattaches what the directory holds, token-identically."""
    from tiered_kv.tiers import cold_files
    config = shared_config(tmp_path / "cold", "all_hot")
    first = tiered_kv.TierStore(config)
    bank = tiered_kv.CacheBank(model, store=first)
    _chat(model, bank, conversations[0])
    bank.close()
    first.close()  # its records are durable in block file 0
    monkeypatch.setattr(cold_files, "LOCK_WAIT_S", 0.2)
    gc = cold_files.ColdDirectory(str(tmp_path / "cold"), shared=False)
    try:
        with gc.exclusive_lock():
            before = sorted(os.listdir(tmp_path / "cold"))
            with caplog.at_level("WARNING", logger="tiered_kv"):
                store = tiered_kv.TierStore(config)
            assert "read-only on cold" in caplog.text and store.cold_unavailable
            try:
                reused, _ = check_reattach(model, store, conversations[0])
                assert reused == _full_blocks(conversations[0].history)
                assert store.stats()["tiers"]["cold"]["capacity_blocks"] == 0
            finally:
                store.close()
            assert sorted(os.listdir(tmp_path / "cold")) == before  # made nothing there
    finally:
        gc.close()
