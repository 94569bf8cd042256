"""The rollout service's first CUDA query comes after the engine's environment is set (issue 43, item 1).

A `torch.cuda.is_available()` in the service's process before vLLM is imported creates a CUDA context unless
PYTORCH_NVML_BASED_CUDA_CHECK=1 is set, and vLLM (which sets the variable itself on import, too late for such a query)
then forks its engine core into a process where CUDA cannot start. So the entry point sets it before anything can
ask. The test runs the real entry point (`python -m rollout_service`, the compose and docs launch path) in a
subprocess where an import hook wraps `torch.cuda.is_available` and watches for vLLM's import; at the first of the
two (a CUDA query by anyone, or vLLM starting to import) it records the environment and who asked, and ends the
process: the variable must already be set then, by the entry point.
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

def record(event, caller):  # the first event of the process: record and stop
    print(json.dumps({"event": event, "nvml": os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK"),
                      "caller": f"{os.path.basename(caller.filename)}:{caller.name}"}), flush=True)
    os._exit(0)

class Spy(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "vllm":  # before any of vLLM's own code (which sets the variable) runs
            record("vllm import", traceback.extract_stack()[-2])
        if name != "torch.cuda":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            def is_available():  # the first CUDA query of the process
                record("cuda query", traceback.extract_stack()[-2])
            module.is_available = is_available
        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, Spy())
os.environ.pop("PYTORCH_NVML_BASED_CUDA_CHECK", None)
sys.argv = ["rollout_service", "--model", sys.argv[1], "--port", "0"]
import runpy
runpy.run_module("rollout_service", run_name="__main__")
"""


def test_the_nvml_check_is_set_before_the_first_cuda_query(tiny_model_dir: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_NVML_BASED_CUDA_CHECK"}
    env["PYTHONPATH"] = str(REPO_ROOT)
    out = subprocess.run([sys.executable, "-c", SPY, str(tiny_model_dir)], env=env, cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=300)
    lines = [x for x in out.stdout.splitlines() if x.startswith("{")]
    assert lines, f"neither a CUDA query nor vLLM's import happened (rc {out.returncode}):\n{out.stderr[-3000:]}"
    first = json.loads(lines[0])
    assert first["nvml"] == "1", first  # vLLM's own setting has not run yet: the entry point must have set it
