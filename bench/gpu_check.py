#!/usr/bin/env python
"""One prepared run on a lent GPU: the device figures of issues 8 and 17, in one JSON file.

    python3 bench/gpu_check.py --out $OUT/gpu.json          # the GPU run (at most --budget-s, 300 s)
    python3 bench/gpu_check.py --quick --out /tmp/q.json    # tiny sizes on CPU (< 1 minute)

Sections, in this order, each in its own child process with its own time limit (a crash, a
hang or a poisoned CUDA context in one cannot take the others down):
  env     versions, the GPU, and which backends tiered_kv chose at start
  kernels tiered_kv.kernels.selfcheck(): max abs error of each CUDA kernel against torch
  decode  greedy decode at 4k and 32k context, variants interleaved round by round: DynamicCache,
          a second DynamicCache (the A/A control), CacheBank (no hooks, hooks exact, hooks
          merge), and the same with hot = 25% of the chat (rest warm; merge there runs the
          native paged kernel on CUDA). Per step: GPU ms (CUDA events) and host ms (perf_counter
          around the call); syncs per step; the SDPA backend each path ran; tokens and logits
          against DynamicCache's
  warm    ~2,000 hot<->warm block moves through a TierStore beside plain pinned copies of the
          same bytes, interleaved round by round; store host time per block
  cold    cold reads: kvikio (GPUDirect Storage or its compat mode) beside preadv + copy, raw
          and through the cold tier (TierStore demote to cold, then promote)
  compressed  issue 21: native/dequant_blocks.cu against the torch codec on the device (bit for
          bit, GB/s of model-dtype bytes out; packed bytes in device memory and in pinned host
          memory read through UVA); issue 36: native/quant_blocks.cu against the torch codec on the
          CPU (bit for bit) and its GB/s of model-dtype bytes in; hot<->warm moves with warm int8
          beside warm none (issue 36's target: hot -> int8 warm at least 0.8x the uncompressed move)
  pytest  a few test files on this machine (where they fit in the time left)
A failing part records its error and traceback in the JSON and the run goes on. The JSON is
rewritten after every section (and sections save as they go), so a run killed at its limit
still leaves what it measured. bench/gpu_check.md says what every figure means.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SECTIONS = ("env", "kernels", "decode", "warm", "cold", "compressed", "pytest")
# hard limit per section (the child is killed past it), seconds; they add up to less than the
# default budget, and shrink in proportion under a smaller --budget-s
LIMITS_S = {"env": 30, "kernels": 30, "decode": 110, "warm": 28, "cold": 33, "compressed": 20, "pytest": 28}
QUICK_LIMITS_S = {"env": 30, "kernels": 30, "decode": 60, "warm": 30, "cold": 30, "compressed": 30, "pytest": 40}
SOFT_MARGIN_S = 12  # a section stops starting new parts this long before its hard limit (at most 30% of it)
ORCHESTRATOR_RESERVE_S = 3  # per section: starting it, killing it at its limit, reading its JSON
TOTAL_BUDGET_S = 300
GB = 1e9

# SmolLM2-135M's shape (the weights are not carried: random init, same compute and KV bytes)
SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, head_dim=64, rope_theta=100000.0,
                     tie_word_embeddings=True, rms_norm_eps=1e-5)
TINY_SHAPE = dict(vocab_size=256, hidden_size=96, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=6, num_key_value_heads=3, head_dim=16, tie_word_embeddings=True)

SIZES = {  # per mode: what each section moves
    # decode: decode_steps per timed chunk (long_decode_steps above long_context tokens), up to
    # decode_rounds timed rounds after the warm-up chunk; warm: warm_blocks moved each way per round
    "full": dict(shape=SMOLLM2_SHAPE, contexts=(4096, 32768), decode_steps=16, long_decode_steps=8,
                 long_context=8192, decode_rounds=5, block_size=16, warm_blocks=2000, warm_rounds=5,
                 cold_raw_bytes=1 << 29, cold_tier_bytes=1 << 28, compressed_blocks=512,
                 pytest=("tests/test_kernels.py",
                 "tests/test_hooks.py", "tests/test_equivalence.py")),
    "quick": dict(shape=TINY_SHAPE, contexts=(40, 120), decode_steps=4, long_decode_steps=3, long_context=64,
                  decode_rounds=5, block_size=16, warm_blocks=64, warm_rounds=3, cold_raw_bytes=8 << 20,
                  cold_tier_bytes=2 << 20, compressed_blocks=16, pytest=("tests/test_config.py",)),
}


# ---- JSON and output helpers -----------------------------------------------------------------
def jsonable(value):
    """A copy of `value` that json.dump writes as standard JSON (no NaN, tensors as lists)."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [jsonable(v) for v in value]
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, (str, int, bool)) or value is None:
        return value
    try:  # numpy / torch scalars and small tensors
        if hasattr(value, "tolist"):
            return jsonable(value.tolist())
        if hasattr(value, "item"):
            return jsonable(value.item())
    except Exception:
        pass
    return repr(value)


def write_json(path: str | Path, data) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(jsonable(data), f, indent=1)
    os.replace(tmp, path)


def error_record(exc: BaseException) -> dict:
    return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=12)}


def say(*parts) -> None:
    print(*parts, flush=True)


class Recorder:
    """A section's results, saved to its JSON file whenever a part finishes."""

    def __init__(self, path: str, name: str, limit_s: float):
        self.path, self.name = path, name
        self.started = time.monotonic()
        self.deadline = self.started + max(1.0, limit_s - min(SOFT_MARGIN_S, 0.3 * limit_s))
        self.data: dict = {"status": "running"}

    def left_s(self) -> float:
        return self.deadline - time.monotonic()

    def save(self) -> None:
        self.data["seconds"] = round(time.monotonic() - self.started, 3)
        write_json(self.path, self.data)

    def part(self, key: str, fn, *args, **kwargs):
        """Run one part; its result (or its error) goes under `key`. Never raises."""
        started = time.monotonic()
        try:
            value = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - a failing part is a figure, not a crash
            if isinstance(exc, KeyboardInterrupt):
                raise
            value = error_record(exc)
            say(f"[{self.name}] {key}: {value['error']}")
        if isinstance(value, dict):
            value.setdefault("seconds", round(time.monotonic() - started, 3))
        self.data[key] = value
        self.save()
        return value


# ---- the torch side (children only) ------------------------------------------------------------
class Ctx:
    """What every section needs: the mode's sizes, the device, a scratch directory."""

    def __init__(self, args):
        import torch

        self.args = args
        self.mode = "quick" if args.quick else "full"
        self.sizes = dict(SIZES[self.mode])
        # a shorter second run: GPU_CHECK_CONTEXTS=4096 GPU_CHECK_PYTEST=tests/a.py,tests/b.py
        if os.environ.get("GPU_CHECK_CONTEXTS"):
            self.sizes["contexts"] = tuple(int(c) for c in os.environ["GPU_CHECK_CONTEXTS"].split(","))
        if os.environ.get("GPU_CHECK_PYTEST"):
            self.sizes["pytest"] = tuple(os.environ["GPU_CHECK_PYTEST"].split(","))
        want = args.device
        if want == "auto":
            want = "cpu" if args.quick else ("cuda" if torch.cuda.is_available() else "cpu")
        self.device = torch.device(want)
        self.is_cuda = self.device.type == "cuda"
        self.scratch = args.scratch

    def sync(self) -> None:
        if self.is_cuda:
            import torch

            torch.cuda.synchronize(self.device)


def block_layout(ctx, dtype_name: str = "bfloat16"):
    from tiered_kv.blocks import KVLayout

    shape = ctx.sizes["shape"]
    return KVLayout(shape["num_hidden_layers"], shape["num_key_value_heads"], shape["head_dim"],
                    ctx.sizes["block_size"], dtype_name)


def filesystem_of(path: str) -> dict:
    """Mount point, filesystem type and free bytes of the filesystem holding `path`."""
    path = os.path.realpath(path)
    best = ("", "?", "?")
    try:
        with open("/proc/mounts", encoding="utf-8") as f:
            for line in f:
                device, mount, fstype = line.split()[:3]
                if (path == mount or path.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best[0]):
                    best = (mount, fstype, device)
    except OSError:
        pass
    stat = os.statvfs(path)
    return {"path": path, "mount": best[0], "fstype": best[1], "device": best[2],
            "free_bytes": stat.f_bavail * stat.f_frsize}


def module_info(name: str) -> dict:
    """Version and location of a module, or why it does not import."""
    import importlib

    started = time.monotonic()
    try:
        module = importlib.import_module(name)
    except BaseException as exc:  # noqa: BLE001
        return {"ok": False, **error_record(exc), "import_s": round(time.monotonic() - started, 3)}
    version = getattr(module, "__version__", None)
    if version is None:
        try:
            from importlib.metadata import version as dist_version

            version = dist_version({"yaml": "pyyaml", "pynvml": "nvidia-ml-py"}.get(name, name))
        except Exception:
            version = None
    return {"ok": True, "version": str(version), "file": getattr(module, "__file__", None),
            "import_s": round(time.monotonic() - started, 3)}


# ---- section: env ------------------------------------------------------------------------------
def section_env(ctx, rec: Recorder) -> None:
    import torch

    def basics():
        out = {"python": sys.version.split()[0], "executable": sys.executable, "platform": platform.platform(),
               "cpu_count": os.cpu_count(), "mode": ctx.mode, "device": str(ctx.device),
               "torch": torch.__version__, "torch_cuda": torch.version.cuda,
               "cuda_available": torch.cuda.is_available(), "pythonpath": os.environ.get("PYTHONPATH", "")}
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            out.update(gpu=props.name, capability=f"{props.major}.{props.minor}", gpu_memory_bytes=props.total_memory,
                       multiprocessors=props.multi_processor_count, cudnn=torch.backends.cudnn.version())
        try:
            out["git_commit"] = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True,
                                               text=True, timeout=5).stdout.strip() or None
        except Exception:
            out["git_commit"] = None
        return out

    rec.part("basics", basics)
    rec.part("kvikio", kvikio_settings)  # first: a fallback import here serves the rest of the section
    rec.part("modules", lambda: {name: module_info(name) for name in (
        "transformers", "tokenizers", "huggingface_hub", "safetensors", "regex", "numpy", "yaml", "xxhash", "pynvml",
        "cupy", "kvikio", "tiered_kv", "tiered_kv.hooks", "tiered_kv.kernels")})

    def cupy_info():
        import cupy

        out = {"version": cupy.__version__, "is_available": bool(cupy.cuda.is_available())}
        if out["is_available"]:
            out["runtime"] = cupy.cuda.runtime.runtimeGetVersion()
            out["driver"] = cupy.cuda.runtime.driverGetVersion()
        return out

    rec.part("cupy", cupy_info)

    def nvml_info():
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        return {"driver": pynvml.nvmlSystemGetDriverVersion(),
                "pcie_gen_max": pynvml.nvmlDeviceGetMaxPcieLinkGeneration(handle),
                "pcie_width_max": pynvml.nvmlDeviceGetMaxPcieLinkWidth(handle),
                "pcie_gen_now": pynvml.nvmlDeviceGetCurrPcieLinkGeneration(handle),
                "pcie_width_now": pynvml.nvmlDeviceGetCurrPcieLinkWidth(handle)}

    if ctx.is_cuda:
        rec.part("nvml", nvml_info)
    rec.part("backends", chosen_backends, ctx)
    rec.part("scratch_filesystem", filesystem_of, ctx.scratch)


