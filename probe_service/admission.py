"""Admission of a probe request: the body is already a valid `ProbeParams` (pydantic, else 422); here it is
checked against what this service allows, and planned by the core.

    plan = admit(params, settings)     # RequestError(status, message) when refused

1. rewards: only the built-in ones unless the operator set allow_custom_rewards (a custom reward is code
   the request names); sampler rollout: its rollout_address must be one of the service's rollout_addresses
   (the job sends the service's token there; 400 otherwise, before anything connects);
2. `forkrl.probe.plan_probe` resolves the checkpoints, dataset, task and reward, passing every path it will
   read through `inside_roots` first: '..' is 400, a path (or a symlink, or a file in a checkpoint) that
   resolves outside the allowed roots is 403;
3. the core's typed errors become HTTP answers: missing steps 404 with the steps that exist, a missing
   path 404, anything else it refuses 400;
4. the job's size against the service's caps (`check_bounds`): samples, tokens and gradient positions,
   422 naming the limit and the setting that raises it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from forkrl.data.rewards import BUILTIN_REWARDS
from forkrl.probe.checkpoints import CheckpointNotFound, Confine, PathNotFound, ProbeInputError
from forkrl.probe.job import ProbePlan, plan_probe
from forkrl.probe.params import ProbeParams
from forkrl.security import OutsideRoots, confine_path
from forkrl.training.rules import address_allowed
from probe_service.config import ProbeSettings

__all__ = ["RequestError", "admit", "check_bounds", "inside_roots"]


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


def _too_big(what: str, value: int, name: str, limit: int) -> RequestError:
    return RequestError(422, f"{what} = {value:,} exceeds the probe service's {name} {limit:,}; an operator can "
                             f"raise it with --{name.replace('_', '-')} (PROBE_{name.upper()})", limit=name)


def check_bounds(plan: ProbePlan, settings: ProbeSettings) -> None:
    """RequestError 422 when the planned job is bigger than the service allows."""
    p, n = plan.params, len(plan.checkpoints)
    samples = n * p.num_prompts * p.num_samples
    if samples > settings.max_job_samples:
        raise _too_big(f"checkpoints {n} x num_prompts {p.num_prompts} x num_samples {p.num_samples}", samples,
                       "max_job_samples", settings.max_job_samples)
    tokens = samples * plan.max_new_tokens
    if tokens > settings.max_job_tokens:
        raise _too_big(f"checkpoints {n} x num_prompts {p.num_prompts} x num_samples {p.num_samples} x "
                       f"max_new_tokens {plan.max_new_tokens}", tokens, "max_job_tokens", settings.max_job_tokens)
    positions = n * p.entropy_bins * 2 * p.max_positions_per_group
    if positions > settings.max_job_positions:
        raise _too_big(f"checkpoints {n} x entropy_bins {p.entropy_bins} x 2 x max_positions_per_group "
                       f"{p.max_positions_per_group}", positions, "max_job_positions", settings.max_job_positions)


def admit(params: ProbeParams, settings: ProbeSettings) -> ProbePlan:
    """The plan of an allowed request, or RequestError."""
    if params.reward and params.reward not in BUILTIN_REWARDS and not settings.allow_custom_rewards:
        raise RequestError(400, f"reward {params.reward!r} is not allowed; use {' or '.join(BUILTIN_REWARDS)}")
    if params.sampler == "rollout" and not address_allowed(params.rollout_address, tuple(settings.rollout_addresses)):
        raise RequestError(400, f"rollout_address {params.rollout_address!r} is not one of the probe service's "
                                f"rollout_addresses {settings.rollout_addresses} (--rollout-addresses, "
                                "PROBE_ROLLOUT_ADDRESSES): a job sends the service's token and its prompts only to "
                                "the rollout services it is configured with")
    try:
        plan = plan_probe(params, inside_roots(settings.resolved_roots()))
    except CheckpointNotFound as exc:
        raise RequestError(
            404, str(exc), missing_steps=exc.missing, available_steps=exc.available, has_final=exc.has_final
        ) from None
    except PathNotFound as exc:
        raise RequestError(404, str(exc)) from None
    except ProbeInputError as exc:
        raise RequestError(400, str(exc)) from None
    check_bounds(plan, settings)
    return plan
