"""Fixtures for tests in a simulated cluster (scripts/cluster_sim.py): each test builds its own cluster (~0.2 s) and
the cluster is gone when the test ends, passed or failed. Skipped, with the reason, where a cluster cannot be built
(not root, no `ip netns`); CI runs as root, so there they run."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator

import pytest

from scripts.cluster_sim import Cluster, unsupported_reason
from tests.service_fixtures import REPO_ROOT, kill_group

PEER = str(REPO_ROOT / "tests/cluster/net_peer.py")


def require_cluster() -> None:
    reason = unsupported_reason()
    if reason:
        pytest.skip(reason)


@pytest.fixture
def cluster3() -> Iterator[Cluster]:
    require_cluster()
    with Cluster(3) as c:
        yield c


@pytest.fixture
def listener(cluster3: Cluster) -> Iterator[Callable[[str, str], tuple[int, subprocess.Popen]]]:
    """listener(host, address) -> (port, process): net_peer.py listening on `address` inside `host`."""
    procs: list[subprocess.Popen] = []

    def start(host: str, address: str) -> tuple[int, subprocess.Popen]:
        proc = cluster3.popen(host, [sys.executable, PEER, "listen", address], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
        procs.append(proc)
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert line, f"the listener on {host} exited with {proc.wait()} before it listened"
        return json.loads(line)["port"], proc

    yield start
    for proc in procs:
        kill_group(proc, 5)


def send(cluster: Cluster, host: str, address: str, port: int, n_bytes: int = 5,
         timeout_s: float = 5.0) -> dict:
    """net_peer.py send from `host` to address:port: the listener's reply, or {"error": ...}."""
    out = cluster.run(host, [sys.executable, PEER, "send", address, str(port), str(n_bytes), "--timeout",
                             str(timeout_s)], capture_output=True, text=True, timeout=timeout_s + 120)
    assert out.stdout.strip(), f"net_peer send printed nothing (rc {out.returncode}): {out.stderr}"
    return json.loads(out.stdout.strip().splitlines()[-1])
