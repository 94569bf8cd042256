"""Process environment defaults for CPU runs of torch and vLLM.

Call `apply_runtime_env()` *before* importing torch or vLLM (thread counts are read at import).
Every value is a default: a variable already set by the user wins.

Why each one (measured, see docs/vllm-cpu-notes in the design docs):
- VLLM_CPU_KVCACHE_SPACE: unset, vLLM's CPU backend claims most of the RAM and starts 5x slower.
- VLLM_HOST_IP: otherwise the engine's message queue binds the machine's external address.
- VLLM_RPC_BASE_PATH / VLLM_CACHE_ROOT / TORCHINDUCTOR_CACHE_DIR: keep sockets and compile caches in
  the project's cache dir instead of /tmp and ~/.cache.
- OMP_NUM_THREADS: two CPU-bound processes with a thread per core each slow each other 10-20x.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def cache_dir() -> Path:
    return Path(os.environ.get("FORKRL_CACHE_DIR", REPO_ROOT / ".cache"))


def apply_runtime_env(threads: int | None = None) -> None:
    """Set CPU-friendly defaults for torch/vLLM in this process (and the workers it spawns)."""
    cache = cache_dir()
    defaults = {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_HOST_IP": "127.0.0.1",
        "VLLM_RPC_BASE_PATH": str(cache / "vllm-rpc"),
        "VLLM_CACHE_ROOT": str(cache / "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    if threads is not None:
        defaults["OMP_NUM_THREADS"] = str(threads)
        defaults["MKL_NUM_THREADS"] = str(threads)
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    Path(os.environ["VLLM_RPC_BASE_PATH"]).mkdir(parents=True, exist_ok=True)
