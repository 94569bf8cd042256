"""The trainer service's gRPC API against a real rollout service (vLLM, the embedded tiny model): errors it
promises, every loss, resume after kill -9, SIGTERM with a run going. The client (clients/start_run.py) is
in test_start_run_client.py; run options, and a second rollout engine, in test_run_options.py.

The shared services (conftest.py) are never stopped or signalled here; tests that do start their own.
"""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from forkrl.training.config import RunConfig, to_proto
from forkrl.weights.checkpoint import latest_checkpoint, read_state
from forkrl.wire.trainer.v1 import trainer_pb2
from tests.service_fixtures import REPO_ROOT, start_trainer_service, wait_until
from tests.trainer.helpers import (
    SMALL,
    kept_bounds,
    metric_lines,
    run_to_end,
    stop_and_wait,
    trainer_stub,
)

pytestmark = pytest.mark.slow


def _code(fn) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        fn()
    return err.value.code(), err.value.details()


def test_bad_start_run_fields_and_second_run(rollout_address, trainer, tiny_model_dir, tmp_path) -> None:
    address, _ = trainer
    with trainer_stub(address) as stub:
        bad = to_proto(RunConfig(model=str(tiny_model_dir), rollout_addresses=[rollout_address]))
        bad.entropy_top_frac = 1.5
        code, msg = _code(lambda: stub.StartRun(trainer_pb2.StartRunRequest(config=bad), timeout=30))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert "entropy_top_frac must be in (0, 1], got 1.5" in msg

        missing = to_proto(RunConfig(model=str(tmp_path / "nope"), rollout_addresses=[rollout_address]))
        code, msg = _code(lambda: stub.StartRun(trainer_pb2.StartRunRequest(config=missing), timeout=30))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "config.json" in msg

        foreign = tmp_path / "falcon"  # a model type whose log-probs the train step cannot match (forkrl/rl/head.py)
        foreign.mkdir()
        (foreign / "config.json").write_text('{"model_type": "falcon_h1"}')
        unmatched = to_proto(RunConfig(model=str(foreign), rollout_addresses=[rollout_address]))
        code, msg = _code(lambda: stub.StartRun(trainer_pb2.StartRunRequest(config=unmatched), timeout=30))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "model_type 'falcon_h1' is not supported" in msg

        long_run = RunConfig(model=str(tiny_model_dir), rollout_addresses=[rollout_address], num_steps=1000,
                             **SMALL)
        first = stub.StartRun(trainer_pb2.StartRunRequest(config=to_proto(long_run)), timeout=60)
        try:
            code, msg = _code(lambda: stub.StartRun(trainer_pb2.StartRunRequest(config=to_proto(long_run)),
                                                    timeout=30))
            assert code == grpc.StatusCode.FAILED_PRECONDITION and first.run_id in msg
        finally:
            run = stop_and_wait(address, first.run_id)
    assert run.state == trainer_pb2.RUN_STATE_STOPPED
    ckpt = latest_checkpoint(Path(first.run_dir))
    assert ckpt is not None and read_state(ckpt)["step"] == run.step  # StopRun checkpointed the last step


