"""Paged-attention hooks: attention reads a CacheBank's blocks in place.

    tiered_kv.hooks.install(model, bank)                 # exact (bitwise equal to sdpa)
    tiered_kv.hooks.install(model, bank, mode="merge")   # per-tier partials merged by LSE
    tiered_kv.hooks.uninstall(model)

install.py registers the attention functions and checks the model; attention.py holds them;
reads.py plans what each layer reads (view, gather, stream, paged kernel) through the step's
lease; stream_worker.py fetches layers ahead.
"""

from .attention import LAYER_KEY
from .install import MODES, check_servable, install, installed_mode, uninstall

__all__ = ["install", "uninstall", "installed_mode", "check_servable", "MODES", "LAYER_KEY"]
