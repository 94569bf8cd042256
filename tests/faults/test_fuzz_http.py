"""Property-based fuzzing of the probe's HTTP API on a real server (the app under uvicorn on 127.0.0.1, with a
token): random JSON bodies (random values under ProbeParams' field names, and any JSON), content types, job
ids, query strings and tokens. Every answer is a clean client error or a success (never 5xx), its status and
content type are ones the OpenAPI schema documents for that route, and /healthz answers 200 after each example.
No fuzzed job can be admitted: the allowed root is an empty directory (paths are 400/403/404, no checkpoint).

Every error body also validates against the JSON schema the OpenAPI document declares for that status. Every
path answers each HTTP method it does not serve with 405 and an `Allow` header naming all the methods it serves.

Also, without a server: the schema documents, for every route, the statuses the middleware and the route can
answer, its non-JSON content types (records as NDJSON, plots as PNG, metrics as Prometheus text) and the JSON body
of every error status."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import jsonschema
import pytest
import uvicorn
from fastapi.routing import APIRoute
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.routing import Route

from forkrl.probe.params import ProbeParams
from forkrl.remote.channel import http_headers
from probe_service.app import create_app
from probe_service.config import ProbeSettings
from tests.service_fixtures import wait_until

EXAMPLES = 30
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))
GUARDED = {400, 401}  # every route but /healthz: the Host check and the token
POST_ONLY = {413, 415, 422}
METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE")

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=30)
    | st.sampled_from(["", "..", "/", "/etc", "../x", "builtins:print", "step_000001", "none", "auto", "vllm"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)
fields = sorted(ProbeParams.model_fields) + ["group_size", "layers", "row_specs"]
probe_bodies = st.one_of(
    st.dictionaries(st.sampled_from(fields), json_values, max_size=8),
    json_values,
)


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Any]]:
    tmp = tmp_path_factory.mktemp("probe")
    (tmp / "empty").mkdir()
    app = create_app(ProbeSettings(allowed_roots=[str(tmp / "empty")], jobs_dir=str(tmp / "jobs"), device="cpu",
                                   max_body_bytes=4096, log_level="warning"))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started or not thread.is_alive(), 30, "the probe server to start")
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", app
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def _documented(app: Any) -> dict[tuple[str, str], dict[str, Any]]:
    """(METHOD, path template) -> the operation's `responses` in the OpenAPI schema."""
    schema = app.openapi()
    return {(m.upper(), p): op["responses"] for p, ops in schema["paths"].items() for m, op in ops.items()}


def _check(app: Any, method: str, template: str, r: httpx.Response) -> None:
    assert r.status_code < 500, (method, template, r.status_code, r.text[:300])
    responses = _documented(app)[(method, template)]
    assert str(r.status_code) in responses, f"{method} {template} answered {r.status_code}, undocumented: {r.text}"
    ctype = r.headers.get("content-type", "").partition(";")[0]
    if r.status_code < 300 and "content" in responses[str(r.status_code)]:
        assert ctype in responses[str(r.status_code)]["content"], (method, template, ctype)
    elif r.status_code >= 400:
        assert ctype == "application/json" and "detail" in r.json(), (method, template, r.text)
        schema = responses[str(r.status_code)]["content"]["application/json"]["schema"]
        # the body is what the schema declares ($refs resolve against the document's components)
        jsonschema.validate(r.json(), {**schema, "components": app.openapi()["components"]})


def _healthy(client: httpx.Client) -> None:
    assert client.get("/healthz").status_code == 200


def test_fuzz_post_probe(probe: tuple[str, Any]) -> None:
    base, app = probe
    with httpx.Client(base_url=base, timeout=60, headers=http_headers()) as client:

        @SETTINGS
        @given(body=probe_bodies, ctype=st.sampled_from(["application/json", "application/json; charset=utf-8",
                                                         "text/plain", "application/x-www-form-urlencoded", ""]),
               raw=st.one_of(st.none(), st.binary(max_size=64)), pad=st.integers(0, 5000),
               wait=st.sampled_from(["false", "0", "no", "maybe", ""]))
        def run(body: Any, ctype: str, raw: bytes | None, pad: int, wait: str) -> None:
            import json

            content = raw if raw is not None else json.dumps(body).encode() + b" " * (pad if pad > 4000 else 0)
            r = client.post("/probe", content=content, params={"wait": wait},
                            headers={"content-type": ctype} if ctype else {})
            _check(app, "POST", "/probe", r)
            _healthy(client)

        run()
        assert client.get("/probe").json() == {"jobs": []}  # nothing was admitted


