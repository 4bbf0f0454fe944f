"""Putting a bank under a model's attention: `install(model, bank)` and `uninstall(model)`.

transformers 5.24's seam (DESIGN.md, "Facts about the dependencies"): an attention function
registered with `AttentionInterface` under a name, the sdpa mask function registered under the
same name with `AttentionMaskInterface` (without it the causal and padding masks are silently
None), then `model.set_attn_implementation(name)`. Llama-style attention calls
`cache.update(k, v, layer_idx, kwargs=kwargs)` and then the attention function with the same
`kwargs` dict, so a paged step's bank leaves its plan in that dict for the attention function
(attention.py).

Only what can be served is patched: every attention module needs a `layer_idx`, and a layer
kind the bank cannot serve (recurrent / linear-attention state, shared-KV layers) is refused
with a LayoutError naming the model type and the layer type, before anything changes.
Sliding-window and hybrid models are served: a bank of several layer groups (or of sliding
layers) hands each layer's K/V back from `update()` — the window's blocks for a sliding layer,
read as a view or gathered — and the attention functions run transformers' sdpa over them
with transformers' own masks (the sliding ones included), in every mode. Models whose
attention adds what sdpa cannot (logit soft-capping, attention sinks) keep transformers' own
attention function: install() patches nothing for them and says so once; the bank serves them
through `update()` as without hooks.
"""

from __future__ import annotations

import logging

from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..adapters import runtime_model
from ..blocks import model_layer_groups
from ..errors import LayoutError
from ..logs import log_once
from ..bank.plan import HOOKS_MODES
from .attention import exact_attention, merge_attention

_FUNCTIONS = {"exact": exact_attention, "merge": merge_attention}
MODES = {mode: (name, _FUNCTIONS[mode]) for name, mode in HOOKS_MODES.items()}
RENAMED_MODES = {"fast": "merge"}  # a mode of earlier releases: what serves it now
_STATE_ATTR = "_tiered_kv_hooks"
log = logging.getLogger(__name__)

for _name, _function in MODES.values():
    AttentionInterface.register(_name, _function)
    AttentionMaskInterface.register(_name, sdpa_mask)


class HookState:
    """What install() changed on a model, to undo it. Which banks are served is not kept: every
    bank built from the model sees, at each step, whether the model runs one of our attention
    functions (CacheBank.hooks_mode), so a later set_attn_implementation turns it off, never wrong."""

    def __init__(self, mode: str, previous_implementation):
        self.mode = mode
        self.previous_implementation = previous_implementation


def install(model, bank, mode: str = "exact") -> None:
    """Serve `model`'s attention from `bank`'s blocks.

    mode="exact" (default): transformers' sdpa over the K/V the bank hands back (views of the
    blocks in place, or one gather per layer; on CUDA laid out as DynamicCache hands them):
    logits bitwise equal to sdpa over a DynamicCache. The same as no hooks.
    mode="merge": on CUDA, contiguous history goes to SDPA as a strided view (no copy), and a
    decode step whose blocks lie in hot and page-locked warm runs the native paged decode kernel
    over them where they lie; on a CPU store a one-token decode step attends to each run of the slab
    (hot, then paged warm) in place and merges the partial attentions by log-sum-exp. Equal to exact
    within ~1e-5 relative, not bitwise (docs/guides/hooks.md). ("fast", a mode of earlier releases,
    is merge now.)
    """
    if mode in RENAMED_MODES:
        log_once(log, logging.INFO, "tiered_kv.hooks: mode %r is %r now", mode, RENAMED_MODES[mode])
        mode = RENAMED_MODES[mode]
    if mode not in MODES:
        raise ValueError(f"tiered_kv.hooks.install(mode={mode!r}): allowed: {sorted(MODES)}")
    if not hasattr(bank, "hooks_mode") or not hasattr(bank, "steps"):
        raise TypeError(f"tiered_kv.hooks.install: `bank` must be a tiered_kv.CacheBank; got {type(bank).__name__}")
    model = runtime_model(model)  # a PeftModel: the inner model's attention runs
    if bank.model_ref is None or bank.model_ref() is not model:
        raise ValueError("tiered_kv.hooks.install: the bank must be built from this model (CacheBank(model, cfg)); "
                         "a bank built from a config alone cannot see the model's forward passes")
    check_servable(model)
    reason = pass_through_reason(model)
    if reason is not None:  # transformers' own attention stays: the bank serves it through update()
        model_type = getattr(model.config, "model_type", type(model).__name__)
        log_once(log, logging.WARNING, "tiered_kv.hooks: model type %r %s, which the hooks' sdpa would drop; "
                 "its attention stays transformers' own and CacheBank serves it through update() (nothing was "
                 "patched)", model_type, reason)
        return
    install_attention(model, mode)


