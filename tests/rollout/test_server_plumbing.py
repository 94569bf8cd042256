"""Rollout service plumbing with a fake inference backend: the real gRPC server, RolloutEngine (validation,
gate, versions, weight staging) and RolloutClient; only vLLM is replaced. Model behaviour (logprobs,
reloads that change the samples) is tested against the real engine in test_rollout_service.py.

Nothing here depends on timing: the fake backend finishes a sample at once unless the test holds it at
`sample_gate`, and a reload waits at `reload_gate` while the test looks. Every wait is on observable
state (`wait_until`). Tests that break a server (a failed reload, the load gate) get their own; the
shared one is only ever left as it was found, and counters are compared before/after within a test.
"""

from __future__ import annotations

import asyncio
import hashlib
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2
from safetensors.torch import load_file, save_file

from forkrl.remote.channel import grpc_channel
from forkrl.remote.rollout import RolloutClient
from forkrl.seeds import sample_seed
from forkrl.weights.chunks import pack_state_dict
from forkrl.weights.safetensors import checkpoint_files
from forkrl.wire.rollout.v1 import rollout_pb2 as pb
from forkrl.wire.rollout.v1 import rollout_pb2_grpc as pb_grpc
from rollout_service.config import RolloutSettings
from rollout_service.server import build_server
from rollout_service.types import Completion, SamplingSpec
from tests.service_fixtures import REPO_ROOT, wait_until

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
MODEL = {"embed.weight": torch.randn(50, 8), "norm.weight": torch.ones(8)}
MODEL_BYTES = sum(v.numel() * 4 for v in MODEL.values())  # 1632
SECRET = "3c" * 32  # a weight-transfer group's secret (forkrl/weights/transfer_gloo.py)


class FakeBackend:
    """Deterministic completions, finished at once unless held. Samples with index >= `hold_from_sample`
    wait until `sample_gate` is set; a reload waits at `reload_gate` when set, and raises `fail_reload`
    when set (after it has read the staged file, like a reload that fails half-way). Both gates are asyncio
    Events on the server loop: create and set them with `ServerThread.event()` / `ServerThread.set()`."""

    vocab_size = vocab_limit = 50
    eos_token_id = 2
    max_model_len = 64

    def __init__(self, model: str) -> None:
        self.model = model
        self.engine_settings = {"dtype": "float32", "device": "fake", "engine_mode": "fake",
                                "weight_transfer_backend": "gloo", "weight_transfer_workers": 1}
        self.running: set[str] = set()
        self.finished: list[str] = []
        self.aborted: list[str] = []
        self.encoded: list[str] = []
        self.reloaded: list[dict[str, torch.Tensor]] = []
        self.reloads_started = 0
        self.reloads_keep_running: list[bool] = []
        self.hold_from_sample: int | None = None
        self.sample_gate: asyncio.Event | None = None
        self.reload_gate: asyncio.Event | None = None
        self.fail_reload: Exception | None = None
        self.fail_update: Exception | None = None  # raised by the next weight-transfer chunk (then cleared)
        self.dead = False
        self.transfer_calls: list[tuple[str, Any]] = []  # vLLM's weight-transfer API, in call order

    def encode(self, text: str) -> list[int]:
        self.encoded.append(text)
        return [4 + ord(c) % 40 for c in text]

    async def generate_one(self, rid: str, ids: list[int], spec: SamplingSpec, seed: int | None) -> Completion:
        self.running.add(rid)
        try:
            j = int(rid.rsplit("-", 1)[1])
            if self.hold_from_sample is not None and j >= self.hold_from_sample and self.sample_gate is not None:
                await self.sample_gate.wait()
            toks = [(seed or 0) % 50] * spec.max_new_tokens
            self.finished.append(rid)
            return Completion(toks, "x" * len(toks), [-0.5] * len(toks), "length")
        finally:
            self.running.discard(rid)

    async def abort(self, request_ids: list[str]) -> None:
        self.aborted += request_ids

    async def reload(self, path: str, *, keep_running: bool = False, before_resume: Any = None) -> None:
        self.reloads_started += 1
        self.reloads_keep_running.append(keep_running)
        if self.reload_gate is not None:
            await self.reload_gate.wait()
        files = checkpoint_files(path)
        if not files:  # what the vLLM worker extension does
            raise FileNotFoundError(f"no *.safetensors under {path}")
        state = {k: v for f in files for k, v in load_file(f).items()}
        if self.fail_reload is not None:
            raise self.fail_reload
        self.reloaded.append(state)
        if before_resume is not None:
            before_resume()

    async def init_weight_transfer(self, init_info: dict) -> None:
        self.transfer_calls.append(("init", init_info))

    async def start_weight_update(self) -> None:
        self.transfer_calls.append(("start", None))

    async def update_weights(self, update_info: dict) -> None:
        self.transfer_calls.append(("update", update_info))
        error, self.fail_update = self.fail_update, None
        if error is not None:
            raise error

    async def finish_weight_update(self, version: int, before_resume: Any) -> None:
        self.transfer_calls.append(("finish", version))
        before_resume()

    async def abort_weight_update(self) -> None:
        self.transfer_calls.append(("abort", None))

    async def shutdown_weight_transfer(self) -> None:
        self.transfer_calls.append(("shutdown", None))

    def num_unfinished(self) -> int:
        return len(self.running)

    def errored(self) -> bool:
        return self.dead

    def shutdown(self) -> None:
        pass


