"""The rollout service end to end: `python -m rollout_service` over real gRPC with the real vLLM engine.

One service per module (vLLM's engine start ~15 s). The model is the embedded tiny model when
`forkrl.models.tiny` exists, else (or with FORKRL_TEST_RANDOM_MODEL=1) a random Llama built here: any local HF
checkpoint directory must work. References are transformers forward passes with teacher forcing: float64 for the
exact values, float32 for the size of float32 rounding (tests/numerics.py).

Order independence: versions and counters are compared before/after inside each test, and every test
that changes the served weights restores the base model afterwards (`restores_base_weights`), so each
test starts from a service that serves the checkpoint it was started with, whatever ran before.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from safetensors.torch import save_file

from forkrl.remote.channel import grpc_channel
from forkrl.remote.rollout import RolloutClient
from forkrl.weights.chunks import pack_state_dict
from forkrl.wire.rollout.v1 import rollout_pb2 as pb
from forkrl.wire.rollout.v1 import rollout_pb2_grpc as pb_grpc
from tests.numerics import logprob_parity
from tests.service_fixtures import ServiceAddress, build_random_llama, start_rollout_service, wait_until

pytestmark = pytest.mark.slow

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
# An in-distribution prompt (the tiny model answers in ~8 tokens) and an out-of-distribution one (runs
# long): samples of one call finish far apart, which is what the streaming test needs.
PROMPTS: list[str | list[int]] = ["12+34+5=", "hello world"]


@pytest.fixture(scope="module")
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    if os.environ.get("FORKRL_TEST_RANDOM_MODEL") != "1":
        try:
            import forkrl.models.tiny  # noqa: F401

            return request.getfixturevalue("tiny_model_dir")
        except (ImportError, pytest.FixtureLookupError):
            pass
    return build_random_llama(tmp_path_factory.mktemp("random-llama"))


@pytest.fixture(scope="module")
def staging(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("staging")


@pytest.fixture(scope="module")
def service(model_dir: Path, staging: Path) -> Iterator[ServiceAddress]:
    # expect_clean_stop: the module's teardown checks that SIGTERM stops the service and its engine.
    # swap_mode drain: test_health_is_not_serving_during_a_swap checks the drain; the default, inplace, is
    # tested against the real engine in test_swap_inplace.py
    with start_rollout_service(model_dir, seed=0, kv_cache_gib=1, staging_dir=staging, swap_mode="drain",
                               log_path=staging.parent / "rollout.log",
                               expect_clean_stop=True) as address:
        yield address


@pytest.fixture(scope="module")
def client(service: ServiceAddress) -> Iterator[RolloutClient]:
    c = RolloutClient(service, timeout_s=120)
    c.wait_ready(60)
    yield c
    c.close()


@pytest.fixture(scope="module")
def hf(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf64(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture
def restores_base_weights(client: RolloutClient, hf: torch.nn.Module) -> Iterator[None]:
    """For tests that change the served weights: afterwards the service serves the base model again (at
    a new version), so the next test finds the weights every test starts from."""
    yield
    client.update_weights(hf.state_dict(), client.info().version + 1)
    assert client.health() == SERVING


def parity(trajs: list[pb.Trajectory], model32: torch.nn.Module, model64: torch.nn.Module, t: float) -> tuple:
    """(max |served logp - exact logp|, the float32 bound for it): see tests/numerics.py."""
    return logprob_parity(
        [list(x.logprobs) for x in trajs],
        [(list(x.prompt_token_ids), list(x.completion_token_ids)) for x in trajs],
        model32, model64, t,
    )


def perturbed(model: torch.nn.Module, scale: float, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * v.std() * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}


def model_with(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    import copy

    m = copy.deepcopy(model)
    m.load_state_dict(state)  # cast into the model's dtype: float32 weights are exact in float64
    return m


def fingerprint(client: RolloutClient) -> list[tuple[int, int, list[int], list[float], int]]:
    """Seeded samples: identical before and after anything that must not change the weights."""
    ts = client.generate(PROMPTS, n=2, temperature=1.0, max_new_tokens=12, seed=123)
    return sorted(
        (t.prompt_index, t.sample_index, list(t.completion_token_ids), list(t.logprobs), t.policy_version)
        for t in ts
    )


def test_generate_streams_every_sample_with_hf_logprobs(client: RolloutClient, hf, hf64, tokenizer):
    n, max_new = 16, 120
    version = client.info().version
    trajs, running_at_first = [], None
    for t in client.generate(PROMPTS, n=n, temperature=1.0, max_new_tokens=max_new, seed=0):
        if not trajs:
            # Streamed, not batched at the end: when the first sample arrives the engine still runs others.
            running_at_first = client.info().counters.running_requests
        trajs.append(t)
    assert len(trajs) == len(PROMPTS) * n
    assert sorted((t.prompt_index, t.sample_index) for t in trajs) == [
        (i, j) for i in range(2) for j in range(n)
    ]
    lengths = [len(t.completion_token_ids) for t in trajs]
    assert lengths[0] < max(lengths) and running_at_first > 0
    for t in trajs:
        assert t.policy_version == version and len(t.logprobs) == len(t.completion_token_ids) > 0
        if t.finish_reason == pb.FINISH_REASON_LENGTH:
            assert len(t.completion_token_ids) == max_new
        else:
            assert (
                t.finish_reason == pb.FINISH_REASON_STOP
                and t.completion_token_ids[-1] == tokenizer.eos_token_id
            )
        assert list(t.prompt_token_ids) == tokenizer(PROMPTS[t.prompt_index]).input_ids
    worst, bound = parity(trajs, hf, hf64, 1.0)
    assert worst <= bound, f"max |dlogp| {worst:.3g} over {sum(lengths)} tokens exceeds the float32 bound {bound:.3g}"


def test_logprobs_at_temperature_07_and_seeded_repeat(client: RolloutClient, hf, hf64):
    ids_prompt = [list(x) for x in [[1, 20, 21, 22], [1, 30]]]  # token-id prompts
    a = list(client.generate(ids_prompt, n=4, temperature=0.7, max_new_tokens=24, seed=5))
    worst, bound = parity(a, hf, hf64, 0.7)
    assert worst <= bound
    assert parity(a, hf, hf64, 1.0)[0] > 10 * bound  # the logprobs really are at T = 0.7
    b = list(client.generate(ids_prompt, n=4, temperature=0.7, max_new_tokens=24, seed=5))
    key = lambda t: (t.prompt_index, t.sample_index)  # noqa: E731
    assert [list(t.completion_token_ids) for t in sorted(a, key=key)] == [
        list(t.completion_token_ids) for t in sorted(b, key=key)
    ]


def test_large_seeded_batch_survives_chunked_scheduling(client: RolloutClient, tokenizer):
    """More prompt tokens than one engine step takes (2048 by default): on vLLM's CPU backend, chunked
    prefill of a seeded request calls `set_offset` on a CPU generator, which kills the engine core."""
    max_len = client.info().engine.max_model_len
    digits = tokenizer("0123456789", add_special_tokens=False).input_ids
    prompts = [[digits[(i * 7 + k) % 10] for k in range(max_len - 8)] for i in range(32)]
    trajs = list(client.generate(prompts, n=1, temperature=1.0, max_new_tokens=4, seed=11))
    assert len(trajs) == 32 and sum(len(t.prompt_token_ids) for t in trajs) > 3 * 2048


def test_bad_inputs_are_invalid_argument(client: RolloutClient):
    info = client.info()
    limit, max_len = info.vocab_size, info.engine.max_model_len
    cases = [
        ({"n": 0}, "sampling.n must be > 0, got 0"),
        ({"temperature": -1.0}, "sampling.temperature must be >= 0, got -1"),
        (
            {"prompts": [[1, limit]]},
            f"prompts[0].token_ids[1] must be in [0, {limit}) (the vocabulary), got {limit}",
        ),
        (
            {"prompts": [[1, 2, 3]], "max_new_tokens": max_len},
            f"prompts[0] has 3 tokens: 3 + sampling.max_new_tokens {max_len} exceeds max_model_len {max_len}",
        ),
    ]
    for kwargs, message in cases:
        args = {"prompts": [[1, 2]], "n": 1, "max_new_tokens": 4} | kwargs
        with pytest.raises(grpc.RpcError) as e:
            list(client.generate(**args))
        assert (e.value.code(), e.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, message)


def test_update_weights_serves_the_new_weights(client: RolloutClient, hf, hf64, restores_base_weights):
    info = client.info()
    version, reloads = info.version, info.counters.weight_reloads
    new_state = perturbed(hf, 0.3, seed=1)
    assert client.update_weights(new_state, version + 1, chunk_bytes=256 << 10) == version + 1  # many chunks
    resp = client.last_weights_response
    assert resp.bytes_received == sum(v.numel() * 4 for v in new_state.values())
    trajs = list(client.generate(PROMPTS, n=4, temperature=1.0, max_new_tokens=24, seed=9))
    assert {t.policy_version for t in trajs} == {version + 1}
    worst, bound = parity(trajs, model_with(hf, new_state), model_with(hf64, new_state), 1.0)
    assert worst <= bound
    assert parity(trajs, hf, hf64, 1.0)[0] > 10 * bound  # and no longer the old weights
    assert client.info().counters.weight_reloads == reloads + 1


def test_load_weights_serves_the_checkpoint(client: RolloutClient, hf, hf64, tmp_path: Path,
                                            restores_base_weights):
    version = client.info().version
    new_state = perturbed(hf, 0.3, seed=2)
    save_file({k: v.contiguous() for k, v in new_state.items()}, str(tmp_path / "model.safetensors"))
    assert client.load_weights(str(tmp_path), version + 1) == version + 1
    trajs = list(client.generate(PROMPTS, n=4, temperature=0.7, max_new_tokens=24, seed=9))
    assert {t.policy_version for t in trajs} == {version + 1}
    worst, bound = parity(trajs, model_with(hf, new_state), model_with(hf64, new_state), 0.7)
    assert worst <= bound


def test_a_truncated_checkpoint_is_refused_before_the_engine(client: RolloutClient, hf, hf64, tmp_path: Path):
    """A checkpoint whose data section was cut in half passes the header checks of LoadWeights; the check of every
    tensor's bytes (and of their values) refuses it before the engine is touched: INVALID_ARGUMENT naming the
    tensor, the old weights serve on. (A reload that fails inside the engine all the same leaves the service
    NOT_SERVING until a good push: test_server_plumbing.py, and for the weight-transfer route
    test_weight_transfer.py.)"""
    info = client.info()
    version, rejected = info.version, info.counters.rejected_weight_updates
    bad = tmp_path / "truncated"
    bad.mkdir()
    save_file({k: v.contiguous() for k, v in perturbed(hf, 0.3, seed=5).items()}, str(bad / "model.safetensors"))
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(grpc.RpcError) as e:
        client.load_weights(str(bad), version + 1)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "a truncated file?" in e.value.details()
    assert client.health() == SERVING
    info = client.info()
    assert info.version == version and info.counters.rejected_weight_updates == rejected + 1
    trajs = list(client.generate(PROMPTS, n=4, temperature=1.0, max_new_tokens=24, seed=9))
    assert {t.policy_version for t in trajs} == {version}
    worst, bound = parity(trajs, hf, hf64, 1.0)
    assert worst <= bound


def test_failed_updates_keep_the_old_weights(client: RolloutClient, service: ServiceAddress, hf, staging: Path):
    info = client.info()
    before, version = fingerprint(client), info.version
    rejected = info.counters.rejected_weight_updates
    metas, total, sha, chunks = pack_state_dict(perturbed(hf, 0.5, seed=3), chunk_bytes=64 << 10)
    chunks = list(chunks)
    release = threading.Event()

    def messages(sha256: str, target: int, n_chunks: int | None = None, hang: bool = False):
        header = pb.WeightsHeader(
            target_version=target,
            tensors=[pb.TensorMeta(**m) for m in metas],
            total_bytes=total,
            sha256=sha256,
        )
        yield pb.UpdateWeightsRequest(header=header)
        for c in chunks[:n_chunks]:
            yield pb.UpdateWeightsRequest(chunk=c)
        if hang:
            release.wait(600)

    try:
        with grpc_channel(service) as ch:
            stub = pb_grpc.RolloutServiceStub(ch)
            corrupt = ("f" if sha[0] != "f" else "0") + sha[1:]
            with pytest.raises(grpc.RpcError) as e:
                stub.UpdateWeights(messages(corrupt, version + 1), timeout=60)
            assert e.value.code() == grpc.StatusCode.DATA_LOSS and "sha256" in e.value.details()
            with pytest.raises(grpc.RpcError) as e:
                stub.UpdateWeights(messages(sha, version), timeout=60)
            assert e.value.code() == grpc.StatusCode.ABORTED
            # aborted stream: half the chunks, then the client cancels while the service stages them
            fut = stub.UpdateWeights.future(
                messages(sha, version + 1, n_chunks=len(chunks) // 2, hang=True), timeout=600
            )
            wait_until(lambda: any(staging.iterdir()), 300, "the service to stage the pushed chunks")
            fut.cancel()
            wait_until(lambda: client.info().counters.rejected_weight_updates == rejected + 3, 300,
                       "the service to count the cancelled update")
    finally:
        release.set()
    assert client.info().version == version
    assert fingerprint(client) == before
    wait_until(lambda: not any(staging.iterdir()), 300, "the staging file to be removed")


def test_non_finite_weights_are_refused_and_the_old_ones_keep_serving(client: RolloutClient, hf, hf64,
                                                                      tmp_path: Path):
    """An inf in one tensor of a push, a NaN in one of a checkpoint: INVALID_ARGUMENT naming the tensor, the version
    stays, and Generate still samples with the old weights' log-probs (float32 bound)."""
    info = client.info()
    version, rejected = info.version, info.counters.rejected_weight_updates
    name = next(k for k in hf.state_dict() if k.endswith("mlp.down_proj.weight"))
    pushed = perturbed(hf, 0.3, seed=8)
    pushed[name][1, 2] = float("inf")
    with pytest.raises(grpc.RpcError) as e:
        client.update_weights(pushed, version + 1)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and f"tensor {name!r} holds NaN or inf" in \
        e.value.details()
    pushed[name][1, 2] = float("nan")
    save_file({k: v.contiguous() for k, v in pushed.items()}, str(tmp_path / "model.safetensors"))
    with pytest.raises(grpc.RpcError) as e:
        client.load_weights(str(tmp_path), version + 1)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and f"tensor {name!r} holds NaN or inf" in \
        e.value.details()
    info = client.info()
    assert info.version == version and info.counters.rejected_weight_updates == rejected + 2
    assert client.health() == SERVING
    trajs = list(client.generate(PROMPTS, n=4, temperature=1.0, max_new_tokens=24, seed=9))
    assert {t.policy_version for t in trajs} == {version}
    worst, bound = parity(trajs, hf, hf64, 1.0)
    assert worst <= bound


