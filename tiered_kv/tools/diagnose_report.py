"""What `tiered-kv diagnose` found: the figures (plain dataclasses), their JSON form and their text.

No torch and no I/O here: tools/diagnose.py measures and fills a `Report`, diagnose_flags.py
reads one. Every byte figure is an int of bytes (`*_bytes`); None means "not measured here"
(e.g. CUDA allocator figures on a CPU run, RSS where /proc does not give it).

Totals (`Report.totals()`): `device_bytes` is what the measured figures put on the compute
device (weights, buffers, activations' peak, the hot slab, the gather buffer, device staging);
`host_bytes` what they put in host RAM beside it (the warm slab, host staging). On a CPU run both
are the same RAM, reported apart so the two cases read alike. `kv_share` is the hot slab's share
of `device_bytes`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

TIER_NAMES = ("hot", "warm", "cold")  # the order of tiered_kv.scheduler.TIER_NAMES (which imports torch)
MIB = 2**20


@dataclass(frozen=True)
class ModelFigures:
    model_type: str
    device: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_positions: int | None
    num_parameters: int
    parameters_bytes: int  # sum of numel x element size over model.parameters() (a tied tensor once)
    buffers_bytes: int  # the same over model.buffers() (rotary tables and the like)


@dataclass(frozen=True)
class RunFigures:
    prompt_tokens: int
    new_tokens: int  # tokens generate() produced after the prompt
    kv_tokens: int  # tokens whose K/V the bank holds at the end (the last new token is never fed back)
    generate_s: float


@dataclass(frozen=True)
class ActivationFigures:
    """Memory taken by generate() beyond what it kept: `peak_bytes` = `peak_above_start_bytes`
    (highest allocated during generate() above the level before it) - `retained_bytes` (what was
    still allocated after it: the gather buffer, the output ids)."""
    method: str
    peak_above_start_bytes: int
    retained_bytes: int
    peak_bytes: int


@dataclass(frozen=True)
class ProcessFigures:
    """Process-wide readings: RSS includes everything the process holds, allocator caches too."""
    rss_before_bytes: int | None  # VmRSS just before generate() (model loaded, tiers allocated)
    rss_peak_bytes: int | None  # VmHWM over generate() (None when the peak could not be reset)
    rss_after_bytes: int | None
    device_allocated_before_bytes: int | None = None  # CUDA: torch.cuda.memory_allocated before the bank
    device_max_allocated_bytes: int | None = None  # CUDA: torch.cuda.max_memory_allocated over generate()
    device_allocated_after_bytes: int | None = None
    device_reserved_bytes: int | None = None  # CUDA: torch.cuda.memory_reserved at the end


@dataclass(frozen=True)
class TierFigures:
    location: str  # the device, "cpu", the block file, or why the tier is off
    capacity_blocks: int
    used_blocks_before: int  # store-wide, before the prompt (e.g. durable cold records of earlier runs)
    used_blocks: int  # store-wide, at the end
    prompt_blocks: int  # this prompt's blocks in the tier at the end
    reserved_bytes: int  # measured: the slab tensor's bytes (hot, warm), the block file's size (cold)
    used_bytes: int  # used_blocks x block_bytes
    prompt_bytes: int  # prompt_blocks x block_bytes
    moved_in_bytes: int  # bytes moved into the tier during the run
    block_bytes: int = 0  # one block as this tier stores it (fewer than hot's when compressed)
    compression: str = "none"

    @property
    def touched(self) -> bool:
        """Whether the run put anything in this tier."""
        return self.prompt_blocks > 0 or self.moved_in_bytes > 0 or self.used_blocks != self.used_blocks_before


@dataclass(frozen=True)
class KVFigures:
    block_size_tokens: int
    block_size_auto: bool
    block_bytes: int  # measured: hot slab bytes / hot slots
    bytes_per_token: int
    tokens: int
    blocks: int  # this prompt's blocks, all tiers
    used_bytes: int  # blocks x block_bytes
    filled_bytes: int  # tokens x bytes_per_token
    waste_slots: int  # token slots of the prompt's blocks left empty (its last, partly filled block)
    waste_bytes: int
    waste_ratio: float  # waste_slots / (blocks x block_size_tokens)
    waste_tier: str | None  # where the partly filled block sits
    reserved_bytes: int  # all tiers
    tiers: dict[str, TierFigures] = field(default_factory=dict)


@dataclass(frozen=True)
class BufferFigures:
    staging_host_bytes: int  # the store's host buffer for moves into and out of cold
    staging_device_bytes: int  # the store's device buffer for hot<->warm batches (CUDA only)
    mover_staging_host_bytes: int  # the background mover's host buffer
    mover_staging_device_bytes: int  # the background mover's device buffer (CUDA only)
    gather_buffer_bytes: int  # the bank's buffer of one layer's gathered history

    @property
    def device_bytes(self) -> int:
        return self.staging_device_bytes + self.mover_staging_device_bytes + self.gather_buffer_bytes

    @property
    def host_bytes(self) -> int:
        return self.staging_host_bytes + self.mover_staging_host_bytes


@dataclass(frozen=True)
class LinkFigures:
    monitor: str  # "measured" (our own copy rate over a calibrated peak) or "nvml" (PCIe throughput)
    saturation_peak: float  # highest of the samples taken after each forward of generate() and at the end
    saturation_end: float
    bytes_moved: dict[str, int] = field(default_factory=dict)  # "hot->warm": bytes, ...


@dataclass(frozen=True)
class LayoutFigures:
    fragmentation: float  # hot pool: 1 - largest free run / free slots
    contiguity: float  # this prompt's hot blocks: share in its longest run of consecutive slots


@dataclass(frozen=True)
class Flag:
    """Something the numbers show, and which config key to turn which way."""
    id: str
    shows: str  # what the figures show, with the figure
    config_key: str
    direction: str  # e.g. "raise hot.capacity to at least 72.0 MiB"
    value: float
    threshold: float


@dataclass(frozen=True)
class Report:
    model: ModelFigures
    run: RunFigures
    activations: ActivationFigures
    process: ProcessFigures
    kv: KVFigures
    buffers: BufferFigures
    link: LinkFigures
    layout: LayoutFigures
    settings: dict  # the config values the flags compare with ("scheduler.bs_threshold": 0.8, ...)
    thresholds: dict = field(default_factory=dict)  # the flags' own thresholds (diagnose_flags.Thresholds)
    flags: list[Flag] = field(default_factory=list)
    compression: dict = field(default_factory=dict)  # stats()["compression"] (compression/auto.py)
    attention: dict = field(default_factory=dict)  # stats()["attention"] (bank/attention_steps.py)

    def totals(self) -> dict:
        m, kv = self.model, self.kv
        hot_bytes = kv.tiers["hot"].reserved_bytes
        device_bytes = (m.parameters_bytes + m.buffers_bytes + self.activations.peak_bytes + hot_bytes
                        + self.buffers.device_bytes)
        host_bytes = kv.tiers["warm"].reserved_bytes + self.buffers.host_bytes
        return {"device_bytes": device_bytes, "host_bytes": host_bytes,
                "cold_file_bytes": kv.tiers["cold"].reserved_bytes,
                "kv_share": hot_bytes / device_bytes if device_bytes else 0.0}


def report_json(report: Report) -> dict:
    """The stable JSON form: every dataclass as an object of its fields, plus `totals`."""
    out = dataclasses.asdict(report)
    out["totals"] = report.totals()
    for name, tier in report.kv.tiers.items():
        out["kv"]["tiers"][name]["touched"] = tier.touched
    return out


# ---- text -----------------------------------------------------------------------------------
def _mib(num_bytes: int | None) -> str:
    return "-" if num_bytes is None else f"{num_bytes / MIB:,.1f}"


def _bytes(num_bytes: int | None) -> str:
    return "-" if num_bytes is None else f"{num_bytes:,}"


def compression_text(c: dict) -> str:
    """One line: each tier's mode (and what was asked when it differs), the floor, what was measured."""
    modes, asked = c.get("mode"), c.get("requested")
    if not isinstance(modes, dict):
        modes = {key: modes for key in (asked if isinstance(asked, dict) else ("warm", "cold", "remote"))}
    if not isinstance(asked, dict):
        asked = {key: asked for key in modes}
    tiers = ", ".join(f"{key} {mode}" + (f" (asked {asked[key]})" if asked.get(key) != mode else "")
                      for key, mode in modes.items())
    measured = ", ".join(f"{mode} {100 * value:.2f}%" + (f" (ppl x{c['ppl_ratio'][mode]:.4f})"
                                                         if c.get("ppl_ratio", {}).get(mode) else "")
                         for mode, value in c.get("measured", {}).items()) or "nothing"
    return (f"compression: {tiers}; quality_floor {100 * c.get('quality_floor', 0):.2f}% next-token agreement; "
            f"measured {measured} (source {c.get('source')}, {c.get('calibration_s', 0.0):.2f} s)")


