#!/usr/bin/env python
"""How close a batched decode step (tiered_kv.BankBatch) comes to each conversation alone.

`--conversations` (16) conversations on SmolLM2, prompts of different lengths (fixed seed), each
decoded `--new-tokens` (32) greedy tokens alone through its own CacheBank, its logits kept at
every step. Then the same conversations, each prefilled alone into a fresh bank, decode together
through `tiered_kv.forward_rows`, one forward pass a step for every row, fed the alone run's
tokens (teacher forcing), so the logits of every step compare with the alone run's. Reported per
batch layout (`packed`: the rows one after another in a batch of one, as the server runs them;
`rect`: a `[B, 1]` batch):
  * the share of conversations whose greedy tokens equal their alone run (the argmax at every
    step equals the alone token: the free-running batched greedy is then the same);
  * the largest absolute logit difference over every step and row;
  * a batch of identical rows (`--identical` copies of conversation 0) and a batch of one: the
    same two figures;
  * decode tok/s alone and batched (every row's tokens over the batched steps' time), and the load.

    python bench/batch_equality.py --json bench/results/batch_equality_cpu.json
    python bench/batch_equality.py --conversations 2 --new-tokens 4 --identical 2   # smoke size
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--identical", type=int, default=4, help="rows of the identical-rows batch")
    parser.add_argument("--min-prompt", type=int, default=24, help="the shortest prompt, in tokens")
    parser.add_argument("--prompt-step", type=int, default=37, help="each next prompt is this much longer")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--json", default=None, metavar="PATH")
    return parser.parse_args(argv)


def config(cold_dir: str) -> dict:
    return {"block_size": 16, "hot": {"device": "cpu", "capacity": "512MiB"}, "warm": {"capacity": "256MiB"},
            "cold": {"capacity": "256MiB", "path": cold_dir}}


def alone(model, store, prompt: list[int], new_tokens: int):
    """Greedy tokens and each step's logits of one conversation through its own bank; decode seconds."""
    import torch

    import tiered_kv
    bank = tiered_kv.CacheBank(model, store=store)
    tokens, logits = [], []
    with torch.no_grad():
        last = model(input_ids=torch.tensor([prompt]), cache=bank, use_cache=True, logits_to_keep=1).logits[0, -1]
        started = time.perf_counter()
        for step in range(new_tokens):
            logits.append(last.float().clone())
            tokens.append(int(last.argmax()))
            if step + 1 < new_tokens:
                last = model(input_ids=torch.tensor([[tokens[-1]]]), cache=bank, use_cache=True).logits[0, -1]
        seconds = time.perf_counter() - started
    bank.close()
    return tokens, logits, seconds


def batched(model, store, prompts: list[list[int]], forced: list[list[int]], layout: str):
    """Each row prefilled alone, then one forward a step for all rows fed `forced` tokens: per row,
    its logits per step; the batched steps' seconds."""
    import torch

    import tiered_kv
    banks = [tiered_kv.CacheBank(model, store=store) for _ in prompts]
    steps = len(forced[0])
    rows_logits = [[] for _ in prompts]
    with torch.no_grad():
        for r, (bank, prompt) in enumerate(zip(banks, prompts)):
            rows_logits[r].append(model(input_ids=torch.tensor([prompt]), cache=bank, use_cache=True,
                                        logits_to_keep=1).logits[0, -1].float().clone())
        started = time.perf_counter()
        for step in range(steps - 1):
            ids = [[row[step]] for row in forced]
            out = tiered_kv.forward_rows(model, banks, ids if layout == "packed" else torch.tensor(ids))
            assert not out.failed and out.rows == list(range(len(banks))), out.failed
            for r in range(len(banks)):
                rows_logits[r].append(out.logits[r, -1].float().clone())
        seconds = time.perf_counter() - started
    for bank in banks:
        bank.close()
    return rows_logits, seconds


def compare(alone_runs, rows_logits) -> dict:
    equal, max_diff = 0, 0.0
    for (tokens, logits, _), got in zip(alone_runs, rows_logits):
        same = all(int(g.argmax()) == t for g, t in zip(got, tokens))
        equal += same
        max_diff = max(max_diff, max(float((g - a).abs().max()) for g, a in zip(got, logits)))
    return {"rows": len(rows_logits), "equal_tokens": equal, "share_equal": equal / len(rows_logits),
            "max_abs_logit_diff": max_diff}


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    import tiered_kv
    from tiered_kv.models import load_model
    if args.threads:
        torch.set_num_threads(args.threads)
    model, _ = load_model(None, progress=False)
    generator = torch.Generator().manual_seed(args.seed)
    vocab = model.config.vocab_size
    prompts = [torch.randint(100, vocab - 1, (args.min_prompt + i * args.prompt_step,), generator=generator).tolist()
               for i in range(args.conversations)]
    load_before, started = os.getloadavg(), time.perf_counter()
    result = {"args": vars(args), "model": "SmolLM2-135M-Instruct", "dtype": str(model.dtype)}
    with tempfile.TemporaryDirectory(prefix="tiered_kv-batch-equality-") as cold_dir:
        store = tiered_kv.TierStore(config(cold_dir))
        try:
            runs = [alone(model, store, p, args.new_tokens) for p in prompts]
            alone_s = sum(r[2] for r in runs)
            result["alone_decode_tok_s"] = len(runs) * (args.new_tokens - 1) / alone_s
            for layout in ("packed", "rect"):
                logits, seconds = batched(model, store, prompts, [r[0] for r in runs], layout)
                figures = compare(runs, logits)
                figures["batched_decode_tok_s"] = len(runs) * (args.new_tokens - 1) / seconds
                figures["identical_rows"] = compare([runs[0]] * args.identical,
                                                    batched(model, store, [prompts[0]] * args.identical,
                                                            [runs[0][0]] * args.identical, layout)[0])
                figures["batch_of_one"] = compare([runs[0]], batched(model, store, [prompts[0]], [runs[0][0]],
                                                                     layout)[0])
                result[layout] = figures
                print(f"{layout}: {figures['equal_tokens']} of {figures['rows']} conversations' greedy tokens equal "
                      f"alone; largest logit difference {figures['max_abs_logit_diff']:.3g}; identical rows: "
                      f"{figures['identical_rows']['share_equal']:.0%} equal, "
                      f"{figures['identical_rows']['max_abs_logit_diff']:.3g}; batch of one: "
                      f"{figures['batch_of_one']['max_abs_logit_diff']:.3g}; decode {figures['batched_decode_tok_s']:.1f}"
                      f" tok/s batched vs {result['alone_decode_tok_s']:.1f} alone", flush=True)
        finally:
            store.close()
    result["load_average"] = [load_before[0], os.getloadavg()[0]]
    result["wall_s"] = time.perf_counter() - started
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
