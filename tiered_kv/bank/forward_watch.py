"""Forward hooks that tell a CacheBank the token ids of every forward pass it serves.

A bank built from a model (`CacheBank(model, cfg)`) installs these once per model. Before each
forward the pre-hook finds the cache in the call (`cache=` or the deprecated
`past_key_values=`) and, when it is a bank, hands it the `input_ids`, `attention_mask` and
`position_ids` of this call: the ids of the tokens whose KV the bank is about to store. This is
what makes token identity verified rather than assumed (docs/design.md, invariant 2). The post-hook
runs even when the forward raised (`always_call`), so a bank rolls a failed step back at once.
The hooks hold no reference to any bank: the cache travels in each call's arguments. A BankBatch
(batch.py) hands each of its banks its own row.
"""

from __future__ import annotations

import threading

import torch

from ..identity import refresh_for_forward
from . import compiled
from .batch import BatchSteps
from .steps import StepMachine

_INSTALLED_ATTR = "_tiered_kv_forward_watch"
_INSTALL_LOCK = threading.Lock()


def _cache_in(kwargs: dict):
    cache = kwargs.get("cache")
    if cache is None:
        cache = kwargs.get("past_key_values")
    return cache if isinstance(getattr(cache, "steps", None), (StepMachine, BatchSteps)) else None


def _before_forward(module, args, kwargs):
    bank = _cache_in(kwargs)
    if bank is not None:
        input_ids = kwargs.get("input_ids")
        if input_ids is None and args:
            input_ids = args[0]
        if isinstance(bank.steps, BatchSteps):  # a BankBatch: each bank is told its own row (bank/batch.py)
            bank.steps.note_forward_inputs(module, input_ids, kwargs.get("attention_mask"), kwargs.get("position_ids"))
            return None
        if torch.compiler.is_compiling():  # inside a compiled decode forward: tensor ops only (compiled.py)
            compiled.note_inputs(bank.steps, input_ids, kwargs.get("position_ids"))
            return None
        refresh_for_forward(bank, module, input_ids)  # the weights (adapters) about to act name its new blocks
        bank.steps.note_forward_inputs(module, input_ids, kwargs.get("attention_mask"), kwargs.get("position_ids"))
    return None


def _after_forward(module, args, kwargs, result):
    bank = _cache_in(kwargs)
    if bank is not None and not torch.compiler.is_compiling():  # (a compiled step settles at the next eager call)
        bank.steps.note_forward_end(failed=result is None)
    return None


def watch(model) -> None:
    """Install the hooks on `model` (idempotent, also when banks are built in several threads)."""
    with _INSTALL_LOCK:
        if getattr(model, _INSTALLED_ATTR, None) is not None:
            return
        pre = model.register_forward_pre_hook(_before_forward, with_kwargs=True)
        post = model.register_forward_hook(_after_forward, with_kwargs=True, always_call=True)
        object.__setattr__(model, _INSTALLED_ATTR, (pre, post))
