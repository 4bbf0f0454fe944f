"""One request's generation, a forward pass at a time, so the engine can interleave many.

A `Sequence` owns the request's CacheBank. `prefill()` attaches the longest stored verified prefix
and runs the model over the rest of the prompt: its logits give the first token. Each `decode()`
feeds the last token and picks the next. The forward passes are the ones `model.generate(cache=bank)`
runs (the uncached suffix with `logits_to_keep=1`, then one token at a time, positions and an
all-ones mask over the whole sequence), and a `temperature: 0` pick is the argmax generate's greedy
search takes, so a conversation served here gives the tokens a local greedy generate gives.

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
    """A request being generated: its bank, the tokens so far and why it ended ("stop", "length")."""

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
        self.bank = CacheBank(model, store=store)
        self.cached_tokens = 0
        self.completion_ids: list[int] = []
        self.finish_reason: str | None = None

    def prefill(self) -> int:
        """Attach, then compute the uncached rest of the prompt; the first new token."""
        ids = torch.tensor([self.prompt_ids], device=self.device)
        self.cached_tokens = self.bank.attach(ids) if self.reuse else 0
        return self._forward(self.prompt_ids[self.cached_tokens:], self.cached_tokens)

    def decode(self) -> int:
        """Feed the last token; the next one."""
        return self._forward(self.completion_ids[-1:], len(self.prompt_ids) + len(self.completion_ids) - 1)

    def _forward(self, new_ids: list[int], start: int) -> int:
        total = start + len(new_ids)
        positions = torch.arange(start, total, device=self.device)
        with torch.no_grad():
            out = self.model(input_ids=torch.tensor([new_ids], device=self.device),
                             attention_mask=torch.ones((1, total), dtype=torch.long, device=self.device),
                             position_ids=positions.unsqueeze(0), cache_position=positions, cache=self.bank,
                             use_cache=True, logits_to_keep=1)
        token = pick_token(out.logits[0, -1], self.temperature, self.top_p, self.generator)
        self._note(token)
        return token

    def _note(self, token: int) -> None:
        self.completion_ids.append(token)
        if token in self.eos_ids or self._stop_seen():
            self.finish_reason = "stop"
        elif len(self.completion_ids) >= self.max_new_tokens:
            self.finish_reason = "length"

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
