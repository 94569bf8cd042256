"""vLLM worker extension: in-place weight reload from safetensors files; the end of an abandoned weight transfer.

The engine is started with `worker_extension_cls="rollout_service.worker_ext.WeightReloadExtension"`, so
these methods run inside vLLM's worker process and are called through `engine.collective_rpc(...)`.

Why a path and not tensors: on the CPU backend, tensors passed as `collective_rpc` arguments arrive as
pickled lists (slow, small ones fail), and `model.load_weights` after start-up fails because linear
weights were repacked into oneDNN handles. The worker's `reload_weights(weights_iterator=...)` re-runs
the packing and works (vllm-cpu-notes.md, "In-place weight reload"). The rollout service therefore
stages pushed weights as a safetensors file (in /dev/shm when it exists) and passes its path.

Importing this module also registers the "gloo" weight-transfer backend (forkrl/weights/transfer_gloo.py) with
vLLM's factories: vLLM imports the extension when it builds the worker, before `load_model`, where the worker
creates the weight-transfer engine its `WeightTransferConfig` names; and it wraps that factory so every engine it
creates (vLLM's nccl one too) loads only tensors finite in the served dtype (forkrl/weights/guard.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

import forkrl.weights.transfer_gloo  # noqa: F401  (registers the "gloo" backend: see the module docstring)
from forkrl.runtime import die_with_service
from forkrl.weights.guard import guard_factory
from forkrl.weights.safetensors import check_data_section, checkpoint_files, iter_safetensors

# vLLM imports this module in the process that runs the model (its engine core, or with --engine-mode mp its worker)
# before the model is loaded: from here on that process, and any between it and the service, ends with the service
# even when the service is SIGKILLed (forkrl/runtime.py)
die_with_service()

# every weight-transfer engine of this worker (vLLM's nccl one too) loads only tensors finite in the served dtype
guard_factory()

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
        for f in files:  # before the model is touched (forkrl/weights/safetensors.py: check_data_section)
            check_data_section(f)
        count = 0

        def counted() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal count
            for item in iter_safetensors(files):
                count += 1
                yield item

        self.reload_weights(weights_iterator=counted())  # type: ignore[attr-defined]
        return {"tensors": count, "seconds": time.perf_counter() - start}

    def forkrl_abort_weight_update(self) -> None:
        """End a weight-transfer update that will not finish (a chunk failed, the trainer went away): the engine's
        own abort when it has one (the gloo engine drops the receives it posted ahead, and with them the group),
        then vLLM's finish, which finalizes the layerwise reload (every layer that received nothing gets its kept
        tensors back, so the model can run; layers that were loaded keep the new weights: the service reports the
        weights broken) and closes the worker's session."""
        engine = getattr(self, "weight_transfer_engine", None)
        abort = getattr(engine, "abort_weight_update", None)
        if abort is not None:
            abort()
        try:
            self.finish_weight_update()  # type: ignore[attr-defined]
        except RuntimeError:  # update_weights failed: vLLM's worker closed its session already
            if abort is None:
                from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

                finalize_layerwise_reload(self.model_runner.get_model(), self.model_config)  # type: ignore[attr-defined]

    def forkrl_bound_receives(self, deadline_s: float) -> None:
        """A deadline on every receive of the NCCL weight transfer (forkrl/weights/deadline.py): past it the
        communicator is aborted and the receive fails, freeing the engine (vLLM's NCCL engine has no timeout)."""
        from forkrl.weights.deadline import bound_receives

        bound_receives(self.weight_transfer_engine, deadline_s)  # type: ignore[attr-defined]
