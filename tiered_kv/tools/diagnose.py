"""`diagnose(model, tokenizer, cfg)`: a measured memory-pathway report of one real prompt.

Builds a CacheBank on `cfg` with tiered_kv.hooks (exact mode, as `tiered-kv chat` does), binds
its store before anything runs (so the tier slabs and staging exist before the baseline is
read), then runs ONE `model.generate(cache=bank)` of a deterministic prompt of `prompt_tokens`
tokens and `new_tokens` greedy tokens, and reads what it took:

  weights        numel x element size of every parameter (a tied tensor once) and buffer
  activations    CUDA: torch.cuda.max_memory_allocated over generate() above the start, minus
                 what stayed allocated after it; CPU: the same from the bytes of the tensor
                 storages created during generate() (memory_probe.LiveTensorBytes), since
                 torch keeps no CPU allocator statistics; plus the process RSS before, at its
                 peak (VmHWM, reset just before) and after: process-wide, allocator caches included
  KV per tier    reserved: the hot and warm slab tensors' bytes, the cold block file's size on
                 disk; used: blocks in use x block bytes (hot slab bytes / hot slots); this
                 prompt's blocks per tier; the empty slots of its partly filled last block
  buffers        the store's staging tensors and the bank's gather buffer, their own bytes
  link           the link monitor's saturation, sampled after every forward and at the end

Flags (diagnose_flags.py) are found from those figures; the report's JSON and text are
diagnose_report.py. Nothing here prints.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import time

import torch
from transformers.generation.streamers import BaseStreamer

from .. import hooks
from ..bank import CacheBank
from ..blocks import COLD, HOT, TIER_NAMES, layout_from_model_config, num_blocks_for
from ..config import Config, load_config
from .diagnose_flags import Thresholds, find_flags
from .diagnose_report import (ActivationFigures, BufferFigures, KVFigures, LayoutFigures, LinkFigures, ModelFigures,
                              ProcessFigures, Report, RunFigures, TierFigures)
from .memory_probe import LiveTensorBytes, process_rss, reset_rss_peak, tensor_bytes

log = logging.getLogger(__name__)

DEFAULT_PROMPT_TOKENS = 1000
DEFAULT_NEW_TOKENS = 4
PROMPT_TEXT = (
    "A paged key-value cache splits the attention history of a conversation into blocks of a fixed number "
    "of tokens. Blocks that are read often stay in device memory; the others move to host memory or to "
    "files on a fast disk, and come back when a later turn needs them. "
)
FIRST_SYNTHETIC_ID = 3  # without a tokenizer: ids cycle from here (clear of the usual pad/bos/eos ids)


def prompt_ids(tokenizer, num_tokens: int, vocab_size: int) -> list[int]:
    """`num_tokens` deterministic prompt ids: PROMPT_TEXT tokenized, repeated and cut; without a
    tokenizer, ids cycling through the vocabulary."""
    if tokenizer is not None:
        unit = list(tokenizer(PROMPT_TEXT, add_special_tokens=False)["input_ids"])
    else:
        unit = list(range(FIRST_SYNTHETIC_ID, max(vocab_size, FIRST_SYNTHETIC_ID + 1)))
    return (unit * -(-num_tokens // len(unit)))[:num_tokens]


class _SaturationSampler(BaseStreamer):
    """A generate() streamer: samples the link saturation after every forward."""

    def __init__(self, link_monitor) -> None:
        self.link_monitor = link_monitor
        self.samples: list[float] = []

    def put(self, value) -> None:
        self.samples.append(float(self.link_monitor.saturation()))

    def end(self) -> None:
        pass


def diagnose(model, tokenizer, cfg: Config | dict | str | None = None, *,
             prompt_tokens: int = DEFAULT_PROMPT_TOKENS, new_tokens: int = DEFAULT_NEW_TOKENS,
             thresholds: Thresholds = Thresholds()) -> Report:
    """Run one prompt through a hooked CacheBank on `cfg` and measure it (module docstring).

    Raises LayoutError (as hooks.install does) for a model the hooks cannot serve, before anything
    is built; ValueError naming the limit when the prompt passes the model's positions or all tiers
    together; ConfigError when the config does not fit (e.g. a slab larger than free memory)."""
    cfg = load_config(cfg if cfg is not None else {})
    if prompt_tokens < 1 or new_tokens < 1:
        raise ValueError(f"diagnose: prompt_tokens={prompt_tokens}, new_tokens={new_tokens}; allowed: >= 1 each")
    hooks.check_servable(model)
    max_positions = getattr(model.config, "max_position_embeddings", None)
    if max_positions and prompt_tokens + new_tokens > max_positions:
        raise ValueError(
            f"--prompt-tokens {prompt_tokens} + {new_tokens} generated tokens pass the model's "
            f"max_position_embeddings {max_positions}; allowed: at most {max_positions - new_tokens} prompt tokens")
    parameter = next(model.parameters())
    device, dtype = parameter.device, parameter.dtype
    layout = layout_from_model_config(model.config, cfg.block_size, str(dtype).removeprefix("torch."))
    is_cuda = device.type == "cuda"
    device_allocated_before = torch.cuda.memory_allocated(device) if is_cuda else None
    bank = CacheBank(model, cfg, tokenizer=tokenizer)  # (compression: auto measures the model with it)
    try:
        hooks.install(model, bank, mode="exact")
        try:
            bank.store.bind(layout, dtype)
            _check_fits(bank.store, prompt_tokens, new_tokens, bank.layer_groups)
            report = _measure(model, bank, prompt_ids(tokenizer, prompt_tokens, model.config.vocab_size),
                              new_tokens, device_allocated_before)
        finally:
            hooks.uninstall(model)
    finally:
        bank.close()
    report = dataclasses.replace(report, thresholds=dataclasses.asdict(thresholds))
    return dataclasses.replace(report, flags=find_flags(report, thresholds))


def _check_fits(store, prompt_tokens: int, new_tokens: int, layer_groups) -> None:
    """ValueError when the run cannot fit all tiers: at the prefill's end or the last token, per
    layer group (a sliding group holds only what its window keeps)."""
    block_size = store.layout.block_size
    need_blocks = max(layer_groups.blocks_held(prompt_tokens, 0, block_size),
                      layer_groups.blocks_held(prompt_tokens + new_tokens - 1, None, block_size))
    hot, warm, cold = store.capacities
    if need_blocks > store.total_capacity_blocks:
        raise ValueError(
            f"--prompt-tokens {prompt_tokens} + {new_tokens} generated tokens need {need_blocks} blocks of "
            f"{block_size} tokens but hot+warm+cold hold {store.total_capacity_blocks} blocks "
            f"({store.total_capacity_blocks * block_size} tokens: hot {hot}, warm {warm}, cold {cold}); "
            "raise a tier's capacity or ask for fewer tokens")


def _measure(model, bank: CacheBank, ids: list[int], new_tokens: int, device_allocated_before: int | None) -> Report:
    store = bank.store
    device = store.device
    is_cuda = device.type == "cuda"
    used_blocks_before = [pool.num_used - _durable_copies(store, t) for t, pool in enumerate(store.pools)]
    input_ids = torch.tensor([ids], dtype=torch.long, device=next(model.parameters()).device)
    sampler = _SaturationSampler(store.link_monitor)

    gc.collect()
    rss_before = process_rss().rss_bytes
    peak_was_reset = reset_rss_peak()
    if is_cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        allocated_start = torch.cuda.memory_allocated(device)
    tracker = LiveTensorBytes() if not is_cuda else None
    start = time.perf_counter()
    with tracker if tracker is not None else contextlib.nullcontext():
        output = model.generate(input_ids, cache=bank, attention_mask=torch.ones_like(input_ids),
                                max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                streamer=sampler)
    generate_s = time.perf_counter() - start
    num_new = output.shape[1] - input_ids.shape[1]
    del output
    gc.collect()
    rss = process_rss()
    if is_cuda:
        torch.cuda.synchronize(device)
        peak_above = torch.cuda.max_memory_allocated(device) - allocated_start
        retained = torch.cuda.memory_allocated(device) - allocated_start
        method = "torch.cuda.max_memory_allocated"
    else:
        peak_above, retained = tracker.peak_bytes, tracker.live_bytes
        method = "tensor storages created in generate()"
    activations = ActivationFigures(method, peak_above, retained, max(0, peak_above - retained))
    process = ProcessFigures(
        rss_before, rss.peak_bytes if peak_was_reset else None, rss.rss_bytes,
        device_allocated_before_bytes=device_allocated_before,
        device_max_allocated_bytes=torch.cuda.max_memory_allocated(device) if is_cuda else None,
        device_allocated_after_bytes=torch.cuda.memory_allocated(device) if is_cuda else None,
        device_reserved_bytes=torch.cuda.memory_reserved(device) if is_cuda else None)

    store.wait_for_background()  # a settled store: the figures below describe one state
    stats = bank.stats()
    kv = _kv_figures(store, bank, stats, used_blocks_before)
    buffers = {name: tensor_bytes(t) for name, t in store.reporting.scratch_buffers().items()}
    saturation_end = float(store.link_monitor.saturation())
    cfg = store.config
    return Report(
        model=_model_figures(model, store.layout),
        run=RunFigures(len(ids), num_new, kv.tokens, generate_s),
        activations=activations,
        process=process,
        kv=kv,
        buffers=BufferFigures(buffers["staging_host"], buffers["staging_device"], buffers["mover_staging_host"],
                              buffers["mover_staging_device"], stats["hooks"]["gather_buffer_bytes"]),
        link=LinkFigures(stats["scheduler"]["link_monitor"], max(sampler.samples + [saturation_end]),
                         saturation_end, dict(stats["bytes_moved"])),
        layout=LayoutFigures(float(stats["fragmentation"]), float(stats["contiguity"])),
        settings=_settings(cfg),
        compression=stats["compression"],
        attention=stats["attention"],
    )


def _model_figures(model, layout) -> ModelFigures:
    parameters = list(model.parameters())  # each shared (tied) tensor once
    return ModelFigures(
        model_type=str(getattr(model.config, "model_type", type(model).__name__)),
        device=str(parameters[0].device), dtype=layout.dtype_name,
        num_layers=getattr(model.config.get_text_config(), "num_hidden_layers", layout.num_layers),
        num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim,
        max_positions=getattr(model.config, "max_position_embeddings", None),
        num_parameters=sum(p.numel() for p in parameters),
        parameters_bytes=sum(tensor_bytes(p) for p in parameters),
        buffers_bytes=sum(tensor_bytes(b) for b in model.buffers()))


def _reserved_bytes(store, tier: int) -> int:
    """Bytes the tier holds whatever is in it: its slab tensor, or its block file on disk."""
    return store.tiers[tier].reserved_bytes if store.tiers[tier] is not None else 0


def _durable_copies(store, tier: int) -> int:
    """Cold slots holding only a durable copy of a block above cold (written behind by the mover,
    whenever it gets to it): room the store counts as free (StoreState.free_slots), not as used."""
    copies = store.state.copies
    return len(copies) if tier == COLD and copies else 0


def _kv_figures(store, bank: CacheBank, stats: dict, used_blocks_before: list[int]) -> KVFigures:
    """The KV figures, read from the store's tiers and pools (of a settled store)."""
    block_size = store.layout.block_size
    block_bytes = store.tiers[HOT].reserved_bytes // store.pools[HOT].num_slots
    if block_bytes != store.layout.block_bytes:  # a broken invariant of the hot slab, not a figure to report
        raise RuntimeError(f"diagnose: hot slab holds {block_bytes} bytes per slot; the layout says "
                           f"{store.layout.block_bytes}")
    tokens = int(stats["seq_tokens"])
    # one table per layer group (a hybrid model's sliding groups hold only their windows)
    tables = [bank.block_table(0, g) for g in range(len(bank.layer_groups))]
    num_blocks = sum(map(len, tables))
    whole = num_blocks_for(tokens, block_size)
    held_tokens = sum(tokens - (whole - len(t)) * block_size for t in tables if t)
    tiers = {}
    for t, name in enumerate(TIER_NAMES):
        pool = store.pools[t]
        used = pool.num_used - _durable_copies(store, t)
        prompt_blocks = int(stats["bank_blocks"][name])
        tier_bytes = stats["tiers"][name].get("block_bytes", block_bytes)  # compressed: fewer
        tiers[name] = TierFigures(
            location=str(stats["tiers"][name]["device"]), capacity_blocks=pool.num_slots,
            used_blocks_before=used_blocks_before[t], used_blocks=used, prompt_blocks=prompt_blocks,
            reserved_bytes=_reserved_bytes(store, t), used_bytes=used * tier_bytes,
            prompt_bytes=prompt_blocks * tier_bytes,
            moved_in_bytes=sum(v for k, v in stats["bytes_moved"].items() if k.endswith(f"->{name}")),
            block_bytes=tier_bytes, compression=stats["tiers"][name].get("compression", "none"))
    waste_slots = num_blocks * block_size - held_tokens
    waste_tier = None
    if tables[0] and waste_slots:
        last_tiers, _ = store.placements(tables[0][-1:])
        waste_tier = TIER_NAMES[int(last_tiers[0])]
    bytes_per_token = block_bytes // block_size
    return KVFigures(
        block_size_tokens=block_size, block_size_auto=store.config.block_size_is_auto, block_bytes=block_bytes,
        bytes_per_token=bytes_per_token, tokens=tokens, blocks=num_blocks, used_bytes=num_blocks * block_bytes,
        filled_bytes=held_tokens * bytes_per_token, waste_slots=waste_slots, waste_bytes=waste_slots * bytes_per_token,
        waste_ratio=waste_slots / (num_blocks * block_size) if num_blocks else 0.0, waste_tier=waste_tier,
        reserved_bytes=sum(t.reserved_bytes for t in tiers.values()), tiers=tiers)


def _capacity_key(section) -> str:
    """The key a flag names: the one the config sets the tier's capacity with."""
    return f"{section.SECTION}.{'capacity_blocks' if section.capacity_blocks is not None else 'capacity'}"


def _settings(cfg: Config) -> dict:
    """The config values the flags compare figures with, and the keys they name."""
    s = cfg.scheduler
    return {
        "hot.capacity_key": _capacity_key(cfg.hot), "warm.capacity_key": _capacity_key(cfg.warm),
        "cold.capacity_key": _capacity_key(cfg.cold), "hot.high_watermark": cfg.hot.high_watermark,
        "cold.configured": cfg.cold.capacity_blocks != 0 and cfg.cold.capacity_bytes != 0,
        "scheduler.bs_threshold": s.bs_threshold, "scheduler.max_fragmentation": s.max_fragmentation,
        "scheduler.min_contiguity": s.min_contiguity, "scheduler.background": s.background,
    }
