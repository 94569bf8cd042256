"""The token on real servers on 127.0.0.1: without it every RPC and route but health is refused
(UNAUTHENTICATED / 401, naming FORKRL_TOKEN), with it the call goes through; health stays open.

rollout: the real grpc.aio server with the fake engine of tests/rollout/test_server_plumbing.py (only vLLM is
replaced); trainer: the `python -m trainer_service` process; probe: the app under uvicorn."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
import uvicorn
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from safetensors.torch import save_file

from forkrl.remote.channel import grpc_channel, http_headers
from forkrl.security import load_token
from forkrl.wire.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from forkrl.wire.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from probe_service.app import create_app
from probe_service.config import ProbeSettings
from tests.rollout.test_server_plumbing import MODEL, ServerThread
from tests.service_fixtures import start_trainer_service, wait_until

SERVING = health_pb2.HealthCheckResponse.SERVING
TOKEN = load_token()  # the suite's (tests/conftest.py): every service the tests start requires it
assert TOKEN


def _calls(stub: object, service: object) -> dict[str, object]:
    """One call per RPC of `service` (a proto ServiceDescriptor), with an empty request, as a function of
    the timeout: every method, so that a new RPC cannot be left open by accident."""
    calls = {}
    for m in service.methods:
        fn = getattr(stub, m.name)
        req = getattr(rollout_pb2 if "rollout" in service.full_name else trainer_pb2, m.input_type.name)()
        if m.client_streaming:
            calls[m.name] = lambda fn=fn, req=req: fn(iter([req]), timeout=10)
        elif m.server_streaming:
            calls[m.name] = lambda fn=fn, req=req: list(fn(req, timeout=10))
        else:
            calls[m.name] = lambda fn=fn, req=req: fn(req, timeout=10)
    return calls


def _refused(call) -> str:
    with pytest.raises(grpc.RpcError) as e:
        call()
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, (e.value.code(), e.value.details())
    return e.value.details()


def _health_and_reflection_open(address: str) -> None:
    with grpc_channel(address, token="") as ch:
        assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status == SERVING
        reply = next(reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10))
        assert any(s.name.startswith("forkrl.") for s in reply.list_services_response.service)


def _every_rpc_needs_the_token(address: str, stub_cls: type, service: object) -> None:
    for token in ("", "not-" + TOKEN):
        with grpc_channel(address, token=token) as ch:
            for name, call in _calls(stub_cls(ch), service).items():
                details = _refused(call)
                assert "FORKRL_TOKEN" in details, (name, details)
                assert ("wrong token" in details) == bool(token), (name, details)


@pytest.fixture(scope="module")
def rollout(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    d = tmp_path_factory.mktemp("model")
    save_file(MODEL, str(d / "model.safetensors"))
    server = ServerThread(d, d / "staging")
    yield server
    server.stop()


def test_rollout_refuses_every_rpc_without_the_token(rollout: ServerThread) -> None:
    service = rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"]
    assert {m.name for m in service.methods} == {"Generate", "UpdateWeights", "LoadWeights", "GetInfo", "ReleaseLease",
                                                 "InitWeightTransfer", "StartWeightUpdate", "UpdateWeightChunk",
                                                 "FinishWeightUpdate", "AbortWeightUpdate", "ShutdownWeightTransfer"}
    _every_rpc_needs_the_token(rollout.address, rollout_pb2_grpc.RolloutServiceStub, service)
    _health_and_reflection_open(rollout.address)
    with grpc_channel(rollout.address) as ch:  # the token of the environment
        stub = rollout_pb2_grpc.RolloutServiceStub(ch)
        assert stub.GetInfo(rollout_pb2.GetInfoRequest(), timeout=10).version == 0
        # past the token, the request's own checks answer
        with pytest.raises(grpc.RpcError) as e:
            stub.LoadWeights(rollout_pb2.LoadWeightsRequest(path="", target_version=1), timeout=10)
        assert e.value.code() != grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.slow
def test_trainer_refuses_every_rpc_without_the_token(tmp_path: Path) -> None:
    service = trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"]
    with start_trainer_service(tmp_path / "runs", log_path=tmp_path / "trainer.log") as address:
        _every_rpc_needs_the_token(address, trainer_pb2_grpc.TrainerServiceStub, service)
        _health_and_reflection_open(address)
        with grpc_channel(address) as ch:
            with pytest.raises(grpc.RpcError) as e:
                trainer_pb2_grpc.TrainerServiceStub(ch).GetRun(trainer_pb2.GetRunRequest(), timeout=10)
            assert e.value.code() == grpc.StatusCode.NOT_FOUND and "no run has been started" in e.value.details()


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, object]]:
    tmp = tmp_path_factory.mktemp("probe")
    app = create_app(ProbeSettings(allowed_roots=[str(tmp)], jobs_dir=str(tmp / "jobs"), device="cpu",
                                   log_level="warning"))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started or not thread.is_alive(), 30, "the probe server to start")
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", app
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def test_probe_refuses_every_route_but_health_without_the_token(probe) -> None:
    base, app = probe
    open_paths = {"/healthz", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}
    routes = [(m, r.path) for r in app.routes for m in getattr(r, "methods", ()) if m != "HEAD"]
    guarded = [(m, p.replace("{job_id}", "nope")) for m, p in routes if p not in open_paths]
    assert {p for _, p in guarded} >= {"/probe", "/probe/nope", "/probe/nope/records", "/metrics"}
    with httpx.Client(base_url=base, timeout=30) as client:
        for headers, why in [({}, "no token"), ({"authorization": "Bearer x" + TOKEN}, "wrong token"),
                             ({"authorization": TOKEN}, "must be 'Bearer")]:
            for method, path in guarded:
                r = client.request(method, path, headers=headers, json={})
                assert r.status_code == 401, (method, path, r.status_code, r.text)
                assert why in r.json()["detail"] and "FORKRL_TOKEN" in r.json()["detail"]
                assert r.headers["www-authenticate"] == "Bearer"
        assert client.get("/healthz").status_code == 200
        # a cross-site form post carries no token: refused before the body is read
        assert client.post("/probe", content=b"a=1", headers={"content-type": "text/plain"}).status_code == 401
        ok = client.get("/probe", headers=http_headers())
        assert ok.status_code == 200 and ok.json() == {"jobs": []}
        assert client.get("/probe/nope", headers=http_headers()).status_code == 404
        assert client.get("/metrics", headers=http_headers()).status_code == 200
