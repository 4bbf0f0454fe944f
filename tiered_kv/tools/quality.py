"""`tiered-kv quality`: what a compression mode costs one model, measured over a text.

Teacher-forced: the text's tokens go through the model in chunks twice, once with transformers'
DynamicCache (the reference, the model's dtype throughout) and once through a CacheBank whose hot
tier holds only a few blocks, so the history each chunk attends to lies mostly in the compressed
tier (`warm`, or `cold` with no warm). Over every token after the first chunk it reports:

- argmax agreement: the share of positions where both predict the same next token;
- the perplexity ratio: exp(mean NLL through the bank) / exp(mean NLL of the reference), the NLL of
  the text's actual next token;
- KL(reference || bank) of the next-token distributions, mean nats per token;
- greedy continuation: after the text, both generate `continuation_tokens` greedily; the share of
  positions before the first difference (1.0: the same continuation).

It also reports the share of the history's blocks that were in the compressed tier at the end, so a
figure is never read as "compressed" when the history stayed hot, and which text it read (`tiered-kv
quality` reads the given texts and always the calibration text `compression: auto` is measured on:
`shipped_text`). (It was compression/quality.py,
which still re-exports it: a tool that runs a CacheBank, not part of the codecs.)
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from ..bank import CacheBank
from ..blocks import model_layer_groups, num_blocks_for
from ..compression import MODES

DEFAULT_TOKENS = 2048
DEFAULT_CHUNK_TOKENS = 64
DEFAULT_CONTINUATION_TOKENS = 32
HOT_SPARE_BLOCKS = 2  # hot holds one chunk's blocks and this many more: the rest of the history is below


@dataclass(frozen=True)
class QualityReport:
    compression: str
    tier: str
    tokens: int
    scored_tokens: int
    compressed_share: float  # of the history's blocks, in the compressed tier at the end
    argmax_agreement: float
    perplexity_reference: float
    perplexity: float
    perplexity_ratio: float
    kl_nats: float
    greedy_agreement: float
    block_bytes: int
    compressed_block_bytes: int
    text: str = ""  # its name: a file's, or a shipped text's (`shipped_text`)

    def to_dict(self) -> dict:
        return asdict(self)


def default_text() -> str:
    """A real English text that every Python install has: pydoc's topic pages (the language
    reference), joined in sorted order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


def shipped_text(name: str) -> str:
    """A calibration text shipped in the package (compression.calibration_text; ConfigError naming
    the key for a name the package does not ship)."""
    from ..config import CompressionConfig

    return CompressionConfig(calibration_text=name).text_path().read_text(encoding="utf-8")


def _config(compression: str, tier: str, block_size: int, hot_blocks: int, lower_blocks: int, cold_dir: str,
            device: str) -> dict:
    lower = {"capacity_blocks": lower_blocks, "compression": compression}
    return {"block_size": block_size,
            "hot": {"device": device, "capacity_blocks": hot_blocks, "high_watermark": 1.0, "low_watermark": 1.0},
            "warm": lower if tier == "warm" else {"capacity_blocks": 0},
            "cold": {**lower, "path": cold_dir, "write_behind_s": 0} if tier == "cold" else
                    {"capacity_blocks": 0, "path": cold_dir},
            "scheduler": {"background": False}, "compression": {"check_explicit": False}}  # (measured here)


def _chunked_logits(model, ids: torch.Tensor, cache, chunk: int) -> torch.Tensor:
    out = []
    with torch.no_grad():
        for start in range(0, ids.shape[1], chunk):
            piece = ids[:, start:start + chunk]
            out.append(model(input_ids=piece, cache=cache, use_cache=True).logits[0].float())
    return torch.cat(out)


def _greedy(model, ids: torch.Tensor, cache, new_tokens: int) -> torch.Tensor:
    with torch.no_grad():
        out = model.generate(ids, cache=cache, attention_mask=torch.ones_like(ids),
                             max_new_tokens=new_tokens, do_sample=False, min_new_tokens=new_tokens)
    return out[0, ids.shape[1]:]


