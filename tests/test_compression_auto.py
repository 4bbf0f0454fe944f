"""`compression: auto` and the quality floor (issue 36): the config, resolution on the model before the
store binds, the record beside the cold tier's files, the check of explicit lossy modes, reporting."""

from __future__ import annotations

import json
import logging
import os
import re
import stat

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import DynamicCache, PreTrainedTokenizerFast

import tiered_kv
from tiered_kv import ConfigError, load_config
from tiered_kv.blocks import WARM, KVLayout
from tiered_kv.compression import CALIBRATION_METHOD, CODEC_VERSION, auto
from tiered_kv.compression.calibration import Calibrator
from tiered_kv.compression.record import RECORD_NAME
from tiered_kv.logs import forget_logged_once
from tiered_kv.metrics import exposition
from tiered_kv.tools.diagnose_report import compression_text
from helpers import VOCAB, tier_config, tiny_model


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A real tokenizer of 256 byte-level ids (the tiny models' vocabulary): no merges, one id a byte."""
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    assert len(vocab) == VOCAB
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.fixture(autouse=True)
def fresh_process_state():
    """Each test starts as a new process would: nothing measured, nothing logged once yet."""
    auto.forget_measurements()
    forget_logged_once()
    yield
    auto.forget_measurements()


@pytest.fixture
def calibrations(monkeypatch):
    """The modes the calibrator measured, in order (each a forward pass over the text)."""
    measured = []
    real = Calibrator.measure

    def counting(self, mode):
        measured.append(mode)
        return real(self, mode)

    monkeypatch.setattr(Calibrator, "measure", counting)
    return measured


def warm_mode(report: dict) -> str:
    """The warm tier's mode in stats()["compression"] (one value when every tier has it)."""
    return report["mode"] if isinstance(report["mode"], str) else report["mode"]["warm"]


def auto_config(cold_dir, floor: float = 0.5, **tiers) -> dict:
    cfg = tier_config("forces_warm", cold_dir)
    cfg["warm"]["compression"] = tiers.get("warm", "auto")
    cfg["cold"].update(capacity_blocks=64, compression=tiers.get("cold", "none"))
    cfg["scheduler"] = {"background": False}
    cfg["compression"] = {"quality_floor": floor}
    return cfg


# ---- config ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("section, bad, key, allowed", [
    ({"compression": {"quality_floor": 0}}, None, "compression.quality_floor", "a number in (0, 1]"),
    ({"compression": {"quality_floor": 1.5}}, None, "compression.quality_floor", "a number in (0, 1]"),
    ({"compression": {"quality_floor": True}}, None, "compression.quality_floor", "a number in (0, 1]"),
    ({"compression": {"calibration_text": "poems"}}, None, "compression.calibration_text", "'mixed'"),
    ({"compression": {"calibration_tokens": 100}}, None, "compression.calibration_tokens", "from 256 to 8192"),
    ({"compression": {"check_explicit": "yes"}}, None, "compression.check_explicit", "true or false"),
    ({"warm": {"compression": "auto8"}}, None, "warm.compression", "'auto'"),
    ({"compression": {"floor": 0.9}}, None, "compression.floor", "'quality_floor'"),
])
def test_config_errors_name_the_key_and_what_is_allowed(section, bad, key, allowed):
    with pytest.raises(ConfigError, match=re.escape(f"'{key}'")) as info:
        load_config(section)
    assert allowed in str(info.value)


def test_auto_is_a_value_of_every_compressed_tier_and_round_trips():
    cfg = load_config({"warm": {"compression": "auto", "layout": "records"}, "cold": {"compression": "auto"},
                       "remote": {"compression": "auto"}, "compression": {"quality_floor": 0.95}})
    assert (cfg.warm.compression, cfg.cold.compression, cfg.remote.compression) == ("auto",) * 3
    assert cfg.compression.quality_floor == 0.95 and load_config(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match="'warm.layout' and 'warm.compression': got 'paged' with 'auto'"):
        load_config({"warm": {"compression": "auto", "layout": "paged"}})


def test_a_mode_the_model_cannot_hold_is_a_config_error_naming_the_tier(tmp_path):
    store = tiered_kv.TierStore({"hot": {"device": "cpu", "capacity_blocks": 4}, "warm": {"capacity_blocks": 0},
                                 "cold": {"capacity_blocks": 8, "path": str(tmp_path), "compression": "int4"}})
    try:
        with pytest.raises(ConfigError, match=r"'cold.compression': got 'int4'.*head_dim.*allowed for this model: "
                                              r"'none', 'fp8', 'int8', 'auto'"):
            store.bind(KVLayout(2, 2, 15, 4, "float32"), torch.float32)  # odd head_dim: no int4
        assert not store.is_bound and not store.is_closed
    finally:
        store.close()


