"""The documentation: the site builds in strict mode (broken links and references fail), its
configuration reference names every key the schema accepts, and README.md stays short and keeps
the two set-up commands CI runs."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import tiered_kv
from tiered_kv.config import reference
from tiered_kv.config.attention import SparseConfig
from tiered_kv.config.load import _SECTION_KEYS
from tiered_kv.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]


def _flatten(tree: dict, prefix: str = "") -> set[str]:
    keys = set()
    for key, value in tree.items():
        path = f"{prefix}{key}"
        keys |= _flatten(value, path + ".") if isinstance(value, dict) else {path}
    return keys


def schema_keys() -> set[str]:
    """Every key a config may give: what a full config dumps, plus the loader's other spellings."""
    keys = _flatten(tiered_kv.Config(block_size="auto").to_dict())
    keys |= {f"{section}.{key}" for section, names in _SECTION_KEYS.items() for key in names if key != "sparse"}
    keys |= {f"attention.sparse.{f.name}" for f in dataclasses.fields(SparseConfig)}
    return keys


def test_the_reference_names_every_schema_key_and_no_other():
    rows = {row.key: row for row in reference.rows()}
    assert set(rows) == schema_keys()
    text = reference.markdown()
    for key in schema_keys():
        assert f"| `{key}` |" in text, key


def test_the_reference_says_what_the_validator_allows_and_the_defaults_load():
    rows = {row.key: row for row in reference.rows()}
    assert "'lru', 'lfu', 'fifo' or 'turns'" in rows["scheduler.policy"].allowed
    assert rows["hot.capacity"].shipped == "64MiB" and rows["block_size"].default == 16
    assert rows["cold.path"].default == "~/.cache/tiered_kv/cold"  # as declared, not this machine's home
    for row in rows.values():
        assert row.allowed and "config key" not in row.allowed, row
    # a change to a validator's message shows in the reference: it is read, not copied
    with pytest.raises(ConfigError, match=re.escape(rows["warm.layout"].allowed)):
        tiered_kv.load_config({"warm": {"layout": "sideways"}})


def test_the_site_builds_in_strict_mode(tmp_path):
    site = tmp_path / "site"
    env = {**os.environ, "PYTHONPATH": str(REPO), "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(site)],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    page = (site / "configuration" / "index.html").read_text()
    for key in schema_keys():
        assert f"<code>{key}</code>" in page, key
    api = (site / "api" / "index.html").read_text()
    assert "tiered_kv.CacheBank" in api and "attach" in api
    benchmarks = (site / "benchmarks" / "index.html").read_text()
    assert "Attention-aware tiers (issue 37)" in benchmarks  # bench/README.md, included whole
    cli = (site / "cli" / "index.html").read_text()
    for option in _cli_options():
        assert option in cli, option
    for example in sorted((REPO / "examples").glob("*.py")):
        assert example.name in (site / "examples" / "index.html").read_text()


def _cli_options() -> set[str]:
    """Every `tiered-kv` command and option, from the parser itself."""
    import argparse

    from tiered_kv.cli_parser import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    out = {f"tiered-kv {name}" for name in commands.choices}
    for command in commands.choices.values():
        out |= {flag for action in command._actions for flag in action.option_strings if flag.startswith("--")}
    return out


def _setup_commands() -> dict[str, str]:
    text = (REPO / "README.md").read_text()
    section = text.split("## Set up", 1)[1].split("\n## ", 1)[0]
    commands, pieces = {}, section.split("```sh\n")
    for before, piece in zip(pieces, pieces[1:]):
        label = before.rsplit("```", 1)[-1].strip().split("\n\n")[-1]  # the paragraph above the block
        commands[label.split()[0]] = piece.split("\n```", 1)[0]
    return commands


def test_the_readme_is_short_and_keeps_the_two_set_up_commands():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 220
    commands = _setup_commands()
    assert set(commands) == {"Main", "Tests"}
    assert commands["Main"].endswith("tiered-kv chat --config configs/default.yaml")
    assert commands["Tests"].endswith("-m pytest -q tests") and "'.[test]'" in commands["Tests"]
    assert commands["Tests"] in (REPO / ".ci" / "run").read_text().splitlines()  # CI runs exactly it


def test_every_docs_page_is_in_the_nav_and_every_readme_link_resolves():
    nav = (REPO / "mkdocs.yml").read_text()
    for page in (REPO / "docs").rglob("*.md"):
        assert str(page.relative_to(REPO / "docs")) in nav, page
    readme = (REPO / "README.md").read_text()
    for target in re.findall(r"\]\(([^)#]+)\)", readme):
        if not target.startswith("http"):
            assert (REPO / target).exists(), target


def test_troubleshooting_names_every_error_class():
    import inspect

    from tiered_kv import errors

    page = (REPO / "docs" / "troubleshooting.md").read_text()
    classes = [name for name, value in vars(errors).items() if inspect.isclass(value) and issubclass(value, Exception)]
    assert len(classes) >= 8
    for name in classes:
        assert f"`{name}`" in page or f"`tiered_kv.{name}`" in page, name
