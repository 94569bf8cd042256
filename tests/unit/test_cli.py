"""The one config mechanism (forkrl/cli.py) behind all four entry points: flags over environment variables over
defaults, errors that name the flag and exit 2, --help that lists every field with its docstring, and no torch
import before the flags are parsed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pydantic_settings import BaseSettings

from forkrl.cli import parse_settings
from forkrl.training.config import RunConfig
from probe_service.config import ProbeSettings
from rollout_service.config import RolloutSettings
from trainer_service.config import TrainerSettings

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "clients"))
import start_run  # noqa: E402

SERVICES = [(RolloutSettings, "ROLLOUT_"), (TrainerSettings, "TRAINER_"), (ProbeSettings, "PROBE_")]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for var in list(os.environ):
        if var.startswith(("ROLLOUT_", "TRAINER_", "PROBE_")) or var in start_run.ENV_DEFAULTS.values():
            monkeypatch.delenv(var)


def _help(cls: type[BaseSettings], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        parse_settings(cls, ["--help"])
    assert exc.value.code == 0
    # argparse wraps long lines at spaces and after hyphens ("forkrl-rollout" may print as "forkrl-\nrollout")
    return " ".join(capsys.readouterr().out.split()).replace("- ", "-")


@pytest.mark.parametrize("cls", [RolloutSettings, TrainerSettings, ProbeSettings, start_run.StartRunArgs])
def test_help_lists_every_field_with_its_docstring(cls, capsys: pytest.CaptureFixture[str]) -> None:
    text = _help(cls, capsys)
    for name, field in cls.model_fields.items():
        assert f"--{name.replace('_', '-')}" in text, name
        assert " ".join(field.description.split()).replace("- ", "-") in text, name


def test_trainer_settings_flags_override_env_over_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_settings(TrainerSettings, []) == TrainerSettings()
    monkeypatch.setenv("TRAINER_PORT", "6000")
    monkeypatch.setenv("TRAINER_TENSORBOARD", "false")
    s = parse_settings(TrainerSettings, ["--runs-root", "/r"])
    assert (s.port, s.tensorboard, s.runs_root, s.host) == (6000, False, "/r", "127.0.0.1")
    s = parse_settings(TrainerSettings, ["--port", "7000", "--tensorboard", "--grace-s", "2.5"])
    assert (s.port, s.tensorboard, s.grace_s) == (7000, True, 2.5)
    assert parse_settings(TrainerSettings, ["--no-tensorboard"]).tensorboard is False


def test_rollout_settings_from_env_and_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLOUT_MODEL", "/m")
    monkeypatch.setenv("ROLLOUT_DTYPE", "bfloat16")
    s = parse_settings(RolloutSettings, ["--kv-cache-gib", "2", "--no-enforce-eager", "--engine-mode", "mp"])
    assert (s.model, s.dtype, s.kv_cache_gib, s.enforce_eager, s.engine_mode) == ("/m", "bfloat16", 2.0, False, "mp")
    assert parse_settings(RolloutSettings, ["--model", "/other"]).model == "/other"


def test_probe_allowed_roots_take_commas_in_env_and_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_settings(ProbeSettings, []).allowed_roots == ["runs", "models"]
    monkeypatch.setenv("PROBE_ALLOWED_ROOTS", "runs, /models ,")
    assert parse_settings(ProbeSettings, []).allowed_roots == ["runs", "/models"]
    assert parse_settings(ProbeSettings, ["--allowed-roots", "a,b"]).allowed_roots == ["a", "b"]
    assert parse_settings(ProbeSettings, ["--allowed-roots", "a", "--allowed-roots", "b"]).allowed_roots == ["a", "b"]
    monkeypatch.setenv("PROBE_MAX_CONCURRENT_JOBS", "3")
    assert parse_settings(ProbeSettings, ["--threads", "2"]).max_concurrent_jobs == 3


@pytest.mark.parametrize(("cls", "prefix"), SERVICES)
def test_bad_values_exit_2_naming_the_flag_and_the_variable(cls, prefix, capsys, monkeypatch) -> None:
    monkeypatch.setenv("ROLLOUT_MODEL", "/m")
    with pytest.raises(SystemExit) as exc:
        parse_settings(cls, ["--port", "70000"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"error: --port ({prefix}PORT): Input should be less than or equal to 65535, got '70000'" in err


def test_a_missing_required_setting_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_settings(RolloutSettings, [])
    assert exc.value.code == 2
    assert "--model (ROLLOUT_MODEL): required" in capsys.readouterr().err


# ---- clients/start_run.py: flags generated from RunConfig, plus the client's own ----


def test_start_run_has_one_flag_per_run_config_field_plus_the_client_flags() -> None:
    client = set(start_run.StartRunArgs.model_fields) - set(RunConfig.model_fields)
    assert client == {"trainer_address", "detach", "watch", "connect_timeout_s", "config"}
    for name, field in RunConfig.model_fields.items():
        assert start_run.StartRunArgs.model_fields[name].description == field.description


def test_start_run_defaults_flags_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    args = start_run.parse_args([])
    assert args.run_config() == RunConfig() and args.trainer_address == "127.0.0.1:50052"
    assert (args.detach, args.watch, args.connect_timeout_s) == (False, "", 60.0)
    monkeypatch.setenv("ENTROPY_TOP_FRAC", "0.2")
    monkeypatch.setenv("RL_DATASET_PATH", "/data/x.jsonl")
    monkeypatch.setenv("TRAINER_ADDRESS", "10.0.0.1:5")
    args = start_run.parse_args(["--num-steps", "3", "--loss", "dapo", "--dynamic-sampling", "--detach"])
    cfg = args.run_config()
    assert (cfg.entropy_top_frac, cfg.dataset, args.trainer_address) == (0.2, "/data/x.jsonl", "10.0.0.1:5")
    assert (cfg.num_steps, cfg.loss, cfg.dynamic_sampling, args.detach) == (3, "dapo", True, True)
    assert start_run.parse_args(["--entropy-top-frac", "0.5"]).entropy_top_frac == 0.5  # a flag beats the env
    monkeypatch.setenv("ENTROPY_TOP_FRAC", "")
    assert start_run.parse_args([]).entropy_top_frac is None  # empty = unset


@pytest.mark.parametrize(("flags", "want"), [
    (["--rollout-addresses", "127.0.0.1:50051"], ["127.0.0.1:50051"]),
    (["--rollout-addresses", "a:1,b:2"], ["a:1", "b:2"]),
    (["--rollout-addresses", "a:1", "--rollout-addresses", "b:2"], ["a:1", "b:2"]),
])
def test_start_run_rollout_addresses(flags: list[str], want: list[str]) -> None:
    assert start_run.parse_args(flags).rollout_addresses == want


def test_start_run_config_file_under_the_flags_over_the_env(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("ENTROPY_TOP_FRAC", "0.2")
    monkeypatch.setenv("TRAINER_ADDRESS", "env:1")
    path = tmp_path / "run.toml"
    path.write_text('entropy_top_frac = 0.3\nnum_steps = 7\nloss = "dapo"\nrollout_addresses = ["a:1", "b:2"]\n'
                    'trainer_address = "file:2"\n')
    args = start_run.parse_args(["--config", str(path), "--num-steps", "9"])
    cfg = args.run_config()
    assert (cfg.entropy_top_frac, cfg.num_steps, cfg.loss, cfg.rollout_addresses) == (0.3, 9, "dapo", ["a:1", "b:2"])
    assert args.trainer_address == "file:2"
    assert start_run.parse_args([f"--config={path}"]).num_steps == 7


@pytest.mark.parametrize(("flags", "needle"), [
    (["--entropy-top-frac", "1.5"], "error: --entropy-top-frac: entropy_top_frac must be in (0, 1], got 1.5"),
    (["--loss", "ppo"], "error: --loss: Input should be 'grpo', 'dr_grpo', 'dapo', 'reinforce', 'rloo', 'gspo' or "
                        "'cispo', got 'ppo'"),
    (["--num-steps", "0"], "error: --num-steps: Input should be greater than or equal to 1, got '0'"),
    (["--loss", "rloo", "--group-size", "1"], "error: loss rloo needs group_size >= 2"),
    (["--resume"], "error: resume needs run_dir (the run to continue)"),
    (["--num-steps", "1000000000000"], "error: --num-steps: Input should be less than or equal to 10000000, got "
                                       "'1000000000000'"),
    (["--max-staleness", "2147483647"], "error: --max-staleness: Input should be less than or equal to 64"),
    (["--lr", "nan"], "error: --lr: Input should be a finite number, got 'nan'"),
    (["--task", "t" * 100_000], "error: --task: String should have at most 256 characters, got 'ttt"),
    (["--bogus"], "unrecognized arguments: --bogus"),
])
def test_start_run_bad_flags_exit_2_with_the_field_and_value(flags, needle, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        start_run.parse_args(flags)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert needle in err
    assert "t" * 1000 not in err  # a long value is cut, never echoed whole


def test_start_run_bad_config_file_exits_2(tmp_path: Path, capsys) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("bogus = 1\n")
    with pytest.raises(SystemExit) as exc:
        start_run.parse_args(["--config", str(path)])
    assert exc.value.code == 2 and "unknown setting 'bogus'" in capsys.readouterr().err
    path.write_text("num_steps = 1000000000000\n")  # out of int32: refused with the limit, never sent
    with pytest.raises(SystemExit) as exc:
        start_run.parse_args(["--config", str(path)])
    assert exc.value.code == 2
    assert "--num-steps: Input should be less than or equal to 10000000" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        start_run.parse_args(["--config", str(tmp_path / "nope.toml")])
    assert exc.value.code == 2 and "nope.toml" in capsys.readouterr().err


def test_help_of_every_entry_point_imports_no_torch() -> None:
    """--help must stay instant: parse before torch/vLLM/transformers are imported (checked in a fresh process)."""
    code = """
import runpy, sys
sys.path.insert(0, "clients")
for target, is_path in (("rollout_service", False), ("trainer_service", False), ("probe_service", False),
                        ("clients/start_run.py", True)):
    sys.argv = [target, "--help"]
    try:
        (runpy.run_path if is_path else runpy.run_module)(target, run_name="__main__")
    except SystemExit as exc:
        assert exc.code == 0, (target, exc.code)
heavy = sorted(m for m in ("torch", "vllm", "transformers") if m in sys.modules)
print("HEAVY", heavy)
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "HEAVY []" in proc.stdout