_KVIKIO_FIRST_ERROR: list = []


def import_kvikio():
    """`import kvikio`; when its loader fails on a helper (cuda.pathfinder without cufile, say),
    load librapids_logger and libkvikio ourselves and try once more (kvikio dlopens libcufile and
    libcuda at run time by itself). The first error is kept: then tiered_kv's own `import kvikio`
    would fail in a process that did not do this."""
    try:
        import kvikio

        return kvikio
    except ImportError as exc:
        if isinstance(exc, ModuleNotFoundError) and exc.name in ("kvikio", "libkvikio"):
            raise
        if not _KVIKIO_FIRST_ERROR:
            _KVIKIO_FIRST_ERROR.append(f"{type(exc).__name__}: {exc}")
    for name in [n for n in sys.modules if n == "kvikio" or n.startswith("kvikio.")]:
        del sys.modules[name]
    import libkvikio
    import libkvikio.load

    try:
        import rapids_logger

        rapids_logger.load_library()
    except Exception:  # noqa: BLE001 - a system librapids_logger may still be found
        pass
    libkvikio.load._load_library("libkvikio.so")
    libkvikio.load_library = lambda: None
    import kvikio

    return kvikio


def kvikio_settings() -> dict:
    kvikio = import_kvikio()
    importlib.import_module("kvikio.defaults")  # the submodule read below (kvikio.defaults.get)

    out = {"version": kvikio.__version__, "plain_import_error": _KVIKIO_FIRST_ERROR[0] if _KVIKIO_FIRST_ERROR else None}
    for key in ("compat_mode", "num_threads", "task_size", "gds_threshold", "bounce_buffer_size"):
        try:
            out[key] = str(kvikio.defaults.get(key))
        except Exception as exc:  # noqa: BLE001
            out[key] = f"unreadable: {exc}"
    try:  # OFF: GDS only, ON: POSIX with bounce buffers, AUTO: GDS where cuFile opens, else ON
        out["compat_mode"] = kvikio.CompatMode(int(kvikio.defaults.get("compat_mode"))).name
    except Exception:  # noqa: BLE001
        pass
    try:
        out["compat_mode_preferred"] = bool(kvikio.defaults.is_compat_mode_preferred())
    except Exception as exc:  # noqa: BLE001
        out["compat_mode_preferred"] = f"unreadable: {exc}"
    try:
        import kvikio.cufile_driver as driver

        for key in ("is_gds_available", "allow_compat_mode", "major_version", "minor_version"):
            try:
                out[f"driver_{key}"] = driver.get(key)
            except Exception as exc:  # noqa: BLE001
                out[f"driver_{key}"] = f"unreadable: {exc}"
        try:
            out["libcufile_version"] = driver.libcufile_version()
        except Exception as exc:  # noqa: BLE001
            out["libcufile_version"] = f"unreadable: {exc}"
    except Exception as exc:  # noqa: BLE001
        out["driver"] = f"unreadable: {exc}"
    return out


def chosen_backends(ctx) -> dict:
    """Start a small store the way a user would ('auto' everywhere) and read what it picked."""
    import torch

    import tiered_kv
    from tiered_kv.hw.block_io import kvikio_usable
    from tiered_kv.scheduler import COLD

    cold_dir = os.path.join(ctx.scratch, "env-cold")
    store = tiered_kv.TierStore({"block_size": ctx.sizes["block_size"],
                                 "hot": {"device": "auto", "capacity_blocks": 4},
                                 "warm": {"capacity_blocks": 4, "pinned": "auto"},
                                 "cold": {"capacity_blocks": 4, "path": cold_dir, "backend": "auto"},
                                 "scheduler": {"background": False}})
    try:
        store.bind(block_layout(ctx), torch.bfloat16)
        out = {"hot_device": str(store.device), "copy_engine": type(store.copy_engine).__name__,
               "warm_pinned": bool(store.pinned), "link_monitor": store.link_monitor.name,
               "link_peak_bytes_per_s": getattr(store.link_monitor, "peak_bytes_per_s", None),
               "cold_backend": store.tiers[COLD].io.name if store.tiers[COLD] is not None else None,
               "kvikio_usable": kvikio_usable()}
    finally:
        store.close()
        shutil.rmtree(cold_dir, ignore_errors=True)
    try:
        ops = kernel_ops()
        out["kernels_backend"] = str(getattr(ops, "backend", None))
        out["kernels_fallback_reason"] = getattr(ops, "fallback_reason", None)
    except BaseException as exc:  # noqa: BLE001
        out["kernels_backend"] = f"unavailable: {type(exc).__name__}: {exc}"
    return out


def kernel_ops():
    """`tiered_kv.kernels.ops` (chosen on first use: compiles native/*.cu through cupy on GPU)."""
    import tiered_kv.kernels as kernels

    return kernels.get_ops() if hasattr(kernels, "get_ops") else kernels.ops


# ---- section: kernels --------------------------------------------------------------------------
def section_kernels(ctx, rec: Recorder) -> None:
    def nvcc():
        found = shutil.which("nvcc")
        if not found:
            return {"nvcc": None}
        text = subprocess.run([found, "--version"], capture_output=True, text=True, timeout=20).stdout
        return {"nvcc": found, "version": text.strip().splitlines()[-1] if text.strip() else ""}

    rec.part("nvcc", nvcc)
    rec.part("native_sources", lambda: {"files": sorted(str(p.relative_to(REPO)) for p in REPO.glob("native/**/*")
                                                        if p.is_file())})

    def backend():
        started = time.monotonic()
        ops = kernel_ops()  # on GPU: compiles and loads native/*.cu (cupy RawModule)
        return {"backend": str(getattr(ops, "backend", None)), "fallback_reason": getattr(ops, "fallback_reason", None),
                "choose_s": round(time.monotonic() - started, 3),
                "names": sorted(n for n in dir(ops) if not n.startswith("_"))[:60]}

    rec.part("ops", backend)

    def selfcheck():
        from tiered_kv.kernels import selfcheck as run_selfcheck

        kwargs = {"device": str(ctx.device)}
        if ctx.mode == "quick":  # one dtype and block size: the CPU run checks the plumbing, not the kernels
            import inspect

            import torch

            accepted = inspect.signature(run_selfcheck).parameters
            kwargs.update({k: v for k, v in (("dtypes", (torch.bfloat16,)), ("block_sizes", (16,)))
                           if k in accepted})
        started = time.monotonic()
        result = run_selfcheck(**kwargs)
        out = {"result": result, "selfcheck_s": round(time.monotonic() - started, 3)}
        ops_only = {k: v for k, v in result.items() if isinstance(v, dict)} if isinstance(result, dict) else result
        errors = list(_flat_numbers(ops_only))
        out["max_abs_error_over_all"] = max(errors) if errors else None
        out["worst"] = sorted(_flat_items(ops_only), key=lambda kv: -kv[1])[:5]
        backend = result.get("backend") if isinstance(result, dict) else None
        if backend is not None and backend != "cuda":  # both sides were the torch reference
            out["note"] = f"backend {backend!r}: the kernels were not run (errors are reference vs itself)"
        return out

    rec.part("selfcheck", selfcheck)


