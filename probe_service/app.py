"""HTTP routes of the probe service. The work happens in `forkrl.probe`; admission (allowed roots, rewards)
in `probe_service.admission`; jobs in `probe_service.jobs`.

POST /probe, in order: the body is validated as `forkrl.probe.params.ProbeParams` (422 naming the field)
-> admission: paths confined to the allowed roots (400 '..', 403 outside), the core plans the job (404
missing steps or paths, 400 bad checkpoint, task, dataset or reward) -> the job is queued (429 when full).

POST   /probe                      202 + Location (or 200 + summary with ?wait=true)
GET    /probe                      all jobs
GET    /probe/{id}                 status, progress, timings, error, summary when done
GET    /probe/{id}/records         token_probe_records.jsonl (?format=json for a JSON list)
GET    /probe/{id}/manifest        manifest.json
GET    /probe/{id}/plot.png        ?checkpoint=<label>
GET    /probe/{id}/overlap.png     the entropy-pattern overlap across checkpoints
GET    /probe/{id}/report          the job's report: one self-contained HTML page (forkrl/report)
DELETE /probe/{id}                 cancel (409 once finished)
GET    /metrics                    Prometheus text
GET    /healthz                    open; every other route needs `authorization: Bearer <token>` when the
                                   service has a token (401 otherwise; forkrl/security.py)

Every route but /healthz answers only to a Host it knows (400 otherwise: allowed_hosts); a method a path does
not serve is 405 with `Allow` naming those it does; POST bodies must be `application/json` (415) of at most
max_body_bytes (413). Every error body is JSON with a `detail` (schemas.Problem). The OpenAPI schema lists each
route's statuses, content types and error bodies (tests/faults/test_fuzz_http.py checks them against what the
routes answer).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Query, Request, Response
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, PlainTextResponse
from fastapi.security import HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.routing import Match, Route, Router

from forkrl.probe.params import CAVEAT, ProbeParams
from forkrl.security import check_authorization
from probe_service.admission import RequestError, admit
from probe_service.config import ProbeSettings
from probe_service.jobs import Job, JobFinished, JobManager, JobNotFound, QueueFull
from probe_service.schemas import JobCreated, JobList, JobStatus, Problem, ValidationProblem

# Only declares the scheme in the OpenAPI schema (auto_error=False: checks nothing); RequireToken checks.
_BEARER = HTTPBearer(auto_error=False, description="The services' token (FORKRL_TOKEN): 'Bearer <token>'.")
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


# What each status means, for the OpenAPI schema (every route lists the ones it can answer; a test checks).
_STATUS = {
    400: "a malformed request: a Host this service does not answer to (allowed_hosts), '..' in a path, a bad "
         "checkpoint, task, dataset or reward, ?checkpoint= missing where the job has several",
    401: "no token or a wrong one (`authorization: Bearer <token>`)",
    403: "a path outside the service's allowed roots (symlinks followed)",
    404: "no such job, step, checkpoint, path or output",
    409: "the job is not done yet (outputs), already finished (cancel), or was cancelled (?wait=true)",
    413: "the body is larger than max_body_bytes",
    415: "the body is not `application/json`",
    422: "a field out of range or of the wrong type (names the field), or a job larger than the service's caps "
         "(max_job_samples, max_job_tokens, max_job_positions; names the setting)",
    429: "the queue is full (Retry-After)",
    500: "?wait=true: the job failed (its error)",
}


def _responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI entries of these error statuses: what each means and its JSON body."""
    return {c: {"description": _STATUS[c], "model": ValidationProblem if c == 422 else Problem} for c in codes}


