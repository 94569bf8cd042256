"""scripts/gpu_check.sh without a GPU: it must stop at once with exit status 2 and say what it needs.
(Its --dry-run, the same path end to end on CPU with a tiny model, starts both services: not a unit test.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.sh"


def run(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PY": sys.executable, **env})


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine would run the whole check")
def test_without_cuda_it_fails_fast_and_says_so():
    out = run(FORKRL_GPU_CHECK_DEVICE="cuda")
    assert out.returncode == 2
    assert "no CUDA device" in out.stderr and "--dry-run" in out.stderr


def test_bad_arguments_are_refused():
    assert run("--bogus").returncode == 2
    assert run(FORKRL_GPU_CHECK_DEVICE="tpu").returncode == 2
