"""Every RunConfig field at its extremes through the real trainer service and the real rollout service (vLLM, the
embedded tiny model): 0, -1, the least and greatest int32 / int64, nan and +-inf for floats, a 100,000-character
string and a path with a 400-byte name (the file system's limit is 255), an unknown enum number, an empty list,
too many addresses, plus the engine's temperature limits and the documented maxima of the settings that multiply
a step's work. The field list is RunConfig.model_fields, so a new
field is walked too.

Each value is either refused at StartRun with INVALID_ARGUMENT naming the field (PERMISSION_DENIED for an address
this trainer does not serve, also naming the field), or accepted, and then the run trains a step (or ends) and
ends SUCCEEDED, STOPPED (the test stops it after its first step) or FAILED with a sentence as its error: never a
hang, never a gRPC object's repr. One trainer (its rollout_addresses: the one rollout service, so the default
address is refused, never used) and one rollout service for the whole walk; accepted values run one step of tiny
batches with evaluation off (on for the evaluation fields), and a value whose config equals one already run is
not run again.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor

from forkrl.training.config import RunConfig, from_proto, to_proto
from forkrl.wire.trainer.v1 import trainer_pb2
from tests.service_fixtures import start_trainer_service
from tests.trainer.helpers import trainer_stub

pytestmark = pytest.mark.slow

PROTO = trainer_pb2.RunConfig.DESCRIPTOR.fields_by_name
INT32 = (0, -1, -(2**31), 2**31 - 1)
INT64 = (0, -1, -(2**63), 2**63 - 1)
DOUBLE = (0.0, -1.0, float(2**31 - 1), float(2**63 - 1), math.nan, math.inf, -math.inf)
LONG = "x" * 100_000
EXTREMES: dict[int, tuple[Any, ...]] = {
    FieldDescriptor.TYPE_INT32: INT32, FieldDescriptor.TYPE_INT64: INT64, FieldDescriptor.TYPE_DOUBLE: DOUBLE,
    FieldDescriptor.TYPE_STRING: ("", LONG, "/tmp/" + "é" * 200), FieldDescriptor.TYPE_BOOL: (False, True),
    FieldDescriptor.TYPE_ENUM: (0, 99, -1),
}
# Besides the type's extremes: the engine's temperature range, and the documented maxima of what multiplies a step
MORE: dict[str, tuple[Any, ...]] = {"temperature": (0.01, 2.0), "ppo_epochs": (64,), "max_staleness": (64,),
                                    "num_steps": (10**7,)}
EVAL_FIELDS = ("eval_every", "eval_prompts")
ENDED = (trainer_pb2.RUN_STATE_SUCCEEDED, trainer_pb2.RUN_STATE_STOPPED, trainer_pb2.RUN_STATE_FAILED)
HANG_S = 600  # only a hang takes this long (a run of one step of tiny batches)


@pytest.fixture(scope="module")
def walk_trainer(rollout_address: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    d = tmp_path_factory.mktemp("walk")
    with start_trainer_service(d / "runs", log_path=d / "trainer.log", expect_clean_stop=True,
                               rollout_addresses=rollout_address, rollout_wait_s=60) as address:
        yield address


def _values(name: str, rollout: str) -> list[Any]:
    field = PROTO[name]
    if field.is_repeated:  # rollout_addresses
        return [[], [LONG], [rollout] * 65, [rollout.rpartition(":")[0] + ":99999"]]
    return [*EXTREMES[field.type], *MORE.get(name, ())]


def _message(base: RunConfig, name: str, value: Any) -> Any:
    msg = to_proto(base)
    if isinstance(value, list):
        msg.ClearField(name)
        getattr(msg, name).extend(value)
    else:
        setattr(msg, name, value)
    return msg


def _sentence(error: str) -> bool:
    """A run's error as a person reads it: words, bounded, no object repr or traceback."""
    return (0 < len(error) <= 2100 and "Rendezvous" not in error and "RpcError" not in error
            and " object at 0x" not in error and "Traceback" not in error and not error.startswith("<"))


