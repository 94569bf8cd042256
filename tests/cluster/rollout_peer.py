"""A client of a rollout service on another simulated host (run there by tests/cluster/test_rollout_in_cluster.py).

    FORKRL_TLS_CA=ca.pem FORKRL_TOKEN=... python tests/cluster/rollout_peer.py 10.210.0.12:PORT

Waits for the service (health over TLS), generates with forkrl's RolloutClient, then tries the service the wrong
ways: in plaintext, and over TLS without the token. Prints one JSON line with what each attempt got.
"""

from __future__ import annotations

import json
import os
import socket
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from forkrl.remote.channel import grpc_channel
from forkrl.remote.rollout import RolloutClient


def _health_code(address: str, **kw: object) -> str:
    with grpc_channel(address, **kw) as channel:  # type: ignore[arg-type]
        try:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=60)
            return "OK"
        except grpc.RpcError as e:
            return e.code().name


def main(address: str) -> int:
    ca = os.environ["FORKRL_TLS_CA"]
    out: dict[str, object] = {"client_host": socket.gethostname()}
    with RolloutClient(address, timeout_s=120) as client:
        client.wait_ready(timeout_s=240)
        trajs = list(client.generate(["1+2="], n=3, temperature=1.0, max_new_tokens=4, seed=0))
        out["samples"] = len(trajs)
        out["tokens"] = [len(t.completion_token_ids) for t in trajs]
        out["logprobs_finite"] = all(abs(x) < 1e9 for t in trajs for x in t.logprobs)
        out["version"] = client.info().version
    os.environ.pop("FORKRL_TLS_CA")
    out["plaintext"] = _health_code(address)  # the service speaks TLS only: the call cannot go through
    out["tls_without_token"] = _health_code(address, ca_file=ca, token="")  # health is open: the handshake works
    os.environ["FORKRL_TLS_CA"] = ca
    with RolloutClient(address, timeout_s=30, token="", max_retries=0) as anonymous:
        try:
            anonymous.info(timeout_s=30)
            out["info_without_token"] = "OK"
        except grpc.RpcError as e:
            out["info_without_token"] = e.code().name
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
