"""Which backend serves the model: `--backend vllm|torch`, or `auto` by a measured rule.

auto picks the torch backend (`torch_backend.py`: forkrl's sampler on the HF model in this process) when the
model runs on the CPU and has at most `TORCH_MAX_PARAMS` parameters, and vLLM otherwise. Below that size a
vLLM engine step costs more than the model's own work in it (scheduler, sampler, output path and unfused
kernels around a few small matrix products), so plain batched decoding in torch generates the same samples
faster; above it vLLM's kernels and paged KV cache win. The bound sits between the sizes where each was measured
faster (docs/results.md, "Which backend generates faster"); on a GPU the rule always picks vLLM.
"""

from __future__ import annotations

import math
from typing import Any

TORCH_MAX_PARAMS = 20_000_000
BACKENDS = ("auto", "vllm", "torch")


def parameter_count(model_dir: str) -> int:
    """Parameters of a checkpoint from its safetensors headers (no tensor data read)."""
    from forkrl.weights.safetensors import read_checkpoint_specs

    return sum(math.prod(shape) for _dtype, shape in read_checkpoint_specs(model_dir).values())


def choose_backend(settings: Any, gpu: bool | None = None) -> tuple[str, str]:
    """(backend, why) for the settings' `backend` and `model`."""
    if settings.backend != "auto":
        return settings.backend, "set by --backend"
    if gpu is None:
        import os

        import torch

        # NVML, not a CUDA context: vLLM forks its engine core later (apply_engine_env sets it for the service)
        os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
        gpu = torch.cuda.is_available()
    if gpu:
        return "vllm", "auto: a GPU is present"
    n = parameter_count(settings.model)
    if n <= TORCH_MAX_PARAMS:
        return "torch", f"auto: {n:,} parameters on the CPU (<= {TORCH_MAX_PARAMS:,})"
    return "vllm", f"auto: {n:,} parameters on the CPU (> {TORCH_MAX_PARAMS:,})"


async def start_backend(settings: Any) -> Any:
    """Start the backend `choose_backend` picks (logged with the reason)."""
    import logging

    name, why = choose_backend(settings)
    logging.getLogger("rollout_service").info("backend %s (%s)", name, why)
    if name == "torch":
        from rollout_service.torch_backend import TorchBackend

        return await TorchBackend.start(settings)
    from rollout_service.vllm_backend import VllmBackend

    return await VllmBackend.start(settings)
