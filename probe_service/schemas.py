"""Response models of the probe API. The request body is the core's `forkrl.probe.params.ProbeParams` as it
is: every field carries its description and range there, so /docs documents it and an out-of-range value
is a 422 whose `loc` names the field. Every error answer's body is a `Problem` (`ValidationProblem` for 422)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class Problem(BaseModel):
    """The body of every error answer: what is wrong, in words. Some add fields: 404 for missing checkpoint
    steps (missing_steps, available_steps, has_final), 409/500 of ?wait=true (id: the job)."""

    model_config = ConfigDict(extra="allow")

    detail: str = Field(description="What is wrong; names the field, path, setting or limit.")


class ValidationIssue(BaseModel):
    """One problem of a request that does not fit the schema (FastAPI's validation error item)."""

    model_config = ConfigDict(extra="allow")

    loc: list[str | int] = Field(description="Where: ['body', field, ...] or ['query', name] or ['path', name].")
    msg: str = Field(description="What is wrong with it.")
    type: str = Field(description="The kind of error.")


class ValidationProblem(BaseModel):
    """A 422 body: the fields that do not fit the schema (a list), or a job over the service's caps (words, and
    the setting that raises the cap in `limit`)."""

    model_config = ConfigDict(extra="allow")

    detail: str | list[ValidationIssue] = Field(description="The problems, or what exceeds which cap.")
    limit: str | None = Field(default=None, description="The cap exceeded (max_job_samples, ...).")


class Progress(BaseModel):
    done: int = Field(description="Work units finished (sampling, entropy pass, one per probed position).")
    total: int = Field(description="Work units planned; refined once positions are selected.")
    stage: str = Field(description="What the job is doing now.")


class Timings(BaseModel):
    created_at: float = Field(description="Unix time the job was accepted.")
    started_at: float | None = Field(default=None, description="Unix time a worker started it.")
    finished_at: float | None = Field(default=None, description="Unix time it ended (any final state).")
    queued_s: float | None = Field(default=None, description="Seconds spent waiting for a worker.")
    run_s: float | None = Field(default=None, description="Seconds spent running (so far, while running).")


JobStateName = Literal["queued", "running", "done", "failed", "cancelled"]


class JobStatus(BaseModel):
    id: str = Field(description="Job id.")
    state: JobStateName = Field(description="queued, running, done, failed or cancelled.")
    cancel_requested: bool = Field(description="DELETE was called; the job stops at its next check.")
    progress: Progress
    timings: Timings
    error: str | None = Field(default=None, description="Why the job failed.")
    links: dict[str, str] = Field(description="URLs of the job's outputs (valid once it is done).")
    summary: dict[str, Any] | None = Field(default=None, description="summary.json, once done.")


class JobCreated(BaseModel):
    id: str = Field(description="Job id.")
    state: JobStateName
    location: str = Field(description="Poll this URL for status (also in the Location header).")


class JobList(BaseModel):
    jobs: list[JobStatus]
