"""A done job's outputs: records, manifest, plots and the HTML report (409 before the job is done, 404 for an
output it does not have)."""

from __future__ import annotations

import json
from pathlib import Path

from fastapi import APIRouter, HTTPException, Query
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse

from probe_service.deps import ManagerDep, find_job
from probe_service.job_manager import Job
from probe_service.openapi import error_responses

router = APIRouter()
_PNG = {"image/png": {"schema": {"type": "string", "format": "binary"}}}


def output_path(job: Job, name: str) -> Path:
    """The path of the done job's output `name`; 409 while the job is not done, 404 when it has none."""
    if job.state != "done":
        raise HTTPException(409, f"job {job.id} is {job.state}; outputs exist once it is done")
    path = job.out_dir / name
    if not path.is_file():
        raise HTTPException(404, f"job {job.id} has no {name}")
    return path


@router.get("/probe/{job_id}/records", responses={
    200: {"description": "token_probe_records.jsonl: one JSON object a line (?format=json: a JSON list)",
          "content": {"application/x-ndjson": {"schema": {"type": "string"}},
                      "application/json": {"schema": {"type": "array", "items": {"type": "object"}}}}},
    **error_responses(404, 409, 422)})
def records(
    job_id: str,
    manager: ManagerDep,
    format: str = Query("jsonl", pattern="^(jsonl|json)$", description="jsonl or json (a list)"),
):
    path = output_path(find_job(manager, job_id), "token_probe_records.jsonl")
    if format == "json":
        return JSONResponse([json.loads(line) for line in path.read_text().splitlines() if line])
    return FileResponse(path, media_type="application/x-ndjson", filename=f"{job_id}-records.jsonl")


@router.get("/probe/{job_id}/manifest", responses={
    200: {"description": "manifest.json", "content": {"application/json": {"schema": {"type": "object"}}}},
    **error_responses(404, 409)})
def manifest(job_id: str, manager: ManagerDep):
    return JSONResponse(json.loads(output_path(find_job(manager, job_id), "manifest.json").read_text()))


@router.get("/probe/{job_id}/plot.png", response_class=FileResponse, responses={
    200: {"description": "the checkpoint's plot", "content": _PNG}, **error_responses(404, 409, 422)})
def plot(job_id: str, manager: ManagerDep,
         checkpoint: str | None = Query(None, description="Checkpoint label, e.g. step_000020")):
    job = find_job(manager, job_id)
    output_path(job, "summary.json")
    labels = [c["label"] for c in (job.summary or {}).get("checkpoints", [])]
    if checkpoint is None:
        if len(labels) != 1:
            raise HTTPException(400, f"give ?checkpoint=, one of {labels}")
        checkpoint = labels[0]
    if checkpoint not in labels:
        raise HTTPException(404, f"no checkpoint {checkpoint!r} in job {job_id}; checkpoints: {labels}")
    return FileResponse(output_path(job, f"plot_{checkpoint}.png"), media_type="image/png")


@router.get("/probe/{job_id}/overlap.png", response_class=FileResponse, responses={
    200: {"description": "the overlap plot", "content": _PNG}, **error_responses(404, 409)})
def overlap_plot(job_id: str, manager: ManagerDep):
    """The entropy-pattern overlap across the job's checkpoints (jobs with frozen bins)."""
    return FileResponse(output_path(find_job(manager, job_id), "entropy_overlap.png"), media_type="image/png")


@router.get("/probe/{job_id}/report", response_class=HTMLResponse, responses={
    200: {"description": "the job's report: one self-contained HTML page (charts inline, nothing fetched)",
          "content": {"text/html": {"schema": {"type": "string"}}}}, **error_responses(404, 409)})
def report(job_id: str, manager: ManagerDep):
    """Grad norm by entropy bin x correctness with the bootstrap intervals, the entropy-pattern overlap, the
    caveat, example tokens of each bin in context. Rendered by the core (forkrl/report) on the first request
    and kept in the job's directory (report.html): a finished job's files do not change."""
    from forkrl.report.probe_page import write_probe_report

    job = find_job(manager, job_id)
    output_path(job, "summary.json")
    page = job.out_dir / "report.html"
    if not page.is_file():
        write_probe_report(job.out_dir, page)
    return FileResponse(page, media_type="text/html")
