"""Which rollout services take a run's samples and pushes: the pool, and its rules for taking one out and back in.

    pool = ServicePool(2)
    pool.active()                       # [0, 1]
    pool.drop(1, "UNAVAILABLE: ...")    # True: 1 is out, its groups go to the others
    pool.drop(0, "...")                 # False: the last service is never dropped (the caller waits, as with one)
    pool.readmit(1, served=7, current=7)  # True: back in, it serves the trainer's current version

With several rollout services, losing one (a host partitioned or rebooted, a service restarted) must not stall the
run: a Generate call that fails with a fault the pool fails over on (`failover_fault`) takes that service out, and
its prompts (whole groups: a group's samples always come from one call) are asked of the services still in. A
service out of the pool gets no Generate and no push; the trainer probes it before each push, and when it answers
it is pushed the trainer's current version with the others and comes back in only once it serves exactly that
version (`readmit`), so no sample of another policy is ever taken from it. With one service nothing fails over:
the trainer waits for it and redoes the operation (forkrl/training/recovery.py), as before.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import grpc

from forkrl.remote.rollout import RolloutClient

log = logging.getLogger("forkrl.rollouts")

# A service that answers none of these within its call is taken out of the pool (when another one is left):
# UNAVAILABLE (gone, refused, a broken connection, a keepalive a stopped peer did not answer), DEADLINE_EXCEEDED
# (a hung peer), INTERNAL (a stream reset mid-way), and a restart noticed by a push ("served version + 1").
_FAILOVER_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL)


class ShortStream(RuntimeError):
    """A Generate call ended without every sample it was asked for (the stream broke without an error)."""


def failover_fault(e: BaseException) -> bool:
    """Whether `e`, from one service's call, is a fault of that service that the others can stand in for."""
    if isinstance(e, ShortStream):
        return True
    if not isinstance(e, grpc.RpcError):
        return False
    code = e.code()
    return code in _FAILOVER_CODES or (
        code == grpc.StatusCode.FAILED_PRECONDITION and "served version + 1" in (e.details() or ""))


class ServicePool:
    """The services of a run that are in (take Generate calls and pushes) and out; thread-safe (the async sampler
    drops services on its thread, the trainer re-admits them on its own)."""

    def __init__(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"a run needs at least one rollout service, got {n}")
        self.n = n
        self._out: dict[int, str] = {}  # index -> why it was taken out
        self._lock = threading.Lock()
        self.failovers = 0  # services taken out so far
        self.readmissions = 0  # services let back in so far

    def active(self) -> list[int]:
        with self._lock:
            return [j for j in range(self.n) if j not in self._out]

    def out(self) -> list[int]:
        with self._lock:
            return sorted(self._out)

    def is_in(self, j: int) -> bool:
        with self._lock:
            return j not in self._out

    def drop(self, j: int, why: str) -> bool:
        """Take service `j` out. False (nothing changes) when it is the last one in: the caller raises the fault,
        and the run recovers as with one service (waits, pushes again, redoes the operation)."""
        with self._lock:
            if j in self._out:
                return True
            if self.n - len(self._out) <= 1:
                return False
            self._out[j] = why
            self.failovers += 1
            return True

    def readmit(self, j: int, served: int | None, current: int) -> bool:
        """Let service `j` back in when it serves the trainer's `current` version (`served`: the trainer's version
        of what it serves, None when unknown); otherwise it stays out."""
        if served is None or served != current:
            return False
        with self._lock:
            if self._out.pop(j, None) is not None:
                self.readmissions += 1
        return True

    def readmit_all(self) -> None:
        """Every service is in again (after the one-service recovery pushed the current version to each)."""
        with self._lock:
            self.readmissions += len(self._out)
            self._out.clear()

    def answering(self, clients: Sequence[RolloutClient], timeout_s: float) -> list[int]:
        """The services out of the pool whose health check answers SERVING within `timeout_s` (a stopped peer
        costs that much per call)."""
        ready = []
        for j in self.out():
            try:
                if clients[j].health(timeout_s=timeout_s) == 1:  # health_pb2.HealthCheckResponse.SERVING
                    ready.append(j)
            except grpc.RpcError:
                pass
        return ready


def sample_groups(client: RolloutClient, versions: dict[int, int], idx: list[int], prompts: list[str], n: int,
                  temperature: float, max_new_tokens: int, seed: int,
                  deadline_s: float) -> list[tuple[int, Any]] | BaseException:
    """The n samples of each prompts[i], i in `idx`, from one service in one call, as (i, trajectory), each
    trajectory's versions in the trainer's numbering (`versions`: the service's -> the trainer's; -1 for one this
    run did not push; as served while empty); or the error of the call (a broken stream: ShortStream)."""
    if not idx:
        return []
    out = []
    try:
        # seeds per global prompt index: the result does not depend on how prompts are sharded
        for t in client.generate([prompts[i] for i in idx], n=n, temperature=temperature,
                                 max_new_tokens=max_new_tokens, seed=seed, prompt_offsets=idx, timeout_s=deadline_s):
            if versions:
                t.policy_version = versions.get(t.policy_version, -1)
                if t.last_policy_version >= 0:
                    t.last_policy_version = versions.get(t.last_policy_version, -1)
            out.append((idx[t.prompt_index], t))
    except grpc.RpcError as e:
        return e
    if len({(i, t.sample_index) for i, t in out}) != len(idx) * n:
        return ShortStream(f"rollout service {client.address} returned {len(out)} of the {len(idx) * n} "
                           "trajectories asked")
    return out
