"""`forkrl.runtime.die_with`: a process ends when the ancestor it watches is gone, also on SIGKILL, and takes the
processes between the two with it (vLLM's engine core between the rollout service and a worker of
--engine-mode mp). Real processes: a chain top -> middle -> leaf, where the leaf watches the top; the reward pool's
workers (forkrl/data/rewards.py) watch their trainer the same way."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from forkrl.runtime import _start_time
from tests.service_fixtures import REPO_ROOT, wait_until

LEAF = textwrap.dedent("""
    import os, sys, time
    from forkrl.runtime import die_with
    assert die_with(int(sys.argv[1]), every_s=0.05) is not None
    print(os.getpid(), flush=True)
    time.sleep(600)
""")
MIDDLE = textwrap.dedent("""
    import subprocess, sys, time
    leaf = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], stdout=sys.stdout)
    time.sleep(600)
""")
TOP = textwrap.dedent("""
    import os, subprocess, sys, time
    subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2], str(os.getpid())], stdout=sys.stdout)
    time.sleep(600)
""")


def test_the_leaf_and_every_process_between_end_when_the_top_is_sigkilled(tmp_path: Path) -> None:
    out = tmp_path / "leaf.pid"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    with open(out, "w") as f:
        top = subprocess.Popen([sys.executable, "-c", TOP, MIDDLE, LEAF], stdout=f, env=env, start_new_session=True)
    try:
        leaf = int(wait_until(lambda: out.read_text().strip(), 120, "the leaf to start watching"))
        middle = int(Path(f"/proc/{leaf}/stat").read_text().rsplit(")", 1)[1].split()[1])
        assert middle not in (top.pid, 1)
        watched = {pid: _start_time(pid) for pid in (middle, leaf)}
        assert all(watched.values())
        os.kill(top.pid, signal.SIGKILL)
        top.wait(60)
        wait_until(lambda: all(_start_time(p) != t for p, t in watched.items()), 120,
                   "the middle and the leaf to end")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(top.pid, signal.SIGKILL)


def test_nothing_is_watched_from_outside_the_ancestry() -> None:
    from forkrl.runtime import die_with

    assert die_with(1) is None
    assert die_with(os.getpid()) is None  # itself: not an ancestor
