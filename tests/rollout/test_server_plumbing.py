"""Rollout service plumbing with a fake inference backend: the real gRPC server, RolloutEngine (validation,
gate, versions, weight staging) and RolloutClient; only vLLM is replaced. Model behaviour (logprobs,
reloads that change the samples) is tested against the real engine in test_rollout_service.py."""

from __future__ import annotations

import asyncio
import hashlib
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

from forkrl.clients.rollout import RolloutClient
from forkrl.seeds import sample_seed
from forkrl.weights.safetensors import checkpoint_files
from forkrl.weights.wire import pack_state_dict
from forkrl.wire.rollout.v1 import rollout_pb2 as pb
from forkrl.wire.rollout.v1 import rollout_pb2_grpc as pb_grpc
from rollout_service.config import RolloutSettings
from rollout_service.server import build_server
from rollout_service.types import Completion, SamplingSpec

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
MODEL = {"embed.weight": torch.randn(50, 8), "norm.weight": torch.ones(8)}


class FakeBackend:
    """Deterministic completions; sample j takes (j + 1) * max_new_tokens ms. `hold` (an asyncio
    Event on the server loop) keeps a reload in progress until the test sets it."""

    vocab_size = vocab_limit = 50
    eos_token_id = 2
    max_model_len = 64

    def __init__(self, model: str) -> None:
        self.model = model
        self.engine_settings = {"dtype": "float32", "device": "fake", "engine_mode": "fake"}
        self.running: set[str] = set()
        self.aborted: list[str] = []
        self.reloaded: list[dict[str, torch.Tensor]] = []
        self.hold: asyncio.Event | None = None

    def encode(self, text: str) -> list[int]:
        return [4 + ord(c) % 40 for c in text]

    async def generate_one(
        self, rid: str, ids: list[int], spec: SamplingSpec, seed: int | None
    ) -> Completion:
        self.running.add(rid)
        try:
            await asyncio.sleep((int(rid.rsplit("-", 1)[1]) + 1) * spec.max_new_tokens / 1000)
            toks = [(seed or 0) % 50] * spec.max_new_tokens
            return Completion(toks, "x" * len(toks), [-0.5] * len(toks), "length")
        finally:
            self.running.discard(rid)

    async def abort(self, request_ids: list[str]) -> None:
        self.aborted += request_ids

    async def reload(self, path: str) -> None:
        state = {k: v for f in checkpoint_files(path) for k, v in load_file(f).items()}
        self.reloaded.append(state)
        if self.hold is not None:
            await self.hold.wait()

    def num_unfinished(self) -> int:
        return len(self.running)

    dead = False

    def errored(self) -> bool:
        return self.dead

    def shutdown(self) -> None:
        pass


class ServerThread:
    """The real grpc.aio server on its own event loop in a thread; `load_gate` delays the engine start."""

    def __init__(self, model_dir: Path) -> None:
        self.settings = RolloutSettings(model=str(model_dir), port=0, staging_dir=str(model_dir / "staging"))
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.backend: FakeBackend | None = None
        self.load_gate = self.run(self._make_event())
        self.server, self.servicer, self.health, port = self.run(self._build())
        self.address = f"127.0.0.1:{port}"

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=30)

    async def _make_event(self) -> asyncio.Event:
        return asyncio.Event()

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

    def set_event(self, event: asyncio.Event) -> None:
        self.loop.call_soon_threadsafe(event.set)

    def stop(self) -> None:
        self.run(self.server.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("fake-model")
    save_file(MODEL, str(d / "model.safetensors"))
    return d


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[ServerThread]:
    s = ServerThread(model_dir)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server: ServerThread) -> Iterator[RolloutClient]:
    c = RolloutClient(server.address, timeout_s=20)
    yield c
    c.close()


def _code_and_message(fn: Any) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        fn()
    return e.value.code(), e.value.details()


