"""Settings of the trainer service: CLI flags (kebab-case, 1:1 with the fields) over `TRAINER_*` variables.

    python -m trainer_service --port 50052 --runs-root runs
    TRAINER_DEVICE=cuda python -m trainer_service --no-tensorboard

Imports nothing heavy: `--help` must stay instant.
"""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from forkrl.cli import TokenSettings


class TrainerSettings(TokenSettings):
    """gRPC trainer service: owns RL runs (StartRun, WatchRun, GetRun, StopRun)."""

    model_config = SettingsConfigDict(env_prefix="TRAINER_", cli_prog_name="python -m trainer_service")

    host: str = "127.0.0.1"
    """Address to bind (loopback by default; any other address needs a token, or the service refuses to
    start)."""
    port: int = Field(50052, ge=0, le=65535)
    """gRPC port (0 = pick a free one and print it)."""
    runs_root: str = "runs"
    """Where runs without an explicit run_dir are written."""
    threads: int = Field(1, ge=1)
    """torch threads for the training forward/backward."""
    device: str = "auto"
    """torch device for training: auto (cuda if present), cpu, cuda."""
    grace_s: float = Field(10.0, ge=0)
    """SIGTERM: seconds to let in-flight RPCs finish."""
    tensorboard: bool = True
    """Also write TensorBoard event files into the run dir."""