def _declare_json_errors(app: FastAPI) -> None:
    """Every error answer is JSON, but FastAPI files an error response's model under the route's own media type
    (text/plain for /metrics, image/png for the plots): the schema is built as FastAPI builds it, then each error
    body is moved under application/json (FastAPI's documented way to change the schema: replace app.openapi)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            for operations in build()["paths"].values():  # build() caches the schema it returns: fixed in place
                for operation in operations.values():
                    for code, response in operation.get("responses", {}).items():
                        content = response.get("content", {})
                        if code[0] in "45" and content and "application/json" not in content:
                            response["content"] = {"application/json": next(iter(content.values()))}
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


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


def create_app(settings: ProbeSettings | None = None) -> FastAPI:
    settings = settings or ProbeSettings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        import torch
        from transformers.utils import logging as hf_logging

        torch.set_num_threads(settings.threads)
        hf_logging.disable_progress_bar()  # per-load weight bars would flood the service log
        manager.start()
        yield
        manager.shutdown()

    manager = JobManager(settings)
    app = FastAPI(
        title="forkrl probe service",
        description="Entropy-binned exact gradient statistics of RL checkpoints (algorithms.md §4).\n\n"
        f"**Caveat.** {CAVEAT}",
        version="1",
        lifespan=lifespan,
    )
    app.state.settings, app.state.manager = settings, manager
    app.add_middleware(RequestGuard, settings=settings, router=app.router)
    token = settings.auth_token()
    if token:  # added last: the outermost layer, it answers before any other reads the request
        app.add_middleware(RequireToken, token=token)

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError) -> JSONResponse:
        return JSONResponse(status_code=exc.status, content={"detail": exc.message, **exc.extra})

    # The routes that need the token (RequireToken enforces it; this router documents it in the schema).
    # Every guarded route can answer 400 (Host, RequestGuard) and, with a token, 401.
    api = APIRouter(dependencies=[Depends(_BEARER)] if token else [],
                    responses=_responses(400, *([401] if token else [])))

    def _job(job_id: str) -> Job:
        try:
            return manager.get(job_id)
        except JobNotFound:
            raise HTTPException(404, f"no job {job_id}") from None

    def _status(job: Job, request: Request) -> JobStatus:
        base = str(request.url_for("job_status", job_id=job.id))
        links = {"self": base, "records": f"{base}/records", "manifest": f"{base}/manifest", "report": f"{base}/report"}
        for c in (job.summary or {}).get("checkpoints", []):
            links[f"plot:{c['label']}"] = f"{base}/plot.png?checkpoint={c['label']}"
        if (job.summary or {}).get("entropy_pattern_overlap"):
            links["overlap"] = f"{base}/overlap.png"
        return JobStatus(**job.status_dict(), links=links, summary=job.summary if job.state == "done" else None)

    def _output(job: Job, name: str) -> Path:
        if job.state != "done":
            raise HTTPException(409, f"job {job.id} is {job.state}; outputs exist once it is done")
        path = job.out_dir / name
        if not path.is_file():
            raise HTTPException(404, f"job {job.id} has no {name}")
        return path

    @api.post(
        "/probe",
        status_code=202,
        response_model=JobCreated,
        responses={200: {"description": "?wait=true: the finished job's summary"},
                   **_responses(403, 404, 409, 413, 415, 422, 429, 500)},
    )
    def submit(
        params: ProbeParams,
        request: Request,
        response: Response,
        wait: bool = Query(False, description="Block until the job ends and return its summary (200)."),
    ):
        plan = admit(params, settings)
        try:
            job = manager.submit(plan)
        except QueueFull as exc:
            raise HTTPException(429, str(exc), headers={"Retry-After": "30"}) from None
        location = str(request.url_for("job_status", job_id=job.id))
        if wait and job.finished_event.wait(settings.wait_timeout_s):
            if job.state == "done":
                return JSONResponse(job.summary, headers={"Location": location})
            code = 409 if job.state == "cancelled" else 500
            return JSONResponse(
                {"detail": job.error or f"job {job.state}", "id": job.id}, code, headers={"Location": location}
            )
        response.headers["Location"] = location
        return JobCreated(id=job.id, state=job.state, location=location)

    @api.get("/probe", response_model=JobList)
    def list_jobs(request: Request) -> JobList:
        return JobList(jobs=[_status(j, request) for j in manager.list()])

    @api.get("/probe/{job_id}", response_model=JobStatus, name="job_status", responses=_responses(404))
    def job_status(job_id: str, request: Request) -> JobStatus:
        return _status(_job(job_id), request)

    @api.get("/probe/{job_id}/records", responses={
        200: {"description": "token_probe_records.jsonl: one JSON object a line (?format=json: a JSON list)",
              "content": {"application/x-ndjson": {"schema": {"type": "string"}},
                          "application/json": {"schema": {"type": "array", "items": {"type": "object"}}}}},
        **_responses(404, 409, 422)})
    def records(
        job_id: str, format: str = Query("jsonl", pattern="^(jsonl|json)$", description="jsonl or json (a list)")
    ):
        path = _output(_job(job_id), "token_probe_records.jsonl")
        if format == "json":
            return JSONResponse([json.loads(line) for line in path.read_text().splitlines() if line])
        return FileResponse(path, media_type="application/x-ndjson", filename=f"{job_id}-records.jsonl")

    @api.get("/probe/{job_id}/manifest", responses={
        200: {"description": "manifest.json", "content": {"application/json": {"schema": {"type": "object"}}}},
        **_responses(404, 409)})
    def manifest(job_id: str):
        return JSONResponse(json.loads(_output(_job(job_id), "manifest.json").read_text()))

    png = {"image/png": {"schema": {"type": "string", "format": "binary"}}}

    @api.get("/probe/{job_id}/plot.png", response_class=FileResponse, responses={
        200: {"description": "the checkpoint's plot", "content": png}, **_responses(404, 409, 422)})
    def plot(job_id: str, checkpoint: str | None = Query(None, description="Checkpoint label, e.g. step_000020")):
        job = _job(job_id)
        _output(job, "summary.json")
        labels = [c["label"] for c in (job.summary or {}).get("checkpoints", [])]
        if checkpoint is None:
            if len(labels) != 1:
                raise HTTPException(400, f"give ?checkpoint=, one of {labels}")
            checkpoint = labels[0]
        if checkpoint not in labels:
            raise HTTPException(404, f"no checkpoint {checkpoint!r} in job {job_id}; checkpoints: {labels}")
        return FileResponse(_output(job, f"plot_{checkpoint}.png"), media_type="image/png")

    @api.get("/probe/{job_id}/overlap.png", response_class=FileResponse, responses={
        200: {"description": "the overlap plot", "content": png}, **_responses(404, 409)})
    def overlap_plot(job_id: str):
        """The entropy-pattern overlap across the job's checkpoints (jobs with frozen bins)."""
        return FileResponse(_output(_job(job_id), "entropy_overlap.png"), media_type="image/png")

    @api.get("/probe/{job_id}/report", response_class=HTMLResponse, responses={
        200: {"description": "the job's report: one self-contained HTML page (charts inline, nothing fetched)",
              "content": {"text/html": {"schema": {"type": "string"}}}}, **_responses(404, 409)})
    def report(job_id: str):
        """Grad norm by entropy bin x correctness with the bootstrap intervals, the entropy-pattern overlap, the
        caveat, example tokens of each bin in context. Rendered by the core (forkrl/report) on the first request
        and kept in the job's directory (report.html): a finished job's files do not change."""
        from forkrl.report.probe_page import write_probe_report

        job = _job(job_id)
        _output(job, "summary.json")
        page = job.out_dir / "report.html"
        if not page.is_file():
            write_probe_report(job.out_dir, page)
        return FileResponse(page, media_type="text/html")

    @api.delete("/probe/{job_id}", response_model=JobStatus, responses={
        202: {"description": "a running job: it stops at its next check", "model": JobStatus},
        **_responses(404, 409)})
    def cancel(job_id: str, request: Request, response: Response) -> JobStatus:
        try:
            job = manager.cancel(job_id)
        except JobNotFound:
            raise HTTPException(404, f"no job {job_id}") from None
        except JobFinished as exc:
            raise HTTPException(409, str(exc)) from None
        # a queued job is cancelled at once (200); a running one stops at its next check (202)
        response.status_code = 200 if job.state == "cancelled" else 202
        return _status(job, request)

    @app.get("/healthz")
    def healthz() -> dict:
        return {"status": "ok", "jobs": manager.counts()}

    prometheus = {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}}

    @api.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"description": "Prometheus text exposition", "content": prometheus}})
    def metrics() -> Response:
        return Response(generate_latest(manager.registry), media_type=CONTENT_TYPE_LATEST)

    app.include_router(api)
    _declare_json_errors(app)
    return app
