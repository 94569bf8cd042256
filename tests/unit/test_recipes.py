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
from forkrl.training.rules import RunRules, check_bounds

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
    assert {p.name for p in RECIPES} >= {"dapo_paper.toml", "tiny_default.toml", "seed_qwen2.5_1.5b.toml",
                                         "paper_qwen3_8b.toml"}


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


def _longest_row(cfg: RunConfig) -> int:
    """Prompt + response tokens of the longest row: scripts/memory_plan.py's prompt cap (DAPO's 2,048) + the cap."""
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    import memory_plan

    return memory_plan.Run().prompt_tokens + cfg.max_new_tokens


@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_the_recipes_take_micro_batches_by_tokens(path: Path) -> None:
    """Every recipe but the embedded demo sets the token budget (issue 45); with the mask on, the step-scope top-k
    (docs/algorithms-departures.md §6); the budget holds the longest row (a row longer would be alone: allowed,
    but then the recipe's memory sizing would not hold), and the recipe says how it was sized."""
    cfg = _load(path)
    if path.name == "tiny_default.toml":  # <= 16-token responses: fixed micro-batches (its comment says why)
        assert cfg.max_tokens_per_micro_batch == 0 and "fixed micro-batches" in path.read_text()
        return
    assert cfg.max_tokens_per_micro_batch >= _longest_row(cfg), path.name
    assert cfg.entropy_top_frac == 1 or cfg.mask_scope == "step", path.name
    line = next(s for s in path.read_text().splitlines() if s.startswith("max_tokens_per_micro_batch"))
    assert "#" in line and "memory_plan" in path.read_text(), "the budget's sizing is said"


def test_the_paper_recipe_has_the_papers_hyper_parameters() -> None:
    cfg = _load(REPO_ROOT / "recipes" / "dapo_paper.toml")
    assert (cfg.loss, cfg.entropy_top_frac, cfg.kl_beta) == ("dapo", 0.2, 0.0)
    assert cfg.activation_checkpointing  # 20,480-token responses: docs/scaling.md "Memory plan"
    # one longest row per micro-batch, by tokens (verl's ppo_max_token_len_per_gpu); the top-k per update
    assert (cfg.max_tokens_per_micro_batch, cfg.mask_scope) == (2048 + 20480, "step")
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


def test_the_seed_recipe_is_the_seeds_run() -> None:
    cfg = _load(REPO_ROOT / "recipes" / "seed_qwen2.5_1.5b.toml")
    assert "Qwen2.5-1.5B" in cfg.model
    assert (cfg.loss, cfg.entropy_top_frac, cfg.kl_beta, cfg.clip_low, cfg.clip_high) == ("dapo", 0.2, 0.0, 0.2, 0.28)
    assert (cfg.max_new_tokens, cfg.save_every) == (2048, 20)  # the seed probe's budget and checkpoint steps
    assert cfg.prompts_per_step % 4 == 0  # whole prompts on each of its 4 trainer ranks
    assert cfg.mini_batch_prompts == 0 and cfg.ppo_epochs == 1  # what the N-rank trainer takes today
    # the prompt format and the reward agree (the answer on an "Answer:" line, read by math_verify); benchmarks named
    assert (cfg.prompt_format, check_values(cfg).reward) == ("dapo", "math_verify") and cfg.eval_dataset
    check_bounds(cfg, RunRules(Path("/"), []))  # runs on a trainer's default caps


def test_the_qwen3_8b_recipe_is_the_paper_recipe_on_8b_with_its_benchmarks() -> None:
    cfg = _load(REPO_ROOT / "recipes" / "paper_qwen3_8b.toml")
    paper = _load(REPO_ROOT / "recipes" / "dapo_paper.toml")
    assert "Qwen3-8B-Base" in cfg.model
    same = {k for k in RunConfig.model_fields if k not in ("model", "eval_dataset", "eval_prompts", "log_to")}
    assert {k: getattr(cfg, k) for k in same} == {k: getattr(paper, k) for k in same}
    assert cfg.prompt_format == "dapo" and check_values(cfg).reward == "math_verify"
    names = [Path(p).stem for p in cfg.eval_dataset]  # the paper's Table 2
    assert names == ["aime-2024", "aime-2025", "amc-2023", "math500", "minerva", "olympiadbench"]
    # the caps its comment names: refused on a trainer's defaults, accepted with them
    with pytest.raises(ValueError, match="max_step_tokens"):
        check_bounds(cfg, RunRules(Path("/"), []))
    check_bounds(cfg, RunRules(Path("/"), [], max_step_tokens=1_677_721_600, max_eval_tokens=62_914_560))
    with pytest.raises(ValueError, match="max_eval_tokens"):
        check_bounds(cfg, RunRules(Path("/"), [], max_step_tokens=1_677_721_600, max_eval_tokens=62_914_559))
