"""`tiered-kv quality --sparse BUDGET`: what sparse reads of spilled history cost one model on a text.

Teacher-forced, one token a step (sparse reads serve one-token decode steps): the text's first
`context_tokens` are prefilled (in chunks) through two CacheBanks whose hot tier holds `hot_share` of
the chat and warm the rest, in the hooks' merge mode: one reads every block (exact), the other has
`attention.sparse.budget` = BUDGET. Then each of the next `positions` tokens is fed alone to both, in
turn (paired step times), and the two next-token distributions compared: argmax agreement, the perplexity ratio of the
text's actual next tokens, KL(exact || sparse) in nats. It also reports the share of the blocks
below hot the sparse steps read, and each pass's median step time.
"""

from __future__ import annotations

import math
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from .. import hooks
from ..bank import CacheBank
from ..blocks import num_blocks_for

DEFAULT_CONTEXT_TOKENS = 4096
DEFAULT_POSITIONS = 512
DEFAULT_HOT_SHARE = 0.25
CHUNK_TOKENS = 256


@dataclass(frozen=True)
class SparseReport:
    budget: float | int
    text: str
    context_tokens: int
    positions: int
    hot_blocks: int
    argmax_agreement: float
    perplexity_exact: float
    perplexity_ratio: float
    kl_nats: float
    read_share_below_hot: float  # of the blocks below hot, the share a sparse step read (over layers and steps)
    step_ms_exact: float
    step_ms_sparse: float
    placement: str = "lru"
    below_hot: str = "warm"  # where the history below hot lay: "warm", "cold", or with its compression ("warm int8")

    def to_dict(self) -> dict:
        return asdict(self)


def parse_budget(text: str) -> float | int:
    """`0.25` (a share) or `16` (blocks), as attention.sparse.budget takes it (checked there)."""
    value = float(text)
    return int(value) if value.is_integer() and "." not in text else value


def _config(budget, block_size: int, hot_blocks: int, below_blocks: int, cold_dir: str, device: str,
            attention_weight: float = 0.0, tier: str = "warm", compression: str = "none") -> dict:
    """Hot holds `hot_blocks`; the rest of the chat lies in `tier` (warm or cold), stored as `compression`."""
    attention = {"sample_steps": 0.25 if attention_weight else 0.0}
    if budget is not None:
        attention["sparse"] = {"budget": budget}
    if tier not in ("warm", "cold"):
        raise ValueError(f"tier {tier!r}: allowed 'warm' or 'cold' (where the history below hot lies)")
    below = {"capacity_blocks": below_blocks, "compression": compression}
    return {"block_size": block_size,
            "hot": {"device": device, "capacity_blocks": hot_blocks, "high_watermark": 1.0, "low_watermark": 1.0},
            "warm": below if tier == "warm" else {"capacity_blocks": 0},
            "cold": {**(below if tier == "cold" else {"capacity_blocks": 0}), "path": cold_dir},
            "scheduler": {"background": False, "attention_weight": attention_weight}, "attention": attention}


def _teacher_forced(model, banks: dict, context: torch.Tensor, fed: torch.Tensor) -> dict:
    """Per bank: logits `[positions, V]` of each token of `fed` given everything before it, one step
    each, the banks' steps interleaved (so their step times are paired), the step times, its stats."""
    out = {name: ([], []) for name in banks}
    try:
        with torch.no_grad():
            for name, bank in banks.items():
                hooks.install(model, bank, mode="merge")
                for start in range(0, context.shape[1], CHUNK_TOKENS):
                    model(input_ids=context[:, start:start + CHUNK_TOKENS], cache=bank, use_cache=True)
            for i in range(fed.shape[1]):
                for name, bank in banks.items():
                    hooks.install(model, bank, mode="merge")
                    began = time.perf_counter()
                    logits = model(input_ids=fed[:, i:i + 1], cache=bank, use_cache=True).logits[0, -1].float()
                    out[name][1].append(time.perf_counter() - began)
                    out[name][0].append(logits)
        return {name: (torch.stack(logits), seconds, banks[name].stats()) for name, (logits, seconds) in out.items()}
    finally:
        hooks.uninstall(model)


