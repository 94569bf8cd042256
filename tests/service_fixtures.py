"""Reusable helpers for tests that need a real rollout service (and a model to serve).

    from tests.service_fixtures import start_rollout_service, build_random_llama

    with start_rollout_service(model_dir, kv_cache_gib=1) as address:
        client = RolloutClient(address)
        ...

`start_rollout_service` runs `python -m rollout_service --model DIR --port P` as a subprocess in its own
process group, waits until the standard health service says SERVING, and on exit sends SIGTERM to the
service (graceful stop) and then SIGKILL to its process group, so no engine process outlives the tests.

`build_random_llama` writes a small random Llama checkpoint with a char-level tokenizer: the fallback
model when the embedded tiny model (`forkrl.models.tiny`) is not available, and proof that any local HF
checkpoint directory can be served.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

# Digits, operators and a few letters: enough for the synthetic tasks and readable test prompts.
CHARS = list("0123456789+-*=() abcdefghijklmnopqrstuvwxyz.,")
SPECIAL = ["<pad>", "<s>", "</s>", "<unk>"]


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


class ServiceAddress(str):
    """ "127.0.0.1:PORT", with the service's `process` (a subprocess.Popen) for tests that signal it."""

    process: subprocess.Popen


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_group(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM the service (its own graceful stop shuts its engine down), then SIGKILL its whole
    process group: nothing it started survives, whatever state it was in."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    # The engine core and worker are in the same group; kill whatever survived the graceful stop.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


def wait_for_health(address: str, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    """Poll grpc.health.v1 Check until SERVING; fail early if `proc` exited."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"rollout service exited with code {proc.returncode} before SERVING")
            try:
                resp = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2.0)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"rollout service at {address} not SERVING after {timeout_s:.0f} s")
            time.sleep(0.25)


@contextlib.contextmanager
def start_rollout_service(
    model_dir: str | Path,
    *,
    startup_timeout_s: float = 300.0,
    log_path: str | Path | None = None,
    extra_env: dict[str, str] | None = None,
    **settings: object,
) -> Iterator[ServiceAddress]:
    """Run the rollout service on a free 127.0.0.1 port; yield its address ("127.0.0.1:PORT", a str
    whose `.process` is the Popen).

    `settings` are RolloutSettings fields (`kv_cache_gib=1`, `seed=0`, ...) passed as CLI flags.
    The service's stdout/stderr go to `log_path` (default: a temp file, printed on a failed start).
    """
    port = free_port()
    cmd = [sys.executable, "-m", "rollout_service", "--model", str(model_dir), "--port", str(port)]
    for key, value in settings.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            cmd += [flag if value else "--no-" + key.replace("_", "-")]
        else:
            cmd += [flag, str(value)]
    env = {**os.environ, **(extra_env or {})}
    env.setdefault("OMP_NUM_THREADS", "1")
    temp_log = log_path is None
    if temp_log:
        log_file = tempfile.NamedTemporaryFile("w+b", prefix="rollout_service_", suffix=".log", delete=False)
    else:
        log_file = open(log_path, "w+b")  # noqa: SIM115 - closed in finally
    proc = subprocess.Popen(
        cmd, cwd=REPO_ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
    )
    address = ServiceAddress(f"127.0.0.1:{port}")
    address.process = proc
    try:
        try:
            wait_for_health(address, startup_timeout_s, proc)
        except Exception:
            log_file.flush()
            log_file.seek(0)
            tail = log_file.read().decode(errors="replace")[-4000:]
            raise RuntimeError(f"rollout service failed to start; log tail:\n{tail}") from None
        yield address
    finally:
        _kill_group(proc, grace_s=15.0)
        log_file.close()
        if temp_log:
            if proc.returncode in (0, -signal.SIGTERM):  # a clean stop: nothing worth keeping
                os.unlink(log_file.name)
            else:
                print(f"rollout service exited with {proc.returncode}; log kept at {log_file.name}", file=sys.stderr)
