"""Reusable helpers for tests that need real services (and a model to serve).

    from tests.service_fixtures import start_rollout_service, start_trainer_service, build_random_llama

    with start_rollout_service(model_dir, log_path=tmp_path / "rollout.log", kv_cache_gib=1) as address:
        client = RolloutClient(address)
        ...

Both services are started with `--port 0`: the service binds a free port itself and reports it in its
"listening on HOST:PORT" line, which the helper reads back. Nothing is released between choosing a
port and binding it, so two services (or two test runs) can never race for the same port.

Each service runs as a subprocess in its own process group; on exit the helper sends SIGTERM (graceful
stop) and then SIGKILL to the process group, so no engine process outlives the tests. Logs go to
`log_path` (give one under pytest's tmp_path); without it, to a temporary directory that is removed
after a clean stop and whose log tail is printed otherwise.

`wait_until(predicate, timeout_s, what)` is the one way tests wait: on observable state, with a deadline.

`build_random_llama` writes a small random Llama checkpoint with a char-level tokenizer: the fallback
model when the embedded tiny model (`forkrl.models.tiny`) is not available, and proof that any local HF
checkpoint directory can be served.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

REPO_ROOT = Path(__file__).resolve().parents[1]

# Digits, operators and a few letters: enough for the synthetic tasks and readable test prompts.
CHARS = list("0123456789+-*=() abcdefghijklmnopqrstuvwxyz.,")
SPECIAL = ["<pad>", "<s>", "</s>", "<unk>"]
# What both services print (trainer: stdout) or log (rollout: stderr) once their port is bound.
_LISTENING = re.compile(rb"listening on ([^\s:]+):(\d+)")

T = TypeVar("T")


def build_random_llama(
    out: str | Path,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 512,
    seed: int = 0,
) -> Path:
    """Write a random-weight Llama checkpoint (fp32 safetensors + char-level tokenizer) into `out`."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    vocab = {tok: i for i, tok in enumerate(SPECIAL + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    hf_tok.save_pretrained(out)
    config = LlamaConfig(
        vocab_size=len(vocab),  # = tokenizer length, else vLLM samples ids the tokenizer cannot decode
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        # vLLM's CPU attention supports head sizes 32, 64, 80, ... only (16 fails at the first step).
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=vocab["<s>"],
        eos_token_id=vocab["</s>"],
        pad_token_id=vocab["<pad>"],
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    # A larger init spread than HF's default 0.02 makes the output distribution far from uniform, so
    # logprob comparisons are meaningful and stop tokens actually get sampled sometimes.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2 if hidden_size <= 128 else 0.02)
    model.save_pretrained(out, safe_serialization=True)
    return out


def wait_until(predicate: Callable[[], T], timeout_s: float, what: str, every_s: float = 0.02) -> T:
    """Poll `predicate` until it returns something truthy (returned); AssertionError naming `what` after
    `timeout_s`. The one way tests wait: on observable state, never on a fixed sleep."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(every_s)


class ServiceAddress(str):
    """ "HOST:PORT" (127.0.0.1 unless the service was told another --host), with the service's `process` (a
    subprocess.Popen) and `log_path`."""

    process: subprocess.Popen
    log_path: Path


def free_port() -> int:
    """A port that was free a moment ago. Racy by nature (it is released before anyone binds it): only
    for commands whose ports must be known in advance (compose files); retry those on a bind failure."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kill_group(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM the service (its own graceful stop shuts its engine down), then SIGKILL its whole
    process group: nothing it started survives, whatever state it was in."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
    # The engine core and worker are in the same group; kill whatever survived the graceful stop.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


_kill_group = kill_group  # the old name, for callers outside tests/ (bench)


def group_alive(pgid: int) -> bool:
    """Whether any process of the process group `pgid` is still alive (zombies count as gone)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                return True
    return False


def wait_for_health(address: str, timeout_s: float, proc: subprocess.Popen | None = None, service: str = "",
                    ca_file: str | None = None) -> None:
    """Poll grpc.health.v1 Check until SERVING; fail early if `proc` exited. `ca_file`: over TLS."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from forkrl.remote.channel import grpc_channel

    deadline = time.monotonic() + timeout_s
    with grpc_channel(address, token="", ca_file=ca_file) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"service at {address} exited with code {proc.returncode} before SERVING")
            with contextlib.suppress(grpc.RpcError):
                resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2.0)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"service at {address} not SERVING after {timeout_s:.0f} s")
            time.sleep(0.1)


