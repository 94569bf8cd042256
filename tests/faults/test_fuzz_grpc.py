"""Property-based fuzzing of every request message of the rollout and trainer services, on real servers on
127.0.0.1: whatever the fields hold, a call ends with OK or a clean client error (INVALID_ARGUMENT, NOT_FOUND,
...), never UNKNOWN / INTERNAL (an unhandled exception) or UNAVAILABLE / DEADLINE_EXCEEDED (a dead or hung
service), and the service stays SERVING and answers after each example.

Messages are drawn from the proto descriptors (every field, nested messages, repeated and map fields, unknown
enum values, extreme integers, NaN and infinite floats, odd strings), so a field added to a proto is fuzzed
without a change here. A bounded, derandomized number of examples per RPC (EXAMPLES): the same examples on
every run. rollout: the real grpc.aio server with the fake engine of tests/rollout/test_server_plumbing.py;
trainer: the `python -m trainer_service` process, configured so that no fuzzed StartRun can start a run (its
only rollout address is 127.0.0.1:1 and its roots are empty directories)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor as F
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from forkrl.remote.channel import grpc_channel
from forkrl.wire.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from forkrl.wire.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from tests.rollout.test_server_plumbing import MODEL, ServerThread
from tests.service_fixtures import start_trainer_service

EXAMPLES = 30
CLEAN = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION,
         grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.ABORTED, grpc.StatusCode.OUT_OF_RANGE,
         grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DATA_LOSS}
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None, print_blob=True,
                    suppress_health_check=list(HealthCheck))
_INTS = {F.TYPE_INT32: 32, F.TYPE_SINT32: 32, F.TYPE_SFIXED32: 32, F.TYPE_INT64: 64, F.TYPE_SINT64: 64,
         F.TYPE_SFIXED64: 64}
_UINTS = {F.TYPE_UINT32: 32, F.TYPE_FIXED32: 32, F.TYPE_UINT64: 64, F.TYPE_FIXED64: 64}
# strings that reach deeper than random text: paths (none inside the roots: the temp dir holds other files),
# names the services know, addresses
_WORDS = ["", ".", "..", "../..", "/", "/etc/passwd", "/proc/self/environ", "/dev/null", "a\x00b", "1+2+3=",
          "countdown",
          "math_verify", "exact_match", "builtins:print", "os:system", "grpo", "dapo", "127.0.0.1:1", "127.0.0.1:*",
          "step_000001", "final", "float32", "bfloat16", "embed.weight", "norm.weight", "x" * 300]


def _scalar(fd: Any) -> st.SearchStrategy:
    t = fd.type
    if t in _INTS:
        b = _INTS[t]
        return st.one_of(st.integers(-2, 70), st.integers(-(2 ** (b - 1)), 2 ** (b - 1) - 1),
                         st.sampled_from([-(2 ** (b - 1)), 2 ** (b - 1) - 1]))
    if t in _UINTS:
        b = _UINTS[t]
        return st.one_of(st.integers(0, 70), st.integers(0, 2**b - 1), st.just(2**b - 1))
    if t == F.TYPE_BOOL:
        return st.booleans()
    if t in (F.TYPE_FLOAT, F.TYPE_DOUBLE):
        width = 32 if t == F.TYPE_FLOAT else 64
        return st.one_of(st.floats(-3, 3, width=width), st.floats(width=width),
                         st.sampled_from([0.0, -0.0, math.nan, math.inf, -math.inf, 1e-30, 1e30]))
    if t == F.TYPE_STRING:
        return st.one_of(st.sampled_from(_WORDS), st.text(max_size=40))
    if t == F.TYPE_BYTES:
        return st.binary(max_size=128)
    if t == F.TYPE_ENUM:
        top = max(v.number for v in fd.enum_type.values)
        return st.integers(-1, top + 2)  # unknown values too (proto3 enums are open)
    raise AssertionError(f"no strategy for field type {t} of {fd.full_name}")


def _repeated(fd: Any) -> bool:
    return fd.is_repeated if hasattr(fd, "is_repeated") else fd.label == F.LABEL_REPEATED


def _fill(draw: Any, msg: Any, depth: int) -> None:
    """Set a random subset of `msg`'s fields (in place), nested messages down to depth 3."""
    for fd in msg.DESCRIPTOR.fields:
        if not draw(st.booleans()):
            continue
        target = getattr(msg, fd.name)
        if fd.type == F.TYPE_MESSAGE and fd.message_type.GetOptions().map_entry:
            key_fd, value_fd = fd.message_type.fields_by_name["key"], fd.message_type.fields_by_name["value"]
            for _ in range(draw(st.integers(0, 3))):
                key = draw(_scalar(key_fd))
                if value_fd.type == F.TYPE_MESSAGE:
                    if depth < 3:
                        _fill(draw, target[key], depth + 1)
                else:
                    target[key] = draw(_scalar(value_fd))
        elif _repeated(fd):
            if fd.type == F.TYPE_MESSAGE:
                for _ in range(draw(st.integers(0, 4)) if depth < 3 else 0):
                    _fill(draw, target.add(), depth + 1)
            else:
                target.extend(draw(st.lists(_scalar(fd), max_size=5)))
        elif fd.type == F.TYPE_MESSAGE:
            if depth < 3:
                target.SetInParent()
                _fill(draw, target, depth + 1)
        else:
            setattr(msg, fd.name, draw(_scalar(fd)))


