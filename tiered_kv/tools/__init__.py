"""Offline tools over a cold directory (`tiered-kv inspect`, `tiered-kv gc`): scanning it read-only
(cold_scan.py), choosing and dropping records (cold_gc.py), and printing what was found (cold_report.py)."""
