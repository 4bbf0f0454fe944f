"""The OpenAI-compatible server, driven by the official `openai` client.

    python examples/serve_openai.py

It starts `tiered-kv serve`'s app in a thread of this process on a free localhost port (from a shell:
`tiered-kv serve`, then point any OpenAI client at http://127.0.0.1:8000/v1). Clients send the whole
conversation each time; the server reuses the stored prefix: `cached_tokens` counts it.
Needs the serve extra and the client: pip install -e '.[serve]' openai
(BackgroundServer and ChatEngine are what `tiered-kv serve` itself runs; tests and benchmarks use them
the same way, but they are not part of the stable API: a script of your own should start the server
with the command.)
"""
import tempfile

from openai import OpenAI

import tiered_kv
from tiered_kv.models import load_model
from tiered_kv.serve.background import BackgroundServer
from tiered_kv.serve.engine import ChatEngine

model, tokenizer = load_model()
with tempfile.TemporaryDirectory() as cold_dir:
    config = tiered_kv.load_config({"hot": {"capacity_blocks": 16}, "warm": {"capacity": "64MiB"},
                                    "cold": {"path": cold_dir, "capacity": "128MiB"}})
    with BackgroundServer(ChatEngine(model, tokenizer, config, "SmolLM2-135M-Instruct")) as server:
        client = OpenAI(base_url=server.base_url, api_key="none")
        messages = [{"role": "user", "content": "Explain how a CPU cache works, briefly."}]
        for question in ["And virtual memory?", None]:
            reply = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages,
                                                   max_tokens=24, temperature=0)
            text = reply.choices[0].message.content
            cached = reply.usage.prompt_tokens_details.cached_tokens
            print(f"{reply.usage.prompt_tokens} prompt tokens, {cached} served from the tiers: {text!r}")
            if question is None:
                break
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": question}]
        if not cached:
            raise SystemExit("the second request did not reuse the first one's KV")
        stream = client.chat.completions.create(model="SmolLM2-135M-Instruct", stream=True, max_tokens=12,
                                                messages=[{"role": "user", "content": "Count to five."}])
        print("streamed:", "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices))
