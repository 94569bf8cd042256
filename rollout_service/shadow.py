"""Double-buffered weight swap: load pushed weights into a shadow of the served model, then copy them in.

vLLM's in-place reload (`reload_weights`) runs the whole loading pipeline on the served model: every layer is
put back on the meta device, the checkpoint tensors are loaded (fusing q/k/v, gate/up, ...), each layer is
processed again (on CPU: weights re-packed into oneDNN/SGL handles) and the processed values are copied
into the kernel tensors. Generation must stop for all of it (22-27 ms on the tiny model, far longer on a real
one), which is the stall `bench/bench_swap.py` measured in swap mode "inplace".

`ShadowModel` runs that same pipeline on a *shadow* of the model while the engine keeps generating:
- the shadow is a copy of the module tree (`copy.copy` of each module with its own `_parameters`,
  `_buffers` and `_modules`), every parameter and buffer a clone (ties kept: a tensor shared by two modules
  is cloned once), and each layer's reload metadata (vLLM's `LAYERWISE_INFO`, recorded at start-up) copied
  with its weight-loader methods bound to the shadow layer. The KV cache and everything else that is not a
  parameter or buffer stay shared, and are never written by a reload;
- `stage(weights)` calls vLLM's `reload_weights` on the shadow (any thread; the served model is not
  touched) and records which non-tensor attributes the processing re-bound (on CPU: `cpu_linear`, the
  closure that holds the packed weight);
- `apply()`, called between two engine steps, copies every parameter and buffer of the shadow into the served
  tensors (`copy_`, so CUDA-graph references stay valid, as vLLM's own reload does) and re-binds the
  recorded attributes on the served layers. It touches tensors and attributes only: on the tiny model on
  CPU well under a millisecond.
`stage` runs in slices between engine steps (worker_ext, slices.py) and calls its `checkpoint` where the
staging may park: between two tensors, between two layers set up, and before each of vLLM's layerwise steps (a
layer's processing, its copy into the kernel tensors, an attention layer's finalization), which this module
wraps with a checkpoint named `(step, id(layer))` taken from a ContextVar: only the staging's own greenlet or
thread calls it, the engine's own loading never does. A layer's processing on CPU (oneDNN re-packing) is the
longest stretch of work between two checkpoints (0.1-3 ms per layer on the tiny model).
The price is a second copy of the weights (and of the packed handles) in the worker, kept between pushes.
Anything unexpected (a tensor whose shape or dtype differs between shadow and served model) raises before
the first copy, so a failed `apply` leaves the served weights as they were.
"""

from __future__ import annotations

import contextvars
import copy
import time
from collections.abc import Callable, Iterable
from types import MethodType
from typing import Any

import torch
from vllm.model_executor.model_loader.reload.inplace import reload_weights
from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO, get_layerwise_info
from vllm.model_executor.model_loader.reload.sanitize import layer_ref_sentinel

# the checkpoint of the staging running in this context (a greenlet or a thread: each has its own), called by the
# wrappers below inside vLLM's pipeline; None elsewhere (the engine's own loading, other threads)
_CHECKPOINT: contextvars.ContextVar[Callable[..., None] | None] = contextvars.ContextVar("forkrl_stage_checkpoint",
                                                                                       default=None)
# vLLM's layerwise steps that take a layer's share of a reload (on CPU 0.1-3 ms each on the tiny model): a
# checkpoint before each, named after the step and the layer, so the staging can park before it (slices.py)
LAYER_STEPS = ("_layerwise_process", "_copy_and_restore_kernel_tensors", "_finalize_attention_layer")


def _install_layer_checkpoints() -> int:
    """Wrap vLLM's layerwise steps (module globals of `reload.layerwise`, looked up at each call) with a
    checkpoint before each; returns how many are wrapped (0 where that vLLM internal is not there: the
    staging then checkpoints between tensors only). Idempotent; outside a staging the wrappers only call."""
    try:
        from vllm.model_executor.model_loader.reload import layerwise
    except ImportError:
        return 0
    wrapped = 0
    for name in LAYER_STEPS:
        step = getattr(layerwise, name, None)
        if step is None:
            continue
        if not getattr(step, "_forkrl_checkpointed", False):
            def before(layer: torch.nn.Module, *args: Any, _step: Callable = step, _name: str = name,
                       **kwargs: Any) -> Any:
                checkpoint = _CHECKPOINT.get()
                if checkpoint is not None:
                    checkpoint((_name, id(layer)))
                return _step(layer, *args, **kwargs)

            before._forkrl_checkpointed = True  # type: ignore[attr-defined]
            setattr(layerwise, name, before)
        wrapped += 1
    return wrapped


