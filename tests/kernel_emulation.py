"""Runs the native/*.cu kernels on the CPU: a host build with an emulation of the CUDA they use.

For tests on machines without a GPU. Each `.cu` file, as inlined for NVRTC (sources.read_source),
is compiled by g++ (C++20) together with a prelude that emulates the subset of CUDA the kernels
use: one std::thread per GPU thread, a std::barrier per block for `__syncthreads` /
`__syncthreads_or` and one per warp for `__shfl_xor_sync`, `__shared__` as function statics (the
blocks of a launch run one after another). The PTX in common.cuh (fp16 conversions, the 16-byte
global load) is swapped for host code. The emulation also checks what a GPU would not report:
every thread of a block (warp) must reach the same sync (shuffle) site in the same phase, with the
same shuffle offset and a full mask, and a 16-byte load must be 16-byte aligned; a violation makes
`launch` raise. It says nothing about speed, and not everything about the GPU memory model (no
data race detection).

    import kernel_emulation as emulation          # from tests/
    from tiered_kv.kernels import cuda
    # with pytest's monkeypatch: route the CUDA wrappers' launches to the host build, CPU tensors
    emulation.route(monkeypatch.setattr)
    out, lse = cuda.paged_decode(...)          # CPU tensors; the kernels run on the host

`unavailable_reason()` is None when g++ can build it here.
"""

from __future__ import annotations

import ctypes
import hashlib
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np

from tiered_kv.kernels.sources import HEADER_NAME, KERNEL_FILES, native_dir, read_source

COMPILER = "g++"
COMPILE_FLAGS = ("-std=c++20", "-O1", "-fPIC", "-shared", "-pthread", "-fno-strict-aliasing",
                 "-Wno-unknown-pragmas")
_C_TYPES = {"long long": ctypes.c_longlong, "int": ctypes.c_int, "float": ctypes.c_float}
_SUFFIX_TYPES = {"f32": "float", "f16": "tkv_half", "bf16": "tkv_bf16"}

