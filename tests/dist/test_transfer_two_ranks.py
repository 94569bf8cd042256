"""A 2-rank FSDP2 trainer (torchrun, gloo, CPU) pushes through the gloo weight-transfer backend into a real vLLM
rollout service: tests/dist/transfer_worker.py. Rank 0 broadcasts each layerwise group as both ranks gather it
(the model is never gathered whole for the push), the service serves version 1, and its log-probs equal the
pushed weights' teacher-forced log-probs within the float32 bound of tests/numerics.py. Launched by forkrl.launch
(torchrun, one node): during the whole run no process of it (torchrun's agent, the ranks, the rollout service and
vLLM's engine processes) listens on 0.0.0.0 or [::] (tests/listeners.py reads /proc)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from itertools import pairwise
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from forkrl.remote.rollout import RolloutClient
from tests.listeners import descendants, listening, on_every_interface
from tests.numerics import logprob_parity
from tests.service_fixtures import REPO_ROOT, start_rollout_service

pytestmark = [pytest.mark.slow, pytest.mark.isolated]


def test_a_two_rank_fsdp2_trainer_pushes_layer_by_layer(tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer.base import layerwise_groups

    with start_rollout_service(tiny_model_dir, seed=0, kv_cache_gib=1, staging_dir=tmp_path / "staging",
                               log_path=tmp_path / "rollout.log") as address:
        env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "forkrl.launch", "--nproc-per-node", "2",
               str(REPO_ROOT / "tests/dist/transfer_worker.py"), address, str(tiny_model_dir), str(tmp_path)]
        log = tmp_path / "torchrun.log"
        with log.open("w") as out:
            proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL)
            seen: set[tuple[int, str, str, int]] = set()
            deadline = time.monotonic() + 600
            while proc.poll() is None and time.monotonic() < deadline:
                seen |= listening(descendants(os.getpid()))  # torchrun, its ranks, the service and vLLM's
                time.sleep(0.2)
            if proc.poll() is None:
                proc.kill()
            assert proc.wait() == 0, log.read_text()[-8000:]
        assert [s for s in seen if on_every_interface(s[2])] == []
        # what the sampling saw: the rendezvous store (torchrun's agent), the ranks' own sockets, the transfer's
        names = {name for _, name, _, _ in seen}
        assert "pt_elastic" in names and len({pid for pid, _, _, _ in seen}) >= 4, seen
        report = json.loads((tmp_path / "report.json").read_text())
        pushed = load_file(str(tmp_path / "pushed.safetensors"))
        with RolloutClient(address) as client:
            assert client.info().version == 1
            trajs = list(client.generate(["12+34+5=", "hello world"], n=4, temperature=1.0, max_new_tokens=24,
                                         seed=9))
    assert report["routes"] == ["transfer"] and report["version"] == 1
    # the groups the sender streamed: vLLM's layerwise groups of the model's parameters
    m32 = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    params = dict(m32.named_parameters())
    sizes = [sum(params[n].numel() * 4 for n in g) for g in layerwise_groups(list(params))]
    held = max(a + b for a, b in pairwise(sizes))  # a group and the one before it, still in flight
    assert report["groups"] == len(sizes) and report["peak_held_bytes"] == held
    assert report["bytes"] == report["model_bytes"] and held < report["model_bytes"]
    m32.load_state_dict(pushed)
    m64 = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64).eval()
    m64.load_state_dict(pushed)
    assert {t.policy_version for t in trajs} == {1}
    worst, bound = logprob_parity([list(t.logprobs) for t in trajs],
                                  [(list(t.prompt_token_ids), list(t.completion_token_ids)) for t in trajs],
                                  m32, m64, 1.0)
    assert worst <= bound
