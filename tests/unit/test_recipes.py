"""Every checked-in recipe (recipes/*.toml) loads through `clients/start_run.py --config` and passes every check a
run makes before it starts; the files it names are checked only where they exist here (the paper recipe names
placeholders the user overrides). The paper recipe carries the paper's hyper-parameters."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from forkrl.data.tasks import DEFAULT_TASK
from forkrl.models.tiny import default_model_dir
from forkrl.training.config import RunConfig
from forkrl.training.preflight import check_values, preflight

REPO_ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((REPO_ROOT / "recipes").glob("*.toml"))
sys.path.insert(0, str(REPO_ROOT / "clients"))
import start_run  # noqa: E402

tomllib = pytest.importorskip("tomllib")  # --config needs Python >= 3.11, as start_run says


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in start_run.ENV_DEFAULTS.values():
        monkeypatch.delenv(var, raising=False)


def _load(path: Path, *flags: str) -> RunConfig:
    return start_run.parse_args(["--config", str(path), *flags]).run_config()


def test_the_recipes_are_there() -> None:
    assert {p.name for p in RECIPES} >= {"dapo_paper.toml", "tiny_default.toml"}


@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_every_recipe_loads_and_validates(path: Path, tmp_path: Path) -> None:
    keys = set(tomllib.loads(path.read_text()))
    unknown = keys - set(RunConfig.model_fields)
    assert not unknown, f"{path.name}: not run settings: {unknown}"
    assert not keys & {"run_dir", "resume", "rollout_addresses"}, "a recipe names no machine-specific run"
    cfg = _load(path)
    resolved = check_values(cfg)  # task, reward, the loss's combinations: no file needed
    assert resolved.loss_config().name == cfg.loss
    if cfg.mini_batch_prompts:
        assert cfg.prompts_per_step % cfg.mini_batch_prompts == 0, "mini-batches of equal size"
    model, dataset = Path(resolved.model), Path(resolved.dataset) if resolved.dataset else None
    if (model / "config.json").is_file() and (dataset is None or dataset.is_file()):
        preflight(resolved)  # the whole check where the files are here
    # flags override the file (the placeholders are replaced this way)
    flagged = _load(path, "--model", str(tmp_path), "--num-steps", "3")
    assert (flagged.model, flagged.num_steps) == (str(tmp_path), 3)


def test_the_paper_recipe_has_the_papers_hyper_parameters() -> None:
    cfg = _load(REPO_ROOT / "recipes" / "dapo_paper.toml")
    assert (cfg.loss, cfg.entropy_top_frac, cfg.kl_beta) == ("dapo", 0.2, 0.0)
    assert cfg.activation_checkpointing  # 20,480-token responses: docs/scaling.md "Memory plan"
    assert (cfg.prompts_per_step, cfg.group_size, cfg.mini_batch_prompts, cfg.ppo_epochs) == (512, 16, 32, 1)
    assert cfg.prompts_per_step // cfg.mini_batch_prompts == 16  # updates per rollout batch
    assert (cfg.clip_low, cfg.clip_high) == (0.2, 0.28)
    assert (cfg.dynamic_sampling, cfg.max_gen_batches) == (True, 10)
    assert (cfg.max_new_tokens, cfg.overlong_cache_len) == (20480, 4096)
    assert (cfg.lr, cfg.warmup_steps, cfg.weight_decay, cfg.max_grad_norm, cfg.temperature) == (
        1e-6, 10, 0.1, 1.0, 1.0)
    loss = check_values(cfg).loss_config()
    assert loss.aggregator == "token_mean" and loss.clip == (0.2, 0.28)


def test_the_tiny_recipe_is_the_embedded_default() -> None:
    cfg = _load(REPO_ROOT / "recipes" / "tiny_default.toml")
    assert not cfg.model and not cfg.dataset  # the embedded model and task
    resolved = check_values(cfg)
    assert (resolved.model, resolved.task) == (str(default_model_dir()), DEFAULT_TASK)
    assert (cfg.loss, cfg.entropy_top_frac, cfg.prompts_per_step, cfg.group_size) == ("grpo", 0.2, 32, 8)
