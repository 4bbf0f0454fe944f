"""tiered_kv.config: shipped configs, size parsing, defaults, round trip and every failure mode."""
import dataclasses
import os
import re
from pathlib import Path

import pytest
import yaml

from tiered_kv.config import (ALLOWED_POLICIES, ColdConfig, Config, HotConfig, SchedulerConfig,
                              WarmConfig, load_config, parse_size)
from tiered_kv.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent
BAD_CONFIGS = Path(__file__).resolve().parent / "configs"
KiB, MiB, GiB = 2**10, 2**20, 2**30
SMOLLM2_BLOCK_BYTES = 16 * 46 * KiB  # 736 KiB: 16 tokens of fp32 KV for SmolLM2-135M


# --- shipped configs -------------------------------------------------------------------------

def test_default_yaml_values():
    cfg = load_config(REPO / "configs" / "default.yaml")
    assert cfg == Config(
        block_size=16,
        hot=HotConfig(device="auto", capacity_bytes=64 * MiB),
        warm=WarmConfig(capacity_bytes=256 * MiB, pinned="auto"),
        cold=ColdConfig(path=os.path.expanduser("~/.cache/tiered_kv/cold"), capacity_bytes=2 * GiB,
                        backend="auto", fsync=True),
        scheduler=SchedulerConfig(policy="lru"))
    assert cfg.hot.capacity_blocks is None
    assert cfg.cold.path == os.path.join(os.path.expanduser("~"), ".cache", "tiered_kv", "cold")


def test_default_yaml_hot_tier_holds_less_than_a_long_chat():
    cfg = load_config(str(REPO / "configs" / "default.yaml"))
    num_hot_blocks = cfg.hot.resolve_blocks(SMOLLM2_BLOCK_BYTES)
    assert num_hot_blocks == 89
    assert num_hot_blocks * cfg.block_size == 1424  # < 2,000 tokens, so a long chat spills to warm
    assert cfg.warm.resolve_blocks(SMOLLM2_BLOCK_BYTES) == 356
    assert cfg.cold.resolve_blocks(SMOLLM2_BLOCK_BYTES) == 2849


def test_small_device_yaml_values():
    cfg = load_config(REPO / "configs" / "small_device.yaml")
    assert cfg == Config(
        block_size=16,
        hot=HotConfig(device="auto", capacity_blocks=8),
        warm=WarmConfig(capacity_blocks=16, pinned="auto"),
        cold=ColdConfig(path=os.path.expanduser("~/.cache/tiered_kv/cold-small"), capacity_bytes=GiB,
                        backend="auto", fsync=True),
        scheduler=SchedulerConfig(policy="lru"))
    assert (cfg.hot.capacity_bytes, cfg.warm.capacity_bytes) == (None, None)
    assert cfg.hot.resolve_blocks(SMOLLM2_BLOCK_BYTES) == 8
    assert cfg.warm.resolve_blocks(SMOLLM2_BLOCK_BYTES) == 16


# --- sizes -----------------------------------------------------------------------------------

@pytest.mark.parametrize("text, num_bytes", [
    (0, 0), (4096, 4096), ("4096", 4096), ("0", 0), ("7B", 7), ("7 b", 7),
    ("512KiB", 512 * KiB), ("256MiB", 256 * MiB), ("64 MiB", 64 * MiB), ("64mib", 64 * MiB),
    ("2GiB", 2 * GiB), ("1.5GiB", 1610612736), ("1TiB", 2**40), ("0.5KiB", 512),
    ("1KB", 1000), ("100MB", 100_000_000), ("2GB", 2_000_000_000), ("3tb", 3 * 10**12),
    ("1.25MB", 1_250_000), ("  8 GiB  ", 8 * GiB),
])
def test_parse_size(text, num_bytes):
    assert parse_size(text) == num_bytes
    assert type(parse_size(text)) is int


@pytest.mark.parametrize("text", [
    "", "MiB", "-1", -1, "1.5", "0.3KiB", "12 parsecs", "1 M", "1Gi", "1e9", "1,000", "1.GiB",
    True, 1.5, None, [64],
])
def test_parse_size_rejects(text):
    with pytest.raises(ConfigError, match=re.escape(f"config key 'size': got {text!r}; allowed: a byte count")):
        parse_size(text)


def test_parse_size_names_the_key():
    with pytest.raises(ConfigError, match=re.escape("config key 'warm.capacity': got '2 GiBs'")):
        parse_size("2 GiBs", "warm.capacity")


