"""Threads chosen for the mode (forkrl/runtime.py `train_threads`, trainer_service --threads): auto gives a sync run
every usable core, an async run half, shared among the ranks of the machine; a number is kept; the trainer's
setting reaches torch when a run loads its policy."""

from __future__ import annotations

import pytest
import torch

from forkrl import runtime
from forkrl.runtime import train_threads


@pytest.mark.parametrize(("cores", "local_world", "sync", "async_"),
                         [(2, None, 2, 1), (16, None, 16, 8), (1, None, 1, 1), (16, "4", 4, 2), (3, "4", 1, 1),
                          (7, "", 7, 3)])
def test_auto_takes_the_usable_cores_per_local_rank_and_halves_them_for_async(
        monkeypatch: pytest.MonkeyPatch, cores: int, local_world: str | None, sync: int, async_: int) -> None:
    monkeypatch.setattr(runtime.os, "sched_getaffinity", lambda pid: set(range(100, 100 + cores)), raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    if local_world is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local_world)
    assert train_threads("auto", async_run=False) == sync
    assert train_threads("auto", async_run=True) == async_
    assert train_threads(3, async_run=True) == train_threads(3, async_run=False) == 3  # a number is kept


def test_auto_takes_omp_num_threads_as_its_budget_when_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runtime.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # a machine shared with other work (the tests set it)
    assert train_threads("auto", async_run=False) == train_threads("auto", async_run=True) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "6")
    assert (train_threads("auto", async_run=False), train_threads("auto", async_run=True)) == (6, 3)
    monkeypatch.setenv("OMP_NUM_THREADS", "0")  # not a budget: the usable cores
    assert train_threads("auto", async_run=False) == 16


def test_trainer_threads_default_to_auto_and_take_a_number() -> None:
    from forkrl.cli import parse_settings
    from trainer_service.config import TrainerSettings

    assert parse_settings(TrainerSettings, []).threads == "auto"
    assert parse_settings(TrainerSettings, ["--threads", "2"]).threads == 2
    with pytest.raises(SystemExit):
        parse_settings(TrainerSettings, ["--threads", "0"])


@pytest.mark.slow
def test_load_policy_sets_the_run_s_threads(tiny_model_dir, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from forkrl.training.config import RunConfig
    from forkrl.training.policy import load_policy

    monkeypatch.setattr(runtime.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    # torch's own function: an in-process vLLM CPU worker run by an earlier test in this pytest process replaces
    # torch.set_num_threads with a no-op process-wide (a trainer process never runs vLLM, so only tests meet it)
    monkeypatch.setattr(torch, "set_num_threads", torch._C.set_num_threads)
    before = torch.get_num_threads()
    try:
        for staleness, threads, want in ((0, "auto", 4), (1, "auto", 2), (1, 3, 3)):
            cfg = RunConfig(model=str(tiny_model_dir), run_dir=str(tmp_path / str(staleness)),
                            max_staleness=staleness)
            load_policy(cfg, tmp_path / str(staleness), "cpu", threads)
            assert torch.get_num_threads() == want
    finally:
        torch.set_num_threads(before)


def test_the_openmp_wait_policy_engines_passive_trainer_libgomps_default_the_users_value_wins() -> None:
    """The engines (apply_runtime_env) wait passively, the trainer sets no policy (libgomp's default), and a value
    the user exports reaches both unchanged, in the trainer before torch loads (libgomp reads it then)."""
    import os
    import subprocess
    import sys

    # a stand-in server module: what the environment holds, and whether torch was loaded, when serve() starts
    trainer = ("import os, sys, types\n"
               "stub = types.ModuleType('trainer_service.server')\n"
               "stub.serve = lambda s: print(os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules) or 0\n"
               "sys.modules['trainer_service.server'] = stub\n"
               "from trainer_service.__main__ import main\n"
               "main([])")
    engine = ("import os, sys; from forkrl.runtime import apply_runtime_env; apply_runtime_env(); "
              "print(os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    for given, want_trainer, want_engine in ((None, "None", "PASSIVE"), ("PASSIVE", "PASSIVE", "PASSIVE"),
                                             ("ACTIVE", "ACTIVE", "ACTIVE")):
        e = env if given is None else {**env, "OMP_WAIT_POLICY": given}
        for code, want in ((trainer, want_trainer), (engine, want_engine)):
            out = subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, check=True)
            assert out.stdout.split() == [want, "False"]
