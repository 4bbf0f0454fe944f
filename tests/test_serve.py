"""`tiered-kv serve` (issue 20) driven over HTTP on localhost by the real `openai` client: replies
equal a local CacheBank run over the same chat template, later turns reuse the earlier ones' KV
(`cached_tokens`), streaming, concurrency, a full queue, a client that goes away, and the errors."""

from __future__ import annotations

import os
import socket
import threading
import time

import httpx
import openai
import pytest
import torch

import tiered_kv
from tiered_kv.models import load_model
from tiered_kv.serve.background import BackgroundServer
from tiered_kv.serve.engine import ChatEngine

MODEL = "SmolLM2-135M-Instruct"
NEW_TOKENS = 8


def server_config(cold_dir) -> dict:
    return {"block_size": 16, "hot": {"device": "cpu", "capacity": "64MiB"}, "warm": {"capacity": "64MiB"},
            "cold": {"capacity": "64MiB", "path": str(cold_dir)}}


class Server(BackgroundServer):
    """The real uvicorn server on a free localhost port, in a thread, with the openai client."""

    def client(self, api_key: str = "none") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key=api_key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def smollm2():
    torch.set_num_threads(2)
    return load_model(None, progress=False)


@pytest.fixture(scope="module")
def server(smollm2, tmp_path_factory):
    model, tokenizer = smollm2
    running = Server(ChatEngine(model, tokenizer, server_config(tmp_path_factory.mktemp("cold")), MODEL))
    yield running
    running.stop()


def local_reply(smollm2, messages: list[dict], store) -> str:
    """What a local greedy generate(cache=bank) over the same chat template answers."""
    model, tokenizer = smollm2
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    bank = tiered_kv.CacheBank(model, store=store)
    try:
        bank.attach(ids)
        with torch.no_grad():
            out = model.generate(ids, cache=bank, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                 do_sample=False)
    finally:
        bank.close()
    new = [t for t in out[0, ids.shape[1]:].tolist() if t != model.generation_config.eos_token_id]
    return tokenizer.decode(new, skip_special_tokens=True)


def ask(client, messages, **kwargs):
    kwargs = {"max_tokens": NEW_TOKENS, "temperature": 0, **kwargs}
    return client.chat.completions.create(model=MODEL, messages=messages, **kwargs)


def test_a_multi_turn_chat_equals_a_local_run_and_later_turns_reuse_the_history(server, smollm2, tmp_path):
    client = server.client()
    local = tiered_kv.TierStore(server_config(tmp_path / "local"))
    try:
        messages = [{"role": "user", "content": "Name three colours."}]
        for turn, follow_up in enumerate(["And three animals?", "And three fruits?"]):
            reply = ask(client, messages)
            assert reply.choices[0].message.content == local_reply(smollm2, messages, local)
            usage = reply.usage
            assert usage.prompt_tokens > 0 and usage.completion_tokens == NEW_TOKENS
            assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
            if turn:  # everything before this turn's new message was served from the tiers
                assert usage.prompt_tokens_details.cached_tokens >= 0.5 * usage.prompt_tokens, usage
            messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                         {"role": "user", "content": follow_up}]
    finally:
        local.close()


def test_streaming_sends_the_same_reply_in_openai_chunks(server):
    client = server.client()
    messages = [{"role": "user", "content": "Say something about the sea."}]
    whole = ask(client, messages).choices[0].message.content
    chunks = list(ask(client, messages, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens_details.cached_tokens > 0
    with httpx.stream("POST", server.url + "/v1/chat/completions",
                      json={"model": MODEL, "messages": messages, "max_tokens": 2, "stream": True}) as raw:
        lines = [line for line in raw.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)


def test_concurrent_conversations_all_answer_as_they_would_alone(server):
    client = server.client()
    conversations = [[{"role": "user", "content": f"Count from {i} to {i + 5}."}] for i in range(4)]
    alone = [ask(client, m).choices[0].message.content for m in conversations]
    results = [None] * len(conversations)

    def one(i):
        results[i] = ask(client, conversations[i]).choices[0].message.content

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(conversations))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == alone


def test_a_client_that_goes_away_mid_stream_stops_its_generation(server):
    engine = server.engine
    with httpx.stream("POST", server.url + "/v1/chat/completions",
                      json={"model": MODEL, "messages": [{"role": "user", "content": "Write a long story."}],
                            "max_tokens": 400, "temperature": 0, "stream": True}) as raw:
        for i, _ in enumerate(raw.iter_lines()):
            if i >= 3:
                break  # leave with most of the reply not generated
    deadline = time.monotonic() + 30
    while engine.active:
        assert time.monotonic() < deadline, "the generation went on after its client left"
        time.sleep(0.05)
    assert engine.store.state.leases == {} and engine.store.check_consistency() == []


def test_a_client_that_goes_away_while_it_waits_for_a_whole_reply_stops_its_generation(server):
    engine = server.engine
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/chat/completions", timeout=1.5,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "Write a long story."}],
                         "max_tokens": 400, "temperature": 0})
    deadline = time.monotonic() + 30
    while engine.active:
        assert time.monotonic() < deadline, "the generation went on after its client left"
        time.sleep(0.05)
    assert engine.store.state.leases == {} and engine.store.check_consistency() == []


