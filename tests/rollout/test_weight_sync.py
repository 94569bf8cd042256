"""The trainer's weight push (`Rollouts.push`, forkrl/training/rollouts.py) into real rollout services over
real gRPC on 127.0.0.1: the automatic route, its fallback, and that the served policy is the pushed one.

`auto` after `adopt()` (what a run does) takes the transfer route when every service offers the trainer's
weight-transfer backend: one gloo group of the trainer and both services' workers (rank offsets 1 and 2), the
model broadcast layer by layer. Without that (`adopt` not called here, or a service without the backend) it is
the shm / stream choice below.

Two services of the embedded tiny model run side by side. `colocated` has the test's sync dir as its
FORKRL_SYNC_DIR, as a service on the trainer's host with the same /dev/shm does; `elsewhere` has another
one, as a container with its own /dev/shm: it answers LoadWeights of the trainer's file with
PERMISSION_DENIED, and `auto` must stream to it instead. Neither may read anything else (allowed_roots is an
empty directory). Served log-probs are compared with transformers on the pushed weights (tests/numerics.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from forkrl.remote.rollout import RolloutClient
from forkrl.training.rollouts import Rollouts
from forkrl.weights.shm import SYNC_DIR_ENV
from tests.numerics import logprob_parity
from tests.service_fixtures import ServiceAddress, start_rollout_service

pytestmark = pytest.mark.slow

PROMPTS = ["12+34+5=", "hello world"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("weight-sync")
    out = {k: base / k for k in ("sync", "other_sync", "roots", "run")}
    for p in out.values():
        p.mkdir()
    return out


@pytest.fixture(scope="module")
def services(tiny_model_dir: Path, dirs: dict[str, Path]) -> Iterator[tuple[ServiceAddress, ServiceAddress]]:
    with start_rollout_service(tiny_model_dir, seed=0, kv_cache_gib=1, allowed_roots=dirs["roots"],
                               extra_env={SYNC_DIR_ENV: str(dirs["sync"])}) as colocated, \
            start_rollout_service(tiny_model_dir, seed=0, kv_cache_gib=1, allowed_roots=dirs["roots"],
                                  extra_env={SYNC_DIR_ENV: str(dirs["other_sync"])}) as elsewhere:
        yield colocated, elsewhere


@pytest.fixture(scope="module")
def models(tiny_model_dir: Path) -> tuple[torch.nn.Module, torch.nn.Module]:
    from transformers import AutoModelForCausalLM

    return tuple(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=d).eval()  # type: ignore[return-value]
                 for d in (torch.float32, torch.float64))


def perturbed(model: torch.nn.Module, scale: float, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * v.std() * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}


def with_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    import copy

    m = copy.deepcopy(model)
    m.load_state_dict(state)
    return m


def served_parity(client: RolloutClient, version: int, m32: torch.nn.Module, m64: torch.nn.Module) -> tuple:
    trajs = list(client.generate(PROMPTS, n=4, temperature=1.0, max_new_tokens=24, seed=9))
    assert {t.policy_version for t in trajs} == {version}
    return logprob_parity([list(t.logprobs) for t in trajs],
                          [(list(t.prompt_token_ids), list(t.completion_token_ids)) for t in trajs], m32, m64, 1.0)


def test_auto_push_serves_the_trainers_weights_on_every_service(services, models, dirs, monkeypatch):
    monkeypatch.setenv(SYNC_DIR_ENV, str(dirs["sync"]))  # the trainer's side of the same shared memory
    hf32, hf64 = models
    rollouts = Rollouts(list(services))
    try:
        rollouts.wait_ready(120)
        version = rollouts.version()
        # each service takes a push as its own served version + 1; the other tests of this module push to one
        # service only, so in a shuffled order the two may start apart
        served = [c.info().version for c in rollouts.clients]
        for k, seed in enumerate((1, 2)):
            state = perturbed(hf32, 0.3, seed)
            rollouts.push(state, version + k + 1, "auto", dirs["run"])
            # colocated loads the shared file; elsewhere cannot see it (PERMISSION_DENIED) and was streamed to
            assert rollouts.routes == ["shm", "stream"]
            assert rollouts.last_swap["push_shm_services"] == 1.0
            files = list(dirs["sync"].iterdir())
            assert len(files) == 1 and files[0].suffix == ".safetensors"
            if k == 0:
                inode = files[0].stat().st_ino
            else:
                assert files[0].stat().st_ino == inode  # rewritten in place, not recreated
            m32, m64 = with_state(hf32, state), with_state(hf64, state)
            for c, base in zip(rollouts.clients, served, strict=True):
                worst, bound = served_parity(c, base + k + 1, m32, m64)
                assert worst <= bound, c.address
                assert served_parity(c, base + k + 1, hf32, hf64)[0] > 10 * bound  # not the old weights
        assert rollouts._no_shm == {1}  # asked once, then streamed to without asking again
        assert not list(dirs["other_sync"].iterdir())
    finally:
        rollouts.close()
    assert not list(dirs["sync"].iterdir())  # the run's end removes the shared file


def test_auto_transfers_into_every_service_through_one_group(services, models, dirs):
    hf32, hf64 = models
    rollouts = Rollouts(list(services))
    try:
        rollouts.wait_ready(120)
        served = [c.info().version for c in rollouts.clients]
        rollouts.adopt(0)
        assert rollouts.offers == ["gloo", "gloo"] and rollouts.choose_routes("auto") == ["transfer", "transfer"]
        for k, seed in enumerate((4, 5)):  # the second push reuses the group formed by the first
            state = perturbed(hf32, 0.3, seed)
            model = with_state(hf32, state)
            rollouts.push(model, k + 1, "auto", dirs["run"])
            assert rollouts.routes == ["transfer", "transfer"]
            assert all(v[s + k + 1] == k + 1 for v, s in zip(rollouts.versions, served, strict=True))
            m64 = with_state(hf64, state)
            for c, base in zip(rollouts.clients, served, strict=True):
                worst, bound = served_parity(c, base + k + 1, model, m64)
                assert worst <= bound, c.address
    finally:
        rollouts.close()


def test_auto_takes_transfer_only_when_every_service_offers_the_trainers_backend():
    from forkrl.training.transfer_route import trainer_backend

    ours = trainer_backend()  # gloo on CPU, nccl with CUDA
    other = "nccl" if ours == "gloo" else "gloo"
    rollouts = Rollouts(["127.0.0.1:1", "127.0.0.1:2"], token="")  # no calls are made: offers set by hand
    try:
        assert rollouts.offers is None and rollouts.choose_routes("auto")[0] != "transfer"  # before adopt()
        rollouts.offers = [ours, ours]
        assert rollouts.choose_routes("auto") == ["transfer", "transfer"]
        rollouts.offers = [ours, ""]  # a service started with --weight-transfer none
        assert "transfer" not in rollouts.choose_routes("auto")
        rollouts.offers = [other, other]  # e.g. GPU services and a CPU trainer
        assert "transfer" not in rollouts.choose_routes("auto")
        rollouts.offers, rollouts._no_transfer = [ours, ours], True  # joining failed once
        assert "transfer" not in rollouts.choose_routes("auto")
        assert rollouts.choose_routes("transfer") == ["transfer", "transfer"]  # an explicit route is never changed
    finally:
        rollouts.close()


def test_explicit_shm_route_does_not_fall_back(services, models, dirs, monkeypatch):
    monkeypatch.setenv(SYNC_DIR_ENV, str(dirs["sync"]))
    hf32, _ = models
    rollouts = Rollouts([services[1]])
    try:
        version = rollouts.version()
        with pytest.raises(grpc.RpcError) as e:
            rollouts.push(hf32.state_dict(), version + 1, "shm", dirs["run"])
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert rollouts.version() == version  # nothing was applied
        assert not list(dirs["sync"].iterdir())  # a failed push drops the file (a reload may still map it)
        assert rollouts.push(hf32.state_dict(), version + 1, "stream", dirs["run"]) >= 0
        assert rollouts.version() == version + 1 and rollouts.routes == ["stream"]
    finally:
        rollouts.close()


def test_auto_streams_when_the_sync_dir_cannot_be_written(services, models, dirs, monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(SYNC_DIR_ENV, str(blocker / "sync"))  # mkdir fails: a file where a folder should be
    hf32, hf64 = models
    rollouts = Rollouts([services[0]])
    try:
        version = rollouts.version()
        state = perturbed(hf32, 0.3, seed=3)
        rollouts.push(state, version + 1, "auto", dirs["run"])
        assert rollouts.routes == ["stream"] and rollouts._no_shm == {0}
        worst, bound = served_parity(rollouts.clients[0], version + 1, with_state(hf32, state), with_state(hf64, state))
        assert worst <= bound
        with pytest.raises(OSError):  # an explicit shm route says why instead
            rollouts.push(state, version + 2, "shm", dirs["run"])
    finally:
        rollouts.close()
