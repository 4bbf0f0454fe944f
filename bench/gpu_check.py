#!/usr/bin/env python
"""One prepared run on a lent GPU: every figure issue 8 item 6 asks for, in one JSON file.

    python3 bench/gpu_check.py --out $OUT/gpu.json          # the GPU run (about 4-6 minutes)
    python3 bench/gpu_check.py --quick --out /tmp/q.json    # tiny sizes on CPU (< 1 minute)

Sections, in this order, each in its own child process with its own time limit (a crash, a
hang or a poisoned CUDA context in one cannot take the others down):
  env     versions, the GPU, and which backends tiered_kv chose at start
  kernels tiered_kv.kernels.selfcheck(): max abs error of each CUDA kernel against torch
  decode  greedy decode tokens/s at 4k and 32k context: DynamicCache, CacheBank (no hooks,
          hooks exact, hooks merge), and a bank whose hot tier holds 25% of the chat (rest warm)
  warm    hot<->warm block moves through a TierStore beside plain pinned copies of the bytes
  cold    cold reads: kvikio (GPUDirect Storage or its compat mode) beside preadv + copy, raw
          and through the cold tier (TierStore demote to cold, then promote)
  pytest  a few test files on this machine (where they fit in the time left)
A failing part records its error and traceback in the JSON and the run goes on. The JSON is
rewritten after every section (and sections save as they go), so a run killed at its limit
still leaves what it measured. bench/gpu_check.md says what every figure means.
"""

from __future__ import annotations

import argparse
import gc
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
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SECTIONS = ("env", "kernels", "decode", "warm", "cold", "pytest")
# hard limit per section (the child is killed past it) and the soft deadline inside it, seconds
LIMITS_S = {"env": 40, "kernels": 45, "decode": 150, "warm": 35, "cold": 60, "pytest": 60}
QUICK_LIMITS_S = {"env": 30, "kernels": 30, "decode": 60, "warm": 30, "cold": 30, "pytest": 40}
SOFT_MARGIN_S = 12  # a section stops starting new parts this long before its hard limit
TOTAL_BUDGET_S = 360
GB = 1e9

# SmolLM2-135M's shape (the weights are not carried: random init, same compute and KV bytes)
SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, head_dim=64, rope_theta=100000.0,
                     tie_word_embeddings=True, rms_norm_eps=1e-5)
TINY_SHAPE = dict(vocab_size=256, hidden_size=96, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=6, num_key_value_heads=3, head_dim=16, tie_word_embeddings=True)