def _flat_items(value, prefix: str = ""):
    """(path, number) of every finite number in a nested dict."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _flat_items(v, f"{prefix}/{k}" if prefix else str(k))
    elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        yield prefix, float(value)


def _flat_numbers(value):
    if isinstance(value, dict):
        for v in value.values():
            yield from _flat_numbers(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _flat_numbers(v)
    elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        yield float(value)


# ---- section: decode ---------------------------------------------------------------------------
def build_model(ctx, max_tokens: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**ctx.sizes["shape"], max_position_embeddings=max_tokens)
    config._attn_implementation = "sdpa"
    with torch.device(ctx.device):
        model = LlamaForCausalLM(config)
    model = model.to(torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    return model


def bank_config(ctx, total_tokens: int, hot_share: float | None) -> dict:
    """All hot (hot_share None) or hot = hot_share of the chat's blocks and warm the rest.
    Watermarks 1.0 so nothing demotes below the budget (the budget is the experiment); the mover
    is off unless --decode-mover (with every variant's store open at once, idle movers would tax
    every variant's steps, DynamicCache's included)."""
    from tiered_kv.blocks import num_blocks_for

    bs = ctx.sizes["block_size"]
    blocks = num_blocks_for(total_tokens, bs) + 2
    full = {"high_watermark": 1.0, "low_watermark": 1.0}
    if hot_share is None:
        hot, warm = blocks, 0
    else:
        hot = max(1, math.ceil(hot_share * blocks))
        warm = blocks
    return {"block_size": bs, "hot": {"device": str(ctx.device), "capacity_blocks": hot, **full},
            "warm": {"capacity_blocks": warm, "pinned": "auto", **full}, "cold": {"capacity": 0},
            "scheduler": {"background": bool(getattr(ctx.args, "decode_mover", False))}}


# name, cache, hooks mode, hot share, what it is. Every round runs one timed chunk of each, in an
# order rotated by one place per round and reversed every other round (round_order).
DECODE_VARIANTS = (
    ("dynamic", "dynamic", None, None, "transformers DynamicCache: the reference"),
    ("dynamic_control", "dynamic", None, None,
     "a second DynamicCache, timed like any variant: the A/A control (its ratio to dynamic is the noise)"),
    ("bank", "bank", None, None, "CacheBank, all hot, no hooks"),
    ("bank_hooks_exact", "bank", "exact", None, "all hot, tiered_kv.hooks exact"),
    ("bank_hooks_merge", "bank", "merge", None, "all hot, tiered_kv.hooks merge"),
    ("bank_hot25", "bank", None, 0.25, "hot = 25% of the chat's blocks, the rest warm, no hooks"),
    ("bank_hot25_hooks_exact", "bank", "exact", 0.25, "hot 25%, rest warm, hooks exact"),
    ("bank_hot25_hooks_merge", "bank", "merge", 0.25,
     "hot 25%, rest warm, hooks merge: on CUDA with the native kernels a decode step runs "
     "native/paged_decode.cu (hook_paths_per_step['paged'] says whether it did)"),
)
# CPU only: the same merge step through the paged path, the kernels' torch reference standing in
# for native/paged_decode.cu (tiered_kv.bank.plan.PAGED_ON_CPU, what the tests use), so a
# dry run exercises the plumbing the GPU run's bank_hot25_hooks_merge takes
PAGED_REF_VARIANT = ("bank_hot25_hooks_merge_paged_ref", "bank", "merge", 0.25,
                     "CPU only: hot 25%, hooks merge through the paged path (torch reference kernels)")
EXPECTED_BITWISE = {"dynamic_control", "bank", "bank_hooks_exact", "bank_hot25", "bank_hot25_hooks_exact"}
SDPA_OPS = {  # profiler op name -> the SDPA backend it is
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "flash_cpu",
    "aten::_scaled_dot_product_efficient_attention": "mem_efficient",
    "aten::_scaled_dot_product_cudnn_attention": "cudnn",
    "aten::_scaled_dot_product_attention_math": "math",
    "aten::_scaled_dot_product_fused_attention_overrideable": "overrideable",
}
ATTENTION_KERNEL_WORDS = ("flash", "fmha", "attention", "attn", "sdpa", "cudnn", "paged", "gather", "merge",
                          "softmax")
IMPLICIT_SYNC = "implicit (torch sync debug mode)"


class SyncCounter:
    """Counts CUDA host syncs while active (CUDA only):
    - torch's sync debug mode set to "warn": torch warns at every synchronizing operation it
      knows (item/tolist, a D2H copy to pageable memory, nonzero, stream and device synchronize),
      each warning recorded (filter "always", so none is folded into an earlier one);
    - torch.cuda.synchronize, torch.cuda.Event.synchronize and torch.cuda.Stream.synchronize
      wrapped (debug mode off inside them, so each counts once: Event.synchronize never warns).
    Tensor.item / tolist on CUDA tensors are also counted apart (`item_tolist`), as a check that
    the debug-mode warnings were captured (they are part of the implicit count, not added).
    Not seen: syncs inside cupy (the native kernels' module) and in C++ threads."""

    def __init__(self):
        import collections

        self.counts = collections.Counter()
        self.item_tolist = 0
        self._saved: list = []
        self._seen = 0
        self._log: list | None = None
        self._warnings = None

    def __enter__(self):
        import torch

        def wrap(owner, attr, kind, cuda_tensor_only=False):
            original = getattr(owner, attr)

            def wrapper(*args, **kwargs):
                if cuda_tensor_only:
                    if args and getattr(args[0], "is_cuda", False):
                        self.item_tolist += 1
                    return original(*args, **kwargs)
                self.counts[kind] += 1
                mode = torch.cuda.get_sync_debug_mode()
                torch.cuda.set_sync_debug_mode(0)
                try:
                    return original(*args, **kwargs)
                finally:
                    torch.cuda.set_sync_debug_mode(mode)

            setattr(owner, attr, wrapper)
            self._saved.append((owner, attr, original))

        wrap(torch.cuda, "synchronize", "torch.cuda.synchronize")
        wrap(torch.cuda.Event, "synchronize", "Event.synchronize")
        wrap(torch.cuda.Stream, "synchronize", "Stream.synchronize")
        wrap(torch.Tensor, "item", None, cuda_tensor_only=True)
        wrap(torch.Tensor, "tolist", None, cuda_tensor_only=True)
        self._warnings = warnings.catch_warnings(record=True)
        self._log = self._warnings.__enter__()
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def snapshot(self) -> dict:
        log = self._log or []
        for w in log[self._seen:]:
            if "synchroniz" in str(w.message):
                self.counts[IMPLICIT_SYNC] += 1
        self._seen = len(log)
        return dict(self.counts)

    def __exit__(self, *exc):
        import torch

        torch.cuda.set_sync_debug_mode(0)
        for owner, attr, original in reversed(self._saved):
            setattr(owner, attr, original)
        self._saved.clear()
        if self._warnings is not None:
            self._warnings.__exit__(*exc)
        return False


def _diff_counts(after: dict, before: dict) -> dict:
    return {k: after[k] - before.get(k, 0) for k in after if after[k] - before.get(k, 0)}


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def run_chunk(ctx, model, cache, first, n_steps: int, *, keep_logits: bool = False, syncs: SyncCounter | None = None):
    """`n_steps` greedy one-token forwards from `first`. Per step: host ms (perf_counter around the
    Python call, forward + argmax, before any sync) and, on CUDA, GPU ms (CUDA events recorded on
    the current stream just before and after the call, read once the chunk is done)."""
    import torch

    events = None
    if ctx.is_cuda:
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n_steps)]
    host_ms, step_syncs, logits_kept = [], [], []
    token, tokens = first, [first]
    ctx.sync()
    chunk_started = time.perf_counter()
    with torch.no_grad():
        for step in range(n_steps):
            if events is not None:
                events[step][0].record()
            before = syncs.snapshot() if syncs is not None else None
            started = time.perf_counter()
            logits = model(input_ids=token, cache=cache, use_cache=True).logits[:, -1]
            token = logits.argmax(-1, keepdim=True)
            host = time.perf_counter() - started
            if syncs is not None:
                step_syncs.append(_diff_counts(syncs.snapshot(), before))
            if events is not None:
                events[step][1].record()
            host_ms.append(1e3 * host)
            tokens.append(token)
            if keep_logits:  # untimed chunks only: this copy waits for the step
                logits_kept.append(logits[0].detach().to("cpu", copy=True))
    ctx.sync()
    wall_s = time.perf_counter() - chunk_started
    out = {"host_ms": host_ms, "gpu_ms": [a.elapsed_time(b) for a, b in events] if events is not None else None,
           "wall_s": wall_s, "tokens": torch.cat(tokens, dim=1)[0].tolist()}
    if syncs is not None:
        out["syncs"] = step_syncs
    if keep_logits:
        out["logits"] = torch.stack(logits_kept)
    return out


