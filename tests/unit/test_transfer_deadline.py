"""The deadline of the NCCL weight transfer (forkrl/weights/deadline.py) with a fake stalled communicator: NCCL needs
GPUs, and what is under test is the seam around it. `StalledComm` has the two members of vLLM's PyNcclCommunicator
that `abort_communicator` uses (`nccl.ncclCommAbort(comm)`, `available`/`disabled`); its pending operation, like a
real one after `ncclCommAbort`, returns with an error only once the communicator is aborted."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from forkrl.weights.deadline import (
    TransferDeadline,
    abort_communicator,
    bound_receives,
    bound_send,
    call_with_deadline,
)


class StalledComm:
    def __init__(self) -> None:
        self.aborted = threading.Event()
        self.aborts = 0
        self.available, self.disabled, self.comm = True, False, object()
        self.nccl = self  # PyNcclCommunicator.nccl.ncclCommAbort(comm)

    def ncclCommAbort(self, comm: object) -> None:  # noqa: N802 - NCCL's name
        assert comm is self.comm
        self.aborts += 1
        self.aborted.set()

    def wait(self) -> None:
        """A pending broadcast: no peer ever comes; it ends (failing) when the communicator is aborted."""
        if not self.aborted.wait(600):
            raise AssertionError("never aborted")
        raise RuntimeError("NCCL error: operation aborted")


class FakeNcclWorkerEngine:
    """The shape of vLLM's NCCLWeightTransferEngine that bound_receives relies on."""

    def __init__(self) -> None:
        self.model_update_group: Any = StalledComm()
        self.received: list[Any] = []

    def receive_weights(self, update_info: Any) -> None:
        self.received.append(update_info)
        self.model_update_group.wait()


def test_a_stalled_call_is_aborted_at_its_deadline_and_says_so() -> None:
    comm = StalledComm()
    with pytest.raises(TransferDeadline) as e:
        call_with_deadline(comm.wait, 0.2, lambda: abort_communicator(comm), "receiving 3 tensor(s)")
    assert "receiving 3 tensor(s) did not complete within 0.2 s" in str(e.value)
    assert isinstance(e.value.__cause__, RuntimeError) and isinstance(e.value, TimeoutError)
    assert comm.aborts == 1 and comm.disabled and not comm.available
    abort_communicator(comm)  # its later destroy(): nothing aborted twice
    assert comm.aborts == 1


def test_a_call_within_its_deadline_is_not_touched() -> None:
    comm = StalledComm()
    assert call_with_deadline(lambda: 7, 60.0, lambda: abort_communicator(comm), "x") == 7
    assert comm.aborts == 0
    with pytest.raises(KeyError):  # its own error passes unchanged
        call_with_deadline(lambda: {}["k"], 60.0, lambda: abort_communicator(comm), "x")
    with pytest.raises(ValueError, match="deadline_s must be > 0, got 0"):
        call_with_deadline(lambda: 7, 0, lambda: None, "x")


def test_a_workers_stalled_receive_fails_within_the_deadline_and_frees_its_thread() -> None:
    """The worker's receive (what holds vLLM's engine thread) returns with TransferDeadline; vLLM's worker then ends
    the update with that error and the service marks the weights broken (tests/rollout/test_transfer_nccl.py)."""
    engine = FakeNcclWorkerEngine()
    bound_receives(engine, 0.2)
    bound_receives(engine, 0.2)  # a second InitWeightTransfer: still one deadline, not two nested
    with ThreadPoolExecutor(1) as pool:  # the engine's thread
        done = pool.submit(engine.receive_weights, "chunk")
        with pytest.raises(TransferDeadline, match="did not complete within 0.2 s"):
            done.result(timeout=120)
    assert engine.received == ["chunk"] and engine.model_update_group.aborts == 1


class Refused(Exception):
    pass


class FakeNcclTrainerEngine:
    """vLLM's NCCLTrainerWeightTransferEngine.send_weights in outline: the services' update_weights on a side thread,
    the broadcast on this one (blocking until every worker joined), then the side thread's result."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.model_update_group = StalledComm()

    def send_weights(self) -> None:
        exe = ThreadPoolExecutor(1)
        try:
            future = exe.submit(self.client.update_weights, {"names": ["w"], "dtype_names": ["float32"],
                                                             "shapes": [[2]]})
            self.model_update_group.wait()  # the broadcast: the refusing service's workers never join
            future.result()
        finally:
            exe.shutdown(wait=False)  # as vLLM: never wait for the RPC thread after a failed broadcast


class RefusingClient:
    def update_weights(self, update_info: dict) -> None:
        raise Refused("INVALID_ARGUMENT: shapes[0] ('w') must be [3]")


def test_a_refused_chunk_aborts_the_trainers_broadcast_at_once_with_the_services_error() -> None:
    client = RefusingClient()
    engine = FakeNcclTrainerEngine(client)
    bound_send(engine, client, 600.0)  # the deadline is not what ends it
    with pytest.raises(Refused, match="must be \\[3\\]"):
        engine.send_weights()
    assert engine.model_update_group.aborts == 1


def test_a_trainers_stalled_send_is_aborted_at_its_deadline() -> None:
    class SilentClient:  # a service that never answers (its process hangs)
        def __init__(self) -> None:
            self.release = threading.Event()

        def update_weights(self, update_info: dict) -> None:
            self.release.wait(600)

    client = SilentClient()
    engine = FakeNcclTrainerEngine(client)
    bound_send(engine, client, 0.2)
    try:
        with pytest.raises(TransferDeadline, match="sending the weights to the rollout services"):
            engine.send_weights()
    finally:
        client.release.set()
    assert engine.model_update_group.aborts == 1
