"""`tiered-kv inspect` and `tiered-kv gc` on a real cold directory written by ColdTier."""
import json
import os
import sqlite3

import pytest
import torch

from tiered_kv.blocks import KVLayout
from tiered_kv.cli import main
from tiered_kv.tiers import ColdTier
from tiered_kv.tiers import cold_format as fmt
from tiered_kv.tiers.cold_files import open_cold_directory

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype_name="float32")  # 512 B, 4 KiB
ROOT_A, ROOT_B = bytes.fromhex("a1" * 16), bytes.fromhex("b2" * 16)  # model fingerprints
FOREIGN = "kv-v9-0123456789abcdef.blocks"
STRIDE = fmt.record_stride_bytes(LAYOUT)


def block(n: int) -> torch.Tensor:
    return (torch.arange(LAYOUT.block_bytes // 4, dtype=torch.float32) + 1000 * n).reshape(1, *LAYOUT.record_shape())


def key_of(n: int) -> bytes:
    return n.to_bytes(16, "little")


def open_tier(path):
    directory = open_cold_directory(str(path))
    return directory, ColdTier(LAYOUT, 8, directory, backend="posix")


def close(directory, tier):
    tier.close()
    directory.close()


@pytest.fixture
def cold(tmp_path):
    """Slots 0-2 hold root A's blocks 0-2, slots 3-4 root B's blocks 3-4, persisted in that order (slot 0
    least recently used); plus a file of another format version."""
    path = tmp_path / "cold"
    directory, tier = open_tier(path)
    for slot in range(5):
        tier.write_blocks([slot], block(slot))
        tier.persist(slot, key_of(slot), ROOT_A if slot < 3 else ROOT_B)
        tier.flush()
    close(directory, tier)
    (path / FOREIGN).write_bytes(os.urandom(8192))
    os.chmod(path / FOREIGN, 0o600)
    return path


def snapshot(path):
    return {name: (os.stat(path / name, follow_symlinks=False), (path / name).read_bytes())
            for name in sorted(os.listdir(path))}


def same(before, after):
    assert list(before) == list(after)
    for name, (info, data) in before.items():
        info2, data2 = after[name]
        assert (info.st_ino, info.st_size, info.st_mtime_ns, info.st_mode, data) == \
            (info2.st_ino, info2.st_size, info2.st_mtime_ns, info2.st_mode, data2), name


def run(capsys, *argv):
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def durable(path):
    directory, tier = open_tier(path)
    try:
        return {slot: root for slot, _, root in tier.durable_records()}, tier.read_blocks([3, 4])
    finally:
        close(directory, tier)


def test_inspect_lists_roots_and_ignored_files_and_writes_nothing(cold, capsys):
    before = snapshot(cold)
    status, out, _ = run(capsys, "inspect", str(cold))
    assert status == 0
    assert fmt.block_file_name(LAYOUT) in out
    assert "layout: 2 layers x 2 kv heads x head_dim 4, block 4 tokens, float32" in out
    assert "capacity: 8 slots, 32.0 KiB" in out and "records: 5 used, 3 free slots" in out
    assert f"root {ROOT_A.hex()[:16]}: 3 blocks, 12.0 KiB" in out
    assert f"root {ROOT_B.hex()[:16]}: 2 blocks, 8.0 KiB" in out
    assert f"ignored: {FOREIGN} (another format version)" in out and "store running: no" in out
    status, out, _ = run(capsys, "inspect", str(cold), "--json", "--verify")
    report = json.loads(out)
    assert status == 0 and report["store_running"] is False and report["free_disk_bytes"] > 0
    [f] = report["files"]
    assert (f["capacity_slots"], f["used_records"], f["free_slots"], f["verify"]) == (8, 5, 3, {"ok": 5, "bad": []})
    assert [(r["root"], r["blocks"]) for r in f["roots"]] == [(ROOT_A.hex(), 3), (ROOT_B.hex(), 2)]
    same(before, snapshot(cold))


def test_inspect_while_a_store_runs_reads_its_index_read_only(cold, capsys):
    directory, tier = open_tier(cold)
    try:
        tier.write_blocks([5], block(5))
        tier.persist(5, key_of(5), ROOT_B)
        tier.flush()  # the row sits in the -wal of the running store
        status, out, _ = run(capsys, "inspect", str(cold), "--verify")
        assert status == 0 and "store running: yes" in out and "verify: 6 ok, 0 bad" in out
        assert f"root {ROOT_B.hex()[:16]}: 3 blocks" in out
    finally:
        close(directory, tier)


def test_verify_reports_a_flipped_data_byte(cold, capsys):
    with open(cold / fmt.block_file_name(LAYOUT), "r+b") as f:
        f.seek(4 * STRIDE + LAYOUT.layer_bytes + 7)  # slot 4, layer 1
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
    status, out, _ = run(capsys, "inspect", str(cold), "--verify")
    assert status == 1
    assert "verify: 4 ok, 1 bad" in out and "slot 4: layer 1 failed its checksum (XXH3-64)" in out
    status, out, _ = run(capsys, "gc", str(cold), "--drop-bad")
    assert status == 0 and "dropped 1 records" in out
    assert run(capsys, "inspect", str(cold), "--verify")[0] == 0


def test_gc_drop_root_removes_its_rows_and_keeps_the_other_root_intact(cold, capsys):
    before = snapshot(cold)
    status, out, _ = run(capsys, "gc", str(cold), "--drop-root", ROOT_A.hex()[:8], "--dry-run")
    assert status == 0 and "would drop 3 records" in out
    same(before, snapshot(cold))
    status, out, _ = run(capsys, "gc", str(cold), "--drop-root", ROOT_A.hex()[:8])
    assert status == 0 and "dropped 3 records" in out and "slot 0 (root" in out
    records, blocks = durable(cold)
    assert records == {3: ROOT_B, 4: ROOT_B}
    assert torch.equal(blocks, torch.cat([block(3), block(4)]))
    data = (cold / fmt.block_file_name(LAYOUT)).read_bytes()
    assert len(data) == 8 * STRIDE
    assert not data[fmt.header_offset_bytes(LAYOUT):STRIDE].strip(b"\0")  # slot 0's header zeroed
    assert (cold / FOREIGN).read_bytes() == before[FOREIGN][1]


def test_gc_keep_root_and_max_bytes_keep_the_most_recently_used(cold, capsys):
    status, out, _ = run(capsys, "gc", str(cold), "--keep-root", ROOT_A.hex(), "--dry-run")
    assert status == 0 and "would drop 2 records" in out and "root not kept" in out
    status, out, _ = run(capsys, "gc", str(cold), "--max-bytes", f"{2 * STRIDE // 1024}KiB")
    assert status == 0 and "dropped 3 records" in out and "least recently used" in out
    assert durable(cold)[0] == {3: ROOT_B, 4: ROOT_B}


@pytest.mark.parametrize("holds", ["directory", "block_file"])
def test_gc_refuses_while_a_store_holds_the_lock(cold, capsys, holds):
    """A store on the directory (it holds the lock, shared) and its block file: gc changes nothing."""
    directory = open_cold_directory(str(cold))
    try:
        if holds == "block_file":
            tier = ColdTier(LAYOUT, 8, directory, backend="posix")  # claims the existing file
            assert tier.file_number == 0
            status, out, err = run(capsys, "gc", str(cold), "--drop-root", ROOT_A.hex())
            tier.close()
        else:
            status, out, err = run(capsys, "gc", str(cold), "--drop-root", ROOT_A.hex())
    finally:
        directory.close()
    assert status == 2 and out == "" and err.count("\n") == 1 and "a store is running" in err
    assert len(durable(cold)[0]) == 5


@pytest.mark.parametrize("argv, message", [
    (["gc", "{missing}"], "cannot be opened as a directory"),
    (["inspect", "{missing}"], "cannot be opened as a directory"),
    (["gc", "{empty}"], "is not a cold directory"),
    (["gc", "{cold}", "--max-bytes", "lots"], "--max-bytes"),
    (["gc", "{cold}", "--drop-root", "zz"], "not a hex root key"),
    (["gc", "{cold}", "--keep-root", "ffff"], "matches no stored root"),
])
def test_bad_input_is_one_line_and_exit_2(cold, tmp_path, capsys, argv, message):
    (tmp_path / "empty").mkdir()
    names = {"missing": tmp_path / "missing", "empty": tmp_path / "empty", "cold": cold}
    before = snapshot(cold)
    status, out, err = run(capsys, *[a.format(**names) for a in argv])
    assert (status, out, err.count("\n")) == (2, "", 1) and message in err
    assert not (tmp_path / "missing").exists() and os.listdir(tmp_path / "empty") == []
    same(before, snapshot(cold))


def test_inspect_reads_an_index_a_crashed_store_left_with_a_wal(cold, capsys):
    index = cold / fmt.index_file_name(LAYOUT)
    db = sqlite3.connect(index, isolation_level=None)  # keep a -wal behind, as a killed writer does
    db.execute("PRAGMA wal_autocheckpoint=0")
    db.execute("UPDATE records SET last_access = 0 WHERE slot = 4")
    db_copy = {s: (cold / (index.name + s)).read_bytes() for s in ("", "-wal")}
    db.close()
    for suffix, data in db_copy.items():
        (cold / (index.name + suffix)).write_bytes(data)
    (cold / (index.name + "-shm")).unlink(missing_ok=True)
    assert (cold / (index.name + "-wal")).stat().st_size > 0
    before = snapshot(cold)
    status, out, _ = run(capsys, "inspect", str(cold), "--json")
    assert status == 0 and min(r["first_access"] for r in json.loads(out)["files"][0]["roots"]) == 0
    same(before, snapshot(cold))