# --- dict input, defaults, round trip --------------------------------------------------------

def test_empty_dict_gives_documented_defaults():
    cfg = load_config({})
    assert cfg == Config()
    assert cfg.block_size == 16
    assert (cfg.hot.device, cfg.hot.capacity_bytes, cfg.hot.capacity_blocks) == ("auto", 512 * MiB, None)
    assert (cfg.warm.capacity_bytes, cfg.warm.capacity_blocks, cfg.warm.pinned) == (2 * GiB, None, "auto")
    assert cfg.cold == ColdConfig(path=os.path.expanduser("~/.cache/tiered_kv/cold"),
                                  capacity_bytes=8 * GiB, backend="auto", fsync=True)
    assert cfg.scheduler.policy == "lru"
    assert ALLOWED_POLICIES == ("lru", "lfu", "fifo", "turns")


def test_dict_input_with_partial_sections():
    cfg = load_config({"block_size": 32, "hot": {"device": "cuda:1", "capacity_blocks": 4},
                       "warm": {"capacity": "1.5GiB", "pinned": False}, "cold": {"capacity": 0},
                       "scheduler": None})
    assert cfg.block_size == 32
    assert cfg.hot == HotConfig(device="cuda:1", capacity_blocks=4)
    assert cfg.warm == WarmConfig(capacity_bytes=1610612736, pinned="false")
    assert (cfg.cold.capacity_bytes, cfg.cold.backend, cfg.cold.fsync) == (0, "auto", True)
    assert cfg.scheduler == SchedulerConfig(policy="lru")


@pytest.mark.parametrize("raw, pinned", [(True, "true"), (False, "false"), ("true", "true"),
                                         ("false", "false"), ("auto", "auto")])
def test_pinned_accepts_yaml_bools(raw, pinned):
    assert load_config({"warm": {"pinned": raw}}).warm.pinned == pinned


def test_yaml_bool_pinned_from_file(tmp_path):
    path = tmp_path / "pinned.yaml"
    path.write_text("warm:\n  pinned: true\ncold:\n  fsync: false\n")
    cfg = load_config(path)
    assert (cfg.warm.pinned, cfg.cold.fsync) == ("true", False)


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:0", "cuda:12"])
def test_device_accepted(device):
    assert load_config({"hot": {"device": device}}).hot.device == device


def test_cold_path_expands_user_and_vars_and_is_not_created(tmp_path, monkeypatch):
    monkeypatch.setenv("TIERED_KV_TEST_ROOT", str(tmp_path))
    cfg = load_config({"cold": {"path": "$TIERED_KV_TEST_ROOT/never/made"}})
    assert cfg.cold.path == str(tmp_path / "never" / "made")
    assert not (tmp_path / "never").exists()
    assert load_config({"cold": {"path": "~/kv"}}).cold.path == os.path.join(os.path.expanduser("~"), "kv")


def test_config_is_returned_as_is_and_frozen():
    cfg = load_config({"block_size": 8})
    assert load_config(cfg) is cfg
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.block_size = 4  # type: ignore[misc]


@pytest.mark.parametrize("name", ["default.yaml", "small_device.yaml"])
def test_round_trip_shipped(name):
    cfg = load_config(REPO / "configs" / name)
    as_dict = cfg.to_dict()
    assert load_config(as_dict) == cfg
    assert type(as_dict) is dict and all(type(as_dict[key]) is dict for key in ("hot", "warm", "cold", "scheduler"))


