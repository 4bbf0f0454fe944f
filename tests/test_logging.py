"""Logging (issue 9): one logger per module under "tiered_kv", no print() in the library, one warning
per event (checksum failure, dropped blocks, a failed cold write), start-up fallbacks logged once per
process, and the CLI's -v / -q. Each event is provoked for real: bytes flipped on disk, os.pwritev
failing with ENOSPC, a cache too small for what it is asked to keep."""
import ast
import errno
import logging
import os
import sqlite3
import time
from pathlib import Path

import pytest
import torch

from tiered_kv import CorruptBlockError, TierStore, logs
from tiered_kv.blocks import KVLayout
from tiered_kv.cli import main
from tiered_kv.hw import block_io
from tiered_kv.hw.block_io import ColdWriteError
from tiered_kv.scheduler import COLD, HOT
from tiered_kv.store import StepRequest
from tiered_kv.tiers import ColdTier
from tiered_kv.tiers import cold_format as fmt
from tiered_kv.tiers.cold_files import open_cold_directory

PACKAGE = Path(__file__).resolve().parents[1] / "tiered_kv"
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype_name="float32")  # 512 B, 4 KiB
STRIDE = fmt.record_stride_bytes(LAYOUT)
ROOT = bytes.fromhex("a1" * 16)


def block_data(seed: int) -> torch.Tensor:
    return torch.randn((1, *LAYOUT.record_shape()), generator=torch.Generator().manual_seed(seed))


def key_of(n: int) -> bytes:
    return n.to_bytes(16, "little")


