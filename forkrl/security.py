"""The shared bearer token of the forkrl services: where it comes from, how it is checked, how clients send it.

    token = load_token()                        # FORKRL_TOKEN, else the file named by FORKRL_TOKEN_FILE, else None
    channel = grpc_channel("127.0.0.1:50052")   # a gRPC channel whose every call carries `authorization: Bearer …`
    httpx.get(url, headers=http_headers())      # the same header for the probe's HTTP API
    server = grpc.aio.server(interceptors=server_interceptors(token))   # UNAUTHENTICATED without it

All three services take one token (`--token-file` / `FORKRL_TOKEN_FILE`, or `FORKRL_TOKEN`); every RPC and
route but the health checks (and gRPC reflection) needs it. A service without a token runs open only on a
loopback address, with a warning; on any other address it refuses to start (`refuse_open_bind`). The local
launcher and compose.yaml create a token when none is given:

    python -m forkrl.security ensure-token /data/secrets/token     # keeps an existing file; 0600

TLS is optional: a service given a certificate and key (`--tls-cert-file`/`--tls-key-file`, FORKRL_TLS_CERT /
FORKRL_TLS_KEY) listens only with TLS (`add_server_port`; the probe through uvicorn); clients speak TLS when
FORKRL_TLS_CA names the CA to trust (`grpc_channel`, `http_verify`), plaintext otherwise.

Paths a request names are confined to the roots a service is configured with (`confine_path`: '..' refused,
symlinks followed). Comparison is constant-time (hmac.compare_digest). gRPC is imported only by the
functions that need it.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import secrets
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

TOKEN_ENV = "FORKRL_TOKEN"
TOKEN_FILE_ENV = "FORKRL_TOKEN_FILE"
# TLS (optional): the services read a certificate and key, the clients a CA file; set, the clients use TLS.
TLS_CERT_ENV = "FORKRL_TLS_CERT"
TLS_KEY_ENV = "FORKRL_TLS_KEY"
TLS_CA_ENV = "FORKRL_TLS_CA"
TLS_SERVER_NAME_ENV = "FORKRL_TLS_SERVER_NAME"  # the name to check the certificate for, when not the address's
HEADER = "authorization"
# What a refused client is told: how to give it the token.
HOW_TO_SET = (f"set {TOKEN_ENV} (or {TOKEN_FILE_ENV}, a file holding it) in the client's environment to the "
              "services' token; the local launcher writes it to <data-dir>/secrets/token, compose to "
              "/data/secrets/token in its volume")
# Always open: liveness probes (Docker, the launcher) and the schema of the API.
OPEN_GRPC_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/",
                      "/grpc.reflection.v1.ServerReflection/")

log = logging.getLogger("forkrl.security")


class TokenError(ValueError):
    """A token file that cannot be used (missing, unreadable, empty)."""


def read_token_file(path: str | os.PathLike) -> str:
    """The token in `path` (surrounding whitespace stripped); TokenError naming the file otherwise."""
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8").strip()
    except OSError as err:
        raise TokenError(f"token file {str(path)!r} cannot be read: {err.strerror or err}") from None
    if not text:
        raise TokenError(f"token file {str(path)!r} is empty")
    return text


def resolve_token(token: str | None, token_file: str | None) -> str | None:
    """`token` when non-empty, else the content of `token_file` when given, else None."""
    if token and token.strip():
        return token.strip()
    if token_file and token_file.strip():
        return read_token_file(token_file.strip())
    return None


def load_token(env: Mapping[str, str] | None = None) -> str | None:
    """The clients' token: FORKRL_TOKEN, else the file named by FORKRL_TOKEN_FILE, else None (send none)."""
    env = os.environ if env is None else env
    return resolve_token(env.get(TOKEN_ENV), env.get(TOKEN_FILE_ENV))


def tokens_equal(given: str, expected: str) -> bool:
    """Constant-time comparison (the time does not reveal how much of a guess was right)."""
    return hmac.compare_digest(given.encode("utf-8"), expected.encode("utf-8"))


def check_authorization(header: str | None, token: str) -> str | None:
    """None when `header` is `Bearer <token>`; else why not (the message a refused client gets)."""
    if not header:
        return f"no token: every call needs the header '{HEADER}: Bearer <token>'; {HOW_TO_SET}"
    scheme, _, given = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        return f"the {HEADER} header must be 'Bearer <token>'; {HOW_TO_SET}"
    if not tokens_equal(given.strip(), token):
        return f"wrong token; {HOW_TO_SET}"
    return None


def http_headers(token: str | None = None) -> dict[str, str]:
    """Headers for the probe's HTTP API: the token of `token` or of the environment (none when unset)."""
    token = load_token() if token is None else token
    return {HEADER: f"Bearer {token}"} if token else {}


