"""The simulated cluster itself (scripts/cluster_sim.py): hosts reach each other over their addresses and nothing
else, a shaped link is bounded by its rate, a partition cuts a host off until it is healed, and nothing is left
behind: after the block, after an exception in it, after a killed process (`--cleanup`)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.cluster_sim import NETNS_ETC, STATE_FILE, Cluster, existing_links, existing_namespaces
from tests.cluster.conftest import require_cluster, send
from tests.service_fixtures import REPO_ROOT, wait_until

pytestmark = pytest.mark.slow
SCRIPT = str(REPO_ROOT / "scripts/cluster_sim.py")


def _nothing_left() -> None:
    assert existing_namespaces() == []
    assert existing_links() == []
    assert not list(NETNS_ETC.glob("fk*")) if NETNS_ETC.is_dir() else True
    assert not STATE_FILE.exists()
    ip = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    assert " fk" not in ip, ip


def test_tcp_between_hosts_and_names(cluster3: Cluster, listener) -> None:
    a1, a2 = cluster3.address("fk-host1"), cluster3.address("fk-host2")
    assert (a1, a2) == ("10.210.0.11", "10.210.0.12")
    port, _ = listener("fk-host1", a1)
    reply = send(cluster3, "fk-host2", a1, port, n_bytes=1000)
    assert reply["bytes"] == 1000 and reply["host"] == "fk-host1"  # the listener runs under its host's own name
    by_name = send(cluster3, "fk-host3", "fk-host1", port)  # host names resolve from the per-host /etc/hosts
    assert by_name["bytes"] == 5
    lookup = cluster3.run("fk-host2", [sys.executable, "-c", "import socket; print(socket.gethostbyname("
                                       "socket.gethostname()))"], capture_output=True, text=True, check=True)
    assert lookup.stdout.strip() == a2  # a host's own name is its address, not 127.0.0.1


def test_loopback_is_per_host_and_no_way_out(cluster3: Cluster, listener) -> None:
    port, _ = listener("fk-host1", "127.0.0.1")
    assert send(cluster3, "fk-host1", "127.0.0.1", port)["bytes"] == 5  # on its own host it answers
    assert "ConnectionRefused" in send(cluster3, "fk-host2", "127.0.0.1", port)["error"]  # host2's loopback
    assert "ConnectionRefused" in send(cluster3, "fk-host2", cluster3.address("fk-host1"), port)["error"]
    for host in cluster3.names():
        routes = subprocess.run(["ip", "-n", host, "route"], capture_output=True, text=True, check=True).stdout
        assert routes.split() and "default" not in routes, routes
        assert [r.split()[0] for r in routes.strip().splitlines()] == ["10.210.0.0/24"], routes
        assert subprocess.run(["ip", "-n", host, "-6", "addr"], capture_output=True, text=True).stdout == ""
    bridge = subprocess.run(["ip", "-o", "addr", "show", "dev", "fkbr0"], capture_output=True, text=True).stdout
    assert bridge == "", f"the bridge must have no address (no path to the machine): {bridge}"


def test_shaped_link_is_bounded_by_its_rate(cluster3: Cluster, listener) -> None:
    rate_bit_s = 50e6
    cluster3.shape("fk-host2", "50mbit")  # host2's egress: what it sends to host1
    port, _ = listener("fk-host1", cluster3.address("fk-host1"))
    reply = send(cluster3, "fk-host2", cluster3.address("fk-host1"), port, n_bytes=8 << 20, timeout_s=10)
    assert reply["bytes"] == 8 << 20
    achieved = reply["timed_bytes"] * 8 / reply["seconds"]
    # an upper bound only: a loaded machine may move less, never more than the bucket lets through
    assert achieved <= 1.5 * rate_bit_s, f"{achieved / 1e6:.1f} Mbit/s through a 50 Mbit/s bucket"
    cluster3.shape("fk-host2", "off")
    with pytest.raises(Exception, match="tc rate"):
        cluster3.shape("fk-host2", "fast")


def test_partition_and_heal(cluster3: Cluster, listener) -> None:
    a1 = cluster3.address("fk-host1")
    port, _ = listener("fk-host1", a1)
    assert send(cluster3, "fk-host2", a1, port)["bytes"] == 5
    cluster3.partition("fk-host1")
    assert "error" in send(cluster3, "fk-host2", a1, port, timeout_s=2)  # refused or timed out: never through
    cluster3.heal("fk-host1")
    wait_until(lambda: "bytes" in send(cluster3, "fk-host2", a1, port, timeout_s=2), 60, "host1 back after heal")


def test_nothing_left_after_the_block_also_on_an_exception() -> None:
    require_cluster()
    with Cluster(2) as c:
        assert existing_namespaces() == ["fk-host1", "fk-host2"] and STATE_FILE.exists()
        assert (NETNS_ETC / "fk-host1" / "hosts").read_text().count("fk-host") == 2
    _nothing_left()
    with pytest.raises(RuntimeError, match="inside the block"), Cluster(2):
        c.shape("fk-host1", "1gbit")
        raise RuntimeError("inside the block")
    _nothing_left()


def test_cleanup_after_a_killed_owner_and_cli(tmp_path: Path) -> None:
    require_cluster()
    code = "from scripts.cluster_sim import Cluster; Cluster(2).__enter__(); print('up', flush=True); " \
           "import time; time.sleep(600)"
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "up"  # type: ignore[union-attr]
        with pytest.raises(Exception, match=f"process {proc.pid}"):  # one cluster at a time, while its owner lives
            Cluster(2).__enter__()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert existing_namespaces() == ["fk-host1", "fk-host2"]  # what the killed process left
    with Cluster(1):  # a dead owner's cluster is removed before a new one is built
        assert existing_namespaces() == ["fk-host1"]
    _nothing_left()
    run = [sys.executable, SCRIPT]
    up = subprocess.run([*run, "up", "--hosts", "2"], capture_output=True, text=True, timeout=60)
    try:
        assert up.returncode == 0, up.stderr
        assert up.stdout.split() == ["fk-host1", "10.210.0.11", "fk-host2", "10.210.0.12"]
        again = subprocess.run([*run, "up", "--hosts", "2"], capture_output=True, text=True, timeout=60)
        assert again.returncode == 1 and "down" in again.stderr  # refuses, and says how to go on
        ex = subprocess.run([*run, "exec", "fk-host2", "--", "hostname"], capture_output=True, text=True, timeout=60)
        assert ex.stdout.strip() == "fk-host2", ex.stderr
    finally:
        for _ in range(2):  # idempotent: the second finds nothing
            done = subprocess.run([*run, "--cleanup"], capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "removed: nothing"
    _nothing_left()
