"""Async rollouts (forkrl/training/pipeline.py): the collector samples ahead of the trainer by at most k steps, so
no trajectory is ever trained more than k policy versions after it was sampled (asserted from the versions the
trajectories carry), and k = 0 is the sync order. A scripted rollout stands for the services: its served
version goes up by one per push, as a rollout service's does."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from forkrl.training.pipeline import AheadCollector, staleness
from tests.service_fixtures import wait_until


class VersionedRollout:
    """Serves version `served`; a batch's trajectories carry the version served when it was sampled."""

    def __init__(self) -> None:
        self.served = 0
        self.lock = threading.Lock()
        self.sampled: dict[int, int] = {}  # step -> version it was sampled with

    def collect(self, step: int) -> SimpleNamespace:
        with self.lock:
            v = self.served
            self.sampled[step] = v
        return SimpleNamespace(step=step, trajectories=[SimpleNamespace(policy_version=v) for _ in range(3)])

    def push(self) -> int:
        with self.lock:
            self.served += 1
            return self.served


@pytest.mark.parametrize("k", [0, 1, 2])
def test_trajectories_are_never_more_than_k_versions_old(k: int) -> None:
    rollout, steps = VersionedRollout(), 8
    c = AheadCollector(rollout.collect, first_step=1, last_step=steps, max_staleness=k)
    seen = []
    try:
        for step in range(1, steps + 1):
            batch = c.get(step)
            assert batch.step == step
            version = rollout.served  # the trainer's version while it trains this step
            seen.append(max(staleness(version, batch.trajectories)))
            if step + k <= steps:  # the collector runs k steps ahead: it samples step + k before we push
                wait_until(lambda s=step + k: s in rollout.sampled, 30, f"sampling of step {step + k}")
            # and never further: step + k + 1 waits for this step to finish
            assert step + k + 1 not in rollout.sampled
            rollout.push()
            c.done(step)
    finally:
        c.close()
    # the first k batches were sampled at version 0 (before any push), later ones exactly k versions back
    assert seen == [min(s - 1, k) for s in range(1, steps + 1)]
    assert all(s <= k for s in seen)
    assert [step for step, _ in c.started] == list(range(1, steps + 1))
    assert all(step - 1 - done <= k for step, done in c.started)


def test_sync_k0_samples_each_step_after_the_previous_one_finished() -> None:
    rollout = VersionedRollout()
    c = AheadCollector(rollout.collect, first_step=4, last_step=6, max_staleness=0)  # a resumed run: from 4
    for step in (4, 5, 6):
        assert c.get(step).trajectories[0].policy_version == rollout.served
        rollout.push()
        c.done(step)
    c.close()
    assert c.started == [(4, 3), (5, 4), (6, 5)]


def test_an_error_while_sampling_reaches_the_trainer_and_close_stops_waiting() -> None:
    def collect(step: int):
        if step == 2:
            raise ConnectionError("rollout gone")
        return SimpleNamespace(step=step)

    c = AheadCollector(collect, first_step=1, last_step=3, max_staleness=1)
    assert c.get(1).step == 1
    with pytest.raises(RuntimeError, match="sampling the batch of step 2 failed: rollout gone"):
        c.get(2)
    c.close()

    idle = AheadCollector(lambda s: SimpleNamespace(step=s), first_step=1, last_step=5, max_staleness=0)
    assert idle.get(1).step == 1
    idle.close(timeout_s=30)  # waiting for done(1): close ends it
    assert not idle._thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        idle.get(2)
    with pytest.raises(ValueError, match="max_staleness must be >= 0"):
        AheadCollector(lambda s: s, 1, 2, -1)
