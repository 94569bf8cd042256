"""Trainer service settings: flags, TRAINER_* environment variables, defaults (in that order of priority)."""

from __future__ import annotations

import argparse

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class TrainerSettings(BaseSettings):
    """Settings of one trainer service process."""

    model_config = SettingsConfigDict(env_prefix="TRAINER_")

    host: str = Field(default="127.0.0.1", description="Address to bind (loopback by default).")
    port: int = Field(default=50052, ge=0, le=65535, description="gRPC port (0 = pick a free one and print it).")
    runs_root: str = Field(default="runs", description="Where runs without an explicit run_dir are written.")
    threads: int = Field(default=1, ge=1, description="torch threads for the training forward/backward.")
    device: str = Field(default="auto", description="torch device for training: auto (cuda if present), cpu, cuda.")
    grace_s: float = Field(default=10.0, ge=0, description="SIGTERM: seconds to let in-flight RPCs finish.")
    tensorboard: bool = Field(default=True, description="Also write TensorBoard event files into the run dir.")


def parse_settings(argv: list[str] | None = None) -> TrainerSettings:
    parser = argparse.ArgumentParser(
        prog="python -m trainer_service",
        description="gRPC trainer service: owns RL runs (StartRun, WatchRun, GetRun, StopRun).",
    )
    for name, field in TrainerSettings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        if field.annotation is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=field.description)
        else:
            parser.add_argument(flag, type=field.annotation, default=None,
                                help=f"{field.description} (default: {field.default}; env TRAINER_{name.upper()})")
    args = parser.parse_args(argv)
    overrides = {k: v for k, v in vars(args).items() if v is not None}
    return TrainerSettings(**overrides)