def test_to_dict_exact():
    cfg = load_config({"hot": {"capacity_blocks": 8}, "warm": {"capacity": "1KiB", "pinned": True},
                       "cold": {"path": "/tmp/kv", "backend": "posix", "fsync": False}})
    assert cfg.to_dict() == {
        "block_size": 16,
        "hot": {"device": "auto", "capacity_blocks": 8, "high_watermark": 0.9, "low_watermark": 0.8},
        "warm": {"capacity": 1024, "pinned": "true", "layout": "auto", "compression": "none",
                 "high_watermark": 0.95, "low_watermark": 0.85},
        "cold": {"path": "/tmp/kv", "capacity": 8 * GiB, "backend": "posix", "fsync": False, "write_behind_s": 1.0,
                 "admit": "published", "compression": "none", "high_watermark": 1.0, "low_watermark": 1.0},
        "scheduler": {"policy": "lru", "ali_window": 100, "ali_hot": 0.7, "ali_warm": 0.3, "bs_threshold": 0.8,
                      "cs_weight": 0.5, "attention_weight": 0.0, "default_cost_sensitivity": 0.5, "idle_steps": 1000,
                      "half_life_turns": 16.0, "lfu_half_life_turns": 16.0, "ali_promote": False, "restore": "always", "background": True,
                      "mover_interval_s": 0.02, "max_fragmentation": 0.5, "min_contiguity": 0.9},
        "metrics": {"enabled": True},
        "remote": {"url": "", "cluster": False, "username": "", "password_env": "", "key_prefix": "tkv:", "ttl": 0,
                   "write": "through", "timeout_ms": 500, "required": False, "compression": "none"},
        "copies": {"engine": "auto", "delay_us": 0},
        "compression": {"quality_floor": 0.99, "calibration_text": "mixed", "calibration_tokens": 512,
                        "check_explicit": True},
        "attention": {"sample_steps": 0.05, "sample_layers": 0.25, "decay": 0.8,
                      "sparse": {"budget": None, "first_blocks": 1, "recent_blocks": 2}},
    }


def test_round_trip_through_yaml_file(tmp_path):
    cfg = load_config({"block_size": 64, "hot": {"capacity": "3MiB"}, "warm": {"capacity_blocks": 0}})
    path = tmp_path / "dumped.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict()))
    assert load_config(path) == cfg


def test_replace_validates():
    cfg = Config()
    smaller = cfg.replace(block_size=32, hot=HotConfig(capacity_blocks=2))
    assert (smaller.block_size, smaller.hot.capacity_blocks, smaller.hot.capacity_bytes) == (32, 2, None)
    assert smaller.warm is cfg.warm and cfg.block_size == 16
    with pytest.raises(ConfigError, match=re.escape("config key 'block_size': got 3;")):
        cfg.replace(block_size=3)


# --- resolve_blocks --------------------------------------------------------------------------

def test_resolve_blocks():
    assert HotConfig(capacity_bytes=10 * KiB).resolve_blocks(KiB) == 10
    assert HotConfig(capacity_bytes=10 * KiB + 1023).resolve_blocks(KiB) == 10  # rounds down
    assert HotConfig(capacity_blocks=3).resolve_blocks(KiB) == 3  # blocks ignore block_bytes
    assert WarmConfig(capacity_bytes=KiB - 1).resolve_blocks(KiB) == 0  # warm may be empty
    assert ColdConfig(capacity_blocks=0).resolve_blocks(KiB) == 0


def test_resolve_blocks_hot_needs_one_block():
    with pytest.raises(ConfigError, match=re.escape("config key 'hot.capacity': got 1023; allowed: at least one block (1024 bytes")):
        HotConfig(capacity_bytes=1023).resolve_blocks(1024)


@pytest.mark.parametrize("block_bytes", [0, -4, True, 1.0])
def test_resolve_blocks_rejects_bad_block_bytes(block_bytes):
    with pytest.raises(ValueError, match=re.escape(f"block_bytes must be a positive int, got {block_bytes!r}")):
        HotConfig(capacity_blocks=1).resolve_blocks(block_bytes)


def test_direct_construction_validates():
    with pytest.raises(ConfigError, match=re.escape("config key 'cold.backend': got 'nfs'")):
        ColdConfig(backend="nfs")
    with pytest.raises(ConfigError, match=re.escape("config key 'hot': got {'capacity': 1}; allowed: a HotConfig")):
        Config(hot={"capacity": 1})  # type: ignore[arg-type]


# --- failing YAML fixtures: each names its key path and the bad value -------------------------

