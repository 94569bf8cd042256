"""Caps on the work of one request, on real servers on 127.0.0.1: a Generate call (rollout, INVALID_ARGUMENT),
a training step (trainer StartRun, INVALID_ARGUMENT), a probe job (422). Each refusal names the limit and the
setting (flag and variable) that raises it; recipes/dapo_paper.toml's step passes once the operator raises it.

rollout: the real grpc.aio server with the fake engine of tests/rollout/test_server_plumbing.py; trainer: the
`python -m trainer_service` process; probe: the app under uvicorn."""

from __future__ import annotations

import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
import uvicorn
from safetensors.torch import save_file

from forkrl.models.tiny import default_model_dir
from forkrl.remote.channel import grpc_channel, http_headers
from forkrl.training.config import RunConfig, to_proto
from forkrl.training.rules import RunRules, check_bounds
from forkrl.wire.rollout.v1 import rollout_pb2 as pb
from forkrl.wire.rollout.v1 import rollout_pb2_grpc as pb_grpc
from forkrl.wire.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from probe_service.app import create_app
from probe_service.config import ProbeSettings
from rollout_service.config import RolloutSettings
from tests.rollout.test_server_plumbing import MODEL, ServerThread
from tests.service_fixtures import start_trainer_service, wait_until

REPO_ROOT = Path(__file__).resolve().parents[2]
DAPO = REPO_ROOT / "recipes" / "dapo_paper.toml"
DAPO_STEP_TOKENS = 512 * 16 * 20480 * 10  # prompts x group x max_new_tokens x max_gen_batches


def _refused(call, code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT) -> str:
    with pytest.raises(grpc.RpcError) as e:
        call()
    assert e.value.code() == code, (e.value.code(), e.value.details())
    return e.value.details()