def test_cancel_aborts_the_engine_requests(client: RolloutClient):
    before = client.info().counters.aborted_requests
    stream = client.generate(PROMPTS, n=32, temperature=1.0, max_new_tokens=200, seed=1)
    next(stream)
    stream.close()  # cancels the RPC: the service must abort what is still running
    wait_until(lambda: client.info().counters.running_requests == 0, 300, "the engine to be idle")
    assert client.info().counters.aborted_requests > before


def test_health_is_not_serving_during_a_swap(client: RolloutClient, service: ServiceAddress, hf,
                                              restores_base_weights):
    statuses: list[int] = []
    with grpc_channel(service) as ch:
        watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=""), timeout=120)

        def collect() -> None:
            try:
                for r in watch:
                    statuses.append(r.status)
            except grpc.RpcError:  # cancelled below
                pass

        watcher = threading.Thread(target=collect, daemon=True)
        watcher.start()
        # a long generation in flight: the swap waits for it (drain) with health NOT_SERVING
        inflight: list[pb.Trajectory] = []
        gen = threading.Thread(
            target=lambda: inflight.extend(
                client.generate(PROMPTS, n=32, temperature=1.0, max_new_tokens=200, seed=2)
            )
        )
        version = client.info().version
        try:
            wait_until(lambda: statuses, 300, "the first health status")
            gen.start()
            wait_until(lambda: client.info().counters.running_requests > 0 or not gen.is_alive(), 300,
                       "the generation to reach the engine")
            assert client.update_weights(perturbed(hf, 0.1, seed=4), version + 1) == version + 1
            gen.join(120)
            wait_until(lambda: statuses[-1] == SERVING, 300, "SERVING after the swap")
        finally:
            watch.cancel()
            watcher.join(5)
    assert statuses[0] == SERVING and NOT_SERVING in statuses
    assert len(inflight) == 64 and {t.policy_version for t in inflight} == {version}  # never mixed
    assert {t.last_policy_version for t in inflight} == {version}
    assert client.last_weights_response.drain_s > 0


