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

import math
import os
import time
from collections.abc import Iterator
from typing import Any

import torch

from forkrl.weights.safetensors import _ST_DTYPES, checkpoint_files, iter_safetensors, read_header
from rollout_service.shadow import LAYER_STEPS, ShadowModel  # with the worker: no import in a staging slice
from rollout_service.slices import InlineSlices, SliceGate

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
        for f in files:  # before the model is touched: see check_data_section
            check_data_section(f)
        count = 0

        def counted() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal count
            for item in iter_safetensors(files):
                count += 1
                yield item

        self.reload_weights(weights_iterator=counted())  # type: ignore[attr-defined]
        return {"tensors": count, "seconds": time.perf_counter() - start}

    # ---- staged swap (rollout_service/shadow.py): the new weights are loaded into a shadow of the model by a
    # staging thread, in slices granted between engine steps, then copied in by one call. A slice:
    # `forkrl_stage_status` (one utility call, so it runs between two engine steps) lets the staging thread run
    # for `slice_s` while this thread waits; the staging thread parks itself as soon as the slice is over, at
    # the next return from any function (a profile hook on that thread: `SliceGate`), so its Python never runs
    # beside the engine's and each step is delayed by at most one slice. A native call that releases the GIL
    # (oneDNN weight packing, a tensor copy) may outlast the slice: by default the slice waits for it (on CPU
    # it would compete with the engine for the cores); with `native_beside` (a GPU: copies to the device do
    # not compete) the engine goes on beside it and the staging thread parks when the call returns.
    # With `inline` (the CPU default) there is no staging thread: the staging is a greenlet on this thread
    # (`InlineSlices`), switched in by `forkrl_stage_status` and out at the first checkpoint after its slice (a
    # tensor read, a layer set up, before each of vLLM's layer steps: shadow.py), so no slice waits for a thread
    # to be woken or to park; it ends after the stretch of work it is in (on the tiny model on CPU at most one
    # layer's processing, ~2-3 ms), or before a layer step that took longer than what is left of the slice the
    # last time (`stretches`: each step's longest CPU time, learnt by the start-up trial and every push).
    def forkrl_prepare_shadow(self, path: str = "") -> dict[str, Any]:
        """Build the shadow model now (at start-up), so the first push's slices do not include it; with `path`
        (the served checkpoint), stage it once (nothing is applied), so a model the staging cannot handle
        fails here, before any sample runs, and the service falls back to pause + reload."""
        state = _staging(self)
        if state["shadow"] is None:
            state["shadow"] = ShadowModel(self.model_runner.get_model())  # type: ignore[attr-defined]
        start = time.perf_counter()
        files = checkpoint_files(path) if path else []
        if files:
            for f in files:
                check_data_section(f)
            # in one slice with no end: nothing parks, and each layer step's CPU time is recorded, so the first
            # push's slices already start a long step in a slice of its own (InlineSlices' lookahead)
            gate = InlineSlices(swap_state=(torch.is_grad_enabled, torch.set_grad_enabled), history=state["stretches"])
            errors: list[BaseException] = []
            gate.start(lambda: state["shadow"].stage(self.vllm_config, iter_safetensors(files),  # type: ignore[attr-defined]
                                                     gate.checkpoint),
                       lambda _, error: errors.append(error) if error is not None else None)
            gate.grant(math.inf)
            state["shadow"].ready = False
            if errors:
                raise errors[0]
        return {"bytes": state["shadow"].nbytes(), "trial_s": time.perf_counter() - start if files else 0.0}

    def forkrl_stage_safetensors(self, path: str, slice_s: float, native_beside: bool = False,
                                 inline: bool = False) -> dict[str, Any]:
        """Prepare a staged load of `path`; the work happens in the slices `forkrl_stage_status` grants (on
        this thread with `inline`: `InlineSlices`; else on a staging thread of its own: `SliceGate`)."""
        state = _staging(self)
        if state["thread"] is not None and state["thread"].is_alive():
            raise RuntimeError("a staged reload is already in progress")
        gate: SliceGate | InlineSlices = (InlineSlices(swap_state=(torch.is_grad_enabled, torch.set_grad_enabled),
                                                       history=state["stretches"])
                                          if inline else SliceGate(native_beside=bool(native_beside)))
        state.update(status="running", error="", tensors=0, seconds=0.0, slices=0, slice_s=float(slice_s),
                     gate=gate, last_end=0.0, max_slice_s=0.0, max_slice_cpu_s=0.0,
                     longest_slice={}, overruns=0)
        start = time.perf_counter()

        def work() -> int:
            files = checkpoint_files(path)
            if not files:
                raise FileNotFoundError(f"no *.safetensors under {path}")
            for f in files:
                check_data_section(f)
            if state["shadow"] is None:
                state["shadow"] = ShadowModel(self.model_runner.get_model(),  # type: ignore[attr-defined]
                                              checkpoint=gate.checkpoint)
            return state["shadow"].stage(self.vllm_config, iter_safetensors(files),  # type: ignore[attr-defined]
                                         gate.checkpoint)

        def done(tensors: int | None, error: BaseException | None) -> None:
            # after the gate let go of the thread: published here, the status cannot be seen "ready" while
            # the thread still waits for a slice (the next push would find it alive)
            if error is not None:  # reported by forkrl_stage_status; the served model was not touched
                state.update(status="failed", error=f"{type(error).__name__}: {error}")
            else:
                state.update(status="ready", tensors=tensors, seconds=time.perf_counter() - start)

        state["thread"] = gate.start(work, done, name="forkrl-stage")
        return {"status": "running"}

    def forkrl_stage_status(self) -> dict[str, Any]:
        """Grant the staging one slice (if it is running), then report: running | ready | failed (with the
        error), the tensors read, the staging seconds (wall, slices and the steps between them), the slices, the
        longest time one call held the engine (`max_slice_s`; `max_slice_cpu_s`: the longest CPU time of the
        staging's work in one slice, which leaves out time the hypervisor took the CPU and waits for one) and
        the slices given up on a native call that did not return (`overruns`: it then ran on beside the
        engine)."""
        state = _staging(self)
        # at most one slice per slice_s of wall time: calls that come closer (several between two engine
        # steps) only report, so the engine gets at least half of the time
        if state["status"] == "running" and time.perf_counter() - state["last_end"] >= state["slice_s"]:
            state["slices"] += 1
            inline = isinstance(state["gate"], InlineSlices)
            t0 = time.perf_counter()  # the reads of /proc inside the timed call: its run delay lies within it
            sched = _sched_now() if inline else None
            state["gate"].grant(state["slice_s"])
            after = _sched_now() if sched is not None else None
            state["last_end"] = time.perf_counter()
            wall = state["last_end"] - t0
            if wall > state["max_slice_s"]:  # all the engine waited, and where the time went
                state["max_slice_s"] = wall
                # inline, the work ran on this thread: wall = its CPU time + waits for a core in this VM
                # (queued) + blocking (a lock, the GIL: `blocked` > 0) + what is left, the hypervisor's steal
                state["longest_slice"] = {"wall_s": wall, "cpu_s": state["gate"].last_cpu_s} | (
                    {"queued_s": after[0] - sched[0], "blocked": after[1] - sched[1]} if after is not None else {})
            state["max_slice_cpu_s"] = max(state["max_slice_cpu_s"], state["gate"].last_cpu_s)  # the work in it
            state["overruns"] = state["gate"].overruns
        return {k: state[k] for k in ("status", "error", "tensors", "seconds", "slices", "max_slice_s",
                                      "max_slice_cpu_s", "overruns")}

    def forkrl_apply_staged(self) -> dict[str, Any]:
        """Copy the staged weights into the served model; runs between two engine steps."""
        state = _staging(self)
        if state["status"] != "ready":
            raise RuntimeError(f"no staged weights to apply (staging {state['status']}: {state['error']})")
        start, cpu = time.perf_counter(), time.thread_time()
        copied = state["shadow"].apply()
        copy_s, copy_cpu_s = time.perf_counter() - start, time.thread_time() - cpu
        runner = self.model_runner  # type: ignore[attr-defined]
        for reset in ("reset_encoder_cache", "reset_mm_cache"):  # what vLLM's reload_weights also drops
            if hasattr(runner, reset):
                getattr(runner, reset)()
        state["status"] = "idle"
        return {"tensors": copied, "seconds": time.perf_counter() - start, "copy_seconds": copy_s,
                "copy_cpu_seconds": copy_cpu_s,
                "stage_seconds": state["seconds"],
                "slices": state["slices"], "max_slice_s": state["max_slice_s"],
                "max_slice_cpu_s": state["max_slice_cpu_s"], "longest_slice": state["longest_slice"],
                "overruns": state["overruns"], "lookahead_parks": getattr(state["gate"], "lookahead_parks", 0),
                # inline: the longest stretch of work between two checkpoints (CPU), and where it started
                # and how many checkpoints came before one of vLLM's layerwise steps (shadow.py's wrappers)
                "longest_stretch": ({"cpu_s": state["gate"].longest_stretch_s,
                                     "at": state["shadow"].describe(state["gate"].longest_stretch_label),
                                     "layer_step_checkpoints": sum(state["gate"].checkpoints.get(k, 0)
                                                                   for k in LAYER_STEPS)}
                                    if isinstance(state["gate"], InlineSlices) else {})}