BAD_FIXTURES = {
    "bad_unknown_key.yaml": r"config key 'hot\.colour' is unknown \(value 'red'\); allowed keys under 'hot': 'device', 'capacity', 'capacity_blocks'",
    "bad_unknown_top_key.yaml": r"config key 'lukewarm' is unknown \(value \{'capacity': '1GiB'\}\); allowed keys: 'block_size', 'hot'",
    "bad_block_size.yaml": r"config key 'block_size': got 24; allowed: a power of two from 1 to 1024",
    "bad_block_size_bool.yaml": r"config key 'block_size': got True; allowed: a power of two",
    "bad_size.yaml": r"config key 'warm\.capacity': got '12 parsecs'; allowed: a byte count",
    "bad_backend.yaml": r"config key 'cold\.backend': got 's3'; allowed: 'auto', 'posix' or 'kvikio'",
    "bad_yaml_syntax.yaml": r"not valid YAML: mapping values are not allowed here.*line 3, column 12",
    "bad_both_capacities.yaml": r"config keys 'warm\.capacity' and 'warm\.capacity_blocks': got both \(268435456 bytes and 16 blocks\); allowed: one of them",
    "bad_negative_blocks.yaml": r"config key 'cold\.capacity_blocks': got -1; allowed: an integer >= 0",
    "bad_hot_zero.yaml": r"config key 'hot\.capacity': got 0; allowed: a size > 0",
    "bad_hot_zero_blocks.yaml": r"config key 'hot\.capacity_blocks': got 0; allowed: an integer >= 1",
    "bad_device.yaml": r"config key 'hot\.device': got 'cuda:x'; allowed: 'auto', 'cpu', 'cuda' or 'cuda:N'",
    "bad_policy.yaml": r"config key 'scheduler\.policy': got 'mru'; allowed: 'lru'",
    "bad_pinned.yaml": r"config key 'warm\.pinned': got 'maybe'; allowed: 'auto', 'true' or 'false'",
    "bad_fsync.yaml": r"config key 'cold\.fsync': got 'sometimes'; allowed: true or false",
    "bad_section_type.yaml": r"config key 'warm': got 5; allowed: a mapping with keys 'capacity', 'capacity_blocks', 'pinned'",
    "bad_top_level.yaml": r"config top level: got \[\{'block_size': 16\}, \{'hot': \{\}\}\]; allowed: a mapping",
    "bad_null_value.yaml": r"config key 'cold\.path': got None; allowed: a value",
}


def test_every_bad_fixture_is_tested():
    assert sorted(p.name for p in BAD_CONFIGS.glob("*.yaml")) == sorted(BAD_FIXTURES)


@pytest.mark.parametrize("name", sorted(BAD_FIXTURES))
def test_bad_fixture_raises(name):
    path = BAD_CONFIGS / name
    with pytest.raises(ConfigError, match="^" + re.escape(str(path)) + ": ") as info:
        load_config(path)
    assert re.search(BAD_FIXTURES[name], str(info.value), re.DOTALL), str(info.value)
    assert info.value.__cause__ is None  # no yaml/KeyError traceback chained under it


def test_missing_file(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=re.escape(f"{path}: cannot read config file: No such file or directory")):
        load_config(path)


