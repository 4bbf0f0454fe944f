"""`block_size: auto`: the class pick, what is kept of the spelling, round trips, every bad input,
and a bank built from an auto config (its store's layout uses the picked size)."""
import dataclasses
import re
from pathlib import Path

import pytest
import torch
import yaml
from transformers import DynamicCache

import tiered_kv
from tiered_kv.config import BlockSizeAutoConfig, Config, HotConfig, load_config
from tiered_kv.errors import ConfigError

from helpers import rand_ids, tiny_model

REPO = Path(__file__).resolve().parent.parent
BAD_CONFIGS = Path(__file__).resolve().parent / "configs" / "block_size_auto"
DEFAULT_CLASSES = ((512, 8), (2048, 16), (None, 32))


# --- the pick ----------------------------------------------------------------------------------

@pytest.mark.parametrize("expected, size", [
    (1, 8), (511, 8), (512, 8),          # a class includes its threshold
    (513, 16), (2048, 16),
    (2049, 32), (32768, 32), (10**9, 32),  # the open-ended class takes everything longer
])
def test_auto_picks_by_default_classes(expected, size):
    cfg = load_config({"block_size": "auto", "block_size_auto": {"expected_context_tokens": expected}})
    assert cfg.block_size == size and type(cfg.block_size) is int
    assert cfg.block_size_spec == "auto" and cfg.block_size_is_auto
    assert cfg.block_size_auto == BlockSizeAutoConfig(expected_context_tokens=expected, classes=DEFAULT_CLASSES)


def test_auto_alone_uses_documented_defaults():
    cfg = load_config({"block_size": "auto"})
    assert (cfg.block_size, cfg.block_size_spec) == (16, "auto")  # expected 2,048 tokens -> 16
    assert cfg.block_size_auto == BlockSizeAutoConfig()
    assert cfg.block_size_auto.classes == DEFAULT_CLASSES and cfg.block_size_auto.expected_context_tokens == 2048
    assert Config(block_size="auto") == cfg
    assert load_config({"block_size": "auto", "block_size_auto": None}) == cfg  # `block_size_auto:` alone


def test_custom_classes_one_class_and_pick_of_other_lengths():
    auto = BlockSizeAutoConfig(expected_context_tokens=100, classes=[[64, 4], [1000, 64], [None, 256]])
    assert auto.classes == ((64, 4), (1000, 64), (None, 256))  # YAML lists become tuples (hashable, frozen)
    assert [auto.pick(), auto.pick(64), auto.pick(65), auto.pick(1001)] == [64, 4, 64, 256]
    only = load_config({"block_size": "auto", "block_size_auto": {"classes": [[None, 128]]}})
    assert only.block_size == 128


def test_int_block_size_is_unchanged():
    cfg = load_config({"block_size": 32})
    assert (cfg.block_size, cfg.block_size_spec, cfg.block_size_auto, cfg.block_size_is_auto) == (32, 32, None, False)
    assert "block_size_auto" not in cfg.to_dict()
    assert Config() == load_config({}) and Config().block_size_spec == 16


def test_auto_differs_from_the_same_int():
    """Same slab layout, but not the same config: stats/repr must be able to say it was picked."""
    auto, fixed = load_config({"block_size": "auto"}), load_config({"block_size": 16})
    assert auto.block_size == fixed.block_size == 16
    assert auto != fixed
    assert "block_size_spec='auto'" in repr(auto) and "block_size_spec=16" in repr(fixed)


