"""The rollout lease and the swap's drain timeout, on the real gRPC server with the fake backend of
test_server_plumbing.py: a push must be the served version + 1 and come from the run holding the lease; the
holder releases it, it expires, an operator resets it; a drain that outlasts drain_timeout_s aborts the samples.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from forkrl.remote.rollout import RolloutClient
from rollout_service.admin import main as admin_main
from tests.rollout.test_server_plumbing import MODEL, ServerThread
from tests.service_fixtures import wait_until

W = {k: v * 2 for k, v in MODEL.items()}


@pytest.fixture
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from safetensors.torch import save_file

    d = tmp_path_factory.mktemp("fake-model")
    save_file(MODEL, str(d / "model.safetensors"))
    return d


@pytest.fixture
def served(model_dir: Path, tmp_path: Path) -> Iterator[tuple[ServerThread, RolloutClient]]:
    s = ServerThread(model_dir, tmp_path / "staging")
    c = RolloutClient(s.address, timeout_s=120, max_retries=0)
    c.wait_ready(120)
    yield s, c
    c.close()
    s.stop()


def _refused(fn) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        fn()
    return e.value.code(), e.value.details()


def test_a_push_must_be_the_served_version_plus_one(served):
    _, c = served
    assert c.update_weights(W, 1) == 1
    for target in (3, 2**63 - 1):  # the version can never be pushed out of reach of later pushes
        code, msg = _refused(lambda t=target: c.update_weights(W, t))
        assert code == grpc.StatusCode.FAILED_PRECONDITION
        assert msg == f"target_version must be the served version + 1 = 2, got {target}"
    assert c.info().version == 1 and c.update_weights(W, 2) == 2


def test_the_first_run_to_push_holds_the_rollout(served, tmp_path: Path):
    _, c = served
    assert c.update_weights(W, 1, run_id="run-a") == 1
    info = c.info()
    assert info.lease_run_id == "run-a" and 0 < info.lease_expires_in_s <= 900
    for push in (lambda: c.update_weights(W, 2, run_id="run-b"), lambda: c.update_weights(W, 2),
                 lambda: c.load_weights(str(tmp_path), 2, run_id="run-b")):
        code, msg = _refused(push)
        assert code == grpc.StatusCode.FAILED_PRECONDITION
        assert "leased to run 'run-a'" in msg and "reset-lease" in msg
    assert _refused(lambda: c.release_lease("run-b"))[0] == grpc.StatusCode.FAILED_PRECONDITION
    assert c.info().version == 1 and c.info().counters.rejected_weight_updates == 3
    assert c.update_weights(W, 2, run_id="run-a") == 2  # the holder goes on
    assert c.release_lease("run-a") == "run-a" and c.info().lease_run_id == ""
    assert c.update_weights(W, 3, run_id="run-b") == 3 and c.info().lease_run_id == "run-b"


def test_an_operator_resets_the_lease(served, capsys):
    s, c = served
    assert c.update_weights(W, 1, run_id="run-a") == 1
    assert admin_main(["reset-lease", "--address", s.address]) == 0
    out = capsys.readouterr().out
    assert "lease of run run-a released" in out and "serving version 1; lease: none" in out
    assert c.update_weights(W, 2, run_id="run-b") == 2


def test_a_lease_expires_without_pushes(model_dir: Path, tmp_path: Path):
    """The engine's lease clock is moved past lease_timeout_s instead of waiting for it: nothing here depends on
    how fast the machine is."""
    s = ServerThread(model_dir, tmp_path / "staging", lease_timeout_s=900)
    ahead = [0.0]
    assert s.servicer.engine is not None
    s.servicer.engine.clock = lambda: time.monotonic() + ahead[0]
    try:
        with RolloutClient(s.address, timeout_s=120) as c:
            assert c.update_weights(W, 1, run_id="run-a") == 1
            assert c.info().lease_run_id == "run-a"
            ahead[0] += 899.0
            assert c.info().lease_run_id == "run-a"  # not yet
            ahead[0] += 2.0
            assert c.info().lease_run_id == "" and c.info().lease_expires_in_s == 0  # expired
            assert c.update_weights(W, 2, run_id="run-b") == 2
            info = c.info()
            assert info.lease_run_id == "run-b" and 0 < info.lease_expires_in_s <= 900
    finally:
        s.stop()


def test_a_drain_past_its_timeout_aborts_the_samples_and_swaps(model_dir: Path, tmp_path: Path):
    s = ServerThread(model_dir, tmp_path / "staging", drain_timeout_s=0.2)
    try:
        assert s.backend is not None
        s.backend.hold_from_sample = 1  # sample 1 of each prompt never finishes on its own
        s.backend.sample_gate = s.event()
        with RolloutClient(s.address, timeout_s=120, max_retries=0) as c:
            got: list = []
            errors: list[grpc.RpcError] = []

            def sample() -> None:
                try:
                    got.extend(c.generate(["12"], n=2, max_new_tokens=2, seed=0))
                except grpc.RpcError as e:
                    errors.append(e)

            t = threading.Thread(target=sample)
            t.start()
            wait_until(lambda: len(s.backend.running) == 1, 120, "a held sample")
            assert c.update_weights(W, 1) == 1  # waits 0.2 s, then aborts the held sample
            t.join(120)
            assert [e.code() for e in errors] == [grpc.StatusCode.UNAVAILABLE]
            assert "drain_timeout_s 0.2 s" in errors[0].details()
            assert len(got) == 1 and got[0].policy_version == 0  # the finished sample, of the old weights
            info = c.info()
            assert info.version == 1 and info.counters.aborted_requests == 1
            assert len(s.backend.reloaded) == 1 and torch.equal(s.backend.reloaded[0]["norm.weight"], W["norm.weight"])
    finally:
        s.stop()


def test_the_trainer_side_maps_versions_and_restores_lost_weights(served, tmp_path: Path):
    """forkrl.training.rollouts.Rollouts: trajectories carry the trainer's version of the weights that sampled
    them, -1 for weights this run did not push; restore() pushes the current weights again where they were lost."""
    from forkrl.training.rollouts import Rollouts

    s, c = served
    r = Rollouts([s.address], token=None, run_id="run-a")
    try:
        r.adopt(7)  # e.g. a resumed run: the service's version 0 is the trainer's 7
        assert r.generate(["12"], n=2, temperature=1.0, max_new_tokens=2, seed=0)[0][0].policy_version == 7
        r.push(W, 8, "stream", tmp_path)
        assert c.info().version == 1 and c.info().lease_run_id == "run-a"
        assert {t.policy_version for t in r.generate(["12"], n=2, temperature=1.0, max_new_tokens=2, seed=0)[0]} == {8}
        assert r.lost() == []
        # someone else's weights (an operator reset the lease and pushed): not the trainer's version 8
        assert c.release_lease(force=True) == "run-a" and c.update_weights(MODEL, 2) == 2
        assert {t.policy_version for t in r.generate(["12"], n=2, temperature=1.0, max_new_tokens=2, seed=0)[0]} == {-1}
        assert r.lost() == [0]
        assert r.restore(W, 8, "stream", tmp_path, wait_s=120) == [0]
        assert c.info().version == 3 and torch.equal(s.backend.reloaded[-1]["norm.weight"], W["norm.weight"])
        assert {t.policy_version for t in r.generate(["12"], n=2, temperature=1.0, max_new_tokens=2, seed=0)[0]} == {8}
        r.release()
        assert c.info().lease_run_id == ""
    finally:
        r.executor.shutdown()
        for client in r.clients:
            client.close()
