"""The nccl side of rollout_service/transfer.py with the fake engine of test_server_plumbing.py (the real gRPC server
and session rules; only vLLM is replaced, since its NCCL engine needs GPUs): what a refused chunk sends to vLLM's
nccl update-info schema (nothing: no gloo `discard`), and a receive that never completes."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo

import tests.rollout.test_server_plumbing as plumbing
from forkrl.remote.rollout import RolloutClient
from tests.rollout.test_server_plumbing import NOT_SERVING, SERVING, FakeBackend, ServerThread, _code_and_message
from tests.service_fixtures import wait_until

model_dir = plumbing.model_dir  # the fake model (fixture)


class NcclBackend(FakeBackend):
    """The fake engine offering vLLM's nccl weight transfer; `stall` holds every receive (a trainer that died
    mid-broadcast, with the workers' own deadline not freeing the engine)."""

    stall = False

    def __init__(self, model: str) -> None:
        super().__init__(model)
        self.engine_settings["weight_transfer_backend"] = "nccl"

    async def update_weights(self, update_info: dict) -> None:
        self.transfer_calls.append(("update", update_info))
        if self.stall:
            await asyncio.Event().wait()


@pytest.fixture
def nccl_server(model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ServerThread]:
    monkeypatch.setattr(plumbing, "FakeBackend", NcclBackend)
    s = ServerThread(model_dir, tmp_path / "staging", transfer_timeout_s=0.5)
    try:
        yield s
    finally:
        s.stop()


def _updates(backend: Any) -> list[dict]:
    return [info for call, info in backend.transfer_calls if call == "update"]


def test_a_refused_chunk_sends_nothing_the_nccl_schema_refuses_and_ends_the_session(nccl_server: ServerThread):
    backend = nccl_server.backend
    assert backend is not None
    with RolloutClient(nccl_server.address, timeout_s=120) as c:
        c.init_weight_transfer("run-a", "nccl", "127.0.0.1", 29500, 2, 1)
        assert backend.transfer_calls[-1][1]["timeout_s"] == 0.5  # the workers' receive deadline (vllm_backend.py)
        c.start_weight_update("run-a", 1)
        code, msg = _code_and_message(lambda: c.update_weight_chunk("run-a", 1, ["embed.weight"], ["float32"],
                                                                    [[50, 9]]))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "must be [50, 8]" in msg
        # nothing received: nccl's receive would load into the model, and gloo's drain field is not in its schema
        assert _updates(backend) == []
        assert backend.transfer_calls[-2:] == [("abort", None), ("shutdown", None)]  # this side's group is aborted
        assert c.health() == SERVING and c.info().version == 0  # nothing reached the engine: the old weights serve
        with pytest.raises(TypeError, match="discard"):  # what the old drain sent: vLLM's worker refused it
            NCCLWeightTransferUpdateInfo(names=["embed.weight"], dtype_names=["float32"], shapes=[[50, 9]],
                                         discard=True)
        # a good push after it: every chunk the engine gets is one vLLM's nccl schema takes
        c.init_weight_transfer("run-a", "nccl", "127.0.0.1", 29500, 2, 1)
        c.start_weight_update("run-a", 1)
        c.update_weight_chunk("run-a", 1, ["embed.weight", "norm.weight"], ["float32", "float32"], [[50, 8], [8]],
                              next={"names": ["x"], "dtype_names": ["float32"], "shapes": [[1]]})
        assert c.finish_weight_update("run-a", 1).version == 1
    sent = _updates(backend)
    assert len(sent) == 1
    info = NCCLWeightTransferUpdateInfo(**sent[0])  # vLLM's own parse (WeightTransferEngine.parse_update_info)
    assert info.names == ["embed.weight", "norm.weight"] and info.shapes == [[50, 8], [8]]


def test_a_receive_that_never_completes_marks_the_service_broken(nccl_server: ServerThread):
    """The workers' deadline aborts a stalled NCCL receive (tests/unit/test_transfer_deadline.py); should the engine
    still not answer by twice that deadline, the service says it is broken instead of holding the push forever."""
    backend = nccl_server.backend
    assert isinstance(backend, NcclBackend)
    backend.stall = True
    with RolloutClient(nccl_server.address, timeout_s=120) as c:
        c.init_weight_transfer("run-a", "nccl", "127.0.0.1", 29500, 2, 1)
        c.start_weight_update("run-a", 1)
        code, msg = _code_and_message(lambda: c.update_weight_chunk("run-a", 1, ["norm.weight"], ["float32"], [[8]]))
        assert code == grpc.StatusCode.FAILED_PRECONDITION
        assert "not received within 1 s (the NCCL receive's deadline is 0.5 s)" in msg and "restart" in msg
        wait_until(lambda: c.health() == NOT_SERVING, 60, "NOT_SERVING")
        assert c.info().counters.rejected_weight_updates == 1
        code, msg = _code_and_message(lambda: c.start_weight_update("run-a", 1))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "InitWeightTransfer first" in msg


def test_a_trainer_on_the_services_gpu_is_told_so_before_any_nccl_call(nccl_server: ServerThread, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch):
    """One GPU: --weight-sync transfer fails with a message naming the shared GPU and the route to use (not NCCL's
    "Duplicate GPU detected"); auto picks another route up front. The trainer's own GPU is the seam (no CUDA here)."""
    import torch

    import forkrl.training.rollouts as rollouts_mod
    from forkrl.training.rollouts import Rollouts

    backend = nccl_server.backend
    assert backend is not None
    backend.engine_settings["gpu_uuids"] = ["GPU-8f6c0a11-aaaa-bbbb-cccc-0123456789ab"]
    monkeypatch.setattr(rollouts_mod, "trainer_backend", lambda: "nccl")
    monkeypatch.setattr(rollouts_mod, "own_gpu_uuid", lambda: "8F6C0A11-AAAA-BBBB-CCCC-0123456789AB")
    r = Rollouts([nccl_server.address], run_id="run-a")
    try:
        r.adopt(0)
        assert list(RolloutClient(nccl_server.address).info().engine.gpu_uuids) == backend.engine_settings["gpu_uuids"]
        assert r.shared_gpu is not None and r.choose_routes("auto") != ["transfer"]
        with pytest.raises(RuntimeError) as e:
            r.push(torch.nn.Linear(2, 2), 1, "transfer", tmp_path)
        assert f"rollout service {nccl_server.address} runs on this trainer's GPU" in str(e.value)
        assert "--weight-sync shm" in str(e.value)
        assert not [call for call, _ in backend.transfer_calls if call == "init"]  # no group was tried
        monkeypatch.setattr(rollouts_mod, "own_gpu_uuid", lambda: "GPU-00000000-another-gpu")
        r.adopt(0)
        assert r.shared_gpu is None and r.choose_routes("auto") == ["transfer"]
    finally:
        r.close()