def test_info_reports_engine_and_counters(client: RolloutClient, model_dir: Path, hf):
    info = client.info()
    assert info.model == str(model_dir)
    assert info.engine.dtype == "float32" and info.engine.logprobs_mode == "processed_logprobs"
    assert info.engine.backend == "vllm"
    assert info.engine.kv_cache_gib == 1 and info.engine.enforce_eager and info.engine.engine_mode == "uni"
    assert info.engine.weight_transfer_backend == "gloo" and info.engine.vllm_version
    c0 = info.counters
    trajs = list(client.generate(PROMPTS, n=3, temperature=1.0, max_new_tokens=8, seed=4))
    assert client.update_weights(hf.state_dict(), info.version + 1) == info.version + 1  # the same weights
    after = client.info()
    c1 = after.counters
    assert after.version == info.version + 1
    assert (c1.requests - c0.requests, c1.samples - c0.samples, c1.weight_reloads - c0.weight_reloads) == (1, 6, 1)
    assert c1.generated_tokens - c0.generated_tokens == sum(len(t.completion_token_ids) for t in trajs)
    assert c1.prompt_tokens - c0.prompt_tokens == sum(len(t.prompt_token_ids) for t in trajs)
    assert c1.rejected_weight_updates == c0.rejected_weight_updates and c1.running_requests == 0


