"""Optional TLS on real servers on 127.0.0.1, with a CA and a server certificate made here (cryptography):
with the CA (FORKRL_TLS_CA / ca_file) the handshake works and the call goes through; without it (plaintext,
or another CA) the client cannot talk to the service.

rollout: the real grpc.aio server with the fake engine (certificate from FORKRL_TLS_CERT / FORKRL_TLS_KEY);
trainer: the `python -m trainer_service` process with --tls-cert-file / --tls-key-file; probe: the app under
uvicorn with ssl_certfile / ssl_keyfile, as `python -m probe_service` runs it."""

from __future__ import annotations

import socket
import ssl
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import httpx
import pytest
import uvicorn
from grpc_health.v1 import health_pb2, health_pb2_grpc
from safetensors.torch import save_file

from forkrl.remote.channel import grpc_channel, http_headers, http_verify
from forkrl.remote.rollout import RolloutClient
from probe_service.app import create_app
from probe_service.config import ProbeSettings
from tests.rollout.test_server_plumbing import MODEL, ServerThread
from tests.service_fixtures import REPO_ROOT, start_trainer_service, wait_until

pytest.importorskip("cryptography.x509")
from tests.pki import make_pki  # noqa: E402

SERVING = health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """ca.pem signs cert.pem (localhost, 127.0.0.1); other_ca.pem is a CA that signed nothing here."""
    return make_pki(tmp_path_factory.mktemp("pki"))


HANG_S = 120  # a deadline only a hang reaches: a TLS handshake on a loaded machine may take seconds


def _health(address: str, **kw) -> int:
    """One health Check (fail-fast: a refused or failed handshake answers UNAVAILABLE at once; only a hang waits
    for the deadline, which a slow handshake never reaches)."""
    with grpc_channel(address, token="", **kw) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=HANG_S).status


def _grpc_fails_without_the_ca(address: str, pki: dict[str, str]) -> None:
    for kw in ({}, {"ca_file": pki["other_ca"]}):  # plaintext; TLS with a CA that did not sign the server's
        with pytest.raises(grpc.RpcError) as e:
            _health(address, **kw)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE, kw


def test_rollout_over_tls(pki: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    save_file(MODEL, str(tmp_path / "model.safetensors"))
    monkeypatch.setenv("FORKRL_TLS_CERT", pki["cert"])  # RolloutSettings reads them, as the service does
    monkeypatch.setenv("FORKRL_TLS_KEY", pki["key"])
    server = ServerThread(tmp_path, tmp_path / "staging")
    try:
        assert server.settings.tls_cert_file == pki["cert"]
        assert _health(server.address, ca_file=pki["ca"]) == SERVING
        _grpc_fails_without_the_ca(server.address, pki)
        monkeypatch.setenv("FORKRL_TLS_CA", pki["ca"])  # the trainer's rollout client takes it from here
        with RolloutClient(server.address, timeout_s=20) as client:
            trajs = list(client.generate(["1+1="], n=2, temperature=1.0, max_new_tokens=3, seed=0))
            assert len(trajs) == 2 and client.info().version == 0
        # --timeout: its 3 s default suits Docker's polling, not a fresh process's first TLS handshake under load
        ok = subprocess.run([sys.executable, "clients/healthcheck.py", "grpc", server.address, "--timeout",
                             str(HANG_S)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=HANG_S + 60)
        assert ok.returncode == 0, ok.stdout + ok.stderr
    finally:
        server.stop()


@pytest.mark.slow
def test_trainer_over_tls(pki: dict[str, str], tmp_path: Path) -> None:
    with start_trainer_service(tmp_path / "runs", log_path=tmp_path / "trainer.log",
                               extra_env={"FORKRL_TLS_CA": pki["ca"]},  # for the fixture's own health check
                               tls_cert_file=pki["cert"], tls_key_file=pki["key"]) as address:
        assert _health(address, ca_file=pki["ca"]) == SERVING
        _grpc_fails_without_the_ca(address, pki)


def test_probe_over_tls(pki: dict[str, str], tmp_path: Path) -> None:
    app = create_app(ProbeSettings(allowed_roots=[str(tmp_path)], jobs_dir=str(tmp_path / "jobs"), device="cpu"))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", ssl_certfile=pki["cert"],
                                           ssl_keyfile=pki["key"]))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started or not thread.is_alive(), 30, "the probe server to start")
        base = f"https://127.0.0.1:{sock.getsockname()[1]}"
        # deadlines only a hang reaches: a slow handshake must still succeed, and a refused one must fail as a
        # ConnectError (certificate), never as a ConnectTimeout
        r = httpx.get(f"{base}/probe", headers=http_headers(), verify=http_verify(pki["ca"]), timeout=HANG_S)
        assert r.status_code == 200 and r.json() == {"jobs": []}
        with pytest.raises(httpx.ConnectError):  # the system's CAs do not know this certificate
            httpx.get(f"{base}/healthz", timeout=HANG_S)
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{base}/healthz", verify=ssl.create_default_context(cafile=pki["other_ca"]), timeout=HANG_S)
        with pytest.raises(httpx.HTTPError):  # plaintext to a TLS port
            httpx.get(base.replace("https", "http") + "/healthz", timeout=HANG_S)
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def test_tls_settings_need_both_files_and_readable_ones(pki: dict[str, str], tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    from forkrl.cli import parse_settings
    from trainer_service.config import TrainerSettings

    for argv, problem in [(["--tls-cert-file", pki["cert"]], "give both or neither"),
                          (["--tls-cert-file", pki["cert"], "--tls-key-file", str(tmp_path / "none.pem")],
                           "cannot be read")]:
        with pytest.raises(SystemExit) as e:
            parse_settings(TrainerSettings, argv)
        assert e.value.code == 2 and problem in capsys.readouterr().err
    s = parse_settings(TrainerSettings, ["--tls-cert-file", pki["cert"], "--tls-key-file", pki["key"]])
    assert (s.tls_cert_file, s.tls_key_file) == (pki["cert"], pki["key"])
