"""The pieces every forkrl grpc.aio server shares: its options, the token interceptor, listening (TLS or not).

    server = grpc.aio.server(interceptors=server_interceptors(token),
                             options=grpc_server_options(max_receive, max_send, max_streams))
    port = add_server_port(server, "0.0.0.0:50051", cert_file, key_file)   # TLS when both files are given

With a token every RPC but health and reflection needs `authorization: Bearer <token>` (UNAUTHENTICATED,
naming how to set it, otherwise); the check itself is the core's (forkrl/security.py:check_authorization).
"""

from __future__ import annotations

from typing import Any

import grpc

from forkrl.security import HEADER, check_authorization, read_tls_file

# Always open: liveness probes (Docker, the launcher) and the schema of the API.
OPEN_GRPC_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/",
                      "/grpc.reflection.v1.ServerReflection/")


def add_server_port(server: Any, address: str, cert_file: str | None = None, key_file: str | None = None) -> int:
    """Listen on `address`: TLS with the certificate chain and key from files when given, else plaintext.
    Returns the port (RuntimeError from grpc when it cannot bind)."""
    if not cert_file:
        return server.add_insecure_port(address)
    creds = grpc.ssl_server_credentials([(read_tls_file(key_file or "", "key file"),
                                          read_tls_file(cert_file, "certificate file"))])
    return server.add_secure_port(address, creds)


KEEPALIVE_MIN_MS = 5000  # the shortest ping interval a server accepts from a client


def grpc_server_options(max_receive_bytes: int, max_send_bytes: int, max_streams: int) -> list[tuple[str, int]]:
    """Options of every forkrl grpc.aio server: message limits, concurrent streams per connection, and no
    SO_REUSEPORT (gRPC's default: a second service on the same port would start silently and share the
    traffic; fail instead). Clients may ping every KEEPALIVE_MIN_MS during a call (the trainer's keepalive, which
    finds a stopped or partitioned rollout service: forkrl/remote/rollout.py) without being told too_many_pings."""
    return [("grpc.max_receive_message_length", max_receive_bytes),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_MIN_MS),
            ("grpc.http2.max_ping_strikes", 0),
            ("grpc.max_send_message_length", max_send_bytes),
            ("grpc.max_concurrent_streams", max_streams),
            ("grpc.so_reuseport", 0)]


class RequireToken(grpc.aio.ServerInterceptor):
    """Refuses (UNAUTHENTICATED) every RPC but health and reflection that does not carry the token."""

    def __init__(self, token: str) -> None:
        self._token = token

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_GRPC_PREFIXES):
            return handler
        header = next((v for k, v in details.invocation_metadata or () if k == HEADER), None)
        problem = check_authorization(header if isinstance(header, str) else None, self._token)
        if problem is None:
            return handler

        async def refuse(request_or_iterator, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, problem)

        kind = ("stream" if handler.request_streaming else "unary",
                "stream" if handler.response_streaming else "unary")
        make = {("unary", "unary"): grpc.unary_unary_rpc_method_handler,
                ("unary", "stream"): grpc.unary_stream_rpc_method_handler,
                ("stream", "unary"): grpc.stream_unary_rpc_method_handler,
                ("stream", "stream"): grpc.stream_stream_rpc_method_handler}[kind]
        return make(refuse, request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)


def server_interceptors(token: str | None) -> list[grpc.aio.ServerInterceptor]:
    """The interceptors of a grpc.aio server: with a token, [RequireToken]; without one, none."""
    return [RequireToken(token)] if token else []