@pytest.mark.isolated  # its own service
def test_dead_engine_core_takes_the_service_down(model_dir: Path, tmp_path: Path):
    """kill -9 of vLLM's engine-core process: the service must not keep answering SERVING for a dead
    engine; a health watcher sees it go NOT_SERVING, and it exits with status 1 so Docker or the launcher sees
    the failure."""
    with start_rollout_service(model_dir, log_path=tmp_path / "rollout.log", staging_dir=tmp_path / "staging") \
            as service:
        proc = service.process
        statuses: list[int] = []

        def watch() -> None:
            with grpc_channel(service) as ch:
                try:
                    for r in health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=""),
                                                                  timeout=300):
                        statuses.append(r.status)
                except grpc.RpcError:  # the service went away
                    pass

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        wait_until(lambda: SERVING in statuses, 120, "the watcher's first SERVING")
        children = []
        for p in Path("/proc").glob("[0-9]*/stat"):
            try:
                if p.read_text().rsplit(")", 1)[1].split()[1] == str(proc.pid):
                    children.append(int(p.parent.name))
            except OSError:  # a process that ended while we looked
                continue
        cores = [pid for pid in children if b"EngineCore" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert cores, "no engine-core child process found"
        os.kill(cores[0], signal.SIGKILL)
        assert proc.wait(timeout=300) == 1
        watcher.join(120)
    assert NOT_SERVING in statuses[statuses.index(SERVING):]
