"""A run's recovery from rollout faults, the part of the training loop's session (forkrl/training/loop.py) that
waits, pushes again and redoes an operation.

Several rollout services: a service that fails (UNAVAILABLE, a deadline, a stream that breaks) is taken out of the
pool by Rollouts itself (forkrl/training/pool.py) and the operation goes on with the others: nothing here runs. What
reaches this module is a fault no other service could stand in for: the last service in the pool failed, or a
batch holds a trajectory not sampled by the pushed policy (ForeignBatch: a service restarted and serves its
initial weights). Then: wait up to `wait_s` for every service to be SERVING, push the current weights again to the
services that lost them (and to those out of the pool, which are in again once they serve that version), and redo
the operation (the step's sampling, a push, an evaluation) with the same prompts and seeds, at most
MAX_RECOVERIES times; then the run fails (the loop checkpoints its last trained step first).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from forkrl.training.pipeline import AheadCollector, staleness

if TYPE_CHECKING:
    from forkrl.training.scoring import ScoredBatch

MAX_RECOVERIES = 5  # per operation (a step's sampling, a push, an evaluation): then the run fails
T = TypeVar("T")


class ForeignBatch(Exception):
    """A batch holds trajectories not sampled by the policy version the trainer pushed."""


class Recovery:
    """The loop session's recovery (a mixin of loop.py's _Session: it uses its run, cfg, rollouts, data, version,
    cursor, wait_s, foreign_batches, recoveries, policy_weights and collect_ahead)."""

    run: Any
    cfg: Any
    rollouts: Any
    data: Any
    version: int
    cursor: int | None
    wait_s: float
    foreign_batches: int
    recoveries: int

    def take_ahead(self, ahead: AheadCollector, step: int, start_cursor: int) -> tuple[ScoredBatch, AheadCollector]:
        """Async: the batch of `step` from the collector, and the collector to go on with. After a rollout fault
        (the sampling thread's call failed UNAVAILABLE, or the batch holds a trajectory of weights this run did not
        push there: a restarted service), stop the collector (the batches sampled ahead are discarded), put the data
        cursor back after the last batch taken, wait for health and push the current weights again where they
        were lost, and sample again from `step` on a new collector: the fault costs the steps in flight, never a
        step trained on foreign samples."""
        for attempt in range(MAX_RECOVERIES + 1):
            try:
                scored, cursor = ahead.get(step)
                foreign = sum(t.policy_version < 0 for t in scored.trajectories)
                too_old = max(staleness(self.version, scored.trajectories), default=0) > self.cfg.max_staleness
                if foreign or (too_old and self.rollouts.lost()):  # not: too old because someone else pushed
                    foreign = foreign or len(scored.trajectories)
                    self.foreign_batches += 1
                    raise ForeignBatch(f"{foreign} of {len(scored.trajectories)} trajectories of step {step} were "
                                       "sampled by weights this run did not push (a restarted rollout service)")
                self.cursor = cursor
                return scored, ahead
            except (RuntimeError, ForeignBatch, grpc.RpcError) as e:
                cause = e.__cause__ if type(e) is RuntimeError else e  # get() wraps the sampler's error
                if attempt == MAX_RECOVERIES or not isinstance(cause, grpc.RpcError | ForeignBatch) \
                        or not _rollout_fault(cause):
                    raise
                ahead.close(timeout_s=600)
                self.data.cursor = self.cursor if self.cursor is not None else start_cursor
                self.recover(f"sampling step {step} ahead", cause)
                ahead = AheadCollector(self.collect_ahead, step, self.cfg.num_steps, self.cfg.max_staleness)
        raise AssertionError("unreachable")

    def recover(self, what: str, e: BaseException) -> None:
        """After a rollout fault: wait for health, push the current weights again where they were lost."""
        why = str(e) if isinstance(e, ForeignBatch) else f"{e.code().name}: {e.details()}"
        self.run.event("LOG", f"{what}: {why}; waiting up to {self.wait_s:.0f} s for the rollout "
                       "service(s), then pushing the weights again")
        t0 = time.perf_counter()
        lost = self.rollouts.restore(self.policy_weights(), self.version, self.cfg.weight_sync, self.run.run_dir,
                                     self.wait_s)
        self.recoveries += 1
        self.run.event("LOG", f"{what}: rollout service(s) {lost} given version {self.version} again after "
                       f"{time.perf_counter() - t0:.1f} s; redoing it")

    def resilient(self, what: str, fn: Callable[[], T]) -> T:
        """fn(), and after a rollout fault (UNAVAILABLE, a version the service no longer serves, a foreign batch):
        wait for health, push the current weights again where they were lost, and run fn() again."""
        for attempt in range(MAX_RECOVERIES + 1):
            try:
                return fn()
            except (grpc.RpcError, ForeignBatch) as e:
                if attempt == MAX_RECOVERIES or not _rollout_fault(e):
                    raise
                self.recover(what, e)
        raise AssertionError("unreachable")


def _rollout_fault(e: BaseException) -> bool:
    """A fault of the rollout service(s) that waiting and pushing again can mend."""
    if isinstance(e, ForeignBatch):
        return True
    code = e.code() if isinstance(e, grpc.RpcError) else None
    # FAILED_PRECONDITION "served version + 1": the service restarted between reading its version and the push
    return code == grpc.StatusCode.UNAVAILABLE or (
        code == grpc.StatusCode.FAILED_PRECONDITION and "served version + 1" in (e.details() or ""))