def profile_step(ctx, model, cache, token) -> dict:
    """One more forward under torch.profiler: which SDPA op each attention call ran (the aten op
    names tell the backend: flash, mem_efficient, cudnn, math, flash_cpu), the CUDA kernels whose
    names say attention (paged/gather/merge for the native ones), kernels and memcpys per step,
    and the GPU busy time (sum of kernel times) of that step."""
    import collections

    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.is_cuda else [])
    ctx.sync()
    with torch.no_grad(), profile(activities=activities) as prof:
        model(input_ids=token, cache=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        ctx.sync()
    sdpa, kernels, memcpy = collections.Counter(), collections.Counter(), collections.Counter()
    kernel_count, busy_us = 0, 0.0
    for evt in prof.key_averages():
        key = evt.key
        if key in SDPA_OPS:
            sdpa[SDPA_OPS[key]] += evt.count
        device_type = str(getattr(evt, "device_type", ""))
        if "CUDA" not in device_type:
            continue
        if key.lower().startswith(("memcpy", "memset")):
            memcpy[key] += evt.count
            continue
        kernel_count += evt.count
        busy_us += float(getattr(evt, "self_device_time_total", None) or getattr(evt, "self_cuda_time_total", 0) or 0)
        if any(word in key.lower() for word in ATTENTION_KERNEL_WORDS):
            kernels[key[:120]] += evt.count
    backend = "+".join(sorted(sdpa)) if sdpa else "none (no SDPA op: attention computed another way)"
    out = {"sdpa_backend": backend, "sdpa_calls": dict(sdpa)}
    if ctx.is_cuda:
        out.update(attention_kernels=dict(kernels.most_common(8)), cuda_kernels=kernel_count,
                   memcpy=dict(memcpy), gpu_busy_ms=busy_us / 1e3)
    return out


class DecodeVariant:
    """One variant's cache, state and samples for one context."""

    def __init__(self, spec):
        self.name, self.kind, self.hooks_mode, self.hot_share, about = spec
        self.paged_ref = self.name.endswith("_paged_ref")
        self.cache = None
        self.first = None
        self.tokens = None
        self.logits = None
        self.prefill_logits = None
        self.last_chunk_s = None
        self.ready = False
        self.rounds: list[dict] = []
        self.hooks_before_rounds = None
        self.out: dict = {"about": about, "cache": self.kind, "hooks": self.hooks_mode, "hot_share": self.hot_share,
                          "status": "setting up", "expected_bitwise": self.name in EXPECTED_BITWISE}

    def fail(self, exc: BaseException | str) -> None:
        self.ready = False
        if isinstance(exc, BaseException):
            self.out.update(status="error", **error_record(exc))
        else:
            self.out.update(status="error", error=exc)

    def hook_counts(self):
        if self.kind != "bank" or self.cache is None:
            return None
        return dict(self.cache.stats().get("hooks", {}).get("steps_by_read", {}))  # steps by how they read (bank/plan.py)


class active_variant:
    """Hooks installed (and the CPU paged reference switched on) for this variant's forwards only;
    the model is back on plain sdpa afterwards."""

    def __init__(self, model, variant: DecodeVariant):
        self.model, self.variant = model, variant

    def __enter__(self):
        v = self.variant
        if v.hooks_mode is not None:
            import tiered_kv.hooks as hooks

            hooks.install(self.model, v.cache, mode=v.hooks_mode)
        if v.paged_ref:
            import tiered_kv.bank.plan as attention

            attention.PAGED_ON_CPU = True
        return self

    def __exit__(self, *exc):
        v = self.variant
        if v.paged_ref:
            import tiered_kv.bank.plan as attention

            attention.PAGED_ON_CPU = False
        if v.hooks_mode is not None:
            import tiered_kv.hooks as hooks

            hooks.uninstall(self.model)
        if getattr(self.model.config, "_attn_implementation", "sdpa") != "sdpa":
            self.model.set_attn_implementation("sdpa")
        return False


def setup_variant(ctx, model, prompt, v: DecodeVariant, n_steps: int) -> None:
    """Build the cache, prefill the prompt (one sample: prefill_s), run the warm-up chunk (never
    timed: its tokens and logits are the exactness figures, its steps after the first the sync
    counts), profile one more step, crop back to the prompt."""
    import torch
    from transformers import DynamicCache

    import tiered_kv

    context = prompt.shape[1]
    if v.kind == "dynamic":
        v.cache = DynamicCache(config=model.config)
    else:
        cfg = bank_config(ctx, context + n_steps + 2, v.hot_share)
        v.out["config"] = cfg
        v.cache = tiered_kv.CacheBank(model, cfg)
    with active_variant(model, v):
        v.out["attn_implementation"] = getattr(model.config, "_attn_implementation", None)
        with torch.no_grad():
            ctx.sync()
            started = time.perf_counter()
            logits = model(input_ids=prompt, cache=v.cache, use_cache=True, logits_to_keep=1).logits[:, -1]
            v.first = logits.argmax(-1, keepdim=True)
            ctx.sync()
        v.out["prefill_s"] = time.perf_counter() - started
        v.out["prefill_tokens_per_s"] = context / v.out["prefill_s"]
        v.prefill_logits = logits[0].detach().to("cpu", copy=True)
        counts_before = v.hook_counts()
        warm = None
        if ctx.is_cuda:
            try:
                with SyncCounter() as counter:
                    warm = run_chunk(ctx, model, v.cache, v.first, n_steps, keep_logits=True, syncs=counter)
                    implicit = counter.snapshot().get(IMPLICIT_SYNC, 0)
                # every step's logits copy to pageable memory and the tokens' tolist() are syncs
                # torch's debug mode must have reported: a self-check of the counting
                v.out["sync_capture_check"] = {"implicit_total": implicit, "item_tolist": counter.item_tolist,
                                               "logits_copies": n_steps,
                                               "ok": implicit >= counter.item_tolist + n_steps}
            except Exception as exc:  # noqa: BLE001 - counting failed: warm up without it
                v.out["syncs_error"] = error_record(exc)
                extra = v.cache.get_seq_length() - context
                if extra > 0:
                    v.cache.crop(-extra)
                warm = None
        if warm is None:
            warm = run_chunk(ctx, model, v.cache, v.first, n_steps, keep_logits=True)
        v.tokens, v.logits, v.last_chunk_s = warm["tokens"], warm["logits"], warm["wall_s"]
        v.out["warmup_chunk"] = {"steps": n_steps, "wall_s": warm["wall_s"], "host_ms": warm["host_ms"],
                                 "gpu_ms": warm["gpu_ms"]}
        if "syncs" in warm:
            per_step = warm["syncs"]
            counted = per_step[1:] if len(per_step) > 1 else per_step  # the first step pays one-time costs
            totals = [sum(s.values()) for s in counted]
            kinds: dict = {}
            for s in counted:
                for k, n in s.items():
                    kinds[k] = kinds.get(k, 0) + n
            v.out["syncs_per_step"] = _median(totals)
            v.out["syncs_per_step_max"] = max(totals) if totals else None
            v.out["syncs_first_step"] = sum(per_step[0].values()) if per_step else None
            v.out["sync_kinds_per_step"] = {k: n / max(1, len(counted)) for k, n in kinds.items()}
        else:
            v.out["syncs_per_step"] = None
        started = time.perf_counter()
        try:
            v.out["profile"] = profile_step(ctx, model, v.cache, torch.tensor([[v.tokens[-1]]], device=ctx.device))
            v.out["profile"]["seconds"] = round(time.perf_counter() - started, 3)
            profiled = 1
        except BaseException as exc:  # noqa: BLE001 - the backend stays unknown, the timing goes on
            v.out["profile"] = error_record(exc)
            profiled = v.cache.get_seq_length() - context - n_steps
        v.out["sdpa_backend"] = v.out["profile"].get("sdpa_backend")
        v.cache.crop(-(n_steps + profiled))
        if v.cache.get_seq_length() != context:
            raise RuntimeError(f"crop left {v.cache.get_seq_length()} tokens, expected {context}")
        if counts_before is not None:
            after = v.hook_counts()
            v.out["hook_paths_warmup"] = {k: after[k] - counts_before.get(k, 0) for k in after}
        v.hooks_before_rounds = v.hook_counts()
    v.ready = True
    v.out["status"] = "warmed up"


def timed_chunk(ctx, model, v: DecodeVariant, n_steps: int, round_index: int, position: int) -> None:
    with active_variant(model, v):
        result = run_chunk(ctx, model, v.cache, v.first, n_steps)
        v.cache.crop(-n_steps)
    v.last_chunk_s = result["wall_s"]
    v.rounds.append({"round": round_index, "position": position, "host_ms": result["host_ms"],
                     "gpu_ms": result["gpu_ms"], "wall_ms_per_step": 1e3 * result["wall_s"] / n_steps,
                     "tokens_same_as_warmup": result["tokens"] == v.tokens})


def variant_figures(v: DecodeVariant, is_cuda: bool) -> dict:
    """Medians over every timed step of every timed round; no timed round: failed, no figure."""
    out = v.out
    for key in ("timed_rounds", "timed_steps", "step_ms", "gpu_step_ms", "host_step_ms", "wall_step_ms",
                "host_over_gpu", "tokens_per_s", "round_step_ms", "tokens_same_every_round"):
        out.pop(key, None)
    out["timed_rounds"] = len(v.rounds)
    if not v.rounds:
        if out.get("status") != "error":
            out["status"] = "failed"
            out["error"] = out.get("error") or "no timed repeat: no round ran this variant (budget or setup)"
        return out
    host = [x for r in v.rounds for x in r["host_ms"]]
    gpu = [x for r in v.rounds for x in r["gpu_ms"]] if is_cuda else None
    out["timed_steps"] = len(host)
    out["host_step_ms"] = statistics.median(host)
    out["gpu_step_ms"] = statistics.median(gpu) if gpu else None
    out["wall_step_ms"] = statistics.median(r["wall_ms_per_step"] for r in v.rounds)
    out["step_ms"] = out["gpu_step_ms"] if gpu else out["host_step_ms"]
    out["step_clock"] = "cuda_events" if gpu else "perf_counter"
    out["host_over_gpu"] = out["host_step_ms"] / out["gpu_step_ms"] if gpu else None
    out["tokens_per_s"] = 1e3 / out["step_ms"]
    out["round_step_ms"] = {r["round"]: statistics.median(r["gpu_ms"] if gpu else r["host_ms"]) for r in v.rounds}
    out["tokens_same_every_round"] = all(r["tokens_same_as_warmup"] for r in v.rounds)
    if out.get("status") != "error":
        out["status"] = "ok"
    return out


def compare_variants(row: dict, variants: list[DecodeVariant]) -> None:
    """Each variant against DynamicCache: speed (dynamic step / variant step: >1 is faster), the
    paired per-round ratio, greedy tokens, and every logit of the prefill and the warm-up chunk."""
    import torch

    by_name = {v.name: v for v in variants}
    ref = by_name.get("dynamic")
    for v in variants:
        out = v.out
        if ref is not None and v is not ref and "step_ms" in out and "step_ms" in ref.out:
            out["speed_vs_dynamic"] = ref.out["step_ms"] / out["step_ms"]
            out["host_speed_vs_dynamic"] = ref.out["host_step_ms"] / out["host_step_ms"]
            paired = [ref.out["round_step_ms"][r] / t for r, t in out["round_step_ms"].items()
                      if r in ref.out["round_step_ms"]]
            out["paired_speed_vs_dynamic"] = statistics.median(paired) if paired else None
        if ref is not None and v is not ref and v.tokens is not None and ref.tokens is not None:
            n = min(len(v.tokens), len(ref.tokens))
            mismatch = next((i for i in range(n) if v.tokens[i] != ref.tokens[i]), None)
            out["tokens_equal_dynamic"] = mismatch is None and len(v.tokens) == len(ref.tokens)
            out["first_mismatch_index"] = mismatch
            out["logits_dtype"] = str(v.logits.dtype).replace("torch.", "")
            steps = min(len(v.logits), len(ref.logits))
            diff = (v.logits[:steps].float() - ref.logits[:steps].float()).abs()
            out["logits_steps_compared"] = steps
            out["logits_bitwise_equal"] = bool(torch.equal(v.logits[:steps], ref.logits[:steps]))
            out["logits_max_abs_diff"] = float(diff.max()) if diff.numel() else 0.0
            out["logits_max_abs_diff_per_step"] = [float(d.max()) for d in diff]
            out["prefill_logits_bitwise_equal"] = bool(torch.equal(v.prefill_logits, ref.prefill_logits))
            out["prefill_logits_max_abs_diff"] = float((v.prefill_logits.float() - ref.prefill_logits.float()).abs().max())
    for name, all_hot in (("bank_hot25", "bank"), ("bank_hot25_hooks_exact", "bank_hooks_exact"),
                          ("bank_hot25_hooks_merge", "bank_hooks_merge"),
                          ("bank_hot25_hooks_merge_paged_ref", "bank_hooks_merge")):
        a, b = by_name.get(name), by_name.get(all_hot)
        if a is not None and b is not None and "step_ms" in a.out and "step_ms" in b.out:
            a.out["speed_vs_all_hot_same_hooks"] = b.out["step_ms"] / a.out["step_ms"]
    control = by_name.get("dynamic_control")
    if control is not None:
        c = control.out
        ratio = c.get("speed_vs_dynamic")
        row["control"] = {"speed_vs_dynamic": ratio, "paired_speed_vs_dynamic": c.get("paired_speed_vs_dynamic"),
                          "host_speed_vs_dynamic": c.get("host_speed_vs_dynamic"),
                          "within_3pct": None if ratio is None else abs(ratio - 1.0) <= 0.03,
                          "logits_bitwise_equal": c.get("logits_bitwise_equal")}
    bad = [v.name for v in variants if v.out.get("tokens_equal_dynamic") is False
           or (v.out.get("expected_bitwise") and v.out.get("logits_bitwise_equal") is False)]
    row["exactness_ok"] = not bad
    row["exactness_off"] = bad


def bank_figures(v: DecodeVariant) -> None:
    if v.kind != "bank" or v.cache is None:
        return
    stats = v.cache.stats()
    v.out["bank_blocks"] = stats.get("bank_blocks")
    v.out["tiers"] = {k: {"used_blocks": t["used_blocks"], "capacity_blocks": t["capacity_blocks"],
                          "device": t["device"]} for k, t in stats["tiers"].items()}
    v.out["contiguity"] = stats.get("contiguity")
    v.out["bytes_moved"] = stats.get("bytes_moved")
    v.out["critical_path"] = stats.get("critical_path")
    hooks = stats.get("hooks", {})
    v.out["gather_buffer_bytes"] = hooks.get("gather_buffer_bytes")
    steps = sum(len(r["host_ms"]) for r in v.rounds)
    if v.hooks_before_rounds is not None and steps:
        after = dict(hooks.get("steps_by_read", {}))
        v.out["hook_paths_per_step"] = {k: (after[k] - v.hooks_before_rounds.get(k, 0)) / steps for k in after}


def round_order(items: list, round_index: int) -> list:
    """Round r (from 1): the list rotated by r - 1 places (r in even rounds), reversed in even
    rounds, so an item's place changes every round and neighbours swap (A then B, then B then A)."""
    even = round_index % 2 == 0
    shift = (round_index - 1 + even) % max(1, len(items))
    order = items[shift:] + items[:shift]
    return order[::-1] if even else order


def run_context(ctx, rec: Recorder, model, context: int, specs, deadline: float) -> dict:
    import torch

    sizes = ctx.sizes
    n_steps = sizes["decode_steps"] if context <= sizes["long_context"] else sizes["long_decode_steps"]
    generator = torch.Generator().manual_seed(context)
    prompt = torch.randint(3, model.config.vocab_size, (1, context), generator=generator).to(ctx.device)
    variants = [DecodeVariant(spec) for spec in specs]
    row: dict = {"context": context, "decode_steps_per_chunk": n_steps, "max_rounds": sizes["decode_rounds"],
                 "variants": {v.name: v.out for v in variants}, "rounds": []}
    min_left = 8 if ctx.mode == "full" else 1
    try:
        for v in variants:
            # set up only what leaves time for one round of everything set up so far
            ready = [u for u in variants if u.ready]
            setups = [u.out["setup_s"] for u in variants if "setup_s" in u.out]
            chunk_s = sum(u.last_chunk_s or 0.0 for u in ready)
            need = (statistics.mean(setups) if setups else 0.0) + 1.25 * (chunk_s + chunk_s / max(1, len(ready)))
            if rec.left_s() < min_left + need:
                v.fail(f"not set up: section time budget ({rec.left_s():.0f} s left, about {need:.0f} s needed "
                       "to set it up and run one round)")
                continue
            say(f"[decode] context {context}: set up {v.name}")
            started = time.monotonic()
            try:
                setup_variant(ctx, model, prompt, v, n_steps)
            except BaseException as exc:  # noqa: BLE001 - a failing variant is a figure
                if isinstance(exc, KeyboardInterrupt):
                    raise
                v.fail(exc)
                say(f"[decode] context {context}: {v.name}: {v.out['error']}")
            v.out["setup_s"] = round(time.monotonic() - started, 3)
            rec.save()
        for round_index in range(1, sizes["decode_rounds"] + 1):
            active = [v for v in variants if v.ready]
            if not active:
                break
            estimate = 1.25 * sum(v.last_chunk_s or 0.0 for v in active) + 0.02 * len(active)
            # round 1 may use the section's time; later rounds only this context's share
            limit_at = time.monotonic() + rec.left_s() if round_index == 1 else deadline
            if time.monotonic() + estimate > limit_at:
                row["rounds_cut_by_budget"] = {"before_round": round_index, "estimate_s": round(estimate, 2)}
                break
            order = round_order(active, round_index)
            started = time.monotonic()
            for position, v in enumerate(order):
                try:
                    timed_chunk(ctx, model, v, n_steps, round_index, position)
                except BaseException as exc:  # noqa: BLE001
                    if isinstance(exc, KeyboardInterrupt):
                        raise
                    v.fail(exc)
                    say(f"[decode] context {context}: {v.name} round {round_index}: {v.out['error']}")
            row["rounds"].append({"round": round_index, "order": [v.name for v in order],
                                  "seconds": round(time.monotonic() - started, 3)})
            for v in variants:
                variant_figures(v, ctx.is_cuda)
            compare_variants(row, variants)
            rec.save()
            say(f"[decode] context {context}: round {round_index} done ({row['rounds'][-1]['seconds']:.1f} s)")
    finally:
        for v in variants:
            variant_figures(v, ctx.is_cuda)
        compare_variants(row, variants)
        for v in variants:
            try:
                bank_figures(v)
            except BaseException as exc:  # noqa: BLE001
                v.out["stats_error"] = f"{type(exc).__name__}: {exc}"
            if v.kind == "bank" and v.cache is not None:
                try:
                    v.cache.close()
                except BaseException as exc:  # noqa: BLE001
                    v.out["close_error"] = f"{type(exc).__name__}: {exc}"
            v.cache = None
            v.out["rounds"] = [{"round": r["round"], "position": r["position"],
                                "tokens_same_as_warmup": r["tokens_same_as_warmup"],
                                "step_ms": statistics.median(r["gpu_ms"] or r["host_ms"]),
                                "host_ms": [round(x, 4) for x in r["host_ms"]],
                                "gpu_ms": [round(x, 4) for x in r["gpu_ms"]] if r["gpu_ms"] else None,
                                "wall_ms_per_step": round(r["wall_ms_per_step"], 4)} for r in v.rounds]
        gc.collect()
        if ctx.is_cuda:
            torch.cuda.empty_cache()
    return row


def section_decode(ctx, rec: Recorder) -> None:
    import torch

    sizes = ctx.sizes
    contexts = sizes["contexts"]
    if not ctx.is_cuda and ctx.mode == "quick":
        torch.set_num_threads(1)  # steadier on a shared CPU; the dry run checks structure, not speed
    rec.data["model"] = {"shape": sizes["shape"], "dtype": "bfloat16", "device": str(ctx.device),
                         "torch_threads": torch.get_num_threads(),
                         "weights": "random init with SmolLM2-135M's config shape (the real weights are too big "
                                    "to carry to the GPU machine); compute and KV bytes per token are the same"
                         if ctx.mode == "full" else "tiny random model (quick mode)"}
    rec.data["method"] = (
        "per context every variant is set up in turn (prefill, one untimed warm-up chunk, one profiled step, "
        "crop back); then each round runs one timed chunk of decode_steps_per_chunk greedy steps of every "
        "variant, the order rotated by one place per round and reversed every other round, the cache cropped "
        "back after each chunk; per step "
        "host ms = perf_counter around the forward + argmax (no sync), GPU ms = CUDA events around it; "
        "medians over every timed step of every round")
    started = time.monotonic()
    model = build_model(ctx, max(contexts) + 4 * sizes["decode_steps"])
    rec.data["build_model_s"] = round(time.monotonic() - started, 3)

    def warm_up():  # CUDA context, cuBLAS handles, kernel choice: before any variant
        from transformers import DynamicCache

        ids = torch.randint(3, model.config.vocab_size, (1, 32), device=ctx.device)
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=ids, cache=cache, use_cache=True)
            for _ in range(3):
                model(input_ids=ids[:, :1], cache=cache, use_cache=True)
        ctx.sync()
        return {"ok": True}

    rec.part("model_warm_up", warm_up)

    def kernels():  # chosen (on GPU: compiled) here, before any timed chunk
        ops = kernel_ops()
        return {"backend": str(getattr(ops, "backend", None)), "fallback_reason": getattr(ops, "fallback_reason", None),
                "paged_path": "native/paged_decode.cu" if getattr(ops, "backend", None) == "cuda" else
                ("torch reference (bank_hot25_hooks_merge_paged_ref)" if not ctx.is_cuda else None)}

    rec.part("kernels_backend", kernels)

    def sdpa_flags():
        if not ctx.is_cuda:
            return {"note": "CPU: the profiler's op names say which kernel ran (variants' sdpa_backend)"}
        b = torch.backends.cuda
        return {name: bool(getattr(b, f"{name}_sdp_enabled")()) for name in ("flash", "mem_efficient", "math", "cudnn")
                if hasattr(b, f"{name}_sdp_enabled")}

    rec.part("sdpa_enabled", sdpa_flags)
    specs = DECODE_VARIANTS + (() if ctx.is_cuda else (PAGED_REF_VARIANT,))
    rec.data["variants"] = [spec[0] for spec in specs]
    results: dict = {}
    rec.data["contexts"] = results
    weights = [math.log2(max(2, c)) for c in contexts]
    for i, context in enumerate(contexts):
        share = weights[i] / sum(weights[i:])
        deadline = time.monotonic() + share * max(0.0, rec.left_s())
        say(f"[decode] context {context}: {share:.0%} of {rec.left_s():.0f} s left")
        try:
            results[str(context)] = run_context(ctx, rec, model, context, specs, deadline)
        except BaseException as exc:  # noqa: BLE001
            if isinstance(exc, KeyboardInterrupt):
                raise
            results[str(context)] = error_record(exc)
        rec.save()
    rec.data["summary"] = decode_summary(results)
    rec.save()


