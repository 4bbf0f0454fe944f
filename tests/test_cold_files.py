"""The cold tier's files are ours alone (DESIGN invariant 5), a short cold record is a corrupt
block, and a tier slab that cannot fit is a ConfigError naming its capacity key.

Everything runs on the real file system; tmpfs mounts and other-uid files need root and are
skipped without it."""
import errno
import os
import resource
import stat
import subprocess
import sys
from contextlib import contextmanager

import pytest
import torch

from tiered_kv import ConfigError, CorruptBlockError, TierStore
from tiered_kv.blocks import KVLayout
from tiered_kv.hw import block_io, memory
from tiered_kv.tiers import ColdTier, HotTier, WarmTier
from tiered_kv.tiers.cold import layout_signature
from tiered_kv.tiers.cold_files import LOCK_NAME, open_cold_directory

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype_name="float32")  # 512 B, stride 4 KiB
PACKED = KVLayout(num_layers=2, num_kv_heads=2, head_dim=256, block_size=4, dtype_name="float32")  # 16 KiB = stride
BLOCK_NAME = f"kv-{layout_signature(LAYOUT)}.blocks"
IS_ROOT = os.geteuid() == 0


def snapshot(root):
    """Every path under `root` with its mode, size and bytes (for 'nothing else changed')."""
    seen = {}
    for parent, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(parent, name)
            info = os.lstat(path)
            content = open(path, "rb").read() if stat.S_ISREG(info.st_mode) else os.readlink(path) \
                if stat.S_ISLNK(info.st_mode) else None
            seen[os.path.relpath(path, root)] = (info.st_mode, info.st_uid, info.st_size, content)
    return seen


