"""The scripted multi-turn chat: the project's main job, as a library function.

The conversation is kept as token ids, never as text. Each turn's prompt is the previous
`generate()` output exactly as returned (prompt + reply), plus the tokens that close the
reply and open the next user message and the assistant header. Earlier text is never
re-tokenized, so every earlier token keeps its id and position and `bank.attach(ids)` can
reuse all of its KV; only the new user message is computed.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TextIO

import torch
from transformers.generation.streamers import BaseStreamer

from . import hooks
from .bank import CacheBank
from .config import Config
from .scheduler import TIER_NAMES
from .store import TierStore
from .trace import TraceRecorder

# Questions that ask for long answers, so that 8 turns of up to 240 new tokens pass 2,000 tokens.
DEFAULT_USER_MESSAGES = (
    "Explain in detail how a CPU executes an instruction, step by step, from fetch to write-back.",
    "Now explain, in detail, how CPU caches work and why they make programs faster.",
    "Describe in detail how virtual memory and paging work in a modern operating system.",
    "Explain in detail what happens when you type a web address into a browser and press enter.",
    "Describe in detail how a hash table works, including collisions and resizing.",
    "Explain in detail how public-key cryptography works and where it is used every day.",
    "Explain in detail how a neural network learns with gradient descent and backpropagation.",
    "Describe in detail how a transformer language model generates text one token at a time.",
    "Explain in detail how a database index speeds up queries and what it costs.",
    "Describe in detail how a garbage collector finds and frees unused memory.",
    "Explain in detail how TCP makes delivery reliable over an unreliable network.",
    "Summarize, in detail, the most important ideas from everything we discussed so far.",
)
DEFAULT_NUM_TURNS = 8
DEFAULT_MAX_NEW_TOKENS = 240


class _CurrentStdout:
    """Writes to whatever `sys.stdout` is at call time (so pytest's capture sees it)."""

    def write(self, text: str) -> int:
        return sys.stdout.write(text)

    def flush(self) -> None:
        sys.stdout.flush()


STDOUT = _CurrentStdout()


class TurnTimer(BaseStreamer):
    """Times one `generate()` call: its first `put()` is the prompt, the second the first new token."""

    def __init__(self) -> None:
        self.num_puts = 0
        self.first_token_time: float | None = None
        self.end_time: float | None = None

    def put(self, value) -> None:
        self.num_puts += 1
        if self.num_puts == 2:
            self.first_token_time = time.perf_counter()

    def end(self) -> None:
        self.end_time = time.perf_counter()


# ---- turn tokens ----------------------------------------------------------------------------
def _render(tokenizer, messages: list[dict], *, add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def first_turn_ids(tokenizer, message: str) -> list[int]:
    """The whole first prompt: the template's default system prompt (if any), the message, the assistant header."""
    return _encode(tokenizer, _render(tokenizer, [{"role": "user", "content": message}], add_generation_prompt=True))


def next_turn_ids(tokenizer, message: str) -> list[int]:
    """Tokens of one more user message plus the assistant header, as the template renders them mid-chat.

    Rendered after a stand-in system message and cut off behind it, so templates that insert
    a default system prompt before the first message (SmolLM2's does) do not add a second one.
    """
    head = [{"role": "system", "content": "S"}]
    before = _render(tokenizer, head, add_generation_prompt=False)
    after = _render(tokenizer, head + [{"role": "user", "content": message}], add_generation_prompt=True)
    if not after.startswith(before):
        raise ValueError("the chat template does not render a conversation as a growing prefix; cannot extend by tokens")
    return _encode(tokenizer, after[len(before):])


def reply_closing_ids(tokenizer, reply_ids: list[int], stop_ids: set[int]) -> list[int]:
    """Tokens the template puts after an assistant reply (ChatML: `<|im_end|>\\n`).

    When generation stopped on a stop token that the closing text starts with, only the
    rest is added; a reply cut off by max_new_tokens gets the whole closing text.
    """
    marker = "\x00REPLY\x00"
    text = _render(
        tokenizer,
        [{"role": "user", "content": "U"}, {"role": "assistant", "content": marker}],
        add_generation_prompt=False,
    )
    closing = text[text.index(marker) + len(marker):]
    if reply_ids and reply_ids[-1] in stop_ids:
        stop_text = tokenizer.decode([reply_ids[-1]])
        if closing.startswith(stop_text):
            closing = closing[len(stop_text):]
    return _encode(tokenizer, closing) if closing else []


def _stop_ids(model, tokenizer) -> set[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}


# ---- the chat -------------------------------------------------------------------------------
def auto_hooks_mode(device) -> str:
    """merge on a CPU store: once a chat spills to warm it reads every run of blocks in place
    (the main job's turns 6-8 decode as fast as with everything hot), where exact copies the
    whole history per layer and step; exact on a GPU, where merge's paged kernel is not yet
    measured against it (bench/gpu_check.py)."""
    return "merge" if torch.device(device).type == "cpu" else "exact"


def run_chat(
    model,
    tokenizer,
    cfg: Config,
    user_messages,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    out: TextIO | None = STDOUT,
    *,
    store: TierStore | None = None,
    hooks_mode: str | None = "exact",
    trace: str | os.PathLike | TraceRecorder | None = None,
) -> list[dict]:
    """Chat through a CacheBank, one user message per turn, greedy decoding; return per-turn records.

    Prints each reply and a stats line to `out` (None: print nothing) and a summary at the end.
    Each record: turn, user, reply, prompt_tokens, reused_tokens, computed_tokens, new_tokens,
    seq_tokens, attach_s, ttft_s (turn start, attach included, to first new token),
    decode_tokens_per_s (tokens after the first / time after the first), turn_s, stats (bank.stats()).
    `hooks_mode` "exact" / "fast" / "merge" puts the bank under the model's attention
    (tiered_kv.hooks) for the chat and takes it out after ("auto": see auto_hooks_mode); None
    runs the bank as a plain transformers Cache.
    `trace` (a file path, or a TraceRecorder the caller closes) records every forward pass and
    turn as JSON lines (tiered_kv/trace/recorder.py); `tiered-kv plot` draws them.
    """
    user_messages = list(user_messages)
    if not user_messages:
        raise ValueError("run_chat: user_messages is empty; give at least one message")
    if max_new_tokens < 1:
        raise ValueError(f"run_chat: max_new_tokens={max_new_tokens}; allowed: >= 1")

    def write(text: str) -> None:
        if out is not None:
            out.write(text + "\n")
            out.flush()

    device = next(model.parameters()).device
    stop_ids = _stop_ids(model, tokenizer)
    max_positions = getattr(model.config, "max_position_embeddings", None)

    bank = CacheBank(model, cfg, store=store, tokenizer=tokenizer)
    recorder = trace if isinstance(trace, TraceRecorder) else None
    if hooks_mode == "auto":
        hooks_mode = auto_hooks_mode(bank.store.device)
    if hooks_mode is not None:
        hooks.install(model, bank, mode=hooks_mode)
    records: list[dict] = []
    conversation: list[int] = []
    try:
        if trace is not None:
            recorder = recorder or TraceRecorder(trace)
            recorder.start(bank, model_name=_model_name(model))
        for turn, message in enumerate(user_messages, start=1):
            if turn == 1:
                prompt = first_turn_ids(tokenizer, message)
            else:
                prompt = conversation + reply_closing_ids(tokenizer, conversation, stop_ids)
                prompt += next_turn_ids(tokenizer, message)
            if max_positions and len(prompt) + max_new_tokens > max_positions:
                write(f"[stopping before turn {turn}: {len(prompt)} + {max_new_tokens} tokens would pass "
                      f"the model's {max_positions} positions]")
                break
            write(f"\n--- turn {turn}/{len(user_messages)} ---\nuser: {message}")
            if recorder is not None:
                recorder.begin_turn(turn)
            record = _run_turn(model, tokenizer, bank, prompt, max_new_tokens, device)
            record.update(turn=turn, user=message)
            conversation = record.pop("output_ids")
            records.append(record)
            if recorder is not None:
                recorder.end_turn(record)
            write(f"assistant: {record['reply']}")
            write(_turn_line(record))
        if records:
            write(_summary(records))
    finally:
        if hooks_mode is not None:
            hooks.uninstall(model)
        try:
            if recorder is not None and recorder is not trace:  # ours: its end line reads the live store
                recorder.close()
        finally:
            bank.close()
    return records


def _model_name(model) -> str | None:
    return getattr(model.config, "name_or_path", None) or getattr(model, "name_or_path", None) or None


def _run_turn(model, tokenizer, bank: CacheBank, prompt: list[int], max_new_tokens: int, device) -> dict:
    ids = torch.tensor([prompt], dtype=torch.long, device=device)
    timer = TurnTimer()
    start = time.perf_counter()
    reused = bank.attach(ids)
    attach_s = time.perf_counter() - start
    output = model.generate(
        ids,
        cache=bank,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        streamer=timer,
    )
    end = time.perf_counter()
    output_ids = [int(t) for t in output[0].tolist()]
    new_ids = output_ids[len(prompt):]
    first = timer.first_token_time if timer.first_token_time is not None else end
    decode_s = (timer.end_time or end) - first
    return {
        "prompt_tokens": len(prompt),
        "reused_tokens": reused,
        "computed_tokens": len(prompt) - reused,
        "new_tokens": len(new_ids),
        "seq_tokens": len(output_ids),
        "attach_s": attach_s,
        "ttft_s": first - start,
        "decode_tokens_per_s": (len(new_ids) - 1) / decode_s if len(new_ids) > 1 and decode_s > 0 else 0.0,
        "turn_s": end - start,
        "reply": tokenizer.decode(new_ids, skip_special_tokens=True).strip(),
        "stats": bank.stats(),
        "output_ids": output_ids,
    }


# ---- reporting ------------------------------------------------------------------------------
def _mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:.1f} MiB"


def _tiers_text(stats: dict) -> str:
    parts = []
    for name in TIER_NAMES:
        tier = stats["tiers"][name]
        parts.append(
            f"{name} {tier['used_blocks']}/{tier['capacity_blocks']} blocks "
            f"({_mib(tier['used_bytes'])}/{_mib(tier['capacity_bytes'])})"
        )
    return ", ".join(parts)


def _turn_line(record: dict) -> str:
    return (
        f"[turn {record['turn']}] prompt {record['prompt_tokens']} tokens: computed {record['computed_tokens']}, "
        f"reused {record['reused_tokens']} | TTFT {record['ttft_s']:.2f} s | "
        f"decode {record['decode_tokens_per_s']:.1f} tok/s ({record['new_tokens']} new) | "
        f"{_tiers_text(record['stats'])}"
    )


def _summary(records: list[dict]) -> str:
    last = records[-1]["stats"]
    prompt_tokens = sum(r["prompt_tokens"] for r in records)
    reused = sum(r["reused_tokens"] for r in records)
    computed = sum(r["computed_tokens"] for r in records)
    later = records[1:] or records
    decode_rates = [r["decode_tokens_per_s"] for r in records if r["new_tokens"] > 1]
    moved = ", ".join(f"{k} {_mib(v)}" for k, v in last["bytes_moved"].items() if v) or "none"
    hits = ", ".join(f"{k} {v}" for k, v in last["hits"].items())
    return "\n".join([
        f"\n=== summary: {len(records)} turns, conversation {records[-1]['seq_tokens']} tokens ===",
        f"prompt tokens: {prompt_tokens} in all, computed {computed}, reused {reused} "
        f"({100 * reused / max(prompt_tokens, 1):.0f}%)",
        f"TTFT: turn 1 {records[0]['ttft_s']:.2f} s, later turns mean "
        f"{sum(r['ttft_s'] for r in later) / len(later):.2f} s",
        f"decode: mean {sum(decode_rates) / max(len(decode_rates), 1):.1f} tok/s "
        f"(attention: {'tiered_kv.hooks ' + last['hooks']['mode'] if last['hooks']['mode'] else 'sdpa over gathered K/V'})",
        f"block hits: {hits}; misses {last['misses']}",
        f"bytes moved: {moved}",
        f"tiers at end: {_tiers_text(last)}; block size {last['block_size']['tokens']} tokens"
        f"{' (auto)' if last['block_size']['auto'] else ''}",
    ])