SIZES = {  # per mode: what each section moves
    "full": dict(shape=SMOLLM2_SHAPE, contexts=(4096, 32768), decode_steps=64, slow_decode_steps=16,
                 slow_context=8192, repeats=3, block_size=16, warm_bytes=1 << 30, warm_repeats=3,
                 cold_raw_bytes=1 << 30, cold_tier_bytes=1 << 29, pytest=("tests/test_kernels.py",
                 "tests/test_hooks.py", "tests/test_equivalence.py")),
    "quick": dict(shape=TINY_SHAPE, contexts=(40, 120), decode_steps=4, slow_decode_steps=3, slow_context=64,
                  repeats=1, block_size=16, warm_bytes=4 << 20, warm_repeats=2, cold_raw_bytes=8 << 20,
                  cold_tier_bytes=2 << 20, pytest=("tests/test_config.py",)),
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
        self.deadline = self.started + max(1.0, limit_s - SOFT_MARGIN_S)
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
    import kvikio.defaults

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
    Watermarks 1.0 so the mover never demotes below the budget: the budget is the experiment."""
    bs = ctx.sizes["block_size"]
    blocks = -(-total_tokens // bs) + 2
    full = {"high_watermark": 1.0, "low_watermark": 1.0}
    if hot_share is None:
        hot, warm = blocks, 0
    else:
        hot = max(1, math.ceil(hot_share * blocks))
        warm = blocks
    return {"block_size": bs, "hot": {"device": str(ctx.device), "capacity_blocks": hot, **full},
            "warm": {"capacity_blocks": warm, "pinned": "auto", **full}, "cold": {"capacity": 0}}


VARIANTS = (  # name, cache, hooks mode, hot share
    ("dynamic", "dynamic", None, None),
    ("bank", "bank", None, None),
    ("bank_hooks_exact", "bank", "exact", None),
    ("bank_hooks_merge", "bank", "merge", None),
    ("bank_hot25_hooks_exact", "bank", "exact", 0.25),
    ("bank_hot25_hooks_merge", "bank", "merge", 0.25),  # decode through native/paged_decode.cu
    ("bank_hot25", "bank", None, 0.25),
)


def decode_variant(ctx, model, prompt, variant, n_steps: int, repeats: int, deadline: float) -> dict:
    import torch
    from transformers import DynamicCache

    import tiered_kv

    name, kind, hooks_mode, hot_share = variant
    out: dict = {"decode_steps": n_steps, "hooks": hooks_mode, "hot_share": hot_share}
    context = prompt.shape[1]
    cfg = None
    if kind == "dynamic":
        cache = DynamicCache(config=model.config)
    else:
        cfg = bank_config(ctx, context + n_steps + 1, hot_share)
        out["config"] = cfg
        cache = tiered_kv.CacheBank(model, cfg)
    hooks = None
    step_logits: list = []
    try:
        if hooks_mode is not None:
            import tiered_kv.hooks as hooks

            hooks.install(model, cache, mode=hooks_mode)
        out["attn_implementation"] = getattr(model.config, "_attn_implementation", None)
        with torch.no_grad():
            ctx.sync()
            started = time.perf_counter()
            logits = model(input_ids=prompt, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
            first = logits.argmax(-1, keepdim=True)
            ctx.sync()
            out["prefill_s"] = time.perf_counter() - started
            out["prefill_tokens_per_s"] = context / out["prefill_s"]
            samples, tokens_by_rep = [], []
            for rep in range(1 + repeats):  # rep 0 warms up (first-call costs stay out of the figure)
                if rep and time.monotonic() + (samples[-1] if samples else out["warmup_s"]) > deadline:
                    out["repeats_cut_by_budget"] = True
                    break
                if rep:
                    cache.crop(-n_steps)
                ctx.sync()
                started = time.perf_counter()
                token, tokens = first, [first]
                for step in range(n_steps):
                    logits = model(input_ids=token, cache=cache, use_cache=True).logits[:, -1]
                    if rep == 0:  # every step's logits, to compare with DynamicCache's (untimed repeat)
                        step_logits.append(logits[0].float().cpu())
                    token = logits.argmax(-1, keepdim=True)
                    tokens.append(token)
                ctx.sync()
                elapsed = time.perf_counter() - started
                tokens_by_rep.append(torch.cat(tokens, dim=1)[0].tolist())
                if rep == 0:
                    out["warmup_s"] = elapsed
                else:
                    samples.append(elapsed)
        timed = samples or [out["warmup_s"]]
        out["step_samples_s"] = [s / n_steps for s in timed]
        out["timed_repeats"] = len(samples)
        out["tokens_per_s"] = n_steps / statistics.median(timed)
        out["step_ms"] = 1e3 * statistics.median(timed) / n_steps
        out["tokens"] = tokens_by_rep[0]
        out["tokens_same_every_repeat"] = all(t == tokens_by_rep[0] for t in tokens_by_rep)
        if kind == "bank":
            stats = cache.stats()
            out["bank_blocks"] = stats.get("bank_blocks")
            out["tiers"] = {k: {"used_blocks": v["used_blocks"], "capacity_blocks": v["capacity_blocks"],
                                "device": v["device"]} for k, v in stats["tiers"].items()}
            out["bytes_moved"] = stats.get("bytes_moved")
            out["critical_path"] = stats.get("critical_path")
            out["link_monitor"] = stats.get("scheduler", {}).get("link_monitor")
            out["contiguity"] = stats.get("contiguity")
            for key in stats:
                if key not in out and key not in ("tiers", "scheduler", "hits", "hit_rate", "store_critical_path"):
                    out.setdefault("other_stats", {})[key] = stats[key]
    finally:
        if hooks is not None:
            try:
                hooks.uninstall(model)
            except BaseException as exc:  # noqa: BLE001
                out["uninstall_error"] = f"{type(exc).__name__}: {exc}"
        if getattr(model.config, "_attn_implementation", "sdpa") != "sdpa":
            out["attn_implementation_after"] = model.config._attn_implementation
            model.set_attn_implementation("sdpa")  # later variants must run on plain sdpa
        if kind == "bank":
            cache.close()
        del cache
        gc.collect()
        if ctx.is_cuda:
            torch.cuda.empty_cache()
    return out, torch.stack(step_logits) if step_logits else None


def section_decode(ctx, rec: Recorder) -> None:
    import torch

    sizes = ctx.sizes
    contexts = sizes["contexts"]
    rec.data["model"] = {"shape": sizes["shape"], "dtype": "bfloat16", "device": str(ctx.device),
                         "weights": "random init with SmolLM2-135M's config shape (the real weights are too big "
                                    "to carry to the GPU machine); compute and KV bytes per token are the same"
                         if ctx.mode == "full" else "tiny random model (quick mode)",
                         "timing": "greedy argmax, one token per forward; synchronize + perf_counter around "
                                   "the decode loop (Python overhead included); median of the timed repeats "
                                   "after one warm-up repeat; the cache is cropped back between repeats"}
    started = time.monotonic()
    model = build_model(ctx, max(contexts) + 4 * sizes["decode_steps"])
    rec.data["build_model_s"] = round(time.monotonic() - started, 3)

    def warm_up():  # CUDA context, cuBLAS handles, kernel choice: before any timed variant
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
    results: dict = {}
    rec.data["contexts"] = results
    parts_left = len(contexts) * len(VARIANTS)
    for context in contexts:
        generator = torch.Generator().manual_seed(context)
        prompt = torch.randint(3, model.config.vocab_size, (1, context), generator=generator).to(ctx.device)
        row: dict = {}
        logits: dict = {}
        results[str(context)] = row
        for variant in VARIANTS:
            name, _, _, hot_share = variant
            slow = hot_share is not None and context > sizes["slow_context"]
            n_steps = sizes["slow_decode_steps"] if slow else sizes["decode_steps"]
            left = rec.left_s()
            if left < (8 if ctx.mode == "full" else 1):
                row[name] = {"skipped": f"section time budget ({left:.0f} s left)"}
                parts_left -= 1
                rec.save()
                continue
            # timed repeats stop at this part's share of the time left (the warm-up always runs)
            part_deadline = time.monotonic() + min(left, 2.5 * left / max(1, parts_left))
            parts_left -= 1
            say(f"[decode] context {context}: {name} ({n_steps} steps)")
            part_started = time.monotonic()
            try:
                value, logits[name] = decode_variant(ctx, model, prompt, variant, n_steps, sizes["repeats"],
                                                     part_deadline)
            except BaseException as exc:  # noqa: BLE001 - a failing variant is a figure
                value = error_record(exc)
                say(f"[decode] context {context}: {name}: {value['error']}")
            value["seconds"] = round(time.monotonic() - part_started, 3)
            row[name] = value
            if "tokens_per_s" in value:
                say(f"[decode] context {context}: {name}: {value['tokens_per_s']:.1f} tok/s, "
                    f"prefill {value['prefill_s']:.3f} s, {value['seconds']:.1f} s in all")
            compare_to_dynamic(row, logits)
            rec.save()
    rec.data["summary"] = decode_summary(results)
    rec.save()


def compare_to_dynamic(row: dict, step_logits: dict) -> None:
    """Greedy tokens and every decode step's logits of each variant against DynamicCache's
    (a random model often repeats one token, so the logits are the sharper check)."""
    import torch

    ref = row.get("dynamic", {})
    ref_tokens, ref_logits = ref.get("tokens"), step_logits.get("dynamic")
    for name, value in row.items():
        logits = step_logits.get(name)
        if name == "dynamic" or not isinstance(value, dict) or "tokens" not in value or ref_tokens is None:
            continue
        n = min(len(ref_tokens), len(value["tokens"]))
        mismatch = next((i for i in range(n) if ref_tokens[i] != value["tokens"][i]), None)
        value["tokens_equal_dynamic"] = mismatch is None
        value["tokens_compared"] = n
        value["first_mismatch_index"] = mismatch
        if logits is not None and ref_logits is not None:
            steps = min(len(logits), len(ref_logits))
            diff = (logits[:steps] - ref_logits[:steps]).abs()
            value["logits_steps_compared"] = steps
            value["logits_max_abs_diff"] = float(diff.max())
            value["logits_max_abs_diff_first_step"] = float(diff[0].max())
            value["logits_bitwise_equal"] = bool(torch.equal(logits[:steps], ref_logits[:steps]))
        if "tokens_per_s" in value and "tokens_per_s" in ref:
            value["speed_vs_dynamic"] = value["tokens_per_s"] / ref["tokens_per_s"]
    for name in ("bank_hot25", "bank_hot25_hooks_exact", "bank_hot25_hooks_merge"):
        all_hot = row.get("bank_hooks_exact" if "hooks" in name else "bank", {})
        if "tokens_per_s" in row.get(name, {}) and "tokens_per_s" in all_hot:
            row[name]["speed_vs_all_hot_same_hooks"] = row[name]["tokens_per_s"] / all_hot["tokens_per_s"]


def decode_summary(results: dict) -> dict:
    out = {}
    for context, row in results.items():
        line = {}
        for name, value in row.items():
            if "tokens_per_s" in value:
                line[name] = {"tok_s": round(value["tokens_per_s"], 2),
                              "vs_dynamic": round(value.get("speed_vs_dynamic", 1.0), 3),
                              "tokens_equal": value.get("tokens_equal_dynamic", name == "dynamic"),
                              "logits_bitwise": value.get("logits_bitwise_equal", name == "dynamic"),
                              "logits_max_abs_diff": value.get("logits_max_abs_diff", 0.0)}
                if "speed_vs_all_hot_same_hooks" in value:
                    line[name]["vs_all_hot"] = round(value["speed_vs_all_hot_same_hooks"], 3)
            else:
                line[name] = {"error": value.get("error") or value.get("skipped") or "no figure"}
        out[context] = line
    return out


# ---- section: warm -----------------------------------------------------------------------------
def timed_copy_gbps(ctx, fn, num_bytes: int, repeats: int) -> dict:
    """GB/s of fn() (median of `repeats` after one warm-up), timed with CUDA events on GPU."""
    import torch

    fn()
    ctx.sync()
    samples = []
    for _ in range(repeats):
        if ctx.is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            started = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - started)
    seconds = statistics.median(samples)
    return {"bytes": num_bytes, "seconds": seconds, "gb_per_s": num_bytes / GB / seconds, "samples_s": samples}


def fill_random(tensor) -> None:
    """Random values (never zeros: METHOD.md), in chunks so no big temporary is made."""
    flat = tensor.view(-1)
    step = 1 << 27
    for start in range(0, flat.numel(), step):
        part = flat[start:start + step]
        if part.is_floating_point():
            part.normal_()
        else:
            part.random_(0, 256)


def section_warm(ctx, rec: Recorder) -> None:
    import torch

    import tiered_kv
    from tiered_kv.scheduler import HOT, WARM

    layout = block_layout(ctx)
    num_blocks = max(2, ctx.sizes["warm_bytes"] // layout.block_bytes)
    num_bytes = num_blocks * layout.block_bytes
    repeats = ctx.sizes["warm_repeats"]
    rec.data["layout"] = {"block_bytes": layout.block_bytes, "blocks": num_blocks, "bytes": num_bytes,
                          "shape": list(layout.record_shape()), "dtype": layout.dtype_name}

    def store_moves():
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
            out = {"copy_engine": type(store.copy_engine).__name__, "warm_pinned": bool(store.pinned),
                   "d2h_s": [], "h2d_s": []}
            for _ in range(repeats):
                ctx.sync()
                started = time.perf_counter()
                bad = store.demote(block_ids, WARM)
                store.copy_engine.synchronize()
                ctx.sync()
                out["d2h_s"].append(time.perf_counter() - started)
                tiers, _ = store.placements(block_ids)
                assert not bad and (tiers == WARM).all(), f"demote left tiers {sorted(set(tiers.tolist()))}, bad {bad}"
                started = time.perf_counter()
                bad = store.promote(block_ids)
                store.copy_engine.synchronize()
                ctx.sync()
                out["h2d_s"].append(time.perf_counter() - started)
                tiers, slots = store.placements(block_ids)
                assert not bad and (tiers == HOT).all(), f"promote left tiers {sorted(set(tiers.tolist()))}, bad {bad}"
            now = hot._blocks.index_select(3, torch.as_tensor(slots, device=ctx.device))
            out["data_round_trip_equal"] = bool(torch.equal(now, ref))
            for direction in ("d2h", "h2d"):
                seconds = statistics.median(out[f"{direction}_s"])
                out[f"{direction}_gb_per_s"] = num_bytes / GB / seconds
            out["bytes_moved"] = store.stats()["bytes_moved"]
            return out
        finally:
            store.close()

    rec.part("store", store_moves)

    def plain():
        pinned = ctx.is_cuda
        host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=pinned)
        device = torch.empty(num_bytes, dtype=torch.uint8, device=ctx.device)
        fill_random(host)
        fill_random(device)
        bb = layout.block_bytes
        out = {"pinned": pinned,
               "h2d_one_copy": timed_copy_gbps(ctx, lambda: device.copy_(host, non_blocking=True), num_bytes, repeats),
               "d2h_one_copy": timed_copy_gbps(ctx, lambda: host.copy_(device, non_blocking=True), num_bytes, repeats)}

        def per_block(dst, src):
            for i in range(num_blocks):
                dst[i * bb:(i + 1) * bb].copy_(src[i * bb:(i + 1) * bb], non_blocking=True)

        out["h2d_per_block"] = timed_copy_gbps(ctx, lambda: per_block(device, host), num_bytes, repeats)
        out["d2h_per_block"] = timed_copy_gbps(ctx, lambda: per_block(host, device), num_bytes, repeats)
        return out

    rec.part("plain", plain)
    store, base = rec.data.get("store", {}), rec.data.get("plain", {})
    if "h2d_gb_per_s" in store and "h2d_one_copy" in base:
        rec.data["summary"] = {
            "store_h2d_gb_per_s": store["h2d_gb_per_s"], "store_d2h_gb_per_s": store["d2h_gb_per_s"],
            "plain_h2d_gb_per_s": base["h2d_one_copy"]["gb_per_s"], "plain_d2h_gb_per_s": base["d2h_one_copy"]["gb_per_s"],
            "h2d_ratio_store_over_plain": store["h2d_gb_per_s"] / base["h2d_one_copy"]["gb_per_s"],
            "d2h_ratio_store_over_plain": store["d2h_gb_per_s"] / base["d2h_one_copy"]["gb_per_s"],
            "h2d_ratio_store_over_plain_per_block": store["h2d_gb_per_s"] / base["h2d_per_block"]["gb_per_s"],
            "d2h_ratio_store_over_plain_per_block": store["d2h_gb_per_s"] / base["d2h_per_block"]["gb_per_s"],
            "data_round_trip_equal": store["data_round_trip_equal"]}
        rec.save()


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
                 "cold": section_cold, "pytest": section_pytest}


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
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True, bufsize=1)
    tail: list[str] = []

    def pump():
        for line in proc.stdout:
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
            proc.wait(timeout=5)
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
    for context, line in sections.get("decode", {}).get("summary", {}).items():
        say(f"decode @ {context}:")
        for variant, figure in line.items():
            if "tok_s" in figure:
                extra = f" vs_all_hot {figure['vs_all_hot']:.2f}x" if "vs_all_hot" in figure else ""
                say(f"  {variant:24s} {figure['tok_s']:9.1f} tok/s  {figure['vs_dynamic']:5.2f}x DC  "
                    f"tokens {'same' if figure['tokens_equal'] else 'DIFFER'}  logits "
                    f"{'bitwise' if figure['logits_bitwise'] else 'max diff %.3g' % figure['logits_max_abs_diff']}"
                    f"{extra}")
            else:
                say(f"  {variant:24s} {figure['error'][:120]}")
    warm = sections.get("warm", {}).get("summary")
    if warm:
        say("warm: store H2D {store_h2d_gb_per_s:.2f} GB/s ({h2d_ratio_store_over_plain:.2f}x plain "
            "{plain_h2d_gb_per_s:.2f}), D2H {store_d2h_gb_per_s:.2f} GB/s ({d2h_ratio_store_over_plain:.2f}x plain "
            "{plain_d2h_gb_per_s:.2f}); data equal {data_round_trip_equal}".format(**warm))
    cold = sections.get("cold", {}).get("summary")
    if cold:
        say("cold: " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in cold.items()))
    pytest_data = sections.get("pytest", {})
    if pytest_data.get("last_line"):
        say(f"pytest: {pytest_data['last_line']}")


def orchestrate(args) -> int:
    started = time.monotonic()
    limits = dict(QUICK_LIMITS_S if args.quick else LIMITS_S)
    names = [s.strip() for s in args.sections.split(",") if s.strip()] if args.sections else list(SECTIONS)
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        raise SystemExit(f"--sections: unknown {unknown}; allowed: {','.join(SECTIONS)}")
    base = args.scratch or tempfile.gettempdir()
    os.makedirs(base, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="gpu_check-", dir=base)
    result = {"command": sys.argv, "mode": "quick" if args.quick else "full", "started_unix": time.time(),
              "budget_s": args.budget_s, "sections": {}}
    say(f"gpu_check: mode {result['mode']}, sections {names}, budget {args.budget_s} s, scratch {scratch}")
    try:
        for name in names:
            left = args.budget_s - (time.monotonic() - started)
            # never starve the sections still to come below half their limit
            later = sum(limits[n] for n in names[names.index(name) + 1:])
            limit = min(limits[name], max(limits[name] / 2, left - later / 2))
            if left < 10:
                result["sections"][name] = {"status": "skipped", "error": f"total budget spent ({left:.0f} s left)"}
                continue
            say(f"== {name} (limit {limit:.0f} s)")
            result["sections"][name] = run_section(name, args, limit, scratch)
            result["wall_s"] = round(time.monotonic() - started, 2)
            write_json(args.out, result)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    result["wall_s"] = round(time.monotonic() - started, 2)
    write_json(args.out, result)
    print_summary(result)
    say(f"wrote {args.out} ({result['wall_s']:.0f} s)")
    return 0


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="gpu_check.json", help="where the JSON goes")
    parser.add_argument("--quick", action="store_true", help="tiny sizes on CPU: a dry run of every section")
    parser.add_argument("--device", default="auto", help="auto (cuda when present; cpu with --quick), cpu or cuda")
    parser.add_argument("--sections", default="", help=f"comma-separated subset of {','.join(SECTIONS)}")
    parser.add_argument("--budget-s", type=float, default=TOTAL_BUDGET_S, help="wall-clock budget of the whole run")
    parser.add_argument("--scratch", default=None, help="directory for cold-tier files (default: the temp dir)")
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
