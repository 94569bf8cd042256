"""RolloutClient's `should_stop`: a call to a real gRPC server that accepts and never answers (health and Generate)
ends with CallStopped soon after the stop, not at its deadline (issue 42 item 8: a cancelled probe job kept its
worker for the hour of the call's deadline)."""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health_pb2_grpc

from forkrl.remote.rollout import CallStopped, RolloutClient
from forkrl.wire.rollout.v1 import rollout_pb2_grpc


class _Silent(rollout_pb2_grpc.RolloutServiceServicer, health_pb2_grpc.HealthServicer):
    def __init__(self) -> None:
        self.called, self.release = threading.Semaphore(0), threading.Event()

    def _hang(self, context) -> None:
        self.called.release()
        while context.is_active() and not self.release.wait(0.05):
            pass

    def Check(self, request, context):  # noqa: N802
        self._hang(context)
        context.abort(grpc.StatusCode.UNAVAILABLE, "released")

    def Generate(self, request, context):  # noqa: N802
        self._hang(context)
        return iter(())


@pytest.fixture
def silent():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    servicer = _Silent()
    rollout_pb2_grpc.add_RolloutServiceServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", servicer
    servicer.release.set()
    server.stop(0)


def _stopped_after_the_first_call(servicer: _Silent, fn) -> BaseException:
    stop = threading.Event()
    out: list[BaseException] = []

    def run() -> None:
        try:
            fn(stop.is_set)
        except BaseException as e:  # noqa: BLE001 (the test looks at it)
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert servicer.called.acquire(timeout=60), "the call never reached the server"
    stop.set()
    t.join(30)  # the call's own deadline is an hour: only the stop can end it in time
    assert not t.is_alive(), "the stopped call is still blocked"
    assert not servicer.release.is_set()
    return out[0]


def test_generate_stops_while_the_service_is_silent(silent):
    address, servicer = silent
    with RolloutClient(address, timeout_s=3600, token="") as client:
        err = _stopped_after_the_first_call(
            servicer, lambda stop: list(client.generate([[1, 2]], n=1, max_new_tokens=4, should_stop=stop)))
    assert isinstance(err, CallStopped) and "cancelled by its caller" in str(err)


def test_wait_ready_stops_during_a_health_call_that_gets_no_answer(silent):
    address, servicer = silent
    with RolloutClient(address, timeout_s=3600, token="") as client:
        err = _stopped_after_the_first_call(servicer, lambda stop: client.wait_ready(3600, should_stop=stop))
    assert isinstance(err, CallStopped) and address in str(err)
