"""compose.gpu.yaml without a GPU: the settings it passes exist, and the services of one NCCL group share IPC."""

from __future__ import annotations

import re

import pytest

from rollout_service.config import RolloutSettings
from tests.service_fixtures import REPO_ROOT

yaml = pytest.importorskip("yaml")


def _services() -> dict:
    return yaml.safe_load((REPO_ROOT / "compose.gpu.yaml").read_text())["services"]


def test_the_services_of_an_nccl_group_share_the_hosts_ipc() -> None:
    """The rollouts' workers and the trainer's ranks form one NCCL group (--weight-sync transfer); NCCL's shm
    transport needs one /dev/shm where peer-to-peer access is unavailable."""
    services = _services()
    group = [name for name in services if name.startswith("rollout") or name == "trainer"]
    assert len(group) == 5 and {name: services[name].get("ipc") for name in group} == dict.fromkeys(group, "host")


def test_the_rollouts_settings_are_settings_of_the_service_and_fit_the_1_gpu_layout() -> None:
    fields = set(RolloutSettings.model_fields)
    for name, service in _services().items():
        if not name.startswith("rollout"):
            continue
        env = service["environment"]
        assert {k.removeprefix("ROLLOUT_").lower() for k in env if k.startswith("ROLLOUT_")} <= fields
        # replica 0 shares GPU 0 with the trainer by default: vLLM's start-up check of free memory must pass beside it
        low = re.fullmatch(r"\$\{ROLLOUT_GPU_MEMORY_UTILIZATION:-([\d.]+)\}", env["ROLLOUT_GPU_MEMORY_UTILIZATION"])
        assert low is not None and float(low.group(1)) <= 0.5
