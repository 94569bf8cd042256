"""scripts/gpu_check.sh without a GPU: what can be checked here. It parses (`bash -n`), its --help says what it
runs and that it has not run on a GPU, it stops at once with exit status 2 without CUDA, every flag it passes to
clients/start_run.py and the two services exists in their --help, and the run it starts (recipes/dapo_paper.toml
plus its overrides, at its GPU and its dry-run sizes) loads through start_run's --config path and passes the
checks a trainer makes before a run starts. Its --dry-run (both services, 2 trainer ranks, gloo) runs end to end
in the slow test at the bottom."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "scripts" / "gpu_check.sh"
TEXT = SCRIPT.read_text()
sys.path.insert(0, str(REPO_ROOT / "clients"))
import start_run  # noqa: E402

from forkrl.training.preflight import check_values, preflight  # noqa: E402
from forkrl.training.rules import RunRules, check_bounds  # noqa: E402


def run(*args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PY": sys.executable, **env})


def command(start: str) -> list[str]:
    """The words of the script's command line that begins with `start` (backslash continuations joined)."""
    at = TEXT.index(start)
    lines = []
    for line in TEXT[at:].splitlines():
        lines.append(line.rstrip("\\").strip())
        if not line.endswith("\\"):
            break
    return shlex.split(re.split(r"\s\d*>|\s\|", " ".join(lines))[0])  # up to a redirection or a pipe


def flags(words: list[str]) -> set[str]:
    return {w for w in words if w.startswith("--")}


def branch_settings(device: str) -> dict[str, str]:
    """The variables the script's cuda or cpu branch sets, their defaults taken (NAME=${ENV:-default})."""
    start = TEXT.index('if [ "$DEVICE" = cuda ]' if device == "cuda" else 'elif [ "$DEVICE" = cpu ]')
    body = TEXT[start:TEXT.index('elif [ "$DEVICE" = cpu ]' if device == "cuda" else "else\n  echo", start + 1)]
    values: dict[str, str] = {}
    for word in re.split(r"[;\s]+", body):
        m = re.fullmatch(r"([A-Z_]+)=(?:\$\{\w+:-([^}]*)\}|([\w.,-]*))", word)
        if m:
            values.setdefault(m[1], m[2] if m[2] is not None else m[3])  # the first (the >1 GPU layout's)
    return values


def test_it_parses_and_its_help_says_what_it_runs() -> None:
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    out = run("--help")
    assert out.returncode == 0
    for words in ("NOT RUN ON A GPU", "--dry-run", "recipes/dapo_paper.toml", "Qwen2.5-1.5B", "--weight-sync transfer",
                  "Duplicate GPU detected", "dynamic sampling off"):
        assert words in out.stdout.replace("\n", " "), words


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine would run the whole check")
def test_without_cuda_it_fails_fast_and_says_so():
    out = run(FORKRL_GPU_CHECK_DEVICE="cuda")
    assert out.returncode == 2
    assert "no CUDA device" in out.stderr and "--dry-run" in out.stderr


def test_bad_arguments_are_refused():
    assert run("--bogus").returncode == 2
    assert run(FORKRL_GPU_CHECK_DEVICE="tpu").returncode == 2


@pytest.mark.slow  # three --help runs in subprocesses
@pytest.mark.parametrize("start, cli", [
    ('"$PY" clients/start_run.py', [sys.executable, "clients/start_run.py", "--help"]),
    ('"$PY" -m rollout_service', [sys.executable, "-m", "rollout_service", "--help"]),
    ('"${LAUNCH[@]}" -m trainer_service', [sys.executable, "-m", "trainer_service", "--help"]),
], ids=["start_run", "rollout_service", "trainer_service"])
def test_every_flag_it_passes_exists(start: str, cli: list[str]) -> None:
    passed = flags(command(start))
    assert len(passed) >= 5
    helptext = subprocess.run(cli, capture_output=True, text=True, cwd=REPO_ROOT, timeout=120,
                              env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}).stdout
    offered = set(re.findall(r"--[a-z][a-z0-9-]*", helptext))
    assert passed <= offered, passed - offered


@pytest.fixture
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in start_run.ENV_DEFAULTS.values():
        monkeypatch.delenv(var, raising=False)