# ---- resolution -----------------------------------------------------------------------------------
def test_auto_resolves_before_bind_and_every_auto_tier_uses_it(tmp_path, calibrations):
    model = tiny_model("llama")
    cfg = auto_config(tmp_path / "cold", floor=0.5, cold="auto")
    bank = tiered_kv.CacheBank(model, cfg, tokenizer=byte_tokenizer())
    try:
        report = bank.stats()["compression"]
        assert report["mode"] == {"warm": "int4", "cold": "int4", "remote": "none"}  # the smallest, at a low floor
        assert report["requested"] == {"warm": "auto", "cold": "auto", "remote": "none"}
        assert report["source"] == "calibrated" and report["quality_floor"] == 0.5 and calibrations == ["int4"]
        assert 0.5 <= report["measured"]["int4"] <= 1 and report["ppl_ratio"]["int4"] > 0
        assert bank.store.tiers[WARM].layout.compression == "int4" == bank.stats()["tiers"]["warm"]["compression"]
        assert bank.stats()["tiers"]["cold"]["compression"] == "int4"
        assert bank.store.config == load_config(cfg)  # the store's config is what was asked: banks may share it
        assert "tiered_kv_compression_agreement_ratio{mode=\"int4\"}" in exposition([bank.store])
        assert "warm int4 (asked auto)" in compression_text(report)
        ids = torch.randint(0, VOCAB, (1, 40))
        bank_out = model.generate(ids, cache=bank, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                                  do_sample=False)
        assert bank.stats()["bank_blocks"]["warm"] > 0 and bank_out.shape[1] == 44  # blocks went down, packed
    finally:
        bank.close()


def test_the_record_is_json_0600_and_a_restart_reuses_it_without_calibrating(tmp_path, calibrations):
    model, tokenizer = tiny_model("llama"), byte_tokenizer()
    cfg = auto_config(tmp_path / "cold", floor=0.9999)
    first = tiered_kv.CacheBank(model, cfg, tokenizer=tokenizer)
    modes = first.stats()["compression"]["mode"]  # one value when every tier has it
    chosen = modes if isinstance(modes, str) else modes["warm"]
    first.close()
    assert calibrations, "the first store calibrated"
    path = tmp_path / "cold" / RECORD_NAME
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    record = json.loads(path.read_text())
    (key, entry), = record["entries"].items()
    assert key.endswith(f"|codec=v{CODEC_VERSION}|method={CALIBRATION_METHOD}") and "|text=mixed|tokens=512|block_size=4|" in key
    assert entry["chosen"] == chosen and entry["floor"] == 0.9999 and set(entry["agreement"]) == set(calibrations)
    assert entry["seconds"] > 0 and entry["time"] > 0 and not list((tmp_path / "cold").glob(".*.tmp"))

    measured_before = list(calibrations)
    second = tiered_kv.CacheBank(model, cfg, tokenizer=tokenizer)  # another store, this process: memoized
    assert warm_mode(second.stats()["compression"]) == chosen and calibrations == measured_before
    second.close()
    auto.forget_measurements()  # as a new process: only the record knows
    third = tiered_kv.CacheBank(model, cfg)  # no tokenizer needed: nothing to measure
    try:
        report = third.stats()["compression"]
        assert calibrations == measured_before and report["source"] == "record"
        assert warm_mode(report) == chosen and report["measured"] == entry["agreement"]
        assert third.store.tiers[WARM].layout.compression == chosen
    finally:
        third.close()


@pytest.mark.parametrize("damage", [b"{not json", b'{"format": 1, "entries": {"k": {"agreement": {"int4": 1.5}, '
                                                  b'"ppl_ratio": {"int4": 1.0}}}}', b"\x80\x81"])
def test_a_corrupt_record_is_measured_again_with_a_warning(tmp_path, calibrations, caplog, damage):
    model, tokenizer = tiny_model("llama"), byte_tokenizer()
    cfg = auto_config(tmp_path / "cold")
    tiered_kv.CacheBank(model, cfg, tokenizer=tokenizer).close()
    path = tmp_path / "cold" / RECORD_NAME
    path.write_bytes(damage)
    auto.forget_measurements()
    del calibrations[:]
    with caplog.at_level(logging.WARNING, logger="tiered_kv"):
        bank = tiered_kv.CacheBank(model, cfg, tokenizer=tokenizer)
        bank.close()
        tiered_kv.CacheBank(model, cfg, tokenizer=tokenizer).close()  # memoized: no second warning
    warnings = [r.getMessage() for r in caplog.records if "is not trusted" in r.getMessage()]
    assert len(warnings) == 1 and RECORD_NAME in warnings[0]
    assert calibrations == ["int4"]  # measured again, not read from the bad file
    entries = json.loads(path.read_text())["entries"]  # and rewritten whole
    assert all(0 <= v <= 1 for e in entries.values() for v in e["agreement"].values())


def test_an_unwritable_record_warns_once_and_keeps_the_choice_in_memory(tmp_path, calibrations, caplog,
                                                                         monkeypatch):
    monkeypatch.setattr(auto.Record, "_replace", lambda self, data: "cannot create a file there (Read-only)")
    model, tokenizer = tiny_model("llama"), byte_tokenizer()
    cfg = auto_config(tmp_path / "cold")
    with caplog.at_level(logging.WARNING, logger="tiered_kv"):
        for _ in range(2):
            bank = tiered_kv.CacheBank(model, cfg, tokenizer=tokenizer)
            assert bank.stats()["compression"]["mode"]["warm"] == "int4"
            bank.close()
    warnings = [r.getMessage() for r in caplog.records if "cannot be written" in r.getMessage()]
    assert len(warnings) == 1 and "in this process only" in warnings[0]
    assert calibrations == ["int4"] and not (tmp_path / "cold" / RECORD_NAME).exists()