def test_frozen():
    cfg = load_config({"block_size": "auto"})
    for name in ("block_size", "block_size_spec", "block_size_auto"):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(cfg, name, 8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.block_size_auto.expected_context_tokens = 1  # type: ignore[misc]


# --- round trips and replace -------------------------------------------------------------------

def test_round_trip_keeps_auto(tmp_path):
    cfg = load_config({"block_size": "auto", "block_size_auto": {"expected_context_tokens": 4096,
                                                                 "classes": [[256, 4], [None, 64]]}})
    as_dict = cfg.to_dict()
    assert as_dict["block_size"] == "auto"
    assert as_dict["block_size_auto"] == {"expected_context_tokens": 4096, "classes": [[256, 4], [None, 64]]}
    assert load_config(as_dict) == cfg and cfg.block_size == 64
    path = tmp_path / "auto.yaml"
    path.write_text(yaml.safe_dump(as_dict))
    assert "block_size: auto" in path.read_text()
    assert load_config(path) == cfg


def test_replace_keeps_or_drops_auto():
    cfg = load_config({"block_size": "auto", "block_size_auto": {"expected_context_tokens": 8192}})
    smaller_hot = cfg.replace(hot=HotConfig(capacity_blocks=2))
    assert (smaller_hot.block_size, smaller_hot.block_size_spec) == (32, "auto")
    assert smaller_hot.block_size_auto is cfg.block_size_auto
    repicked = cfg.replace(block_size_auto=BlockSizeAutoConfig(expected_context_tokens=300))
    assert (repicked.block_size, repicked.block_size_spec) == (8, "auto")
    fixed = cfg.replace(block_size=64)
    assert (fixed.block_size, fixed.block_size_spec, fixed.block_size_auto) == (64, 64, None)
    back = fixed.replace(block_size="auto")
    assert (back.block_size, back.block_size_auto) == (16, BlockSizeAutoConfig())
    with pytest.raises(ConfigError, match=re.escape("config key 'block_size_auto': given while 'block_size' is 64")):
        fixed.replace(block_size_auto=BlockSizeAutoConfig())


def test_shipped_default_yaml_example_loads(tmp_path):
    """The commented `block_size: auto` example in default.yaml, uncommented, is valid and picks 16."""
    text = (REPO / "configs" / "default.yaml").read_text()
    lines = text.splitlines()
    start = lines.index("#   block_size: auto")
    example = []
    for line in lines[start:]:
        if not line.startswith("#   "):
            break
        example.append(line[4:])
    assert len(example) == 4, example
    body = text.replace("\nblock_size: 16\n", "\n" + "\n".join(example) + "\n")
    path = tmp_path / "default_auto.yaml"
    path.write_text(body)
    cfg = load_config(path)
    assert (cfg.block_size, cfg.block_size_spec, cfg.block_size_auto) == (16, "auto", BlockSizeAutoConfig())
    assert cfg.replace(block_size=16) == load_config(REPO / "configs" / "default.yaml")


# --- bad input: each names the key path, the value and what is allowed -------------------------

BAD_FIXTURES = {
    "bad_auto_without_auto.yaml": r"config key 'block_size_auto': given while 'block_size' is 16; allowed: only with "
                                  r"block_size: auto",
    "bad_thresholds_decrease.yaml": r"config key 'block_size_auto\.classes\[1\]\[0\]': got 512; allowed: an integer "
                                    r"> 2048 \(thresholds strictly increase\)",
    "bad_no_open_class.yaml": r"config key 'block_size_auto\.classes\[1\]\[0\]': got 2048; allowed: null in the last "
                              r"class",
    "bad_open_class_first.yaml": r"config key 'block_size_auto\.classes\[0\]\[0\]': got None; allowed: null only in "
                                 r"the last class",
    "bad_class_size.yaml": r"config key 'block_size_auto\.classes\[1\]\[1\]': got 24; allowed: a power of two from 1 "
                           r"to 1024",
    "bad_expected_zero.yaml": r"config key 'block_size_auto\.expected_context_tokens': got 0; allowed: an integer >= 1",
    "bad_auto_unknown_key.yaml": r"config key 'block_size_auto\.expected_tokens' is unknown \(value 4096\); allowed "
                                 r"keys under 'block_size_auto': 'expected_context_tokens', 'classes'",
    "bad_auto_spelling.yaml": r"config key 'block_size': got 'Auto'; allowed: a power of two from 1 to 1024 "
                              r"\(tokens\) or 'auto'",
}


def test_every_bad_fixture_is_tested():
    assert sorted(p.name for p in BAD_CONFIGS.glob("*.yaml")) == sorted(BAD_FIXTURES)


@pytest.mark.parametrize("name", sorted(BAD_FIXTURES))
def test_bad_fixture_raises(name):
    path = BAD_CONFIGS / name
    with pytest.raises(ConfigError, match="^" + re.escape(str(path)) + ": ") as info:
        load_config(path)
    assert re.search(BAD_FIXTURES[name], str(info.value)), str(info.value)
    assert info.value.__cause__ is None


def _auto(**section):
    return {"block_size": "auto", "block_size_auto": section}


@pytest.mark.parametrize("data, message", [
    (_auto(expected_context_tokens=-5), "config key 'block_size_auto.expected_context_tokens': got -5; allowed: an integer >= 1"),
    (_auto(expected_context_tokens=True), "config key 'block_size_auto.expected_context_tokens': got True;"),
    (_auto(expected_context_tokens=2048.0), "config key 'block_size_auto.expected_context_tokens': got 2048.0;"),
    (_auto(expected_context_tokens="2k"), "config key 'block_size_auto.expected_context_tokens': got '2k';"),
    (_auto(expected_context_tokens=None), "config key 'block_size_auto.expected_context_tokens': got None; allowed: a value"),
    (_auto(classes=[]), "config key 'block_size_auto.classes': got []; allowed: a non-empty list of "
                        "[max_context_tokens, block_size] pairs"),
    (_auto(classes={512: 8}), "config key 'block_size_auto.classes': got {512: 8}; allowed: a non-empty list"),
    (_auto(classes=[[512, 8, 1], [None, 32]]), "config key 'block_size_auto.classes[0]': got [512, 8, 1]; "
                                               "allowed: a pair [max_context_tokens, block_size]"),
    (_auto(classes=[512, [None, 32]]), "config key 'block_size_auto.classes[0]': got 512; allowed: a pair"),
    (_auto(classes=[[512, 8], [512, 16], [None, 32]]), "config key 'block_size_auto.classes[1][0]': got 512; "
                                                       "allowed: an integer > 512 (thresholds strictly increase)"),
    (_auto(classes=[[0, 8], [None, 32]]), "config key 'block_size_auto.classes[0][0]': got 0; allowed: an integer > 0"),
    (_auto(classes=[[-1, 8], [None, 32]]), "config key 'block_size_auto.classes[0][0]': got -1; allowed: an integer > 0"),
    (_auto(classes=[[True, 8], [None, 32]]), "config key 'block_size_auto.classes[0][0]': got True;"),
    (_auto(classes=[[512.5, 8], [None, 32]]), "config key 'block_size_auto.classes[0][0]': got 512.5;"),
    (_auto(classes=[[512, 8], [None, 32], [None, 64]]), "config key 'block_size_auto.classes[1][0]': got None; "
                                                        "allowed: null only in the last class"),
    (_auto(classes=[[512, 0], [None, 32]]), "config key 'block_size_auto.classes[0][1]': got 0; allowed: a power of two"),
    (_auto(classes=[[512, -8], [None, 32]]), "config key 'block_size_auto.classes[0][1]': got -8; allowed: a power of two"),
    (_auto(classes=[[512, 8], [None, 2048]]), "config key 'block_size_auto.classes[1][1]': got 2048; allowed: a "
                                              "power of two from 1 to 1024"),
    (_auto(classes=[[512, "8"], [None, 32]]), "config key 'block_size_auto.classes[0][1]': got '8';"),
    (_auto(classes=[[512, True], [None, 32]]), "config key 'block_size_auto.classes[0][1]': got True;"),
    (_auto(classes=[[None, None]]), "config key 'block_size_auto.classes[0][1]': got None; allowed: a power of two"),
    ({"block_size": 8, "block_size_auto": {}}, "config key 'block_size_auto': given while 'block_size' is 8; allowed: "
                                               "only with block_size: auto (set block_size: auto, or remove block_size_auto)"),
    ({"block_size": 8, "block_size_auto": None}, "config key 'block_size_auto': given while 'block_size' is 8"),
    ({"block_size_auto": {}}, "config key 'block_size_auto': given while 'block_size' is 16"),  # the default is an int
    ({"block_size": "AUTO"}, "config key 'block_size': got 'AUTO'; allowed: a power of two from 1 to 1024 (tokens) "
                             "or 'auto' (picked by block_size_auto)"),
    ({"block_size": None}, "config key 'block_size': got None; allowed: a power of two"),
    ({"block_size": "auto", "block_size_auto": [2048]}, "config key 'block_size_auto': got [2048]; allowed: a mapping "
                                                        "with keys 'expected_context_tokens', 'classes'"),
    ({"block_size": "auto", "block_size_auto": 2048}, "config key 'block_size_auto': got 2048; allowed: a mapping"),
    ({"block_sizes": "auto"}, "config key 'block_sizes' is unknown (value 'auto'); allowed keys: 'block_size', 'hot', "
                              "'warm', 'cold', 'scheduler', 'metrics', 'remote', 'copies', 'compression', 'attention', 'block_size_auto'"),
])
def test_bad_values(data, message):
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        load_config(data)


def test_direct_construction_validates():
    with pytest.raises(ConfigError, match=re.escape("config key 'block_size_auto': got {'classes': []}; allowed: "
                                                    "a BlockSizeAutoConfig")):
        Config(block_size="auto", block_size_auto={"classes": []})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=re.escape("config key 'block_size_auto.classes[0][0]': got 4;")):
        BlockSizeAutoConfig(classes=((4, 8),))


