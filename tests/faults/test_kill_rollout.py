"""kill -9 of the rollout service in the middle of a run, restarted on the same port: the run waits for it, pushes
its weights again, redoes the step in progress and ends SUCCEEDED with every step done once, each trained on
samples of the policy it had pushed (metrics.jsonl). Real processes: the vLLM rollout service and the trainer
service; the run is small (the embedded tiny model, 8 steps of 8 prompts x 4 samples), sync and async (k = 1).
And a rollout that never comes back: the run fails after its bounded wait, with a checkpoint of its last trained
step. And no orphans: SIGKILL of the service's main process leaves none of the processes it started running."""

from __future__ import annotations

import os
import signal
import statistics
from pathlib import Path

import pytest

from forkrl.remote.rollout import RolloutClient
from forkrl.training.config import RunConfig, to_proto
from forkrl.weights.checkpoint import latest_checkpoint, read_state
from forkrl.wire.trainer.v1 import trainer_pb2
from tests.service_fixtures import free_port, start_rollout_service, start_trainer_service, wait_until
from tests.trainer.helpers import SMALL, metric_lines, run_to_end, trainer_stub

pytestmark = [pytest.mark.slow, pytest.mark.isolated]
STEPS = 8


@pytest.mark.parametrize("max_staleness", [0, 1], ids=["sync", "async"])
def test_a_rollout_killed_mid_run_costs_the_step_in_progress_only(tiny_model_dir, tmp_path, max_staleness):
    """Sync: the step in progress is sampled again. Async (k = 1): the sampler is stopped, the batches sampled ahead
    are discarded, and sampling starts again from the step in progress once the weights are back."""
    port = free_port()  # the restarted service must come back where the run looks for it
    run_dir = tmp_path / "runs" / "run"
    cfg = RunConfig(model=str(tiny_model_dir), rollout_addresses=[f"127.0.0.1:{port}"], num_steps=STEPS,
                    run_dir=str(run_dir), max_staleness=max_staleness, **SMALL)
    rollout = dict(port=port, kv_cache_gib=1, seed=0, staging_dir=tmp_path / "staging")
    with start_trainer_service(tmp_path / "runs", log_path=tmp_path / "trainer.log", rollout_wait_s=300) as trainer, \
            trainer_stub(trainer) as stub:
        with start_rollout_service(tiny_model_dir, log_path=tmp_path / "rollout-a.log", **rollout) as first:
            run_id = stub.StartRun(trainer_pb2.StartRunRequest(config=to_proto(cfg)), timeout=60).run_id

            def get() -> trainer_pb2.GetRunResponse:
                return stub.GetRun(trainer_pb2.GetRunRequest(run_id=run_id), timeout=10)

            wait_until(lambda: get().step >= 2, 300, "two steps", every_s=0.05)
            os.killpg(first.process.pid, signal.SIGKILL)
            first.process.wait(10)
            at_kill = get()
            assert at_kill.state == trainer_pb2.RUN_STATE_RUNNING and at_kill.step < STEPS, "the kill came too late"
        with start_rollout_service(tiny_model_dir, log_path=tmp_path / "rollout-b.log", **rollout) as second:
            list(stub.WatchRun(trainer_pb2.WatchRunRequest(run_id=run_id), timeout=600))
            run = get()
            assert run.state == trainer_pb2.RUN_STATE_SUCCEEDED, run.error
            with RolloutClient(second) as c:
                info = c.info()
            assert info.lease_run_id == ""  # released at the end of the run
            assert info.version >= STEPS - at_kill.step  # the weights again, then one push per remaining step

    lines = metric_lines(run_dir)
    assert [m["step"] for m in lines] == list(range(1, STEPS + 1))  # every step, once
    # step s trains at version s - 1 and pushes s (policy_version); its samples come from a version this run pushed
    # (never the restarted service's own weights, which map to -1 or to the initial version 0) at most k versions
    # older than the trainer's: sync, exactly s - 1
    for m in lines:
        trained_at = m["policy_version"] - 1
        assert trained_at - max_staleness <= m["rollout_policy_version"] <= trained_at, m
        assert m["rollout_policy_version"] >= 0
        if m["step"] > 1 + max_staleness:  # past the start, a version 0 sample would be the restarted service's
            assert m["rollout_policy_version"] >= 1, m
    if max_staleness == 0:
        assert [m["rollout_policy_version"] for m in lines] == [m["policy_version"] - 1 for m in lines]
    if max_staleness:
        assert lines[-1]["stale_batches_dropped"] == 0  # recovered, not dropped
    assert lines[-1]["rollout_recoveries"] >= 1
    times = [m["time_step_s"] for m in lines]
    slow = max(range(STEPS), key=times.__getitem__)
    lost = times[slow] - statistics.median(times[:slow] + times[slow + 1:])
    print(f"\nrollout restart: step {slow + 1} took {times[slow]:.1f} s, {lost:.1f} s more than the median step; "
          f"foreign batches {lines[-1]['foreign_batches']:.0f}, recoveries {lines[-1]['rollout_recoveries']:.0f}")