def test_auto_without_a_tokenizer_is_a_config_error_before_any_block(tmp_path):
    model = tiny_model("llama")
    cfg = auto_config(tmp_path / "cold")
    with pytest.raises(ConfigError, match=r"'warm.compression': got 'auto'.*pass tokenizer= to CacheBank"):
        tiered_kv.CacheBank(model, cfg)
    store = tiered_kv.TierStore(cfg)  # a shared store stays as it was: the next bank with a tokenizer binds it
    try:
        with pytest.raises(ConfigError, match="tokenizer="):
            tiered_kv.CacheBank(model, store=store)
        assert not store.is_bound and not store.is_closed and store.stats()["compression"]["mode"] is None
        with pytest.raises(ConfigError, match=r"'warm.compression': got 'auto'.*bound without one"):
            store.bind(KVLayout(2, 2, 16, 4, "float32"), torch.float32)  # nothing measured a model
        config_bank = tiered_kv.CacheBank(model.config, store=store)
        ids = torch.randint(0, VOCAB, (1, 12))
        with pytest.raises(ConfigError, match="got 'auto'"):
            model(input_ids=ids, cache=config_bank)  # bound at its first layer: refused, nothing written
        assert not store.is_bound and not list((tmp_path / "cold").glob("kv-*"))
        bank = tiered_kv.CacheBank(model, store=store, tokenizer=byte_tokenizer())
        assert store.is_bound and bank.stats()["compression"]["mode"]["warm"] == "int4"
        bank.close()
    finally:
        store.close()


# ---- explicit modes -------------------------------------------------------------------------------
def test_an_explicit_mode_below_the_floor_warns_once_with_the_figures(tmp_path, calibrations, caplog):
    model, tokenizer = tiny_model("llama"), byte_tokenizer()
    cfg = auto_config(tmp_path / "cold", floor=1.0, warm="int4")  # a random model's int4 misses a floor of 1
    with caplog.at_level(logging.INFO, logger="tiered_kv"):
        for _ in range(2):
            bank = tiered_kv.CacheBank(model, cfg, tokenizer=tokenizer)
            report = bank.stats()["compression"]
            bank.close()
    assert report["mode"]["warm"] == "int4" and report["source"] == "explicit" and calibrations == ["int4"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    agreement = report["measured"]["int4"]
    assert agreement < 1.0
    for figure in (f"{100 * agreement:.2f}%", "100.00%", f"{report['ppl_ratio']['int4']:.4f}", "'mixed'",
                   "'warm.compression' 'int4'", "compression: auto", "fp8"):
        assert figure in warnings[0], figure


def test_an_explicit_mode_without_a_tokenizer_is_not_measured_and_never_fails(tmp_path, calibrations, caplog):
    cfg = auto_config(tmp_path / "cold", floor=1.0, warm="int8")
    with caplog.at_level(logging.INFO, logger="tiered_kv"):
        bank = tiered_kv.CacheBank(tiny_model("llama"), cfg)
        report = bank.stats()["compression"]
        bank.close()
    assert calibrations == [] and report["measured"] == {} and report["mode"]["warm"] == "int8"
    infos = [r for r in caplog.records if "no tokenizer" in r.getMessage()]
    assert len(infos) == 1 and infos[0].levelno == logging.INFO
    cfg["compression"]["check_explicit"] = False
    bank = tiered_kv.CacheBank(tiny_model("llama"), cfg, tokenizer=byte_tokenizer())
    bank.close()
    assert calibrations == []  # not asked to check


# ---- an auto bank that chose none is the uncompressed cache --------------------------------------
def test_greedy_tokens_through_an_auto_bank_that_chose_none_equal_dynamic_cache(tmp_path, monkeypatch):
    def short_of_every_floor(self, mode):
        self.result.agreement[mode], self.result.ppl_ratio[mode] = 0.5, 1.5
        return 0.5

    monkeypatch.setattr(Calibrator, "measure", short_of_every_floor)
    model = tiny_model("llama")
    bank = tiered_kv.CacheBank(model, auto_config(tmp_path / "cold", floor=0.9), tokenizer=byte_tokenizer())
    try:
        report = bank.stats()["compression"]
        assert report["mode"] == "none" and set(report["measured"]) == {"int4", "fp8", "int8"}  # one value: all agree
        assert bank.store.tiers[WARM].layout.compression == "none"
        ids = torch.randint(0, VOCAB, (1, 30))
        kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
        expected = model.generate(ids, cache=DynamicCache(config=model.config), **kwargs)
        got = model.generate(ids, cache=bank, **kwargs)
        assert bank.stats()["bank_blocks"]["warm"] > 0  # the history really went down
        assert torch.equal(got, expected)
    finally:
        bank.close()