def install_attention(model, mode: str) -> None:
    """Set `model`'s attention implementation to the hooks' `mode` (checked by the caller), keeping
    the one it had for uninstall() (a BankBatch installs exact when a model runs none)."""
    state = getattr(model, _STATE_ATTR, None)
    previous = state.previous_implementation if state is not None else model.config._attn_implementation
    model.set_attn_implementation(MODES[mode][0])
    if model.config._attn_implementation != MODES[mode][0]:
        raise LayoutError(f"tiered_kv.hooks.install: {type(model).__name__} did not accept a custom attention "
                          "implementation (it does not use transformers' AttentionInterface); nothing was patched")
    object.__setattr__(model, _STATE_ATTR, HookState(mode, previous))


def uninstall(model) -> None:
    """Give `model` back the attention implementation it had before install()."""
    model = runtime_model(model)
    state = getattr(model, _STATE_ATTR, None)
    if state is None:
        return
    if state.previous_implementation is not None:
        model.set_attn_implementation(state.previous_implementation)
    object.__setattr__(model, _STATE_ATTR, None)


def installed_mode(model) -> str | None:
    """"exact" or "merge" while hooks are installed and active on `model`, else None."""
    implementation = getattr(getattr(model, "config", None), "_attn_implementation", None)
    return next((mode for mode, (name, _) in MODES.items() if name == implementation), None)


def check_servable(model) -> None:
    """LayoutError naming the model type when the hooks cannot serve this architecture."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", type(model).__name__)
    try:
        model_layer_groups(config)
    except LayoutError as error:
        raise LayoutError(f"tiered_kv.hooks: {error}") from None
    attention_modules = [m for name, m in model.named_modules()
                         if name.endswith(("self_attn", "attention")) and hasattr(m, "forward")
                         and (hasattr(m, "q_proj") or hasattr(m, "qkv_proj") or hasattr(m, "layer_idx"))]
    if not attention_modules:
        raise LayoutError(f"tiered_kv.hooks cannot serve model type {model_type!r}: no attention modules "
                          "(`*.self_attn`) found; nothing was patched")
    missing = [type(m).__name__ for m in attention_modules if not isinstance(getattr(m, "layer_idx", None), int)]
    if missing:
        raise LayoutError(f"tiered_kv.hooks cannot serve model type {model_type!r}: attention layers "
                          f"{sorted(set(missing))} have no integer `layer_idx`; nothing was patched")


def pass_through_reason(model) -> str | None:
    """Why the hooks leave this model's attention as transformers' own, or None: attention that
    soft-caps its logits or adds sink logits, which sdpa (every hooks mode) does not."""
    config = getattr(model, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    softcap = getattr(text_config, "attn_logit_softcapping", None)
    if softcap:
        return f"soft-caps its attention logits (attn_logit_softcapping={softcap})"
    if any(hasattr(m, "sinks") for name, m in model.named_modules() if name.endswith(("self_attn", "attention"))):
        return "adds attention-sink logits (`sinks`)"
    return None
