"""The finite check on every weight-transfer receive route, in the worker that loads the weights.

The gloo backend (forkrl/weights/transfer_gloo.py) checks a chunk before it loads any of it. vLLM's own backends
(nccl on a GPU) receive and hand each tensor straight to `model.load_weights`; `guard_receives` wraps an engine's
`receive_weights` so that, during the call, `model.load_weights` sees each tensor only once it is found finite in
the dtype the model serves (forkrl/weights/finite.py), and a tensor that is not ends the chunk with
NonFiniteWeights naming it (the tensors before it in the chunk were loaded: the service reports the weights broken
until a good push, as for any chunk that fails half-way). The rollout service's worker extension applies it to
every engine vLLM's factory creates (rollout_service/worker_ext.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from forkrl.weights.finite import is_finite


class NonFiniteWeights(ValueError):
    """A received tensor holds a NaN or inf (in its dtype or the served one): the chunk is refused."""


def served_dtype(engine: Any) -> torch.dtype | None:
    """The dtype the engine's model serves (vLLM's model_config.dtype), None when unknown."""
    dtype = getattr(getattr(engine, "model_config", None), "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else None


def checked(weights: Iterable[tuple[str, torch.Tensor]], served: torch.dtype | None
            ) -> Iterator[tuple[str, torch.Tensor]]:
    """`weights`, each checked finite (in `served` too) before it is handed on; NonFiniteWeights at the first bad
    one."""
    for name, t in weights:
        if not is_finite(t, served):
            raise NonFiniteWeights(f"tensor {name!r} holds NaN or inf values (in its dtype or the served {served})")
        yield name, t


def guard_receives(engine: Any) -> Any:
    """Wrap `engine.receive_weights` (a vLLM WeightTransferEngine) so the tensors it loads are checked; returns
    the engine. Engines that check on their own (`checks_finite = True`, the gloo one) are left as they are."""
    if getattr(engine, "checks_finite", False) or getattr(engine, "_forkrl_guarded", False):
        return engine
    receive: Callable[..., Any] = engine.receive_weights

    @functools.wraps(receive)
    def receive_weights(*args: Any, **kwargs: Any) -> Any:
        model = engine.model
        load = model.load_weights
        model.load_weights = lambda weights, *a, **k: load(checked(weights, served_dtype(engine)), *a, **k)
        try:
            return receive(*args, **kwargs)
        finally:
            del model.load_weights  # the model's own method again

    engine.receive_weights = receive_weights
    engine._forkrl_guarded = True
    return engine


def guard_factory() -> None:
    """Every weight-transfer engine vLLM's factory creates in this process from now on is guarded."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    create = WeightTransferEngineFactory.create_engine
    if getattr(create, "_forkrl_guarded", False):
        return

    @functools.wraps(create)
    def create_engine(*args: Any, **kwargs: Any) -> Any:
        return guard_receives(create(*args, **kwargs))

    create_engine._forkrl_guarded = True  # type: ignore[attr-defined]
    WeightTransferEngineFactory.create_engine = staticmethod(create_engine)  # type: ignore[method-assign,assignment]
