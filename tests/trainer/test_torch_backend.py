"""Training runs against a rollout service on the torch backend, which `--backend auto` picks for the embedded
tiny model on a CPU: the served policy is the trainer's after every push (the rollout's logprobs of each step's
samples agree with the trainer's to float32 rounding), sync and async, with the samples of an async step
generated while the previous push lands in place."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from forkrl.remote.rollout import RolloutClient
from forkrl.training.config import RunConfig
from forkrl.wire.trainer.v1 import trainer_pb2
from rollout_service.backends import TORCH_MAX_PARAMS, choose_backend, parameter_count
from tests.service_fixtures import ServiceAddress, start_rollout_service
from tests.trainer.helpers import metric_lines, run_to_end, trainer_rollout_logp_ceiling

pytestmark = pytest.mark.slow


def test_auto_picks_torch_only_for_small_models_on_a_cpu(tiny_model_dir: Path) -> None:
    n = parameter_count(str(tiny_model_dir))
    assert 0 < n <= TORCH_MAX_PARAMS
    settings = SimpleNamespace(backend="auto", model=str(tiny_model_dir))
    assert choose_backend(settings, gpu=False)[0] == "torch"
    assert choose_backend(settings, gpu=True)[0] == "vllm"
    for name in ("vllm", "torch"):
        assert choose_backend(SimpleNamespace(backend=name, model=str(tiny_model_dir)), gpu=False)[0] == name


@pytest.fixture(scope="module")
def auto_rollout(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceAddress]:
    d = tmp_path_factory.mktemp("rollout-auto")
    with start_rollout_service(tiny_model_dir, seed=0, backend="auto", staging_dir=d / "staging",
                               log_path=d / "rollout.log", expect_clean_stop=True) as address:
        yield address


@pytest.mark.parametrize("max_staleness", [0, 1])
def test_runs_on_the_torch_backend_serve_the_trainers_weights(auto_rollout, trainer, tiny_model_dir, tmp_path,
                                                              max_staleness: int) -> None:
    with RolloutClient(auto_rollout, timeout_s=60) as c:
        info = c.info()
    assert info.engine.backend == "torch"  # auto, for this model on a CPU
    assert "backend torch (auto: " in Path(auto_rollout.log_path).read_text()
    run_dir = tmp_path / "run"
    cfg = RunConfig(model=str(tiny_model_dir), rollout_addresses=[auto_rollout], run_dir=str(run_dir), seed=0,
                    num_steps=4, prompts_per_step=8, group_size=4, entropy_top_frac=0.2, lr=3e-4, eval_prompts=0,
                    max_staleness=max_staleness)
    _, _, run = run_to_end(trainer[0], cfg)
    assert run.state == trainer_pb2.RUN_STATE_SUCCEEDED, run.error
    lines = metric_lines(run_dir)
    assert [m["step"] for m in lines] == [1, 2, 3, 4]
    ceiling = trainer_rollout_logp_ceiling(tiny_model_dir)
    for m in lines:
        assert m["push_shm_services"] == 1  # no weight-transfer engine here: the shm route
        age = m.get("staleness_max", 0.0)  # logged by async runs only (sync: every sample is on-policy)
        assert age <= max_staleness
        if age == 0:
            # sampled from exactly the policy being trained: the rollout's logprobs are the trainer's to fp32 rounding
            assert m["logp_delta_max"] <= ceiling, (m["step"], m["logp_delta_max"], ceiling)
    if max_staleness:  # step s + 1 was sampled while step s trained (the engine kept serving through the pushes)
        assert any(m.get("staleness_max") == 1 for m in lines)
    with RolloutClient(auto_rollout, timeout_s=60) as c:
        after = c.info()
    # every step's weights were pushed and applied, after the run's initial weights when the service served others
    assert after.version == info.version + 4 + (info.version != 0)
    assert after.counters.samples - info.counters.samples == 4 * 8 * 4  # exactly the 4 steps' batches