def test_a_short_request_is_answered_while_a_long_reply_is_still_generated(server):
    """Requests are interleaved a forward pass at a time: a new one does not wait for others to finish."""
    long_tokens, long_done, leave = [], threading.Event(), threading.Event()

    def long_reply():
        with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=120,
                          json={"model": MODEL, "messages": [{"role": "user", "content": "Write a long story."}],
                                "max_tokens": 300, "temperature": 0, "stream": True}) as raw:
            for line in raw.iter_lines():
                long_tokens.append(line)
                if leave.is_set():
                    return
        long_done.set()

    thread = threading.Thread(target=long_reply)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while len(long_tokens) < 3:
            assert time.monotonic() < deadline and thread.is_alive(), "the long reply never started"
            time.sleep(0.02)
        short = ask(server.client(), [{"role": "user", "content": "Hi!"}], max_tokens=2)
        assert short.usage.completion_tokens >= 1
        assert not long_done.is_set(), "the short request waited for the long reply to end"
    finally:
        leave.set()
        thread.join(timeout=120)


def test_stop_strings_end_the_reply_before_them(server):
    client = server.client()
    messages = [{"role": "user", "content": "Describe a forest in one sentence."}]
    whole = ask(client, messages).choices[0].message.content
    stop = whole[len(whole) // 2:len(whole) // 2 + 3]
    assert len(stop) == 3
    stopped = ask(client, messages, stop=[stop])
    assert stopped.choices[0].message.content == whole[:whole.find(stop)]
    assert stopped.choices[0].finish_reason == "stop"


def test_seeded_sampling_repeats_and_concurrent_requests_do_not_share_a_generator(server):
    client = server.client()
    messages = [{"role": "user", "content": "Invent a name for a cat."}]
    alone = ask(client, messages, temperature=1.0, seed=7).choices[0].message.content
    assert ask(client, messages, temperature=1.0, seed=7).choices[0].message.content == alone
    results = [None] * 4

    def one(i):  # two with seed 7 amid two others drawing at the same time
        results[i] = ask(client, messages, temperature=1.0, seed=7 if i % 2 == 0 else 100 + i).choices[0].message.content

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(results))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results[0] == results[2] == alone


def test_a_tiny_top_p_keeps_only_the_most_likely_token(server):
    client = server.client()
    messages = [{"role": "user", "content": "Name a colour."}]
    greedy = ask(client, messages).choices[0].message.content
    assert ask(client, messages, temperature=1.5, top_p=1e-6, seed=3).choices[0].message.content == greedy


def test_pick_token():
    from tiered_kv.serve.decoding import pick_token
    logits = torch.tensor([0.0, 3.0, 2.9, -1.0])
    assert pick_token(logits, 0.0, 1.0, None) == 1
    draws = {pick_token(logits, 1.0, 1.0, torch.Generator().manual_seed(s)) for s in range(64)}
    assert draws >= {1, 2} and draws <= {0, 1, 2, 3}
    assert {pick_token(logits, 5.0, 0.3, torch.Generator().manual_seed(s)) for s in range(64)} == {1}
    first = [pick_token(logits, 1.0, 0.9, torch.Generator().manual_seed(11)) for _ in range(3)]
    assert len(set(first)) == 1


