"""Admission of a probe request: the body is already a valid `ProbeParams` (pydantic, else 422); here it is
checked against what this service allows, and planned by the core.

    plan = admit(params, settings)     # RequestError(status, message) when refused

1. rewards: only the built-in ones unless the operator set allow_custom_rewards (a custom reward is code
   the request names);
2. `forkrl.probe.plan_probe` resolves the checkpoints, dataset, task and reward, passing every path it will
   read through `inside_roots` first: '..' is 400, a path (or a symlink, or a file in a checkpoint) that
   resolves outside the allowed roots is 403;
3. the core's typed errors become HTTP answers: missing steps 404 with the steps that exist, a missing
   path 404, anything else it refuses 400.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from forkrl.data.rewards import BUILTIN_REWARDS
from forkrl.probe.checkpoints import CheckpointNotFound, Confine, PathNotFound, ProbeInputError
from forkrl.probe.job import ProbePlan, plan_probe
from forkrl.probe.params import ProbeParams
from forkrl.security import OutsideRoots, confine_path
from probe_service.config import ProbeSettings

__all__ = ["RequestError", "admit", "inside_roots"]


class RequestError(Exception):
    """A request the service refuses; `status` is the HTTP code, `extra` goes into the body."""

    def __init__(self, status: int, message: str, **extra: Any):
        super().__init__(message)
        self.status, self.message, self.extra = status, message, extra


def inside_roots(roots: list[Path]) -> Confine:
    """A `confine` for the core: the real path (symlinks followed) if it lies inside one of `roots`."""

    def confine(path: Path, what: str) -> Path:
        try:
            return confine_path(path, roots, what, "the allowed roots")
        except OutsideRoots as exc:
            raise RequestError(403, str(exc)) from None
        except ValueError as exc:
            raise RequestError(400, str(exc)) from None

    return confine


def admit(params: ProbeParams, settings: ProbeSettings) -> ProbePlan:
    """The plan of an allowed request, or RequestError."""
    if params.reward and params.reward not in BUILTIN_REWARDS and not settings.allow_custom_rewards:
        raise RequestError(400, f"reward {params.reward!r} is not allowed; use {' or '.join(BUILTIN_REWARDS)}")
    try:
        if params.sampler == "auto":
            params = params.model_copy(update={"sampler": settings.auto_sampler})
        return plan_probe(params, inside_roots(settings.resolved_roots()))
    except CheckpointNotFound as exc:
        raise RequestError(
            404, str(exc), missing_steps=exc.missing, available_steps=exc.available, has_final=exc.has_final
        ) from None
    except PathNotFound as exc:
        raise RequestError(404, str(exc)) from None
    except ProbeInputError as exc:
        raise RequestError(400, str(exc)) from None
