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
DELETE /probe/{id}                 cancel (409 once finished)
GET    /metrics                    Prometheus text
GET    /healthz                    open; every other route needs `authorization: Bearer <token>` when the
                                   service has a token (401 otherwise; forkrl/security.py)
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Query, Request, Response
from fastapi.responses import FileResponse, JSONResponse
from fastapi.security import HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from forkrl.probe.params import CAVEAT, ProbeParams
from forkrl.security import check_authorization
from probe_service.admission import RequestError, admit
from probe_service.config import ProbeSettings
from probe_service.jobs import Job, JobFinished, JobManager, JobNotFound, QueueFull
from probe_service.schemas import JobCreated, JobList, JobStatus

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


class JsonBodyByDefault:
    """`curl -X POST URL -d '{...}'` labels its body application/x-www-form-urlencoded. JSON is the only
    body this API takes, so a POST without a JSON content type is read as JSON (one curl, no -H needed)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            ctype = dict(scope["headers"]).get(b"content-type", b"")
            if not ctype.startswith(b"application/json"):
                scope = dict(scope, headers=[*headers, (b"content-type", b"application/json")])
        await self.app(scope, receive, send)


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
    app.add_middleware(JsonBodyByDefault)
    token = settings.auth_token()
    if token:  # added last: the outermost layer, it answers before any other reads the request
        app.add_middleware(RequireToken, token=token)

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError) -> JSONResponse:
        return JSONResponse(status_code=exc.status, content={"detail": exc.message, **exc.extra})

    # The routes that need the token (RequireToken enforces it; this router documents it in the schema).
    api = APIRouter(dependencies=[Depends(_BEARER)] if token else [],
                    responses={401: {"description": "no token or a wrong one"}} if token else None)

    def _job(job_id: str) -> Job:
        try:
            return manager.get(job_id)
        except JobNotFound:
            raise HTTPException(404, f"no job {job_id}") from None

    def _status(job: Job, request: Request) -> JobStatus:
        base = str(request.url_for("job_status", job_id=job.id))
        links = {"self": base, "records": f"{base}/records", "manifest": f"{base}/manifest"}
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
        responses={200: {"description": "?wait=true: the finished job's summary"}, 429: {"description": "full"}},
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

    @api.get("/probe/{job_id}", response_model=JobStatus, name="job_status")
    def job_status(job_id: str, request: Request) -> JobStatus:
        return _status(_job(job_id), request)

    @api.get("/probe/{job_id}/records")
    def records(
        job_id: str, format: str = Query("jsonl", pattern="^(jsonl|json)$", description="jsonl or json (a list)")
    ):
        path = _output(_job(job_id), "token_probe_records.jsonl")
        if format == "json":
            return JSONResponse([json.loads(line) for line in path.read_text().splitlines() if line])
        return FileResponse(path, media_type="application/x-ndjson", filename=f"{job_id}-records.jsonl")

    @api.get("/probe/{job_id}/manifest")
    def manifest(job_id: str):
        return JSONResponse(json.loads(_output(_job(job_id), "manifest.json").read_text()))

    @api.get("/probe/{job_id}/plot.png", response_class=FileResponse)
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

    @api.get("/probe/{job_id}/overlap.png", response_class=FileResponse)
    def overlap_plot(job_id: str):
        """The entropy-pattern overlap across the job's checkpoints (jobs with frozen bins)."""
        return FileResponse(_output(_job(job_id), "entropy_overlap.png"), media_type="image/png")

    @api.delete("/probe/{job_id}", response_model=JobStatus)
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

    @api.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(manager.registry), media_type=CONTENT_TYPE_LATEST)

    app.include_router(api)
    return app
