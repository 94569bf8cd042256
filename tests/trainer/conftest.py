"""Fixtures for trainer tests: a real rollout service (vLLM) and real trainer service processes."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.service_fixtures import REPO_ROOT, _kill_group, free_port, start_rollout_service, wait_for_health


@contextlib.contextmanager
def start_trainer_service(runs_root: Path, **env: str) -> Iterator[tuple[str, subprocess.Popen]]:
    """`python -m trainer_service` on a free 127.0.0.1 port; yields (address, process)."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "trainer_service",
        "--port",
        str(port),
        "--runs-root",
        str(runs_root),
        "--no-tensorboard",
    ]
    log = tempfile.NamedTemporaryFile("w+b", prefix="trainer_service_", suffix=".log", delete=False)
    proc = subprocess.Popen(
        cmd,
        cwd=REPO_ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    address = f"127.0.0.1:{port}"
    try:
        try:
            wait_for_health(address, 120, proc)
        except Exception:
            log.seek(0)
            raise RuntimeError("trainer service failed to start:\n" + log.read().decode()[-3000:]) from None
        proc.log_path = log.name  # type: ignore[attr-defined]
        yield address, proc
    finally:
        _kill_group(proc, grace_s=20.0)
        log.close()


@pytest.fixture(scope="module")
def rollout_address(tiny_model_dir: Path) -> Iterator[str]:
    with start_rollout_service(tiny_model_dir, seed=0) as address:
        yield address


@pytest.fixture(scope="module")
def trainer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    runs_root = tmp_path_factory.mktemp("runs")
    with start_trainer_service(runs_root) as (address, _proc):
        yield address, runs_root