def load_run(device: str, work: Path):
    """The RunConfig the script's start_run.py line asks for on `device`, through start_run's --config path."""
    values = branch_settings(device) | {"WORK": str(work), "TPORT": "52151", "RPORT": "52150"}
    values["OVERLONG"] = str(int(values["MAXNEW"]) // 4)
    words = command('"$PY" clients/start_run.py')[2:]
    argv = [re.sub(r"\$\{?(\w+)\}?", lambda m: values[m[1]], w) for w in words]
    return values, start_run.parse_args(argv).run_config()


@pytest.mark.usefixtures("_clean_env")
@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_the_run_it_starts_is_the_recipe_scaled_down_and_valid(device: str, tmp_path: Path) -> None:
    values, cfg = load_run(device, tmp_path)
    assert values["SIZE"] == {"cuda": "1.5b", "cpu": "tiny-1.5b"}[device]
    assert values["SYNC"] == "transfer"  # the >1 GPU layout and the dry run: vLLM's weight-transfer API
    # the recipe's algorithm, kept
    assert (cfg.loss, cfg.entropy_top_frac, cfg.mask_norm) == ("dapo", 0.2, "kept")
    # packed sequences in token-budget micro-batches, whose top-k is the step's (docs/algorithms-departures.md §6)
    assert cfg.pack_sequences and cfg.max_tokens_per_micro_batch > 0 and cfg.mask_scope == "step"
    assert (cfg.clip_low, cfg.clip_high, cfg.kl_beta, cfg.lr, cfg.weight_decay) == (0.2, 0.28, 0.0, 1e-6, 0.1)
    assert cfg.activation_checkpointing and cfg.reward == "math_verify" and cfg.tis_cap == 2.0
    # scaled down: several updates per rollout batch, whole groups each
    assert cfg.prompts_per_step % cfg.mini_batch_prompts == 0 and cfg.prompts_per_step // cfg.mini_batch_prompts >= 2
    assert 0 < cfg.overlong_cache_len <= cfg.max_new_tokens
    assert not cfg.dynamic_sampling  # a random-init policy fails every sample: the filter would keep no group
    assert cfg.weight_sync == "transfer" and cfg.model == str(tmp_path / "model")
    assert cfg.num_steps == {"cuda": 10, "cpu": 3}[device]
    if device == "cuda":
        assert (cfg.prompts_per_step, cfg.group_size, cfg.max_new_tokens) == (32, 8, 256)
    check_bounds(check_values(cfg), RunRules(Path("/"), []))  # a trainer's default caps, as the script starts it


@pytest.mark.slow  # builds the model and reads its tokenizer
@pytest.mark.isolated  # its own model in tmp_path: no order can change it (CI's shuffled pass leaves it out)
@pytest.mark.usefixtures("_clean_env")
def test_the_dry_runs_run_passes_the_trainers_preflight(tmp_path: Path) -> None:
    """The whole preflight of StartRun, on the model and a dataset of the kind the dry run builds."""
    from forkrl.models.random_qwen2 import build_random_qwen2

    values, cfg = load_run("cpu", tmp_path)
    build_random_qwen2(tmp_path / "model", values["SIZE"])
    (tmp_path / "data.jsonl").write_text(json.dumps({"prompt": "What is 1 + 2?", "answer": "3"}) + "\n")
    preflight(check_values(cfg))


@pytest.mark.slow  # both services, 2 trainer ranks under torchrun, 3 steps: minutes on a 2-core machine
@pytest.mark.isolated  # starts everything it uses: once is enough (CI's shuffled pass leaves it out)
@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is the CPU path")
def test_the_dry_run_passes_every_step_through_the_transfer_route(tmp_path: Path) -> None:
    port = str(20000 + os.getpid() % 20000)
    out = run("--dry-run", timeout=1200, FORKRL_GPU_CHECK_DIR=str(tmp_path), FORKRL_GPU_CHECK_PORT=port)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert "gpu_check: PASS" in out.stdout
    rows = [json.loads(x) for x in (tmp_path / "runs/check/metrics.jsonl").read_text().splitlines()]
    trained = {r["step"]: r for r in rows if r.get("kind") == "train" and "time_train_s" in r}
    assert sorted(trained) == [1, 2, 3]
    assert all(r["n_updates"] == 2 for r in trained.values())  # 4 prompts in mini-batches of 2
    assert all(r["push_shm_services"] == 0 for r in trained.values())
    assert re.search(r"push route .*transfer", out.stdout)
    assert "gloo weight-transfer group" in out.stdout
