"""Every script in examples/ runs to the end on the bundled model (each checks its own claim:
tokens equal to DynamicCache's, history reused, a conversation resumed from cold), so none rots."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.py"))


def test_the_examples_are_there():
    assert {p.name for p in EXAMPLES} >= {"wrap_generate.py", "chat_loop.py", "many_chats.py", "restart_reattach.py",
                                          "serve_openai.py", "compression.py"}


@pytest.mark.parametrize("script", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_an_example_runs(script, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TMPDIR": str(tmp_path)}
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.strip()