def is_loopback(host: str) -> bool:
    """Whether binding `host` reaches only this machine (127.0.0.0/8, ::1, localhost)."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False


def refuse_open_bind(service: str, host: str, token: str | None) -> None:
    """The start-up rule: no token on a non-loopback address → SystemExit; no token on loopback → a warning."""
    if token:
        return
    if not is_loopback(host):
        raise SystemExit(
            f"{service}: refusing to listen on {host} without a token: anyone who reaches it could use it. "
            f"Set {TOKEN_ENV} or {TOKEN_FILE_ENV} (or --token-file), or bind 127.0.0.1.")
    log.warning("%s: NO TOKEN SET: every local user and process can call this service on %s. "
                "Set %s or %s to require one.", service, host, TOKEN_ENV, TOKEN_FILE_ENV)


# --------------------------------------------------------------------------------------------- paths
class OutsideRoots(PermissionError):
    """A path that resolves (symlinks followed) outside the roots a service may use: PERMISSION_DENIED / 403."""


def confine_path(path: str | os.PathLike, roots: Sequence[Path], what: str, setting: str) -> Path:
    """The real path of `path` (symlinks followed) when it lies inside one of `roots` (real paths).

    '..' anywhere → ValueError (a request that tries to climb out is malformed, whatever it resolves to);
    outside → OutsideRoots naming `setting` (the roots' setting, e.g. "the trainer's runs_root (--runs-root)")
    and, when a symlink leads out, where it leads. A path that does not exist yet is resolved as far as it
    exists (a new run dir inside a symlinked folder is judged by where the folder leads)."""
    p = Path(path).expanduser()
    if ".." in p.parts:
        raise ValueError(f"{what} {str(path)!r} must not contain '..'")
    real = p.resolve()
    if not any(real == r or real.is_relative_to(r) for r in roots):
        allowed = [str(r) for r in roots]
        if real != p.absolute():  # a symlink (of the path or of a folder above it) leads out
            raise OutsideRoots(f"{what} {str(path)!r} links outside {setting} {allowed} (to {str(real)!r})")
        raise OutsideRoots(f"{what} {str(path)!r} is outside {setting} {allowed}")
    return real


def real_roots(roots: Sequence[str | os.PathLike]) -> list[Path]:
    return [Path(r).expanduser().resolve() for r in roots]


# --------------------------------------------------------------------------------------------- gRPC
def auth_metadata(token: str) -> tuple[tuple[str, str], ...]:
    return ((HEADER, f"Bearer {token}"),)


def tls_ca(env: Mapping[str, str] | None = None) -> str | None:
    """The clients' CA file (FORKRL_TLS_CA): set, clients speak TLS and trust only that CA; else plaintext."""
    env = os.environ if env is None else env
    return env.get(TLS_CA_ENV, "").strip() or None


def read_tls_file(path: str, what: str) -> bytes:
    try:
        data = Path(path).expanduser().read_bytes()
    except OSError as err:
        raise TokenError(f"TLS {what} {path!r} cannot be read: {err.strerror or err}") from None
    if not data.strip():
        raise TokenError(f"TLS {what} {path!r} is empty")
    return data


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


def add_server_port(server: Any, address: str, cert_file: str | None = None, key_file: str | None = None) -> int:
    """Listen on `address`: TLS with the certificate chain and key from files when given, else plaintext.
    Returns the port (RuntimeError from grpc when it cannot bind)."""
    if not cert_file:
        return server.add_insecure_port(address)
    import grpc

    creds = grpc.ssl_server_credentials([(read_tls_file(key_file or "", "key file"),
                                          read_tls_file(cert_file, "certificate file"))])
    return server.add_secure_port(address, creds)


def grpc_server_options(max_receive_bytes: int, max_send_bytes: int, max_streams: int) -> list[tuple[str, int]]:
    """Options of every forkrl grpc.aio server: message limits, concurrent streams per connection, and no
    SO_REUSEPORT (gRPC's default: a second service on the same port would start silently and share the
    traffic; fail instead)."""
    return [("grpc.max_receive_message_length", max_receive_bytes),
            ("grpc.max_send_message_length", max_send_bytes),
            ("grpc.max_concurrent_streams", max_streams),
            ("grpc.so_reuseport", 0)]


def server_interceptors(token: str | None) -> list[Any]:
    """The interceptors of a grpc.aio server: with a token, every RPC but health and reflection needs it
    (UNAUTHENTICATED otherwise, naming how to set it); without one, none."""
    if not token:
        return []
    import grpc

    class RequireToken(grpc.aio.ServerInterceptor):
        async def intercept_service(self, continuation, details):
            handler = await continuation(details)
            if handler is None or details.method.startswith(OPEN_GRPC_PREFIXES):
                return handler
            header = next((v for k, v in details.invocation_metadata or () if k == HEADER), None)
            problem = check_authorization(header if isinstance(header, str) else None, token)
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

    return [RequireToken()]


# --------------------------------------------------------------------------------------------- CLI
def ensure_token_file(path: str | os.PathLike) -> tuple[Path, bool]:
    """Create `path` holding a new random token (mode 0600) unless it already holds one; (path, created)."""
    p = Path(path)
    try:
        read_token_file(p)
        return p, False
    except TokenError:
        pass
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(secrets.token_urlsafe(32) + "\n")
    os.replace(tmp, p)
    return p, True


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m forkrl.security ensure-token FILE`: the one-shot of compose.yaml and the local launcher.
    With FORKRL_TOKEN set nothing is written (the services use that); else FILE is created once."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2 or args[0] != "ensure-token":
        print("usage: python -m forkrl.security ensure-token FILE", file=sys.stderr)
        return 2
    if os.environ.get(TOKEN_ENV, "").strip():
        print(f"{TOKEN_ENV} is set: the services use it ({args[1]} is not needed)")
        return 0
    path, created = ensure_token_file(args[1])
    print(f"token {'created' if created else 'kept'}: {path} (clients: export {TOKEN_FILE_ENV}={path})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