def decode_summary(results: dict) -> dict:
    out = {}
    for context, row in results.items():
        if "variants" not in row:
            out[context] = {"error": row.get("error", "no result")}
            continue
        line = {}
        for name, v in row["variants"].items():
            if v.get("status") == "ok":
                line[name] = {k: v.get(k) for k in (
                    "step_ms", "gpu_step_ms", "host_step_ms", "speed_vs_dynamic", "paired_speed_vs_dynamic",
                    "speed_vs_all_hot_same_hooks", "timed_rounds", "tokens_equal_dynamic", "logits_bitwise_equal",
                    "logits_max_abs_diff", "syncs_per_step", "sdpa_backend")}
                line[name]["paged_steps_per_step"] = (v.get("hook_paths_per_step") or {}).get("paged")
            else:
                line[name] = {"status": v.get("status"), "error": str(v.get("error", "no figure"))[:300]}
        out[context] = {"variants": line, "control": row.get("control"), "exactness_ok": row.get("exactness_ok"),
                        "exactness_off": row.get("exactness_off"), "rounds": len(row.get("rounds", []))}
    return out


# ---- section: warm -----------------------------------------------------------------------------
def fill_random(tensor) -> None:
    """Random values (never zeros: METHOD.md), in chunks so no big temporary is made (a slab
    that shares its storage with another tier's is filled through that storage)."""
    if not tensor.is_contiguous():
        tensor = getattr(tensor, "_base", None) if getattr(tensor, "_base", None) is not None else tensor.contiguous()
    flat = tensor.view(-1)
    step = 1 << 27
    for start in range(0, flat.numel(), step):
        part = flat[start:start + step]
        if part.is_floating_point():
            part.normal_()
        else:
            part.random_(0, 256)


def timed_call(ctx, call, finish=None, events: bool = True) -> dict:
    """host_s: perf_counter around call() alone (no sync); wall_s: until `finish` and the device
    are synchronized; gpu_s (CUDA, events=True): events on the current stream around call() and
    finish() (the store copies on its own stream, so its moves are timed by wall_s alone)."""
    import torch

    ctx.sync()
    start = end = None
    if ctx.is_cuda and events:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    started = time.perf_counter()
    result = call()
    host_s = time.perf_counter() - started
    if finish is not None:
        finish()
    if end is not None:
        end.record()
    ctx.sync()
    wall_s = time.perf_counter() - started
    return {"host_s": host_s, "wall_s": wall_s, "gpu_s": start.elapsed_time(end) / 1e3 if start is not None else None,
            "result": result}


