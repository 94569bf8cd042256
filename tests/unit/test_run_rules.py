"""What StartRun may ask of a trainer (forkrl/training/rules.py): paths inside its roots, its own rollout
services, built-in rewards unless --allow-custom-rewards. Messages name the setting that decides."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from forkrl.cli import parse_settings
from forkrl.data.rewards import BUILTIN_REWARDS
from forkrl.security import OutsideRoots
from forkrl.training.config import RunConfig
from forkrl.training.rules import BUILTIN_REWARD_NAMES, NotAllowed, RunRules, address_allowed, confine_run
from trainer_service.config import TrainerSettings


@pytest.fixture
def world(tmp_path: Path) -> dict[str, Path]:
    runs, models, outside = tmp_path / "runs", tmp_path / "models", tmp_path / "outside"
    for d in (runs, models / "m", outside / "m"):
        d.mkdir(parents=True)
    (models / "escape").symlink_to(outside / "m", target_is_directory=True)
    (runs / "out").symlink_to(outside, target_is_directory=True)
    return {"runs": runs, "models": models, "outside": outside}


def _rules(w: dict[str, Path], **kw) -> RunRules:
    return RunRules(runs_root=w["runs"].resolve(), read_roots=[w["models"].resolve(), w["runs"].resolve()],
                    rollout_addresses=("127.0.0.1:50051", "10.0.0.7:*"), **kw)


def test_the_builtin_reward_names_are_the_rewards_module_s() -> None:
    assert BUILTIN_REWARD_NAMES == tuple(BUILTIN_REWARDS)


def test_custom_rewards_need_the_trainer_flag(world) -> None:
    cfg = RunConfig(reward="builtins:print")
    with pytest.raises(NotAllowed, match="--allow-custom-rewards"):
        confine_run(cfg, _rules(world))
    assert confine_run(cfg, _rules(world, allow_custom_rewards=True)) == {}
    assert confine_run(RunConfig(reward="math_verify"), _rules(world)) == {}


def test_run_dir_must_be_a_new_dir_or_a_forkrl_run_inside_runs_root(world) -> None:
    rules = _rules(world)
    with pytest.raises(OutsideRoots, match=r"run_dir '/tmp/anywhere-i-like' is outside the trainer's runs_root"):
        confine_run(RunConfig(run_dir="/tmp/anywhere-i-like"), rules)
    with pytest.raises(OutsideRoots, match=r"--runs-root, TRAINER_RUNS_ROOT"):
        confine_run(RunConfig(run_dir=str(world["models"] / "r")), rules)
    with pytest.raises(ValueError, match=r"must not contain '\.\.'"):
        confine_run(RunConfig(run_dir=str(world["runs"] / ".." / "runs" / "r")), rules)
    with pytest.raises(OutsideRoots, match="links outside .* runs_root .*to '.*outside/new'"):
        confine_run(RunConfig(run_dir=str(world["runs"] / "out" / "new")), rules)  # a symlinked folder leads out
    with pytest.raises(OutsideRoots, match="runs_root .* itself"):
        confine_run(RunConfig(run_dir=str(world["runs"])), rules)
    foreign = world["runs"] / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="something other than a forkrl run"):
        confine_run(RunConfig(run_dir=str(foreign)), rules)
    run = world["runs"] / "r1"
    assert confine_run(RunConfig(run_dir=str(run)), rules) == {"run_dir": str(run.resolve())}  # new
    run.mkdir()
    (run / "config.json").write_text(json.dumps(RunConfig().model_dump()))
    assert confine_run(RunConfig(run_dir=str(run)), rules) == {"run_dir": str(run.resolve())}  # a forkrl run
    (foreign / "checkpoints").mkdir()  # checkpoints of a run (preflight then asks for resume)
    assert confine_run(RunConfig(run_dir=str(foreign)), rules) == {"run_dir": str(foreign.resolve())}


def test_model_and_dataset_must_resolve_inside_the_read_roots(world) -> None:
    rules = _rules(world)
    assert confine_run(RunConfig(model=str(world["models"] / "m")), rules) == {
        "model": str((world["models"] / "m").resolve())}
    with pytest.raises(OutsideRoots, match="model .* is outside the trainer's allowed_roots .*--allowed-roots"):
        confine_run(RunConfig(model=str(world["outside"] / "m")), rules)
    with pytest.raises(OutsideRoots, match="model .* links outside the trainer's allowed_roots"):
        confine_run(RunConfig(model=str(world["models"] / "escape")), rules)
    with pytest.raises(OutsideRoots, match="dataset '/etc/passwd' is outside the trainer's allowed_roots"):
        confine_run(RunConfig(dataset="/etc/passwd"), rules)


def test_rollout_addresses_come_from_the_trainer_s_allow_list(world) -> None:
    rules = _rules(world)
    assert confine_run(RunConfig(rollout_addresses=["127.0.0.1:50051", "10.0.0.7:1234"]), rules) == {}
    with pytest.raises(NotAllowed, match=r"'evil.example:50051' is not one of .*--rollout-addresses"):
        confine_run(RunConfig(rollout_addresses=["127.0.0.1:50051", "evil.example:50051"]), rules)
    assert address_allowed("127.0.0.1:7", ("127.0.0.1:*",)) and not address_allowed("127.0.0.2:7", ("127.0.0.1:*",))
    assert not address_allowed("127.0.0.1:50052", ("127.0.0.1:50051",))


def test_trainer_settings_build_the_rules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINER_ALLOWED_ROOTS", f"{tmp_path}/a, {tmp_path}/b")
    monkeypatch.setenv("FORKRL_MODEL_DIR", str(tmp_path / "tiny"))
    s = parse_settings(TrainerSettings, ["--runs-root", str(tmp_path / "runs"), "--rollout-addresses", "h:1,h:2",
                                         "--allow-custom-rewards"])
    rules = s.rules()
    assert rules.runs_root == (tmp_path / "runs").resolve() and rules.allow_custom_rewards
    assert rules.read_roots == [(tmp_path / p).resolve() for p in ("a", "b", "runs", "tiny")]
    assert rules.rollout_addresses == ("h:1", "h:2")
    defaults = parse_settings(TrainerSettings, []).rules()
    assert defaults.rollout_addresses == ("127.0.0.1:50051",) and not defaults.allow_custom_rewards


def test_eval_dataset_files_are_confined_like_the_dataset(world) -> None:
    rules = _rules(world)
    inside = world["models"] / "aime24.jsonl"
    got = confine_run(RunConfig(eval_dataset=[str(inside), str(world["models"] / "m")]), rules)
    assert got == {"eval_dataset": [str(inside.resolve()), str((world["models"] / "m").resolve())]}
    with pytest.raises(OutsideRoots, match=r"eval_dataset '.*outside/m' is outside the trainer's allowed_roots"):
        confine_run(RunConfig(eval_dataset=[str(inside), str(world["outside"] / "m")]), rules)
    with pytest.raises(OutsideRoots, match="eval_dataset .* links outside"):
        confine_run(RunConfig(eval_dataset=[str(world["models"] / "escape")]), rules)


def test_a_dataset_template_is_confined_file_by_file(world) -> None:
    """issue 42 item 2: the root check ran on the template as written, the run opened template.format(split=...):
    `{split:.<2.0}` formats to `..` and a prompt from outside every root was trained on."""
    rules, models, outside = _rules(world), world["models"], world["outside"]
    (outside / "secret.jsonl").write_text('{"prompt": "outside", "answer": "1"}\n')
    (models / "train").mkdir()
    climb = str(models / "{split}" / "{split:.<2.0}" / "{split:.<2.0}" / "outside" / "secret.jsonl")
    assert not (models / "train/../../outside/secret.jsonl").resolve().is_relative_to(models.resolve())
    with pytest.raises(ValueError, match=r"^dataset: '\{split:\.<2\.0\}' is not a field .* only '\{split\}'"):
        confine_run(RunConfig(dataset=climb), rules)
    with pytest.raises(ValueError, match=r"^dataset: '\{split:>100000000\}' is not a field"):  # no 100 MB string
        confine_run(RunConfig(dataset=str(models / "{split:>100000000}.jsonl")), rules)
    # each file a template names is checked, not the template: train.jsonl is a symlink out
    (models / "d").mkdir()
    (models / "d" / "eval.jsonl").write_text('{"prompt": "p", "answer": "1"}\n')
    (models / "d" / "train.jsonl").symlink_to(outside / "secret.jsonl")
    with pytest.raises(OutsideRoots, match=r"dataset '.*/d/train\.jsonl' links outside the trainer's allowed_roots"):
        confine_run(RunConfig(dataset=str(models / "d" / "{split}.jsonl")), rules)
    (models / "d" / "train.jsonl").unlink()
    (models / "d" / "train.jsonl").write_text('{"prompt": "p", "answer": "1"}\n')
    assert confine_run(RunConfig(dataset=str(models / "d" / "{split}.jsonl")), rules) == {
        "dataset": str((models / "d").resolve() / "{split}.jsonl")}
