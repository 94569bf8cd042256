"""Probe jobs: submit (POST /probe), list, status, cancel.

POST /probe, in order: the body is validated as `forkrl.probe.params.ProbeParams` (422 naming the field)
-> admission: paths confined to the allowed roots (400 '..', 403 outside), the core plans the job (404
missing steps or paths, 400 bad checkpoint, task, dataset or reward) -> the job is queued (429 when full).
"""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Query, Request, Response
from fastapi.responses import JSONResponse

from forkrl.probe.params import ProbeParams
from probe_service.admission import admit
from probe_service.deps import ManagerDep, SettingsDep, find_job
from probe_service.job_manager import Job, JobFinished, JobNotFound, QueueFull
from probe_service.openapi import error_responses
from probe_service.schemas import JobCreated, JobList, JobStatus

router = APIRouter()


def job_status_of(job: Job, request: Request) -> JobStatus:
    """The job's status with the links to its outputs (and its summary once done)."""
    base = str(request.url_for("job_status", job_id=job.id))
    links = {"self": base, "records": f"{base}/records", "manifest": f"{base}/manifest", "report": f"{base}/report"}
    for c in (job.summary or {}).get("checkpoints", []):
        links[f"plot:{c['label']}"] = f"{base}/plot.png?checkpoint={c['label']}"
    if (job.summary or {}).get("entropy_pattern_overlap"):
        links["overlap"] = f"{base}/overlap.png"
    return JobStatus(**job.status_dict(), links=links, summary=job.summary if job.state == "done" else None)


@router.post(
    "/probe",
    status_code=202,
    response_model=JobCreated,
    responses={200: {"description": "?wait=true: the finished job's summary"},
               **error_responses(403, 404, 409, 413, 415, 422, 429, 500)},
)
def submit(
    params: ProbeParams,
    request: Request,
    response: Response,
    settings: SettingsDep,
    manager: ManagerDep,
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


@router.get("/probe", response_model=JobList)
def list_jobs(request: Request, manager: ManagerDep) -> JobList:
    return JobList(jobs=[job_status_of(j, request) for j in manager.list()])


@router.get("/probe/{job_id}", response_model=JobStatus, name="job_status", responses=error_responses(404))
def job_status(job_id: str, request: Request, manager: ManagerDep) -> JobStatus:
    return job_status_of(find_job(manager, job_id), request)


@router.delete("/probe/{job_id}", response_model=JobStatus, responses={
    202: {"description": "a running job: it stops at its next check", "model": JobStatus},
    **error_responses(404, 409)})
def cancel(job_id: str, request: Request, response: Response, manager: ManagerDep) -> JobStatus:
    try:
        job = manager.cancel(job_id)
    except JobNotFound:
        raise HTTPException(404, f"no job {job_id}") from None
    except JobFinished as exc:
        raise HTTPException(409, str(exc)) from None
    # a queued job is cancelled at once (200); a running one stops at its next check (202)
    response.status_code = 200 if job.state == "cancelled" else 202
    return job_status_of(job, request)
