"""The trainer's checks before an NCCL push (forkrl/training/transfer_route.py) that CPU can run."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import forkrl.training.transfer_route as route


def test_a_service_on_the_trainers_gpu_is_named() -> None:
    why = route.shared_gpu("abc-1", ["127.0.0.1:50051", "127.0.0.1:50061"], [["GPU-abc-0"], ["GPU-ABC-1"]])
    assert why is not None and "127.0.0.1:50061 runs on this trainer's GPU (abc-1)" in why
    assert route.shared_gpu("abc-2", ["a:1"], [["GPU-abc-1"]]) is None
    assert route.shared_gpu(None, ["a:1"], [["GPU-abc-1"]]) is None  # no CUDA here: nothing to share
    assert route.shared_gpu("abc-1", ["a:1"], [[]]) is None  # a service on CPU (or one that cannot tell)


def test_the_send_waits_for_the_optimizers_kernels_on_cuda_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's packed producer reads the parameters on its own streams: the current stream (opt.step()) is waited
    for first. No CUDA here: the stream is the seam."""
    waited: list[torch.device] = []

    class Stream:
        def __init__(self, device: torch.device) -> None:
            self.device = device

        def synchronize(self) -> None:
            waited.append(self.device)

    monkeypatch.setattr(torch.cuda, "current_stream", Stream)
    on_gpu = SimpleNamespace(parameters=lambda: iter([SimpleNamespace(device=torch.device("cuda", 1))]))
    route.wait_for_updates(on_gpu)  # type: ignore[arg-type]
    assert waited == [torch.device("cuda", 1)]
    route.wait_for_updates(torch.nn.Linear(2, 2))  # CPU: nothing to wait for
    assert waited == [torch.device("cuda", 1)]
