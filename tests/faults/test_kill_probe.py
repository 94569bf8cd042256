"""kill -9 of the probe service with a job running and jobs queued: after a restart on the same jobs dir every
job is reported, failed with the reason (interrupted), none silently lost. Real processes: `python -m
probe_service` under uvicorn, HTTP through httpx."""

from __future__ import annotations

import os
import shutil
import signal

import pytest

from tests.service_fixtures import start_probe_service, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.isolated]

# a job that runs for minutes on CPU (the one the queue-limit test cancels), and small ones queued behind it
BIG = {"sampler": "transformers", "steps": [1], "num_prompts": 512, "group_size": 16, "entropy_bins": 3,
       "max_positions_per_group": 64, "max_positions_per_trajectory": 2, "modules": ["lm_head"]}
SMALL = {**BIG, "num_prompts": 4, "group_size": 4, "max_positions_per_group": 4}


def test_jobs_queued_or_running_at_a_kill_are_reported_failed_after_the_restart(tiny_model_dir, tmp_path):
    root = tmp_path / "run" / "checkpoints"
    shutil.copytree(tiny_model_dir, root / "step_000001", ignore=shutil.ignore_patterns("forkrl_build.json"))
    jobs, log = tmp_path / "jobs", tmp_path / "probe.log"
    with start_probe_service(tmp_path, jobs, log, max_concurrent_jobs=1, max_queued_jobs=4) as client:
        running = client.post("/probe", json={"checkpoint_root": str(root), **BIG})
        assert running.status_code == 202, running.text
        wait_until(lambda: client.get(f"/probe/{running.json()['id']}").json()["state"] == "running", 120,
                   "the first job to run")
        queued = [client.post("/probe", json={"checkpoint_root": str(root), **SMALL}) for _ in range(3)]
        assert [r.status_code for r in queued] == [202] * 3
        assert {client.get(f"/probe/{r.json()['id']}").json()["state"] for r in queued} == {"queued"}
        os.killpg(client.process.pid, signal.SIGKILL)  # type: ignore[attr-defined]
        client.process.wait(10)  # type: ignore[attr-defined]
    ids = [running.json()["id"]] + [r.json()["id"] for r in queued]

    with start_probe_service(tmp_path, jobs, log, max_concurrent_jobs=1, max_queued_jobs=4) as client:
        states = {i: client.get(f"/probe/{i}").json() for i in ids}
        assert {i: s["state"] for i, s in states.items()} == dict.fromkeys(ids, "failed")
        assert "while the job was running" in states[ids[0]]["error"]
        assert all("while the job was queued" in states[i]["error"] and "submit it again" in states[i]["error"]
                   for i in ids[1:])
        assert {j["id"] for j in client.get("/probe").json()["jobs"]} == set(ids)
        health = client.get("/healthz").json()
        assert health["jobs"].get("failed", 0) == 4 and health["jobs"].get("queued", 0) == 0
