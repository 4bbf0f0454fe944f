"""Typed, validated configuration for tiered_kv (policy code: no torch here).

A `Config` is a tree of frozen dataclasses. Every value is checked when an object is built
(`__post_init__`), so code holding a `Config` never re-validates; `load_config` builds one from
a YAML file, a dict or an existing `Config`. Anything wrong raises `ConfigError` naming the key
path, the value and what is allowed; errors from a file are prefixed with its path.

One module per concept: checks.py (what a value may be, sizes), tiers.py (hot / warm / cold),
placement.py (scheduler), runtime.py (metrics, copies), remote.py, compression.py (the quality floor
that `compression: auto` meets), schema.py (`Config`, and `block_size: auto`), load.py (YAML or a dict
to a `Config`). Import from here: `tiered_kv.config`.
"""
from __future__ import annotations

from ..errors import ConfigError
from .checks import ALLOWED_COMPRESSION, MAX_BLOCK_SIZE_TOKENS, parse_size
from .compression import CompressionConfig
from .load import default_config_path, load_config
from .placement import ALLOWED_POLICIES, POLICY_ALIASES, RESTORE_MODES, SchedulerConfig
from .remote import REMOTE_SCHEMES, REMOTE_WRITE_MODES, RemoteConfig
from .runtime import ALLOWED_COPY_ENGINES, MAX_COPY_DELAY_US, CopiesConfig, MetricsConfig
from .schema import BLOCK_SIZE_AUTO, BlockSizeAutoConfig, Config
from .tiers import ALLOWED_ADMIT, ALLOWED_BACKENDS, ALLOWED_PINNED, ALLOWED_WARM_LAYOUTS, ColdConfig, HotConfig, WarmConfig

__all__ = ["ALLOWED_ADMIT", "ALLOWED_BACKENDS", "ALLOWED_COMPRESSION", "ALLOWED_COPY_ENGINES", "ALLOWED_PINNED",
           "ALLOWED_POLICIES", "ALLOWED_WARM_LAYOUTS", "BLOCK_SIZE_AUTO", "BlockSizeAutoConfig", "ColdConfig", "CompressionConfig",
           "Config", "ConfigError", "CopiesConfig", "HotConfig", "MAX_BLOCK_SIZE_TOKENS", "MAX_COPY_DELAY_US", "MetricsConfig",
           "POLICY_ALIASES", "REMOTE_SCHEMES", "REMOTE_WRITE_MODES", "RESTORE_MODES", "RemoteConfig",
           "SchedulerConfig", "WarmConfig", "default_config_path", "load_config", "parse_size"]
