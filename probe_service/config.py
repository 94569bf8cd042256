"""Probe service settings: flags, PROBE_* environment variables, defaults (in that order of priority).

List settings take comma-separated values in flags and in the environment:
    PROBE_ALLOWED_ROOTS=runs,models python -m probe_service
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Annotated

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


class ProbeSettings(BaseSettings):
    """Settings of one probe service process."""

    model_config = SettingsConfigDict(env_prefix="PROBE_")

    host: str = Field(default="127.0.0.1", description="Address to bind (loopback by default).")
    port: int = Field(default=8000, ge=0, le=65535, description="HTTP port.")
    allowed_roots: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["runs", "models"],
        description="Directories the service may read checkpoints and datasets from (comma-separated). Every "
        "requested path must resolve, symlinks followed, inside one of them.",
    )
    jobs_dir: str = Field(default="probe_jobs", description="Where each job's output directory is created.")
    max_concurrent_jobs: int = Field(default=1, ge=1, le=64, description="Jobs that run at the same time.")
    max_queued_jobs: int = Field(
        default=4, ge=0, le=10_000, description="Jobs that may wait for a free worker; beyond that POST gets 429."
    )
    threads: int = Field(default=1, ge=1, le=256, description="torch threads for sampling and gradients.")
    device: str = Field(default="auto", description="torch device for jobs: auto (cuda if present), cpu, cuda.")
    wait_timeout_s: float = Field(
        default=3600.0, gt=0, description="Longest time POST /probe?wait=true blocks before answering 202."
    )
    allow_custom_rewards: bool = Field(
        default=False,
        description="Accept reward='package.module:function' in requests (imports and runs that code).",
    )
    log_level: str = Field(default="info", description="uvicorn log level.")

    @field_validator("allowed_roots", mode="before")
    @classmethod
    def _split_roots(cls, v: object) -> object:
        if isinstance(v, str):
            return [p.strip() for p in v.split(",") if p.strip()]
        return v

    @field_validator("allowed_roots")
    @classmethod
    def _non_empty(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("allowed_roots must name at least one directory")
        return v

    def resolved_roots(self) -> list[Path]:
        return [Path(r).expanduser().resolve() for r in self.allowed_roots]


def parse_settings(argv: list[str] | None = None) -> ProbeSettings:
    parser = argparse.ArgumentParser(
        prog="python -m probe_service",
        description="HTTP probe service: entropy-binned gradient statistics of RL checkpoints (POST /probe).",
    )
    for name, field in ProbeSettings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        env = f"PROBE_{name.upper()}"
        default = field.default_factory() if field.default_factory else field.default
        if field.annotation is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=field.description)
            continue
        kind = {int: int, float: float}.get(field.annotation, str)
        parser.add_argument(flag, type=kind, default=None, help=f"{field.description} (default: {default}; env {env})")
    args = parser.parse_args(argv)
    return ProbeSettings(**{k: v for k, v in vars(args).items() if v is not None})