def full_disk(*args):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def flip_byte(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        old = f.read(1)
        f.seek(offset)
        f.write(bytes([old[0] ^ 0xFF]))


def warnings_of(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name.startswith("tiered_kv") and r.levelno >= logging.WARNING]


@pytest.fixture
def make_store(tmp_path):
    stores = []

    def make(hot_blocks, warm_blocks, cold_blocks, **overrides):
        config = {
            "block_size": LAYOUT.block_size,
            "hot": {"device": "cpu", "capacity_blocks": hot_blocks},
            "warm": {"capacity_blocks": warm_blocks, "pinned": False},
            "cold": {"capacity_blocks": cold_blocks, "path": str(tmp_path / f"cold{len(stores)}"), "backend": "posix"},
            "scheduler": {"background": False},
        }
        for section, values in overrides.items():
            config[section].update(values)
        store = TierStore(config)
        stores.append(store)
        store.bind(LAYOUT, torch.float32)
        return store

    yield make
    for store in stores:
        store.close()


def cold_block(store, seed: int, key: bytes | None = None) -> int:
    """A block with data whose record lies in the cold tier (hot 1, warm 1: the third goes cold)."""
    ids = [store.allocate(1)[0] for _ in range(3)]
    block_id = next(b for b in ids if store.index.get(b).tier == COLD)
    entry = store.index.get(block_id)
    store.tiers[COLD].write_blocks([entry.slot], block_data(seed))
    if key is not None:
        store.publish(block_id, key)
    return block_id


def flip_cold_byte(store, block_id: int) -> None:
    flip_byte(store.tiers[COLD].file_path, store.index.get(block_id).slot * STRIDE + 7)


# --- the source --------------------------------------------------------------------------------

def _library_files():
    return sorted(PACKAGE.rglob("*.py"))


def test_the_library_prints_nothing_and_every_module_logs_under_its_own_name():
    offenders = []
    for path in _library_files():
        relative = path.relative_to(PACKAGE).as_posix()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
            if name == "print" and isinstance(node.func, ast.Name) and relative not in ("cli.py", "chat.py"):
                offenders.append(f"{relative}:{node.lineno}: print()")
            if name == "getLogger" and relative != "cli.py":  # cli.py configures the package's logger
                args = node.args
                if not (len(args) == 1 and isinstance(args[0], ast.Name) and args[0].id == "__name__"):
                    offenders.append(f"{relative}:{node.lineno}: getLogger({ast.unparse(node).split('(', 1)[1]}")
    assert offenders == []


def test_the_package_logger_has_a_null_handler():
    assert any(isinstance(h, logging.NullHandler) for h in logging.getLogger("tiered_kv").handlers)


# --- checksum failures ---------------------------------------------------------------------------

def test_a_corrupt_cold_record_read_layer_by_layer_warns_once_naming_the_block(make_store, caplog):
    store = make_store(1, 1, 2)
    block_id = cold_block(store, 1, key=b"k0")
    flip_cold_byte(store, block_id)
    lease = store.open_step(StepRequest(7, [[block_id]], {block_id}, LAYOUT.block_size, 1))  # a full block: no copy
    with caplog.at_level(logging.WARNING, logger="tiered_kv"):
        for layer in range(LAYOUT.num_layers):  # the hooks read every layer: one event, one warning
            with pytest.raises(CorruptBlockError):
                lease.read_layer(layer, 0)
    lease.abort()
    (record,) = warnings_of(caplog)
    assert record.name == "tiered_kv.store.state"
    assert f"block {block_id} (cold slot" in record.getMessage() and "failed its checksum" in record.getMessage()
    assert store.tiers[COLD].file_path in record.getMessage()


def test_a_corrupt_cold_record_found_at_turn_start_warns_once(make_store, caplog):
    store = make_store(1, 1, 2)
    block_id = cold_block(store, 2, key=b"k1")
    flip_cold_byte(store, block_id)
    with caplog.at_level(logging.WARNING, logger="tiered_kv"):
        assert store.verify([block_id]) == [block_id]  # a bank's check of cold history at a turn's start
        store.verify([block_id])
        assert store.promote([block_id]) == []  # already dropped: nothing read, nothing more to say
    (record,) = warnings_of(caplog)
    assert f"block {block_id} " in record.getMessage() and "never served" in record.getMessage()


def test_a_corrupt_cold_record_met_by_a_promotion_warns_once(make_store, caplog):
    store = make_store(1, 1, 2)
    block_id = cold_block(store, 3, key=b"k2")
    flip_cold_byte(store, block_id)
    with caplog.at_level(logging.WARNING, logger="tiered_kv"):
        assert store.promote([block_id]) == [block_id]
    (record,) = warnings_of(caplog)
    assert f"block {block_id} " in record.getMessage()


# --- dropped blocks ----------------------------------------------------------------------------

def test_cached_blocks_dropped_by_a_full_cache_warn_with_a_count_then_go_quiet(make_store, caplog):
    store = make_store(2, 0, 0)
    cached = store.allocate(2)
    for n, block_id in enumerate(cached):
        store.publish(block_id, key_of(n))
    store.release(cached)  # unreferenced published blocks: a cache, dropped when room is needed
    with caplog.at_level(logging.WARNING, logger="tiered_kv"):
        store.allocate(2)  # one plan drops both: one warning
    (warning,) = warnings_of(caplog)
    assert warning.name == "tiered_kv.store.state"
    assert "dropped 2 cached block(s)" in warning.getMessage() and "recomputes them" in warning.getMessage()


def test_repeated_drops_within_the_interval_are_logged_at_debug(make_store, caplog):
    store = make_store(1, 0, 0)
    with caplog.at_level(logging.DEBUG, logger="tiered_kv"):
        for n in range(3):  # each allocation drops the block cached by the one before
            (block_id,) = store.allocate(1)
            store.publish(block_id, key_of(n))
            store.release([block_id])
        store.allocate(1)
    drops = [r for r in caplog.records if "cached block(s)" in r.getMessage()]
    assert [r.levelno for r in drops] == [logging.WARNING, logging.DEBUG, logging.DEBUG]


def test_published_blocks_that_do_not_fit_in_cold_at_close_are_reported(make_store, caplog):
    store = make_store(4, 0, 1)
    blocks = store.allocate(3)
    for n, block_id in enumerate(blocks):
        store.publish(block_id, key_of(n))
    with caplog.at_level(logging.WARNING, logger="tiered_kv"):
        store.close()  # only one of the three fits in cold: the other two are lost with the process
    (record,) = warnings_of(caplog)
    assert "2 of 3 published block(s) did not fit in the cold tier" in record.getMessage()


def test_records_dropped_at_recovery_are_one_warning_with_a_count(tmp_path, caplog):
    path = str(tmp_path / "cold")
    directory = open_cold_directory(path)
    tier = ColdTier(LAYOUT, 8, directory, backend="posix")
    for slot in range(4):
        tier.write_blocks([slot], block_data(slot))
        tier.persist(slot, key_of(slot), ROOT)
    tier.flush()
    file_path = tier.file_path
    tier.close()
    directory.close()
    for slot in (1, 2):  # bit rot in two records' headers
        flip_byte(file_path, slot * STRIDE + fmt.header_offset_bytes(LAYOUT) + 20)
    directory = open_cold_directory(path)
    try:
        with caplog.at_level(logging.WARNING, logger="tiered_kv"):
            tier = ColdTier(LAYOUT, 8, directory, backend="posix")
        assert sorted(slot for slot, _, _ in tier.durable_records()) == [0, 3]
        tier.close()
    finally:
        directory.close()
    (record,) = warnings_of(caplog)
    assert record.name == "tiered_kv.tiers.cold_index"
    assert "dropped 2 of 4 durable record(s)" in record.getMessage() and "slot 1" in record.getMessage()


# --- failed cold writes --------------------------------------------------------------------------

def test_enospc_moving_published_blocks_to_cold_at_close_warns_once_with_the_path(make_store, caplog, monkeypatch):
    store = make_store(4, 0, 4)
    blocks = store.allocate(2)
    for n, block_id in enumerate(blocks):
        store.publish(block_id, key_of(n))
    cold_path = store.tiers[COLD].file_path
    monkeypatch.setattr(block_io.os, "pwritev", full_disk)
    with caplog.at_level(logging.DEBUG, logger="tiered_kv"):
        store.close()
    (record,) = warnings_of(caplog)
    message = record.getMessage()
    assert "ENOSPC" in message and cold_path in message and "lost when this store closes" in message


def test_enospc_on_a_demand_move_costs_the_move_warns_naming_the_file_and_gives_the_slot_back(
        make_store, caplog, monkeypatch):
    """A failed copy costs the move, never the caller's operation: the block stays where it was, the
    cold slot the move took comes back, one warning names ENOSPC and the file."""
    store = make_store(4, 0, 4)
    (block_id,) = store.allocate(1)
    monkeypatch.setattr(block_io.os, "pwritev", full_disk)
    with caplog.at_level(logging.WARNING, logger="tiered_kv"):
        assert store.demote([block_id], COLD) == []
    (record,) = warnings_of(caplog)
    message = record.getMessage()
    assert "ENOSPC" in message and store.tiers[COLD].file_path in message and "they stay in hot" in message
    assert store.index.get(block_id).tier == HOT and store.state.free_slots()[COLD] == 4
    assert store.check_consistency() == []
    assert store.stats()["metrics"]["failed_moves_total"] == {"mode=on_demand,error=ENOSPC": 1}


def test_enospc_writing_record_headers_warns_once_per_batch(tmp_path, caplog, monkeypatch):
    directory = open_cold_directory(str(tmp_path / "cold"))
    tier = ColdTier(LAYOUT, 8, directory, backend="posix")
    try:
        for slot in range(3):
            tier.write_blocks([slot], block_data(slot))
        monkeypatch.setattr(block_io.os, "pwritev", full_disk)
        with caplog.at_level(logging.WARNING, logger="tiered_kv"):
            for slot in range(3):
                tier.persist(slot, key_of(slot), ROOT)
            with pytest.raises(ColdWriteError):
                tier.flush()
        (record,) = warnings_of(caplog)
        message = record.getMessage()
        assert "ENOSPC" in message and tier.file_path in message and "did not become durable" in message
    finally:
        monkeypatch.undo()
        tier.close()
        directory.close()


def test_a_failed_index_commit_warns_once(tmp_path, caplog, monkeypatch):
    directory = open_cold_directory(str(tmp_path / "cold"))
    tier = ColdTier(LAYOUT, 8, directory, backend="posix")
    try:
        tier.write_blocks([0], block_data(0))

        def disk_full(*args):
            raise sqlite3.OperationalError("database or disk is full")

        tier.index.open()
        monkeypatch.setattr(tier.index, "apply", disk_full)
        with caplog.at_level(logging.WARNING, logger="tiered_kv"):
            tier.persist(0, key_of(0), ROOT)
            with pytest.raises(ColdWriteError, match="disk is full"):
                tier.flush()
        (record,) = warnings_of(caplog)
        assert "committing to the index" in record.getMessage() and "slots [0]" in record.getMessage()
    finally:
        monkeypatch.undo()
        tier.close()
        directory.close()


# --- fallbacks chosen at start -------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU fallbacks")
def test_cpu_fallbacks_are_logged_once_per_process(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(logs, "_logged_once", set())  # as in a fresh process

    def start(name):
        store = TierStore({"block_size": LAYOUT.block_size,
                           "hot": {"device": "auto", "capacity_blocks": 2},
                           "warm": {"capacity_blocks": 2, "pinned": "auto"},
                           "cold": {"capacity_blocks": 2, "path": str(tmp_path / name), "backend": "auto"}})
        store.bind(LAYOUT, torch.float32)
        store.close()

    with caplog.at_level(logging.INFO, logger="tiered_kv"):
        start("first")
    by_module = {}
    for r in caplog.records:
        if r.levelno == logging.INFO:
            by_module[r.name] = by_module.get(r.name, "") + r.getMessage() + "\n"
    assert "no CUDA device" in by_module["tiered_kv.hw.devices"]
    assert "warm tier in pageable host memory" in by_module["tiered_kv.hw.devices"]
    assert "no NVML" in by_module["tiered_kv.hw.link_monitor"]
    assert "kvikio unusable" in by_module["tiered_kv.tiers.cold"] and "POSIX" in by_module["tiered_kv.tiers.cold"]
    assert all(r.filename != "logs.py" for r in caplog.records)  # records point at the module that logs
    assert not warnings_of(caplog)  # a CPU-only machine is normal
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tiered_kv"):
        start("second")
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO] == []


def test_log_once_and_throttle(caplog):
    logger = logging.getLogger("tiered_kv.test_logging")
    with caplog.at_level(logging.DEBUG, logger="tiered_kv"):
        assert logs.log_once(logger, logging.INFO, "chosen %s", "x") is True
        assert logs.log_once(logger, logging.INFO, "chosen %s", "x") is False
        throttle = logs.Throttle(logger, interval_s=3600)
        assert [throttle.warning("event %d", n) for n in range(3)] == [True, False, False]
        throttle._next_s = 0.0  # the interval passed
        assert throttle.warning("event %d", 3) is True
    levels = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert levels == [(logging.INFO, "chosen x"), (logging.WARNING, "event 0"), (logging.DEBUG, "event 1"),
                      (logging.DEBUG, "event 2"),
                      (logging.WARNING, "event 3 (and 2 more like it since the last warning, logged at DEBUG)")]
    assert logs.error_name(OSError(errno.ENOSPC, "full")) == "ENOSPC"


# --- the CLI -------------------------------------------------------------------------------------

@pytest.fixture
def cold_dir(tmp_path):
    """A cold directory holding one durable record, and another whose headers rot (for a real warning)."""
    paths = []
    for name in ("cold", "rotten"):
        directory = open_cold_directory(str(tmp_path / name))
        tier = ColdTier(LAYOUT, 4, directory, backend="posix")
        tier.write_blocks([0], block_data(0))
        tier.persist(0, key_of(0), ROOT)
        tier.flush()
        tier.close()
        directory.close()
        paths.append(tmp_path / name)
    flip_byte(tier.file_path, fmt.header_offset_bytes(LAYOUT) + 20)
    return paths


def _inspect_with_a_recovery(monkeypatch, rotten):
    """`inspect` that first opens the rotten directory as a store would: its dropped record warns."""
    from tiered_kv.tools import cold_scan

    real_scan = cold_scan.scan

    def scan(path, verify=False, locked=False):
        directory = open_cold_directory(str(rotten))
        try:
            ColdTier(LAYOUT, 4, directory, backend="posix").close()
        finally:
            directory.close()
        return real_scan(path, verify, locked)

    monkeypatch.setattr(cold_scan, "scan", scan)


def run_cli(capsys, *argv):
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


@pytest.mark.parametrize("argv", [("-v", "inspect", "{}"), ("inspect", "{}", "--verbose")])
def test_verbose_shows_debug_lines_with_the_module(capsys, cold_dir, argv):
    status, out, err = run_cli(capsys, *(a.format(cold_dir[0]) for a in argv))
    assert status == 0 and "kv-v1-" in out
    assert "tiered-kv: debug: tiered_kv.tools.cold_scan: scanning" in err


def test_default_shows_warnings_without_debug(capsys, cold_dir, monkeypatch):
    _inspect_with_a_recovery(monkeypatch, cold_dir[1])
    status, out, err = run_cli(capsys, "inspect", str(cold_dir[0]))
    assert status == 0
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tiered-kv: warning: cold tier ") and "dropped 1 of 1" in lines[0]
    assert "debug" not in err


@pytest.mark.parametrize("argv", [("-q", "inspect", "{}"), ("inspect", "--quiet", "{}")])
def test_quiet_silences_warnings(capsys, cold_dir, monkeypatch, argv):
    _inspect_with_a_recovery(monkeypatch, cold_dir[1])
    status, out, err = run_cli(capsys, *(a.format(cold_dir[0]) for a in argv))
    assert status == 0 and "kv-v1-" in out and err == ""


def test_quiet_still_shows_errors(capsys, tmp_path):
    status, _, err = run_cli(capsys, "-q", "inspect", str(tmp_path))
    assert status == 2 and err.startswith("tiered-kv: error:")


@pytest.mark.parametrize("argv", [("-v", "-q", "inspect", "x"), ("-v", "inspect", "x", "-q"),
                                  ("chat", "--quiet", "--verbose")])
def test_verbose_and_quiet_together_are_refused(capsys, argv):
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "-v/--verbose" in err and "-q/--quiet" in err


def test_the_cli_puts_logging_back_and_leaves_the_root_logger_alone(capsys, cold_dir):
    package, root = logging.getLogger("tiered_kv"), logging.getLogger()
    before = (package.level, list(package.handlers), root.level, list(root.handlers))
    run_cli(capsys, "-v", "inspect", str(cold_dir[0]))
    assert (package.level, list(package.handlers), root.level, list(root.handlers)) == before


def test_enospc_in_a_background_move_to_cold_warns_once_then_goes_quiet(make_store, caplog, monkeypatch):
    """The mover's demotion to cold fails at every try while the disk is full: one warning naming
    ENOSPC, the file and that the blocks stay where they are; the retries go to DEBUG."""
    monkeypatch.setattr(block_io.os, "pwritev", full_disk)
    with caplog.at_level(logging.DEBUG, logger="tiered_kv"):
        store = make_store(4, 0, 4, hot={"high_watermark": 0.25, "low_watermark": 0.25},
                           scheduler={"background": True, "mover_interval_s": 0.005})
        store.allocate(3)  # above hot's high watermark: the mover demotes two to cold, and fails
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and \
                sum("background move" in r.getMessage() for r in caplog.records) < 3:
            time.sleep(0.01)
        store.mover.stop()
    moves = [r for r in caplog.records if "background move" in r.getMessage()]
    assert len(moves) >= 3 and [r.levelno for r in moves[:3]] == [logging.WARNING, logging.DEBUG, logging.DEBUG]
    message = moves[0].getMessage()
    assert "ENOSPC" in message and store.tiers[COLD].file_path in message and "they stay in hot" in message
    assert [store.index.get(b).tier for b in range(3)] == [HOT, HOT, HOT]


def test_a_full_disk_makes_the_mover_back_off_then_retry(make_store, monkeypatch):
    """While every cold write fails, the mover does not replan the same demotion every
    mover_interval_s: its retries of moves into cold back off (0.5 s, doubling); once the disk
    has room again, the blocks go down."""
    attempts = []

    def counted_full_disk(*args):
        attempts.append(time.monotonic())
        full_disk()

    monkeypatch.setattr(block_io.os, "pwritev", counted_full_disk)
    store = make_store(4, 0, 4, hot={"high_watermark": 0.25, "low_watermark": 0.25},
                       scheduler={"background": True, "mover_interval_s": 0.005})
    store.allocate(3)  # above hot's high watermark: the mover demotes to cold, and fails
    time.sleep(1.2)
    assert 1 <= len(attempts) <= 4, f"{len(attempts)} cold writes in 1.2 s at a 5 ms mover interval"
    monkeypatch.undo()  # the disk has room again
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and COLD not in [store.index.get(b).tier for b in range(3)]:
        time.sleep(0.02)
    store.mover.stop()
    assert COLD in [store.index.get(b).tier for b in range(3)]