# module attributes that are the module's structure, not state a reload re-binds
_STRUCTURE = frozenset({"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "training"})


def _bind_to(tensor: torch.Tensor, old: Any, new: torch.nn.Module) -> torch.Tensor:
    """A copy of a (meta) metadata tensor whose methods bound to `old` (the served layer or vLLM's
    sentinel) are bound to `new` instead."""
    out = tensor.data.to("meta") if tensor.device.type != "meta" else tensor.data.detach()
    out.__class__ = tensor.__class__
    out.__dict__ = tensor.__dict__.copy()
    for key, value in out.__dict__.items():
        if isinstance(value, MethodType) and value.__self__ in (old, layer_ref_sentinel):
            out.__dict__[key] = value.__func__.__get__(new)
    return out


class ShadowModel:
    """A shadow of `live` (the served vLLM model) for staged reloads; see the module docstring."""

    def __init__(self, live: torch.nn.Module, checkpoint: Callable[..., None] = lambda *_: None) -> None:
        self.live = live
        self.pairs: list[tuple[torch.nn.Module, torch.nn.Module]] = []
        clones: dict[int, torch.Tensor] = {}  # id(served tensor) -> its clone: shared tensors stay shared
        shadows: dict[int, torch.nn.Module] = {}

        def clone(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            if id(t) not in clones:
                data = t.detach().clone()
                clones[id(t)] = torch.nn.Parameter(data, requires_grad=False) if isinstance(
                    t, torch.nn.Parameter) else data
            return clones[id(t)]

        def shadow(m: torch.nn.Module) -> torch.nn.Module:
            if id(m) in shadows:
                return shadows[id(m)]
            checkpoint()  # the caller may park this thread here (worker_ext: staging in slices)
            s = copy.copy(m)  # a new __dict__; the dicts below are replaced so nothing structural is shared
            shadows[id(m)] = s
            s._parameters = {k: clone(p) for k, p in m._parameters.items()}
            s._buffers = {k: clone(b) for k, b in m._buffers.items()}
            s._non_persistent_buffers_set = set(m._non_persistent_buffers_set)
            s._modules = {k: (shadow(c) if c is not None else None) for k, c in m._modules.items()}
            self.pairs.append((m, s))
            return s

        with torch.no_grad():
            self.model = shadow(live)
        for m, s in self.pairs:
            if m not in LAYERWISE_INFO:
                continue
            src, dst = LAYERWISE_INFO[m], get_layerwise_info(s)
            params, buffers = src.restore_metadata
            dst.restore_metadata = ({k: _bind_to(v, m, s) for k, v in params.items()},
                                    {k: _bind_to(v, m, s) for k, v in buffers.items()})
            dst.restore_device = src.restore_device
        self.rebound: list[tuple[torch.nn.Module, dict[str, Any]]] = []
        self.layer_checkpoints = _install_layer_checkpoints()  # vLLM steps with a checkpoint before each
        self.ready = False
        self.stage_s = 0.0

    def nbytes(self) -> int:
        seen: set[int] = set()
        total = 0
        for _, s in self.pairs:
            for t in list(s._parameters.values()) + list(s._buffers.values()):
                if t is not None and id(t) not in seen:
                    seen.add(id(t))
                    total += t.numel() * t.element_size()
        return total

    def stage(self, vllm_config: Any, weights: Iterable[tuple[str, torch.Tensor]],
              checkpoint: Callable[..., None] = lambda *_: None) -> int:
        """Load `weights` (checkpoint format) into the shadow; returns the number of tensors read.
        `checkpoint` is called between two tensors, between layers while they are prepared and, named
        `(step, id(layer))`, before each layerwise step of vLLM's pipeline (the caller may park the thread)."""
        t0 = time.perf_counter()
        self.ready = False
        before = [(m, s, dict(s.__dict__)) for m, s in self.pairs]
        count = 0

        def counted() -> Iterable[tuple[str, torch.Tensor]]:
            nonlocal count
            for item in weights:
                count += 1
                yield item
                checkpoint(("read", count))  # between two tensors

        token = _CHECKPOINT.set(checkpoint)  # the layerwise steps' checkpoints (this greenlet or thread only)
        try:
            with torch.no_grad():
                self._initialize_layers(checkpoint)
                reload_weights(vllm_config, self.model, weights_iterator=counted(), weights_path=None,
                               is_checkpoint_format=True)
        finally:
            _CHECKPOINT.reset(token)
        checkpoint(("rebind",))
        self.rebound = []
        for m, s, old in before:
            changed = {k: v for k, v in s.__dict__.items()
                       if k not in _STRUCTURE and not isinstance(v, torch.nn.Module | torch.Tensor)
                       and (k not in old or old[k] is not v)}
            if changed:
                self.rebound.append((m, changed))
        checkpoint(("check",))
        self._check()
        self.ready = True
        self.stage_s = time.perf_counter() - t0
        return count

    def describe(self, label: Any) -> str:
        """A checkpoint's label in words: `(step, id(layer))` names the shadow layer by its module path."""
        if isinstance(label, tuple) and len(label) == 2 and isinstance(label[1], int) and label[0] != "read":
            for name, m in self.model.named_modules():
                if id(m) == label[1]:
                    return f"{label[0]} {name or type(m).__name__}"
        return " ".join(map(str, label)) if isinstance(label, tuple) else str(label)

    def _initialize_layers(self, checkpoint: Callable[..., None]) -> None:
        """vLLM's `initialize_layerwise_reload` layer by layer, with a checkpoint between layers (it skips
        layers that are initialized already, so `reload_weights` then only loads): one long stretch of
        work fewer between two checkpoints. Without those vLLM internals, `reload_weights` does it at once."""
        try:
            from vllm.model_executor.model_loader.reload.layerwise import (
                get_layerwise_info,
                initialize_online_processing,
            )
            from vllm.model_executor.model_loader.reload.meta import restore_layer_on_meta
            from vllm.model_executor.model_loader.reload.utils import get_layer_params_buffers
        except ImportError:
            return
        for layer in self.model.modules():
            checkpoint(("init", id(layer)))
            info = get_layerwise_info(layer)
            if info.can_load():
                continue
            info.kernel_tensors = get_layer_params_buffers(layer)
            info.kernel_non_persistent_buffers = set(layer._non_persistent_buffers_set)
            restore_layer_on_meta(layer, info)
            initialize_online_processing(layer)

    def _check(self) -> None:
        for m, s in self.pairs:
            for kind in ("_parameters", "_buffers"):
                live, shadow = getattr(m, kind), getattr(s, kind)
                if live.keys() != shadow.keys():
                    raise RuntimeError(f"{type(m).__name__}: {kind[1:]} {sorted(live)} vs staged {sorted(shadow)}")
                for k, t in live.items():
                    u = shadow[k]
                    if (t is None) != (u is None) or (t is not None and (t.shape != u.shape or t.dtype != u.dtype)):
                        raise RuntimeError(f"{type(m).__name__}.{k}: served {None if t is None else tuple(t.shape)} "
                                           f"vs staged {None if u is None else tuple(u.shape)}")

    @torch.no_grad()
    def apply(self) -> int:
        """Copy the staged weights into the served model (call between engine steps); returns tensors copied."""
        if not self.ready:
            raise RuntimeError("no staged weights to apply")
        self._check()  # before the first copy: a failure leaves the served weights whole
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        seen: set[int] = set()
        for m, s in self.pairs:
            for kind in ("_parameters", "_buffers"):
                for k, t in getattr(m, kind).items():
                    if t is not None and t.numel() and id(t) not in seen:
                        seen.add(id(t))
                        dst.append(t.data)
                        src.append(getattr(s, kind)[k].data)
        if dst:
            torch._foreach_copy_(dst, src)
        for m, attrs in self.rebound:
            m.__dict__.update(attrs)
        self.ready = False
        return len(dst)
