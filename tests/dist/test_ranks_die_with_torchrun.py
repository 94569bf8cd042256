"""kill -9 of torchrun (the trainer's launcher) leaves none of its ranks running: each rank watches torchrun's agent
from `init_from_env` (forkrl/runtime.py `die_with`). Real torchrun, 2 ranks, gloo."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from forkrl.runtime import _start_time
from tests.service_fixtures import REPO_ROOT, wait_until

pytestmark = pytest.mark.slow

RANK = textwrap.dedent("""
    import os, sys, time
    from forkrl.training.distributed import init_from_env
    info = init_from_env()
    with open(os.path.join(sys.argv[1], f"rank{info.rank}"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)
""")


def test_sigkill_of_torchrun_ends_every_rank(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    torchrun = [sys.executable, "-m", "forkrl.launch", "--nproc-per-node", "2"]
    agent = subprocess.Popen([*torchrun, str(script), str(tmp_path)], env=env, start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        pids = [int(wait_until(lambda r=r: (tmp_path / f"rank{r}").exists() and (tmp_path / f"rank{r}").read_text(),
                               300, f"rank {r} to join")) for r in range(2)]
        ranks = {pid: _start_time(pid) for pid in pids}
        assert all(ranks.values())
        os.kill(agent.pid, signal.SIGKILL)
        agent.wait(60)
        wait_until(lambda: all(_start_time(p) != t for p, t in ranks.items()), 120, "both ranks to end")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(agent.pid, signal.SIGKILL)