def section_warm(ctx, rec: Recorder) -> None:
    import torch

    import tiered_kv
    from tiered_kv.scheduler import HOT, WARM

    layout = block_layout(ctx)
    num_blocks = ctx.sizes["warm_blocks"]
    num_bytes = num_blocks * layout.block_bytes
    rounds = ctx.sizes["warm_rounds"]
    rec.data["layout"] = {"block_bytes": layout.block_bytes, "blocks": num_blocks, "bytes": num_bytes,
                          "shape": list(layout.record_shape()), "dtype": layout.dtype_name}
    rec.data["method"] = ("round 0 warms up (not counted); each of the next rounds runs every case once, the "
                          "order rotated by one place per round and reversed every other round: store (demote "
                          "all blocks hot->warm, then promote them back), plain_one_copy (one pinned copy_ of "
                          "the same bytes each way), plain_per_block (one copy_ per block each way); GB/s from "
                          "wall time (call until the copy engine and "
                          "the device are synchronized), medians over the counted rounds")

    def moves():
        full = {"high_watermark": 1.0, "low_watermark": 1.0}
        store = tiered_kv.TierStore({"block_size": layout.block_size,
                                     "hot": {"device": str(ctx.device), "capacity_blocks": num_blocks, **full},
                                     "warm": {"capacity_blocks": num_blocks, "pinned": "auto", **full},
                                     "cold": {"capacity": 0}, "scheduler": {"background": False}})
        try:
            store.bind(layout, torch.bfloat16)
            hot = store.tiers[HOT]
            fill_random(hot.slab)
            block_ids = store.allocate(num_blocks)
            tiers, slots = store.placements(block_ids)
            assert (tiers == HOT).all(), f"allocated blocks not all hot: {tiers.tolist()[:8]}"
            ref = hot._blocks.index_select(3, torch.as_tensor(slots, device=ctx.device))
            pinned = ctx.is_cuda
            host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=pinned)
            device = torch.empty(num_bytes, dtype=torch.uint8, device=ctx.device)
            fill_random(host)
            fill_random(device)
            bb = layout.block_bytes
            sync_engine = store.copy_engine.synchronize

            def store_d2h():
                bad = store.demote(block_ids, WARM)
                return bad

            def store_h2d():
                return store.promote(block_ids)

            def per_block(dst, src):
                for i in range(num_blocks):
                    dst[i * bb:(i + 1) * bb].copy_(src[i * bb:(i + 1) * bb], non_blocking=True)

            cases = {
                "store": (("d2h", store_d2h, sync_engine), ("h2d", store_h2d, sync_engine)),
                "plain_one_copy": (("d2h", lambda: host.copy_(device, non_blocking=True), None),
                                   ("h2d", lambda: device.copy_(host, non_blocking=True), None)),
                "plain_per_block": (("d2h", lambda: per_block(host, device), None),
                                    ("h2d", lambda: per_block(device, host), None)),
            }
            samples = {case: {d: [] for d in ("d2h", "h2d")} for case in cases}
            names = list(cases)
            order_log = []
            out = {"copy_engine": type(store.copy_engine).__name__, "warm_pinned": bool(store.pinned),
                   "plain_pinned": pinned, "rounds_counted": 0}
            for round_index in range(rounds + 1):
                order = round_order(names, round_index) if round_index else names
                order_log.append(order)
                for case in order:
                    for direction, call, finish in cases[case]:
                        timing = timed_call(ctx, call, finish, events=case != "store")
                        if case == "store":
                            bad = timing["result"]
                            tiers, _ = store.placements(block_ids)
                            want = WARM if direction == "d2h" else HOT
                            assert not bad and (tiers == want).all(), \
                                f"store {direction} left tiers {sorted(set(tiers.tolist()))}, bad {bad}"
                        timing.pop("result")
                        if round_index:  # round 0 warms up
                            samples[case][direction].append(timing)
                if round_index:
                    out["rounds_counted"] = round_index
                if round_index and rec.left_s() < 3:
                    out["rounds_cut_by_budget"] = True
                    break
            _, slots = store.placements(block_ids)
            now = hot._blocks.index_select(3, torch.as_tensor(slots, device=ctx.device))
            out["data_round_trip_equal"] = bool(torch.equal(now, ref))
            out["order"] = order_log
            for case, per_direction in samples.items():
                figures = {}
                for direction, runs in per_direction.items():
                    if not runs:
                        figures[direction] = {"status": "failed", "error": "no counted round"}
                        continue
                    wall = statistics.median(r["wall_s"] for r in runs)
                    host_s = statistics.median(r["host_s"] for r in runs)
                    gpu = _median([r["gpu_s"] for r in runs])
                    figures[direction] = {
                        "rounds": len(runs), "wall_s": wall, "gb_per_s": num_bytes / GB / wall, "host_s": host_s,
                        "host_us_per_block": 1e6 * host_s / num_blocks,
                        "gpu_s": gpu, "gpu_gb_per_s": num_bytes / GB / gpu if gpu else None,
                        "samples_wall_s": [r["wall_s"] for r in runs]}
                out[case] = figures
            out["bytes_moved"] = store.stats()["bytes_moved"]
            return out
        finally:
            store.close()

    rec.part("moves", moves)
    m = rec.data.get("moves", {})
    if all(isinstance(m.get(c), dict) and "gb_per_s" in m[c].get(d, {}) for c in ("store", "plain_one_copy",
                                                                                  "plain_per_block")
           for d in ("d2h", "h2d")):
        s, one, per = m["store"], m["plain_one_copy"], m["plain_per_block"]
        rec.data["summary"] = {
            "blocks": num_blocks, "rounds": m["rounds_counted"],
            "store_h2d_gb_per_s": s["h2d"]["gb_per_s"], "store_d2h_gb_per_s": s["d2h"]["gb_per_s"],
            "plain_h2d_gb_per_s": one["h2d"]["gb_per_s"], "plain_d2h_gb_per_s": one["d2h"]["gb_per_s"],
            "h2d_ratio_store_over_plain": s["h2d"]["gb_per_s"] / one["h2d"]["gb_per_s"],
            "d2h_ratio_store_over_plain": s["d2h"]["gb_per_s"] / one["d2h"]["gb_per_s"],
            "h2d_ratio_store_over_plain_per_block": s["h2d"]["gb_per_s"] / per["h2d"]["gb_per_s"],
            "d2h_ratio_store_over_plain_per_block": s["d2h"]["gb_per_s"] / per["d2h"]["gb_per_s"],
            "store_host_us_per_block_h2d": s["h2d"]["host_us_per_block"],
            "store_host_us_per_block_d2h": s["d2h"]["host_us_per_block"],
            "plain_per_block_host_us_per_block_h2d": per["h2d"]["host_us_per_block"],
            "plain_per_block_host_us_per_block_d2h": per["d2h"]["host_us_per_block"],
            "data_round_trip_equal": m["data_round_trip_equal"]}
        rec.save()


# ---- section: compressed ----------------------------------------------------------------------
def section_compressed(ctx, rec: Recorder) -> None:
    import torch

    import tiered_kv
    from tiered_kv.compression import MODES, codec
    from tiered_kv.kernels import get_ops, reference
    from tiered_kv.scheduler import HOT, WARM

    layout = block_layout(ctx)
    num_blocks = ctx.sizes["compressed_blocks"]
    ops = get_ops()
    rec.data["layout"] = {"block_bytes": layout.block_bytes, "blocks": num_blocks, "dtype": layout.dtype_name}
    rec.data["kernels_backend"] = ops.backend

    def median_s(call, repeats: int = 5) -> float:
        call()
        return statistics.median(timed_call(ctx, call)["wall_s"] for _ in range(repeats))

    def kernel():
        out = {}
        x = torch.randn(num_blocks, *layout.record_shape(), device=ctx.device).to(torch.bfloat16)
        model_bytes = x.numel() * x.element_size()
        for mode in MODES[1:]:
            packed = codec.encode(x, mode)
            encode_row = encode_figures(x, packed, mode, model_bytes)
            want, got = torch.empty_like(x), torch.empty_like(x)
            reference.dequant_blocks(want, packed, None, mode)
            ops.dequant_blocks(got, packed, None, mode)
            ctx.sync()
            row = {"bitwise_equal_torch": bool(torch.equal(got, want)),
                   "max_abs_error_vs_input": float((got.float() - x.float()).abs().max()),
                   "ops_gb_per_s": model_bytes / GB / median_s(lambda: ops.dequant_blocks(got, packed, None, mode)),
                   "torch_gb_per_s": model_bytes / GB / median_s(lambda: reference.dequant_blocks(want, packed, None,
                                                                                                 mode)),
                   "packed_bytes": packed.numel()}
            if ctx.is_cuda:  # the kernel reading a pinned warm slab in place, through UVA
                pinned = packed.cpu().pin_memory()
                ops.dequant_blocks(got, pinned, None, mode)
                ctx.sync()
                row["from_pinned_bitwise_equal"] = bool(torch.equal(got, want))
                row["from_pinned_gb_per_s"] = model_bytes / GB / median_s(
                    lambda: ops.dequant_blocks(got, pinned, None, mode))
            out[mode] = {**row, **encode_row}
        return out

    def encode_figures(x, packed, mode: str, model_bytes: int) -> dict:
        """The encode kernel (ops.quant_blocks) against packing.encode on the CPU over the first blocks
        (the reference's bits: torch on CUDA divides by a constant as a product with its reciprocal),
        and model-dtype GB/s in for it and for the torch codec on the device."""
        if not hasattr(ops, "quant_blocks"):
            return {}
        from tiered_kv.compression import packing
        from tiered_kv.kernels.selfcheck import packed_mismatches

        got = torch.empty_like(packed)
        ops.quant_blocks(got, x, None, mode)
        ctx.sync()
        check = min(len(x), 32)
        mismatches = packed_mismatches(got[:check], packing.encode(x[:check].cpu(), mode), mode, layout.num_kv_heads,
                                       layout.block_size, layout.head_dim)
        return {"encode_bitwise_equal_cpu_torch": mismatches == 0, "encode_mismatched_bytes": mismatches,
                "encode_ops_gb_per_s": model_bytes / GB / median_s(lambda: ops.quant_blocks(got, x, None, mode)),
                "encode_torch_gb_per_s": model_bytes / GB / median_s(lambda: packing.encode(x, mode))}

    rec.part("kernel", kernel)

    def moves():
        out = {}
        full = {"high_watermark": 1.0, "low_watermark": 1.0}
        for mode in ("none", "int8"):
            store = tiered_kv.TierStore({
                "block_size": layout.block_size,
                "hot": {"device": str(ctx.device), "capacity_blocks": num_blocks, **full},
                "warm": {"capacity_blocks": num_blocks, "pinned": "auto", "layout": "records", "compression": mode,
                         **full},
                "cold": {"capacity": 0}, "scheduler": {"background": False}})
            try:
                store.bind(layout, torch.bfloat16)
                fill_random(store.tiers[HOT].slab)
                block_ids = store.allocate(num_blocks)
                _, slots = store.placements(block_ids)
                ref = store.tiers[HOT].read_blocks(list(slots)).clone()
                down = timed_call(ctx, lambda: store.demote(block_ids, WARM), store.copy_engine.synchronize)
                up = timed_call(ctx, lambda: store.promote(block_ids), store.copy_engine.synchronize)
                tiers, slots = store.placements(block_ids)
                back = store.tiers[HOT].read_blocks(list(slots))
                expected = ref if mode == "none" else codec.decode(codec.encode(ref, mode), mode,
                                                                   layout.num_kv_heads, layout.block_size,
                                                                   layout.head_dim, torch.bfloat16)
                out[mode] = {"d2h_s": down["wall_s"], "h2d_s": up["wall_s"], "all_back_hot": bool((tiers == HOT).all()),
                             "round_trip_as_expected": bool(torch.equal(back, expected)),
                             "bytes_moved": store.stats()["bytes_moved"]}
            finally:
                store.close()
        if all(m in out for m in ("none", "int8")):
            out["int8_speed_vs_none"] = {d: out["none"][f"{d}_s"] / out["int8"][f"{d}_s"] for d in ("d2h", "h2d")}
            out["d2h_target"] = 0.8  # issue 36: entering a compressed tier costs no more than a copy (GPU)
            out["d2h_meets_target"] = out["int8_speed_vs_none"]["d2h"] >= out["d2h_target"]
        return out

    rec.part("moves", moves)