def attention_text(a: dict) -> str:
    """One line: how many decode steps were sampled, the share of their attention each tier served."""
    shares = a.get("mass_share_by_tier") or {}
    served = ", ".join(f"{tier} {100 * share:.1f}%" for tier, share in shares.items()) or "nothing sampled yet"
    line = (f"attention: {a.get('sampled_steps', 0)} of {a.get('decode_steps', 0)} decode steps sampled "
            f"(attention.sample_steps {a.get('sample_steps')}); share of their attention mass served by {served}")
    sparse = a.get("sparse")
    if sparse:
        read = sparse.get("read_share_below_hot")
        line += (f"; sparse reads (budget {sparse['budget']}): {sparse['steps']} steps read "
                 f"{'-' if read is None else f'{100 * read:.1f}%'} of the blocks below hot")
    return line


def memory_rows(report: Report) -> list[tuple[str, int | None, str]]:
    """(label, bytes, how it was measured) of the memory table, in order."""
    m, a, p, b = report.model, report.activations, report.process, report.buffers
    rows = [
        ("weights: parameters", m.parameters_bytes, f"sum of parameter tensor bytes ({m.num_parameters:,} values)"),
        ("weights: buffers", m.buffers_bytes, "sum of buffer tensor bytes"),
        ("activations: peak of generate()", a.peak_bytes,
         f"{a.method}: peak {a.peak_above_start_bytes:,} B above the start - {a.retained_bytes:,} B kept after"),
    ]
    for name in TIER_NAMES:
        tier = report.kv.tiers[name]
        rows.append((f"KV {name}: reserved", tier.reserved_bytes,
                     "block file size on disk" if name == "cold" else "slab tensor bytes"))
        rows.append((f"KV {name}: used", tier.used_bytes, f"{tier.used_blocks}/{tier.capacity_blocks} blocks in use"))
    rows += [
        ("KV waste: partly filled block", report.kv.waste_bytes,
         f"{report.kv.waste_slots} empty token slots ({100 * report.kv.waste_ratio:.1f}% of the prompt's slots)"),
        ("staging: cold moves (host)", b.staging_host_bytes, "tensor bytes"),
        ("staging: hot<->warm (device)", b.staging_device_bytes, "tensor bytes (CUDA only)"),
        ("staging: mover (host)", b.mover_staging_host_bytes, "tensor bytes (scheduler.background)"),
        ("staging: mover (device)", b.mover_staging_device_bytes, "tensor bytes (CUDA only)"),
        ("gather buffer", b.gather_buffer_bytes, "tensor bytes (1 layer of gathered history)"),
        ("process RSS: before generate()", p.rss_before_bytes, "VmRSS, process-wide"),
        ("process RSS: peak of generate()", p.rss_peak_bytes, "VmHWM after a reset, process-wide"),
        ("process RSS: after generate()", p.rss_after_bytes, "VmRSS, process-wide"),
    ]
    if p.device_allocated_before_bytes is not None:
        rows += [
            ("device: allocated before the bank", p.device_allocated_before_bytes, "torch.cuda.memory_allocated"),
            ("device: max allocated in generate()", p.device_max_allocated_bytes, "torch.cuda.max_memory_allocated"),
            ("device: allocated after", p.device_allocated_after_bytes, "torch.cuda.memory_allocated"),
            ("device: reserved by torch", p.device_reserved_bytes, "torch.cuda.memory_reserved"),
        ]
    return rows


