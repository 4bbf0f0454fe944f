"""Pictures of a trace: tier occupancy per forward pass, hit rate, bytes moved and TTFT per turn.

matplotlib is an optional extra (`pip install 'tiered_kv[plot]'`), imported only when a plot is
drawn. Figures are drawn on matplotlib's Agg canvas through its object API: nothing touches
pyplot's global state or the user's chosen backend.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import TraceError
from ..scheduler import TIER_NAMES
from .reader import Trace

PLOT_INSTALL_HINT = "pip install 'tiered_kv[plot]'"
PNG_NAMES = ("occupancy.png", "hit_rate.png", "bytes_moved.png", "ttft.png")
TIER_COLORS = {"hot": "#d62728", "warm": "#ff7f0e", "cold": "#1f77b4"}
DIRECTION_STYLES = {  # moves down solid, moves up dashed
    "hot->warm": ("#ff7f0e", "-"), "warm->cold": ("#1f77b4", "-"), "hot->cold": ("#9467bd", "-"),
    "warm->hot": ("#2ca02c", "--"), "cold->warm": ("#17becf", "--"), "cold->hot": ("#8c564b", "--"),
}
DPI = 100
MIB = 2**20


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed; the message says how to install it."""


def _figure_class():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise PlotUnavailable(f"tiered-kv plot needs matplotlib ({exc}); install it with: {PLOT_INSTALL_HINT}") \
            from None

    def new_figure(**kwargs):
        fig = Figure(**kwargs)
        FigureCanvasAgg(fig)
        return fig
    return new_figure


