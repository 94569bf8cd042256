"""Probe jobs: a bounded queue, worker threads, job records, cancellation. Requests are admitted (checked
and planned) before they get here, by `probe_service.admission`.

A job's outputs go to <jobs_dir>/<id>/ (the files of `forkrl.probe.job.run_probe`) plus job.json, its status,
written when the job is accepted, when it starts and when it ends. Jobs are kept in memory and reloaded from
job.json at start-up, so GET keeps working after a restart; a finished job expires job_ttl_s after it ended (a
sweeper thread, and the start-up load): it is forgotten and its directory deleted, so jobs never fill the disk.
A job that was queued or running when the process died (kill -9, a crash, a stop) is reloaded as failed, with an
error saying so: never silently lost. It is not requeued: the plan is not stored,
and the client that submitted it decides.
"""

from __future__ import annotations

import json
import logging
import queue
import shutil
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from forkrl.files import atomic_write_json
from forkrl.probe.job import ProbePlan, run_probe
from forkrl.probe.worker import ProbeCancelled
from probe_service.config import ProbeSettings

log = logging.getLogger("probe_service")

STATES = ("queued", "running", "done", "failed", "cancelled")
FINAL = frozenset({"done", "failed", "cancelled"})


class QueueFull(Exception):
    pass


class JobNotFound(KeyError):
    pass


class JobFinished(Exception):
    pass


# -------------------------------------------------------------------------------------------------- jobs


@dataclass
class Job:
    id: str
    plan: ProbePlan | None  # None for a finished job reloaded from its job.json
    out_dir: Path
    state: str = "queued"
    created_at: float = field(default_factory=time.time)
    started_at: float | None = None
    finished_at: float | None = None
    done: int = 0
    total: int = 0
    stage: str = "queued"
    error: str | None = None
    summary: dict | None = None
    cancel_event: threading.Event = field(default_factory=threading.Event)
    finished_event: threading.Event = field(default_factory=threading.Event)

    def status_dict(self) -> dict[str, Any]:
        now = time.time()
        run_end = self.finished_at or now
        return {
            "id": self.id,
            "state": self.state,
            "cancel_requested": self.cancel_event.is_set(),
            "progress": {"done": self.done, "total": self.total, "stage": self.stage},
            "timings": {
                "created_at": self.created_at,
                "started_at": self.started_at,
                "finished_at": self.finished_at,
                "queued_s": ((self.started_at or self.finished_at or now) - self.created_at),
                "run_s": (run_end - self.started_at) if self.started_at else None,
            },
            "error": self.error,
        }


class _StateCollector:
    """probe_jobs{state=...}: computed at scrape time from the job table."""

    def __init__(self, manager: JobManager):
        self.manager = manager

    def collect(self):
        g = GaugeMetricFamily("probe_jobs", "Probe jobs by state", labels=["state"])
        counts = self.manager.counts()
        for s in STATES:
            g.add_metric([s], counts.get(s, 0))
        yield g


