"""bench/crash.py at its smallest sizes: SIGKILLed chats reattached, and processes sharing one cold.path."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(tmp_path, *argv) -> dict:
    out = tmp_path / "crash.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "crash.py"), *argv, "--json", str(out)],
                          timeout=600, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text())


def test_kills_smallest_size(tmp_path):
    result = _run(tmp_path, "--kills", "2", "--conversations", "2")
    assert result["kills"] == 2 and result["wrong"] == 0 and result["bad_records"] == 0
    assert all(t["correct"] for t in result["trials"])
    assert all(0 <= t["share"] <= 1 for t in result["trials"])


def test_share_smallest_size(tmp_path):
    result = _run(tmp_path, "--mode", "share", "--processes", "2", "--seconds", "8")
    assert result["wrong"] == 0 and result["bad_records"] == 0 and result["failures"] == []
    assert result["turns"] > 0 and result["kills"] >= 1
    assert result["final_checks"]["wrong"] == 0