def report_text(report: Report) -> str:
    m, r, kv, link, layout = report.model, report.run, report.kv, report.link, report.layout
    totals = report.totals()
    lines = [
        f"tiered-kv diagnose: {m.model_type} on {m.device}, {m.dtype}, {m.num_layers} layers x "
        f"{m.num_kv_heads} KV heads x {m.head_dim} head_dim",
        f"prompt {r.prompt_tokens} tokens + {r.new_tokens} generated: KV of {r.kv_tokens} tokens in {kv.blocks} "
        f"blocks of {kv.block_size_tokens} tokens{' (auto)' if kv.block_size_auto else ''} "
        f"({kv.block_bytes:,} B each, {kv.bytes_per_token:,} B per token); generate() {r.generate_s:.2f} s",
        "",
        f"{'memory (measured)':<38}{'bytes':>16}{'MiB':>11}  how",
    ]
    for label, num_bytes, how in memory_rows(report):
        lines.append(f"  {label:<36}{_bytes(num_bytes):>16}{_mib(num_bytes):>11}  {how}")
    lines += [
        f"  {'total on the compute device':<36}{_bytes(totals['device_bytes']):>16}"
        f"{_mib(totals['device_bytes']):>11}  weights + activations + hot + stream/device staging "
        f"(KV share {100 * totals['kv_share']:.1f}%)",
        f"  {'total in host RAM beside it':<36}{_bytes(totals['host_bytes']):>16}{_mib(totals['host_bytes']):>11}"
        "  warm + host staging",
        "",
        "KV by tier       blocks used/capacity  prompt blocks  moved in (B)  B/block (compression)  where",
    ]
    for name in TIER_NAMES:
        tier = kv.tiers[name]
        lines.append(f"  {name:<14} {f'{tier.used_blocks}/{tier.capacity_blocks}':>20} {tier.prompt_blocks:>14} "
                     f"{tier.moved_in_bytes:>13,}  {f'{tier.block_bytes:,} ({tier.compression})':>21}  {tier.location}")
    moved = ", ".join(f"{k} {v:,} B" for k, v in link.bytes_moved.items() if v) or "none"
    lines += [
        "",
        f"link ({link.monitor} monitor): saturation peak {link.saturation_peak:.2f}, at the end "
        f"{link.saturation_end:.2f} (scheduler.bs_threshold {report.settings['scheduler.bs_threshold']}); "
        f"bytes moved: {moved}",
        f"hot layout: fragmentation {layout.fragmentation:.2f} (scheduler.max_fragmentation "
        f"{report.settings['scheduler.max_fragmentation']}), this prompt's contiguity {layout.contiguity:.2f} "
        f"(scheduler.min_contiguity {report.settings['scheduler.min_contiguity']})",
        *([compression_text(report.compression)] if report.compression else []),
        *([attention_text(report.attention)] if report.attention else []),
        "",
    ]
    if not report.flags:
        lines.append("flags: none")
    else:
        lines.append(f"flags ({len(report.flags)}):")
        for flag in report.flags:
            lines.append(f"  [{flag.id}] {flag.shows}")
            lines.append(f"      -> {flag.direction}")
    return "\n".join(lines)
