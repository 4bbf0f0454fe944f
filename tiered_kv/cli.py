"""The `tiered-kv` command line. `tiered-kv chat` runs the scripted multi-turn chat (the main job);
`tiered-kv inspect` and `tiered-kv gc` look into and clean a cold directory; `tiered-kv diagnose`
measures where memory goes for one prompt (tiered_kv/tools/); `tiered-kv plot` draws a trace that
`chat --trace` wrote (tiered_kv/trace/); `tiered-kv quality` measures what a compressed lower tier
costs a model (tiered_kv/tools/quality.py).

Bad input (a config that does not validate, a missing model or script file, a prompt too long
for the model or the tiers) is reported as one line on stderr with exit status 2, never a
traceback; a model the bank cannot serve (LayoutError) and other failures of a run exit 1.

The library's log messages go to stderr as `tiered-kv: warning: ...`: warnings and errors by
default, errors only with -q/--quiet, everything down to DEBUG (with the logging module's name)
with -v/--verbose. Either flag goes before the command or after it. Only the "tiered_kv" logger
is configured, and only while `main` runs. The commands' arguments are declared in cli_parser.py.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sqlite3
import sys
from pathlib import Path

from .cli_parser import build_parser  # (the arguments of every command: cli_parser.py)

EXIT_USAGE = 2
LOGGER_NAME = "tiered_kv"


def _quality(args: argparse.Namespace) -> int:
    from .compression import MODES
    from .tools import quality
    from .models import ModelNotFoundError, load_model

    try:  # the given texts (else pydoc's pages), and always the text compression: auto is calibrated on
        texts = [(Path(path).name, _read_text(path)) for path in args.text] if args.text else \
            [("python-docs", quality.default_text())]
        texts.append((args.calibration_text, quality.shipped_text(args.calibration_text)))
        model, tokenizer = load_model(args.model, progress=not (args.no_progress or args.quiet))
    except (ModelNotFoundError, OSError, ValueError) as exc:  # (ConfigError is a ValueError)
        return _fail(exc, EXIT_USAGE)
    if args.sparse is not None:  # (the calibration text is too short for --context-tokens + --positions)
        return _sparse_quality(args, model, tokenizer, texts[:-1])
    reports = []
    try:
        for name, text in texts:
            for mode in args.compression or MODES[1:]:
                reports.append(quality.measure(model, tokenizer, text, compression=mode, tier=args.tier,
                                               num_tokens=args.tokens, chunk_tokens=args.chunk_tokens,
                                               continuation_tokens=args.continuation_tokens, text_name=name))
    except ValueError as exc:  # a text too short for two chunks (LayoutError, a ValueError too: int4 and odd heads)
        return _fail(exc, EXIT_USAGE)
    print(json.dumps([r.to_dict() for r in reports], indent=2) if args.json else quality.format_report(reports))
    return 0


def _sparse_quality(args: argparse.Namespace, model, tokenizer, texts: list) -> int:
    from .tools import sparse_quality

    modes = args.compression or ["none"]
    if len(modes) != 1:
        return _fail(ValueError(f"--compression {','.join(modes)} with --sparse: give one mode (the history's "
                                "below hot), e.g. --compression int8"), EXIT_USAGE)
    try:
        reports = [sparse_quality.measure_sparse(model, tokenizer, text, args.sparse, args.context_tokens,
                                                 args.positions, text_name=name, tier=args.tier,
                                                 compression=modes[0]) for name, text in texts]
    except ValueError as exc:  # a text too short for the positions asked
        return _fail(exc, EXIT_USAGE)
    print(json.dumps([r.to_dict() for r in reports], indent=2) if args.json else sparse_quality.format_sparse(reports))
    return 0


def _read_text(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise ValueError(f"--text {path!r}: cannot read it as UTF-8 text ({reason})") from None


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
               args.max_active, args.max_queue, prefill_chunk=args.prefill_chunk, batch=not args.no_batch)
    return 0


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
    from .errors import TraceError
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
