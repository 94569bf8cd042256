"""Settings of the trainer service: CLI flags (kebab-case, 1:1 with the fields) over `TRAINER_*` variables.

    python -m trainer_service --port 50052 --runs-root runs
    TRAINER_DEVICE=cuda python -m trainer_service --no-tensorboard

Imports nothing heavy: `--help` must stay instant.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator
from pydantic_settings import NoDecode, SettingsConfigDict

from forkrl.cli import TokenSettings
from forkrl.security import real_roots
from forkrl.training.rules import RunRules


class TrainerSettings(TokenSettings):
    """gRPC trainer service: owns RL runs (StartRun, WatchRun, GetRun, StopRun)."""

    model_config = SettingsConfigDict(env_prefix="TRAINER_", cli_prog_name="python -m trainer_service")

    host: str = "127.0.0.1"
    """Address to bind (loopback by default; any other address needs a token, or the service refuses to
    start)."""
    port: int = Field(50052, ge=0, le=65535)
    """gRPC port (0 = pick a free one and print it)."""
    runs_root: str = "runs"
    """Where runs are written: a run without run_dir gets <runs_root>/<run id>; a given run_dir must lie inside
    (symlinks followed) and be new, empty or a forkrl run."""
    allowed_roots: Annotated[list[str], NoDecode] = ["models", "data"]
    """Directories StartRun's model and dataset may be read from (comma-separated), besides runs_root (a run's
    checkpoints) and the embedded default model. Paths resolve, symlinks followed, inside one of them."""
    rollout_addresses: Annotated[list[str], NoDecode] = ["127.0.0.1:50051"]
    """The rollout services runs may use (comma-separated host:port; host:* allows any port of that host).
    StartRun's rollout_addresses must each be one of them: the trainer sends prompts and weights there."""
    allow_custom_rewards: bool = False
    """Accept reward='package.module:function' in StartRun (imports and runs that code in the trainer)."""
    threads: Annotated[int, Field(ge=1)] | Literal["auto"] = "auto"
    """torch threads for training: auto (the default) sets them per run from OMP_NUM_THREADS when set, else the CPUs
    this process may use (its affinity: taskset, a container's cpuset), shared among the ranks on this machine: all
    of them in a sync run, where generation and training take turns, half in an async run (a run's max_staleness >
    0), where the rollout service samples while the trainer trains; a number >= 1: that many for every run (e.g. 1
    when other busy processes share the machine)."""
    device: str = "auto"
    """torch device for training: auto (cuda if present), cpu, cuda."""
    max_step_samples: int = Field(16384, ge=1)
    """Largest prompts_per_step x group_size a run may ask for (StartRun: INVALID_ARGUMENT beyond)."""
    max_step_tokens: int = Field(1 << 25, ge=1)
    """Largest number of tokens one step may generate: prompts_per_step x group_size x max_new_tokens, times
    max_gen_batches with dynamic_sampling. The default (33,554,432) covers the built-in tasks and 1024-token
    datasets; recipes/dapo_paper.toml needs 1,677,721,600 (512 x 16 x 20480 x 10)."""
    max_eval_tokens: int = Field(1 << 25, ge=1)
    """Largest eval_prompts x max_new_tokens of one evaluation (StartRun: INVALID_ARGUMENT beyond)."""
    max_message_mib: int = Field(4, ge=1)
    """gRPC receive limit in MiB (a StartRun request is a few KiB)."""
    max_concurrent_streams: int = Field(64, ge=1)
    """gRPC: most RPCs (WatchRun streams included) one client connection may have open at once."""
    rollout_wait_s: float = Field(300.0, gt=0)
    """After a rollout fault (UNAVAILABLE, a restarted service): how long a run waits for the rollout service(s)
    to be SERVING again before it pushes its weights again and redoes the step; past it the run fails (with a
    checkpoint of its last trained step)."""
    grace_s: float = Field(10.0, ge=0)
    """SIGTERM: seconds to let in-flight RPCs finish; the active run is stopped first (it stops before its next
    micro-batch or Generate call and checkpoints its last trained step) and given grace_s x 6 for that."""
    tensorboard: bool = True
    """Also write TensorBoard event files into the run dir."""

    @field_validator("allowed_roots", "rollout_addresses", mode="before")
    @classmethod
    def _split_commas(cls, v: object) -> object:
        # TRAINER_ALLOWED_ROOTS=a,b arrives as one string (NoDecode: not JSON); the CLI splits commas itself
        if isinstance(v, str):
            return [p.strip() for p in v.split(",") if p.strip()]
        return v

    def rules(self) -> RunRules:
        """What StartRun may ask of this trainer (forkrl.training.preflight)."""
        from forkrl.models.tiny import default_model_dir

        return RunRules(
            runs_root=Path(self.runs_root).expanduser().resolve(),
            read_roots=real_roots([*self.allowed_roots, self.runs_root, default_model_dir()]),
            rollout_addresses=tuple(self.rollout_addresses),
            allow_custom_rewards=self.allow_custom_rewards,
            max_step_samples=self.max_step_samples,
            max_step_tokens=self.max_step_tokens,
            max_eval_tokens=self.max_eval_tokens,
        )