# ---- section: cold -----------------------------------------------------------------------------
def drop_page_cache(path: str) -> dict:
    """Write the file's dirty pages back and ask the kernel to drop its cached pages (only this
    file; no root needed). tmpfs ignores it: the figures then measure memory."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    out = {"dropped": True}
    try:
        kvikio = import_kvikio()
        cached, total = kvikio.get_page_cache_info(path)
        out["pages_cached_after"], out["pages_total"] = cached, total
    except Exception:
        pass
    return out


def write_test_file(path: str, num_bytes: int) -> float:
    """`num_bytes` of random bytes (a 64 MiB random pattern repeated), fsynced; returns seconds."""
    import numpy as np

    pattern = np.random.default_rng(0).integers(0, 256, size=min(num_bytes, 64 << 20), dtype=np.uint8)
    started = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        done = 0
        while done < num_bytes:
            n = min(len(pattern), num_bytes - done)
            written = os.pwrite(fd, memoryview(pattern[:n]), done)
            done += written
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - started


def read_posix(ctx, path: str, host, device, chunk_bytes: int = 256 << 20) -> dict:
    """preadv into (pinned) host memory, then one copy to the device: what the cold tier does."""
    num_bytes = host.numel()
    view = memoryview(host.numpy())
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        ctx.sync()
        started = time.perf_counter()
        done = 0
        while done < num_bytes:
            n = os.preadv(fd, [view[done:min(num_bytes, done + chunk_bytes)]], done)
            if n <= 0:
                raise OSError(f"short read at {done} of {num_bytes}")
            done += n
        read_s = time.perf_counter() - started
        device.copy_(host, non_blocking=True)
        ctx.sync()
        total_s = time.perf_counter() - started
    finally:
        os.close(fd)
    return {"bytes": num_bytes, "read_s": read_s, "read_gb_per_s": num_bytes / GB / read_s, "total_s": total_s,
            "to_device_gb_per_s": num_bytes / GB / total_s}


def read_kvikio(ctx, path: str, device) -> dict:
    kvikio = import_kvikio()

    num_bytes = device.numel()
    ctx.sync()
    started = time.perf_counter()
    with kvikio.CuFile(path, "r") as f:
        try:
            import cupy

            target = cupy.asarray(device)
        except Exception:
            target = device
        got = f.pread(target, num_bytes, 0).get()
    ctx.sync()
    total_s = time.perf_counter() - started
    if got != num_bytes:
        raise OSError(f"kvikio short read: {got} of {num_bytes} bytes")
    return {"bytes": num_bytes, "total_s": total_s, "to_device_gb_per_s": num_bytes / GB / total_s}


def section_cold(ctx, rec: Recorder) -> None:
    import torch

    base = tempfile.mkdtemp(prefix="cold-", dir=ctx.scratch)
    rec.data["filesystem"] = filesystem_of(base)
    rec.part("kvikio", kvikio_settings)
    have_kvikio = "error" not in rec.data["kvikio"] and ctx.is_cuda
    try:
        def raw():
            num_bytes = ctx.sizes["cold_raw_bytes"]
            path = os.path.join(base, "raw.bin")
            out = {"bytes": num_bytes, "write_s": write_test_file(path, num_bytes)}
            host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=ctx.is_cuda)
            ref = torch.empty(num_bytes, dtype=torch.uint8, device=ctx.device)
            out["drop_1"] = drop_page_cache(path)
            out["posix_disk"] = read_posix(ctx, path, host, ref)
            rec.data["raw"] = out
            rec.save()
            if have_kvikio:
                dev = torch.empty(num_bytes, dtype=torch.uint8, device=ctx.device)
                try:
                    out["drop_2"] = drop_page_cache(path)
                    out["kvikio_disk"] = read_kvikio(ctx, path, dev)
                    out["kvikio_bytes_equal_posix"] = bool(torch.equal(dev, ref))
                    out["kvikio_cached"] = read_kvikio(ctx, path, dev)
                    import_kvikio()
                    import kvikio.defaults

                    threads = min(16, os.cpu_count() or 1)
                    with kvikio.defaults.set({"num_threads": threads}):
                        out["drop_3"] = drop_page_cache(path)
                        out[f"kvikio_disk_{threads}_threads"] = read_kvikio(ctx, path, dev)
                except BaseException as exc:  # noqa: BLE001
                    out["kvikio_error"] = error_record(exc)
                del dev
            else:
                out["kvikio_disk"] = {"skipped": "kvikio does not import or no CUDA device"}
            out["posix_cached"] = read_posix(ctx, path, host, ref)
            os.unlink(path)
            return out

        rec.part("raw", raw)
        for backend in ("posix", "kvikio"):
            if rec.left_s() < 5:
                rec.data[f"tier_{backend}"] = {"skipped": "section time budget"}
                continue
            rec.part(f"tier_{backend}", cold_tier_round_trip, ctx, base, backend)
        summarize_cold(rec)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def cold_tier_round_trip(ctx, base: str, backend: str) -> dict:
    """Hot -> cold (demote) and cold -> hot (promote) of the same blocks through a TierStore whose
    cold tier uses `backend`: once with the file's pages dropped (disk), once cached."""
    import torch

    import tiered_kv
    from tiered_kv.scheduler import COLD, HOT

    layout = block_layout(ctx)
    num_blocks = max(2, ctx.sizes["cold_tier_bytes"] // layout.block_bytes)
    num_bytes = num_blocks * layout.block_bytes
    path = os.path.join(base, f"tier-{backend}")
    store = tiered_kv.TierStore({"block_size": layout.block_size,
                                 "hot": {"device": str(ctx.device), "capacity_blocks": num_blocks,
                                         "high_watermark": 1.0, "low_watermark": 1.0},
                                 "warm": {"capacity": 0},
                                 "cold": {"capacity_blocks": num_blocks, "path": path, "backend": backend},
                                 "scheduler": {"background": False}})
    try:
        store.bind(layout, torch.bfloat16)
        cold = store.tiers[COLD]
        out = {"blocks": num_blocks, "bytes": num_bytes, "io": cold.io.name,
               "note": "the cold tier moves whole blocks through host staging (preadv/pwritev + XXH3 checks); "
                       "its kvikio backend routes host buffers through POSIX, so the tier path does not use "
                       "GDS today (compare 'raw')"}
        hot = store.tiers[HOT]
        fill_random(hot.slab)
        block_ids = store.allocate(num_blocks)
        _, slots = store.placements(block_ids)
        ref = hot._blocks.index_select(3, torch.as_tensor(slots, device=ctx.device))
        for label in ("disk", "cached"):
            ctx.sync()
            started = time.perf_counter()
            bad = store.demote(block_ids, COLD)
            store.copy_engine.synchronize()
            write_s = time.perf_counter() - started
            tiers, _ = store.placements(block_ids)
            assert not bad and (tiers == COLD).all(), f"demote left tiers {sorted(set(tiers.tolist()))}"
            if label == "disk":
                out["drop"] = drop_page_cache(cold.file_path)
            ctx.sync()
            started = time.perf_counter()
            bad = store.promote(block_ids)
            store.copy_engine.synchronize()
            ctx.sync()
            read_s = time.perf_counter() - started
            tiers, slots = store.placements(block_ids)
            assert not bad and (tiers == HOT).all(), f"promote left tiers {sorted(set(tiers.tolist()))}, bad {bad}"
            now = hot._blocks.index_select(3, torch.as_tensor(slots, device=ctx.device))
            out[label] = {"demote_s": write_s, "demote_gb_per_s": num_bytes / GB / write_s,
                          "promote_s": read_s, "promote_gb_per_s": num_bytes / GB / read_s,
                          "data_round_trip_equal": bool(torch.equal(now, ref))}
        return out
    finally:
        store.close()
        shutil.rmtree(path, ignore_errors=True)


def summarize_cold(rec: Recorder) -> None:
    raw = rec.data.get("raw", {})
    out = {}
    for key in ("posix_disk", "kvikio_disk", "posix_cached", "kvikio_cached"):
        if isinstance(raw.get(key), dict) and "to_device_gb_per_s" in raw[key]:
            out[f"raw_{key}_gb_per_s"] = raw[key]["to_device_gb_per_s"]
    for key, value in raw.items():
        if key.startswith("kvikio_disk_") and isinstance(value, dict) and "to_device_gb_per_s" in value:
            out[f"raw_{key}_gb_per_s"] = value["to_device_gb_per_s"]
    if "raw_posix_disk_gb_per_s" in out and "raw_kvikio_disk_gb_per_s" in out:
        out["raw_disk_kvikio_over_posix"] = out["raw_kvikio_disk_gb_per_s"] / out["raw_posix_disk_gb_per_s"]
    for backend in ("posix", "kvikio"):
        tier = rec.data.get(f"tier_{backend}", {})
        for label in ("disk", "cached"):
            if label in tier:
                out[f"tier_{backend}_{label}_promote_gb_per_s"] = tier[label]["promote_gb_per_s"]
                out[f"tier_{backend}_{label}_demote_gb_per_s"] = tier[label]["demote_gb_per_s"]
    kv = rec.data.get("kvikio", {})
    out["kvikio_compat_mode"] = kv.get("compat_mode", kv.get("error"))
    out["kvikio_compat_mode_preferred"] = kv.get("compat_mode_preferred")
    out["gds_available"] = kv.get("driver_is_gds_available")
    out["filesystem"] = rec.data.get("filesystem", {}).get("fstype")
    rec.data["summary"] = out
    rec.save()


# ---- section: pytest ---------------------------------------------------------------------------
def section_pytest(ctx, rec: Recorder) -> None:
    files = [f for f in ctx.sizes["pytest"] if (REPO / f).exists()]
    rec.data["files"] = files
    rec.data["missing"] = [f for f in ctx.sizes["pytest"] if f not in files]
    if not files:
        rec.data["skipped"] = "none of the test files exist"
        return
    limit = max(5.0, rec.left_s())
    cmd = [sys.executable, "-m", "pytest", "-q", "--maxfail=3", "-rfE", "-p", "no:cacheprovider", *files]
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=limit)
        rec.data["returncode"] = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        rec.data["returncode"] = None
        rec.data["timed_out_after_s"] = limit
    rec.data["pytest_s"] = round(time.monotonic() - started, 2)
    lines = output.strip().splitlines()
    rec.data["last_line"] = lines[-1] if lines else ""
    rec.data["output_tail"] = "\n".join(lines[-40:])
    say(f"[pytest] {rec.data['last_line']}")


def use_this_checkout() -> None:
    """Import tiered_kv from this checkout only. An editable install of another checkout (a dev
    venv) adds a finder that would serve submodules missing here (hooks, kernels) from there."""
    sys.path.insert(0, str(REPO))
    sys.meta_path[:] = [f for f in sys.meta_path if not str(getattr(f, "__module__", "")).startswith("__editable__")]
    for name in [n for n in sys.modules if n == "tiered_kv" or n.startswith("tiered_kv.")]:
        del sys.modules[name]


SECTION_FUNCS = {"env": section_env, "kernels": section_kernels, "decode": section_decode, "warm": section_warm,
                 "cold": section_cold, "compressed": section_compressed, "pytest": section_pytest}