def test_not_serving_and_unavailable_while_loading(server: ServerThread, client: RolloutClient):
    assert client.health() == NOT_SERVING
    code, msg = _code_and_message(lambda: client.info(timeout_s=1))
    assert code == grpc.StatusCode.UNAVAILABLE and "loading" in msg
    server.set_event(server.load_gate)
    client.wait_ready(timeout_s=10)
    assert client.health() == SERVING
    assert client.info().version == 0


def test_streams_every_sample_with_derived_seeds(server: ServerThread, client: RolloutClient):
    ts = list(client.generate(["ab", [5, 6, 7]], n=3, temperature=1.0, max_new_tokens=4, seed=7))
    assert sorted((t.prompt_index, t.sample_index) for t in ts) == [
        (i, j) for i in range(2) for j in range(3)
    ]
    for t in ts:
        assert list(t.completion_token_ids) == [sample_seed(7, t.prompt_index, t.sample_index) % 50] * 4
        assert t.finish_reason == pb.FINISH_REASON_LENGTH and t.policy_version == 0
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
    with grpc.insecure_channel(server.address) as ch:
        stub = pb_grpc.RolloutServiceStub(ch)
        for req, message in [
            (pb.GenerateRequest(prompts=[pb.Prompt(text="a")]), "sampling is required"),
            (
                pb.GenerateRequest(prompts=[pb.Prompt()], sampling=pb.SamplingParams(n=1, max_new_tokens=1)),
                "prompts[0] has neither text nor token_ids",
            ),
        ]:
            code, msg = _code_and_message(lambda req=req: list(stub.Generate(req, timeout=5)))
            assert (code, msg) == (grpc.StatusCode.INVALID_ARGUMENT, message)


def test_cancel_aborts_unfinished_samples(server: ServerThread, client: RolloutClient):
    before = client.info().counters
    stream = client.generate([[1], [2]], n=4, max_new_tokens=40, seed=0)  # sample j takes (j + 1) * 40 ms
    first = next(stream)
    assert first.sample_index == 0
    stream.close()  # the client cancels the call
    deadline = time.monotonic() + 5
    while client.info().counters.running_requests and time.monotonic() < deadline:
        time.sleep(0.02)
    after = client.info().counters
    assert after.running_requests == 0
    aborted = after.aborted_requests - before.aborted_requests
    assert aborted + (after.samples - before.samples) == 8
    assert aborted >= 4  # samples 2 and 3 of both prompts need >= 120 ms
    assert server.backend is not None and len(server.backend.aborted) == aborted


def _push(
    stub: pb_grpc.RolloutServiceStub, messages: list[pb.UpdateWeightsRequest]
) -> pb.UpdateWeightsResponse:
    return stub.UpdateWeights(iter(messages), timeout=10)


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
    version = client.info().version
    rejected = client.info().counters.rejected_weight_updates
    with grpc.insecure_channel(server.address) as ch:
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
                f"the stream ended after {1632 - len(msgs[-1].chunk)} of header.total_bytes 1632 bytes",
            ),
            (
                msgs + msgs[-1:],
                grpc.StatusCode.INVALID_ARGUMENT,
                "received more than header.total_bytes (1632) bytes",
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
                "header.total_bytes must be 1632 (the sum of header.tensors[].nbytes), got 5",
            ),
        ]
        for messages, code, message in cases:
            got = _code_and_message(lambda messages=messages: _push(stub, messages))
            assert got == (code, message)
    info = client.info()
    assert info.version == version and info.counters.weight_reloads == 0
    assert info.counters.rejected_weight_updates == rejected + len(cases)
    assert server.backend is not None and server.backend.reloaded == []
    assert list(Path(server.settings.staging_dir).iterdir()) == []  # no staging file left behind