def blocks(num_blocks, layout=LAYOUT, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn((num_blocks, *layout.record_shape()), generator=generator)


@pytest.fixture
def private_dir(tmp_path):
    """An existing directory of ours, mode 0700, with one file of the user's in it."""
    path = tmp_path / "private"
    path.mkdir(mode=0o700)
    (path / "notes.txt").write_text("the user's")
    return path


# --- the directory ---------------------------------------------------------------------------

def test_missing_directories_are_created_0700_and_a_failed_start_removes_them(tmp_path):
    before = snapshot(tmp_path)
    path = tmp_path / "a" / "b" / "cold"
    directory = open_cold_directory(str(path))
    assert directory.created_directories == [str(tmp_path / "a"), str(tmp_path / "a" / "b"), str(path)]
    for made in directory.created_directories:
        assert stat.S_IMODE(os.stat(made).st_mode) == 0o700
    tier = ColdTier(LAYOUT, 2, directory, backend="posix")
    assert sorted(os.listdir(path)) == sorted([LOCK_NAME, BLOCK_NAME])
    tier.close()
    directory.abort()
    assert snapshot(tmp_path) == before


def test_created_directories_get_0700_under_any_umask(tmp_path):
    old = os.umask(0o277)
    try:
        directory = open_cold_directory(str(tmp_path / "a" / "cold"))
    finally:
        os.umask(old)
    try:
        assert [stat.S_IMODE(os.stat(p).st_mode) for p in directory.created_directories] == [0o700, 0o700]
        assert stat.S_IMODE(os.stat(tmp_path / "a" / "cold" / LOCK_NAME).st_mode) == 0o600
    finally:
        directory.close()


def test_a_start_that_fails_midway_through_creating_removes_what_it_made(tmp_path):
    before = snapshot(tmp_path)
    with pytest.raises(ConfigError, match=r"config key 'cold\.path': got .*not a writable directory.*allowed"):
        open_cold_directory(str(tmp_path / "new" / ("x" * 300)))  # "new" is made, then the name is too long
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("mode", [0o700, 0o750, 0o755, 0o711])
def test_an_existing_directory_of_ours_is_used_and_never_chmodded(tmp_path, mode):
    path = tmp_path / "home"
    path.mkdir()
    os.chmod(path, mode)
    directory = open_cold_directory(str(path))
    ColdTier(LAYOUT, 1, directory, backend="posix").close()
    directory.close()
    assert stat.S_IMODE(os.stat(path).st_mode) == mode
    assert directory.created_directories == []


@pytest.mark.parametrize("mode", [0o770, 0o757, 0o777, 0o1777])
def test_a_directory_others_may_write_is_refused_and_left_alone(tmp_path, mode):
    path = tmp_path / "shared"
    path.mkdir()
    os.chmod(path, mode)
    with pytest.raises(ConfigError, match=rf"config key 'cold\.path': got '{path}', which is a directory writable by "
                                          rf"group or others \(mode {mode:04o}\).*allowed: a directory owned by"):
        open_cold_directory(str(path))
    assert stat.S_IMODE(os.stat(path).st_mode) == mode
    assert os.listdir(path) == []


@pytest.mark.skipif(not IS_ROOT, reason="chown to another uid needs root")
def test_a_directory_owned_by_another_uid_is_refused_and_left_alone(tmp_path):
    path = tmp_path / "theirs"
    path.mkdir(mode=0o700)
    os.chown(path, 65534, 65534)
    with pytest.raises(ConfigError, match=r"'cold\.path'.*owned by uid 65534, not by this process's uid 0"):
        open_cold_directory(str(path))
    assert (os.stat(path).st_uid, stat.S_IMODE(os.stat(path).st_mode), os.listdir(path)) == (65534, 0o700, [])


def test_a_symlink_at_the_path_itself_is_followed(tmp_path, private_dir):
    link = tmp_path / "link"
    os.symlink(private_dir, link)
    directory = open_cold_directory(str(link))
    tier = ColdTier(LAYOUT, 1, directory, backend="posix")
    assert tier.file_path == str(link / BLOCK_NAME)
    assert sorted(os.listdir(private_dir)) == sorted([LOCK_NAME, BLOCK_NAME, "notes.txt"])
    tier.close()
    directory.close()


def test_a_block_file_is_held_across_processes_and_released_on_close(private_dir):
    """A process holding block file 0 makes another claim file 1; once it closes, file 0 is free."""
    directory = open_cold_directory(str(private_dir))
    tier = ColdTier(LAYOUT, 4, directory, backend="posix")
    probe = ("import sys; from tiered_kv.tiers.cold_files import open_cold_directory\n"
             "from tiered_kv.tiers import ColdTier\nfrom tiered_kv.blocks import KVLayout\n"
             "layout = KVLayout(2, 2, 4, 4, 'float32')\n"
             "d = open_cold_directory(sys.argv[1]); t = ColdTier(layout, 4, d, backend='posix')\n"
             "print(t.file_number); t.close(); d.close()")
    other = [sys.executable, "-c", probe, str(private_dir)]
    cwd = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    assert subprocess.run(other, capture_output=True, text=True, cwd=cwd, check=True).stdout.strip() == "1"
    tier.close()
    directory.close()
    assert subprocess.run(other, capture_output=True, text=True, cwd=cwd, check=True).stdout.strip() == "0"


def test_a_directory_held_exclusively_is_a_clear_error_after_a_bounded_wait(private_dir):
    """gc (or a store of an older tiered_kv) holds the lock exclusively: a store waits for it a
    bounded time, then ColdPathInUseError names the path and why; once released, it opens at once."""
    from tiered_kv.errors import ColdPathInUseError
    from tiered_kv.tiers.cold_files import ColdDirectory
    gc = ColdDirectory(str(private_dir), shared=False)
    try:
        with gc.exclusive_lock():
            with pytest.raises(ColdPathInUseError, match=r"'cold\.path'.*is in use: another process holds it "
                                                         r"exclusively"):
                open_cold_directory(str(private_dir), lock_wait_s=0.2)
            store = None
        store = open_cold_directory(str(private_dir), lock_wait_s=0.2)
        with pytest.raises(ColdPathInUseError, match="stores run on it"):  # and gc waits for no store
            with gc.exclusive_lock():
                pass
        store.close()
    finally:
        gc.close()


# --- names planted inside --------------------------------------------------------------------

@pytest.mark.parametrize("name", [LOCK_NAME, BLOCK_NAME])
@pytest.mark.parametrize("target_exists", [True, False])
def test_a_symlink_planted_at_one_of_our_names_is_refused_and_its_target_untouched(tmp_path, private_dir, name,
                                                                                   target_exists):
    target = tmp_path / "victim"
    if target_exists:
        target.write_bytes(b"precious")
        os.chmod(target, 0o644)
    os.symlink(target, private_dir / name)
    before = snapshot(tmp_path)
    with pytest.raises(ConfigError, match=rf"'cold\.path': '{private_dir / name}' is a symbolic link.*untouched"):
        directory = open_cold_directory(str(private_dir))
        try:
            ColdTier(LAYOUT, 4, directory, backend="posix")
        finally:
            directory.abort()
    assert snapshot(tmp_path) == before  # target not created, written, grown or chmod'ed; the link stays


def _plant_hard_link(path, tmp_path):
    (tmp_path / "elsewhere").write_bytes(b"")
    os.chmod(tmp_path / "elsewhere", 0o600)
    os.link(tmp_path / "elsewhere", path)


@pytest.mark.parametrize("plant, why", [
    (lambda path, tmp_path: (path.write_bytes(b"x" * 100), os.chmod(path, 0o644)),
     r"group or others may access it \(mode 0644\)"),
    (lambda path, tmp_path: (path.write_bytes(b"x" * 100), os.chmod(path, 0o606)), r"mode 0606"),
    (lambda path, tmp_path: path.mkdir(mode=0o700), r"it is a directory"),
    (lambda path, tmp_path: os.mkfifo(path, 0o600), r"not a regular file"),
    (_plant_hard_link, r"2 hard links"),
])
def test_an_existing_file_at_our_name_that_is_not_ours_alone_is_refused_untouched(tmp_path, private_dir, plant, why):
    plant(private_dir / BLOCK_NAME, tmp_path)
    directory = open_cold_directory(str(private_dir))
    before = snapshot(tmp_path)
    with pytest.raises(ConfigError, match=rf"'cold\.path': '{private_dir / BLOCK_NAME}' exists but is not a file "
                                          rf"this store may use \(.*{why}.*\).*allowed"):
        ColdTier(LAYOUT, 4, directory, backend="posix")
    assert snapshot(tmp_path) == before
    directory.close()


@pytest.mark.skipif(not IS_ROOT, reason="chown to another uid needs root")
def test_an_existing_block_file_of_another_uid_is_refused_untouched(tmp_path, private_dir):
    path = private_dir / BLOCK_NAME
    path.write_bytes(b"theirs")
    os.chmod(path, 0o600)
    os.chown(path, 65534, 65534)
    directory = open_cold_directory(str(private_dir))
    before = snapshot(tmp_path)
    with pytest.raises(ConfigError, match=r"owned by uid 65534"):
        ColdTier(LAYOUT, 4, directory, backend="posix")
    assert snapshot(tmp_path) == before
    directory.close()


def test_a_block_file_of_ours_is_reused_and_kept_on_close(private_dir):
    directory = open_cold_directory(str(private_dir))
    ColdTier(LAYOUT, 2, directory, backend="posix").close()
    directory.close()
    inode = os.stat(private_dir / BLOCK_NAME).st_ino
    directory = open_cold_directory(str(private_dir))
    tier = ColdTier(LAYOUT, 3, directory, backend="posix")
    assert os.stat(tier.file_path).st_ino == inode
    assert os.path.getsize(tier.file_path) == 3 * 4096
    tier.close()
    directory.abort()  # made nothing in this start: removes nothing
    assert sorted(os.listdir(private_dir)) == sorted([LOCK_NAME, BLOCK_NAME, "notes.txt"])


# --- capacity --------------------------------------------------------------------------------

@contextmanager
def small_tmpfs(path, size="1m"):
    path.mkdir(mode=0o700)
    if not IS_ROOT or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
                                     capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root")
    try:
        yield path
    finally:  # lazy: detaches even while a failed test still holds a file open in it
        subprocess.run(["umount", "--lazy", str(path)], check=True)


@contextmanager
def max_file_bytes(limit_bytes):
    """RLIMIT_FSIZE: fallocate past it fails with EFBIG (Python ignores SIGXFSZ)."""
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, old[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)


def test_capacity_beyond_free_space_is_refused_before_allocating(tmp_path):
    with small_tmpfs(tmp_path / "mnt") as mount:
        before = snapshot(tmp_path)
        directory = open_cold_directory(str(mount / "cold"))
        try:
            with pytest.raises(ConfigError, match=r"config key 'cold\.capacity': 2097152 bytes do not fit on the disk "
                                                  r"of .* \(\d+ bytes free there; 2097152 more bytes needed\)"):
                ColdTier(LAYOUT, 512, directory, backend="posix")  # 512 records x 4 KiB = 2 MiB on a 1 MiB disk
            assert os.listdir(mount / "cold") == [LOCK_NAME]
        finally:
            directory.abort()
        assert snapshot(tmp_path) == before
        # what fits, fits: a quarter of the mount
        directory = open_cold_directory(str(mount / "cold"))
        tier = ColdTier(LAYOUT, 64, directory, backend="posix")
        try:
            tier.write_blocks(list(range(64)), blocks(64))
            assert torch.equal(tier.read_blocks([63]), blocks(64)[63:])
        finally:
            tier.close()
            directory.close()


def test_fallocate_failing_removes_a_file_made_in_this_start(private_dir, tmp_path):
    directory = open_cold_directory(str(private_dir))
    before = snapshot(tmp_path)
    with max_file_bytes(64 * 1024):
        with pytest.raises(ConfigError, match=r"config key 'cold\.capacity': 1048576 bytes do not fit.*File too large"):
            ColdTier(LAYOUT, 256, directory, backend="posix")
    assert snapshot(tmp_path) == before  # the block file it made is gone, nothing else changed
    directory.close()


@pytest.mark.parametrize("failure", ["efbig", "enospc_after_growing"])
def test_fallocate_failing_cuts_a_reused_file_back_to_its_size(private_dir, tmp_path, monkeypatch, failure):
    directory = open_cold_directory(str(private_dir))
    tier = ColdTier(LAYOUT, 2, directory, backend="posix")
    tier.write_blocks([0, 1], blocks(2))
    tier.close()
    before = snapshot(tmp_path)
    if failure == "enospc_after_growing":  # a disk that fills up part way through (no root needed)
        def full_part_way(fd, size_bytes):
            os.ftruncate(fd, size_bytes // 2)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        monkeypatch.setattr(block_io, "preallocate", full_part_way)
        with pytest.raises(ConfigError, match=r"'cold\.capacity': 1048576 bytes.*No space left on device"):
            ColdTier(LAYOUT, 256, directory, backend="posix")
    else:
        with max_file_bytes(64 * 1024), pytest.raises(ConfigError, match=r"'cold\.capacity'.*File too large"):
            ColdTier(LAYOUT, 256, directory, backend="posix")
    assert snapshot(tmp_path) == before  # still there, same size, same bytes
    directory.close()


# --- short and missing records are corrupt blocks --------------------------------------------

@pytest.mark.parametrize("layout", [LAYOUT, PACKED], ids=["padded", "packed"])
def test_a_truncated_record_is_a_corrupt_block_of_its_slot(private_dir, layout):
    directory = open_cold_directory(str(private_dir))
    tier = ColdTier(layout, 4, directory, backend="posix")
    data = blocks(4, layout)
    tier.write_blocks([0, 1, 2, 3], data)
    tier.flush()
    stride = tier.record_stride_bytes
    os.truncate(tier.file_path, 2 * stride + layout.layer_bytes + 100)  # cuts slot 2's layer 1, all of slot 3
    for slots, bad in [([2], 2), ([3], 3), ([1, 2, 3], 2), ([0, 1, 3], 3)]:
        with pytest.raises(CorruptBlockError, match=rf"cold tier slot {bad} .*cannot be read.*short read") as caught:
            tier.read_blocks(slots)
        assert caught.value.slot == bad
    with pytest.raises(CorruptBlockError, match=r"slot 2 layer 1 cannot be read") as caught:
        tier.read_tokens(1, tier.token_index([0, 2], [1, 1]))
    assert caught.value.slot == 2
    assert torch.equal(tier.read_tokens(0, tier.token_index([2], [3])), data[2, 0, :, :, 3:4, :])  # layer 0 is whole
    assert torch.equal(tier.read_blocks([0, 1]), data[:2])
    assert tier.verify([0, 1, 2, 3]) == [2, 3]
    tier.write_blocks([2, 3], data[2:])  # rewriting heals
    assert torch.equal(tier.read_blocks([0, 1, 2, 3]), data)
    tier.close()
    directory.close()


def test_an_unlinked_file_keeps_serving_its_data_from_the_open_fd(private_dir):
    directory = open_cold_directory(str(private_dir))
    tier = ColdTier(LAYOUT, 3, directory, backend="posix")
    data = blocks(3)
    tier.write_blocks([0, 1, 2], data)
    tier.flush()
    os.unlink(tier.file_path)
    assert torch.equal(tier.read_blocks([0, 1, 2]), data)
    assert tier.verify([0, 1, 2]) == []
    tier.close()
    directory.close()


# --- tier slabs that cannot fit --------------------------------------------------------------

def test_a_hot_slab_beyond_memory_is_a_config_error():
    num_slots = 2**40 // LAYOUT.block_bytes  # 1 TiB
    with pytest.raises(ConfigError, match=r"config key 'hot\.capacity': a slab of 1099511627776 bytes does not fit in "
                                          r"host RAM, which has \d+ bytes available.*allowed"):
        HotTier(LAYOUT, num_slots, torch.device("cpu"), torch.float32)


def test_a_warm_slab_beyond_memory_is_a_config_error():
    with pytest.raises(ConfigError, match=r"config key 'warm\.capacity': a slab of 1099511627776 bytes"):
        WarmTier(LAYOUT, 2**40 // LAYOUT.block_bytes, torch.float32, pinned=False)


def test_a_store_with_one_tib_hot_on_cpu_fails_with_hot_capacity(tmp_path):
    store = TierStore({"hot": {"device": "cpu", "capacity": "1TiB"}, "cold": {"capacity_blocks": 0,
                                                                               "path": str(tmp_path)}})
    with pytest.raises(ConfigError, match=r"'hot\.capacity'.*1099511627776 bytes"):
        store.bind(LAYOUT, torch.float32)
    store.close()


def test_the_check_reads_mem_available_before_allocating(tmp_path, monkeypatch):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       4096 kB\nMemAvailable:   1024 kB\n")
    monkeypatch.setattr(memory, "_MEMINFO_PATH", str(meminfo))
    monkeypatch.setattr(memory, "_CGROUP_LIMITS", ())
    with pytest.raises(ConfigError, match=r"'warm\.capacity': a slab of 2097152 bytes .* 1048576 bytes available "
                                          r"\(MemAvailable in /proc/meminfo\)"):
        memory.allocate_slab("warm.capacity", (2 * 2**20,), torch.uint8, torch.device("cpu"))
    slab = memory.allocate_slab("hot.capacity", (2**20,), torch.uint8, torch.device("cpu"))
    assert slab.shape == (2**20,) and not slab.any()
