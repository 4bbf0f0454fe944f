"""What a compression mode costs one model, measured in seconds: the calibration behind
`compression: auto` and the check of an explicit lossy mode against `compression.quality_floor`.

A text shipped in the package (config `compression.calibration_text`, tiered_kv/compression/texts/)
is read teacher-forced in chunks of 64 tokens twice: through transformers' DynamicCache, and through
one whose blocks are replaced by the codec's round trip (`decode(encode(block))`, the bytes a
compressed tier serves) once they fall behind the hot window (the chunk and 2 more blocks), so ~90%
of the history each position reads is compressed, as in a bank whose hot tier holds a few blocks.
The figure a mode is held to (`agreement`) is the next-token argmax agreement to expect over long
chats, estimated from the mean KL divergence of the next-token distributions: `1 - 1.25 * sqrt(KL)`.
A flip of the argmax needs a perturbation as large as the top-two logit margin, and the perturbation
grows as sqrt(KL); counting flips over a few hundred calibration positions instead measures mostly
the text's near-ties (on SmolLM2, int8, fp8 and int4 all flipped the same 3 of 448 positions, 99.33%,
while over 2,048 positions they differ: 99.8%, 98.9-99.5%, 97.6-98.3%). The factor 1.25 was fitted on
bench/quality.py's run (2 models x 4 texts x 2,048 positions, ~95% of the history compressed, against
the calibration at 512 tokens): it predicts each mode's worst text within ~0.05 points or below it
(conservative). The argmax agreement counted on the calibration text is kept too (`argmax`), with the
perplexity ratio and KL.

Modes are tried from the smallest stored block up; `choose` stops at the first that meets the floor
(`none` when none does). Every full-attention and sliding layer is measured: the cache keeps every
layer whole and the model's own masks apply the windows. No store, no bank: this module runs before
a store binds (it picks the layout the store binds with).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from . import MODES, packed_layer_bytes
from .codec import decode, encode

CHUNK_TOKENS = 64
HOT_SPARE_BLOCKS = 2
KL_FLIP_FACTOR = 1.25  # expected disagreement = this x sqrt(mean KL) (see the module docstring)


def expected_agreement(kl_nats: float) -> float:
    """The next-token agreement to expect over long chats from the mean KL on the calibration text."""
    return max(0.0, 1.0 - KL_FLIP_FACTOR * math.sqrt(max(0.0, kl_nats)))


@dataclass
class Calibration:
    """Figures per mode: `agreement` (expected, from KL: what the floor is checked against),
    `ppl_ratio`, and when measured in this process `kl` and `argmax` (counted on the text)."""
    text: str
    tokens: int
    block_size: int
    agreement: dict[str, float] = field(default_factory=dict)
    ppl_ratio: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    kl: dict[str, float] = field(default_factory=dict)
    argmax: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    def choice(self, floor: float, modes: list[str]) -> str | None:
        """The first of `modes` (smallest first) measured at or above `floor`; None when one before
        it is not measured yet (measure it first); 'none' when every one falls short."""
        for mode in modes:
            if mode not in self.agreement:
                return None
            if self.agreement[mode] >= floor:
                return mode
        return "none"


def modes_by_size(num_kv_heads: int, block_size: int, head_dim: int) -> list[str]:
    """The lossy modes this layout can hold, smallest packed block first."""
    from . import check_shape

    usable = [m for m in MODES[1:] if check_shape(m, head_dim) is None]
    return sorted(usable, key=lambda m: (packed_layer_bytes(num_kv_heads, block_size, head_dim, m), m))


class _RoundTripCache(DynamicCache):
    """A DynamicCache (every layer whole) whose blocks become `decode(encode(block))` once, when
    they fall `hot_tokens` behind the end."""

    def __init__(self, mode: str | None, block_size: int, hot_tokens: int):
        super().__init__()
        self.mode, self.block_size, self.hot_tokens = mode, block_size, hot_tokens
        self.done: dict[int, int] = {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if self.mode is None:
            return keys, values
        bs = self.block_size
        target = max(0, (keys.shape[-2] - self.hot_tokens) // bs * bs)
        done = self.done.get(layer_idx, 0)
        if target > done:
            heads, dim = keys.shape[1], keys.shape[-1]
            for row in range(keys.shape[0]):
                kv = torch.stack((keys[row, :, done:target], values[row, :, done:target]))  # [2, H, T, D]
                blocks = kv.unflatten(2, (-1, bs)).permute(2, 0, 1, 3, 4)  # [n, 2, H, bs, D]
                back = decode(encode(blocks, self.mode), self.mode, heads, bs, dim, keys.dtype)
                back = back.permute(1, 2, 0, 3, 4).flatten(2, 3)
                keys[row, :, done:target], values[row, :, done:target] = back[0], back[1]
            self.done[layer_idx] = target
        return keys, values


def _logits(model, ids: torch.Tensor, cache) -> torch.Tensor:
    out = []
    with torch.no_grad():
        for start in range(0, ids.shape[1], CHUNK_TOKENS):
            piece = ids[:, start:start + CHUNK_TOKENS]
            out.append(model(input_ids=piece, cache=cache, use_cache=True).logits[0].float())
    return torch.cat(out)


class Calibrator:
    """Measures modes on one model over token ids; the reference pass runs once, on first need."""

    def __init__(self, model, ids: torch.Tensor, block_size: int, text_name: str):
        if ids.shape[-1] < 2 * CHUNK_TOKENS + 1:
            raise ValueError(f"calibration needs at least {2 * CHUNK_TOKENS + 1} tokens; the text gave {ids.shape[-1]}")
        device = next(model.parameters()).device
        self.model, self.block_size = model, block_size
        ids = ids.reshape(1, -1).to(device)
        self.prefix, self.target = ids[:, :-1], ids[0, 1:]
        self.result = Calibration(text_name, int(self.prefix.shape[1]), block_size)
        self._reference: torch.Tensor | None = None

    def _hot_tokens(self) -> int:
        return CHUNK_TOKENS + HOT_SPARE_BLOCKS * self.block_size

    def measure(self, mode: str) -> float:
        """Expected agreement of `mode` (kept in `result`, with its KL, counted agreement and
        perplexity ratio)."""
        started = time.perf_counter()
        if self._reference is None:
            self._reference = _logits(self.model, self.prefix, _RoundTripCache(None, self.block_size, 0))
        got = _logits(self.model, self.prefix, _RoundTripCache(mode, self.block_size, self._hot_tokens()))
        ref, out, target = self._reference[CHUNK_TOKENS:], got[CHUNK_TOKENS:], self.target[CHUNK_TOKENS:]
        log_ref, log_out = F.log_softmax(ref, -1), F.log_softmax(out, -1)
        kl = float((log_ref.exp() * (log_ref - log_out)).sum(-1).mean())
        agreement = expected_agreement(kl)
        nll_ref = F.cross_entropy(ref, target).item()
        nll_out = F.cross_entropy(out, target).item()
        self.result.agreement[mode] = agreement
        self.result.kl[mode] = kl
        self.result.argmax[mode] = float((ref.argmax(-1) == out.argmax(-1)).float().mean())
        self.result.ppl_ratio[mode] = math.exp(nll_out - nll_ref)
        self.result.seconds += time.perf_counter() - started
        return agreement

    def choose(self, floor: float, modes: list[str]) -> str:
        """The smallest of `modes` meeting `floor` (measuring as few as it can), else 'none'."""
        while True:
            picked = self.result.choice(floor, modes)
            if picked is not None:
                return picked
            self.measure(next(m for m in modes if m not in self.result.agreement))
