"""One request's generation, so the engine can run many conversations' steps together.

A `Sequence` owns the request's CacheBank and the tokens it still has to compute (`pending`): after
`start()` attached the longest stored verified prefix, the uncached rest of the prompt; then, once
a token was picked, that token. The logits of the last pending token pick the next one. The
engine computes pending tokens two ways (ticks.py): a sequence with many (a prompt) runs alone, a
chunk of at most `--prefill-chunk` tokens a forward; every sequence with one (decode) is a row of
one batched forward (tiered_kv.BankBatch). The forward passes are the ones
`model.generate(cache=bank)` runs (positions continuing the bank, `logits_to_keep=1`), and a
`temperature: 0` pick is the argmax of generate's greedy search, so a conversation served here
gives the tokens a local greedy generate gives (a prompt longer than one chunk, or rows batched
with other conversations, may round differently in the last bits: docs/guides/serving.md).

A sampled pick (temperature > 0, top_p) draws from the request's own torch.Generator, seeded by
the request's `seed` when given: concurrent requests never share or reseed a generator.
"""

from __future__ import annotations

import secrets

import torch

from ..bank import CacheBank

_STOP_WINDOW_TOKENS = 8  # besides the longest stop string's length: tokens decoded to look for a stop


def pick_token(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> int:
    """The next token from a vocabulary's logits: the argmax at temperature 0, else a draw from the
    softmax at `temperature`, cut to the smallest set of tokens whose probability reaches `top_p`."""
    logits = logits.float()
    if temperature == 0.0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # the mass of the tokens ranked above
        sorted_probs[before >= top_p] = 0.0  # the top token always stays
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


class Sequence:
    """A request being generated: its bank, the tokens to compute, the tokens so far and why it
    ended ("stop", "length")."""

    def __init__(self, model, store, prompt_ids: list[int], max_new_tokens: int, eos_ids: list[int],
                 temperature: float, top_p: float, seed: int | None, stops: tuple[str, ...], tokenizer, reuse: bool):
        self.model, self.prompt_ids, self.max_new_tokens = model, prompt_ids, max_new_tokens
        self.eos_ids, self.temperature, self.top_p = set(eos_ids), temperature, top_p
        self.stops, self.tokenizer, self.reuse = stops, tokenizer, reuse
        self.device = next(model.parameters()).device
        self.generator = None
        if temperature > 0.0:
            self.generator = torch.Generator(device=self.device)
            self.generator.manual_seed(seed if seed is not None else secrets.randbits(63))
        self.bank = CacheBank(model, store=store, tokenizer=tokenizer)
        self.cached_tokens = 0
        self.completion_ids: list[int] = []
        self.pending: list[int] = []  # tokens whose KV the bank does not hold yet; the last one picks the next
        self.started = False  # start() attached the stored prefix
        self.finish_reason: str | None = None
        self.recomputed = 0  # times a corrupt block made it compute its history again

    def start(self) -> int:
        """Attach the longest stored verified prefix; the rest of the prompt is pending. Returns
        the number of prompt tokens reused."""
        ids = torch.tensor([self.prompt_ids], device=self.device)
        self.cached_tokens = self.bank.attach(ids) if self.reuse else 0
        self.pending = self.prompt_ids[self.cached_tokens:]
        self.started = True
        return self.cached_tokens

    @property
    def decoding(self) -> bool:
        """One token to compute: a row of the next batched decode step."""
        return len(self.pending) == 1

    def prefill(self, max_tokens: int) -> int | None:
        """Compute up to `max_tokens` pending tokens alone; the picked token once none is left, else None."""
        chunk = self.pending[:max_tokens]
        start = self.bank.seq.num_tokens
        total = start + len(chunk)
        positions = torch.arange(start, total, device=self.device)
        with torch.no_grad():
            out = self.model(input_ids=torch.tensor([chunk], device=self.device),
                             attention_mask=torch.ones((1, total), dtype=torch.long, device=self.device),
                             position_ids=positions.unsqueeze(0), cache=self.bank, use_cache=True, logits_to_keep=1)
        return self.computed(len(chunk), out.logits[0, -1])

    def computed(self, num_tokens: int, logits: torch.Tensor) -> int | None:
        """`num_tokens` pending tokens are in the bank now (a batched step); `logits` are the last
        one's: the picked token once none is pending, else None."""
        self.pending = self.pending[num_tokens:]
        return None if self.pending else self.picked(logits)

    def picked(self, logits: torch.Tensor) -> int:
        """The next token from the last pending token's logits (its KV is in the bank now)."""
        token = pick_token(logits, self.temperature, self.top_p, self.generator)
        self.completion_ids.append(token)
        self.pending = [token]
        if token in self.eos_ids or self._stop_seen():
            self.finish_reason = "stop"
        elif len(self.completion_ids) >= self.max_new_tokens:
            self.finish_reason = "length"
        return token

    def recompute_from_bank(self) -> None:
        """A corrupt block cut the bank short (it is never served): every known token after what
        the bank still holds is pending again, computed as a prompt is."""
        known = self.prompt_ids + self.completion_ids
        self.pending = known[self.bank.seq.num_tokens:]
        self.recomputed += 1

    def _stop_seen(self) -> bool:
        if not self.stops:
            return False
        window = max(len(s) for s in self.stops) + _STOP_WINDOW_TOKENS  # a token is at least one character
        text = self.tokenizer.decode(self.completion_ids[-window:], skip_special_tokens=True)
        return any(stop in text for stop in self.stops)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def close(self) -> None:
        """End the request; its blocks stay in the store for the next turn."""
        self.bank.close()