def _read_address(log_path: Path, proc: subprocess.Popen, timeout_s: float) -> str:
    """HOST:PORT from the service's "listening on HOST:PORT" line (it binds port 0 itself)."""

    def port() -> str | None:
        m = _LISTENING.search(log_path.read_bytes())
        if m:
            return f"{m.group(1).decode()}:{int(m.group(2))}"
        if proc.poll() is not None:
            raise RuntimeError(f"service exited with code {proc.returncode} before it listened")
        return None

    return wait_until(port, timeout_s, f"the 'listening on' line in {log_path}")


def _log_tail(log_path: Path, n_bytes: int = 4000) -> str:
    with contextlib.suppress(OSError):
        return log_path.read_bytes()[-n_bytes:].decode(errors="replace")
    return "(no log)"


@contextlib.contextmanager
def _service(
    cmd: list[str], name: str, log_path: str | Path | None, env: dict[str, str], startup_timeout_s: float,
    grace_s: float, ready: Callable[[ServiceAddress], None], expect_clean_stop: bool,
) -> Iterator[ServiceAddress]:
    temp_dir = None
    if log_path is None:
        temp_dir = Path(tempfile.mkdtemp(prefix=f"forkrl-test-{name}-"))
        log_path = temp_dir / f"{name}.log"
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(
            cmd, cwd=REPO_ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    clean = False
    try:
        try:
            address = ServiceAddress(_read_address(log_path, proc, startup_timeout_s))
            address.process, address.log_path = proc, log_path
            ready(address)
        except Exception as e:
            raise RuntimeError(f"{name} service failed to start ({e}); log tail:\n{_log_tail(log_path)}") from None
        yield address
        clean = True
    finally:
        stop_report = ""
        if clean and expect_clean_stop:  # SIGTERM alone must stop the service and everything it started
            proc.send_signal(signal.SIGTERM)
            try:
                rc = proc.wait(timeout=grace_s)
                if rc != 0:
                    stop_report = f"exited with {rc} on SIGTERM"
                elif not _wait_gone(proc.pid, 10.0):
                    stop_report = "left processes of its group running after SIGTERM"
            except subprocess.TimeoutExpired:
                stop_report = f"still running {grace_s:.0f} s after SIGTERM"
        kill_group(proc, grace_s)
        if temp_dir is not None:
            if clean and not stop_report and proc.returncode in (0, -signal.SIGTERM):
                shutil.rmtree(temp_dir, ignore_errors=True)
            else:
                print(f"{name} service exited with {proc.returncode}; log kept at {log_path}", file=sys.stderr)
    if stop_report:
        raise AssertionError(f"{name} service {stop_report}; log tail:\n{_log_tail(log_path)}")


def _wait_gone(pgid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while group_alive(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _flags(settings: dict[str, object]) -> list[str]:
    out: list[str] = []
    for key, value in settings.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + key.replace("_", "-"))
        else:
            out += [flag, str(value)]
    return out


def start_rollout_service(
    model_dir: str | Path,
    *,
    startup_timeout_s: float = 300.0,
    log_path: str | Path | None = None,
    extra_env: dict[str, str] | None = None,
    expect_clean_stop: bool = False,
    launcher: Sequence[str] = (),
    ready: Callable[[ServiceAddress], None] | None = None,
    **settings: object,
) -> contextlib.AbstractContextManager[ServiceAddress]:
    """Run the rollout service on a port it binds itself; yield its address ("HOST:PORT" of its --host, default
    127.0.0.1; a str with `.process` and `.log_path`) once health says SERVING.

    `settings` are RolloutSettings fields (`kv_cache_gib=1`, `seed=0`, `staging_dir=...`) passed as flags;
    LoadWeights may read anything under the temporary directory (allowed_roots) unless the test says otherwise.
    `expect_clean_stop`: on a normal exit, SIGTERM must stop the service with status 0 and leave no process
    of its group (its engine) behind, or the exit raises AssertionError. `launcher`: a command prefix (a host of
    the simulated cluster: Cluster.argv(host, [])); `ready`: how to wait for it instead of a health check from
    this process (which cannot reach another host's address).
    """
    settings.setdefault("allowed_roots", tempfile.gettempdir())  # where the tests keep their checkpoints
    cmd = [*launcher, sys.executable, "-m", "rollout_service", "--model", str(model_dir), "--port", "0",
           *_flags(settings)]
    env = {**os.environ, **(extra_env or {})}
    env.setdefault("OMP_NUM_THREADS", "1")

    def healthy(address: ServiceAddress) -> None:
        wait_for_health(address, startup_timeout_s, address.process)

    return _service(cmd, "rollout", log_path, env, startup_timeout_s, grace_s=30.0, ready=ready or healthy,
                    expect_clean_stop=expect_clean_stop)


def start_trainer_service(
    runs_root: str | Path,
    *,
    log_path: str | Path | None = None,
    startup_timeout_s: float = 120.0,
    extra_env: dict[str, str] | None = None,
    expect_clean_stop: bool = False,
    ranks: int = 1,
    **settings: object,
) -> contextlib.AbstractContextManager[ServiceAddress]:
    """`python -m trainer_service` on a port it binds itself, runs under `runs_root`, no TensorBoard.
    `expect_clean_stop` as for `start_rollout_service`. Unless the test says otherwise, StartRun may read models
    and datasets under the temporary directory (allowed_roots) and use any rollout service on 127.0.0.1
    (rollout_addresses 127.0.0.1:*); run dirs must lie inside `runs_root`, as for any trainer. `ranks` > 1:
    under `python -m forkrl.launch --nproc-per-node <ranks>` (rank 0 serves, the others follow it)."""
    settings.setdefault("allowed_roots", tempfile.gettempdir())
    settings.setdefault("rollout_addresses", "127.0.0.1:*")  # the tests' rollout services bind free ports
    launcher = [sys.executable, "-m", "forkrl.launch", f"--nproc-per-node={ranks}"] \
        if ranks > 1 else [sys.executable]
    cmd = [*launcher, "-m", "trainer_service", "--port", "0", "--runs-root", str(runs_root),
           "--no-tensorboard", *_flags(settings)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(extra_env or {})}

    def ready(address: ServiceAddress) -> None:
        wait_for_health(address, startup_timeout_s, address.process, ca_file=env.get("FORKRL_TLS_CA"))

    return _service(cmd, "trainer", log_path, env, startup_timeout_s, grace_s=60.0, ready=ready,
                    expect_clean_stop=expect_clean_stop)


@contextlib.contextmanager
def start_probe_service(root: Path, jobs: Path, log: Path, **settings: object) -> Iterator[Any]:
    """`python -m probe_service` (a real process, under uvicorn) reading `root`, jobs in `jobs`, one torch thread,
    on the CPU; `settings` become flags (max_concurrent_jobs=2 -> --max-concurrent-jobs 2). Yields an
    httpx.Client on it carrying the suite's token, with the Popen as `.process`; the process group is killed at
    the end."""
    import httpx

    from forkrl.remote.channel import http_headers

    flags = _flags({"threads": 1, "device": "cpu", "log_level": "warning", **settings})
    for _ in range(5):  # free_port is racy: another process may take the port before uvicorn binds it
        port = free_port()
        with open(log, "ab") as f:
            proc = subprocess.Popen(
                [sys.executable, "-m", "probe_service", "--port", str(port), "--allowed-roots", str(root),
                 "--jobs-dir", str(jobs), *flags],
                cwd=REPO_ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, "OMP_NUM_THREADS": "1"})
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60, headers=http_headers())

        def up(proc: subprocess.Popen = proc, client: httpx.Client = client) -> bool:
            if proc.poll() is not None:
                return True
            with contextlib.suppress(httpx.HTTPError):
                return client.get("/healthz").status_code == 200
            return False

        wait_until(up, 120, "the probe service to answer /healthz", every_s=0.1)
        if proc.poll() is None:
            break
        client.close()
    else:
        raise RuntimeError(f"the probe service did not start; log:\n{log.read_text()[-3000:]}")
    client.process = proc  # type: ignore[attr-defined]
    try:
        yield client
    finally:
        client.close()
        kill_group(proc, 10)
