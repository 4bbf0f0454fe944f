"""Hardware paths (CUDA streams, pinned memory, NVML, kvikio), each with a CPU fallback of the
same signature, chosen once at start."""