PRELUDE = r"""
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <math.h>
#include <mutex>
#include <thread>
#include <vector>

struct tkv_emu_dim3 { unsigned x, y, z; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
static thread_local tkv_emu_dim3 threadIdx;
static thread_local tkv_emu_dim3 blockIdx;
static tkv_emu_dim3 gridDim, blockDim;

static std::mutex tkv_emu_error_lock;
static int tkv_emu_error_count = 0;
static char tkv_emu_error_text[4096];
static void tkv_emu_record(const char* what, long long a, long long b) {
    std::lock_guard<std::mutex> hold(tkv_emu_error_lock);
    if (tkv_emu_error_count++ < 4) {
        size_t used = strlen(tkv_emu_error_text);
        snprintf(tkv_emu_error_text + used, sizeof(tkv_emu_error_text) - used,
                 "%s (%lld vs %lld) in block (%u, %u, %u) thread %u; ", what, a, b, blockIdx.x, blockIdx.y,
                 blockIdx.z, threadIdx.x);
    }
}

struct tkv_emu_stop {};  // thrown in every thread of a block once it is broken: the threads leave
struct tkv_emu_block;
static void tkv_emu_break(tkv_emu_block* block);

// A barrier that a broken block releases, and that breaks its block after TKV_EMU_STALL_S seconds
// without progress (a deadlock: threads waiting at different syncs).
#define TKV_EMU_STALL_S 60
struct tkv_emu_barrier {
    std::mutex mu;
    std::condition_variable cv;
    int expected = 0;
    int arrived = 0;
    unsigned long phase = 0;
    tkv_emu_block* block = nullptr;
    const std::atomic<bool>* broken = nullptr;
    void arrive_and_wait() {
        std::unique_lock<std::mutex> hold(mu);
        if (broken->load()) throw tkv_emu_stop();
        const unsigned long mine = phase;
        if (++arrived >= expected) {
            arrived = 0;
            ++phase;
            cv.notify_all();
            return;
        }
        while (phase == mine && !broken->load()) {
            if (cv.wait_for(hold, std::chrono::seconds(TKV_EMU_STALL_S)) == std::cv_status::timeout && phase == mine &&
                !broken->load()) {
                hold.unlock();
                tkv_emu_record("deadlock: no progress at a sync for TKV_EMU_STALL_S s", arrived, expected);
                tkv_emu_break(block);
                hold.lock();
            }
        }
        if (phase == mine) throw tkv_emu_stop();
    }
    void arrive_and_drop() {  // a thread that exits stops counting (as on a GPU)
        std::lock_guard<std::mutex> hold(mu);
        --expected;
        if (arrived > 0 && arrived >= expected) {
            arrived = 0;
            ++phase;
            cv.notify_all();
        }
    }
    void wake() {
        std::lock_guard<std::mutex> hold(mu);
        cv.notify_all();
    }
};

struct tkv_emu_warp {
    tkv_emu_barrier bar;
    float values[32];
    int sites[32];
    int offsets[32];
};
struct tkv_emu_block {
    std::atomic<bool> broken{false};
    tkv_emu_barrier bar;
    int threads = 0;
    int flags[1024];
    int sites[1024];
    tkv_emu_warp warps[32];
};
static void tkv_emu_break(tkv_emu_block* block) {
    block->broken.store(true);
    block->bar.wake();
    for (auto& w : block->warps) w.bar.wake();
}
static thread_local tkv_emu_block* tkv_emu_current;

static void tkv_emu_fail(const char* what, long long a, long long b) {  // a violation: report, stop the block
    tkv_emu_record(what, a, b);
    tkv_emu_break(tkv_emu_current);
    throw tkv_emu_stop();
}

static inline void tkv_emu_syncthreads(int site) {
    tkv_emu_block* c = tkv_emu_current;
    c->sites[threadIdx.x] = site;
    c->bar.arrive_and_wait();
    for (int t = 0; t < c->threads; ++t)
        if (c->sites[t] != site && c->sites[t] != -1) tkv_emu_fail("__syncthreads at another site", c->sites[t], site);
    c->bar.arrive_and_wait();
}
static inline int tkv_emu_syncthreads_or(int p, int site) {
    tkv_emu_block* c = tkv_emu_current;
    c->flags[threadIdx.x] = p ? 1 : 0;
    c->sites[threadIdx.x] = site;
    c->bar.arrive_and_wait();
    int r = 0;
    for (int t = 0; t < c->threads; ++t) {
        if (c->sites[t] == -1) continue;  // exited
        r |= c->flags[t];
        if (c->sites[t] != site) tkv_emu_fail("__syncthreads_or at another site", c->sites[t], site);
    }
    c->bar.arrive_and_wait();
    return r;
}
static inline float tkv_emu_shfl_xor(unsigned mask, float v, int offset, int site) {
    if (mask != 0xffffffffu) tkv_emu_fail("shuffle with a partial mask", (long long)mask, 0);
    tkv_emu_warp* w = &tkv_emu_current->warps[threadIdx.x >> 5];
    const int lane = threadIdx.x & 31;
    w->values[lane] = v;
    w->sites[lane] = site;
    w->offsets[lane] = offset;
    w->bar.arrive_and_wait();
    const float r = w->values[lane ^ offset];
    for (int other = 0; other < 32; ++other) {
        if (w->sites[other] != site) tkv_emu_fail("shuffle at another site", w->sites[other], site);
        if (w->offsets[other] != offset) tkv_emu_fail("shuffle with another offset", w->offsets[other], offset);
    }
    w->bar.arrive_and_wait();
    return r;
}
#define __syncthreads() tkv_emu_syncthreads(__LINE__)
#define __syncthreads_or(p) tkv_emu_syncthreads_or((p), __LINE__)
#define __shfl_xor_sync(mask, v, offset) tkv_emu_shfl_xor((mask), (v), (offset), __LINE__)
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static

static inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
static inline float __uint_as_float(unsigned i) { float f; memcpy(&f, &i, 4); return f; }
static inline unsigned __float_as_uint(float f) { unsigned i; memcpy(&i, &f, 4); return i; }
static inline int __ffs(int x) { return __builtin_ffs(x); }
static inline float __fmul_rn(float a, float b) { return a * b; }  // no contraction on the host build (no -mfma)
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float tkv_emu_half_to_float(unsigned short h) { _Float16 x; memcpy(&x, &h, 2); return (float)x; }
static inline unsigned short tkv_emu_float_to_half(float f) {
    _Float16 x = (_Float16)f;
    unsigned short h;
    memcpy(&h, &x, 2);
    return h;
}
static inline uint4 tkv_emu_load16(const void* p) {
    const long long misaligned = (long long)((uintptr_t)p % 16);
    if (misaligned) tkv_emu_fail("16-byte load at a misaligned address (mod 16)", misaligned, 0);
    uint4 r;
    memcpy(&r, p, 16);
    return r;
}

// Runs the blocks one after another, each as `threads` std::threads.
template <typename... P, typename... A>
static void tkv_emu_launch(void (*kernel)(P...), unsigned gx, unsigned gy, unsigned gz, unsigned threads, A... args) {
    gridDim = {gx, gy, gz};
    blockDim = {threads, 1, 1};
    for (unsigned z = 0; z < gz; ++z)
        for (unsigned y = 0; y < gy; ++y)
            for (unsigned x = 0; x < gx; ++x) {
                tkv_emu_block* block = new tkv_emu_block();
                block->threads = (int)threads;
                block->bar.expected = (int)threads;
                block->bar.block = block;
                block->bar.broken = &block->broken;
                for (unsigned w = 0; w < 32; ++w) {
                    const int lanes = (int)threads - (int)w * 32;
                    block->warps[w].bar.expected = lanes < 0 ? 0 : (lanes < 32 ? lanes : 32);
                    block->warps[w].bar.block = block;
                    block->warps[w].bar.broken = &block->broken;
                }
                std::vector<std::thread> pool;
                pool.reserve(threads);
                for (unsigned t = 0; t < threads; ++t) {
                    pool.emplace_back([=]() {
                        threadIdx = {t, 0, 0};
                        blockIdx = {x, y, z};
                        tkv_emu_current = block;
                        try {
                            kernel(args...);
                        } catch (const tkv_emu_stop&) {
                        }
                        block->sites[t] = -1;  // an exited thread no longer holds back a barrier
                        block->warps[t >> 5].bar.arrive_and_drop();
                        block->bar.arrive_and_drop();
                    });
                }
                for (auto& th : pool) th.join();
                const bool broken = block->broken.load();
                delete block;
                if (broken) return;  // reported; the rest of the grid is not run
            }
}

extern "C" int tkv_emu_take_errors(char* text, int size) {
    std::lock_guard<std::mutex> hold(tkv_emu_error_lock);
    const int count = tkv_emu_error_count;
    snprintf(text, (size_t)size, "%s", tkv_emu_error_text);
    tkv_emu_error_count = 0;
    tkv_emu_error_text[0] = 0;
    return count;
}
"""

