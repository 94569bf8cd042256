"""The run bookkeeping of the trainer service (trainer_service/runs.py) without a trainer process: a resume keeps
the id of the run it continues and replaces that finished run in the table; run ids are bounded; a run that fails
on a gRPC error reports a sentence ("<who> answered <CODE>: <details>"), never the call object's repr. The gRPC
error is a real one: a Generate at temperature 3 refused by the rollout server (fake engine) over a real channel."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from safetensors.torch import save_file

from forkrl.remote.rollout import RolloutClient
from forkrl.training.config import RunConfig
from tests.rollout.test_server_plumbing import MODEL, ServerThread
from trainer_service.runs import (
    FAILED,
    MAX_RUN_ID_CHARS,
    STOPPED,
    SUCCEEDED,
    Run,
    RunManager,
    UnknownRun,
    describe_failure,
)


def _finish(manager: RunManager, config: RunConfig) -> Run:
    run = manager.start(config)
    assert run.thread is not None
    run.thread.join(60)
    assert not run.thread.is_alive()
    return run


def test_a_resume_keeps_the_run_id_and_replaces_the_finished_run(tmp_path: Path) -> None:
    def loop(run: Run) -> None:  # what forkrl/training/loop.py does with the id: run_dir/run_id
        run.run_dir.mkdir(parents=True, exist_ok=True)
        (run.run_dir / "run_id").write_text(run.run_id + "\n")
        run.emit({"type": "metrics", "step": run.step + 1, "values": {}})

    manager = RunManager(tmp_path, loop)
    first = _finish(manager, RunConfig(run_dir=str(tmp_path / "r")))
    assert first.state == SUCCEEDED and (tmp_path / "r" / "run_id").read_text().strip() == first.run_id
    resumed = _finish(manager, RunConfig(run_dir=str(tmp_path / "r"), resume=True))
    assert resumed.run_id == first.run_id and resumed is not first
    assert manager.get(first.run_id) is resumed and manager.get() is resumed  # the table holds the latest
    other = _finish(manager, RunConfig(run_dir=str(tmp_path / "r2")))
    assert other.run_id != first.run_id and manager.get(first.run_id) is resumed
    # a fresh run in a used dir, and a resume whose run_id file is not an id a run can have: new ids
    fresh = _finish(manager, RunConfig(run_dir=str(tmp_path / "r")))
    assert fresh.run_id != first.run_id
    (tmp_path / "r3").mkdir()
    (tmp_path / "r3" / "run_id").write_text("x" * (MAX_RUN_ID_CHARS + 1))
    odd = _finish(manager, RunConfig(run_dir=str(tmp_path / "r3"), resume=True))
    assert len(odd.run_id) <= MAX_RUN_ID_CHARS and odd.run_id != "x" * (MAX_RUN_ID_CHARS + 1)


def test_run_ids_are_bounded_and_never_echoed(tmp_path: Path) -> None:
    manager = RunManager(tmp_path, lambda run: None)
    with pytest.raises(ValueError) as err:
        manager.get("y" * 100_000)
    assert str(err.value) == f"run_id has at most {MAX_RUN_ID_CHARS} characters, got 100,000"
    with pytest.raises(ValueError):
        manager.stop("y" * (MAX_RUN_ID_CHARS + 1))
    with pytest.raises(UnknownRun, match="no run 'z'"):
        manager.get("z")


@pytest.fixture
def refused_generate(tmp_path: Path) -> Iterator[tuple[str, grpc.RpcError]]:
    """A rollout server (fake engine) and the real RpcError of a Generate it refuses (temperature 3 > 2)."""
    save_file(MODEL, str(tmp_path / "model.safetensors"))
    server = ServerThread(tmp_path, tmp_path / "staging")
    try:
        with RolloutClient(server.address, timeout_s=60) as client, pytest.raises(grpc.RpcError) as err:
            list(client.generate(["1+1="], n=2, temperature=3.0, max_new_tokens=3, seed=0))
        yield server.address, err.value
    finally:
        server.stop()


def test_a_run_failing_on_a_full_disk_names_its_run_dir_and_what_to_do() -> None:
    """The soak's disk_full fault: TensorBoard's writer thread raised ENOSPC, which names no file; the run's error
    read "OSError: [Errno 28] No space left on device". It names the run dir, and says the resume is the way on."""
    import errno

    try:
        raise RuntimeError("the event writer failed") from OSError(errno.ENOSPC, "No space left on device")
    except RuntimeError as e:
        text = describe_failure(e, ["127.0.0.1:1"], "/data/runs/r1")
    assert text.startswith("the disk of the run dir /data/runs/r1 is full (RuntimeError: the event writer failed)")
    assert "resume the run (resume=True)" in text
    other = describe_failure(OSError(errno.EACCES, "denied"), ["127.0.0.1:1"], "/r")
    assert other == "PermissionError: [Errno 13] denied"


def test_a_run_failing_on_a_grpc_error_reports_a_sentence(refused_generate, tmp_path: Path) -> None:
    address, rpc = refused_generate
    said = (f"the rollout service at {address} answered INVALID_ARGUMENT: sampling.temperature must be <= 2 "
            "(vLLM's limit), got 3")
    assert describe_failure(rpc, [address]) == said
    try:  # the async sampler's wrapper (forkrl/training/pipeline.py) puts the error in its own message
        raise RuntimeError(f"sampling the batch of step 3 failed: {rpc}") from rpc
    except RuntimeError as wrapped:
        assert describe_failure(wrapped, [address]) == f"sampling the batch of step 3 failed: {said}"
    assert describe_failure(rpc, [address, "127.0.0.1:2"]).startswith(
        f"a rollout service (one of {address}, 127.0.0.1:2) answered INVALID_ARGUMENT: ")
    try:  # an error of its own, raised from the gRPC error
        raise KeyError("x") from rpc
    except KeyError as own:
        assert describe_failure(own, [address]) == f"KeyError: 'x' (after: {said})"
    assert describe_failure(ValueError("bad"), [address]) == "ValueError: bad"
    assert describe_failure(ValueError("v" * 5000), [address]).endswith(" [cut]")

    def loop(run: Run) -> None:
        raise rpc

    run = _finish(RunManager(tmp_path, loop), RunConfig(rollout_addresses=[address]))
    assert run.state == FAILED and run.error == said
    assert run.history[-1]["message"] == said  # the FINISHED event says the same


def test_stop_of_a_finished_run_changes_nothing(tmp_path: Path) -> None:
    started = threading.Event()

    def loop(run: Run) -> None:
        started.set()
        run.stop_requested.wait(60)

    manager = RunManager(tmp_path, loop)
    run = manager.start(RunConfig())
    assert started.wait(60)
    assert manager.stop(run.run_id) is run
    assert run.thread is not None
    run.thread.join(60)
    assert run.state == STOPPED and manager.stop(run.run_id).state == STOPPED


@pytest.mark.parametrize("outcome", ["succeeded", "failed"])
def test_a_finished_run_frees_its_model(outcome: str, rollout_address: str, tiny_model_dir: Path, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # a real run (the trainer's loop, a vLLM rollout service): once it is FINISHED nothing may hold its model and
    # optimizer state, also when it failed with the policy in its traceback's frames. The run's objects form
    # reference cycles, so with the automatic collector off only the service's own collection can free them.
    import gc
    import weakref

    import forkrl.training.loop as loop_module

    models: list[weakref.ref] = []
    real_load = loop_module.load_policy

    def load(*args: object, **kwargs: object) -> object:
        policy = real_load(*args, **kwargs)
        models.append(weakref.ref(policy.model))
        return policy

    monkeypatch.setattr(loop_module, "load_policy", load)
    if outcome == "failed":
        def boom(_session: object) -> None:
            raise RuntimeError("a step failed")

        monkeypatch.setattr(loop_module, "_steps", boom)
    cfg = RunConfig(model=str(tiny_model_dir), rollout_addresses=[str(rollout_address)], task="countdown",
                    reward="countdown", num_steps=2, prompts_per_step=4, group_size=2, max_new_tokens=8,
                    eval_every=0, run_dir=str(tmp_path / "run"))
    # pytest's log capture keeps every record, and a record logged with exc_info keeps its traceback and so the
    # run's frames: while the run runs, the records go to a handler that keeps none (as a service's stream does)
    root, kept = logging.getLogger(), logging.getLogger().handlers[:]
    root.handlers = [logging.NullHandler()]
    gc.disable()
    try:
        run = _finish(RunManager(tmp_path, lambda r: loop_module.run_training(r, tensorboard=False)), cfg)
        alive = [m() is not None for m in models]  # read before the collector is back on
    finally:
        gc.enable()
        root.handlers = kept
    assert run.state == (SUCCEEDED if outcome == "succeeded" else FAILED), run.error
    assert alive == [False], "the finished run's model is still alive"
