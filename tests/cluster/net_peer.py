"""The two ends of a TCP test between simulated hosts (stdlib only; run inside a namespace by the tests).

    python tests/cluster/net_peer.py listen 10.210.0.11      # prints {"port": P}, then one JSON line per connection
    python tests/cluster/net_peer.py send 10.210.0.11 P 8388608 --timeout 5   # prints the listener's reply

The listener reads each connection to its end and answers with what it measured, {"bytes": B, "seconds": S,
"host": its hostname}: S runs from the end of the first read to the end of the last, so the burst a token bucket
lets through at once (the first read) is not counted as time. The sender prints that reply, or {"error": ...} and
exits 3 when it cannot connect.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time


def listen(address: str) -> None:
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind((address, 0))
    server.listen(8)
    print(json.dumps({"port": server.getsockname()[1]}), flush=True)
    while True:
        conn, _ = server.accept()
        with conn:
            total = 0
            first = last = None
            first_bytes = 0
            while chunk := conn.recv(1 << 16):
                last = time.monotonic()
                if first is None:
                    first, first_bytes = last, len(chunk)
                total += len(chunk)
            reply = {"bytes": total, "timed_bytes": total - first_bytes,
                     "seconds": (last - first) if first is not None else 0.0, "host": socket.gethostname()}
            conn.sendall(json.dumps(reply).encode())
            print(json.dumps(reply), flush=True)


def send(address: str, port: int, n_bytes: int, timeout_s: float) -> int:
    try:
        with socket.create_connection((address, port), timeout=timeout_s) as conn:
            conn.settimeout(max(timeout_s, 60.0))  # connected: the transfer itself may take a while when shaped
            block = b"\0" * (1 << 16)
            left = n_bytes
            while left > 0:
                conn.sendall(block[: min(left, len(block))])
                left -= min(left, len(block))
            conn.shutdown(socket.SHUT_WR)
            reply = b""
            while chunk := conn.recv(4096):
                reply += chunk
    except OSError as e:
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
        return 3
    print(reply.decode(), flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("listen").add_argument("address")
    s = sub.add_parser("send")
    s.add_argument("address")
    s.add_argument("port", type=int)
    s.add_argument("n_bytes", type=int)
    s.add_argument("--timeout", type=float, default=5.0)
    args = parser.parse_args()
    if args.cmd == "listen":
        listen(args.address)
        return 0
    return send(args.address, args.port, args.n_bytes, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
