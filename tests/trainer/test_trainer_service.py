"""Trainer service end to end against a real rollout service (vLLM, the embedded tiny model).

Order matters for the first test: it needs the module's rollout service still at version 0.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import torch

from forkrl.training.config import RunConfig, to_proto
from forkrl.weights.checkpoint import latest_checkpoint, read_state
from forkrl.wire.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from forkrl.wire.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from tests.service_fixtures import REPO_ROOT, start_rollout_service
from tests.trainer.conftest import start_trainer_service

pytestmark = pytest.mark.slow

SMALL = dict(prompts_per_step=8, group_size=4, eval_prompts=0, seed=0)


def _stub(address: str) -> trainer_pb2_grpc.TrainerServiceStub:
    return trainer_pb2_grpc.TrainerServiceStub(grpc.insecure_channel(address))


def _run(
    address: str, cfg: RunConfig, timeout_s: float = 300
) -> tuple[str, list, trainer_pb2.GetRunResponse]:
    stub = _stub(address)
    started = stub.StartRun(trainer_pb2.StartRunRequest(config=to_proto(cfg)), timeout=60)
    items = list(stub.WatchRun(trainer_pb2.WatchRunRequest(run_id=started.run_id), timeout=timeout_s))
    return started.run_id, items, stub.GetRun(trainer_pb2.GetRunRequest(run_id=started.run_id), timeout=10)


def _rollout_info(address: str) -> rollout_pb2.GetInfoResponse:
    stub = rollout_pb2_grpc.RolloutServiceStub(grpc.insecure_channel(address))
    return stub.GetInfo(rollout_pb2.GetInfoRequest(), timeout=10)


def _metric_lines(run_dir: Path) -> list[dict]:
    lines = [json.loads(s) for s in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [m for m in lines if m["kind"] == "train"]


def test_three_step_run_through_the_client(rollout_address, trainer, tiny_model_dir, tmp_path) -> None:
    address, _ = trainer
    assert _rollout_info(rollout_address).version == 0
    run_dir = tmp_path / "run3"
    cmd = [
        sys.executable,
        str(REPO_ROOT / "clients" / "start_run.py"),
        "--entropy-top-frac",
        "0.2",
        "--num-steps",
        "3",
        "--prompts-per-step",
        "8",
        "--group-size",
        "4",
        "--eval-prompts",
        "16",
        "--micro-batch-size",
        "64",
        "--run-dir",
        str(run_dir),
        "--model",
        str(tiny_model_dir),
        "--rollout-addresses",
        rollout_address,
        "--trainer-address",
        address,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "succeeded" in proc.stdout

    lines = _metric_lines(run_dir)
    assert [m["step"] for m in lines] == [1, 2, 3]
    for m in lines:
        # one micro-batch per step: exactly ceil(0.2 * N) of the N response tokens are kept
        assert m["kept_tokens"] == max(1, math.ceil(0.2 * m["response_tokens"] - 1e-9))
        # kept = ceil(0.2 N), so 0 <= kept / N - 0.2 < 1 / N (a ceiling can add up to one whole token)
        assert -1e-12 <= m["kept_frac"] - 0.2 < 1 / m["response_tokens"]
        assert m["entropy_kept_mean"] >= m["entropy_mean"]
        assert m["logp_delta_max"] < 1e-3  # the rollout engine served exactly the trainer's policy
        for key in (
            "reward_mean",
            "accuracy",
            "grad_norm",
            "time_generate_s",
            "time_push_s",
            "mask_threshold",
        ):
            assert math.isfinite(m[key]), key
    evals = [json.loads(s) for s in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals if e["kind"] == "eval"] == [0, 3]
    assert _rollout_info(rollout_address).version == 3

    final = run_dir / "checkpoints" / "final"
    assert read_state(final)["step"] == 3
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(final, use_safetensors=True)
    AutoTokenizer.from_pretrained(final)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, use_safetensors=True)
    changed = [
        n
        for (n, a), b in zip(model.state_dict().items(), base.state_dict().values(), strict=True)
        if not torch.equal(a, b)
    ]
    assert changed, "training did not change any weight"
    # vLLM loads the checkpoint: LoadWeights through the real engine
    stub = rollout_pb2_grpc.RolloutServiceStub(grpc.insecure_channel(rollout_address))
    resp = stub.LoadWeights(rollout_pb2.LoadWeightsRequest(path=str(final), target_version=4), timeout=120)
    assert resp.version == 4


def test_bad_start_run_fields_and_second_run(rollout_address, trainer, tiny_model_dir, tmp_path) -> None:
    address, _ = trainer
    stub = _stub(address)
    bad = to_proto(RunConfig(model=str(tiny_model_dir), rollout_addresses=[rollout_address]))
    bad.entropy_top_frac = 1.5
    with pytest.raises(grpc.RpcError) as err:
        stub.StartRun(trainer_pb2.StartRunRequest(config=bad), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "entropy_top_frac must be in (0, 1], got 1.5" in err.value.details()

    missing = to_proto(RunConfig(model=str(tmp_path / "nope"), rollout_addresses=[rollout_address]))
    with pytest.raises(grpc.RpcError) as err:
        stub.StartRun(trainer_pb2.StartRunRequest(config=missing), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "config.json" in err.value.details()

    long_run = RunConfig(
        model=str(tiny_model_dir), rollout_addresses=[rollout_address], num_steps=1000, **SMALL
    )
    first = stub.StartRun(trainer_pb2.StartRunRequest(config=to_proto(long_run)), timeout=60)
    try:
        with pytest.raises(grpc.RpcError) as err:
            stub.StartRun(trainer_pb2.StartRunRequest(config=to_proto(long_run)), timeout=30)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert first.run_id in err.value.details()
    finally:
        stub.StopRun(trainer_pb2.StopRunRequest(run_id=first.run_id), timeout=30)
    items = list(stub.WatchRun(trainer_pb2.WatchRunRequest(run_id=first.run_id), timeout=300))
    final = items[-1].event
    assert final.kind == trainer_pb2.EVENT_KIND_FINISHED and final.state == trainer_pb2.RUN_STATE_STOPPED
    ckpt = latest_checkpoint(Path(first.run_dir))
    assert ckpt is not None and read_state(ckpt)["step"] == final.step  # StopRun checkpointed the last step


def test_client_rejects_bad_flags_before_sending() -> None:
    for flags, needle in (
        (["--entropy-top-frac", "1.5"], "entropy_top_frac must be in (0, 1], got 1.5"),
        (["--loss", "ppo"], "--loss: Input should be 'grpo'"),
        (["--num-steps", "0"], "--num-steps: Input should be greater than or equal to 1, got '0'"),
        (["--loss", "rloo", "--group-size", "1"], "group_size >= 2"),
    ):
        # an unreachable trainer address: the client must fail on the flags, never try to connect
        proc = subprocess.run(
            [
                sys.executable,
                str(REPO_ROOT / "clients" / "start_run.py"),
                *flags,
                "--trainer-address",
                "127.0.0.1:9",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 2, (flags, proc.stderr)
        assert needle in proc.stderr, (flags, proc.stderr)


@pytest.mark.parametrize("loss", ["grpo", "dr_grpo", "dapo", "reinforce", "rloo", "gspo", "cispo"])
def test_every_loss_runs_a_step_with_and_without_the_mask(
    loss, rollout_address, trainer, tiny_model_dir
) -> None:
    address, _ = trainer
    for rho in (None, 0.2):
        cfg = RunConfig(
            model=str(tiny_model_dir),
            rollout_addresses=[rollout_address],
            loss=loss,
            entropy_top_frac=rho,
            num_steps=1,
            micro_batch_size=16,
            **SMALL,
        )
        _, items, run = _run(address, cfg)
        assert run.state == trainer_pb2.RUN_STATE_SUCCEEDED, run.error
        steps = [i.metrics for i in items if i.HasField("metrics")]
        assert len(steps) == 1
        m = dict(steps[0].values)
        assert math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"])
        if rho is None:
            assert m["kept_tokens"] == m["response_tokens"]
        else:
            assert m["kept_tokens"] < m["response_tokens"] and m["kept_frac"] < 0.3


def test_resume_after_kill_9_gives_the_same_weights(rollout_address, tiny_model_dir, tmp_path) -> None:
    base = dict(
        model=str(tiny_model_dir),
        rollout_addresses=[rollout_address],
        num_steps=4,
        save_every=2,
        entropy_top_frac=0.2,
        **SMALL,
    )
    with start_trainer_service(tmp_path / "runs_a") as (address, _):
        _, _, run = _run(address, RunConfig(run_dir=str(tmp_path / "straight"), **base))
        assert run.state == trainer_pb2.RUN_STATE_SUCCEEDED, run.error

    resumed_dir = tmp_path / "resumed"
    with start_trainer_service(tmp_path / "runs_b") as (address, proc):
        stub = _stub(address)
        stub.StartRun(
            trainer_pb2.StartRunRequest(config=to_proto(RunConfig(run_dir=str(resumed_dir), **base))),
            timeout=60,
        )
        deadline = time.monotonic() + 300
        while latest_checkpoint(resumed_dir) is None:  # wait for step_000002
            assert time.monotonic() < deadline, "no checkpoint after 300 s"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    assert read_state(latest_checkpoint(resumed_dir))["step"] == 2
    assert not (resumed_dir / "checkpoints" / "final").exists()

    with start_trainer_service(tmp_path / "runs_c") as (address, _):
        _, items, run = _run(address, RunConfig(run_dir=str(resumed_dir), resume=True, **base))
        assert run.state == trainer_pb2.RUN_STATE_SUCCEEDED, run.error
        assert [i.metrics.step for i in items if i.HasField("metrics")] == [3, 4]

    from safetensors.torch import load_file

    a = load_file(str(tmp_path / "straight" / "checkpoints" / "final" / "model.safetensors"))
    b = load_file(str(resumed_dir / "checkpoints" / "final" / "model.safetensors"))
    assert a.keys() == b.keys()
    diffs = {k: float((a[k] - b[k]).abs().max()) for k in a}
    assert max(diffs.values()) == 0.0, f"resumed weights differ: {diffs}"


def test_prompts_spread_over_several_rollout_services_sample_identically(rollout_address) -> None:
    """Sharding prompts over N rollout addresses must not change a single sample (seeds follow the global
    prompt index), so runs and resumes do not depend on how many rollout services there are."""
    from forkrl.training.rollouts import Rollouts

    prompts = [f"{a}+{b}+{c}=" for a, b, c in ((1, 2, 3), (45, 6, 78), (9, 90, 9), (12, 34, 56), (7, 0, 70))]
    one = Rollouts([rollout_address]).generate(prompts, n=3, temperature=1.0, max_new_tokens=11, seed=42)
    two = Rollouts([rollout_address, rollout_address]).generate(prompts, n=3, temperature=1.0, max_new_tokens=11,
                                                                seed=42)
    assert [[list(t.completion_token_ids) for t in g] for g in one] == \
        [[list(t.completion_token_ids) for t in g] for g in two]
    assert [[list(t.prompt_token_ids) for t in g] for g in one] == [[list(t.prompt_token_ids) for t in g] for g in two]


def test_ctrl_c_in_the_client_detaches_and_the_run_goes_on(rollout_address, trainer, tiny_model_dir) -> None:
    address, _ = trainer
    cmd = [sys.executable, str(REPO_ROOT / "clients" / "start_run.py"), "--num-steps", "1000",
           "--prompts-per-step", "4", "--group-size", "2", "--eval-prompts", "0", "--model", str(tiny_model_dir),
           "--rollout-addresses", rollout_address, "--trainer-address", address]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    first = proc.stdout.readline()
    assert "started" in first, first
    run_id = first.split()[1]
    stub = _stub(address)
    deadline = time.monotonic() + 120
    while stub.GetRun(trainer_pb2.GetRunRequest(run_id=run_id), timeout=10).step < 1:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)  # no terminal: the client detaches instead of asking
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert f"--watch {run_id}" in out
    run = stub.GetRun(trainer_pb2.GetRunRequest(run_id=run_id), timeout=10)
    assert run.state == trainer_pb2.RUN_STATE_RUNNING
    stub.StopRun(trainer_pb2.StopRunRequest(run_id=run_id), timeout=30)
    items = list(stub.WatchRun(trainer_pb2.WatchRunRequest(run_id=run_id), timeout=300))
    assert items[-1].event.state == trainer_pb2.RUN_STATE_STOPPED


def test_a_run_on_another_model_syncs_the_rollout_first(trainer, tiny_model_dir, tmp_path) -> None:
    """A fresh rollout service (version 0) serving the tiny model, and a run on another checkpoint: the
    trainer must push its initial weights before the first Generate, or step 1 trains on samples of a
    policy it is not training."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    other = tmp_path / "perturbed"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, use_safetensors=True)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(other, safe_serialization=True)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(other)

    with start_rollout_service(tiny_model_dir) as rollout_address:
        assert _rollout_info(rollout_address).version == 0
        cfg = RunConfig(model=str(other), rollout_addresses=[rollout_address], num_steps=1,
                        run_dir=str(tmp_path / "r"), **SMALL)
        _, _, run = _run(trainer[0], cfg)
        assert run.state == trainer_pb2.RUN_STATE_SUCCEEDED, run.error
        assert _rollout_info(rollout_address).version == 2  # initial sync + the step's push
    (m,) = _metric_lines(tmp_path / "r")
    assert m["logp_delta_max"] < 1e-3  # step 1 was sampled from exactly the policy being trained
