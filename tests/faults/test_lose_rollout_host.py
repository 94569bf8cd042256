"""One of two rollout services stops answering mid-run (SIGSTOP: what a partitioned host looks like to the trainer,
a silent peer whose kernel still holds the connection): the run keeps stepping with the other one; after SIGCONT
the service is pushed the trainer's current version, is back in the pool and samples again. Every step once in
metrics.jsonl. Real processes: two vLLM rollout services and the trainer service (the embedded tiny model)."""

from __future__ import annotations

import os
import signal

import pytest

from forkrl.remote.rollout import RolloutClient
from forkrl.training.config import RunConfig, to_proto
from forkrl.wire.trainer.v1 import trainer_pb2
from tests.service_fixtures import free_port, start_rollout_service, start_trainer_service, wait_until
from tests.trainer.helpers import SMALL, metric_lines, trainer_stub

pytestmark = [pytest.mark.slow, pytest.mark.isolated]
STEPS = 12


def test_a_silent_rollout_service_is_left_out_then_readmitted_at_the_current_version(tiny_model_dir, tmp_path):
    ports = [free_port(), free_port()]
    run_dir = tmp_path / "runs" / "run"
    # stream: the push route across hosts (the transfer route's broadcast would hold the silent peer in its group)
    cfg = RunConfig(model=str(tiny_model_dir), rollout_addresses=[f"127.0.0.1:{p}" for p in ports], num_steps=STEPS,
                    run_dir=str(run_dir), weight_sync="stream", **SMALL)
    common = dict(kv_cache_gib=1, seed=0)
    with start_trainer_service(tmp_path / "runs", log_path=tmp_path / "trainer.log", rollout_wait_s=300) as trainer, \
            trainer_stub(trainer) as stub, \
            start_rollout_service(tiny_model_dir, port=ports[0], log_path=tmp_path / "rollout-a.log",
                                  staging_dir=tmp_path / "sa", **common), \
            start_rollout_service(tiny_model_dir, port=ports[1], log_path=tmp_path / "rollout-b.log",
                                  staging_dir=tmp_path / "sb", **common) as second:
        run_id = stub.StartRun(trainer_pb2.StartRunRequest(config=to_proto(cfg)), timeout=60).run_id

        def get() -> trainer_pb2.GetRunResponse:
            return stub.GetRun(trainer_pb2.GetRunRequest(run_id=run_id), timeout=10)

        wait_until(lambda: get().step >= 1, 300, "one step", every_s=0.05)
        os.killpg(second.process.pid, signal.SIGSTOP)
        try:
            at_stop = get().step
            assert at_stop < STEPS - 4, "the stop came too late"

            def left_out() -> list[dict]:
                return [m for m in metric_lines(run_dir) if m.get("rollout_services_in") == 1]

            # the run goes on with the first service alone (generous: a loaded box; the keepalive needs ~20 s)
            wait_until(lambda: bool(left_out()) or get().state != trainer_pb2.RUN_STATE_RUNNING, 240,
                       "a step with the stopped service left out", every_s=0.2)
            assert get().state == trainer_pb2.RUN_STATE_RUNNING, get().error
            during = left_out()[0]
            assert during["rollout_failovers"] >= 1
        finally:
            os.killpg(second.process.pid, signal.SIGCONT)
        # back: before a later push the service answers its health check, is pushed the current version, samples
        wait_until(lambda: any(m["step"] > during["step"] and m.get("rollout_services_in") == 2
                               for m in metric_lines(run_dir)) or get().state != trainer_pb2.RUN_STATE_RUNNING,
                   300, "the stopped service re-admitted", every_s=0.2)
        list(stub.WatchRun(trainer_pb2.WatchRunRequest(run_id=run_id), timeout=600))
        run = get()
        assert run.state == trainer_pb2.RUN_STATE_SUCCEEDED, run.error
        lines = metric_lines(run_dir)
        with RolloutClient(f"127.0.0.1:{ports[0]}") as a, RolloutClient(f"127.0.0.1:{ports[1]}") as b:
            va, vb = a.info().version, b.info().version

    assert [m["step"] for m in lines] == list(range(1, STEPS + 1))  # every step, once
    last = lines[-1]
    assert va == last["policy_version"]  # the first service holds every push
    # the second is back in, holding the trainer's latest push (its own numbering: it missed the pushes while out)
    assert last["rollout_services_in"] == 2 and 1 <= vb < va
    back = [m for m in lines if m["step"] > during["step"] and m["rollout_services_in"] == 2]
    assert back, "the stopped service was never re-admitted"
    # it sampled again after it came back: its trajectory counter grows past where it stood while stopped
    assert last["rollout_samples_1"] > during["rollout_samples_1"]
    for m in lines:  # sync: every step trained on samples of the version it pushed last, never another
        assert m["rollout_policy_version"] == m["policy_version"] - 1, m
