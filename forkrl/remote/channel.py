"""How a client reaches the forkrl services: a gRPC channel (and HTTP headers) that carry the token, over TLS
when a CA is named.

    channel = grpc_channel("127.0.0.1:50052")   # every call carries `authorization: Bearer …` (FORKRL_TOKEN)
    httpx.get(url, headers=http_headers(), verify=http_verify())   # the same for the probe's HTTP API

The token comes from FORKRL_TOKEN, else the file named by FORKRL_TOKEN_FILE (forkrl/security.py:load_token);
without one nothing is sent. Clients speak TLS when FORKRL_TLS_CA names the CA to trust (FORKRL_TLS_SERVER_NAME
overrides the name the certificate is checked for), plaintext otherwise. gRPC is imported only by the functions
that need it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from forkrl.security import HEADER, TLS_CA_ENV, TLS_SERVER_NAME_ENV, load_token, read_tls_file


def auth_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """The gRPC metadata that carries `token`."""
    return ((HEADER, f"Bearer {token}"),)


def http_headers(token: str | None = None) -> dict[str, str]:
    """Headers for the probe's HTTP API: the token of `token` or of the environment (none when unset)."""
    token = load_token() if token is None else token
    return {HEADER: f"Bearer {token}"} if token else {}


def tls_ca(env: Mapping[str, str] | None = None) -> str | None:
    """The clients' CA file (FORKRL_TLS_CA): set, clients speak TLS and trust only that CA; else plaintext."""
    env = os.environ if env is None else env
    return env.get(TLS_CA_ENV, "").strip() or None


def http_verify(ca_file: str | None = None) -> Any:
    """httpx's `verify=` for the probe's API: an SSL context trusting the CA file (argument, else
    FORKRL_TLS_CA), else True (the system's CAs)."""
    import ssl

    ca_file = ca_file or tls_ca()
    return ssl.create_default_context(cafile=ca_file) if ca_file else True


def grpc_channel(address: str, *, options: Sequence[tuple[str, Any]] = (), token: str | None = None,
                 ca_file: str | None = None) -> Any:
    """A gRPC channel that sends the token with every call. `token=None` takes it from the environment
    (load_token); `token=""` sends none. TLS when a CA file is given or FORKRL_TLS_CA is set (the server's
    certificate must be signed by it; FORKRL_TLS_SERVER_NAME overrides the name it is checked for), else
    plaintext."""
    import grpc

    ca_file = ca_file or tls_ca()
    if ca_file:
        creds = grpc.ssl_channel_credentials(root_certificates=read_tls_file(ca_file, "CA file"))
        name = os.environ.get(TLS_SERVER_NAME_ENV, "").strip()
        opts = [*options, *([("grpc.ssl_target_name_override", name)] if name else [])]
        channel = grpc.secure_channel(address, creds, options=opts)
    else:
        channel = grpc.insecure_channel(address, options=list(options))
    token = load_token() if token is None else token
    return grpc.intercept_channel(channel, _client_interceptor(token)) if token else channel


def _client_interceptor(token: str) -> Any:
    import collections

    import grpc

    class Details(collections.namedtuple("Details", ("method", "timeout", "metadata", "credentials",
                                                     "wait_for_ready", "compression")), grpc.ClientCallDetails):
        pass

    extra = auth_metadata(token)

    class AddToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                   grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
        def _details(self, d: Any) -> Any:
            meta = [m for m in (d.metadata or ()) if m[0] != HEADER]
            return Details(d.method, d.timeout, (*meta, *extra), d.credentials, d.wait_for_ready,
                           getattr(d, "compression", None))

        def intercept_unary_unary(self, continuation, details, request):
            return continuation(self._details(details), request)

        def intercept_unary_stream(self, continuation, details, request):
            return continuation(self._details(details), request)

        def intercept_stream_unary(self, continuation, details, request_iterator):
            return continuation(self._details(details), request_iterator)

        def intercept_stream_stream(self, continuation, details, request_iterator):
            return continuation(self._details(details), request_iterator)

    return AddToken()