def measure_sparse(model, tokenizer, text: str, budget, context_tokens: int = DEFAULT_CONTEXT_TOKENS,
                   positions: int = DEFAULT_POSITIONS, hot_share: float = DEFAULT_HOT_SHARE, block_size: int = 16,
                   text_name: str = "", attention_weight: float = 0.0, tier: str = "warm",
                   compression: str = "none") -> SparseReport:
    """Both passes (module docstring), the history below hot in `tier` stored as `compression`;
    ValueError for a text shorter than 2 x `positions` tokens."""
    device = str(getattr(model, "device", "cpu"))
    ids = tokenizer(text, return_tensors="pt").input_ids.to(device)
    if ids.shape[1] < 2 * positions + 1:
        raise ValueError(f"the text has {ids.shape[1]} tokens; --sparse needs at least {2 * positions + 1} "
                         f"({positions} positions after a context at least as long)")
    context_tokens = min(context_tokens, ids.shape[1] - positions - 1)
    context, fed = ids[:, :context_tokens], ids[:, context_tokens:context_tokens + positions + 1]
    total = num_blocks_for(context_tokens + positions + 1, block_size)
    hot_blocks = max(2, int(round(hot_share * total)))
    with tempfile.TemporaryDirectory(prefix="tiered_kv-sparse-") as cold_dir:
        banks = {name: CacheBank(model, _config(b, block_size, hot_blocks, total + 4, f"{cold_dir}/{name}", device,
                                                attention_weight if b is not None else 0.0, tier, compression))
                 for name, b in (("exact", None), ("sparse", budget))}
        try:
            runs = _teacher_forced(model, banks, context, fed[:, :-1])
        finally:
            for bank in banks.values():
                bank.close()
    (exact, exact_s, _), (sparse, sparse_s, stats) = runs["exact"], runs["sparse"]
    target = fed[0, 1:]
    log_exact, log_sparse = F.log_softmax(exact, -1), F.log_softmax(sparse, -1)
    nll_exact = float(-log_exact.gather(1, target[:, None]).mean())
    nll_sparse = float(-log_sparse.gather(1, target[:, None]).mean())
    read = stats["attention"].get("sparse", {}).get("read_share_below_hot")
    return SparseReport(budget, text_name, context_tokens, positions, hot_blocks,
                        float((exact.argmax(-1) == sparse.argmax(-1)).float().mean()), math.exp(nll_exact),
                        math.exp(nll_sparse - nll_exact),
                        float((log_exact.exp() * (log_exact - log_sparse)).sum(-1).mean()),
                        float(read) if read is not None else 1.0, statistics.median(exact_s) * 1e3,
                        statistics.median(sparse_s) * 1e3, "attention" if attention_weight else "lru",
                        tier if compression == "none" else f"{tier} {compression}")


def format_sparse(reports: list[SparseReport]) -> str:
    width = max([4, *(len(r.text) for r in reports)])
    lines = [f"{'text':<{width}}  budget  argmax agree  ppl ratio  KL nats   read below hot  step ms exact -> sparse",
             *(f"{r.text:<{width}}  {r.budget!s:>6}  {r.argmax_agreement:>12.2%}  {r.perplexity_ratio:>9.4f}  "
               f"{r.kl_nats:>8.5f}  {r.read_share_below_hot:>14.1%}  {r.step_ms_exact:>8.1f} -> {r.step_ms_sparse:.1f}"
               for r in reports)]
    if reports:
        r = reports[0]
        lines.append(f"{r.positions} positions after {r.context_tokens} tokens of context, hot {r.hot_blocks} blocks "
                     f"(the rest in {r.below_hot}), each position one decode step in the hooks' merge mode")
    return "\n".join(lines)


__all__ = ["SparseReport", "measure_sparse", "format_sparse", "parse_budget"]