def test_cancelled_stream_changes_nothing(server: ServerThread, client: RolloutClient):
    version = client.info().version
    msgs = _messages({k: v * 3 for k, v in MODEL.items()}, version + 1)
    sent = threading.Event()

    def slow() -> Iterator[pb.UpdateWeightsRequest]:
        yield from msgs[:3]
        sent.set()
        time.sleep(30)  # never finishes: the call is cancelled meanwhile

    with grpc.insecure_channel(server.address) as ch:
        fut = pb_grpc.RolloutServiceStub(ch).UpdateWeights.future(slow(), timeout=30)
        sent.wait(5)
        time.sleep(0.2)
        fut.cancel()
    deadline = time.monotonic() + 5
    while client.info().counters.rejected_weight_updates == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert client.info().version == version
    assert server.backend is not None and server.backend.reloaded == []
    assert list(Path(server.settings.staging_dir).iterdir()) == []


def test_swap_is_not_serving_and_later_generates_wait(server: ServerThread, client: RolloutClient):
    assert server.backend is not None
    version = client.info().version
    new = {k: v * 2 for k, v in MODEL.items()}
    server.backend.hold = server.run(server._make_event())
    result: dict[str, Any] = {}
    pusher = threading.Thread(
        target=lambda: result.update(v=client.update_weights(new, version + 1, chunk_bytes=100))
    )
    pusher.start()
    deadline = time.monotonic() + 5
    while not server.backend.reloaded and time.monotonic() < deadline:
        time.sleep(0.01)
    assert client.health() == NOT_SERVING  # the reload is in progress (held)
    late: list[pb.Trajectory] = []
    gen = threading.Thread(target=lambda: late.extend(client.generate([[1]], n=2, max_new_tokens=1)))
    gen.start()
    time.sleep(0.2)
    assert not late  # waits at the gate while the weights are swapped
    server.set_event(server.backend.hold)
    pusher.join(10)
    gen.join(10)
    assert result["v"] == version + 1 and client.health() == SERVING
    assert [t.policy_version for t in late] == [version + 1] * 2
    staged = server.backend.reloaded[-1]
    assert staged.keys() == new.keys() and all(torch.equal(staged[k], new[k]) for k in new)
    resp = client.last_weights_response
    assert resp.bytes_received == 1632 and resp.apply_s >= 0.1  # held ~0.2 s


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
    code, msg = _code_and_message(lambda: client.load_weights(str(tmp_path), version))
    assert code == grpc.StatusCode.ABORTED
    assert client.load_weights(str(tmp_path), version + 1) == version + 1
    assert torch.equal(server.backend.reloaded[-1]["norm.weight"], MODEL["norm.weight"] * 5)


def test_samples_finishing_together_share_a_message(server: ServerThread):
    # sample j of every prompt finishes at (j + 1) * 30 ms: 3 groups of 4 prompts
    req = pb.GenerateRequest(prompts=[pb.Prompt(token_ids=pb.TokenIds(ids=[i + 1])) for i in range(4)],
                             sampling=pb.SamplingParams(n=3, max_new_tokens=30, seed=0))
    with grpc.insecure_channel(server.address) as ch:
        responses = list(pb_grpc.RolloutServiceStub(ch).Generate(req, timeout=10))
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


def test_dead_engine_stops_the_service_with_status_1(tmp_path: Path) -> None:
    save_file(MODEL, str(tmp_path / "model.safetensors"))
    """A crashed engine must not keep answering SERVING: the service goes NOT_SERVING and exits 1."""
    from rollout_service.server import serve

    backend = FakeBackend(str(tmp_path))

    async def make_backend(settings: RolloutSettings) -> FakeBackend:
        return backend

    async def main() -> int:
        settings = RolloutSettings(model=str(tmp_path), port=0, staging_dir=str(tmp_path / "staging"))
        task = asyncio.ensure_future(serve(settings, make_backend))
        await asyncio.sleep(0.5)
        assert not task.done()  # healthy engine: keeps serving
        backend.dead = True
        return await asyncio.wait_for(task, timeout=30)

    assert asyncio.run(main()) == 1
