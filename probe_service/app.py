"""The probe service's FastAPI app: `create_app` wires the settings, the job manager, the middleware and the
routers; the routes are in `routes/` (jobs, outputs, ops), their dependencies in `deps.py`, the middleware in
`middleware.py`. The work happens in `forkrl.probe`; admission (allowed roots, rewards) in
`probe_service.admission`; jobs in `probe_service.job_manager`.

POST   /probe                      202 + Location (or 200 + summary with ?wait=true)   routes/jobs.py
GET    /probe                      all jobs
GET    /probe/{id}                 status, progress, timings, error, summary when done
DELETE /probe/{id}                 cancel (409 once finished)
GET    /probe/{id}/records         token_probe_records.jsonl (?format=json for a JSON list)   routes/outputs.py
GET    /probe/{id}/manifest        manifest.json
GET    /probe/{id}/plot.png        ?checkpoint=<label>
GET    /probe/{id}/overlap.png     the entropy-pattern overlap across checkpoints
GET    /probe/{id}/report          the job's report: one self-contained HTML page (forkrl/report)
GET    /metrics                    Prometheus text                                      routes/ops.py
GET    /healthz                    open; every other route needs `authorization: Bearer <token>` when the
                                   service has a token (401 otherwise; forkrl/security.py)

Every route but /healthz answers only to a Host it knows (400 otherwise: allowed_hosts); a method a path does
not serve is 405 with `Allow` naming those it does; POST bodies must be `application/json` (415) of at most
max_body_bytes (413). Every error body is JSON with a `detail` (schemas.Problem). The OpenAPI schema lists each
route's statuses, content types and error bodies (tests/faults/test_fuzz_http.py checks them against what the
routes answer).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from forkrl.probe.params import CAVEAT
from probe_service.admission import RequestError
from probe_service.config import ProbeSettings
from probe_service.deps import token_dependencies
from probe_service.job_manager import JobManager
from probe_service.middleware import RequestGuard, RequireToken
from probe_service.openapi import declare_json_errors, error_responses
from probe_service.routes import jobs, ops, outputs


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    import torch
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(app.state.settings.threads)
    hf_logging.disable_progress_bar()  # per-load weight bars would flood the service log
    app.state.manager.start()
    yield
    app.state.manager.shutdown()


async def _request_error(request: Request, exc: RequestError) -> JSONResponse:
    return JSONResponse(status_code=exc.status, content={"detail": exc.message, **exc.extra})


def create_app(settings: ProbeSettings | None = None) -> FastAPI:
    settings = settings or ProbeSettings()
    app = FastAPI(
        title="forkrl probe service",
        description="Entropy-binned exact gradient statistics of RL checkpoints (algorithms.md §4).\n\n"
        f"**Caveat.** {CAVEAT}",
        version="1",
        lifespan=_lifespan,
    )
    app.state.settings, app.state.manager = settings, JobManager(settings)
    app.add_middleware(RequestGuard, settings=settings, router=app.router)
    token = settings.auth_token()
    if token:  # added last: the outermost layer, it answers before any other reads the request
        app.add_middleware(RequireToken, token=token)
    app.add_exception_handler(RequestError, _request_error)

    app.include_router(ops.open_router)
    # The routes that need the token (RequireToken enforces it; the dependency documents it in the schema).
    # Every guarded route can answer 400 (Host, RequestGuard) and, with a token, 401.
    guarded = {"dependencies": token_dependencies(token), "responses": error_responses(400, *([401] if token else []))}
    for router in (jobs.router, outputs.router, ops.router):
        app.include_router(router, **guarded)
    declare_json_errors(app)
    return app
