"""Helpers of the trainer tests: run a config to the end, read metrics.jsonl, the log-prob ceiling between
trainer and rollout, and a pseudo-terminal to drive clients/start_run.py as a person at a keyboard would."""

from __future__ import annotations

import contextlib
import json
import os
import pty
import re
import select
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from forkrl.remote.channel import grpc_channel
from forkrl.training.config import RunConfig, to_proto
from forkrl.wire.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from tests.service_fixtures import REPO_ROOT

SMALL = dict(prompts_per_step=8, group_size=4, eval_prompts=0, seed=0)
START_RUN = str(REPO_ROOT / "clients" / "start_run.py")


@contextlib.contextmanager
def trainer_stub(address: str) -> Iterator[trainer_pb2_grpc.TrainerServiceStub]:
    with grpc_channel(address) as channel:
        yield trainer_pb2_grpc.TrainerServiceStub(channel)


def run_to_end(address: str, cfg: RunConfig, timeout_s: float = 300) -> tuple[str, list, trainer_pb2.GetRunResponse]:
    """StartRun, follow WatchRun to the end; (run id, every WatchRun item, the final GetRun)."""
    with trainer_stub(address) as stub:
        started = stub.StartRun(trainer_pb2.StartRunRequest(config=to_proto(cfg)), timeout=60)
        items = list(stub.WatchRun(trainer_pb2.WatchRunRequest(run_id=started.run_id), timeout=timeout_s))
        return started.run_id, items, stub.GetRun(trainer_pb2.GetRunRequest(run_id=started.run_id), timeout=10)


def stop_and_wait(address: str, run_id: str, timeout_s: float = 300) -> trainer_pb2.GetRunResponse:
    """StopRun (a no-op for a finished run) and wait for the run's end."""
    with trainer_stub(address) as stub:
        stub.StopRun(trainer_pb2.StopRunRequest(run_id=run_id), timeout=30)
        list(stub.WatchRun(trainer_pb2.WatchRunRequest(run_id=run_id), timeout=timeout_s))
        return stub.GetRun(trainer_pb2.GetRunRequest(run_id=run_id), timeout=10)


def metric_lines(run_dir: Path, kind: str = "train") -> list[dict]:
    lines = [json.loads(s) for s in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [m for m in lines if m["kind"] == kind]


def kept_bounds(response_tokens: float, micro_batches: float, rho_num: int = 1, rho_den: int = 5) -> tuple[int, int]:
    """[lo, hi] of the kept-token count when each of `micro_batches` micro-batches keeps ceil(rho n_j):
    the sum of ceilings lies in [ceil(rho N), ceil(rho N) + micro_batches - 1] (integer arithmetic)."""
    lo = max(1, -(-int(response_tokens) * rho_num // rho_den))
    return lo, lo + int(micro_batches) - 1


def trainer_rollout_logp_ceiling(model_dir: Path, temperature: float = 1.0) -> float:
    """How far the trainer's float32 log-probs (HF, a padded batch) and the rollout's (vLLM) may be apart
    for the same policy: each lies within `float32_logprob_bound` of the exact value, computed here on
    completions of this model on the default task (the runs' policies differ from it by a few small updates,
    which do not change the size of float32 rounding). Twice the bound: one for each side."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from forkrl.data.tasks import DEFAULT_TASK, get_task, make_split
    from forkrl.models.tiny import sample_completions
    from tests.numerics import float32_logprob_bound

    tok = AutoTokenizer.from_pretrained(model_dir)
    m32 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    m64 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    prompts = [p.prompt for p in make_split(DEFAULT_TASK, "eval", 32, seed=3)]
    completions = sample_completions(m32, tok, prompts, temperature=temperature, n_samples=2,
                                     max_new_tokens=get_task(DEFAULT_TASK).max_new_tokens)
    seqs = [
        (tok(p).input_ids, tok(c, add_special_tokens=False).input_ids + [tok.eos_token_id])
        for p, cs in zip(prompts, completions, strict=True) for c in cs
    ]
    return 2 * float32_logprob_bound(seqs, m32, m64, temperature)


class PtyProcess:
    """A command on a pseudo-terminal of its own (its controlling terminal): `send("\\x03")` is a Ctrl-C
    typed at the keyboard (the terminal sends SIGINT to it), `expect(regex)` waits for output."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None) -> None:
        pid, fd = pty.fork()
        if pid == 0:  # the child: exec at once (nothing else is safe after fork in a threaded parent)
            try:
                os.chdir(REPO_ROOT)
                os.execve(argv[0], argv, env if env is not None else dict(os.environ))
            finally:
                os._exit(127)
        self.pid, self.fd, self.output, self.returncode = pid, fd, "", None

    def _read(self, timeout_s: float) -> bool:
        ready, _, _ = select.select([self.fd], [], [], timeout_s)
        if not ready:
            return False
        try:
            chunk = os.read(self.fd, 65536)
        except OSError:  # EIO: the child closed the terminal (it exited)
            chunk = b""
        if not chunk:
            raise EOFError
        self.output += chunk.decode(errors="replace")
        return True

    def expect(self, pattern: str, timeout_s: float = 120) -> re.Match:
        deadline = time.monotonic() + timeout_s
        start = 0
        while True:
            m = re.compile(pattern).search(self.output, start)
            if m:
                return m
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {pattern!r} after {timeout_s:.0f} s; output so far:\n{self.output[-3000:]}")
            try:
                self._read(min(left, 1.0))
            except EOFError:
                raise AssertionError(f"exited before printing {pattern!r}; output:\n{self.output[-3000:]}") from None

    def send(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def wait(self, timeout_s: float = 120) -> int:
        """Exit status (reading the output meanwhile, so the child never blocks on a full terminal)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                with contextlib.suppress(EOFError, OSError):
                    while self._read(0.05):
                        pass
                self.returncode = os.waitstatus_to_exitcode(status)
                return self.returncode
            with contextlib.suppress(EOFError):
                self._read(0.1)
        raise AssertionError(f"still running after {timeout_s:.0f} s; output:\n{self.output[-3000:]}")

    def close(self) -> None:
        """Kill the child if it still runs (unconditional cleanup) and close the terminal."""
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(self.pid, 0)
        with contextlib.suppress(OSError):
            os.close(self.fd)


def start_run_argv(*flags: str) -> list[str]:
    return [sys.executable, START_RUN, *flags]