def messages(cls: type) -> st.SearchStrategy:
    """Random instances of the proto message class `cls`."""

    @st.composite
    def build(draw: Any) -> Any:
        msg = cls()
        _fill(draw, msg, 0)
        return msg

    return build()


# Near-valid requests of the rollout service: random messages mostly stop at the first check (no prompts, no
# header); these reach the sampling checks, the engine, the weight checks and the staging of a push.
_small_floats = st.one_of(st.floats(-1, 3, width=32), st.sampled_from([0.0, 0.005, 1.0, math.nan, math.inf]))


@st.composite
def _near_valid_generate(draw: Any) -> Any:
    pb = rollout_pb2
    prompts = draw(st.lists(st.one_of(
        st.builds(lambda t: pb.Prompt(text=t), st.one_of(st.text(max_size=20), st.sampled_from(_WORDS))),
        st.builds(lambda ids: pb.Prompt(token_ids=pb.TokenIds(ids=ids)), st.lists(st.integers(-2, 60), max_size=8)),
    ), min_size=1, max_size=4))
    sp = pb.SamplingParams(n=draw(st.integers(-1, 4)), temperature=draw(_small_floats),
                           max_new_tokens=draw(st.integers(-1, 70)), stop=draw(st.lists(st.text(max_size=3),
                                                                                        max_size=2)))
    if draw(st.booleans()):
        sp.top_p = draw(_small_floats)
    if draw(st.booleans()):
        sp.seed = draw(st.integers(-(2**63), 2**63 - 1))
    offsets = draw(st.one_of(st.just([]), st.lists(st.integers(-(2**63), 2**63 - 1), max_size=5)))
    return pb.GenerateRequest(prompts=prompts, sampling=sp, prompt_offsets=offsets,
                              request_tag=draw(st.text(max_size=70)))


@st.composite
def _near_valid_push(draw: Any) -> list:
    pb = rollout_pb2
    metas = [pb.TensorMeta(name=draw(st.sampled_from([*MODEL, "x", ""])),
                           dtype=draw(st.sampled_from(["float32", "F32", "bfloat16", "int8", ""])),
                           shape=draw(st.lists(st.integers(-1, 60), max_size=3)), nbytes=draw(st.integers(-1, 2000)))
             for _ in range(draw(st.integers(1, 3)))]
    total = draw(st.one_of(st.just(sum(max(m.nbytes, 0) for m in metas)), st.integers(-1, 4000)))
    header = pb.WeightsHeader(target_version=draw(st.integers(-1, 3)), tensors=metas, total_bytes=total,
                              sha256=draw(st.sampled_from(["", "0" * 64, "zz"])))
    chunks = [pb.UpdateWeightsRequest(chunk=draw(st.binary(max_size=700))) for _ in range(draw(st.integers(0, 3)))]
    return [pb.UpdateWeightsRequest(header=header), *chunks]


