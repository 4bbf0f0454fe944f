"""Attention hooks: a CacheBank under a model's attention.

    tiered_kv.hooks.install(model, bank)                 # exact (bitwise equal to sdpa)
    tiered_kv.hooks.install(model, bank, mode="merge")   # CUDA: the paged decode kernel over hot + warm
    tiered_kv.hooks.uninstall(model)

install.py registers the attention functions and checks the model; attention.py holds them. What
each layer reads is prepared by the bank before layer 0 (tiered_kv/bank/plan.py).
"""

from ..bank.plan import PAGED_KEY
from .install import MODES, check_servable, install, install_attention, installed_mode, pass_through_reason, uninstall

__all__ = ["install", "uninstall", "installed_mode", "check_servable", "install_attention", "pass_through_reason",
           "MODES", "PAGED_KEY"]