def _run_one_step(stub: Any, run_id: str) -> tuple[trainer_pb2.GetRunResponse, int]:
    """Follow the run to its first step (or its end), stop it, and wait for its end: (GetRun, steps seen)."""
    watch = stub.WatchRun(trainer_pb2.WatchRunRequest(run_id=run_id), timeout=HANG_S)
    steps = 0
    for item in watch:
        steps += item.HasField("metrics")
        if steps or item.event.kind == trainer_pb2.EVENT_KIND_FINISHED:
            break
    watch.cancel()
    stub.StopRun(trainer_pb2.StopRunRequest(run_id=run_id), timeout=30)
    for item in stub.WatchRun(trainer_pb2.WatchRunRequest(run_id=run_id), timeout=HANG_S):
        steps = max(steps, item.HasField("metrics"))
    return stub.GetRun(trainer_pb2.GetRunRequest(run_id=run_id), timeout=30), steps


@pytest.mark.timeout(1800)  # liveness: each run has its own hang bound (HANG_S); the walk is ~30 short runs
def test_every_field_at_its_extremes_is_refused_by_name_or_runs(walk_trainer: str, rollout_address: str,
                                                                tiny_model_dir: Path) -> None:
    base = RunConfig(model=str(tiny_model_dir), rollout_addresses=[rollout_address], num_steps=1,
                     prompts_per_step=2, group_size=2, micro_batch_size=4, eval_prompts=0, seed=0)
    problems: list[str] = []
    ran: dict[str, str] = {}  # config (JSON) -> the case that ran it
    walked, accepted, refused, same = set(), [], [], 0
    with trainer_stub(walk_trainer) as stub:
        for name in RunConfig.model_fields:
            case_base = base.model_copy(update={"eval_prompts": 4}) if name in EVAL_FIELDS else base
            for value in _values(name, rollout_address):
                walked.add(name)
                case = f"{name}={str(value)[:40]}"
                msg = _message(case_base, name, value)
                try:
                    key = from_proto(msg).model_dump_json()
                except ValueError:
                    key = None  # the model refuses it: StartRun must too
                if key is not None and key in ran:
                    same += 1
                    continue  # the same run as `ran[key]`
                try:
                    started = stub.StartRun(trainer_pb2.StartRunRequest(config=msg), timeout=120)
                except grpc.RpcError as err:
                    details = err.details() or ""
                    codes = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED)
                    if err.code() not in codes or name not in details or len(details) > 2100:
                        problems.append(f"{case}: refused with {err.code().name} {details[:300]!r}")
                    refused.append(case)
                    continue
                if key is not None:
                    ran[key] = case
                accepted.append(case)
                run, steps = _run_one_step(stub, started.run_id)
                if run.state not in ENDED:
                    problems.append(f"{case}: still {trainer_pb2.RunState.Name(run.state)} after StopRun")
                elif run.state == trainer_pb2.RUN_STATE_FAILED and not _sentence(run.error):
                    problems.append(f"{case}: failed with {run.error[:300]!r}, not a sentence")
                elif run.state != trainer_pb2.RUN_STATE_FAILED and not steps:
                    problems.append(f"{case}: {trainer_pb2.RunState.Name(run.state)} without a step")
        # ppo_epochs 2^31 - 1 (accepted before: StopRun then took 90 s at 100% CPU) is refused at StartRun
        with pytest.raises(grpc.RpcError) as err:
            stub.StartRun(trainer_pb2.StartRunRequest(config=_message(base, "ppo_epochs", 2**31 - 1)), timeout=120)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == "ppo_epochs: Input should be less than or equal to 64, got 2147483647"
    print(f"walked {len(walked)} fields: {len(refused)} values refused, {len(accepted)} run, {same} the same "
          f"config as one run before; run: {', '.join(accepted)}")
    assert walked == set(RunConfig.model_fields)
    assert not problems, "\n".join(problems)
    # the values that must run did (a refusal of any of them is a regression of the documented ranges)
    for case in ("lr=2147483647.0", "temperature=0.01", "temperature=2.0", "ppo_epochs=64",
                 "max_staleness=64", "num_steps=10000000", "seed=9223372036854775807", "dynamic_sampling=True"):
        assert case in accepted, (case, accepted)
