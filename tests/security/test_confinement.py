"""Confinement on real servers: what issue 16 measured on the Docker stack — `clients/start_run.py --reward
builtins:print --run-dir /tmp/anywhere-i-like` accepted — is refused, naming the setting; the rollout's
LoadWeights reads only inside its allowed roots.

trainer: the `python -m trainer_service` process with its own settings (StartRun is refused in preflight,
before a rollout service is needed); rollout: the real grpc.aio server with the fake engine of
tests/rollout/test_server_plumbing.py (only vLLM is replaced)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from safetensors.torch import save_file

from forkrl.remote.rollout import RolloutClient
from tests.rollout.test_server_plumbing import MODEL, ServerThread
from tests.service_fixtures import REPO_ROOT, start_trainer_service

START_RUN = str(REPO_ROOT / "clients" / "start_run.py")


def _start_run(address: str, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, START_RUN, "--trainer-address", address, "--detach", *flags],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)


@pytest.mark.slow
def test_start_run_is_confined_to_the_trainer_s_settings(tmp_path: Path, tiny_model_dir: Path) -> None:
    runs = tmp_path / "runs"
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "data.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    with start_trainer_service(runs, log_path=tmp_path / "trainer.log", allowed_roots=str(tmp_path / "models"),
                               rollout_addresses="127.0.0.1:50051") as address:
        rollout = ["--model", str(tiny_model_dir), "--rollout-addresses", "127.0.0.1:50051"]
        cases = [
            (["--reward", "builtins:print"], "reward 'builtins:print'", "--allow-custom-rewards"),
            (["--run-dir", "/tmp/anywhere-i-like"], "run_dir '/tmp/anywhere-i-like' is outside",
             "runs_root (--runs-root, TRAINER_RUNS_ROOT)"),
            (["--run-dir", f"{runs}/../escape"], "must not contain '..'", "run_dir"),
            (["--dataset", str(tmp_path / "elsewhere" / "data.jsonl")], "dataset", "--allowed-roots"),
        ]
        for flags, what, setting in cases:
            done = _start_run(address, *rollout, *flags)
            assert done.returncode != 0, (flags, done.stdout)
            assert "StartRun refused" in done.stderr and what in done.stderr and setting in done.stderr, \
                (flags, done.stderr[-2000:])
            code = "INVALID_ARGUMENT" if ".." in what else "PERMISSION_DENIED"
            assert code in done.stderr, (flags, done.stderr[-2000:])
        done = _start_run(address, "--model", str(tiny_model_dir), "--rollout-addresses", "203.0.113.9:50051")
        assert done.returncode != 0 and "PERMISSION_DENIED" in done.stderr
        assert "'203.0.113.9:50051' is not one of the trainer's rollout_addresses" in done.stderr
    assert not Path("/tmp/anywhere-i-like").exists() and not (tmp_path / "escape").exists()
    assert not runs.exists() or not any(runs.iterdir())  # no run was started


@pytest.fixture
def rollout(tmp_path: Path) -> Iterator[tuple[ServerThread, Path]]:
    model, allowed = tmp_path / "model", tmp_path / "allowed"
    model.mkdir()
    allowed.mkdir()
    save_file(MODEL, str(model / "model.safetensors"))
    server = ServerThread(model, tmp_path / "staging")
    server.settings.allowed_roots = [str(allowed)]  # read by every LoadWeights
    yield server, allowed
    server.stop()


def test_load_weights_reads_only_inside_the_allowed_roots(rollout, tmp_path: Path) -> None:
    server, allowed = rollout
    outside = tmp_path / "outside"
    outside.mkdir()
    save_file(MODEL, str(outside / "model.safetensors"))
    (allowed / "link").symlink_to(outside, target_is_directory=True)
    save_file(MODEL, str(allowed / "model.safetensors"))
    with RolloutClient(server.address, timeout_s=20) as client:
        client.wait_ready(10)
        v = client.info().version
        for path, code, text in [
            (outside, grpc.StatusCode.PERMISSION_DENIED, "is outside the rollout service's allowed_roots"),
            (allowed / "link", grpc.StatusCode.PERMISSION_DENIED, "links outside"),
            (Path("/etc"), grpc.StatusCode.PERMISSION_DENIED, "ROLLOUT_ALLOWED_ROOTS"),
            (f"{allowed}/../outside", grpc.StatusCode.INVALID_ARGUMENT, "must not contain '..'"),
        ]:
            with pytest.raises(grpc.RpcError) as e:
                client.load_weights(str(path), v + 1)
            assert e.value.code() == code and text in e.value.details(), (path, e.value.details())
        assert client.info().version == v and len(server.backend.reloaded) == 0
        assert client.load_weights(str(allowed), v + 1) == v + 1  # inside: loaded
        assert client.load_weights(str(tmp_path / "model"), v + 2) == v + 2  # the served model's own dir