def _sched_now() -> tuple[float, int] | None:
    """This thread's seconds spent runnable but waiting for a CPU (the kernel's schedstat run delay) and its
    voluntary context switches (it blocked: on a lock, the GIL), from /proc (Linux); None where unavailable."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            queued = int(f.read().split()[1]) / 1e9
        with open("/proc/thread-self/status") as f:
            for line in f:
                if line.startswith("voluntary_ctxt_switches:"):
                    return queued, int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def _staging(worker: Any) -> dict[str, Any]:
    if not hasattr(worker, "_forkrl_staging"):
        worker._forkrl_staging = {"thread": None, "shadow": None, "status": "idle", "error": "", "tensors": 0,
                                  "seconds": 0.0, "slices": 0, "max_slice_s": 0.0, "max_slice_cpu_s": 0.0,
                                  "longest_slice": {}, "overruns": 0,
                                  "stretches": {}}  # InlineSlices' history: each layer step's longest CPU time
    return worker._forkrl_staging


def check_data_section(path: str | os.PathLike) -> None:
    """Every tensor's bytes lie inside the file and match its dtype and shape.

    vLLM's in-place reload swaps each layer's parameters for placeholders first and restores them only
    when the whole iterator was consumed: a file that fails half-way (truncated, a bad header) would leave
    the model unable to take any later reload. So a file is checked completely before the reload starts."""
    header, n = read_header(path)
    data = os.path.getsize(path) - 8 - n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        dtype = _ST_DTYPES.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"{path}: tensor {name!r} has unknown dtype {info['dtype']!r}")
        if not 0 <= start <= end <= data:
            raise ValueError(f"{path}: tensor {name!r} spans bytes [{start}, {end}) of a {data}-byte data section "
                             "(a truncated file?)")
        if end - start != math.prod(info["shape"]) * dtype.itemsize:
            raise ValueError(f"{path}: tensor {name!r} has {end - start} bytes for shape {info['shape']}")
