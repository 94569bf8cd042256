"""Settings of the probe service: CLI flags (kebab-case, 1:1 with the fields) over `PROBE_*` variables.

    python -m probe_service --port 8000 --allowed-roots runs,models
    PROBE_ALLOWED_ROOTS=runs,models PROBE_DEVICE=cuda python -m probe_service

List settings take comma-separated values, in flags and in the environment. Imports nothing heavy: `--help`
must stay instant.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import Field, field_validator
from pydantic_settings import NoDecode, SettingsConfigDict

from forkrl.cli import TokenSettings


class ProbeSettings(TokenSettings):
    """HTTP probe service: entropy-binned gradient statistics of RL checkpoints (POST /probe)."""

    model_config = SettingsConfigDict(env_prefix="PROBE_", cli_prog_name="python -m probe_service")

    host: str = "127.0.0.1"
    """Address to bind (loopback by default; any other address needs a token, or the service refuses to
    start)."""
    port: int = Field(8000, ge=0, le=65535)
    """HTTP port."""
    allowed_roots: Annotated[list[str], NoDecode] = ["runs", "models"]
    """Directories the service may read checkpoints and datasets from (comma-separated). Every requested path
    must resolve, symlinks followed, inside one of them."""
    jobs_dir: str = "probe_jobs"
    """Where each job's output directory is created."""
    max_concurrent_jobs: int = Field(1, ge=1, le=64)
    """Jobs that run at the same time (in worker threads of this process). Their vLLM sampling (the sampler
    'auto' and 'vllm') takes turns: one in-process engine at a time per process (forkrl/probe/engines.py)."""
    max_queued_jobs: int = Field(4, ge=0, le=10_000)
    """Jobs that may wait for a free worker; beyond that POST gets 429."""
    threads: int = Field(1, ge=1, le=256)
    """torch threads for sampling and gradients (kept after a vLLM engine: forkrl/probe/engines.py)."""
    device: str = "auto"
    """torch device for jobs: auto (cuda if present), cpu, cuda."""
    job_ttl_s: float = Field(7 * 86400.0, gt=0)
    """Seconds a finished job (done, failed, cancelled) is kept after it ended: then it is forgotten (GET: 404)
    and its output directory under jobs_dir is deleted (default 7 days). Checked about every min(60, ttl/4) s
    and at start-up, so a restart also removes expired jobs."""
    wait_timeout_s: float = Field(3600.0, gt=0)
    """Longest time POST /probe?wait=true blocks before answering 202."""
    allow_custom_rewards: bool = False
    """Accept reward='package.module:function' in requests (imports and runs that code)."""
    rollout_addresses: Annotated[list[str], NoDecode] = ["127.0.0.1:50051"]
    """The rollout services a job with sampler 'rollout' may use (comma-separated host:port; host:* allows any
    port of that host; the trainer's rule, forkrl/training/rules.py). The job sends this service's token and its
    prompts there, so any other rollout_address is refused (400)."""
    max_job_samples: int = Field(8192, ge=1)
    """Largest checkpoints x num_prompts x num_samples one job may sample (POST /probe: 422 beyond)."""
    max_job_tokens: int = Field(1 << 24, ge=1)
    """Largest checkpoints x num_prompts x num_samples x max_new_tokens (resolved) one job may generate."""
    max_job_positions: int = Field(200_000, ge=1)
    """Largest checkpoints x entropy_bins x 2 x max_positions_per_group (gradient positions) of one job."""
    max_body_bytes: int = Field(1 << 20, ge=1024)
    """Largest request body in bytes (413 beyond)."""
    allowed_hosts: Annotated[list[str], NoDecode] = []
    """Host header values (without port) the API answers besides localhost, 127.0.0.1, ::1 and the bound
    host (comma-separated; '*' = any). Others get 400: a web page cannot reach the API through a DNS name
    of its own that resolves to this machine (DNS rebinding). Set it to the names clients use when the
    service is reached by a DNS name or on 0.0.0.0."""
    log_level: str = "info"
    """uvicorn log level."""

    @field_validator("allowed_roots", "allowed_hosts", "rollout_addresses", mode="before")
    @classmethod
    def _split_roots(cls, v: object) -> object:
        # PROBE_ALLOWED_ROOTS=a,b arrives as one string (NoDecode: not JSON); the CLI splits commas itself
        if isinstance(v, str):
            return [p.strip() for p in v.split(",") if p.strip()]
        return v

    @field_validator("allowed_roots")
    @classmethod
    def _non_empty(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("allowed_roots must name at least one directory")
        return v

    def host_names(self) -> frozenset[str] | None:
        """Host header names the API answers (lower case, no port); None = any ('*')."""
        extra = {h.strip().lower().strip("[]") for h in self.allowed_hosts if h.strip()}
        if "*" in extra:
            return None
        bound = self.host.lower().strip("[]")
        bound = {bound} - {"0.0.0.0", "::", ""}  # a wildcard bind is no name a client uses
        return frozenset({"localhost", "127.0.0.1", "::1", *bound, *extra})

    def resolved_roots(self) -> list[Path]:
        return [Path(r).expanduser().resolve() for r in self.allowed_roots]
