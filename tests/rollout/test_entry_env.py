"""The rollout service's first CUDA query comes after the engine's environment is set (issue 43, item 1).

`--backend auto` asks `torch.cuda.is_available()` before vLLM is imported. Without PYTORCH_NVML_BASED_CUDA_CHECK=1
that query creates a CUDA context, and vLLM (which sets the variable itself on import, too late here) then forks its
engine core into a process where CUDA cannot start. The test runs the real entry point (`python -m rollout_service`
with --backend auto, the compose and docs launch path) in a subprocess where an import hook wraps
`torch.cuda.is_available`; at the first call it records the environment and who asked, and ends the process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.service_fixtures import REPO_ROOT

pytestmark = pytest.mark.slow  # imports torch in a subprocess (a few seconds)

SPY = r"""
import importlib.abc, importlib.machinery, json, os, sys, traceback

class Spy(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "torch.cuda":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            def is_available():  # the first CUDA query of the process: record and stop
                caller = traceback.extract_stack()[-2]
                print(json.dumps({"nvml": os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK"),
                                  "vllm_imported": "vllm" in sys.modules,
                                  "caller": f"{os.path.basename(caller.filename)}:{caller.name}"}), flush=True)
                os._exit(0)
            module.is_available = is_available
        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, Spy())
os.environ.pop("PYTORCH_NVML_BASED_CUDA_CHECK", None)
sys.argv = ["rollout_service", "--model", sys.argv[1], "--backend", "auto", "--port", "0"]
import runpy
runpy.run_module("rollout_service", run_name="__main__")
"""


def test_the_nvml_check_is_set_before_the_first_cuda_query(tiny_model_dir: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_NVML_BASED_CUDA_CHECK"}
    env["PYTHONPATH"] = str(REPO_ROOT)
    out = subprocess.run([sys.executable, "-c", SPY, str(tiny_model_dir)], env=env, cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=300)
    lines = [x for x in out.stdout.splitlines() if x.startswith("{")]
    assert lines, f"torch.cuda.is_available was never called (rc {out.returncode}):\n{out.stderr[-3000:]}"
    first = json.loads(lines[0])
    assert first["caller"] == "backends.py:choose_backend"  # --backend auto's rule: the query the issue names
    assert first["vllm_imported"] is False  # vLLM's own setting of the variable has not happened yet
    assert first["nvml"] == "1"  # ... so the entry point must have set it