class JobManager:
    def __init__(self, settings: ProbeSettings):
        self.settings = settings
        self.jobs_dir = Path(settings.jobs_dir).resolve()
        self.jobs_dir.mkdir(parents=True, exist_ok=True)
        self._jobs: dict[str, Job] = {}
        self._lock = threading.Lock()
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._workers: list[threading.Thread] = []
        self._stopping = threading.Event()
        self.registry = CollectorRegistry()
        self.registry.register(_StateCollector(self))
        self.m_records = Counter("probe_records", "Token probe records computed", registry=self.registry)
        self.m_submitted = Counter("probe_jobs_submitted", "Jobs accepted", registry=self.registry)
        self.m_rejected = Counter("probe_jobs_rejected", "Jobs refused (queue full)", registry=self.registry)
        self.m_seconds = Histogram(
            "probe_job_seconds",
            "Run time of finished jobs",
            ["state"],
            registry=self.registry,
            buckets=(1, 5, 15, 30, 60, 120, 300, 900, 1800, 3600, 7200),
        )
        self._load_finished()

    # ---- lifecycle
    def start(self) -> None:
        for i in range(self.settings.max_concurrent_jobs):
            t = threading.Thread(target=self._worker, name=f"probe-worker-{i}", daemon=True)
            t.start()
            self._workers.append(t)
        sweeper = threading.Thread(target=self._sweep, name="probe-job-ttl", daemon=True)
        sweeper.start()
        self._workers.append(sweeper)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self._stopping.set()
        with self._lock:
            for job in self._jobs.values():
                if job.state not in FINAL:
                    job.cancel_event.set()
        for _ in range(self.settings.max_concurrent_jobs):
            self._queue.put(None)
        for t in self._workers:
            t.join(timeout_s)
        self._workers.clear()

    # ---- API
    def counts(self) -> dict[str, int]:
        with self._lock:
            out: dict[str, int] = {}
            for j in self._jobs.values():
                out[j.state] = out.get(j.state, 0) + 1
            return out

    def submit(self, plan: ProbePlan) -> Job:
        with self._lock:
            active = sum(j.state in ("queued", "running") for j in self._jobs.values())
            if active >= self.settings.max_concurrent_jobs + self.settings.max_queued_jobs:
                self.m_rejected.inc()
                raise QueueFull(
                    f"{active} jobs are queued or running (limit {self.settings.max_concurrent_jobs} running + "
                    f"{self.settings.max_queued_jobs} queued); retry later"
                )
            job_id = uuid.uuid4().hex[:16]
            job = Job(id=job_id, plan=plan, out_dir=self.jobs_dir / job_id)
            self._jobs[job_id] = job
            self.m_submitted.inc()
            self._persist(job)  # before it is answered 202: a restart finds it
        self._queue.put(job)
        return job

    def get(self, job_id: str) -> Job:
        with self._lock:
            job = self._jobs.get(job_id)
        if job is None:
            raise JobNotFound(job_id)
        return job

    def list(self) -> list[Job]:
        with self._lock:
            return sorted(self._jobs.values(), key=lambda j: j.created_at)

    def cancel(self, job_id: str) -> Job:
        job = self.get(job_id)
        with self._lock:
            if job.state in FINAL:
                raise JobFinished(f"job {job_id} is already {job.state}")
            job.cancel_event.set()
            if job.state == "queued":  # never started: final right away
                self._finish(job, "cancelled", stage="cancelled before it started")
        return job

    def expire(self, now: float | None = None) -> list[str]:
        """Forget the finished jobs that ended more than job_ttl_s ago and delete their directories; returns their
        ids."""
        now = time.time() if now is None else now
        with self._lock:
            old = [j for j in self._jobs.values()
                   if j.state in FINAL and now - (j.finished_at or j.created_at) > self.settings.job_ttl_s]
            for j in old:
                del self._jobs[j.id]
        for j in old:
            if j.out_dir.parent == self.jobs_dir:  # only a job directory of ours
                shutil.rmtree(j.out_dir, ignore_errors=True)
            log.info("probe job %s expired (job_ttl_s %g): removed", j.id, self.settings.job_ttl_s)
        return [j.id for j in old]

    # ---- internals
    def _sweep(self) -> None:
        every = min(60.0, max(self.settings.job_ttl_s / 4, 0.05))
        while not self._stopping.wait(every):
            try:
                self.expire()
            except Exception:  # a sweep that failed is retried at the next; the service keeps running
                log.exception("expiring probe jobs failed")

    def _worker(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            with self._lock:
                if job.state != "queued":  # cancelled while waiting
                    continue
                job.state, job.started_at, job.stage = "running", time.time(), "starting"
                self._persist(job)
            self._run(job)

    def _run(self, job: Job) -> None:
        def progress(done: int, total: int, stage: str) -> None:
            job.done, job.total = done, total
            if stage:
                job.stage = stage

        try:
            summary = run_probe(
                job.plan, job.out_dir, device=self.settings.device, progress=progress,
                should_cancel=job.cancel_event.is_set,
            )  # fmt: skip
        except ProbeCancelled:
            with self._lock:
                self._finish(job, "cancelled", stage="cancelled")
        except Exception as exc:  # the job's failure, reported in its status; the service keeps running
            log.exception("probe job %s failed", job.id)
            with self._lock:
                self._finish(job, "failed", stage="failed", error=f"{type(exc).__name__}: {exc}")
        else:
            self.m_records.inc(summary.get("n_records", 0))
            with self._lock:
                job.summary = summary
                self._finish(job, "done", stage="done")

    def _finish(self, job: Job, state: str, stage: str, error: str | None = None) -> None:
        """Caller holds the lock."""
        job.state, job.stage, job.error, job.finished_at = state, stage, error, time.time()
        if job.started_at is not None:
            self.m_seconds.labels(state).observe(job.finished_at - job.started_at)
        self._persist(job)
        job.finished_event.set()

    @staticmethod
    def _persist(job: Job) -> None:
        try:
            job.out_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_json(job.out_dir / "job.json", job.status_dict())
        except OSError:
            log.exception("cannot write job.json for %s", job.id)

    def _load_finished(self) -> None:
        for f in sorted(self.jobs_dir.glob("*/job.json")):
            try:
                d = json.loads(f.read_text())
                job = Job(
                    id=d["id"],
                    plan=None,
                    out_dir=f.parent,
                    state=d["state"],
                    created_at=d["timings"]["created_at"],
                    started_at=d["timings"]["started_at"],
                    finished_at=d["timings"]["finished_at"],
                    done=d["progress"]["done"],
                    total=d["progress"]["total"],
                    stage=d["progress"]["stage"],
                    error=d.get("error"),
                )
                if job.state == "done" and (f.parent / "summary.json").is_file():
                    job.summary = json.loads((f.parent / "summary.json").read_text())
                if job.state not in FINAL:  # the process died with it queued or running
                    was = job.state
                    job.state, job.stage, job.finished_at = "failed", "interrupted", time.time()
                    job.error = (f"interrupted: the probe service stopped while the job was {was} (at "
                                 f"{job.done}/{job.total}); it was not requeued, submit it again")
                    self._persist(job)
                job.finished_event.set()
                self._jobs[job.id] = job
            except (OSError, ValueError, KeyError, TypeError):
                log.warning("ignoring unreadable %s", f)
        self.expire()
