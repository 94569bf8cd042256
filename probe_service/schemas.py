"""Response models of the probe API. The request body is the core's `forkrl.probe.params.ProbeParams` as it
is: every field carries its description and range there, so /docs documents it and an out-of-range value
is a 422 whose `loc` names the field."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field


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