def plot_trace(trace: Trace, out_dir: str | os.PathLike) -> list[Path]:
    """Draw the four PNGs (PNG_NAMES) of `trace` into `out_dir` (created if missing); their paths."""
    if not trace.steps:
        raise TraceError(f"trace file {str(trace.path)!r} has no step records: nothing to plot")
    new_figure = _figure_class()
    out_dir = Path(out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise TraceError(f"plot folder {str(out_dir)!r}: cannot create it ({exc.strerror or exc})") from None
    drawings = (_occupancy, _hit_rate, _bytes_moved, _ttft)
    paths = []
    for name, draw in zip(PNG_NAMES, drawings):
        fig = draw(trace, new_figure)
        path = out_dir / name
        try:
            fig.savefig(path, dpi=DPI)
        except OSError as exc:
            raise TraceError(f"plot {str(path)!r}: cannot write it ({exc.strerror or exc})") from None
        paths.append(path)
    return paths


# ---- helpers ---------------------------------------------------------------------------------
def _size_text(num_bytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.3g} {unit}"
    return f"{num_bytes:.0f} B"


def _step_numbers(trace: Trace) -> list[int]:
    """The x axis of the per-step pictures: forward passes of the chat, 1, 2, ... (a step axis
    rather than seconds: turns stay apart however fast the machine ran each)."""
    return list(range(1, len(trace.steps) + 1))


def _turn_starts(trace: Trace) -> list[tuple[int, float]]:
    """(turn, x where its first step begins) for every turn the steps show."""
    starts, seen = [], set()
    for number, step in zip(_step_numbers(trace), trace.steps):
        if step["turn"] not in seen:
            seen.add(step["turn"])
            starts.append((step["turn"], number - 0.5))
    return starts


def _mark_turns(ax, starts, label: bool) -> None:
    span = (starts[-1][1] - starts[0][1]) or 1.0
    last_label_x = None
    for turn, x in starts:
        ax.axvline(x, color="0.6", linewidth=0.8, linestyle=":", zorder=0)
        if label and (last_label_x is None or x - last_label_x >= span / 25):  # no overlapping labels
            ax.text(x, 1.01, f" turn {turn}", transform=ax.get_xaxis_transform(), fontsize=7, color="0.35",
                    va="bottom", ha="left")
            last_label_x = x


def _no_data(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", color="0.4")
    ax.set_xticks([])
    ax.set_yticks([])


def _subtitle(trace: Trace) -> str:
    start = trace.start
    model = (start.get("model") or "").rstrip("/\\")
    parts = [os.path.basename(model) or "model unknown", f"block {start['block_size']} tokens"]
    if start["block_bytes"]:
        parts[-1] += f" = {_size_text(start['block_bytes'])}"
    parts.append(f"policy {start.get('policy', '?')}")
    if not trace.is_complete:
        parts.append("trace cut short (no end line)")
    return " | ".join(parts)


# ---- the four pictures -----------------------------------------------------------------------
def _occupancy(trace: Trace, new_figure):
    steps, start = trace.steps, trace.start
    tiers = [name for name in TIER_NAMES
             if start["tiers"][name]["capacity_blocks"] > 0 or any(s["used_blocks"][name] for s in steps)]
    fig = new_figure(figsize=(9, 1.1 + 2.0 * len(tiers)), layout="constrained")
    axes = fig.subplots(len(tiers), 1, sharex=True, squeeze=False)[:, 0]
    xs = _step_numbers(trace)
    starts = _turn_starts(trace)
    for i, (ax, name) in enumerate(zip(axes, tiers)):
        used = [s["used_blocks"][name] for s in steps]
        capacity = start["tiers"][name]["capacity_blocks"]
        color = TIER_COLORS[name]
        ax.fill_between(xs, used, step="mid", color=color, alpha=0.25, linewidth=0)
        ax.step(xs, used, where="mid", color=color, linewidth=1.4, label=f"{name}: blocks used")
        peak = max(used)
        if capacity <= 3 * max(peak, 1):  # on scale: draw it
            ax.axhline(capacity, color="0.3", linestyle="--", linewidth=1, label=f"capacity {capacity} blocks")
            top = max(capacity, peak)
        else:  # a large tier: say its capacity, keep the used line readable
            ax.plot([], [], color="none", label=f"capacity {capacity} blocks (off scale)")
            top = peak
        ax.set_ylim(0, max(top, 1) * 1.18)
        ax.set_ylabel(f"{name} (blocks)")
        ax.legend(loc="upper left", fontsize=8, framealpha=0.9)
        ax.grid(axis="y", alpha=0.3)
        _mark_turns(ax, starts, label=i == 0)
    axes[-1].set_xlabel("forward pass of the chat (blocks used after it)")
    fig.suptitle(f"Tier occupancy per forward pass\n{_subtitle(trace)}", fontsize=11)
    return fig


def _hit_rate(trace: Trace, new_figure):
    fig = new_figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.subplots()
    turns = trace.turns
    if not turns:
        _no_data(ax, "no finished turn in this trace")
    else:
        x = [t["turn"] for t in turns]
        bottom = [0.0] * len(turns)
        for name in TIER_NAMES:
            share = [100 * (t["hit_rate"][name] or 0.0) for t in turns]
            ax.bar(x, share, bottom=bottom, color=TIER_COLORS[name], label=f"found in {name}", width=0.7)
            for turn, b, value in zip(x, bottom, share):
                if value >= 8:  # room for its label
                    ax.text(turn, b + value / 2, f"{value:.0f}%", ha="center", va="center", fontsize=8,
                            color="white")
            bottom = [b + s for b, s in zip(bottom, share)]
        for t in turns:
            text = f"{t['turn_blocks']} blocks" if t["turn_blocks"] else "no history"
            ax.text(t["turn"], 101 if t["turn_blocks"] else 2, text, ha="center", va="bottom", fontsize=8,
                    rotation=0 if t["turn_blocks"] else 90)
        ax.set_xticks(x)
        ax.set_ylim(0, 112)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
        ax.set_xlabel("turn")
        ax.set_ylabel("history blocks found in tier (%)")
    ax.set_title(f"Hit rate per turn: where each turn found its history\n{_subtitle(trace)}", fontsize=11)
    return fig


def _bytes_moved(trace: Trace, new_figure):
    fig = new_figure(figsize=(9, 6.5), layout="constrained")
    over_time, per_turn = fig.subplots(2, 1)
    last = trace.steps[-1]["bytes_moved"]
    directions = [d for d in DIRECTION_STYLES if last.get(d)] + \
        sorted(d for d in last if d not in DIRECTION_STYLES and last[d])
    if not directions:
        _no_data(over_time, "no block moved between tiers")
        _no_data(per_turn, "no block moved between tiers")
    else:
        xs = _step_numbers(trace)
        for d in directions:
            color, style = DIRECTION_STYLES.get(d, (None, "-"))
            over_time.step(xs, [s["bytes_moved"].get(d, 0) / MIB for s in trace.steps], where="mid",
                           color=color, linestyle=style, linewidth=1.5, label=d)
        _mark_turns(over_time, _turn_starts(trace), label=True)
        over_time.set_xlabel("forward pass of the chat (moved by its end)")
        over_time.set_ylabel("cumulative (MiB)")
        over_time.legend(loc="upper left", fontsize=8, framealpha=0.9)
        over_time.grid(alpha=0.3)
        if trace.turns:
            x = [t["turn"] for t in trace.turns]
            bottom = [0.0] * len(x)
            for d in directions:
                color, _ = DIRECTION_STYLES.get(d, (None, "-"))
                mib = [t["bytes_moved"].get(d, 0) / MIB for t in trace.turns]
                per_turn.bar(x, mib, bottom=bottom, color=color, label=d, width=0.7,
                             hatch="//" if DIRECTION_STYLES.get(d, ("", "-"))[1] == "--" else None,
                             edgecolor="white", linewidth=0.5)
                bottom = [b + m for b, m in zip(bottom, mib)]
            per_turn.set_xticks(x)
            per_turn.set_xlabel("turn")
            per_turn.set_ylabel("moved in the turn (MiB)")
            per_turn.legend(loc="upper left", fontsize=8, framealpha=0.9)
            per_turn.grid(axis="y", alpha=0.3)
        else:
            _no_data(per_turn, "no finished turn in this trace")
    fig.suptitle(f"Bytes moved between tiers (solid: down, dashed/hatched: up)\n{_subtitle(trace)}", fontsize=11)
    return fig


def _ttft(trace: Trace, new_figure):
    fig = new_figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.subplots()
    turns = trace.turns
    if not turns:
        _no_data(ax, "no finished turn in this trace")
    else:
        in_ms = max(t["ttft_s"] for t in turns) < 1.0
        scale, unit = (1000.0, "ms") if in_ms else (1.0, "s")
        x = [t["turn"] for t in turns]
        values = [t["ttft_s"] * scale for t in turns]
        ax.bar(x, values, color="#4c72b0", width=0.7)
        top = max(values)
        for t, value in zip(turns, values):
            ax.text(t["turn"], value + top * 0.02, f"{value:.3g} {unit}\n{t['computed_tokens']} computed\n"
                    f"{t['reused_tokens']} reused", ha="center", va="bottom", fontsize=7)
        ax.set_ylim(0, top * 1.35 or 1)
        ax.set_xticks(x)
        ax.set_xlabel("turn")
        ax.set_ylabel(f"time to first token ({unit})")
        ax.grid(axis="y", alpha=0.3)
    ax.set_title(f"Time to first token per turn (prompt tokens computed / reused)\n{_subtitle(trace)}", fontsize=11)
    return fig
