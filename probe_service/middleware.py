"""The probe service's ASGI middleware, outermost first: the token (`RequireToken`, when the service has one),
then `RequestGuard` (Host, method, content type and size of the body), before any route reads a request."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse
from starlette.routing import Match, Route, Router

from forkrl.security import check_authorization
from probe_service.config import ProbeSettings

# Open without the token: the health check, and the API's schema and its viewers (no data in them).
OPEN_PATHS = frozenset({"/healthz", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})


class RequireToken:
    """401 for every request but OPEN_PATHS without `authorization: Bearer <token>`, before anything else
    reads it (its body included: a cross-site form post is refused as is, never parsed)."""

    def __init__(self, app: Any, token: str) -> None:
        self.app, self.token = app, token

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            header = dict(scope["headers"]).get(b"authorization")
            problem = check_authorization(header.decode("latin-1") if header else None, self.token)
            if problem is not None:
                reply = JSONResponse({"detail": problem}, 401, headers={"WWW-Authenticate": "Bearer"})
                await reply(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _reply(status: int, detail: str) -> JSONResponse:
    return JSONResponse({"detail": detail}, status)


class RequestGuard:
    """Before any route sees a request:
    - the Host header must name this service (settings.host_names: localhost, 127.0.0.1, ::1, the bound host,
      allowed_hosts), else 400: a page that rebinds its own DNS name to this machine gets nothing (every path
      but /healthz);
    - the method must be one the path serves, else 405 with `Allow` listing every method the path serves (the
      router alone would name those of the first route of the path, and the body checks below would answer
      first);
    - a served POST's body must be `application/json`, else 415: a browser sends a cross-site form (urlencoded,
      multipart, text/plain) without asking first, JSON never;
    - a body may be at most settings.max_body_bytes, else 413 (by Content-Length, and while it is read).
    A path no route serves goes on to the router (404)."""

    def __init__(self, app: Any, settings: ProbeSettings, router: Router) -> None:
        self.app, self.settings, self.hosts, self.router = app, settings, settings.host_names(), router

    def _served(self, scope: dict) -> tuple[bool, set[str]]:
        """(whether a route serves this path and method, every method the routes of this path serve)."""
        served, methods = False, set()
        for route in self.router.routes:
            if not isinstance(route, Route) or not route.methods:
                continue
            match, _ = route.matches(scope)
            served |= match == Match.FULL
            if match != Match.NONE:
                methods |= route.methods
        return served, methods

    def _host_ok(self, host: str) -> bool:
        if self.hosts is None:
            return True
        host = host.strip().lower()
        name = host[1:].partition("]")[0] if host.startswith("[") else host.rpartition(":")[0] or host
        if host.count(":") > 1 and not host.startswith("["):  # a bare IPv6 address
            name = host
        return name in self.hosts

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        host = headers.get(b"host", b"").decode("latin-1")
        if scope["path"] != "/healthz" and not self._host_ok(host):
            reply = _reply(400, f"Host {host[:100]!r} is not one this service answers to; the operator can add it "
                                "to the probe's allowed_hosts (--allowed-hosts, PROBE_ALLOWED_HOSTS)")
            await reply(scope, receive, send)
            return
        served, methods = self._served(scope)
        if methods and not served:
            allow = ", ".join(sorted(methods))
            reply = JSONResponse({"detail": f"method {scope['method'][:20]} is not served here; this path serves "
                                            f"{allow}"}, 405, headers={"Allow": allow})
            await reply(scope, receive, send)
            return
        if not served or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        ctype = headers.get(b"content-type", b"").decode("latin-1").partition(";")[0].strip().lower()
        if ctype != "application/json":
            reply = _reply(415, f"the body must be JSON with 'content-type: application/json', got "
                                f"{ctype or 'none'!r} (curl: -H 'content-type: application/json')")
            await reply(scope, receive, send)
            return
        limit = self.settings.max_body_bytes
        too_big = (f"the body exceeds the probe's max_body_bytes {limit:,} (raise it with --max-body-bytes, "
                   "PROBE_MAX_BODY_BYTES)")
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            await _reply(413 if length.isdigit() else 400, too_big if length.isdigit()
                         else "bad content-length")(scope, receive, send)
            return
        body, more = b"", True  # read the whole (bounded) body first: chunked uploads have no length
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > limit:
                await _reply(413, too_big)(scope, receive, send)
                return
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