def test_unknown_run_ids_are_not_found_and_resume_needs_a_checkpoint(
    rollout_address, trainer, tiny_model_dir, tmp_path
) -> None:
    address, _ = trainer
    with trainer_stub(address) as stub:
        for call in (
            lambda: stub.GetRun(trainer_pb2.GetRunRequest(run_id="no-such-run"), timeout=10),
            lambda: stub.StopRun(trainer_pb2.StopRunRequest(run_id="no-such-run"), timeout=10),
            lambda: list(stub.WatchRun(trainer_pb2.WatchRunRequest(run_id="no-such-run"), timeout=10)),
        ):
            code, msg = _code(call)
            assert code == grpc.StatusCode.NOT_FOUND and "no run 'no-such-run'" in msg
        long_id = "r" * 100_000  # was RESOURCE_EXHAUSTED: the NOT_FOUND message echoed it past gRPC's header limit
        for call in (
            lambda: stub.GetRun(trainer_pb2.GetRunRequest(run_id=long_id), timeout=10),
            lambda: stub.StopRun(trainer_pb2.StopRunRequest(run_id=long_id), timeout=10),
            lambda: list(stub.WatchRun(trainer_pb2.WatchRunRequest(run_id=long_id), timeout=10)),
        ):
            code, msg = _code(call)
            assert (code, msg) == (grpc.StatusCode.INVALID_ARGUMENT, "run_id has at most 64 characters, got 100,000")

        base = dict(model=str(tiny_model_dir), rollout_addresses=[rollout_address], num_steps=1, **SMALL)
        # a valid path of 4,000 bytes, echoed by the refusal cut short (the path's first 200 characters and its length,
        # or the status would not fit gRPC's header limit once percent-encoded: RESOURCE_EXHAUSTED instead of the code)
        deep = str(tmp_path / "/".join(["é" * 100] * 19))
        far = RunConfig(**{**base, "model": deep})
        code, msg = _code(lambda: stub.StartRun(trainer_pb2.StartRunRequest(config=to_proto(far)), timeout=30))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and msg.startswith("model: ") and len(msg.encode()) <= 2048
        assert re.search(r"\.\.\. \([\d,]+ characters\)", msg) and deep not in msg  # its length, not the path
        assert len(msg.encode()) <= 2048, len(msg.encode())
        empty = tmp_path / "empty"
        resume = RunConfig(run_dir=str(empty), resume=True, **base)
        code, msg = _code(lambda: stub.StartRun(trainer_pb2.StartRunRequest(config=to_proto(resume)), timeout=30))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "no complete checkpoint" in msg

        # a run dir that holds a checkpoint is not overwritten by a fresh run
        from transformers import AutoModelForCausalLM

        from forkrl.weights.checkpoint import save_checkpoint

        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, use_safetensors=True)
        save_checkpoint(tmp_path / "used", "step_000001", model, None, None, {"step": 1, "data_cursor": 8})
        fresh = RunConfig(run_dir=str(tmp_path / "used"), **base)
        code, msg = _code(lambda: stub.StartRun(trainer_pb2.StartRunRequest(config=to_proto(fresh)), timeout=30))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "already holds checkpoints" in msg


def _checkpoint_run_ids(run_dir: Path) -> set[str]:
    saved = [p for p in (run_dir / "checkpoints").iterdir() if (p / "trainer_state.json").is_file()]
    return {read_state(p)["run_id"] for p in saved}


def test_a_stopped_run_resumed_on_the_same_trainer_keeps_its_id(rollout_address, trainer, tiny_model_dir,
                                                                tmp_path) -> None:
    """StopRun, then StartRun(resume) on the same trainer: the resumed run has the id of the run it continues, and
    GetRun / WatchRun of that id answer for it (the table replaced the stopped run); every checkpoint and the run
    dir's run_id file carry that one id."""
    address, _ = trainer
    run_dir = tmp_path / "again"
    base = dict(model=str(tiny_model_dir), rollout_addresses=[rollout_address], run_dir=str(run_dir), **SMALL)
    with trainer_stub(address) as stub:
        first = stub.StartRun(trainer_pb2.StartRunRequest(config=to_proto(RunConfig(num_steps=1000, **base))),
                              timeout=60)
        wait_until(lambda: stub.GetRun(trainer_pb2.GetRunRequest(run_id=first.run_id), timeout=10).step >= 1, 300,
                   "the first step")
    stopped = stop_and_wait(address, first.run_id)
    assert stopped.state == trainer_pb2.RUN_STATE_STOPPED, stopped.error
    run_id, items, run = run_to_end(address, RunConfig(num_steps=stopped.step + 1, resume=True, **base))
    assert run_id == run.run_id == first.run_id and run.state == trainer_pb2.RUN_STATE_SUCCEEDED, run.error
    assert [i.metrics.step for i in items if i.HasField("metrics")] == [stopped.step + 1]
    assert run.step == stopped.step + 1 and run.num_steps == stopped.step + 1  # GetRun(id): the resumed run
    assert _checkpoint_run_ids(run_dir) == {first.run_id} and (run_dir / "run_id").read_text().strip() == run_id
    assert {m["step"] for m in metric_lines(run_dir)} == set(range(1, stopped.step + 2))


