"""Text and JSON renderings of a ColdScan and of a gc's drops (no I/O)."""

from __future__ import annotations

import time
from collections import defaultdict

from .cold_scan import ColdScan, Record

ROOT_HEX_CHARS = 16


def human_bytes(num_bytes: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if num_bytes >= size:
            return f"{num_bytes / size:.1f} {unit}"
    return f"{num_bytes} B"


def _when(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(seconds))


def roots_of(records: list[Record]) -> list[dict]:
    """Per root key (model fingerprint): blocks, record bytes, last access range; most blocks first."""
    groups = defaultdict(list)
    for record in records:
        groups[record.root].append(record)
    return [{"root": root.hex(), "blocks": len(rs), "record_bytes": sum(r.record_bytes for r in rs),
             "first_access": min(r.last_access for r in rs), "last_access": max(r.last_access for r in rs)}
            for root, rs in sorted(groups.items(), key=lambda item: (-len(item[1]), item[0]))]


def inspect_json(found: ColdScan) -> dict:
    files = []
    for f in found.files:
        layout = f.layout
        files.append({
            "name": f.name, "index": f.index_name, "file_bytes": f.size_bytes, "problem": f.problem,
            "attached": f.attached, "owner_pid": f.owner_pid,
            "layout": None if layout is None else {
                "num_layers": layout.num_layers, "num_kv_heads": layout.num_kv_heads, "head_dim": layout.head_dim,
                "block_size": layout.block_size, "dtype": layout.dtype_name, "compression": layout.compression,
                "block_bytes": layout.block_bytes,
                "record_stride_bytes": f.stride_bytes},
            "capacity_slots": f.capacity_slots,
            "capacity_bytes": None if f.capacity_slots is None else f.capacity_slots * f.stride_bytes,
            "used_records": len(f.records),
            "free_slots": None if f.capacity_slots is None else max(0, f.capacity_slots - len(f.records)),
            "roots": roots_of(f.records),
            "verify": None if f.bad is None else {"ok": len(f.records) - len(f.bad),
                                                  "bad": [{"slot": s, "reason": why} for s, why in f.bad]},
        })
    return {"path": found.path, "store_running": found.store_running, "free_disk_bytes": found.free_disk_bytes,
            "attached": [{"file": name, "pid": pid} for name, pid in found.attached],
            "files": files, "ignored": [{"name": n, "why": why} for n, why in found.ignored]}


def inspect_text(found: ColdScan) -> str:
    running = "yes" if found.store_running else "no"
    lines = [f"cold directory {found.path}",
             f"  store running: {running}; free disk {human_bytes(found.free_disk_bytes)}"]
    attached = found.attached
    lines.append(f"  processes attached: {len(attached)}" + "".join(
        f"\n    pid {pid if pid is not None else '?'} writes {name}" for name, pid in attached))
    for f in inspect_json(found)["files"]:
        lines.append(f["name"] if f["file_bytes"] is not None else f"{f['name']} (missing; index {f['index']})")
        if f["attached"]:
            lines.append(f"  attached: a running store (pid {f['owner_pid'] or '?'}) writes this file")
        layout = f["layout"]
        if layout:
            lines.append(f"  layout: {layout['num_layers']} layers x {layout['num_kv_heads']} kv heads x head_dim "
                         f"{layout['head_dim']}, block {layout['block_size']} tokens, {layout['dtype']}"
                         f"{'' if layout['compression'] == 'none' else ', compressed ' + layout['compression']} "
                         f"({layout['block_bytes']} B of KV in a {layout['record_stride_bytes']} B record)")
        if f["capacity_slots"] is not None:
            lines.append(f"  capacity: {f['capacity_slots']} slots, {human_bytes(f['capacity_bytes'])}; "
                         f"file {human_bytes(f['file_bytes'])}")
        if f["problem"]:
            lines.append(f"  {f['problem']}")
        else:
            lines.append(f"  records: {f['used_records']} used, {f['free_slots']} free slots")
        for root in f["roots"]:
            lines.append(f"  root {root['root'][:ROOT_HEX_CHARS]}: {root['blocks']} blocks, "
                         f"{human_bytes(root['record_bytes'])}, last access {_when(root['first_access'])} .. "
                         f"{_when(root['last_access'])}")
        if f["verify"] is not None:
            lines.append(f"  verify: {f['verify']['ok']} ok, {len(f['verify']['bad'])} bad")
            lines += [f"    slot {bad['slot']}: {bad['reason']}" for bad in f["verify"]["bad"]]
    lines += [f"ignored: {name} ({why})" for name, why in found.ignored]
    return "\n".join(lines)


def gc_text(found: ColdScan, drops, dry_run: bool) -> str:
    verb = "would drop" if dry_run else "dropped"
    lines = [f"skipped {f.name}: {f.problem}" for f in found.files if f.problem]
    lines += [f"{verb} {d.record.file} slot {d.record.slot} (root {d.record.root.hex()[:ROOT_HEX_CHARS]}, "
              f"{d.reason})" for d in drops]
    total = sum(d.record.record_bytes for d in drops)
    lines.append(f"{verb} {len(drops)} records, {human_bytes(total)}")
    return "\n".join(lines)
