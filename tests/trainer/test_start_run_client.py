"""clients/start_run.py against the real services: a run from the command line, flags refused before
anything is sent, and Ctrl-C: without a terminal it detaches; at a terminal (a pseudo-terminal here, as a
person at a keyboard) it asks whether to stop the run or detach, and `--watch` follows a run again."""

from __future__ import annotations

import math
import queue
import signal
import subprocess
import threading
from pathlib import Path

import pytest
import torch

from forkrl.data.tasks import DEFAULT_TASK, TASKS
from forkrl.remote.channel import grpc_channel
from forkrl.weights.checkpoint import latest_checkpoint, read_state
from forkrl.wire.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from forkrl.wire.trainer.v1 import trainer_pb2
from tests.service_fixtures import REPO_ROOT, wait_until
from tests.trainer.helpers import (
    PtyProcess,
    metric_lines,
    start_run_argv,
    stop_and_wait,
    trainer_rollout_logp_ceiling,
    trainer_stub,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def logp_ceiling(tiny_model_dir: Path) -> float:
    return trainer_rollout_logp_ceiling(tiny_model_dir)


def _rollout_version(address: str) -> int:
    with grpc_channel(address) as ch:
        return rollout_pb2_grpc.RolloutServiceStub(ch).GetInfo(rollout_pb2.GetInfoRequest(), timeout=30).version


def _step(address: str, run_id: str) -> trainer_pb2.GetRunResponse:
    with trainer_stub(address) as stub:
        return stub.GetRun(trainer_pb2.GetRunRequest(run_id=run_id), timeout=10)


def test_three_step_run_through_the_client(rollout_address, trainer, tiny_model_dir, tmp_path, logp_ceiling) -> None:
    address, _ = trainer
    v0 = _rollout_version(rollout_address)
    run_dir = tmp_path / "run3"
    cmd = start_run_argv(
        "--entropy-top-frac", "0.2", "--num-steps", "3", "--prompts-per-step", "8", "--group-size", "4",
        "--eval-prompts", "16", "--micro-batch-size", "64", "--run-dir", str(run_dir), "--model", str(tiny_model_dir),
        "--rollout-addresses", rollout_address, "--trainer-address", address,
    )
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "succeeded" in proc.stdout

    lines = metric_lines(run_dir)
    assert [m["step"] for m in lines] == [1, 2, 3]
    for m in lines:
        n = int(m["response_tokens"])
        # one micro-batch per step: exactly k = max(1, ceil(N / 5)) of the N response tokens are kept,
        # so the kept fraction lies in [0.2, 0.2 + 1/N) whatever N the samples gave
        assert m["micro_batches"] == 1 and m["kept_tokens"] == max(1, -(-n // 5))
        assert m["kept_frac"] == pytest.approx(m["kept_tokens"] / n, rel=1e-12)
        assert 0.2 <= m["kept_frac"] < 0.2 + 1 / n
        assert m["entropy_kept_mean"] >= m["entropy_mean"]  # the top fifth by entropy
        assert m["logp_delta_max"] <= logp_ceiling  # the rollout engine served exactly the trainer's policy
        for key in ("reward_mean", "accuracy", "grad_norm", "time_generate_s", "time_push_s", "mask_threshold"):
            assert math.isfinite(m[key]), key
        # what the mask kept by answer-token class: the shares are counts of the kept (and of all) tokens
        for which, total in (("kept", m["kept_tokens"]), ("all", n)):
            counts = [m[f"{which}_share_{c}"] * total for c in TASKS[DEFAULT_TASK].classes]
            assert all(abs(x - round(x)) < 1e-6 for x in counts) and sum(map(round, counts)) == total, which
    assert [e["step"] for e in metric_lines(run_dir, "eval")] == [0, 3]
    # one push per step, plus the initial sync when the service no longer served the start checkpoint
    assert _rollout_version(rollout_address) == v0 + 3 + (v0 != 0)

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
    version = _rollout_version(rollout_address)
    with grpc_channel(rollout_address) as ch:
        resp = rollout_pb2_grpc.RolloutServiceStub(ch).LoadWeights(
            rollout_pb2.LoadWeightsRequest(path=str(final), target_version=version + 1), timeout=120
        )
    assert resp.version == version + 1


def test_client_rejects_bad_flags_before_sending() -> None:
    for flags, needle in (
        (["--entropy-top-frac", "1.5"], "entropy_top_frac must be in (0, 1], got 1.5"),
        (["--loss", "ppo"], "--loss: Input should be 'grpo'"),
        (["--num-steps", "0"], "--num-steps: Input should be greater than or equal to 1"),
        (["--loss", "rloo", "--group-size", "1"], "group_size >= 2"),
        # out of range (to_proto would raise "ValueError: Value out of range" past int32): the flag and its limit
        (["--num-steps", "1000000000000"], "--num-steps: Input should be less than or equal to 10000000"),
        (["--ppo-epochs", str(2**31 - 1)], "--ppo-epochs: Input should be less than or equal to 64"),
        (["--seed", str(2**63)], "--seed: Input should be less than or equal to 9223372036854775807"),
        (["--temperature", "3"], "--temperature: Input should be less than or equal to 2"),
        (["--weight-decay", "inf"], "--weight-decay: Input should be a finite number"),
    ):
        # an unreachable trainer address: the client must fail on the flags, never try to connect
        proc = subprocess.run(start_run_argv(*flags, "--trainer-address", "127.0.0.1:9"), capture_output=True,
                              text=True, timeout=60, stdin=subprocess.DEVNULL, cwd=REPO_ROOT)
        assert proc.returncode == 2, (flags, proc.stderr)
        assert needle in proc.stderr and "Traceback" not in proc.stderr, (flags, proc.stderr)


def _long_run_flags(rollout_address: str, trainer_address: str, model: Path) -> list[str]:
    return ["--num-steps", "1000", "--prompts-per-step", "4", "--group-size", "2", "--eval-prompts", "0",
            "--model", str(model), "--rollout-addresses", rollout_address, "--trainer-address", trainer_address]


def test_ctrl_c_without_a_terminal_detaches_and_the_run_goes_on(rollout_address, trainer, tiny_model_dir) -> None:
    address, _ = trainer
    proc = subprocess.Popen(start_run_argv(*_long_run_flags(rollout_address, address, tiny_model_dir)),
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True)
    reader.start()
    run_id = None
    try:
        first = lines.get(timeout=120)  # a readline with a deadline
        assert "started" in first, first
        run_id = first.split()[1]
        wait_until(lambda: _step(address, run_id).step >= 1, 120, "the first step")
        proc.send_signal(signal.SIGINT)  # no terminal: the client detaches instead of asking
        returncode = proc.wait(timeout=60)
        reader.join(10)
        out = "".join(lines.queue)
        assert returncode == 0, out[-3000:]
        assert f"--watch {run_id}" in out
        assert _step(address, run_id).state == trainer_pb2.RUN_STATE_RUNNING
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        if run_id is not None:
            run = stop_and_wait(address, run_id)
            assert run.state in (trainer_pb2.RUN_STATE_STOPPED, trainer_pb2.RUN_STATE_SUCCEEDED)


def test_ctrl_c_at_a_terminal_asks_to_stop_or_detach(rollout_address, trainer, tiny_model_dir) -> None:
    address, _ = trainer
    run_id = None
    terms: list[PtyProcess] = []
    try:
        term = PtyProcess(start_run_argv(*_long_run_flags(rollout_address, address, tiny_model_dir)))
        terms.append(term)
        run_id = term.expect(r"run (\S+) started in").group(1)
        term.expect(r"\[started step 0\]")  # the client is following the run
        wait_until(lambda: _step(address, run_id).step >= 1, 120, "the first step")
        term.send("\x03")  # Ctrl-C at the keyboard
        term.expect(r"Stop the run \(writes a checkpoint\) or detach\? \[s/d\]")
        term.send("d\n")
        term.expect(rf"detached; the run goes on\. Follow it again with: .*--watch {run_id}")
        assert term.wait() == 0
        assert _step(address, run_id).state == trainer_pb2.RUN_STATE_RUNNING

        watch = PtyProcess(start_run_argv("--watch", run_id, "--trainer-address", address))
        terms.append(watch)
        watch.expect(r"\[started step 0\]")  # --watch replays the run's events from the start
        watch.send("\x03")
        watch.expect(r"\[s/d\]")
        watch.send("s\n")
        watch.expect(rf"stopping run {run_id}")
        watch.expect(rf"run {run_id} stopped", timeout_s=300)
        assert watch.wait() == 0
        run = _step(address, run_id)
        assert run.state == trainer_pb2.RUN_STATE_STOPPED
        ckpt = latest_checkpoint(Path(run.run_dir))
        assert ckpt is not None and read_state(ckpt)["step"] == run.step  # stopping checkpointed the last step
    finally:
        for t in terms:
            t.close()
        if run_id is not None:
            stop_and_wait(address, run_id)