def test_a_second_trainer_on_a_taken_port_fails_instead_of_sharing_it(trainer) -> None:
    """grpc.so_reuseport is off: a trainer started on a port in use exits with an error, where with
    gRPC's default it would start and silently share the port (and the traffic) with the first one."""
    address, runs_root = trainer
    port = address.rsplit(":", 1)[1]
    proc = subprocess.run(
        [sys.executable, "-m", "trainer_service", "--port", port, "--runs-root", str(runs_root), "--no-tensorboard"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )
    assert proc.returncode != 0 and f"could not bind 127.0.0.1:{port}" in proc.stderr + proc.stdout


@pytest.mark.parametrize("loss", ["grpo", "dr_grpo", "dapo", "reinforce", "rloo", "gspo", "cispo"])
def test_every_loss_runs_a_step_with_and_without_the_mask(loss, rollout_address, trainer, tiny_model_dir) -> None:
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
        _, items, run = run_to_end(address, cfg)
        assert run.state == trainer_pb2.RUN_STATE_SUCCEEDED, run.error
        steps = [i.metrics for i in items if i.HasField("metrics")]
        assert len(steps) == 1
        m = dict(steps[0].values)
        assert math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"])
        if rho is None:
            assert m["kept_tokens"] == m["response_tokens"]
        else:
            # 32 sequences in micro-batches of 16: each keeps ceil(0.2 n_j) of its n_j tokens
            lo, hi = kept_bounds(m["response_tokens"], m["micro_batches"])
            assert m["micro_batches"] == 2 and lo <= m["kept_tokens"] <= hi < m["response_tokens"]


def test_resume_after_kill_9_gives_the_same_weights(rollout_address, tiny_model_dir, tmp_path) -> None:
    base = dict(model=str(tiny_model_dir), rollout_addresses=[rollout_address], num_steps=6, save_every=2,
                entropy_top_frac=0.2, **SMALL)
    with start_trainer_service(tmp_path, log_path=tmp_path / "a.log") as address:
        _, _, run = run_to_end(address, RunConfig(run_dir=str(tmp_path / "straight"), **base))
        assert run.state == trainer_pb2.RUN_STATE_SUCCEEDED, run.error

    resumed_dir = tmp_path / "resumed"
    with start_trainer_service(tmp_path, log_path=tmp_path / "b.log") as address:
        with trainer_stub(address) as stub:
            stub.StartRun(trainer_pb2.StartRunRequest(config=to_proto(RunConfig(run_dir=str(resumed_dir), **base))),
                          timeout=60)
        wait_until(lambda: latest_checkpoint(resumed_dir), 300, "the first checkpoint", every_s=0.01)
        os.killpg(address.process.pid, signal.SIGKILL)
        address.process.wait(10)
    # killed while running: some checkpoint before the end (which one depends on how fast we were)
    killed_at = read_state(latest_checkpoint(resumed_dir))["step"]
    assert killed_at in (2, 4) and not (resumed_dir / "checkpoints" / "final").exists()

    with start_trainer_service(tmp_path, log_path=tmp_path / "c.log") as address:
        _, items, run = run_to_end(address, RunConfig(run_dir=str(resumed_dir), resume=True, **base))
        assert run.state == trainer_pb2.RUN_STATE_SUCCEEDED, run.error
        assert [i.metrics.step for i in items if i.HasField("metrics")] == list(range(killed_at + 1, 7))

    from safetensors.torch import load_file

    a = load_file(str(tmp_path / "straight" / "checkpoints" / "final" / "model.safetensors"))
    b = load_file(str(resumed_dir / "checkpoints" / "final" / "model.safetensors"))
    assert a.keys() == b.keys()
    diffs = {k: float((a[k] - b[k]).abs().max()) for k in a}
    assert max(diffs.values()) == 0.0, f"resumed weights differ: {diffs}"


def test_sigterm_stops_the_active_run_with_a_checkpoint(rollout_address, tiny_model_dir, tmp_path) -> None:
    """docker stop / Ctrl-C of the service: the run finishes its step, checkpoints it, and the service
    exits 0; the checkpoint is the last step in metrics.jsonl, so a resume loses nothing."""
    run_dir = tmp_path / "run"
    cfg = RunConfig(model=str(tiny_model_dir), rollout_addresses=[rollout_address], num_steps=1000,
                    run_dir=str(run_dir), **SMALL)
    with start_trainer_service(tmp_path, log_path=tmp_path / "trainer.log") as address:
        with trainer_stub(address) as stub:
            started = stub.StartRun(trainer_pb2.StartRunRequest(config=to_proto(cfg)), timeout=60)
            wait_until(lambda: stub.GetRun(trainer_pb2.GetRunRequest(run_id=started.run_id), timeout=10).step >= 2,
                       300, "two steps")
        address.process.send_signal(signal.SIGTERM)
        assert address.process.wait(timeout=120) == 0
    ckpt = latest_checkpoint(run_dir)
    assert ckpt is not None and ckpt.name.startswith("step_")  # stopped early: no final
    last = metric_lines(run_dir)[-1]["step"]
    assert read_state(ckpt)["step"] == last >= 2


def test_async_resume_after_kill_9_loses_and_repeats_no_step(rollout_address, tiny_model_dir, tmp_path) -> None:
    """max_staleness 1: the sampler runs a step ahead of the trainer, so at the kill it has drawn prompts the
    trainer never trained on. The checkpoint stores the cursor of the last trained batch: the resumed run
    continues with the next step and the next prompts (the trajectories depend on timing, so the weights are
    not compared: which version sampled a batch is decided by the race the staleness bound allows)."""
    base = dict(model=str(tiny_model_dir), rollout_addresses=[rollout_address], num_steps=6, save_every=2,
                max_staleness=1, **SMALL)
    run_dir = tmp_path / "runs" / "async"  # inside both trainers' runs_root
    with start_trainer_service(tmp_path / "runs", log_path=tmp_path / "a.log") as address:
        with trainer_stub(address) as stub:
            stub.StartRun(trainer_pb2.StartRunRequest(config=to_proto(RunConfig(run_dir=str(run_dir), **base))),
                          timeout=60)
        wait_until(lambda: latest_checkpoint(run_dir), 300, "the first checkpoint", every_s=0.01)
        os.killpg(address.process.pid, signal.SIGKILL)
        address.process.wait(10)
    state = read_state(latest_checkpoint(run_dir))
    killed_at = state["step"]
    assert killed_at in (2, 4) and not (run_dir / "checkpoints" / "final").exists()
    assert state["data_cursor"] == 8 * killed_at  # the trained batches' prompts, not the sampler's

    with start_trainer_service(tmp_path / "runs", log_path=tmp_path / "b.log") as address:
        _, items, run = run_to_end(address, RunConfig(run_dir=str(run_dir), resume=True, **base))
        assert run.state == trainer_pb2.RUN_STATE_SUCCEEDED, run.error
        assert [i.metrics.step for i in items if i.HasField("metrics")] == list(range(killed_at + 1, 7))
    lines = metric_lines(run_dir)[-(6 - killed_at):]  # the resumed run's (the killed one may have logged more)
    assert [m["data_cursor"] for m in lines] == [8.0 * s for s in range(killed_at + 1, 7)]
    assert all(m["staleness_max"] <= 1 and m["stale_batches_dropped"] == 0 for m in lines)
    assert read_state(run_dir / "checkpoints" / "final")["data_cursor"] == 48