def _blocks(store) -> dict | None:
    """Which blocks the store holds, what each is, and who references it (not where: the mover
    may move blocks between tiers at any time)."""
    if not store.is_bound:
        return None
    store.wait_for_background()
    with store.lock:
        return {b: (e.key, e.ref_count) for b, e in store.index.items()}


@pytest.mark.parametrize("body, status, param, code", [
    (b"{not json", 400, None, "invalid_json"),
    ({"model": MODEL}, 400, "messages", "missing_required_parameter"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "frobnicate": 1}, 400, "frobnicate",
     "unknown_parameter"),
    ({"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}, 404, "model", "model_not_found"),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role", "invalid_value"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 7}, 400, "temperature",
     "invalid_value"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "max_tokens",
     "invalid_value"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "word " * 9000}]}, 400, "messages",
     "context_length_exceeded"),
])
def test_bad_requests_get_an_openai_error_and_change_nothing(server, body, status, param, code):
    before = _blocks(server.engine.store)
    kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body}
    response = httpx.post(server.url + "/v1/chat/completions", timeout=60, **kwargs)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert (error["param"], error["code"]) == (param, code)
    assert _blocks(server.engine.store) == before
    assert server.engine.store.state.leases == {}


def test_the_openai_client_sees_its_errors_typed(server):
    with pytest.raises(openai.NotFoundError):
        server.client().chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError):
        server.client().chat.completions.create(model=MODEL, messages=[])


def test_models_health_and_metrics(server):
    assert [m.id for m in server.client().models.list()] == [MODEL]
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and health["model"] == MODEL
    metrics = httpx.get(server.url + "/metrics").text
    assert "tiered_kv_tokens_reused_total" in metrics or "tokens_reused_total" in metrics


def test_a_full_queue_answers_429_with_retry_after(smollm2, tmp_path):
    model, tokenizer = smollm2
    busy = Server(ChatEngine(model, tokenizer, server_config(tmp_path / "cold"), MODEL, max_active=1, max_queue=1))
    statuses, retry_after = [], []

    def one():
        response = httpx.post(busy.url + "/v1/chat/completions", timeout=120,
                              json={"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story."}],
                                    "max_tokens": 24, "temperature": 0})
        statuses.append(response.status_code)
        if response.status_code == 429:
            retry_after.append(response.headers.get("retry-after"))
            assert response.json()["error"]["type"] == "rate_limit_error"

    try:
        threads = [threading.Thread(target=one) for _ in range(5)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        busy.stop()
    assert 429 in statuses and 200 in statuses and set(statuses) <= {200, 429}
    assert all(r == "1" for r in retry_after)


def test_an_api_key_is_required_when_configured(smollm2, tmp_path, monkeypatch):
    from tiered_kv.serve import api_key_from_env
    model, tokenizer = smollm2
    monkeypatch.setenv("TKV_TEST_KEY", "s3cret")
    keyed = Server(ChatEngine(model, tokenizer, server_config(tmp_path / "cold"), MODEL),
                   api_key=api_key_from_env("TKV_TEST_KEY"))
    try:
        with pytest.raises(openai.AuthenticationError):
            keyed.client("wrong").models.list()
        assert [m.id for m in keyed.client("s3cret").models.list()] == [MODEL]
    finally:
        keyed.stop()
    with pytest.raises(ValueError, match="TKV_UNSET"):
        api_key_from_env("TKV_UNSET")
    assert os.environ.get("TKV_UNSET") is None


def test_the_serve_command_starts_answers_and_stops(tmp_path):
    """`tiered-kv serve` as a user starts it: a process on a free port, answering the openai client."""
    import signal
    import subprocess
    import sys

    import yaml
    config_path = tmp_path / "serve.yaml"
    config_path.write_text(yaml.safe_dump(server_config(tmp_path / "cold")))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    bad = subprocess.run([sys.executable, "-m", "tiered_kv.cli", "serve", "--api-key-env", "TKV_UNSET_KEY"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == 2 and "TKV_UNSET_KEY" in bad.stderr
    proc = subprocess.Popen([sys.executable, "-m", "tiered_kv.cli", "serve", "--config", str(config_path),
                             "--port", str(port), "--no-progress"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stderr.read()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server never answered /health"
            time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
        reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello!"}],
                                               max_tokens=4, temperature=0)
        assert reply.choices[0].message.content and reply.usage.completion_tokens >= 1
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, proc.stderr.read()[-2000:]