# the PTX of common.cuh, and its host replacement
_PTX_SWAPS = (
    (r'asm\("cvt\.f32\.f16 %0, %1;" : "=f"\(f\) : "h"\(x\.bits\)\);', "f = tkv_emu_half_to_float(x.bits);"),
    (r'asm\("cvt\.rn\.f16\.f32 %0, %1;" : "=h"\(h\.bits\) : "f"\(f\)\);', "h.bits = tkv_emu_float_to_half(f);"),
    (r'asm\("\{[^"]*?cvta\.to\.global[^"]*?ld\.global\.v4\.u32[^"]*?"[^;]*?\);', "r = tkv_emu_load16(p);"),
)

_lock = threading.Lock()
_libraries: dict[str, ctypes.CDLL] = {}


def unavailable_reason() -> str | None:
    """None when the host build can run here, else why not."""
    if shutil.which(COMPILER) is None:
        return f"{COMPILER} is not on PATH"
    return None


def _declarations() -> dict[str, tuple[str, str | None]]:
    """kernel name -> (params macro, element type or None), from the header's declarations."""
    header = (native_dir() / HEADER_NAME).read_text(encoding="utf-8")
    found = {}
    for name, macro, type_name in re.findall(r'extern "C" __global__ void (\w+)\((\w+)(?:\((\w+)\))?\);', header):
        found[name] = (macro, type_name or None)
    return found


def _params(macro: str) -> list[tuple[str, str]]:
    """(C type, name) of each parameter of a TKV_*_PARAMS macro."""
    header = (native_dir() / HEADER_NAME).read_text(encoding="utf-8")
    body = re.search(rf"#define {macro}(?:\(T\))?\s*\\\n(.*?)\n\n", header, re.S).group(1)
    params = []
    for param in body.replace("\\\n", " ").replace("\\", " ").split(","):
        declared, name = param.strip().rsplit(" ", 1)
        name = name.lstrip("*")
        params.append((declared.replace("const ", "").strip(), name))
    return params