# ------------------------------------------------------------------------------------------------- rollout
@pytest.fixture(scope="module")
def rollout(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    d = tmp_path_factory.mktemp("model")
    save_file(MODEL, str(d / "model.safetensors"))
    server = ServerThread(d, d / "staging")
    yield server
    server.stop()


def _generate(address: str, prompts: list[pb.Prompt], n: int, max_new_tokens: int) -> list:
    with grpc_channel(address, options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
        req = pb.GenerateRequest(prompts=prompts, sampling=pb.SamplingParams(n=n, temperature=1.0,
                                                                             max_new_tokens=max_new_tokens))
        return list(pb_grpc.RolloutServiceStub(ch).Generate(req, timeout=30))


def test_generate_caps_name_the_setting(rollout: ServerThread) -> None:
    s = RolloutSettings(model="m")
    one = [pb.Prompt(text="1+1=")]
    cases = [
        ([pb.Prompt(text="a")] * (s.max_prompts_per_request + 1), 1, 1, "max_prompts_per_request"),
        (one, s.max_samples_per_request + 1, 1, "max_samples_per_request"),
        (one, s.max_samples_per_request, s.max_request_tokens // s.max_samples_per_request + 1,
         "max_request_tokens"),
        ([pb.Prompt(text="a" * (s.max_prompt_chars + 1))], 1, 1, "max_prompt_chars"),
    ]
    for prompts, n, tokens, name in cases:
        details = _refused(lambda p=prompts, n=n, t=tokens: _generate(rollout.address, p, n, t))
        assert f"--{name.replace('_', '-')}" in details and f"ROLLOUT_{name.upper()}" in details, details
        assert f"{getattr(s, name):,}" in details, details
    assert rollout.backend is not None and not any(len(t) > s.max_prompt_chars for t in rollout.backend.encoded)
    # at the caps the same service serves
    assert len(_generate(rollout.address, one, 2, 3)) >= 1


def test_dapo_step_fits_one_rollout_service_by_default() -> None:
    s = RolloutSettings(model="m")
    assert 512 * 16 <= s.max_samples_per_request and 512 <= s.max_prompts_per_request
    assert 512 * 16 * 20480 <= s.max_request_tokens


# ------------------------------------------------------------------------------------------------- trainer
def _dapo_config(dataset: Path) -> RunConfig:
    pytest.importorskip("tomllib")
    sys.path.insert(0, str(REPO_ROOT / "clients"))
    import start_run

    return start_run.parse_args(["--config", str(DAPO), "--model", str(default_model_dir()), "--dataset",
                                 str(dataset), "--rollout-addresses", "127.0.0.1:1"]).run_config()


def test_step_caps_unit(tmp_path: Path) -> None:
    cfg = _dapo_config(tmp_path / "d.jsonl")
    rules = RunRules(runs_root=tmp_path, read_roots=[tmp_path])
    with pytest.raises(ValueError) as e:
        check_bounds(cfg, rules)
    assert f"--max-step-tokens {DAPO_STEP_TOKENS}" in str(e.value)
    assert f"TRAINER_MAX_STEP_TOKENS={DAPO_STEP_TOKENS}" in str(e.value)
    check_bounds(cfg, RunRules(runs_root=tmp_path, read_roots=[tmp_path], max_step_tokens=DAPO_STEP_TOKENS))
    big = RunConfig(prompts_per_step=4096, group_size=8, max_new_tokens=1)
    with pytest.raises(ValueError, match=r"--max-step-samples 32768 \(TRAINER_MAX_STEP_SAMPLES=32768\)"):
        check_bounds(big, rules)
    evals = RunConfig(eval_every=1, eval_prompts=100_000, max_new_tokens=1024)
    with pytest.raises(ValueError, match="--max-eval-tokens"):
        check_bounds(evals, rules)
    with pytest.raises(ValueError, match="--max-eval-tokens"):  # eval_every 0: still before and after
        check_bounds(evals.model_copy(update={"eval_every": 0}), rules)
    check_bounds(evals.model_copy(update={"eval_prompts": 0}), rules)  # no evaluation, no cap


def _start_run(address: str, cfg: RunConfig) -> str:
    with grpc_channel(address) as ch:
        stub = trainer_pb2_grpc.TrainerServiceStub(ch)
        return _refused(lambda: stub.StartRun(trainer_pb2.StartRunRequest(config=to_proto(cfg)), timeout=60))


@pytest.mark.slow
def test_start_run_refuses_a_step_over_the_cap_and_says_how_to_raise_it(tmp_path: Path) -> None:
    missing = tmp_path / "missing.jsonl"  # past the caps, StartRun stops here (no run starts)
    cfg = _dapo_config(missing)
    with start_trainer_service(tmp_path / "runs", log_path=tmp_path / "t1.log") as address:
        details = _start_run(address, cfg)
        assert "max_step_tokens 33,554,432" in details and f"{DAPO_STEP_TOKENS:,} tokens" in details, details
        assert f"--max-step-tokens {DAPO_STEP_TOKENS} (TRAINER_MAX_STEP_TOKENS={DAPO_STEP_TOKENS})" in details
    with start_trainer_service(tmp_path / "runs", log_path=tmp_path / "t2.log",
                               extra_env={"TRAINER_MAX_STEP_TOKENS": str(DAPO_STEP_TOKENS)}) as address:
        details = _start_run(address, cfg)
        assert "no such file" in details and str(missing) in details, details  # the caps passed


# ------------------------------------------------------------------------------------------------- probe
@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("probe")
    app = create_app(ProbeSettings(allowed_roots=[str(tmp), str(default_model_dir())], jobs_dir=str(tmp / "jobs"),
                                   device="cpu", log_level="warning"))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started or not thread.is_alive(), 30, "the probe server to start")
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


@pytest.mark.parametrize("job,name,value", [
    ({"num_prompts": 4096, "num_samples": 4}, "max_job_samples", 16384),
    ({"num_prompts": 1000, "num_samples": 8, "max_new_tokens": 4096}, "max_job_tokens", 1000 * 8 * 4096),
    ({"entropy_bins": 100, "max_positions_per_group": 100_000}, "max_job_positions", 100 * 2 * 100_000),
])
def test_probe_job_caps_422(probe: str, job: dict, name: str, value: int) -> None:
    body = {"model": str(default_model_dir()), **job}
    r = httpx.post(f"{probe}/probe", json=body, headers=http_headers(), timeout=60)
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert f"= {value:,} exceeds" in detail and f"{getattr(ProbeSettings(), name):,}" in detail, detail
    assert f"--{name.replace('_', '-')} (PROBE_{name.upper()})" in detail and r.json()["limit"] == name
    assert httpx.get(f"{probe}/probe", headers=http_headers(), timeout=60).json() == {"jobs": []}  # none queued


def test_grpc_limits_are_settings() -> None:
    from forkrl.cli import parse_settings
    from serving.grpc_server import grpc_server_options
    from trainer_service.config import TrainerSettings

    opts = dict(grpc_server_options(4 << 20, 64 << 20, 8))
    assert opts == {"grpc.max_receive_message_length": 4 << 20, "grpc.max_send_message_length": 64 << 20,
                    "grpc.max_concurrent_streams": 8, "grpc.so_reuseport": 0,
                    "grpc.http2.min_recv_ping_interval_without_data_ms": 5000, "grpc.http2.max_ping_strikes": 0}
    t = parse_settings(TrainerSettings, ["--max-concurrent-streams", "8", "--max-message-mib", "2"])
    r = parse_settings(RolloutSettings, ["--model", "m", "--max-concurrent-streams", "8"])
    assert (t.max_concurrent_streams, t.max_message_mib, r.max_concurrent_streams) == (8, 2, 8)
