"""An authenticated weight push across two simulated hosts into a real vLLM rollout service (scripts/cluster_sim.py).

The trainer process (tests/rollout/transfer_trainer.py: the trainer's own `Rollouts.push`, --weight-sync transfer)
runs on fk-host1 with TRAINER_TRANSFER_ADDRESS = its address; the rollout service (vLLM, TLS, the token) on fk-host2.
Both hosts keep the machine's hostname (`own_hostname=False`), which does not resolve
inside the cluster: gloo's default device falls back to loopback there, as on a node whose name maps to 127.0.0.1,
so a worker that let gloo pick its address would advertise 127.0.0.1 to the trainer and the push would fail; the
weight group's sockets are bound to the address on the route to the trainer instead (tests/unit/
test_weight_channel.py checks that at its seam). After the push the service serves the pushed weights:
its log-probs, read from fk-host1 over TLS, equal the pushed weights' teacher-forced ones within the float32 bound
of tests/numerics.py (as tests/rollout/test_weight_transfer.py checks on one host), and no longer the old ones.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from scripts.cluster_sim import Cluster
from tests.cluster.conftest import require_cluster
from tests.numerics import logprob_parity
from tests.pki import make_pki
from tests.service_fixtures import REPO_ROOT, ServiceAddress, start_rollout_service

pytestmark = pytest.mark.slow
PEER = str(REPO_ROOT / "tests/cluster/served_peer.py")
PROMPTS = ["12+34+5=", "hello world"]


def _model(model_dir: Path, dtype: torch.dtype, state: dict[str, torch.Tensor] | None = None) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    if state is not None:
        m.load_state_dict(state)
    return m


def test_an_authenticated_push_across_hosts_serves_the_trainers_weights(tiny_model_dir: Path, tmp_path: Path) -> None:
    require_cluster()
    with Cluster(2) as cluster:
        trainer_host, server_host = "fk-host1", "fk-host2"
        pki = make_pki(tmp_path / "pki", names=(server_host, cluster.address(server_host)))
        env = {**os.environ, "FORKRL_TLS_CA": pki["ca"], "PYTHONPATH": str(REPO_ROOT),
               "TRAINER_TRANSFER_ADDRESS": cluster.address(trainer_host)}

        def on_trainer_host(*argv: str, timeout: float = 400) -> dict:
            out = cluster.run(trainer_host, [sys.executable, *argv], capture_output=True, text=True, env=env,
                              cwd=REPO_ROOT, timeout=timeout, own_hostname=False)
            lines = [x for x in out.stdout.splitlines() if x.startswith("{")]
            assert out.returncode == 0 and (lines or argv[1] == "wait"), out.stdout + out.stderr[-4000:]
            return json.loads(lines[-1]) if lines else {}

        def ready(service: ServiceAddress) -> None:  # from the trainer's host: this process cannot reach it
            on_trainer_host(PEER, "wait", service)

        with start_rollout_service(tiny_model_dir, log_path=tmp_path / "rollout.log", kv_cache_gib=1, seed=0,
                                   host=cluster.address(server_host), tls_cert_file=pki["cert"],
                                   tls_key_file=pki["key"], staging_dir=tmp_path / "staging", transfer_timeout_s=60,
                                   launcher=cluster.argv(server_host, [], own_hostname=False), ready=ready) as service:
            report = on_trainer_host("-m", "tests.rollout.transfer_trainer", "--address", service, "--model",
                                     str(tiny_model_dir), "--out", str(tmp_path / "pushed.safetensors"), "--seed",
                                     "1", "--run-id", "cluster-push", timeout=600)
            served = on_trainer_host(PEER, "generate", service, *PROMPTS)
        log_text = Path(service.log_path).read_text()
    assert report.get("version") == 1, report
    pushed = load_file(str(tmp_path / "pushed.safetensors"))
    assert report["bytes"] == sum(v.numel() * v.element_size() for v in pushed.values())
    assert "weights v1 in place (weight transfer" in log_text
    trajs = served["trajectories"]
    assert served["version"] == 1 and {t["policy_version"] for t in trajs} == {1}
    logprobs = [t["logprobs"] for t in trajs]
    seqs = [(t["prompt_token_ids"], t["completion_token_ids"]) for t in trajs]
    worst, bound = logprob_parity(logprobs, seqs, _model(tiny_model_dir, torch.float32, pushed),
                                  _model(tiny_model_dir, torch.float64, pushed), 1.0)
    assert worst <= bound, (worst, bound)
    base = (_model(tiny_model_dir, torch.float32), _model(tiny_model_dir, torch.float64))
    assert logprob_parity(logprobs, seqs, *base, 1.0)[0] > 10 * bound  # no longer the old weights
