"""The server's batched engine (issue 35): every decoding conversation in one forward pass, prompts
in chunks between them, and a failure that stays in its row. Driven over real HTTP by the openai
client; what the model computed is seen by a forward pre-hook on the real model."""

from __future__ import annotations

import threading

import openai
import pytest
import torch

import tiered_kv
from tiered_kv.errors import CapacityError
from tiered_kv.models import load_model
from tiered_kv.serve import decoding
from tiered_kv.serve import engine as engine_module
from tiered_kv.serve.background import BackgroundServer
from tiered_kv.serve.engine import ChatEngine

MODEL = "SmolLM2-135M-Instruct"
NEW_TOKENS = 12
FAULT = "Fault here please."


def config(cold_dir, capacity: str = "64MiB") -> dict:
    return {"block_size": 16, "hot": {"device": "cpu", "capacity": capacity}, "warm": {"capacity": capacity},
            "cold": {"capacity": capacity, "path": str(cold_dir)}}


@pytest.fixture(scope="module")
def smollm2():
    torch.set_num_threads(2)
    return load_model(None, progress=False)


class Forwards:
    """Every forward of the model while installed: the tokens each of its rows (conversations) adds."""

    def __init__(self, model):
        self.rows: list[list[int]] = []
        self._handle = model.register_forward_pre_hook(self._seen, with_kwargs=True)

    def _seen(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        packed = getattr(kwargs.get("cache"), "tokens_per_row", None)
        self.rows.append(list(packed) if packed is not None else [ids.shape[1]] * ids.shape[0])

    def decode_rows(self) -> list[int]:
        """Per forward, how many conversations it gave a next token (rows of one token)."""
        return [sum(n == 1 for n in rows) for rows in self.rows]

    def remove(self):
        self._handle.remove()


def serve(smollm2, tmp_path, **engine_kwargs) -> BackgroundServer:
    model, tokenizer = smollm2
    capacity = engine_kwargs.pop("capacity", "64MiB")
    return BackgroundServer(ChatEngine(model, tokenizer, config(tmp_path / "cold", capacity), MODEL, **engine_kwargs))


def ask(server, content: str, **kwargs):
    client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=300)
    kwargs = {"max_tokens": NEW_TOKENS, "temperature": 0, **kwargs}
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kwargs)


def together(server, contents: list[str]) -> list:
    """Every request sent at once; each one's reply text, or the exception it raised."""
    results = [None] * len(contents)

    def one(i):
        try:
            results[i] = ask(server, contents[i]).choices[0].message.content
        except Exception as error:  # noqa: BLE001 - the test looks at it
            results[i] = error

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(contents))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def alone(smollm2, contents: list[str], tmp_path) -> list[str]:
    """Each conversation's reply from a per-request engine, one request at a time."""
    with serve(smollm2, tmp_path / "alone", batch=False) as server:
        return [ask(server, c).choices[0].message.content for c in contents]


CONTENTS = [f"Count from {i} to {i + 6}, one number a line." for i in range(3)] + ["Name four rivers of Europe."]


def test_decoding_conversations_share_one_forward_pass_and_answer_as_alone(smollm2, tmp_path):
    expected = alone(smollm2, CONTENTS, tmp_path)
    forwards = Forwards(smollm2[0])
    try:
        with serve(smollm2, tmp_path / "batched") as server:
            got = together(server, CONTENTS)
            assert server.engine.store.state.leases == {}
    finally:
        forwards.remove()
    assert got == expected
    assert max(forwards.decode_rows()) >= 3, forwards.rows  # conversations decoded together
    assert len(forwards.rows) < len(CONTENTS) * NEW_TOKENS  # fewer passes than one a token


def test_a_long_prompt_is_computed_in_chunks_between_the_others_decode_steps(smollm2, tmp_path):
    long_prompt = "Summarise this list: " + ", ".join(f"item {i}" for i in range(60))
    forwards = Forwards(smollm2[0])
    try:
        with serve(smollm2, tmp_path / "chunks", prefill_chunk=32) as server:
            prompt_tokens = len(server.engine.prompt_ids(ask_body(long_prompt)))
            got = together(server, CONTENTS[:2] + [long_prompt])
    finally:
        forwards.remove()
    assert all(isinstance(g, str) and g for g in got), got
    assert prompt_tokens > 3 * 32
    prompt_rows = [[n for n in rows if n > 1] for rows in forwards.rows]
    assert max(sum(r) for r in prompt_rows) <= 32  # no pass computed more than a chunk of prompts
    chunks = [i for i, r in enumerate(prompt_rows) if r]
    assert len(chunks) >= 3, forwards.rows  # the long prompt took several passes
    # the other conversations' decode steps went on in the passes that carried the long prompt's chunks
    assert any(forwards.decode_rows()[i] >= 1 for i in chunks), forwards.rows