def measure(model, tokenizer, text: str, compression: str = "int8", tier: str = "warm",
            num_tokens: int = DEFAULT_TOKENS, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
            continuation_tokens: int = DEFAULT_CONTINUATION_TOKENS, block_size: int = 16,
            text_name: str = "") -> QualityReport:
    """Run both passes (see the module docstring); ValueError for a text of fewer than 2 chunks."""
    if tier not in ("warm", "cold"):
        raise ValueError(f"tier {tier!r}: allowed 'warm' or 'cold'")
    if compression not in MODES:
        raise ValueError(f"compression {compression!r}: allowed {', '.join(map(repr, MODES))}")
    device = str(getattr(model, "device", "cpu"))
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :num_tokens].to(device)
    if ids.shape[1] < 2 * chunk_tokens:
        raise ValueError(f"the text has {ids.shape[1]} tokens; at least {2 * chunk_tokens} (two chunks of "
                         f"{chunk_tokens}) are needed")
    prefix, scored = ids[:, :-1], ids[0, 1:]
    # per layer group (a hybrid model's sliding and full groups each hold their own blocks: Gemma 3 270M
    # has 6 groups): hot holds the chunk and HOT_SPARE_BLOCKS more in each, so no position reads its own
    # chunk compressed, and the lower tier every group's history
    num_groups = len(model_layer_groups(model.config))
    hot_blocks = (num_blocks_for(chunk_tokens, block_size) + HOT_SPARE_BLOCKS) * num_groups
    lower_blocks = num_groups * num_blocks_for(ids.shape[1] + continuation_tokens, block_size) + 4
    reference = _chunked_logits(model, prefix, DynamicCache(config=model.config), chunk_tokens)
    with tempfile.TemporaryDirectory(prefix="tiered_kv-quality-") as cold_dir:
        config = _config(compression, tier, block_size, hot_blocks, lower_blocks, cold_dir, device)
        bank = CacheBank(model, config)
        try:
            got = _chunked_logits(model, prefix, bank, chunk_tokens)
            where = bank.stats()["bank_blocks"]
            compressed_share = where.get(tier, 0) / max(1, sum(where.values()))
            block_bytes = bank.store.layout.block_bytes
            stored_bytes = bank.stats()["tiers"][tier]["block_bytes"]
        finally:
            bank.close()
        first = chunk_tokens  # positions whose history includes blocks that went down
        ref, out, target = reference[first:], got[first:], scored[first:]
        log_ref, log_out = F.log_softmax(ref, -1), F.log_softmax(out, -1)
        nll_ref = float(-log_ref.gather(1, target[:, None]).mean())
        nll_out = float(-log_out.gather(1, target[:, None]).mean())
        kl = float((log_ref.exp() * (log_ref - log_out)).sum(-1).mean())
        agreement = float((ref.argmax(-1) == out.argmax(-1)).float().mean())
        greedy_ref = _greedy(model, ids, DynamicCache(config=model.config), continuation_tokens)
        bank = CacheBank(model, config)
        try:
            greedy_out = _greedy(model, ids, bank, continuation_tokens)
        finally:
            bank.close()
    same = (greedy_ref == greedy_out).tolist() + [False]
    return QualityReport(compression, tier, int(ids.shape[1]), int(target.shape[0]), compressed_share, agreement,
                         math.exp(nll_ref), math.exp(nll_out), math.exp(nll_out - nll_ref), kl,
                         same.index(False) / continuation_tokens, block_bytes, stored_bytes, text_name)


def format_report(reports: list[QualityReport]) -> str:
    width = max([4, *(len(r.text) for r in reports)])
    lines = [f"{'text':<{width}}  compression  tier  in tier  argmax agree  ppl ref -> bank (ratio)   KL nats   "
             "greedy  B/block",
             *(f"{r.text:<{width}}  {r.compression:<11}  {r.tier:<4}  {r.compressed_share:>7.0%}  "
               f"{r.argmax_agreement:>12.2%}  {r.perplexity_reference:>7.3f} -> {r.perplexity:.3f} "
               f"({r.perplexity_ratio:.4f})  {r.kl_nats:>8.5f}  {r.greedy_agreement:>6.0%}  "
               f"{r.compressed_block_bytes:,} of {r.block_bytes:,}" for r in reports)]
    scored = {r.text: f"{r.scored_tokens} scored tokens of {r.tokens} ({r.text or 'the text'})" for r in reports}
    if reports:
        lines.append(f"over {', '.join(scored.values())}; 'in tier': share of the history's blocks in the "
                     "compressed tier at the end")
    return "\n".join(lines)
