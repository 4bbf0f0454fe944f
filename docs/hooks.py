"""MkDocs hooks: reference sections generated from the code each time the site is built, so they
cannot drift from it: the configuration keys (tiered_kv/config/reference.py, from the schema) and
every `tiered-kv` command's options (its argparse help)."""

import argparse
import os

CONFIG_MARKER = "<!-- config-reference -->"
CLI_MARKER = "<!-- cli-reference -->"


def cli_reference() -> str:
    """Each command's `--help`, as argparse prints it at 100 columns, under its own heading."""
    from tiered_kv.cli_parser import build_parser

    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"  # (argparse wraps at the terminal's width: fixed here, put back after)
    try:
        parser = build_parser()
        commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parts = ["### `tiered-kv`", "", "```text", parser.format_help().rstrip(), "```", ""]
        for name, command in commands.choices.items():
            parts += [f"### `tiered-kv {name}`", "", "```text", command.format_help().rstrip(), "```", ""]
    finally:
        if columns is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = columns
    return "\n".join(parts)


def on_page_markdown(markdown, page, config, files):
    if CONFIG_MARKER in markdown:
        from tiered_kv.config.reference import markdown as config_reference

        markdown = markdown.replace(CONFIG_MARKER, config_reference())
    if CLI_MARKER in markdown:
        markdown = markdown.replace(CLI_MARKER, cli_reference())
    return markdown