# --- downstream: the resolved int is what banks and stores use ---------------------------------

def test_bank_from_auto_config_uses_picked_size(tmp_path):
    model = tiny_model("llama")
    cfg = load_config({"block_size": "auto", "block_size_auto": {"expected_context_tokens": 100,
                                                                 "classes": [[64, 2], [256, 8], [None, 32]]},
                       "hot": {"device": "cpu", "capacity_blocks": 3}, "warm": {"capacity_blocks": 64},
                       "cold": {"capacity_blocks": 0, "path": str(tmp_path / "cold")}})
    assert cfg.block_size == 8
    ids = rand_ids(7, 40)
    bank = tiered_kv.CacheBank(model, cfg)
    try:
        out = model.generate(ids, cache=bank, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
        stats = bank.stats()
        assert bank.store.layout.block_size == 8
        assert stats["block_size"] == {"tokens": 8, "auto": True}
        assert stats["seq_tokens"] == 45 and sum(stats["bank_blocks"].values()) == 6  # ceil(45 / 8)
        assert stats["bank_blocks"]["warm"] > 0  # hot holds 3 blocks: the rest spilled
        same = tiered_kv.CacheBank(model, store=bank.store, config=load_config(cfg.to_dict()))
        same.close()  # an equal auto config is accepted beside the shared store
    finally:
        bank.close()
    reference = model.generate(ids, cache=DynamicCache(config=model.config), attention_mask=torch.ones_like(ids),
                               max_new_tokens=6, do_sample=False)
    assert torch.equal(out, reference)


def test_cli_reports_bad_auto_config_in_one_line(capsys):
    from tiered_kv.cli import main

    path = BAD_CONFIGS / "bad_thresholds_decrease.yaml"
    assert main(["chat", "--config", str(path), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tiered-kv: error:") and "block_size_auto.classes[1][0]" in err[0], err