def ask_body(content: str):
    import json

    from tiered_kv.serve.protocol import parse_chat_request
    return parse_chat_request(json.dumps({"model": MODEL, "messages": [{"role": "user", "content": content}]}).encode(),
                              MODEL)


class FaultySequence(decoding.Sequence):
    """A sequence whose bank fails at its `FAULT_AFTER`-th decode step (and, `FAULT_TIMES`, after):
    a fault injected in one row of a batched step."""

    error: Exception = CapacityError("injected: no room for this row")
    fault_after, fault_times = 3, 10 ** 6

    def start(self) -> int:
        cached = super().start()
        if FAULT in self.tokenizer.decode(self.prompt_ids):
            bank, real_update, seen = self.bank, self.bank.update, {"decode": 0, "raised": 0}

            def update(key_states, value_states, layer_idx, *args, **kwargs):
                if layer_idx == 0 and key_states.shape[2] == 1:
                    seen["decode"] += 1
                    if seen["decode"] >= self.fault_after and seen["raised"] < self.fault_times:
                        seen["raised"] += 1
                        raise self.error
                return real_update(key_states, value_states, layer_idx, *args, **kwargs)

            bank.update = update
        return cached


@pytest.mark.parametrize("error, times, outcome", [
    (CapacityError("injected: no room for this row"), 10 ** 6, "400"),  # alone too: its error
    (CapacityError("injected: no room for this row"), 1, "answer"),  # retried alone, it fits
    (tiered_kv.CorruptBlockError("injected: a block failed its checksum"), 1, "answer"),  # recomputed
    (RuntimeError("injected: the row's forward broke"), 10 ** 6, "500"),  # not a row error: rows run alone
])
def test_a_failure_in_one_row_of_a_four_row_step_stays_in_its_row(smollm2, tmp_path, monkeypatch, error, times,
                                                                    outcome):
    contents = CONTENTS[:3] + [FAULT + " Count to five."]
    expected = alone(smollm2, contents, tmp_path)
    monkeypatch.setattr(FaultySequence, "error", error)
    monkeypatch.setattr(FaultySequence, "fault_times", times)
    monkeypatch.setattr(engine_module, "Sequence", FaultySequence)
    forwards = Forwards(smollm2[0])
    try:
        with serve(smollm2, tmp_path / "faulty") as server:
            got = together(server, contents)
            store = server.engine.store
            assert store.state.leases == {} and store.check_consistency() == []
            assert server.engine.active == 0
    finally:
        forwards.remove()
    assert got[:3] == expected[:3]  # the other rows' tokens are unaffected
    assert max(forwards.decode_rows()) == 4  # the fault hit a 4-row step
    if outcome == "answer":
        assert got[3] == expected[3]
    elif outcome == "400":
        assert isinstance(got[3], openai.BadRequestError) and "injected: no room" in str(got[3])
    else:
        assert isinstance(got[3], openai.InternalServerError) and "injected" in str(got[3])


def test_a_request_larger_than_every_tier_gets_400_and_the_others_are_untouched(smollm2, tmp_path):
    big = "Repeat after me: " + " ".join(f"word{i}" for i in range(400))
    with serve(smollm2, tmp_path / "small", capacity="4MiB", prefill_chunk=64) as server:
        got = together(server, CONTENTS[:2] + [big])
        store = server.engine.store
        assert store.state.leases == {} and store.check_consistency() == []
    assert isinstance(got[2], openai.BadRequestError), got[2]
    assert "does not fit the KV tiers" in str(got[2]) and got[2].code == "context_length_exceeded"
    assert all(isinstance(g, str) and g for g in got[:2]), got


def test_engine_options_are_checked():
    with pytest.raises(ValueError, match="prefill_chunk=0"):
        ChatEngine(None, None, None, MODEL, prefill_chunk=0)


def test_a_ticks_prompt_budget_costs_about_one_decode_pass_while_others_decode():
    from tiered_kv.serve.ticks import MIN_PROMPT_TOKENS, PassTimes
    times = PassTimes(weight=1.0)
    assert times.prompt_budget(256, decoding=True) == 256  # nothing measured yet
    times.note(0.1, prompt_tokens=0, decode_rows=8)  # a decode pass: 100 ms
    times.note(0.1 + 64 * 0.004, prompt_tokens=64, decode_rows=8)  # + 4 ms a prompt token
    assert times.prompt_budget(256, decoding=True) == 25  # 100 ms of prompt tokens
    assert times.prompt_budget(256, decoding=False) == 256  # nobody waits: a whole chunk
    assert times.prompt_budget(16, decoding=True) == 16
    times.note(0.01, prompt_tokens=0, decode_rows=1)
    assert times.prompt_budget(256, decoding=True) == MIN_PROMPT_TOKENS  # prompts always progress
