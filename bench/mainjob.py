#!/usr/bin/env python
"""The README main job's later turns, spilled against all hot: what a chat's history in warm costs.

The main job (`tiered-kv chat` on configs/default.yaml: SmolLM2, hot 64 MiB) spills part of its
history to warm by turn 6. Each round runs the whole scripted chat once per variant, in an order
rotated round by round, one model loaded once:
  default-<mode>  configs/default.yaml, hooks in <mode> (merge: the chat CLI's default on a CPU)
  bighot-<mode>   the same with hot.capacity 2GiB (everything hot)
Reported per variant: mean decode tok/s of turns `--turns` (6-8), medians over the rounds, and
default / bighot per mode (the issue's target: >= 0.9x), plus the bank's blocks per tier at the end.

    python bench/mainjob.py --json bench/results/mainjob_cpu.json
    python bench/mainjob.py --modes merge --rounds 1 --max-new-tokens 2 --turns 2   # smoke size
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiered_kv.chat import DEFAULT_MAX_NEW_TOKENS, DEFAULT_USER_MESSAGES, run_chat  # noqa: E402
from tiered_kv.config import default_config_path, load_config  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--modes", default="merge,exact", help="hooks modes, comma-separated")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--turns", default="6,7,8", help="the turns whose decode speed is compared")
    p.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS, help="the chat CLI's default")
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args(argv)
    args.mode_list = [m for m in args.modes.split(",") if m]
    args.turn_list = [int(t) for t in args.turns.split(",")]
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    from tiered_kv.models import load_model
    model, tokenizer = load_model(progress=False, device="cpu")
    raw = yaml.safe_load(Path(default_config_path()).read_text())
    big = copy.deepcopy(raw)
    big["hot"]["capacity"] = "2GiB"
    big["hot"].pop("capacity_blocks", None)
    configs = {"default": load_config(raw), "bighot": load_config(big)}
    variants = [(c, m) for m in args.mode_list for c in ("default", "bighot")]
    samples = {f"{c}-{m}": [] for c, m in variants}
    blocks = {}
    for r in range(args.rounds):
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        for config_name, mode in (order if r % 2 == 0 else order[::-1]):
            records = run_chat(model, tokenizer, configs[config_name], DEFAULT_USER_MESSAGES, args.max_new_tokens,
                               out=None, hooks_mode=mode)
            rates = [rec["decode_tokens_per_s"] for rec in records if rec["turn"] in args.turn_list]
            samples[f"{config_name}-{mode}"].append(statistics.mean(rates))
            blocks[f"{config_name}-{mode}"] = records[-1]["stats"]["bank_blocks"]
    medians = {name: statistics.median(v) for name, v in samples.items()}
    result = {
        "turns": args.turn_list, "rounds": args.rounds, "max_new_tokens": args.max_new_tokens,
        "load_average": os.getloadavg(), "decode_tokens_per_s": medians, "samples": samples, "bank_blocks": blocks,
        "spilled_vs_all_hot": {m: medians[f"default-{m}"] / medians[f"bighot-{m}"] for m in args.mode_list},
    }
    print(json.dumps({k: result[k] for k in ("decode_tokens_per_s", "spilled_vs_all_hot", "bank_blocks")}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