def test_empty_file_is_not_a_mapping(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing here\n")
    with pytest.raises(ConfigError, match=re.escape(f"{path}: config top level: got None; allowed: a mapping")):
        load_config(path)


@pytest.mark.parametrize("source", [42, None, ["hot"], b"configs/default.yaml"])
def test_bad_source_type(source):
    with pytest.raises(ConfigError, match=re.escape(f"config source: got {source!r}; allowed: a YAML file path")):
        load_config(source)


@pytest.mark.parametrize("data, message", [
    ({"hot": {"capacity": "64MiB", "capacity_blocks": 4}},
     "config keys 'hot.capacity' and 'hot.capacity_blocks': got both (67108864 bytes and 4 blocks)"),
    ({"warm": {"capacity_blocks": -3}}, "config key 'warm.capacity_blocks': got -3; allowed: an integer >= 0"),
    ({"warm": {"capacity_blocks": True}}, "config key 'warm.capacity_blocks': got True; allowed: an integer >= 0"),
    ({"warm": {"capacity_blocks": "16"}}, "config key 'warm.capacity_blocks': got '16'; allowed: an integer >= 0"),
    ({"hot": {"capacity": "0MiB"}}, "config key 'hot.capacity': got 0; allowed: a size > 0"),
    ({"hot": {"capacity": -1}}, "config key 'hot.capacity': got -1; allowed: a byte count"),
    ({"block_size": 12}, "config key 'block_size': got 12; allowed: a power of two from 1 to 1024"),
    ({"block_size": 2048}, "config key 'block_size': got 2048; allowed: a power of two from 1 to 1024"),
    ({"block_size": 0}, "config key 'block_size': got 0; allowed: a power of two"),
    ({"block_size": "16"}, "config key 'block_size': got '16'; allowed: a power of two"),
    ({"block_size": False}, "config key 'block_size': got False; allowed: a power of two"),
    ({"block_size": 16.0}, "config key 'block_size': got 16.0; allowed: a power of two"),
    ({"scheduler": {"policy": "LRU"}}, "config key 'scheduler.policy': got 'LRU'; allowed: 'lru'"),
    ({"cold": {"backend": "gds"}}, "config key 'cold.backend': got 'gds'; allowed: 'auto', 'posix' or 'kvikio'"),
    ({"cold": {"fsync": 1}}, "config key 'cold.fsync': got 1; allowed: true or false"),
    ({"cold": {"path": ""}}, "config key 'cold.path': got ''; allowed: a non-empty directory path"),
    ({"cold": {"path": 7}}, "config key 'cold.path': got 7; allowed: a non-empty directory path"),
    ({"hot": {"device": "cuda:x"}}, "config key 'hot.device': got 'cuda:x'; allowed: 'auto', 'cpu', 'cuda' or 'cuda:N'"),
    ({"hot": {"device": "tpu"}}, "config key 'hot.device': got 'tpu'; allowed: 'auto', 'cpu', 'cuda' or 'cuda:N'"),
    ({"hot": {"device": "cuda:"}}, "config key 'hot.device': got 'cuda:'"),
    ({"hot": {"device": "CPU"}}, "config key 'hot.device': got 'CPU'"),
    ({"hot": {"device": 0}}, "config key 'hot.device': got 0"),
    ({"warm": {"pinned": 1}}, "config key 'warm.pinned': got 1; allowed: 'auto', 'true' or 'false'"),
    ({"scheduler": {"policy": "lru", "window": 8}}, "config key 'scheduler.window' is unknown (value 8); allowed keys under 'scheduler': 'policy'"),
    ({"hot": {"capacity_bytes": 1024}}, "config key 'hot.capacity_bytes' is unknown (value 1024)"),
    ({1: 2}, "config key '1' is unknown (value 2); allowed keys: 'block_size', 'hot', 'warm', 'cold', 'scheduler'"),
    ({"hot": ["cpu"]}, "config key 'hot': got ['cpu']; allowed: a mapping with keys 'device', 'capacity', 'capacity_blocks'"),
])
def test_bad_dict_values(data, message):
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        load_config(data)


@pytest.mark.parametrize("copies, message", [
    ({"engine": "cuda"}, "config key 'copies.engine': got 'cuda'; allowed: auto | sync | thread"),
    ({"engine": "thread", "delay_us": -3}, "copies.delay_us"),
    ({"engine": "thread", "delay_us": 2.5}, "copies.delay_us"),
    ({"engine": "thread", "delay_us": 2_000_000}, "from 0 to 1,000,000"),
    ({"delay_us": 100}, "a delay only with engine 'thread'"),
    ({"engines": "thread"}, "config key 'copies.engines' is unknown"),
])
def test_bad_copies_settings_name_their_key(copies, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config({"copies": copies})


def test_copies_settings_load_and_round_trip():
    cfg = load_config({"copies": {"engine": "thread", "delay_us": 300}})
    assert (cfg.copies.engine, cfg.copies.delay_us) == ("thread", 300)
    assert load_config(cfg.to_dict()) == cfg


def test_a_key_given_twice_in_a_yaml_file_is_an_error_not_the_last_one_winning(tmp_path):
    """YAML parsers keep the last of two equal keys; a config that says a thing twice is refused."""
    path = tmp_path / "twice.yaml"
    path.write_text("hot:\n  capacity: 64MiB\nwarm:\n  capacity: 1MiB\nhot:\n  device: cpu\n")
    with pytest.raises(ConfigError, match=r"'hot'.*twice.*line 5"):
        load_config(str(path))
    path.write_text("scheduler:\n  cs_weight: 0.5\n  cs_weight: 0.2\n")
    with pytest.raises(ConfigError, match=r"'scheduler.cs_weight'.*twice"):
        load_config(str(path))


def test_the_shipped_configs_say_each_key_once(monkeypatch):
    from tiered_kv.config import default_config_path

    monkeypatch.setenv("TKV_REDIS_PASSWORD", "unused")  # configs/remote.yaml names it
    shipped = sorted(default_config_path().parent.glob("*.yaml")) + sorted((REPO / "configs").glob("*.yaml"))
    assert len(shipped) >= 3
    for path in shipped:
        load_config(str(path))
