"""Pushes through vLLM's weight-transfer API with the gloo backend into a real vLLM rollout service, over gRPC.

The trainer is a process of its own (tests/rollout/transfer_trainer.py: the trainer's `Rollouts.push` with
--weight-sync transfer), so the weights travel by gloo broadcast between processes, layer by layer, as they would
between hosts. What is checked: the served log-probs equal the pushed weights' teacher-forced log-probs within the
float32 bound of tests/numerics.py (and no longer the old weights'), the version; a push with samples in flight
(each sample's tokens from the old weights up to one point and the new ones after it, both versions reported);
the refusals (wrong version, another run's lease, a chunk outside a session, a chunk naming no tensor of the model,
an inf in a tensor), an intruder on the weight channel (a chunk altered on the wire: refused before loading) and
a trainer that dies mid-push (the session ends after --transfer-timeout-s without a call:
generation resumes, the weights are reported broken until a good push).

Order independence: tests that change the served weights push the base model back (`restores_base_weights`) with
the module's run id, which every push here uses (the lease).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2
from safetensors.torch import load_file

from forkrl.remote.rollout import RolloutClient, RolloutWeightSync
from forkrl.wire.rollout.v1 import rollout_pb2 as pb
from tests.numerics import float32_logprob_bound, logprob_parity, reference_logprobs
from tests.rollout.transfer_trainer import INF_TENSOR, TAMPER_TENSOR
from tests.service_fixtures import REPO_ROOT, ServiceAddress, start_rollout_service, wait_until

pytestmark = pytest.mark.slow

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
RUN = "transfer-test"
PROMPTS = ["12+34+5=", "hello world"]
TIMEOUT_S = 30  # --transfer-timeout-s: far above any gap between two calls of a live trainer


@pytest.fixture(scope="module")
def service(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceAddress]:
    staging = tmp_path_factory.mktemp("staging-transfer")
    with start_rollout_service(tiny_model_dir, seed=0, kv_cache_gib=1, staging_dir=staging,
                               transfer_timeout_s=TIMEOUT_S, log_path=staging / "rollout.log") as address:
        yield address


@pytest.fixture(scope="module")
def client(service: ServiceAddress) -> Iterator[RolloutClient]:
    c = RolloutClient(service, timeout_s=300)
    c.wait_ready(120)
    yield c
    c.close()


def _model(model_dir: Path, dtype: torch.dtype, state: dict[str, torch.Tensor] | None = None) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    if state is not None:
        m.load_state_dict(state)
    return m


@pytest.fixture(scope="module")
def base(tiny_model_dir: Path) -> tuple[torch.nn.Module, torch.nn.Module]:
    return _model(tiny_model_dir, torch.float32), _model(tiny_model_dir, torch.float64)


@pytest.fixture
def restores_base_weights(client: RolloutClient, base: tuple[torch.nn.Module, torch.nn.Module]) -> Iterator[None]:
    yield
    client.update_weights(base[0].state_dict(), client.info().version + 1, run_id=RUN)
    assert client.health() == SERVING


def trainer(service: str, model_dir: Path, out: Path, mode: str = "all", seed: int = 1) -> dict:
    """Run the trainer process; its JSON report."""
    proc = subprocess.run([sys.executable, "-m", "tests.rollout.transfer_trainer", "--address", service, "--model",
                           str(model_dir), "--out", str(out), "--mode", mode, "--seed", str(seed), "--run-id", RUN],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    assert lines, f"the trainer process printed no report (exit {proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1])


def parity(trajs: list[pb.Trajectory], m32: torch.nn.Module, m64: torch.nn.Module, t: float) -> tuple[float, float]:
    return logprob_parity([list(x.logprobs) for x in trajs],
                          [(list(x.prompt_token_ids), list(x.completion_token_ids)) for x in trajs], m32, m64, t)


def test_info_offers_the_gloo_backend(client: RolloutClient) -> None:
    info = client.info()
    assert info.engine.weight_transfer_backend == "gloo" and info.engine.weight_transfer_workers == 1


def test_a_push_from_a_trainer_process_serves_the_pushed_weights(
        service: ServiceAddress, client: RolloutClient, tiny_model_dir: Path, base, tmp_path: Path,
        restores_base_weights) -> None:
    from vllm.distributed.weight_transfer.base import layerwise_groups

    before = client.info()
    report = trainer(service, tiny_model_dir, tmp_path / "pushed.safetensors", seed=1)
    assert report.get("version") == before.version + 1, report
    # the push left the live parameters outside autograd's graph: a backward after it warns of nothing
    assert report["backward_warnings"] == [] and report["params_with_grad"] == len(list(base[0].parameters()))
    pushed = load_file(str(tmp_path / "pushed.safetensors"))
    nbytes = sum(v.numel() * v.element_size() for k, v in pushed.items())
    # layer by layer: every byte went, one chunk per layerwise group, and the trainer held at most two groups
    # (the one sent and the one before it, still in flight) at a time
    names = [n for n, _ in base[0].named_parameters()]
    sizes = [sum(pushed[n].numel() * 4 for n in g) for g in layerwise_groups(names)]
    assert report["bytes"] == nbytes and report["groups"] == len(sizes) == 4
    assert report["peak_held_bytes"] == max(a + b for a, b in pairwise(sizes)) < nbytes
    info = client.info()
    assert info.version == before.version + 1 and info.counters.weight_reloads == before.counters.weight_reloads + 1
    assert client.health() == SERVING
    trajs = list(client.generate(PROMPTS, n=4, temperature=1.0, max_new_tokens=24, seed=9))
    assert {t.policy_version for t in trajs} == {before.version + 1}
    new32, new64 = _model(tiny_model_dir, torch.float32, pushed), _model(tiny_model_dir, torch.float64, pushed)
    worst, bound = parity(trajs, new32, new64, 1.0)
    assert worst <= bound
    assert parity(trajs, *base, 1.0)[0] > 10 * bound  # no longer the old weights
    log_text = Path(service.log_path).read_text()
    assert f"weights v{before.version + 1} in place (weight transfer, {len(pushed)} tensors)" in log_text


def test_a_push_with_samples_in_flight_reports_both_versions(
        service: ServiceAddress, client: RolloutClient, tiny_model_dir: Path, base, tmp_path: Path,
        restores_base_weights) -> None:
    """Only lm_head changes, so every position's keys and values are the same under both weights: each served
    token's log-prob equals (float32 bound) the old weights' before one point of the sample and the new ones' after
    it (tests/rollout/test_swap_inplace.py checks the UpdateWeights route the same way)."""
    v0 = client.info().version
    aborted = client.info().counters.aborted_requests
    trajs: list[pb.Trajectory] = []
    stop = threading.Event()

    def sample(base_seed: int) -> None:
        k = 0
        while not stop.is_set():
            trajs.extend(client.generate(["hello world"], n=8, temperature=1.0, max_new_tokens=240,
                                         seed=base_seed + k))
            k += 1

    samplers = [threading.Thread(target=sample, args=(1000 * (i + 1),)) for i in range(3)]
    for t in samplers:
        t.start()
    try:
        wait_until(lambda: client.info().counters.running_requests > 0 or not all(t.is_alive() for t in samplers),
                   120, "the samples to reach the engine")
        report = trainer(service, tiny_model_dir, tmp_path / "pushed.safetensors", mode="head", seed=3)
    finally:
        stop.set()
        for t in samplers:
            t.join(300)
    assert report.get("version") == v0 + 1, report
    assert client.info().counters.aborted_requests == aborted
    assert all(t.finish_reason != pb.FINISH_REASON_ABORT for t in trajs)
    assert {t.policy_version for t in trajs} <= {v0, v0 + 1} and v0 in {t.policy_version for t in trajs}
    assert all(v0 <= t.policy_version <= t.last_policy_version <= v0 + 1 for t in trajs)
    pushed = load_file(str(tmp_path / "pushed.safetensors"))
    new32, new64 = _model(tiny_model_dir, torch.float32, pushed), _model(tiny_model_dir, torch.float64, pushed)
    seqs = [(list(t.prompt_token_ids), list(t.completion_token_ids)) for t in trajs]
    bound = max(float32_logprob_bound(seqs, *base, 1.0), float32_logprob_bound(seqs, new32, new64, 1.0))
    mixed = 0
    for t, (prompt, completion) in zip(trajs, seqs, strict=True):
        served = torch.tensor(list(t.logprobs), dtype=torch.float64)
        is_old = (served - reference_logprobs(base[1], prompt, completion, 1.0)[0]).abs() <= bound
        is_new = (served - reference_logprobs(new64, prompt, completion, 1.0)[0]).abs() <= bound
        k = int(is_old.logical_not().nonzero()[0]) if not bool(is_old.all()) else len(completion)
        assert bool(is_old[:k].all()) and bool(is_new[k:].all()), (t.sample_index, k)
        if k < len(completion):
            assert t.last_policy_version == v0 + 1  # its later tokens came from the pushed weights
        if t.policy_version == v0 + 1:
            assert bool(is_new.all())
        mixed += 0 < k < len(completion)
    assert mixed >= 1  # samples were in flight across the push and went on under the new weights


def test_refusals_leave_the_old_weights_serving(client: RolloutClient, base, restores_base_weights) -> None:
    """Wrong version, another run, a chunk outside a session, a chunk naming no tensor of the served model (its
    tensors are still received, so the sender's broadcast completes), a wrong backend: each refused with its code,
    and the old weights serve on (no chunk reached the model)."""
    from forkrl.training.transfer_route import lockstep_source
    from forkrl.weights.transfer_gloo import GlooTrainerInitInfo, GlooTrainerWeightTransferEngine, _broadcast

    client.update_weights(base[0].state_dict(), client.info().version + 1, run_id=RUN)  # RUN holds the lease
    version = client.info().version

    def code(fn) -> tuple[grpc.StatusCode, str]:  # noqa: ANN001
        with pytest.raises(grpc.RpcError) as e:
            fn()
        return e.value.code(), e.value.details()

    assert code(lambda: client.init_weight_transfer(RUN, "nccl", "127.0.0.1", 1, 2, 1))[0] == \
        grpc.StatusCode.INVALID_ARGUMENT
    c, msg = code(lambda: client.update_weight_chunk(RUN, version + 1, ["x"], ["float32"], [[1]]))
    assert c == grpc.StatusCode.FAILED_PRECONDITION and "StartWeightUpdate first" in msg
    sync = RolloutWeightSync([client], RUN, "gloo", [1])
    engine = GlooTrainerWeightTransferEngine.trainer_init(GlooTrainerInitInfo("127.0.0.1", 0, 2, rank=0),
                                                          client=sync, source=lockstep_source(base[0], lambda: None))
    try:
        assert code(lambda: client.start_weight_update(RUN, version))[0] == grpc.StatusCode.ABORTED  # stale
        c, msg = code(lambda: client.start_weight_update(RUN, version + 2))
        assert c == grpc.StatusCode.FAILED_PRECONDITION and f"served version + 1 = {version + 1}" in msg
        c, msg = code(lambda: client.start_weight_update("another-run", version + 1))
        assert c == grpc.StatusCode.FAILED_PRECONDITION and f"leased to run {RUN!r}" in msg
        c, msg = code(lambda: client.init_weight_transfer("another-run", "gloo", "127.0.0.1", 1, 2, 1))
        assert c == grpc.StatusCode.FAILED_PRECONDITION and f"leased to run {RUN!r}" in msg
        # a session, then a chunk naming a tensor the model does not have, broadcast all the same
        client.start_weight_update(RUN, version + 1)
        c, msg = code(lambda: client.start_weight_update(RUN, version + 1))  # one session at a time
        assert c == grpc.StatusCode.FAILED_PRECONDITION and "is in progress" in msg
        bogus = torch.ones(3, 5)
        errors: list[BaseException] = []

        def refused_chunk() -> None:
            try:
                client.update_weight_chunk(RUN, version + 1, ["model.no_such.weight"], ["float32"], [[3, 5]])
            except grpc.RpcError as e:
                errors.append(e)

        t = threading.Thread(target=refused_chunk)
        t.start()
        _broadcast(engine.group, bogus)  # returns once the service's worker received it
        t.join(300)
        assert errors and errors[0].code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "no tensor of that name in the served model" in errors[0].details()
        # the refusal ended the session (nothing reached the model: the old weights serve on) and the group
        c, msg = code(lambda: client.finish_weight_update(RUN, version + 1))
        assert c == grpc.StatusCode.FAILED_PRECONDITION and "no weight update in progress" in msg
        c, msg = code(lambda: client.start_weight_update(RUN, version + 1))
        assert c == grpc.StatusCode.FAILED_PRECONDITION and "InitWeightTransfer first" in msg
        # a new group; a session aborted before any chunk leaves the old weights too
        engine.shutdown()
        engine = GlooTrainerWeightTransferEngine.trainer_init(
            GlooTrainerInitInfo("127.0.0.1", 0, 2, rank=0), client=sync, source=lockstep_source(base[0], lambda: None))
        client.start_weight_update(RUN, version + 1)
        assert client.abort_weight_update(RUN, version + 1) is True
        assert client.abort_weight_update(RUN, version + 1) is False
    finally:
        engine.shutdown()
        sync.shutdown()
    assert client.info().version == version and client.health() == SERVING
    trajs = list(client.generate(PROMPTS, n=4, temperature=1.0, max_new_tokens=24, seed=9))
    assert {t.policy_version for t in trajs} == {version}
    worst, bound = parity(trajs, *base, 1.0)
    assert worst <= bound


def test_an_inf_is_refused_and_the_weights_are_broken_until_a_good_push(
        service: ServiceAddress, client: RolloutClient, tiny_model_dir: Path, tmp_path: Path,
        restores_base_weights) -> None:
    version = client.info().version
    report = trainer(service, tiny_model_dir, tmp_path / "bad.safetensors", mode="inf")
    assert report.get("code") == "INVALID_ARGUMENT" and f"tensor {INF_TENSOR!r} holds NaN or inf" in \
        report["details"], report
    assert client.info().version == version and client.health() == NOT_SERVING
    with pytest.raises(grpc.RpcError) as e:
        list(client.generate(PROMPTS, n=1, max_new_tokens=4, timeout_s=60))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "ended half-way" in e.value.details()
    good = trainer(service, tiny_model_dir, tmp_path / "good.safetensors", seed=5)
    assert good.get("version") == version + 1, good
    assert client.health() == SERVING
    pushed = load_file(str(tmp_path / "good.safetensors"))
    trajs = list(client.generate(PROMPTS, n=4, temperature=1.0, max_new_tokens=24, seed=9))
    worst, bound = parity(trajs, _model(tiny_model_dir, torch.float32, pushed),
                          _model(tiny_model_dir, torch.float64, pushed), 1.0)
    assert worst <= bound


def test_a_trainer_that_dies_mid_push_leaves_the_engine_running_and_the_weights_broken(
        service: ServiceAddress, client: RolloutClient, tiny_model_dir: Path, tmp_path: Path,
        restores_base_weights) -> None:
    """The trainer exits after its first chunk: after --transfer-timeout-s without a call the session ends, the
    engine resumes (a sample then ends at once, FAILED_PRECONDITION), the weights are broken until a good push."""
    version = client.info().version
    report = trainer(service, tiny_model_dir, tmp_path / "half.safetensors", mode="abandon")
    assert "abandoned_after" in report, report
    wait_until(lambda: client.health() == NOT_SERVING, 10 * TIMEOUT_S, "the abandoned session to end")
    assert client.info().version == version
    with pytest.raises(grpc.RpcError) as e:
        list(client.generate(PROMPTS, n=1, max_new_tokens=4, timeout_s=60))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "no call for" in e.value.details()
    assert "abandoned" in Path(service.log_path).read_text()
    good = trainer(service, tiny_model_dir, tmp_path / "good.safetensors", seed=6)
    assert good.get("version") == version + 1 and client.health() == SERVING


def test_an_intruder_on_the_weight_channel_gets_nothing_loaded(
        service: ServiceAddress, client: RolloutClient, tiny_model_dir: Path, base, tmp_path: Path,
        restores_base_weights) -> None:
    """During a real push, a store client with no credentials finds neither the group's secret nor a chunk's digest
    in the rendezvous store, and a chunk altered between the sender's digest and the socket is refused by the
    worker before any of it loads: the push fails, the old weights serve on (their log-probs), and the trainer's
    next push (a new group, a new secret) serves the trainer's weights."""
    version = client.info().version
    report = trainer(service, tiny_model_dir, tmp_path / "tampered.safetensors", mode="tamper", seed=4)
    seen = report["intruder"]
    assert seen["altered"] == TAMPER_TENSOR and seen["keys"], report  # it reached the store during the push
    assert report.get("code") == "FAILED_PRECONDITION" and "does not match the digest" in report["details"], report
    assert not seen["secret_in_store"] and not seen["digest_in_store"], report
    assert "the old weights serve on" in report["details"] and report["health"] == SERVING
    assert client.info().version == version and client.health() == SERVING
    trajs = list(client.generate(PROMPTS, n=4, temperature=1.0, max_new_tokens=24, seed=9))
    assert {t.policy_version for t in trajs} == {version}
    worst, bound = parity(trajs, *base, 1.0)
    assert worst <= bound  # nothing of the altered chunk, nor of any after it, was loaded
    good = trainer(service, tiny_model_dir, tmp_path / "good.safetensors", seed=4)
    assert good.get("version") == version + 1, good
    pushed = load_file(str(tmp_path / "good.safetensors"))
    trajs = list(client.generate(PROMPTS, n=4, temperature=1.0, max_new_tokens=24, seed=9))
    worst, bound = parity(trajs, _model(tiny_model_dir, torch.float32, pushed),
                          _model(tiny_model_dir, torch.float64, pushed), 1.0)
    assert worst <= bound
