"""The TCP sockets a process tree listens on, from /proc (no `ss` needed): for tests that check nothing of a run
listens beyond the loopback (tests/dist/test_transfer_two_ranks.py)."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

LISTEN = "0A"


def descendants(root: int) -> set[int]:
    """`root`'s descendants (children, their children, ...), alive now."""
    parents: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            parents[int(d.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {root}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - found
        found |= frontier
    return found


def _address(hex_addr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return ipaddress.IPv4Address(raw[::-1])
    return ipaddress.IPv6Address(b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))


def listening(pids: set[int]) -> set[tuple[int, str, str, int]]:
    """(pid, process name, address, port) of every TCP socket in LISTEN held by one of `pids`."""
    out: set[tuple[int, str, str, int]] = set()
    for pid in pids:
        try:
            inodes = {os.readlink(f"/proc/{pid}/fd/{fd}")[8:-1] for fd in os.listdir(f"/proc/{pid}/fd")
                      if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:[")}
            name = Path(f"/proc/{pid}/comm").read_text().strip()
            tables = [Path(f"/proc/{pid}/net/{t}").read_text().splitlines()[1:] for t in ("tcp", "tcp6")]
        except OSError:  # it ended meanwhile
            continue
        for row in (r.split() for table in tables for r in table):
            local, state, inode = row[1], row[3], row[9]
            if state == LISTEN and inode in inodes:
                addr, port = local.split(":")
                out.add((pid, name, str(_address(addr)), int(port, 16)))
    return out


def on_every_interface(address: str) -> bool:
    """0.0.0.0 or [::] (which also takes IPv4 on a dual-stack socket)."""
    return ipaddress.ip_address(address).is_unspecified
