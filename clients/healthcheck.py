"""Exit 0 when a forkrl service is healthy: gRPC health SERVING, or HTTP 200.

    python clients/healthcheck.py grpc 127.0.0.1:50051            # standard grpc.health.v1 Check
    python clients/healthcheck.py grpc 127.0.0.1:50052 --service forkrl.trainer.v1.TrainerService
    python clients/healthcheck.py http http://127.0.0.1:8000/healthz

Used by compose.yaml's healthchecks (the image has no curl) and by clients/launch.py. Exit status:
0 healthy, 1 reachable but not healthy / not reachable, 2 bad usage. Prints one line either way.
Keep it light: Docker runs it every few seconds, so it imports only grpc (or only urllib). With
FORKRL_TLS_CA set (services started with a TLS certificate) it checks over TLS against that CA.
"""

from __future__ import annotations

import argparse
import sys


def check_grpc(address: str, service: str, timeout: float) -> tuple[bool, str]:
    import os

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    # Never through an HTTP proxy from the environment: the services are local.
    options = [("grpc.enable_http_proxy", 0)]
    ca = os.environ.get("FORKRL_TLS_CA", "").strip()
    if ca:
        name = os.environ.get("FORKRL_TLS_SERVER_NAME", "").strip()
        with open(ca, "rb") as f:
            creds = grpc.ssl_channel_credentials(root_certificates=f.read())
        channel = grpc.secure_channel(address, creds, [*options, *([("grpc.ssl_target_name_override", name)]
                                                                  if name else [])])
    else:
        channel = grpc.insecure_channel(address, options=options)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as err:
            return False, f"{err.code().name}: {err.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, status


def check_http(url: str, timeout: float) -> tuple[bool, str]:
    import os
    import ssl
    import urllib.error
    import urllib.request

    ca = os.environ.get("FORKRL_TLS_CA", "").strip()
    https = urllib.request.HTTPSHandler(context=ssl.create_default_context(cafile=ca or None))
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), https)  # no proxy from the environment
    try:
        with opener.open(url, timeout=timeout) as reply:
            return reply.status == 200, f"HTTP {reply.status}"
    except urllib.error.HTTPError as err:
        return False, f"HTTP {err.code}"
    except (urllib.error.URLError, OSError) as err:
        return False, f"{type(err).__name__}: {getattr(err, 'reason', err)}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python clients/healthcheck.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=["grpc", "http"])
    parser.add_argument("target", help="host:port for grpc, a URL for http")
    parser.add_argument("--service", default="", help="grpc: service name to check ('' = the whole server)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds (default: 3)")
    parser.add_argument("--quiet", "-q", action="store_true", help="print nothing")
    args = parser.parse_args(argv)
    if args.kind == "grpc":
        ok, text = check_grpc(args.target, args.service, args.timeout)
    else:
        ok, text = check_http(args.target, args.timeout)
    if not args.quiet:
        print(f"{args.kind} {args.target}: {text}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
