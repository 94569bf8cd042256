"""Operator commands for a running rollout service (they need the services' token, like every RPC).

    python -m rollout_service.admin lease --address 127.0.0.1:50051         # who holds the lease, version served
    python -m rollout_service.admin reset-lease --address 127.0.0.1:50051   # release it, whoever holds it

The lease (rollout_service/engine.py) is the run whose weight pushes the service accepts. A run releases it when
it ends and it expires after the service's lease_timeout_s without a push; `reset-lease` is for the case in
between (a trainer killed without a restart). The served version is not reset: it labels the weights being
served, and since every push must be the served version + 1 it cannot be pushed out of reach.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rollout_service.admin", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["lease", "reset-lease"])
    parser.add_argument("--address", default="127.0.0.1:50051", help="the rollout service, host:port")
    parser.add_argument("--timeout-s", type=float, default=30.0, help="deadline of the call")
    args = parser.parse_args(argv)

    import grpc

    from forkrl.remote.rollout import RolloutClient

    with RolloutClient(args.address) as client:
        try:
            if args.command == "reset-lease":
                holder = client.release_lease(force=True, timeout_s=args.timeout_s)
                print(f"lease of run {holder} released" if holder else "no run held the lease")
            info = client.info(timeout_s=args.timeout_s)
        except grpc.RpcError as e:
            print(f"{args.address}: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    lease = f"run {info.lease_run_id} ({info.lease_expires_in_s:.0f} s left)" if info.lease_run_id else "none"
    print(f"serving version {info.version}; lease: {lease}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
