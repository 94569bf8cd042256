"""A real rollout service (vLLM, the committed tiny model) on one host of a simulated cluster, used from another:
it listens on its host's address (not 127.0.0.1, not 0.0.0.0), speaks TLS with a certificate for that
address, and a client on another host generates through it with the CA and the token, while plaintext and a call
without the token are refused. What the service's processes listen on is read from `ss` inside its namespace."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.cluster_sim import Cluster
from tests.cluster.conftest import require_cluster
from tests.pki import make_pki
from tests.service_fixtures import REPO_ROOT, ServiceAddress, start_rollout_service

pytestmark = pytest.mark.slow
_SS_LINE = re.compile(r"^LISTEN\s+\d+\s+\d+\s+(\S+):(\d+)\s+\S+\s+users:\((.*)\)\s*$")


def listening(cluster: Cluster, host: str, pgid: int) -> list[tuple[str, int, str]]:
    """(address, port, process name) of every TCP socket the processes of group `pgid` listen on inside `host`."""
    ss = subprocess.run(["ip", "netns", "exec", host, "ss", "-ltnpH"], capture_output=True, text=True, check=True)
    out = []
    for line in ss.stdout.splitlines():
        m = _SS_LINE.match(line.strip())
        assert m, f"unexpected ss line: {line!r}"
        for name, pid in re.findall(r'\("([^"]+)",pid=(\d+)', m.group(3)):
            try:
                stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(stat[2]) == pgid:
                out.append((m.group(1).strip("[]"), int(m.group(2)), name))
    return sorted(set(out))


def test_rollout_service_on_its_host_address_with_tls(tiny_model_dir: Path, tmp_path: Path) -> None:
    require_cluster()
    with Cluster(3) as cluster:
        server_host, client_host = "fk-host2", "fk-host3"
        address = cluster.address(server_host)
        pki = make_pki(tmp_path / "pki", names=(server_host, address))
        results: dict = {}

        def ready(service: ServiceAddress) -> None:  # from the client's host: this process cannot reach it
            peer = cluster.run(client_host, [sys.executable, str(REPO_ROOT / "tests/cluster/rollout_peer.py"),
                                             service], capture_output=True, text=True, timeout=400,
                               env={**_env(), "FORKRL_TLS_CA": pki["ca"]})
            assert peer.returncode == 0, peer.stdout + peer.stderr[-3000:]
            results.update(json.loads(peer.stdout.strip().splitlines()[-1]))

        with start_rollout_service(tiny_model_dir, log_path=tmp_path / "rollout.log", kv_cache_gib=1, seed=0,
                                   host=address, tls_cert_file=pki["cert"], tls_key_file=pki["key"],
                                   staging_dir=tmp_path / "staging", launcher=cluster.argv(server_host, []),
                                   ready=ready) as service:
            assert service == f"{address}:{service.rsplit(':', 1)[1]}"
            port = int(service.rsplit(":", 1)[1])
            sockets = listening(cluster, server_host, service.process.pid)
        print("listening:", sockets)
    assert results["client_host"] == client_host
    assert results["samples"] == 3 and all(n > 0 for n in results["tokens"]) and results["logprobs_finite"]
    assert results["version"] == 0
    assert results["plaintext"] == "UNAVAILABLE"  # no plaintext path to a TLS-only service
    assert results["tls_without_token"] == "OK"  # health is open (liveness probes): the TLS handshake works
    assert results["info_without_token"] == "UNAUTHENTICATED"
    assert (address, port, "python") in [(a, p, n[:6]) for a, p, n in sockets], sockets
    # Nothing on a wildcard (0.0.0.0, ::, *) or on another host's address. vLLM's engine core also listens on the
    # host's address: the gloo groups of its distributed setup (one listener each; 13 on vLLM 0.32 with one rank),
    # bound to the address the hostname resolves to (docs/multi-node.md).
    for addr, p, name in sockets:
        assert addr == address or addr.startswith("127."), f"{name} listens on {addr}:{p} (not {address})"
        assert p == port or name.startswith("VLLM::"), f"{name} listens on {addr}:{p} besides the service's {port}"


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "FORKRL_TLS_CA"}
