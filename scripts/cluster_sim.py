"""A simulated cluster on one machine: N "hosts" as Linux network namespaces on a private bridge (root only).

    sudo python scripts/cluster_sim.py up --hosts 3          # fk-host1..3 = 10.210.0.11..13 on bridge fkbr0
    sudo python scripts/cluster_sim.py status                # what exists now (namespaces, links, addresses)
    sudo python scripts/cluster_sim.py exec fk-host1 -- python -m rollout_service --host 10.210.0.11 ...
    sudo python scripts/cluster_sim.py shape fk-host2 50mbit # tc tbf on the host's egress (this kernel: no netem)
    sudo python scripts/cluster_sim.py shape fk-host2 off    # remove the shaping
    sudo python scripts/cluster_sim.py partition fk-host2    # its link down: nothing reaches it, it reaches nothing
    sudo python scripts/cluster_sim.py heal fk-host2         # its link up again
    sudo python scripts/cluster_sim.py down                  # remove everything (also: --cleanup)
    sudo python scripts/cluster_sim.py --cleanup             # the same: removes whatever a crashed run left

From Python (tests): the cluster is torn down when the block ends, also on an exception:

    from scripts.cluster_sim import Cluster
    with Cluster(3) as c:
        c.address("fk-host1")                                 # "10.210.0.11"
        c.popen("fk-host1", ["python", "-m", "rollout_service", ...])   # a process on that host
        c.run("fk-host2", ["python", "-c", "..."], capture_output=True, text=True)

What it builds, and the rules it keeps (docs/multi-node.md, /work/shared/docs/cluster-sim-notes.md):
- Host i is the namespace fk-host<i> with one interface eth0 = 10.210.0.(10+i)/24, joined by the veth fkv-host<i>
  to the bridge fkbr0. The bridge has no address and no link to the machine's own interfaces; the namespaces have
  no default route and there is no NAT: traffic goes only between the simulated hosts. IPv6 is off on all of it
  (no link-local path from a namespace to the machine). Each namespace has its own loopback: 127.0.0.1 on one host
  is not 127.0.0.1 on another.
- /etc/netns/fk-host<i>/hosts maps fk-host1..N to their addresses (and localhost to 127.0.0.1); `ip netns exec`
  bind-mounts it over /etc/hosts. The machine's own hostname is deliberately absent, and resolv.conf there names
  no server: a name lookup that is not in that file fails instead of leaving the cluster.
- `exec` / `popen` / `run` start the command with `ip netns exec` under `unshare --uts` with the host's own
  hostname (fk-host<i>, which resolves to the host's address, as on a real node). Without that, every namespace
  would carry the machine's hostname, which /etc/hosts maps to 127.0.0.1 (gloo, torchrun and vLLM pick their
  address from it).
- Not separated: the filesystem, /dev/shm and process ids are the machine's. A test that must not rely on shared
  files gives each host its own directories.
- Every name starts with fk (fk-host*, fkv-*, fkbr0, /etc/netns/fk-*), and a state file
  (/run/forkrl-cluster-sim.json) records what was built and by whom; `down` removes what it names and any other
  fk-prefixed namespace, veth or bridge. One cluster per machine at a time: `up` refuses while another exists.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

BRIDGE = "fkbr0"
NS_PREFIX = "fk-host"
VETH_PREFIX = "fkv-"
SUBNET = "10.210.0"  # one private /24, and nothing else
FIRST_HOST_OCTET = 10  # host i = 10.210.0.(10 + i)
MAX_HOSTS = 200
STATE_FILE = Path("/run/forkrl-cluster-sim.json")
LOCK_FILE = Path("/run/forkrl-cluster-sim.lock")
NETNS_ETC = Path("/etc/netns")
RATE = re.compile(r"^\d+(\.\d+)?(bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps)$")


class ClusterError(RuntimeError):
    """A cluster operation failed; the message names the command or the setting."""


def host_name(i: int) -> str:
    return f"{NS_PREFIX}{i}"


def host_address(i: int) -> str:
    return f"{SUBNET}.{FIRST_HOST_OCTET + i}"


def unsupported_reason() -> str | None:
    """Why a cluster cannot be built here (not root, no `ip netns`, no unshare), or None when it can."""
    if os.geteuid() != 0:
        return "the simulated cluster needs root (network namespaces, a bridge, tc)"
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            return f"the simulated cluster needs `{tool}` (iproute2 / util-linux), not found on PATH"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"`ip netns` does not work here: {probe.stderr.strip()}"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return _cmd(["ip", *args], check=check)


def _cmd(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(argv), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise ClusterError(f"`{' '.join(argv)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def existing_namespaces() -> list[str]:
    """The fk-prefixed network namespaces that exist now."""
    out = _ip("netns", "list", check=False).stdout
    return sorted(n for n in (line.split()[0] for line in out.splitlines() if line.strip()) if n.startswith("fk"))


def existing_links() -> list[str]:
    """The fk-prefixed links (bridge, veth ends) of the machine's own namespace."""
    out = _ip("-o", "link", "show", check=False).stdout
    names = (line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if line.count(":") >= 2)
    return sorted(n for n in names if n == BRIDGE or n.startswith(VETH_PREFIX))


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    """Serialize up/down between processes (two tests, a test and a person at the shell)."""
    LOCK_FILE.parent.mkdir(parents=True, exist_ok=True)
    with open(LOCK_FILE, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _read_state() -> dict[str, Any] | None:
    try:
        return json.loads(STATE_FILE.read_text())
    except (OSError, ValueError):
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup() -> list[str]:
    """Remove every fk-prefixed namespace, link and /etc/netns entry, and the state file (idempotent: what a crashed
    run left, or nothing). Returns what it removed. Processes still running in a namespace keep running but lose
    their network with it."""
    removed: list[str] = []
    state = _read_state() or {}
    for ns in sorted(set(state.get("namespaces", [])) | set(existing_namespaces())):
        if ns.startswith("fk") and _ip("netns", "del", ns, check=False).returncode == 0:
            removed.append(f"netns {ns}")
    for link in existing_links():  # a veth goes with its namespace's end (asynchronously); the bridge does not
        if _ip("link", "del", link, check=False).returncode == 0:
            removed.append(f"link {link}")
    deadline = time.monotonic() + 10.0
    while existing_links() or existing_namespaces():  # the kernel destroys them asynchronously: wait for it
        if time.monotonic() > deadline:
            raise ClusterError(f"still there after cleanup: {existing_namespaces() + existing_links()}")
        time.sleep(0.05)
    if NETNS_ETC.is_dir():
        for d in NETNS_ETC.glob("fk*"):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(f"dir {d}")
        with contextlib.suppress(OSError):
            NETNS_ETC.rmdir()  # only when empty: someone else's entries stay
    if STATE_FILE.exists():
        STATE_FILE.unlink()
        removed.append(f"file {STATE_FILE}")
    return removed


def _sysctl_off_ipv6(ns: str | None, iface: str) -> None:
    path = f"/proc/sys/net/ipv6/conf/{iface}/disable_ipv6"
    if ns is None:
        with contextlib.suppress(OSError):
            Path(path).write_text("1")
    else:
        _cmd(["ip", "netns", "exec", ns, "sh", "-c", f"[ ! -e {path} ] || echo 1 > {path}"], check=False)


def build(n: int, owner_pid: int | None) -> dict[str, Any]:
    """Build an n-host cluster (see the module docstring); `owner_pid`: the process whose end makes it stale (None:
    built by `up`, it lasts until `down`). Refuses while another cluster exists; removes a stale one first."""
    if not 1 <= n <= MAX_HOSTS:
        raise ClusterError(f"--hosts must be in [1, {MAX_HOSTS}], got {n}")
    state = _read_state()
    if state is not None:
        owner = state.get("owner_pid")
        if owner is None:
            raise ClusterError(f"a cluster built by `cluster_sim.py up` exists ({STATE_FILE}); "
                               "run `python scripts/cluster_sim.py down` first")
        if _pid_alive(owner):
            raise ClusterError(f"a cluster of process {owner} exists ({STATE_FILE}); one cluster at a time")
    cleanup()  # a crashed run's leftovers
    try:
        return _build(n, owner_pid)
    except BaseException:
        cleanup()  # a half-built cluster
        raise


def _build(n: int, owner_pid: int | None) -> dict[str, Any]:
    hosts = {host_name(i): host_address(i) for i in range(1, n + 1)}
    state = {"owner_pid": owner_pid, "bridge": BRIDGE, "namespaces": [], "links": [], "hosts": hosts,
             "created_s": time.time()}

    def save() -> None:
        STATE_FILE.write_text(json.dumps(state, indent=1))

    save()  # before anything exists: a crash from here on leaves a file that names what to remove
    _ip("link", "add", BRIDGE, "type", "bridge")
    state["links"].append(BRIDGE)
    save()
    _sysctl_off_ipv6(None, BRIDGE)
    _ip("link", "set", BRIDGE, "up")
    hosts_file = "127.0.0.1 localhost\n" + "".join(f"{a} {h}\n" for h, a in hosts.items())
    for i, (ns, addr) in enumerate(hosts.items(), start=1):
        veth = f"{VETH_PREFIX}host{i}"
        etc = NETNS_ETC / ns
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "hosts").write_text(hosts_file)
        (etc / "resolv.conf").write_text("# no name server: names resolve from this namespace's hosts only\n")
        _ip("netns", "add", ns)
        state["namespaces"].append(ns)
        save()
        _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        state["links"].append(veth)
        save()
        _sysctl_off_ipv6(None, veth)
        _sysctl_off_ipv6(ns, "all")
        _sysctl_off_ipv6(ns, "default")
        _ip("link", "set", veth, "master", BRIDGE, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
    return state


def _check_host(host: str) -> str:
    state = _read_state()
    if state is None or host not in state.get("hosts", {}):
        known = ", ".join((state or {}).get("hosts", {})) or "none (run `up` first)"
        raise ClusterError(f"no simulated host {host!r}; hosts: {known}")
    return host


def shape(host: str, rate: str, burst: str = "256kb", latency: str = "50ms") -> None:
    """Limit `host`'s egress to `rate` (tc's units: 50mbit, 1gbit) with a token bucket (tbf); "off" removes it.
    Only egress: shape both ends of a link to bound both directions."""
    _check_host(host)
    if rate == "off":
        _cmd(["ip", "netns", "exec", host, "tc", "qdisc", "del", "dev", "eth0", "root"], check=False)
        return
    if not RATE.match(rate):
        raise ClusterError(f"rate must be a tc rate such as 50mbit or 1gbit, got {rate!r}")
    _cmd(["ip", "netns", "exec", host, "tc", "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate", rate,
          "burst", burst, "latency", latency])


def partition(host: str) -> None:
    """Cut `host` off: its link goes down (connections to and from it fail or time out)."""
    _ip("-n", _check_host(host), "link", "set", "eth0", "down")


def heal(host: str) -> None:
    """Bring `host`'s link back (its address and routes return with it)."""
    _ip("-n", _check_host(host), "link", "set", "eth0", "up")


def exec_argv(host: str, argv: Sequence[str], *, own_hostname: bool = True) -> list[str]:
    """The command line that runs `argv` on `host`: `ip netns exec` (the host's network, its /etc/hosts), under
    `unshare --uts` with the host's own hostname unless told otherwise. The last process is `argv` itself (each
    step execs the next), so its pid, process group and exit status are those of the returned command. An empty
    `argv`: the prefix alone, for a launcher that appends its own command."""
    _check_host(host)
    prefix = ["ip", "netns", "exec", host]
    if own_hostname:
        prefix += ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', host]
    return [*prefix, *argv]


class Cluster:
    """`with Cluster(n) as c:` builds n hosts (fk-host1..n) and removes them when the block ends, also on an
    exception. A stale cluster of a dead process is removed first; a live one makes the constructor refuse."""

    def __init__(self, n: int) -> None:
        reason = unsupported_reason()
        if reason:
            raise ClusterError(reason)
        self.n = n
        self.hosts: dict[str, str] = {}

    def __enter__(self) -> Cluster:
        with _locked():
            self.hosts = build(self.n, owner_pid=os.getpid())["hosts"]
        return self

    def __exit__(self, *exc: object) -> None:
        with _locked():
            self._remove_own()

    def _remove_own(self) -> None:
        """Remove the cluster if it is this process's: never another's."""
        state = _read_state()
        if state is not None and state.get("owner_pid") == os.getpid():
            cleanup()

    def names(self) -> list[str]:
        return list(self.hosts)

    def address(self, host: str) -> str:
        return self.hosts[host]

    def argv(self, host: str, argv: Sequence[str], *, own_hostname: bool = True) -> list[str]:
        return exec_argv(host, argv, own_hostname=own_hostname)

    def popen(self, host: str, argv: Sequence[str], *, own_hostname: bool = True, **kw: Any) -> subprocess.Popen:
        """A process on `host` (subprocess.Popen's keywords; start_new_session=True makes killing its group easy)."""
        return subprocess.Popen(exec_argv(host, argv, own_hostname=own_hostname), **kw)

    def run(self, host: str, argv: Sequence[str], *, own_hostname: bool = True,
            **kw: Any) -> subprocess.CompletedProcess:
        return subprocess.run(exec_argv(host, argv, own_hostname=own_hostname), **kw)

    def shape(self, host: str, rate: str) -> None:
        shape(host, rate)

    def partition(self, host: str) -> None:
        partition(host)

    def heal(self, host: str) -> None:
        heal(host)


def status() -> str:
    state = _read_state()
    lines = [f"state file {STATE_FILE}: " + (json.dumps(state) if state else "none")]
    lines.append("namespaces: " + (", ".join(existing_namespaces()) or "none"))
    lines.append("links: " + (", ".join(existing_links()) or "none"))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cluster_sim.py", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cleanup", action="store_true", help="remove whatever a (crashed) run left; idempotent")
    sub = parser.add_subparsers(dest="cmd")
    up = sub.add_parser("up", help="build N hosts fk-host1..N (10.210.0.11..)")
    up.add_argument("--hosts", type=int, required=True)
    sub.add_parser("down", help="remove the cluster (the same as --cleanup)")
    sub.add_parser("status", help="what exists now")
    sh = sub.add_parser("shape", help="tc tbf on HOST's egress (RATE: 50mbit, 1gbit; off: remove)")
    sh.add_argument("host")
    sh.add_argument("rate")
    for name, text in (("partition", "HOST's link down"), ("heal", "HOST's link up")):
        sub.add_parser(name, help=text).add_argument("host")
    ex = sub.add_parser("exec", help="run a command on HOST: exec HOST -- CMD ...")
    ex.add_argument("--machine-hostname", action="store_true",
                    help="keep the machine's hostname (default: the host's own, fk-hostN)")
    ex.add_argument("host")
    ex.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.cmd is None and not args.cleanup:
        parser.error("a command (up, down, status, shape, partition, heal, exec) or --cleanup")
    reason = unsupported_reason()
    if reason:
        print(f"cluster_sim: {reason}", file=sys.stderr)
        return 2
    try:
        if args.cleanup or args.cmd == "down":
            with _locked():
                removed = cleanup()
            print("removed: " + (", ".join(removed) or "nothing"))
        elif args.cmd == "up":
            with _locked():
                state = build(args.hosts, owner_pid=None)
            print("\n".join(f"{h} {a}" for h, a in state["hosts"].items()))
        elif args.cmd == "status":
            print(status())
        elif args.cmd == "shape":
            shape(args.host, args.rate)
        elif args.cmd == "partition":
            partition(args.host)
        elif args.cmd == "heal":
            heal(args.host)
        elif args.cmd == "exec":
            command = args.command[1:] if args.command[:1] == ["--"] else args.command
            if not command:
                raise ClusterError("exec needs a command: exec HOST -- CMD ...")
            argv_ = exec_argv(args.host, command, own_hostname=not args.machine_hostname)
            os.execvp(argv_[0], argv_)
    except ClusterError as e:
        print(f"cluster_sim: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