NEAR_VALID = {"Generate": _near_valid_generate(), "UpdateWeights": _near_valid_push()}


def _call(stub: Any, method: Any, request: Any) -> None:
    """One call of `method` (a MethodDescriptor) with `request` (a message, or a list for client streaming):
    OK or a clean client error."""
    fn = getattr(stub, method.name)
    try:
        if method.client_streaming:
            fn(iter(request), timeout=30)
        elif method.server_streaming:
            for _ in fn(request, timeout=30):
                pass
        else:
            fn(request, timeout=30)
    except grpc.RpcError as e:
        assert e.code() in CLEAN, f"{method.name}: {e.code()} {e.details()!r} for {request!r}"


def _healthy(address: str) -> None:
    with grpc_channel(address, token="") as ch:
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status
    assert status == health_pb2.HealthCheckResponse.SERVING


def _fuzz_rpc(address: str, stub: Any, method: Any, module: Any) -> None:
    cls = getattr(module, method.input_type.name)
    strategy = st.lists(messages(cls), max_size=4) if method.client_streaming else messages(cls)
    if module is rollout_pb2 and method.name in NEAR_VALID:
        strategy = st.one_of(strategy, NEAR_VALID[method.name])

    @SETTINGS
    @given(request=strategy)
    def run(request: Any) -> None:
        _call(stub, method, request)
        _healthy(address)

    run()


def _fuzz_every_rpc(address: str, service: Any, stub_cls: type, module: Any) -> set[str]:
    fuzzed = set()
    with grpc_channel(address, options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
        stub = stub_cls(channel)
        for method in service.methods:
            _fuzz_rpc(address, stub, method, module)
            fuzzed.add(method.name)
    return fuzzed


@pytest.fixture(scope="module")
def rollout(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    d = tmp_path_factory.mktemp("model")
    save_file(MODEL, str(d / "model.safetensors"))
    server = ServerThread(d, d / "staging")
    yield server
    server.stop()


@pytest.mark.slow
def test_fuzz_every_rollout_rpc(rollout: ServerThread) -> None:
    service = rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"]
    fuzzed = _fuzz_every_rpc(rollout.address, service, rollout_pb2_grpc.RolloutServiceStub, rollout_pb2)
    assert fuzzed == {m.name for m in service.methods}
    with grpc_channel(rollout.address) as ch:  # still serves a plain request
        req = rollout_pb2.GenerateRequest(prompts=[rollout_pb2.Prompt(text="1+1=")],
                                          sampling=rollout_pb2.SamplingParams(n=2, temperature=1.0, max_new_tokens=3))
        assert len([t for r in rollout_pb2_grpc.RolloutServiceStub(ch).Generate(req, timeout=30)
                    for t in ([r.trajectory] if r.HasField("trajectory") else r.trajectories)]) == 2


@pytest.mark.slow
def test_fuzz_every_trainer_rpc(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    service = trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"]
    with start_trainer_service(tmp_path / "runs", log_path=tmp_path / "trainer.log", rollout_addresses="127.0.0.1:1",
                               allowed_roots=str(tmp_path / "empty")) as address:
        fuzzed = _fuzz_every_rpc(address, service, trainer_pb2_grpc.TrainerServiceStub, trainer_pb2)
        assert fuzzed == {m.name for m in service.methods}
        assert not list((tmp_path / "runs").glob("*")), "a fuzzed StartRun started a run"
