"""The staged swap's checkpoints inside vLLM's reload pipeline (rollout_service/shadow.py).

vLLM processes a layer (on CPU: re-packs its weights, 0.1-3 ms on the tiny model) when its last tensor is
loaded, inside one call of the staging's weight iterator; shadow.py wraps vLLM's layerwise steps with a
checkpoint before each, so a slice can end before a layer's processing instead of after it. The checkpoint is
the one of the staging running in the current context (a ContextVar: the staging greenlet or thread); the
engine's own calls of the same functions, in any other context, call none. A real staging through these
wrappers is checked in test_swap_inplace.py (the log counts the checkpoints before a layer step).
"""

from __future__ import annotations

import contextvars
import threading
from types import SimpleNamespace

import torch
from vllm.model_executor.model_loader.reload import layerwise
from vllm.model_executor.model_loader.reload.types import LayerReloadingInfo

from rollout_service import shadow


class _Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.processed: list[torch.dtype] = []

    def process_weights_after_loading(self, dtype: torch.dtype) -> None:
        self.processed.append(dtype)


def test_layer_steps_are_wrapped_once_and_checkpoint_only_in_the_staging_context():
    n = shadow._install_layer_checkpoints()
    assert n == len(shadow.LAYER_STEPS)  # this vLLM (the pinned one) has every step shadow.py wraps
    wrapped = {name: getattr(layerwise, name) for name in shadow.LAYER_STEPS}
    assert all(getattr(f, "_forkrl_checkpointed", False) for f in wrapped.values())
    assert shadow._install_layer_checkpoints() == n  # idempotent: not wrapped twice
    assert {name: getattr(layerwise, name) for name in shadow.LAYER_STEPS} == wrapped

    layer = _Attention()
    info = LayerReloadingInfo(restore_metadata=({}, {}), restore_device=torch.device("cpu"))
    config = SimpleNamespace(dtype=torch.bfloat16)
    calls: list = []

    def staging() -> None:  # what ShadowModel.stage does around vLLM's reload
        token = shadow._CHECKPOINT.set(lambda label: calls.append((label, list(layer.processed))))
        try:
            layerwise._finalize_attention_layer(layer, info, config)
        finally:
            shadow._CHECKPOINT.reset(token)

    contextvars.copy_context().run(staging)
    # the checkpoint came first, named after the step and the layer; then vLLM's step ran as before
    assert calls == [(("_finalize_attention_layer", id(layer)), [])]
    assert layer.processed == [torch.bfloat16]

    # the engine's thread (another context, no staging): the wrapper only calls the step
    t = threading.Thread(target=layerwise._finalize_attention_layer, args=(layer, info, config))
    t.start()
    t.join(30)
    layerwise._finalize_attention_layer(layer, info, config)  # this context: the staging's token was reset
    assert len(calls) == 1 and layer.processed == [torch.bfloat16] * 3


def test_describe_names_a_layer_step_by_its_module_path():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.Linear(2, 2)))
    fake = SimpleNamespace(model=model)
    inner = model[1][0]
    assert shadow.ShadowModel.describe(fake, ("_layerwise_process", id(inner))) == "_layerwise_process 1.0"
    assert shadow.ShadowModel.describe(fake, ("read", 3)) == "read 3"
    assert shadow.ShadowModel.describe(fake, None) == "None"