def host_source(file_name: str) -> str:
    """The C++ text g++ builds for `file_name`: prelude, the inlined kernel source, one wrapper per kernel."""
    text = read_source(file_name)
    for pattern, replacement in _PTX_SWAPS:
        text = re.sub(pattern, replacement, text, flags=re.S)
    if re.search(r"\basm\s*\(", text):
        raise RuntimeError(f"emulation: {file_name} has inline PTX the host build does not replace")
    declarations = _declarations()
    wrappers = []
    for name in KERNEL_FILES[file_name]:
        macro, type_name = declarations[name]
        names = ", ".join(n for _, n in _params(macro))
        params = f"{macro}({type_name})" if type_name else macro
        wrappers.append(f'extern "C" void tkv_emu_{name}(unsigned gx, unsigned gy, unsigned gz, unsigned threads, '
                        f"{params}) {{ tkv_emu_launch({name}, gx, gy, gz, threads, {names}); }}")
    return PRELUDE + "\n" + text + "\n" + "\n".join(wrappers) + "\n"


def library(file_name: str) -> ctypes.CDLL:
    """The host build of `file_name` (built once per text, kept under the temp dir)."""
    source = host_source(file_name)
    key = hashlib.sha256((source + " ".join(COMPILE_FLAGS)).encode()).hexdigest()[:16]
    with _lock:
        if key in _libraries:
            return _libraries[key]
        folder = Path(tempfile.gettempdir()) / "tiered_kv_emulation"
        folder.mkdir(parents=True, exist_ok=True)
        shared = folder / f"{Path(file_name).stem}_{key}.so"
        if not shared.exists():
            cpp = folder / f"{Path(file_name).stem}_{key}.cpp"
            cpp.write_text(source, encoding="utf-8")
            partial = shared.with_suffix(f".{threading.get_ident()}.tmp")
            result = subprocess.run([COMPILER, *COMPILE_FLAGS, "-o", str(partial), str(cpp)], capture_output=True,
                                    text=True, timeout=600)
            if result.returncode:
                raise RuntimeError(f"emulation: {COMPILER} failed on {file_name}:\n{result.stderr[-4000:]}")
            partial.replace(shared)
        _libraries[key] = ctypes.CDLL(str(shared))
        return _libraries[key]


def launch(file_name: str, kernel_name: str, grid: tuple, block: tuple, args: tuple, device=None) -> None:
    """cuda._launch's signature: runs the kernel on the host; pointers in `args` are host addresses."""
    lib = library(file_name)
    macro, _ = _declarations()[kernel_name]
    types = [ctypes.c_void_p if declared.endswith("*") else _C_TYPES[declared] for declared, _ in _params(macro)]
    if len(types) != len(args):
        raise TypeError(f"emulation: {kernel_name} takes {len(types)} arguments, got {len(args)}")
    function = getattr(lib, f"tkv_emu_{kernel_name}")
    function.argtypes = [ctypes.c_uint] * 4 + types
    function.restype = None
    values = [float(a) if t is ctypes.c_float else int(a) for t, a in zip(types, args)]
    if len(block) > 1 and any(int(b) != 1 for b in block[1:]):
        raise ValueError("emulation: one-dimensional blocks only")
    with _lock:  # gridDim/blockDim are process-wide in the host build
        function(*(int(g) for g in grid), int(block[0]), *values)
        text = ctypes.create_string_buffer(4096)
        errors = lib.tkv_emu_take_errors(text, len(text))
    if errors:
        raise RuntimeError(f"emulation: {kernel_name}: {errors} violations: {text.value.decode()}")


def route(setattr_) -> None:
    """Points tiered_kv.kernels.cuda's launches at the host build, for CPU tensors.

    `setattr_` is pytest's `monkeypatch.setattr` (or `setattr` for good). The wrappers then run their
    checks without demanding CUDA, take every call as a launch, and pass host addresses.
    """
    from tiered_kv.kernels import cuda

    setattr_(cuda, "_REQUIRE_CUDA", False)
    setattr_(cuda, "_takes_cuda_path", lambda *tensors: True)
    setattr_(cuda, "_ptr", lambda t: np.uint64(0 if t is None else t.data_ptr()))
    setattr_(cuda, "_launch", launch)
