"""The rollout pool's bookkeeping (forkrl/training/pool.py) and how Rollouts uses it, without servers: a service
whose call fails is taken out and its groups are sampled whole by the others; it is pushed the current version
when it answers again and is back in only then; one service alone never fails over (the loop waits, as before).
The services are stand-ins for RolloutClient (the seam Rollouts calls); the real services: tests/faults/
test_lose_rollout_host.py."""

from __future__ import annotations

from types import SimpleNamespace

import grpc
import pytest
import torch

from forkrl.training.pool import ServicePool, ShortStream, failover_fault
from forkrl.training.rollouts import Rollouts


class Fault(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str = "") -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class FakeService:
    """A rollout service's client: samples tagged with this service's name; `down` makes every call fail."""

    def __init__(self, name: str) -> None:
        self.address, self.name = name, name
        self.version = 0
        self.down: grpc.RpcError | None = None
        self.half = False  # the stream ends after one sample, without an error
        self.calls: list[list[int]] = []  # prompt offsets of each Generate call
        self.last_weights_response = None

    def generate(self, prompts, n, temperature, max_new_tokens, seed, prompt_offsets, timeout_s):
        self.calls.append(list(prompt_offsets))
        if self.down is not None:
            raise self.down
        for p in range(len(prompts)):
            for k in range(n):
                yield SimpleNamespace(prompt_index=p, sample_index=k, policy_version=self.version,
                                      last_policy_version=-1, by=self.name)
                if self.half:
                    return

    def info(self, timeout_s: float = 30.0):
        if self.down is not None:
            raise self.down
        return SimpleNamespace(version=self.version)

    def health(self, timeout_s: float = 60.0) -> int:
        if self.down is not None:
            raise self.down
        return 1

    def update_weights(self, state, version, run_id=""):
        if self.down is not None:
            raise self.down
        self.version = version
        return version

    def close(self) -> None:
        pass


def rollouts(n: int) -> tuple[Rollouts, list[FakeService]]:
    r = Rollouts([f"127.0.0.1:{50000 + j}" for j in range(n)], token="")
    for c in r.clients:
        c.close()
    r.clients = [FakeService(f"s{j}") for j in range(n)]
    r.versions = [{0: 0} for _ in range(n)]  # adopt(0)
    return r, r.clients


STATE = {"w": torch.zeros(2)}


def test_the_pool_never_drops_its_last_service_and_readmits_only_at_the_current_version() -> None:
    pool = ServicePool(2)
    assert pool.drop(1, "UNAVAILABLE") and pool.active() == [0] and pool.out() == [1]
    assert not pool.drop(0, "UNAVAILABLE") and pool.active() == [0]  # the last one: the caller waits instead
    assert not pool.readmit(1, served=3, current=4) and pool.out() == [1]  # stale weights: stays out
    assert not pool.readmit(1, served=None, current=4) and pool.out() == [1]
    assert pool.readmit(1, served=4, current=4) and pool.active() == [0, 1]
    assert (pool.failovers, pool.readmissions) == (1, 1)
    assert not ServicePool(1).drop(0, "UNAVAILABLE")
    with pytest.raises(ValueError, match="at least one rollout service, got 0"):
        ServicePool(0)


def test_faults_that_fail_over() -> None:
    for code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL):
        assert failover_fault(Fault(code))
    assert failover_fault(ShortStream("3 of 8"))
    assert failover_fault(Fault(grpc.StatusCode.FAILED_PRECONDITION, "a push must be the served version + 1"))
    assert not failover_fault(Fault(grpc.StatusCode.INVALID_ARGUMENT))  # the request's fault: no other helps
    assert not failover_fault(Fault(grpc.StatusCode.UNAUTHENTICATED))
    assert not failover_fault(ValueError("x"))


