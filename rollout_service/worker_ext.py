"""vLLM worker extension: in-place weight reload from safetensors files.

The engine is started with `worker_extension_cls="rollout_service.worker_ext.WeightReloadExtension"`, so
these methods run inside vLLM's worker process and are called through `engine.collective_rpc(...)`.

Why a path and not tensors: on the CPU backend, tensors passed as `collective_rpc` arguments arrive as
pickled lists (slow, small ones fail), and `model.load_weights` after start-up fails because linear
weights were repacked into oneDNN handles. The worker's `reload_weights(weights_iterator=...)` re-runs
the packing and works (vllm-cpu-notes.md, "In-place weight reload"). The rollout service therefore
stages pushed weights as a safetensors file (in /dev/shm when it exists) and passes its path.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from forkrl.weights.safetensors import checkpoint_files, iter_safetensors

# bf16 engines on CPU die with SIGILL inside the attention kernels unless AMX tiles were requested for
# the process before first use; the worker imports this module at start-up, which is early enough.
if hasattr(torch.cpu, "_init_amx"):
    try:
        torch.cpu._init_amx()
    except Exception:  # not an AMX machine, or the kernel refused: the fp32 path does not need it
        pass


class WeightReloadExtension:
    """Mixed into vLLM's worker class; `self` is the worker (it has `reload_weights`)."""

    def forkrl_reload_safetensors(self, path: str) -> dict[str, float | int]:
        """Reload every tensor in the safetensors file(s) at `path`; returns counts and seconds."""
        start = time.perf_counter()
        files = checkpoint_files(path)
        if not files:
            raise FileNotFoundError(f"no *.safetensors under {path}")
        count = 0

        def counted() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal count
            for item in iter_safetensors(files):
                count += 1
                yield item

        self.reload_weights(weights_iterator=counted())  # type: ignore[attr-defined]
        return {"tensors": count, "seconds": time.perf_counter() - start}
