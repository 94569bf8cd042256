"""The routes' dependencies: the service's settings and job manager (set on `app.state` by `create_app`), a job
by id (404 otherwise), and the token's declaration in the OpenAPI schema.

    def job_status(job_id: str, request: Request, manager: ManagerDep) -> JobStatus: ...
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPBearer

from probe_service.config import ProbeSettings
from probe_service.job_manager import Job, JobManager, JobNotFound

# Only declares the scheme in the OpenAPI schema (auto_error=False: checks nothing); middleware.RequireToken
# checks, before any route (or this) reads the request.
BEARER = HTTPBearer(auto_error=False, description="The services' token (FORKRL_TOKEN): 'Bearer <token>'.")


def token_dependencies(token: str | None) -> list[Any]:
    """The dependencies of the routes that need the token: the scheme, when the service has a token."""
    return [Depends(BEARER)] if token else []


def get_settings(request: Request) -> ProbeSettings:
    return request.app.state.settings


def get_manager(request: Request) -> JobManager:
    return request.app.state.manager


SettingsDep = Annotated[ProbeSettings, Depends(get_settings)]
ManagerDep = Annotated[JobManager, Depends(get_manager)]


def find_job(manager: JobManager, job_id: str) -> Job:
    """The job `job_id`; 404 when there is none."""
    try:
        return manager.get(job_id)
    except JobNotFound:
        raise HTTPException(404, f"no job {job_id}") from None