@pytest.mark.parametrize("fault", [Fault(grpc.StatusCode.UNAVAILABLE), "half"], ids=["unavailable", "broken"])
def test_a_failed_service_groups_are_sampled_whole_by_the_others(fault) -> None:
    r, (a, b, c) = rollouts(3)
    if fault == "half":
        b.half = True  # its stream ends after one sample: that sample is never used
    else:
        b.down = fault
    groups = r.generate([f"p{i}" for i in range(6)], n=4, temperature=1.0, max_new_tokens=8, seed=1)
    assert r.pool.out() == [1] and r.pool.active() == [0, 2]
    assert b.calls == [[1, 4]]
    for i, g in enumerate(groups):
        assert len({t.by for t in g}) == 1 and g[0].by != "s1", (i, [t.by for t in g])  # one call per group
        assert [t.sample_index for t in g] == [0, 1, 2, 3]
    assert sorted(i for call in a.calls + c.calls for i in call) == list(range(6))  # 1 and 4 asked again
    assert r.samples[1] == 0 and r.samples[0] + r.samples[2] == 24
    # the next call does not go to the service that is out
    r.generate(["q"], n=2, temperature=1.0, max_new_tokens=8, seed=2)
    assert b.calls == [[1, 4]]


def test_one_service_alone_raises_as_before() -> None:
    r, (a,) = rollouts(1)
    a.down = Fault(grpc.StatusCode.UNAVAILABLE)
    with pytest.raises(grpc.RpcError):
        r.generate(["p"], n=2, temperature=1.0, max_new_tokens=8, seed=1)
    assert r.pool.active() == [0]


def test_every_service_failing_raises_for_the_loops_recovery() -> None:
    r, (a, b) = rollouts(2)
    a.down = b.down = Fault(grpc.StatusCode.UNAVAILABLE)
    with pytest.raises(grpc.RpcError):
        r.generate(["p", "q"], n=2, temperature=1.0, max_new_tokens=8, seed=1)
    assert len(r.pool.active()) == 1  # the last one stays in: the loop waits for it


def test_a_returning_service_is_pushed_the_current_version_before_it_samples_again(tmp_path) -> None:
    r, (a, b) = rollouts(2)
    r.push(STATE, 1, "stream", tmp_path)
    b.down = Fault(grpc.StatusCode.UNAVAILABLE)
    r.push(STATE, 2, "stream", tmp_path)  # b fails: out, the push succeeds on a
    assert r.pool.out() == [1] and (a.version, b.version) == (2, 1)
    r.push(STATE, 3, "stream", tmp_path)  # still down: probed, not pushed to, stays out
    assert r.pool.out() == [1] and b.version == 1
    groups = r.generate(["p", "q"], n=2, temperature=1.0, max_new_tokens=8, seed=1)
    assert {t.by for g in groups for t in g} == {"s0"}
    b.down = None  # it answers again, still serving the old weights: not sampled before the next push
    groups = r.generate(["p", "q"], n=2, temperature=1.0, max_new_tokens=8, seed=1)
    assert {t.by for g in groups for t in g} == {"s0"}
    r.push(STATE, 4, "stream", tmp_path)  # pushed with the others, then in
    assert r.pool.active() == [0, 1] and r.versions[1][b.version] == 4
    groups = r.generate(["p", "q"], n=2, temperature=1.0, max_new_tokens=8, seed=1)
    assert {t.by for g in groups for t in g} == {"s0", "s1"}
    assert {t.policy_version for g in groups for t in g} == {4}  # the trainer's numbering: the current version


def test_a_restarted_service_rejoins_by_itself(tmp_path) -> None:
    r, (a, b) = rollouts(2)
    r.push(STATE, 1, "stream", tmp_path)
    b.down = Fault(grpc.StatusCode.UNAVAILABLE)
    r.generate(["p", "q"], n=2, temperature=1.0, max_new_tokens=8, seed=1)
    assert r.pool.out() == [1]
    b.down, b.version = None, 0  # restarted: its own numbering starts again at 0
    r.push(STATE, 2, "stream", tmp_path)
    assert r.pool.active() == [0, 1] and b.version == 1 and r.versions[1] == {1: 2}


def test_the_one_service_recovery_readmits_the_services_it_pushed(tmp_path) -> None:
    r, (a, b) = rollouts(2)
    b.down = Fault(grpc.StatusCode.UNAVAILABLE)
    r.generate(["p", "q"], n=2, temperature=1.0, max_new_tokens=8, seed=1)
    b.down = None
    r.wait_ready = lambda timeout_s=300.0: None  # the fakes have no health stub
    assert r.restore(STATE, 0, "stream", tmp_path, wait_s=1) == [1]
    assert r.pool.active() == [0, 1] and r.versions[1][b.version] == 0