def test_a_run_whose_rollout_never_returns_fails_with_a_checkpoint_and_resumes(tiny_model_dir, tmp_path):
    """The rollout is killed and not restarted: the run waits --rollout-wait-s (5 s here), then fails, having
    first written a checkpoint of its last trained step; a resume on another rollout service loses nothing."""
    run_dir = tmp_path / "runs" / "run"
    base = dict(model=str(tiny_model_dir), num_steps=STEPS, run_dir=str(run_dir), **SMALL)  # save_every 0
    rollout = dict(kv_cache_gib=1, seed=0, staging_dir=tmp_path / "staging")
    with start_trainer_service(tmp_path / "runs", log_path=tmp_path / "trainer.log", rollout_wait_s=5) as trainer, \
            trainer_stub(trainer) as stub:
        with start_rollout_service(tiny_model_dir, log_path=tmp_path / "rollout-a.log", **rollout) as first:
            cfg = RunConfig(rollout_addresses=[first], **base)
            run_id = stub.StartRun(trainer_pb2.StartRunRequest(config=to_proto(cfg)), timeout=60).run_id
            wait_until(lambda: stub.GetRun(trainer_pb2.GetRunRequest(run_id=run_id), timeout=10).step >= 2, 300,
                       "two steps", every_s=0.05)
            os.killpg(first.process.pid, signal.SIGKILL)
            first.process.wait(10)
        list(stub.WatchRun(trainer_pb2.WatchRunRequest(run_id=run_id), timeout=300))
        run = stub.GetRun(trainer_pb2.GetRunRequest(run_id=run_id), timeout=10)
        assert run.state == trainer_pb2.RUN_STATE_FAILED and "not SERVING after 5 s" in run.error, run.error
        assert run.step < STEPS, "the kill came too late"
        done = [m["step"] for m in metric_lines(run_dir)]
        assert done == list(range(1, len(done) + 1)) and len(done) >= 2
        assert read_state(latest_checkpoint(run_dir))["step"] == done[-1]  # saved on the way out

        with start_rollout_service(tiny_model_dir, log_path=tmp_path / "rollout-b.log", **rollout) as second:
            cfg = RunConfig(rollout_addresses=[second], resume=True, **base)
            _, items, run = run_to_end(trainer, cfg)
        assert run.state == trainer_pb2.RUN_STATE_SUCCEEDED, run.error
        assert [i.metrics.step for i in items if i.HasField("metrics")] == list(range(done[-1] + 1, STEPS + 1))
    assert [m["step"] for m in metric_lines(run_dir)] == list(range(1, STEPS + 1))


def _processes() -> dict[int, tuple[int, int, str]]:
    """Every live process: pid -> (parent pid, start time, name), from /proc; zombies left out."""
    out = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            head, rest = stat.read_text().rsplit(")", 1)
        except OSError:
            continue
        fields = rest.split()
        if fields[0] not in ("Z", "X"):
            out[int(stat.parent.name)] = (int(fields[1]), int(fields[19]), head.split("(", 1)[1])
    return out


def _descendants(root: int) -> dict[tuple[int, int], str]:
    """(pid, start time) -> name of every live descendant of `root`: an identity a reused pid does not share."""
    procs = _processes()
    found: dict[tuple[int, int], str] = {}
    frontier = [root]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, started, name) in procs.items():
            if ppid == parent and (pid, started) not in found:
                found[(pid, started)] = name
                frontier.append(pid)
    return found


@pytest.mark.parametrize("engine_mode", ["uni", "mp"])
def test_sigkill_of_the_rollout_leaves_none_of_its_processes(tiny_model_dir, tmp_path, engine_mode):
    """kill -9 of the service's main process: its vLLM engine core (and with --engine-mode mp its worker) and the
    multiprocessing resource tracker end too (the engine processes watch the service, forkrl/runtime.py; the
    tracker exits once no process holds its pipe). The budget only a hang exceeds."""
    with start_rollout_service(tiny_model_dir, log_path=tmp_path / "rollout.log", kv_cache_gib=1,
                               engine_mode=engine_mode, staging_dir=tmp_path / "staging") as address:
        main = address.process.pid
        children = _descendants(main)
        names = sorted(children.values())
        assert sum(n.startswith("VLLM::EngineCor") for n in names) == 1, names
        if engine_mode == "mp":
            assert len(children) >= 3, names  # the engine core, its worker, the resource tracker
        os.kill(main, signal.SIGKILL)  # the main process only: not its group
        address.process.wait(60)

        def gone() -> bool:
            live = _processes()
            return not any(pid in live and live[pid][1] == started for pid, started in children)

        wait_until(gone, 120, f"the processes the killed rollout service started ({names}) to end", every_s=0.2)