def run_child(args) -> int:
    """One section in this process; results go to args.section_out as they come."""
    rec = Recorder(args.section_out, args.section, args.limit_s)
    try:
        use_this_checkout()
        ctx = Ctx(args)
        rec.data["device"] = str(ctx.device)
        SECTION_FUNCS[args.section](ctx, rec)
        rec.data["status"] = "ok"
    except BaseException as exc:  # noqa: BLE001
        rec.data.update(status="error", **error_record(exc))
        say(f"[{args.section}] error: {rec.data['error']}")
    rec.save()
    return 0


# ---- the orchestrator (no torch here) -------------------------------------------------------------
def run_section(name: str, args, limit_s: float, scratch: str) -> dict:
    """Run one section in a child process (its own process group), echo its output, and return
    what it saved; a timeout or a crash is recorded with the end of its output."""
    out_path = os.path.join(scratch, f"{name}.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--section", name, "--section-out", out_path,
           "--limit-s", str(limit_s), "--device", args.device, "--scratch", scratch]
    if args.quick:
        cmd.append("--quick")
    if args.decode_mover:
        cmd.append("--decode-mover")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True, bufsize=1)
    tail: list[str] = []

    def pump():
        for line in proc.stdout:
            if "SyncActivityProfilerHandler" in line:  # kineto's profiler_start/stop notes (decode profiles)
                continue
            tail.append(line.rstrip("\n"))
            del tail[:-60]
            say(f"  {line.rstrip()}" if line.startswith("[") else f"  [{name}] {line.rstrip()}")

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    reader.join(timeout=5)
    try:
        with open(out_path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        data = {"status": "no result"}
    data["wall_s"] = round(time.monotonic() - started, 2)
    data["returncode"] = proc.returncode
    if timed_out:
        data["status"] = "timeout"
        data["limit_s"] = limit_s
    if data.get("status") != "ok":
        data["output_tail"] = "\n".join(tail[-40:])
    return data


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec) if isinstance(value, (int, float)) else str(value)


def print_summary(result: dict) -> None:
    sections = result["sections"]
    say("\n==== gpu_check summary ====")
    for name, data in sections.items():
        say(f"{name:8s} {data.get('status', '?'):8s} {data.get('wall_s', 0):6.1f} s"
            + (f"  {data.get('error', '')[:150]}" if data.get("error") else ""))
    env = sections.get("env", {})
    basics, backends = env.get("basics", {}), env.get("backends", {})
    mods = env.get("modules", {})
    if basics:
        say(f"env: torch {basics.get('torch')} cuda {basics.get('torch_cuda')} gpu {basics.get('gpu', '-')}; "
            f"transformers {mods.get('transformers', {}).get('version')}; "
            f"kvikio {mods.get('kvikio', {}).get('version') or 'missing'}")
    if backends and "error" not in backends:
        say(f"backends: hot {backends.get('hot_device')} copy {backends.get('copy_engine')} pinned "
            f"{backends.get('warm_pinned')} link {backends.get('link_monitor')} cold {backends.get('cold_backend')} "
            f"kernels {backends.get('kernels_backend')}")
    kernels = sections.get("kernels", {}).get("selfcheck", {})
    if kernels:
        result = kernels.get("result") if isinstance(kernels.get("result"), dict) else {}
        say("kernels: " + (f"backend {result.get('backend')} ({result.get('fallback_reason') or 'native'}), "
                           f"max abs error over all {kernels.get('max_abs_error_over_all')}, worst "
                           f"{kernels.get('worst', [])[:3]}, {kernels.get('selfcheck_s')} s"
                           if "result" in kernels else kernels.get("error", "")[:200]))
    for context, block in sections.get("decode", {}).get("summary", {}).items():
        if "variants" not in block:
            say(f"decode @ {context}: {str(block.get('error'))[:150]}")
            continue
        control = block.get("control") or {}
        say(f"decode @ {context}: {block.get('rounds')} rounds; A/A control "
            f"{_fmt(control.get('speed_vs_dynamic'), '.3f')}x (paired {_fmt(control.get('paired_speed_vs_dynamic'), '.3f')}, "
            f"within 3%: {control.get('within_3pct')}); exactness ok: {block.get('exactness_ok')} "
            f"{block.get('exactness_off') or ''}")
        for variant, f in block["variants"].items():
            if "step_ms" not in f:
                say(f"  {variant:33s} {f.get('status')}: {f.get('error', '')[:110]}")
                continue
            bitwise = "reference" if variant == "dynamic" else "bitwise" if f.get("logits_bitwise_equal") else \
                f"max diff {_fmt(f.get('logits_max_abs_diff'), '.3g')}"
            say(f"  {variant:33s} {f['step_ms']:8.2f} ms (gpu {_fmt(f.get('gpu_step_ms'), '.2f')}, host "
                f"{f['host_step_ms']:.2f})  {_fmt(f.get('speed_vs_dynamic') or 1.0, '.2f')}x DC  "
                f"tokens {'same' if f.get('tokens_equal_dynamic') in (True, None) else 'DIFFER'}  {bitwise}  "
                f"syncs {_fmt(f.get('syncs_per_step'), 'g')}  sdpa {f.get('sdpa_backend')}"
                + (f"  paged {f['paged_steps_per_step']:g}/step" if f.get("paged_steps_per_step") else "")
                + (f"  vs all hot {f['speed_vs_all_hot_same_hooks']:.2f}x" if f.get("speed_vs_all_hot_same_hooks")
                   else ""))
    warm = sections.get("warm", {}).get("summary")
    if warm:
        say("warm ({blocks} blocks, {rounds} rounds): store H2D {store_h2d_gb_per_s:.2f} GB/s "
            "({h2d_ratio_store_over_plain:.2f}x plain {plain_h2d_gb_per_s:.2f}), D2H {store_d2h_gb_per_s:.2f} GB/s "
            "({d2h_ratio_store_over_plain:.2f}x plain {plain_d2h_gb_per_s:.2f}); store host "
            "{store_host_us_per_block_h2d:.1f} / {store_host_us_per_block_d2h:.1f} us per block (plain per-block "
            "copies {plain_per_block_host_us_per_block_h2d:.1f} / {plain_per_block_host_us_per_block_d2h:.1f}); "
            "data equal {data_round_trip_equal}".format(**warm))
    cold = sections.get("cold", {}).get("summary")
    if cold:
        say("cold: " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in cold.items()))
    compressed = sections.get("compressed", {})
    for mode, row in (compressed.get("kernel") or {}).items():
        if isinstance(row, dict) and "ops_gb_per_s" in row:
            say(f"dequant {mode}: {row['ops_gb_per_s']:.1f} GB/s ({compressed.get('kernels_backend')}; torch "
                f"{row['torch_gb_per_s']:.1f}), bitwise {row['bitwise_equal_torch']}"
                + (f", from pinned {row['from_pinned_gb_per_s']:.1f} GB/s" if "from_pinned_gb_per_s" in row else ""))
        if isinstance(row, dict) and "encode_ops_gb_per_s" in row:
            say(f"encode {mode}: {row['encode_ops_gb_per_s']:.1f} GB/s (torch {row['encode_torch_gb_per_s']:.1f}), "
                f"bitwise vs CPU torch {row['encode_bitwise_equal_cpu_torch']}")
    speed = (compressed.get("moves") or {}).get("int8_speed_vs_none")
    if isinstance(speed, dict):
        say(f"moves int8 warm vs none: hot->warm {speed['d2h']:.2f}x, warm->hot {speed['h2d']:.2f}x "
            f"(issue 36's GPU target: hot->warm >= 0.8x)")
    pytest_data = sections.get("pytest", {})
    if pytest_data.get("last_line"):
        say(f"pytest: {pytest_data['last_line']}")


def section_limits(names: list[str], budget_s: float, quick: bool) -> dict:
    """Each section's hard limit: its LIMITS_S entry, all shrunk in proportion when they and the
    orchestrator's reserve per section do not fit in the budget (never grown)."""
    limits = QUICK_LIMITS_S if quick else LIMITS_S
    room = max(0.0, budget_s - ORCHESTRATOR_RESERVE_S * len(names))
    scale = min(1.0, room / max(1e-9, sum(limits[n] for n in names)))
    return {n: limits[n] * scale for n in names}


def orchestrate(args) -> int:
    started = time.monotonic()
    names = [s.strip() for s in args.sections.split(",") if s.strip()] if args.sections else list(SECTIONS)
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        raise SystemExit(f"--sections: unknown {unknown}; allowed: {','.join(SECTIONS)}")
    limits = section_limits(names, args.budget_s, args.quick)
    base = args.scratch or tempfile.gettempdir()
    os.makedirs(base, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="gpu_check-", dir=base)
    result = {"command": sys.argv, "mode": "quick" if args.quick else "full", "started_unix": time.time(),
              "budget_s": args.budget_s, "limits_s": {n: round(v, 1) for n, v in limits.items()}, "sections": {}}
    say(f"gpu_check: mode {result['mode']}, sections {names}, budget {args.budget_s} s, scratch {scratch}")
    try:
        for i, name in enumerate(names):
            left = args.budget_s - (time.monotonic() - started)
            later = sum(limits[n] + ORCHESTRATOR_RESERVE_S for n in names[i + 1:])
            # time a section before left unused goes to this one (up to 1.5x its limit); the
            # sections still to come keep theirs, so the whole run stays inside the budget
            limit = min(1.5 * limits[name], left - later - ORCHESTRATOR_RESERVE_S)
            if limit < min(10.0, 0.5 * limits[name]):
                result["sections"][name] = {"status": "skipped",
                                            "error": f"total budget spent ({left:.0f} s left, {limit:.0f} s for it)"}
                continue
            say(f"== {name} (limit {limit:.0f} s)")
            result["sections"][name] = run_section(name, args, limit, scratch)
            result["wall_s"] = round(time.monotonic() - started, 2)
            write_json(args.out, result)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    result["wall_s"] = round(time.monotonic() - started, 2)
    result["within_budget"] = result["wall_s"] <= args.budget_s
    write_json(args.out, result)
    print_summary(result)
    say(f"wrote {args.out} ({result['wall_s']:.0f} s of a {args.budget_s:.0f} s budget)")
    return 0


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="gpu_check.json", help="where the JSON goes")
    parser.add_argument("--quick", action="store_true", help="tiny sizes on CPU: a dry run of every section")
    parser.add_argument("--device", default="auto", help="auto (cuda when present; cpu with --quick), cpu or cuda")
    parser.add_argument("--sections", default="", help=f"comma-separated subset of {','.join(SECTIONS)}")
    parser.add_argument("--budget-s", type=float, default=TOTAL_BUDGET_S, help="wall-clock budget of the whole run")
    parser.add_argument("--scratch", default=None, help="directory for cold-tier files (default: the temp dir)")
    parser.add_argument("--decode-mover", action="store_true",
                        help="run each decode bank's background mover (off by default: see bank_config)")
    parser.add_argument("--section", choices=SECTIONS, help=argparse.SUPPRESS)
    parser.add_argument("--section-out", help=argparse.SUPPRESS)
    parser.add_argument("--limit-s", type=float, default=60.0, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.section:
        return run_child(args)
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
