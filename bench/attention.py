#!/usr/bin/env python
"""Attention-aware tiers (issue 37): sparse reads of spilled history, placement by attention, and
what sampling the attention costs.

  quality  per text (prose, dialogue, code, docs; each > 4,600 tokens), `tiered-kv quality --sparse`'s
           measurement: `--context` tokens prefilled, hot = `--hot-share` of the chat, the rest in
           (paged, uncompressed) warm, then `--positions` positions teacher-forced one decode step
           each, in the hooks' merge mode, every block read (exact) and with `--budget` (a share of
           the blocks below hot). Agreement, perplexity ratio, KL, the share of the blocks below hot
           read, and the median step time of each pass (targets: >= 99%, within 1%, <= 30%, >= 1.5x)
  trace    a long-document question trace: one document (`--context` tokens of the docs text), then
           `--questions` short questions, each answered `--answer-tokens` tokens. Reference answers
           from an exact bank; then with sparse reads, LRU placement against `attention_weight` 1
           (attention sampled on a quarter of the steps in both), each answer teacher-forced: agreement
           with the reference, the share of blocks below hot read per step (target: attention <= 0.6x
           of lru's bytes, agreement no lower) and the share of the sampled attention mass hot served
  oracle   the quality section with each block ranked by the attention mass it really draws (softmax of
           q.K over every key, summed per block, the largest over heads) instead of the key-summary bound:
           what the best possible choice of blocks at this budget gives, the bound's ceiling
  spill    the quality section's exact and sparse steps on prose with the history below hot in paged
           warm, int8 warm, cold and int8 cold (`--spill-positions` each): where a sparse step pays
  cost     all-hot decode with attention sampling (the defaults) against sampling off, interleaved
           rounds (target: <= 2% slower)

    python bench/attention.py --json bench/results/attention_cpu.json
    python bench/attention.py --tiny                                   # smoke size
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import tiered_kv  # noqa: E402
from tiered_kv.blocks import num_blocks_for  # noqa: E402
from tiered_kv.tools.sparse_quality import measure_sparse  # noqa: E402

HERE = Path(__file__).resolve().parent
TEXTS = {"prose": HERE / "texts" / "prose_austen_emma_long.txt", "dialogue": HERE / "texts" / "dialogue_austen_pride_long.txt",
         "code": "code", "docs": "docs"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="smoke size: a tiny random Llama")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--positions", type=int, default=512)
    p.add_argument("--budget", type=float, default=0.25)
    p.add_argument("--hot-share", type=float, default=0.25)
    p.add_argument("--questions", type=int, default=8)
    p.add_argument("--question-tokens", type=int, default=24)
    p.add_argument("--answer-tokens", type=int, default=24)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--cost-steps", type=int, default=20)
    p.add_argument("--spill-positions", type=int, default=64)
    p.add_argument("--sections", default="quality,trace,cost")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.tiny:
        args.context, args.positions, args.questions, args.question_tokens, args.answer_tokens = 160, 16, 2, 8, 6
        args.rounds, args.cost_steps = 2, 4
    args.sections = [s for s in args.sections.split(",") if s]
    return args


def load(args):
    if args.tiny:
        from bench.multiturn import build_tiny_model
        return build_tiny_model(0), None
    from tiered_kv.models import load_model

    return load_model(None, progress=False)


def text_of(name: str) -> str:
    from bench import quality_texts

    source = TEXTS[name]
    return source.read_text() if isinstance(source, Path) else quality_texts.load(source)


def tokens_of(model, tokenizer, name: str, count: int, seed: int = 0) -> torch.Tensor:
    if tokenizer is None:
        return torch.randint(3, model.config.vocab_size, (1, count), generator=torch.Generator().manual_seed(seed))
    return tokenizer(text_of(name), return_tensors="pt").input_ids[:, :count]


class _Ids:
    """A tokenizer stand-in for the tiny model: random ids, as many as asked for."""

    def __init__(self, model, count: int):
        self.model, self.count = model, count

    def __call__(self, text, return_tensors="pt"):
        return type("Out", (), {"input_ids": tokens_of(self.model, None, text, self.count, seed=len(text))})()


def _sparse_run(model, tokenizer, args, text: str, positions: int, tag: str, **placement) -> tuple[str, dict]:
    """measure_sparse on one of TEXTS (seeded ids for the tiny model), printed; (its name, its figures)."""
    tok = tokenizer if tokenizer is not None else _Ids(model, args.context + positions + 1)
    report = measure_sparse(model, tok, text_of(text) if tokenizer is not None else text, args.budget, args.context,
                            positions, args.hot_share, text_name=text, **placement)
    name = report.below_hot if placement else text
    figures = {**report.to_dict(), "speedup_vs_exact": report.step_ms_exact / report.step_ms_sparse}
    print(f"[{tag}] {name}: {json.dumps(figures)}", flush=True)
    return name, figures


def section_quality(model, tokenizer, args, tag: str = "quality") -> dict:
    out = dict(_sparse_run(model, tokenizer, args, name, args.positions, tag) for name in TEXTS)
    worst = min(r["argmax_agreement"] for r in out.values())
    out["summary"] = {"worst_agreement": worst, "worst_ppl_ratio": max(r["perplexity_ratio"] for r in out.values()
                                                                       if isinstance(r, dict) and "text" in r),
                      "max_read_share": max(r["read_share_below_hot"] for r in out.values() if "text" in r),
                      "min_speedup": min(r["speedup_vs_exact"] for r in out.values() if "text" in r)}
    return out


def _true_mass(step, layer: int, query: torch.Tensor) -> torch.Tensor:
    """An oracle SparseStep.scores: each candidate block's attention mass for this layer's queries."""
    if step.device_slab is None:
        raise SystemExit("the oracle section reads every key from the device slab: paged, uncompressed warm only")
    bs, flat = step.summaries.block_size, step.device_slab.flat
    heads, dim = flat.shape[1], flat.shape[3]
    slots = torch.from_numpy(step.slab_block_positions).to(query.device)
    keys = flat.view(flat.shape[0], heads, -1, bs * dim)[2 * layer].index_select(1, slots).view(heads, -1, dim).float()
    q = query[0, :, -1, :].float().view(heads, -1, dim)
    weights = torch.softmax(torch.einsum("hgd,htd->hgt", q, keys[:, :step.num_tokens]) / dim ** 0.5, dim=-1)
    padded = torch.nn.functional.pad(weights, (0, step.num_blocks * bs - step.num_tokens))
    mass = padded.view(heads, weights.shape[1], step.num_blocks, bs).sum(-1).amax(dim=(0, 1))
    return mass[torch.from_numpy(step.candidates).to(query.device)]


def section_oracle(model, tokenizer, args) -> dict:
    from tiered_kv.bank.sparse import SparseStep

    bound = SparseStep.scores
    SparseStep.scores = _true_mass
    try:
        return section_quality(model, tokenizer, args, tag="oracle")
    finally:
        SparseStep.scores = bound


SPILLS = (("warm", "none"), ("warm", "int8"), ("cold", "none"), ("cold", "int8"))


def section_spill(model, tokenizer, args) -> dict:
    return dict(_sparse_run(model, tokenizer, args, "prose", args.spill_positions, "spill", tier=tier,
                            compression=compression) for tier, compression in SPILLS)


def _trace_config(args, total_blocks: int, workdir: str, sparse: bool, weight: float) -> dict:
    attention = {"sample_steps": 0.25}  # (both placements measure where the attention mass lies)
    if sparse:
        attention["sparse"] = {"budget": args.budget}
    return {"block_size": 16,
            "hot": {"device": "cpu", "capacity_blocks": max(2, int(round(args.hot_share * total_blocks))),
                    "high_watermark": 1.0, "low_watermark": 1.0},
            "warm": {"capacity_blocks": total_blocks + 8}, "cold": {"capacity_blocks": 0, "path": workdir},
            "scheduler": {"background": False, "attention_weight": weight}, "attention": attention}


def _trace_run(model, config, document, questions, answers) -> dict:
    """Teacher-forced answers (the reference's tokens) after each question: argmax agreement with
    them, and the sparse steps' share of blocks below hot read."""
    bank = tiered_kv.CacheBank(model, config)
    tiered_kv.hooks.install(model, bank, mode="merge")
    agree, total, generated = 0, 0, []
    try:
        with torch.no_grad():
            for start in range(0, document.shape[1], 256):
                model(input_ids=document[:, start:start + 256], cache=bank, use_cache=True)
            for question, answer in zip(questions, answers):
                logits = model(input_ids=question, cache=bank, use_cache=True).logits[0, -1]
                predicted = [int(logits.argmax())]
                for token in answer[:-1]:
                    logits = model(input_ids=torch.tensor([[token]]), cache=bank, use_cache=True).logits[0, -1]
                    predicted.append(int(logits.argmax()))
                agree += sum(int(a == b) for a, b in zip(predicted, answer))
                total += len(answer)
                generated.append(predicted)
        stats = bank.stats()
    finally:
        tiered_kv.hooks.uninstall(model)
        bank.close()
    sparse = stats["attention"].get("sparse") or {}
    return {"agreement": agree / total, "read_share_below_hot": sparse.get("read_share_below_hot"),
            "blocks_read_below_hot": sparse.get("blocks_read_below_hot"), "sparse_steps": sparse.get("steps"),
            "mass_share_by_tier": stats["attention"]["mass_share_by_tier"], "bank_blocks": stats["bank_blocks"]}


def section_trace(model, tokenizer, args, workdir: str) -> dict:
    document = tokens_of(model, tokenizer, "docs", args.context)
    pool = tokens_of(model, tokenizer, "prose", args.questions * args.question_tokens + 10, seed=1)
    questions = [pool[:, i * args.question_tokens:(i + 1) * args.question_tokens] for i in range(args.questions)]
    total_tokens = document.shape[1] + args.questions * (args.question_tokens + args.answer_tokens)
    total_blocks = num_blocks_for(total_tokens, 16)
    # reference answers: greedy through a bank that reads every block
    bank = tiered_kv.CacheBank(model, _trace_config(args, total_blocks, os.path.join(workdir, "ref"), False, 0.0))
    tiered_kv.hooks.install(model, bank, mode="merge")
    answers = []
    try:
        with torch.no_grad():
            for start in range(0, document.shape[1], 256):
                model(input_ids=document[:, start:start + 256], cache=bank, use_cache=True)
            for question in questions:
                logits = model(input_ids=question, cache=bank, use_cache=True).logits[0, -1]
                answer = [int(logits.argmax())]
                for _ in range(args.answer_tokens - 1):
                    logits = model(input_ids=torch.tensor([[answer[-1]]]), cache=bank, use_cache=True).logits[0, -1]
                    answer.append(int(logits.argmax()))
                answers.append(answer)
    finally:
        tiered_kv.hooks.uninstall(model)
        bank.close()
    out = {"document_tokens": int(document.shape[1]), "questions": args.questions, "total_blocks": total_blocks}
    for name, weight in (("lru", 0.0), ("attention", 1.0)):
        out[name] = _trace_run(model, _trace_config(args, total_blocks, os.path.join(workdir, name), True, weight),
                               document, questions, answers)
        print(f"[trace] {name}: {json.dumps(out[name])}", flush=True)
    lru, att = out["lru"]["blocks_read_below_hot"], out["attention"]["blocks_read_below_hot"]
    out["bytes_ratio_attention_vs_lru"] = att / lru if lru else None
    return out


def section_cost(model, tokenizer, args, workdir: str) -> dict:
    ids = tokens_of(model, tokenizer, "docs", min(args.context, 2048))
    blocks = num_blocks_for(ids.shape[1] + args.rounds * args.cost_steps * 2 + 32, 16)
    banks = {}
    for name, share in (("off", 0.0), ("on", tiered_kv.load_config({}).attention.sample_steps)):
        config = {"block_size": 16, "hot": {"device": "cpu", "capacity_blocks": blocks}, "warm": {"capacity_blocks": 0},
                  "cold": {"capacity_blocks": 0, "path": os.path.join(workdir, f"cost-{name}")},
                  "scheduler": {"background": False}, "attention": {"sample_steps": share}}
        bank = tiered_kv.CacheBank(model, config)
        tiered_kv.hooks.install(model, bank, mode="merge")
        with torch.no_grad():
            token = model(input_ids=ids, cache=bank, use_cache=True).logits[:, -1:].argmax(-1)
        banks[name] = [bank, token]
    times = {"off": [], "on": []}
    with torch.no_grad():
        for r in range(args.rounds):
            for name in (("off", "on") if r % 2 == 0 else ("on", "off")):
                bank, token = banks[name]
                tiered_kv.hooks.install(model, bank, mode="merge")
                steps = []
                for _ in range(args.cost_steps):
                    began = time.perf_counter()
                    token = model(input_ids=token, cache=bank, use_cache=True).logits[:, -1:].argmax(-1)
                    steps.append(time.perf_counter() - began)
                times[name].append(statistics.median(steps))
                banks[name][1] = token
    sampled = banks["on"][0].stats()["attention"]
    for bank, _ in banks.values():
        bank.close()
    tiered_kv.hooks.uninstall(model)
    ratios = [off / on for off, on in zip(times["off"], times["on"])]
    return {"context": int(ids.shape[1]), "step_ms_off": statistics.median(times["off"]) * 1e3,
            "step_ms_on": statistics.median(times["on"]) * 1e3, "speed_on_vs_off": statistics.median(ratios),
            "rounds": ratios, "sampled_steps": sampled["sampled_steps"], "decode_steps": sampled["decode_steps"]}


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.manual_seed(0)
    model, tokenizer = load(args)
    model.generation_config.eos_token_id = None
    result = {"model": "tiny random llama" if args.tiny else "SmolLM2-135M-Instruct (bundled)",
              "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                          "platform": platform.platform()},
              "load_average_before": list(os.getloadavg()),
              "settings": {k: v for k, v in vars(args).items() if k not in ("json",)}}
    with tempfile.TemporaryDirectory(prefix="tiered_kv-attention-") as workdir:
        if "quality" in args.sections:
            result["quality"] = section_quality(model, tokenizer, args)
        if "oracle" in args.sections:
            result["oracle"] = section_oracle(model, tokenizer, args)
        if "spill" in args.sections:
            result["spill"] = section_spill(model, tokenizer, args)
        if "trace" in args.sections:
            result["trace"] = section_trace(model, tokenizer, args, workdir)
        if "cost" in args.sections:
            result["cost"] = section_cost(model, tokenizer, args, workdir)
            print(f"[cost] {json.dumps(result['cost'])}", flush=True)
    result["load_average_after"] = list(os.getloadavg())
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
