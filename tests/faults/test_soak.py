"""A 3-minute soak (scripts/soak.py): the real stack (vLLM rollout, trainer, probe) trains while a fixed-seed schedule
kills, stops and starves it; the script's exit status and every row of its table must say nothing was lost,
duplicated, corrupted or left behind. The hour-long one: `python scripts/soak.py --minutes 60 --seed 1`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.service_fixtures import REPO_ROOT

pytestmark = [pytest.mark.slow, pytest.mark.isolated]

# one of each: a kill of every service, a kill inside a push and inside a checkpoint write, a stall, a full disk
# (skipped and said when a tmpfs cannot be mounted: not root)
FAULTS = "kill_rollout,kill_trainer,term_trainer,kill_probe,stop_rollout,kill_push,kill_checkpoint,disk_full"


def test_a_three_minute_soak_loses_nothing(tmp_path):
    out = tmp_path / "soak"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "scripts/soak.py", "--minutes", "3", "--seed", "7", "--per-hour", "20",
                           "--faults", FAULTS, "--out", str(out)], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=1800)
    print(proc.stdout[-6000:], proc.stderr[-3000:])
    report = json.loads((out / "soak.json").read_text())
    rows = {r["name"]: r for r in report["results"]}
    failed = {n: r["detail"] for n, r in rows.items() if not r["ok"]}
    assert proc.returncode == 0 and not failed, failed
    for name in ("steps (metrics.jsonl)", "steps (logger: TensorBoard)", "checkpoints", "served version", "orphans",
                 "probe jobs", "faults", "growth rollout", "growth trainer", "growth probe"):
        assert name in rows, sorted(rows)
    applied = [f for f in report["faults"] if not f["detail"].startswith("skipped")]
    assert len(applied) >= 4, report["faults"]