def test_fuzz_job_routes_and_tokens(probe: tuple[str, Any]) -> None:
    base, app = probe
    routes = [(m, r.path) for r in app.routes if isinstance(r, APIRoute) for m in r.methods
              if r.path != "/healthz" and (m, r.path) != ("POST", "/probe")]
    assert len(routes) >= 8
    with httpx.Client(base_url=base, timeout=60) as client:

        @SETTINGS
        @given(route=st.sampled_from(routes), job_id=st.text(min_size=1, max_size=20),
               query=st.dictionaries(st.sampled_from(["format", "checkpoint", "wait", "x"]), st.text(max_size=10),
                                     max_size=2),
               token=st.sampled_from(["ok", "ok", "ok", "none", "wrong", "scheme"]))
        def run(route: tuple[str, str], job_id: str, query: dict, token: str, ) -> None:
            method, template = route
            headers = {"ok": http_headers(), "none": {}, "wrong": {"authorization": "Bearer nope"},
                       "scheme": {"authorization": "Basic x"}}[token]
            path = template.replace("{job_id}", quote(job_id, safe=""))
            r = client.request(method, path, params=query, headers=headers)
            if token != "ok":
                assert r.status_code == 401
            _check(app, method, template, r)
            _healthy(client)

        run()


def test_openapi_documents_every_status_and_content_type(tmp_path: Path) -> None:
    """Static: what the middleware and each route can answer is in the schema."""
    app = create_app(ProbeSettings(allowed_roots=[str(tmp_path)], jobs_dir=str(tmp_path / "jobs")))
    documented = _documented(app)
    routes = {(m, r.path) for r in app.routes if isinstance(r, APIRoute) for m in r.methods}
    assert routes == set(documented), "every route is in the schema, and only those"
    expected = {
        ("POST", "/probe"): {200, 202, 403, 404, 409, 413, 415, 422, 429, 500},
        ("GET", "/probe"): {200},
        ("GET", "/probe/{job_id}"): {200, 404, 422},
        ("GET", "/probe/{job_id}/records"): {200, 404, 409, 422},
        ("GET", "/probe/{job_id}/manifest"): {200, 404, 409},
        ("GET", "/probe/{job_id}/plot.png"): {200, 404, 409, 422},
        ("GET", "/probe/{job_id}/overlap.png"): {200, 404, 409},
        ("GET", "/probe/{job_id}/report"): {200, 404, 409},
        ("DELETE", "/probe/{job_id}"): {200, 202, 404, 409},
        ("GET", "/metrics"): {200},
    }
    assert set(expected) | {("GET", "/healthz")} == routes, "a new route: add what it answers here"
    for route, codes in expected.items():
        have = {int(c) for c in documented[route]}
        assert have >= codes | GUARDED, (route, sorted(codes | GUARDED - have))
        if route[0] != "POST":
            assert not have & {413, 415}, route
    for route, responses in documented.items():  # every error body's schema is declared
        for code, response in responses.items():
            if int(code) >= 400:
                assert "schema" in response.get("content", {}).get("application/json", {}), (route, code)
    content = {route: set(documented[route]["200"].get("content", {})) for route in expected}
    assert content[("GET", "/probe/{job_id}/records")] == {"application/x-ndjson", "application/json"}
    assert content[("GET", "/probe/{job_id}/plot.png")] == {"image/png"}
    assert content[("GET", "/probe/{job_id}/overlap.png")] == {"image/png"}
    assert content[("GET", "/metrics")] == {"text/plain"}
    assert content[("GET", "/probe/{job_id}/manifest")] == {"application/json"}
    assert content[("GET", "/probe/{job_id}/report")] == {"text/html"}
    assert documented[("GET", "/healthz")].keys() == {"200"}


def test_every_path_answers_405_with_allow_for_the_methods_it_does_not_serve(probe: tuple[str, Any]) -> None:
    """Every route path (the API's, /healthz, the schema and its viewers) x every HTTP method: a method the path
    does not serve is 405 with `Allow` naming every method it does serve (not 415 for a body, not the methods of
    one of its routes only); a served one is never 405."""
    base, app = probe
    serves: dict[str, set[str]] = {}
    for route in app.routes:
        if isinstance(route, Route) and route.methods:
            serves.setdefault(route.path, set()).update(route.methods)
    assert serves["/probe"] == {"GET", "POST"} and serves["/healthz"] == {"GET"} and len(serves) >= 10
    with httpx.Client(base_url=base, timeout=60, headers=http_headers()) as client:
        for template, methods in serves.items():
            path = template.replace("{job_id}", "no-such-job")
            for method in METHODS:
                r = client.request(method, path, headers={"content-type": "text/plain"}, content=b"x")
                if method in methods:
                    assert r.status_code != 405, (method, template)
                    continue
                assert r.status_code == 405, (method, template, r.status_code, r.text)
                assert set(r.headers["allow"].split(", ")) == methods, (method, template, r.headers["allow"])
                if method != "HEAD":  # a HEAD answer has no body
                    assert r.headers["content-type"] == "application/json" and "detail" in r.json()
        # without the token: 401 first, whatever the method (nothing about the API is said before)
        r = client.put("/metrics", headers={"authorization": "Bearer nope"})
        assert r.status_code == 401
