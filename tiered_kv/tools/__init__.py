"""Tools behind the `tiered-kv` subcommands.

Offline tools over a cold directory (`tiered-kv inspect`, `tiered-kv gc`): scanning it read-only
(cold_scan.py), choosing and dropping records (cold_gc.py), and printing what was found (cold_report.py).

`tiered-kv diagnose`: one prompt run and measured (diagnose.py, with memory_probe.py), the figures
and their JSON and text (diagnose_report.py), and the flags found from them (diagnose_flags.py).

`tiered-kv quality`: what a compression mode costs a model, measured over a text (quality.py)."""