class ServerThread:
    """The real grpc.aio server on its own event loop in a thread. The engine starts when `load_gate` is
    set (at once unless `hold_load`)."""

    def __init__(self, model_dir: Path, staging_dir: Path, hold_load: bool = False, swap_mode: str = "drain",
                 **settings: Any) -> None:
        self.settings = RolloutSettings(model=str(model_dir), port=0, staging_dir=str(staging_dir),
                                        allowed_roots=[tempfile.gettempdir()], swap_mode=swap_mode, **settings)
        self.staging_dir = staging_dir
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.backend: FakeBackend | None = None
        self.load_gate = self.event()
        self.server, self.servicer, self.health, self.port = self.run(self._build())
        self.address = f"127.0.0.1:{self.port}"
        if not hold_load:
            self.set(self.load_gate)
            wait_until(lambda: self.servicer.engine is not None, 30, "the fake engine to load")

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=120)

    def event(self) -> asyncio.Event:
        async def make() -> asyncio.Event:
            return asyncio.Event()

        return self.run(make())

    def set(self, event: asyncio.Event) -> None:
        self.loop.call_soon_threadsafe(event.set)

    async def _build(self) -> tuple:
        server, servicer, health, port = build_server(self.settings)
        await servicer.set_serving(False)
        await server.start()

        async def make_backend(settings: RolloutSettings) -> FakeBackend:
            await self.load_gate.wait()
            self.backend = FakeBackend(settings.model)
            return self.backend

        self.load_task = asyncio.ensure_future(servicer.load(make_backend))
        return server, servicer, health, port

    def staged(self) -> list[Path]:
        return list(self.staging_dir.iterdir()) if self.staging_dir.exists() else []

    def stop(self) -> None:
        self.run(self.server.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("fake-model")
    save_file(MODEL, str(d / "model.safetensors"))
    return d


@pytest.fixture
def own_server(model_dir: Path, tmp_path: Path) -> Iterator[ServerThread]:
    """A server of the test's own, for tests that leave it broken or need it before the engine loads."""
    s = ServerThread(model_dir, tmp_path / "staging")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    s = ServerThread(model_dir, tmp_path_factory.mktemp("staging"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server: ServerThread) -> Iterator[RolloutClient]:
    c = RolloutClient(server.address, timeout_s=120)
    c.wait_ready(120)
    yield c
    c.close()


def _code_and_message(fn: Any) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        fn()
    return e.value.code(), e.value.details()


def test_not_serving_and_unavailable_while_loading(model_dir: Path, tmp_path: Path):
    server = ServerThread(model_dir, tmp_path / "staging", hold_load=True)
    try:
        # no retries: UNAVAILABLE comes back at once; the deadline is one only a hang exceeds
        with RolloutClient(server.address, timeout_s=120, max_retries=0) as client:
            assert client.health() == NOT_SERVING
            code, msg = _code_and_message(lambda: client.info(timeout_s=60))
            assert code == grpc.StatusCode.UNAVAILABLE and "loading" in msg
            server.set(server.load_gate)
            client.wait_ready(timeout_s=120)
            assert client.health() == SERVING
            assert client.info().version == 0
    finally:
        server.stop()


def test_streams_every_sample_with_derived_seeds(server: ServerThread, client: RolloutClient):
    version = client.info().version
    ts = list(client.generate(["ab", [5, 6, 7]], n=3, temperature=1.0, max_new_tokens=4, seed=7))
    assert sorted((t.prompt_index, t.sample_index) for t in ts) == [
        (i, j) for i in range(2) for j in range(3)
    ]
    for t in ts:
        assert list(t.completion_token_ids) == [sample_seed(7, t.prompt_index, t.sample_index) % 50] * 4
        assert t.finish_reason == pb.FINISH_REASON_LENGTH and t.policy_version == version
    by_prompt = {t.prompt_index: list(t.prompt_token_ids) for t in ts}
    assert by_prompt == {0: [4 + ord("a") % 40, 4 + ord("b") % 40], 1: [5, 6, 7]}
    # prompt_offsets replace positions in the seed: prompt 0 here samples like prompt 5 of a bigger batch
    (t,) = client.generate([[5]], n=1, max_new_tokens=2, seed=7, prompt_offsets=[5])
    assert t.prompt_index == 0 and list(t.completion_token_ids) == [sample_seed(7, 5, 0) % 50] * 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": 0}, "sampling.n must be > 0, got 0"),
        ({"temperature": -0.5}, "sampling.temperature must be >= 0, got -0.5"),
        ({"temperature": 2.5}, "sampling.temperature must be <= 2 (vLLM's limit), got 2.5"),
        ({"temperature": 0.005}, "sampling.temperature must be 0 (greedy) or >= 0.01, got 0.005"),
        ({"top_p": 0.0}, "sampling.top_p must be in (0, 1], got 0"),
        ({"top_p": 1.5}, "sampling.top_p must be in (0, 1], got 1.5"),
        ({"max_new_tokens": 0}, "sampling.max_new_tokens must be > 0, got 0"),
        (
            {"max_new_tokens": 62},
            "prompts[1] has 3 tokens: 3 + sampling.max_new_tokens 62 exceeds max_model_len 64",
        ),
        ({"prompts": []}, "prompts must not be empty"),
        ({"prompts": ["a", ""]}, "prompts[1].text is empty"),
        ({"prompts": ["a", []]}, "prompts[1].token_ids is empty"),
        ({"prompts": [[1, 50]]}, "prompts[0].token_ids[1] must be in [0, 50) (the vocabulary), got 50"),
        ({"prompts": [[-1]]}, "prompts[0].token_ids[0] must be in [0, 50) (the vocabulary), got -1"),
        ({"stop": ["x", ""]}, "sampling.stop[1] is empty"),
        ({"prompt_offsets": [1]}, "prompt_offsets must be empty or have one entry per prompt (2), got 1"),
    ],
)
def test_generate_rejects_bad_fields(client: RolloutClient, kwargs: dict, message: str):
    args = {"prompts": ["a", [1, 2, 3]], "n": 1, "max_new_tokens": 4} | kwargs
    code, msg = _code_and_message(lambda: list(client.generate(**args)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert msg == message


def test_missing_sampling_and_prompt_without_input(server: ServerThread):
    with grpc_channel(server.address) as ch:
        stub = pb_grpc.RolloutServiceStub(ch)
        for req, message in [
            (pb.GenerateRequest(prompts=[pb.Prompt(text="a")]), "sampling is required"),
            (
                pb.GenerateRequest(prompts=[pb.Prompt()], sampling=pb.SamplingParams(n=1, max_new_tokens=1)),
                "prompts[0] has neither text nor token_ids",
            ),
        ]:
            code, msg = _code_and_message(lambda req=req: list(stub.Generate(req, timeout=60)))
            assert (code, msg) == (grpc.StatusCode.INVALID_ARGUMENT, message)


def test_cancel_aborts_unfinished_samples(server: ServerThread, client: RolloutClient):
    backend = server.backend
    assert backend is not None
    before = client.info().counters
    finished_before, aborted_before = len(backend.finished), len(backend.aborted)
    backend.sample_gate, backend.hold_from_sample = server.event(), 1  # samples 1..3 of each prompt wait
    try:
        stream = client.generate([[1], [2]], n=4, max_new_tokens=4, seed=0)
        assert next(stream).sample_index == 0
        wait_until(lambda: len(backend.finished) == finished_before + 2, 120, "both samples 0 to finish")
        stream.close()  # the client cancels the call with 6 samples still running
        wait_until(lambda: client.info().counters.running_requests == 0, 120, "the engine to be idle")
    finally:
        backend.hold_from_sample = None
        server.set(backend.sample_gate)
    after = client.info().counters
    assert after.aborted_requests - before.aborted_requests == 6
    assert after.samples - before.samples == 2
    assert len(backend.aborted) - aborted_before == 6 and len(backend.finished) == finished_before + 2


def _push(
    stub: pb_grpc.RolloutServiceStub, messages: list[pb.UpdateWeightsRequest]
) -> pb.UpdateWeightsResponse:
    return stub.UpdateWeights(iter(messages), timeout=60)


def _messages(state: dict[str, torch.Tensor], version: int, chunk_bytes: int = 64, **override: Any):
    metas, total, sha, chunks = pack_state_dict(state, chunk_bytes)
    header = pb.WeightsHeader(
        target_version=version, tensors=[pb.TensorMeta(**m) for m in metas], total_bytes=total, sha256=sha
    )
    for k, v in override.items():
        if k == "tensors":
            del header.tensors[:]
            header.tensors.extend(v)
        else:
            setattr(header, k, v)
    return [pb.UpdateWeightsRequest(header=header)] + [pb.UpdateWeightsRequest(chunk=c) for c in chunks]


def test_update_weights_validation(server: ServerThread, client: RolloutClient):
    good = {k: v + 1 for k, v in MODEL.items()}
    info = client.info()
    version, rejected, reloads = info.version, info.counters.rejected_weight_updates, info.counters.weight_reloads
    assert server.backend is not None
    reloaded_before = len(server.backend.reloaded)
    with grpc_channel(server.address) as ch:
        stub = pb_grpc.RolloutServiceStub(ch)
        msgs = _messages(good, version + 1)
        cases = [
            (
                msgs[1:],
                grpc.StatusCode.INVALID_ARGUMENT,
                "the first UpdateWeights message must be the header",
            ),
            ([], grpc.StatusCode.INVALID_ARGUMENT, "the first UpdateWeights message must be the header"),
            (
                _messages(good, version),
                grpc.StatusCode.ABORTED,
                f"target_version must be greater than the served version {version}, got {version}",
            ),
            (
                _messages({**good, "extra": torch.zeros(1)}, version + 1),
                grpc.StatusCode.INVALID_ARGUMENT,
                "header.tensors[2] ('extra'): no tensor of that name in the served model",
            ),
            (
                _messages(
                    {"embed.weight": torch.zeros(50, 9), "norm.weight": good["norm.weight"]}, version + 1
                ),
                grpc.StatusCode.INVALID_ARGUMENT,
                "header.tensors[0] ('embed.weight').shape must be [50, 8] (the served model's), got [50, 9]",
            ),
            (
                _messages({"embed.weight": good["embed.weight"]}, version + 1),
                grpc.StatusCode.INVALID_ARGUMENT,
                "header.tensors lacks 1 tensor(s) of the served model: norm.weight",
            ),
            (
                msgs[:2] + msgs[:1],
                grpc.StatusCode.INVALID_ARGUMENT,
                "a second header arrived after 64 payload bytes",
            ),
            (
                msgs[:-1],
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the stream ended after {MODEL_BYTES - len(msgs[-1].chunk)} of header.total_bytes "
                f"{MODEL_BYTES} bytes",
            ),
            (
                msgs + msgs[-1:],
                grpc.StatusCode.INVALID_ARGUMENT,
                f"received more than header.total_bytes ({MODEL_BYTES}) bytes",
            ),
            (
                _messages(good, version + 1, sha256="0" * 64),
                grpc.StatusCode.DATA_LOSS,
                f"sha256 of the received bytes is {hashlib.sha256(b''.join(m.chunk for m in msgs[1:])).hexdigest()}, "
                f"header.sha256 says {'0' * 64}",
            ),
            (
                _messages(good, version + 1, sha256="xyz"),
                grpc.StatusCode.INVALID_ARGUMENT,
                "header.sha256 must be 64 hex characters, got 'xyz'",
            ),
            (
                _messages(good, version + 1, total_bytes=5),
                grpc.StatusCode.INVALID_ARGUMENT,
                f"header.total_bytes must be {MODEL_BYTES} (the sum of header.tensors[].nbytes), got 5",
            ),
        ]
        for messages, code, message in cases:
            got = _code_and_message(lambda messages=messages: _push(stub, messages))
            assert got == (code, message)
    info = client.info()
    assert info.version == version and info.counters.weight_reloads == reloads
    assert info.counters.rejected_weight_updates == rejected + len(cases)
    assert len(server.backend.reloaded) == reloaded_before
    assert server.staged() == []  # no staging file left behind


def test_cancelled_stream_changes_nothing(server: ServerThread, client: RolloutClient):
    info = client.info()
    version, rejected = info.version, info.counters.rejected_weight_updates
    assert server.backend is not None
    reloads_before = server.backend.reloads_started
    msgs = _messages({k: v * 3 for k, v in MODEL.items()}, version + 1)
    release = threading.Event()

    def slow() -> Iterator[pb.UpdateWeightsRequest]:
        yield from msgs[:3]
        release.wait(30)  # never sends the rest: the call is cancelled meanwhile

    try:
        with grpc_channel(server.address) as ch:
            fut = pb_grpc.RolloutServiceStub(ch).UpdateWeights.future(slow(), timeout=30)
            # the header passed the checks and the service is staging the payload: cancel mid-stream
            wait_until(server.staged, 120, "a staging file")
            fut.cancel()
            wait_until(lambda: client.info().counters.rejected_weight_updates == rejected + 1, 10,
                       "the service to see the cancel")
    finally:
        release.set()
    assert client.info().version == version and server.backend.reloads_started == reloads_before
    wait_until(lambda: server.staged() == [], 120, "the staging file to be removed")


def test_swap_is_not_serving_and_later_generates_wait(server: ServerThread, client: RolloutClient):
    backend = server.backend
    assert backend is not None
    info = client.info()
    version, requests = info.version, info.counters.requests
    new = {k: v * 2 for k, v in MODEL.items()}
    backend.reload_gate = server.event()
    result: dict[str, Any] = {}
    pusher = threading.Thread(
        target=lambda: result.update(v=client.update_weights(new, version + 1, chunk_bytes=100))
    )
    late: list[pb.Trajectory] = []
    gen = threading.Thread(target=lambda: late.extend(client.generate(["a"], n=2, max_new_tokens=1)))
    encoded = len(backend.encoded)
    reloads = backend.reloads_started
    try:
        pusher.start()
        wait_until(lambda: backend.reloads_started == reloads + 1, 120, "the reload to start")
        t_reload_seen = time.perf_counter()
        assert client.health() == NOT_SERVING  # the reload is in progress (held)
        gen.start()
        wait_until(lambda: len(backend.encoded) == encoded + 1, 120, "the Generate call to reach the engine")
        # it is inside the engine but has not passed the gate (requests count once through it)
        assert client.info().counters.requests == requests and not late
    finally:
        t_release = time.perf_counter()
        server.set(backend.reload_gate)
        pusher.join(120)
        gen.join(120)
        backend.reload_gate = None
    assert result["v"] == version + 1 and client.health() == SERVING
    assert [t.policy_version for t in late] == [version + 1] * 2  # sampled after the swap, not before
    staged = backend.reloaded[-1]
    assert staged.keys() == new.keys() and all(torch.equal(staged[k], new[k]) for k in new)
    resp = client.last_weights_response
    # the reload was seen running at t_reload_seen and could only finish after t_release
    assert resp.bytes_received == MODEL_BYTES and resp.apply_s >= t_release - t_reload_seen


def test_a_reload_that_fails_half_way_is_not_serving_until_a_good_push(own_server: ServerThread):
    backend = own_server.backend
    assert backend is not None
    backend.fail_reload = RuntimeError("worker lost the file half-way")
    with RolloutClient(own_server.address, timeout_s=120) as client:
        code, msg = _code_and_message(lambda: client.update_weights({k: v * 2 for k, v in MODEL.items()}, 1))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "worker lost the file half-way" in msg
        # the served weights are unknown: not serving, no samples, the version not bumped
        assert client.health() == NOT_SERVING and client.info().version == 0
        code, msg = _code_and_message(lambda: list(client.generate([[1]], n=1, max_new_tokens=1, timeout_s=60)))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "reload failed half-way" in msg
        # a good push repairs it
        backend.fail_reload = None
        good = {k: v * 3 for k, v in MODEL.items()}
        assert client.update_weights(good, 1) == 1
        assert client.health() == SERVING
        assert [t.policy_version for t in client.generate([[1]], n=2, max_new_tokens=1)] == [1, 1]
        assert torch.equal(backend.reloaded[-1]["norm.weight"], good["norm.weight"])


def test_a_cancel_during_the_reload_still_commits_the_version(own_server: ServerThread):
    """The reload is its own task: a caller that gives up mid-reload does not leave the engine holding
    weights of one version while it reports another."""
    backend = own_server.backend
    assert backend is not None
    new = {k: v * 4 for k, v in MODEL.items()}
    backend.reload_gate = own_server.event()
    with RolloutClient(own_server.address, timeout_s=120) as client, grpc_channel(own_server.address) as ch:
        fut = pb_grpc.RolloutServiceStub(ch).UpdateWeights.future(iter(_messages(new, 1)), timeout=30)
        try:
            wait_until(lambda: backend.reloads_started == 1, 120, "the reload to start")
            rejected = client.info().counters.rejected_weight_updates
            fut.cancel()
            assert fut.cancelled()
            wait_until(lambda: client.info().counters.rejected_weight_updates == rejected + 1, 10,
                       "the service to see the cancel")
            assert client.health() == NOT_SERVING and client.info().version == 0  # still reloading
        finally:
            own_server.set(backend.reload_gate)
        wait_until(lambda: client.health() == SERVING, 120, "SERVING after the reload")
        assert client.info().version == 1
        assert torch.equal(backend.reloaded[-1]["embed.weight"], new["embed.weight"])
        assert [t.policy_version for t in client.generate([[1]], n=1, max_new_tokens=1)] == [1]
    wait_until(lambda: own_server.staged() == [], 120, "the staging file to be removed")


def test_a_cancel_while_draining_still_reloads_the_staged_weights(own_server: ServerThread):
    """Cancel the push while the swap waits for a running sample (the drain): the staged file must
    still be there when the reload starts, or the engine is left without the weights it was promised."""
    backend = own_server.backend
    assert backend is not None
    backend.sample_gate, backend.hold_from_sample = own_server.event(), 0
    new = {k: v * 5 for k, v in MODEL.items()}
    with RolloutClient(own_server.address, timeout_s=120) as client, grpc_channel(own_server.address) as ch:
        sampler = threading.Thread(target=lambda: list(client.generate([[1]], n=1, max_new_tokens=1)))
        sampler.start()
        try:
            wait_until(lambda: backend.running, 120, "a sample in the engine")
            fut = pb_grpc.RolloutServiceStub(ch).UpdateWeights.future(iter(_messages(new, 1)), timeout=30)
            wait_until(lambda: client.health() == NOT_SERVING, 120, "the swap to close the gate")
            rejected = client.info().counters.rejected_weight_updates
            fut.cancel()
            assert fut.cancelled()
            wait_until(lambda: client.info().counters.rejected_weight_updates == rejected + 1, 10,
                       "the service to see the cancel")
            assert backend.reloads_started == 0  # still draining
        finally:
            backend.hold_from_sample = None
            own_server.set(backend.sample_gate)
            sampler.join(120)
        wait_until(lambda: client.health() == SERVING, 120, "SERVING after the reload")
        assert client.info().version == 1
        assert torch.equal(backend.reloaded[-1]["embed.weight"], new["embed.weight"])
    wait_until(lambda: own_server.staged() == [], 120, "the staging file to be removed")


def test_load_weights_checks_the_directory(tmp_path: Path, client: RolloutClient, server: ServerThread):
    version = client.info().version
    code, msg = _code_and_message(lambda: client.load_weights(str(tmp_path / "nope"), version + 1))
    assert code == grpc.StatusCode.NOT_FOUND and "does not exist" in msg
    code, msg = _code_and_message(lambda: client.load_weights(str(tmp_path), version + 1))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "holds no *.safetensors" in msg
    save_file({"embed.weight": torch.zeros(50, 8)}, str(tmp_path / "model.safetensors"))
    code, msg = _code_and_message(lambda: client.load_weights(str(tmp_path), version + 1))
    assert (
        code == grpc.StatusCode.INVALID_ARGUMENT
        and "lacks 1 tensor(s) of the served model: norm.weight" in msg
    )
    save_file({k: v * 5 for k, v in MODEL.items()}, str(tmp_path / "model.safetensors"))
    code, msg = _code_and_message(lambda: client.load_weights(str(tmp_path), version - 1))
    assert code == grpc.StatusCode.ABORTED
    assert client.load_weights(str(tmp_path), version + 1) == version + 1
    assert server.backend is not None
    assert torch.equal(server.backend.reloaded[-1]["norm.weight"], MODEL["norm.weight"] * 5)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_weights_are_refused_before_the_engine(tmp_path: Path, client: RolloutClient,
                                                          server: ServerThread, bad: float):
    """UpdateWeights and LoadWeights refuse a NaN or inf in any tensor with INVALID_ARGUMENT naming it; the
    engine never sees the weights and the version stays."""
    assert server.backend is not None
    info = client.info()
    version, rejected, reloads = info.version, info.counters.rejected_weight_updates, server.backend.reloads_started
    state = {k: v.clone() for k, v in MODEL.items()}
    state["norm.weight"][3] = bad
    code, msg = _code_and_message(lambda: client.update_weights(state, version + 1))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "tensor 'norm.weight' holds NaN or inf" in msg, msg
    save_file(state, str(tmp_path / "model.safetensors"))
    code, msg = _code_and_message(lambda: client.load_weights(str(tmp_path), version + 1))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "tensor 'norm.weight' holds NaN or inf" in msg, msg
    info = client.info()
    assert info.version == version and info.counters.rejected_weight_updates == rejected + 2
    assert server.backend.reloads_started == reloads and client.health() == SERVING
    wait_until(lambda: server.staged() == [], 120, "the staging file to be removed")


def test_samples_finishing_together_share_a_message(server: ServerThread):
    backend = server.backend
    assert backend is not None
    # all 12 samples wait at the gate, then finish in the same event-loop turn
    backend.sample_gate, backend.hold_from_sample = server.event(), 0
    req = pb.GenerateRequest(prompts=[pb.Prompt(token_ids=pb.TokenIds(ids=[i + 1])) for i in range(4)],
                             sampling=pb.SamplingParams(n=3, max_new_tokens=3, seed=0))
    responses: list[pb.GenerateResponse] = []
    try:
        with grpc_channel(server.address) as ch:
            call = threading.Thread(
                target=lambda: responses.extend(pb_grpc.RolloutServiceStub(ch).Generate(req, timeout=60))
            )
            running = len(backend.running)
            call.start()
            wait_until(lambda: len(backend.running) == running + 12, 120, "12 samples in the engine")
            server.set(backend.sample_gate)
            call.join(120)
    finally:
        backend.hold_from_sample = None
        server.set(backend.sample_gate)
    sizes = [1 if r.HasField("trajectory") else len(r.trajectories) for r in responses]
    assert sum(sizes) == 12 and len(responses) < 12
    for r in responses:
        assert r.HasField("trajectory") != bool(r.trajectories)  # exactly one of the two


def test_messages_stay_under_a_mebibyte():
    from rollout_service.server import _messages

    big = pb.Trajectory(completion_token_ids=list(range(100_000)))  # ~0.3 MB
    groups = _messages([big] * 7)
    assert [len(g) for g in groups] == [3, 3, 1]
    assert all(sum(t.ByteSize() for t in g) <= 1 << 20 for g in groups)


@pytest.mark.slow
def test_a_second_service_on_a_taken_port_fails_instead_of_sharing_it(server: ServerThread, model_dir: Path):
    """so_reuseport is off: a rollout service started on a port in use exits with an error."""
    proc = subprocess.run(
        [sys.executable, "-m", "rollout_service", "--model", str(model_dir), "--port", str(server.port)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )
    assert proc.returncode != 0
    assert f"cannot listen on 127.0.0.1:{server.port}" in proc.stderr + proc.stdout


def test_dead_engine_stops_the_service_with_status_1(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A crashed engine must not keep answering SERVING: a health watcher sees SERVING, then NOT_SERVING, and
    serve() returns 1 (the process's exit status)."""
    import logging
    import re

    from grpc_health.v1 import health_pb2_grpc

    from rollout_service.server import serve

    save_file(MODEL, str(tmp_path / "model.safetensors"))
    backend = FakeBackend(str(tmp_path))
    statuses: list[int] = []

    def watch(address: str) -> None:
        with grpc_channel(address) as ch:
            try:
                for r in health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=""),
                                                              timeout=300):
                    statuses.append(r.status)
            except grpc.RpcError:  # the server stopped
                pass

    async def main() -> int:
        loaded = asyncio.Event()

        async def make_backend(settings: RolloutSettings) -> FakeBackend:
            loaded.set()
            return backend

        settings = RolloutSettings(model=str(tmp_path), port=0, staging_dir=str(tmp_path / "staging"))
        task = asyncio.ensure_future(serve(settings, make_backend))
        await asyncio.wait_for(loaded.wait(), timeout=120)
        port = int(re.search(r"listening on [^\s:]+:(\d+)", caplog.text).group(1))
        watcher = threading.Thread(target=watch, args=(f"127.0.0.1:{port}",), daemon=True)
        watcher.start()
        await asyncio.to_thread(wait_until, lambda: SERVING in statuses, 120, "SERVING")
        assert not task.done()  # healthy engine: keeps serving
        backend.dead = True
        code = await asyncio.wait_for(task, timeout=120)
        await asyncio.to_thread(watcher.join, 120)
        return code

    with caplog.at_level(logging.INFO, logger="rollout_service"):
        assert asyncio.run(main()) == 1
    assert statuses[0] == SERVING and NOT_SERVING in statuses[statuses.index(SERVING):]


def test_a_push_of_the_served_version_counts_as_applied(server: ServerThread, client: RolloutClient):
    """A push whose answer was lost is sent again and answered ABORTED (the version is served already): the
    client reports it applied. The service itself still says ABORTED, and an older version stays an error."""
    good = {k: v * 3 for k, v in MODEL.items()}
    version = client.info().version
    assert client.update_weights(good, version + 1) == version + 1 and client.last_weights_response is not None
    reloads = len(server.backend.reloaded)
    assert client.update_weights(good, version + 1) == version + 1  # again: ABORTED on the wire, applied here
    assert client.last_weights_response is None and len(server.backend.reloaded) == reloads  # nothing reloaded
    with grpc_channel(server.address) as ch:
        code, msg = _code_and_message(lambda: pb_grpc.RolloutServiceStub(ch).UpdateWeights(
            iter(_messages(good, version + 1)), timeout=20))
    assert code == grpc.StatusCode.ABORTED and f"served version {version + 1}" in msg
    code, msg = _code_and_message(lambda: client.update_weights(good, version))
    assert code == grpc.StatusCode.ABORTED and client.info().version == version + 1


def test_inplace_swap_keeps_samples_in_flight_and_reports_both_versions(model_dir: Path, tmp_path: Path):
    """swap_mode inplace: a push while a sample runs is applied at once (no drain, health stays SERVING), the
    sample finishes and reports the version it was submitted under and the one it finished under."""
    s = ServerThread(model_dir, tmp_path / "staging", swap_mode="inplace")
    try:
        backend = s.backend
        assert backend is not None
        backend.sample_gate, backend.hold_from_sample = s.event(), 1  # sample 1 runs until released
        new = {k: v * 2 for k, v in MODEL.items()}
        with RolloutClient(s.address, timeout_s=120) as client:
            out: list[pb.Trajectory] = []
            sampler = threading.Thread(target=lambda: out.extend(client.generate([[1]], n=2, max_new_tokens=1)))
            sampler.start()
            try:
                wait_until(lambda: backend.running, 120, "a sample in the engine")
                backend.reload_gate = s.event()
                pusher = threading.Thread(target=lambda: client.update_weights(new, 1))
                pusher.start()
                wait_until(lambda: backend.reloads_started == 1, 120, "the reload to start while a sample runs")
                assert backend.running and client.health() == SERVING  # no drain, no NOT_SERVING
                s.set(backend.reload_gate)
                pusher.join(120)
                assert client.info().version == 1 and backend.reloads_keep_running == [True]
                assert client.last_weights_response.drain_s == 0.0
            finally:
                backend.hold_from_sample = None
                s.set(backend.sample_gate)
                sampler.join(120)
            by_sample = {t.sample_index: t for t in out}
            assert [(by_sample[j].policy_version, by_sample[j].last_policy_version) for j in (0, 1)] == [(0, 0), (0, 1)]
            assert [(t.policy_version, t.last_policy_version) for t in client.generate([[1]], n=1, max_new_tokens=1)
                    ] == [(1, 1)]
            # a failed in-place reload: the sample in flight fails too (its weights are unknown), not serving
            backend.fail_reload = RuntimeError("worker lost the file half-way")
            backend.sample_gate, backend.hold_from_sample = s.event(), 0
            errors: list[grpc.RpcError] = []

            def sample() -> None:
                try:
                    list(client.generate([[1]], n=1, max_new_tokens=1))
                except grpc.RpcError as e:
                    errors.append(e)

            sampler = threading.Thread(target=sample)
            sampler.start()
            try:
                wait_until(lambda: backend.running, 120, "a sample in the engine")
                code, _ = _code_and_message(lambda: client.update_weights(new, 2))
                assert code == grpc.StatusCode.FAILED_PRECONDITION and client.health() == NOT_SERVING
            finally:
                backend.hold_from_sample = None
                s.set(backend.sample_gate)
                sampler.join(120)
            assert [e.code() for e in errors] == [grpc.StatusCode.FAILED_PRECONDITION]
            backend.fail_reload = None
            assert client.update_weights(new, 2) == 2 and client.health() == SERVING
    finally:
        s.stop()


def test_a_weight_transfer_session_commits_only_a_whole_model(own_server: ServerThread):
    """The session rules of rollout_service/transfer.py with the fake engine: the calls reach the engine in order,
    Finish commits the version once every tensor came; a Finish that lacks one ends the session with the weights
    reported broken (a chunk had reached the engine) until a good push."""
    backend = own_server.backend
    assert backend is not None
    with RolloutClient(own_server.address, timeout_s=120) as c:
        c.init_weight_transfer("run-a", "gloo", "127.0.0.1", 29500, 2, 1, secret=SECRET)
        assert backend.transfer_calls[-1][1]["rank_offset"] == 1 and backend.transfer_calls[-1][1]["timeout_s"] == 300
        c.start_weight_update("run-a", 1)
        assert c.info().lease_run_id == "run-a"
        c.update_weight_chunk("run-a", 1, ["embed.weight"], ["float32"], [[50, 8]])
        code, msg = _code_and_message(lambda: c.update_weight_chunk("run-a", 1, ["embed.weight"], ["float32"],
                                                                    [[50, 8]]))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "sent twice" in msg  # the refusal ends the session
        assert backend.transfer_calls[-3:] == [("update", {"names": ["embed.weight"], "dtype_names": ["float32"],
                                                           "shapes": [[50, 8]], "digest": "", "discard": True}),
                                               ("abort", None),
                                               ("shutdown", None)]  # the group is left: receives may be posted
        assert c.health() == NOT_SERVING and c.info().version == 0  # a chunk had reached the engine
        code, msg = _code_and_message(lambda: list(c.generate([[1]], n=1, max_new_tokens=1, timeout_s=60)))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "ended half-way" in msg
        code, msg = _code_and_message(lambda: c.start_weight_update("run-a", 1))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "InitWeightTransfer first" in msg
        c.init_weight_transfer("run-a", "gloo", "127.0.0.1", 29500, 2, 1, secret=SECRET)
        c.start_weight_update("run-a", 1)
        c.update_weight_chunk("run-a", 1, ["embed.weight"], ["float32"], [[50, 8]],
                              next={"names": ["norm.weight"], "dtype_names": ["float32"], "shapes": [[8]]})
        assert backend.transfer_calls[-1][1]["next"] == {"names": ["norm.weight"], "dtype_names": ["float32"],
                                                         "shapes": [[8]]}
        code, msg = _code_and_message(lambda: c.finish_weight_update("run-a", 1))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "lacks 1 tensor(s) of the served model: norm.weight" in msg
        c.init_weight_transfer("run-a", "gloo", "127.0.0.1", 29500, 2, 1, secret=SECRET)
        c.start_weight_update("run-a", 1)
        for name, shape in (("embed.weight", [50, 8]), ("norm.weight", [8])):
            c.update_weight_chunk("run-a", 1, [name], ["float32"], [shape])
        resp = c.finish_weight_update("run-a", 1)
        assert resp.version == 1 and c.info().version == 1 and c.health() == SERVING
        assert backend.transfer_calls[-1] == ("finish", 1) and c.info().counters.weight_reloads == 1
        # a session and its refusals: wrong run, stale version, a second session, a chunk of another session
        code, msg = _code_and_message(lambda: c.start_weight_update("run-b", 2))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "leased to run 'run-a'" in msg
        assert _code_and_message(lambda: c.start_weight_update("run-a", 1))[0] == grpc.StatusCode.ABORTED
        c.start_weight_update("run-a", 2)
        code, msg = _code_and_message(lambda: c.start_weight_update("run-a", 2))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "in progress" in msg
        code, msg = _code_and_message(lambda: c.update_weight_chunk("run-a", 3, ["norm.weight"], ["float32"], [[8]]))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "not run 'run-a''s to version 3" in msg
        assert c.abort_weight_update("run-a", 2) and c.health() == SERVING and c.info().version == 1  # untouched


def test_an_abandoned_weight_transfer_session_ends_and_generation_resumes(model_dir: Path, tmp_path: Path):
    """No call for transfer_timeout_s (the trainer died after a chunk): the session ends (vLLM's reload finalized,
    generation resumed) and the weights are broken until a push; a session with no chunk leaves them intact."""
    s = ServerThread(model_dir, tmp_path / "staging", transfer_timeout_s=0.5)
    try:
        backend = s.backend
        assert backend is not None
        with RolloutClient(s.address, timeout_s=120) as c:
            c.init_weight_transfer("run-a", "gloo", "127.0.0.1", 29500, 2, 1, secret=SECRET)
            c.start_weight_update("run-a", 1)
            wait_until(lambda: ("abort", None) in backend.transfer_calls, 120, "the empty session to end")
            wait_until(lambda: c.health() == SERVING, 120, "SERVING again")  # nothing reached the engine
            # the session's end left the group
            c.init_weight_transfer("run-a", "gloo", "127.0.0.1", 29500, 2, 1, secret=SECRET)
            c.start_weight_update("run-a", 1)
            c.update_weight_chunk("run-a", 1, ["norm.weight"], ["float32"], [[8]])
            wait_until(lambda: backend.transfer_calls.count(("abort", None)) == 2, 120, "the abandoned session to end")
            assert c.health() == NOT_SERVING and c.info().version == 0
            code, msg = _code_and_message(lambda: c.finish_weight_update("run-a", 1))
            assert code == grpc.StatusCode.FAILED_PRECONDITION and "no weight update in progress" in msg
            assert c.update_weights({k: v * 2 for k, v in MODEL.items()}, 1, run_id="run-a") == 1
            assert c.health() == SERVING
    finally:
        s.stop()


def test_a_gloo_group_needs_its_secret_and_each_chunk_carries_its_digest(own_server: ServerThread):
    """InitWeightTransfer without the group's secret is refused naming it; the secret reaches the engine's init and
    each chunk's digest its update. A chunk the workers refused before loading (its digest differs: altered on the
    weight channel) as the push's first: the old weights serve on; after a chunk that loaded: broken until a push."""
    backend = own_server.backend
    assert backend is not None
    with RolloutClient(own_server.address, timeout_s=120) as c:
        for bad in ("", "ab" * 16, "XY" * 32):
            code, msg = _code_and_message(lambda b=bad: c.init_weight_transfer("run-a", "gloo", "127.0.0.1", 29500,
                                                                               2, 1, secret=b))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "secret must be" in msg, msg
        assert backend.transfer_calls == []
        c.init_weight_transfer("run-a", "gloo", "127.0.0.1", 29500, 2, 1, secret=SECRET)
        assert backend.transfer_calls[-1][1]["secret"] == SECRET
        c.start_weight_update("run-a", 1)
        backend.fail_update = ValueError("the chunk of 1 tensor(s) from 'embed.weight' does not match the digest "
                                         "the trainer sent (altered or injected on the weight channel)")
        code, msg = _code_and_message(lambda: c.update_weight_chunk("run-a", 1, ["embed.weight"], ["float32"],
                                                                    [[50, 8]], digest="d1" * 32))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "the old weights serve on" in msg, msg
        assert backend.transfer_calls[-3][1]["digest"] == "d1" * 32
        assert c.health() == SERVING and c.info().version == 0  # nothing of it was loaded
        c.init_weight_transfer("run-a", "gloo", "127.0.0.1", 29500, 2, 1, secret=SECRET)
        c.start_weight_update("run-a", 1)
        c.update_weight_chunk("run-a", 1, ["embed.weight"], ["float32"], [[50, 8]], digest="d2" * 32)
        backend.fail_update = ValueError("the chunk of 1 tensor(s) from 'norm.weight' does not match the digest")
        code, msg = _code_and_message(lambda: c.update_weight_chunk("run-a", 1, ["norm.weight"], ["float32"], [[8]],
                                                                    digest="d3" * 32))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "broken until a push" in msg, msg
        assert c.health() == NOT_SERVING and c.info().version == 0  # the first chunk had loaded: a mix


def test_a_value_beyond_the_served_float16_range_is_refused_on_the_stream_and_path_routes(
        tmp_path: Path, client: RolloutClient, server: ServerThread):
    """7e4 is finite in float32 and inf in float16: a float16-served model refuses it on UpdateWeights (the gRPC
    stream) and LoadWeights (a path, as the shm route sends), naming the tensor; the version stays."""
    assert server.backend is not None
    settings = server.backend.engine_settings
    version = client.info().version
    state = {k: v.clone() for k, v in MODEL.items()}
    state["norm.weight"][5] = 7e4
    save_file(state, str(tmp_path / "model.safetensors"))
    settings["served_dtype"] = "float16"
    try:
        code, msg = _code_and_message(lambda: client.update_weights(state, version + 1))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "'norm.weight' holds NaN or inf" in msg, msg
        assert "float16" in msg
        code, msg = _code_and_message(lambda: client.load_weights(str(tmp_path), version + 1))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "'norm.weight' holds NaN or inf" in msg, msg
        assert client.info().version == version and client.health() == SERVING
    finally:
        del settings["served_dtype"]
    assert client.load_weights(str(tmp_path), version + 1) == version + 1  # served in float32: finite
