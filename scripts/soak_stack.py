"""The processes of a soak (scripts/soak.py): the rollout (vLLM), trainer and probe services, each in its own process
group on a fixed port (a restart comes back where the others look for it), restartable, sampled for memory, open
files and threads, and found again by a marker in their environment when they escape their group."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
MARKER = "FORKRL_SOAK_ID"  # in every stack process's environment (vLLM's engine core inherits it)


@dataclass
class Incarnation:
    """One life of a service: its process, when it started and ended, and its resource samples."""

    n: int
    proc: subprocess.Popen
    started: float
    ended: float | None = None
    exit_code: int | None = None
    samples: list[tuple[float, int, int, int]] = field(default_factory=list)  # (t, rss bytes, fds, threads)


@dataclass
class Service:
    name: str
    argv: list[str]
    port: int
    log: Path
    env: dict[str, str]
    lives: list[Incarnation] = field(default_factory=list)
    held: bool = False  # a fault owns it now: the supervisor does not restart it
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def current(self) -> Incarnation | None:
        return self.lives[-1] if self.lives else None

    @property
    def pid(self) -> int | None:
        cur = self.current
        return cur.proc.pid if cur is not None and cur.proc.poll() is None else None

    def start(self, t0: float) -> Incarnation:
        with open(self.log, "ab") as f:
            f.write(f"--- soak: incarnation {len(self.lives) + 1} at t={time.monotonic() - t0:.1f} s\n".encode())
            proc = subprocess.Popen(self.argv, cwd=REPO_ROOT, env=self.env, stdout=f, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        life = Incarnation(len(self.lives) + 1, proc, time.monotonic() - t0)
        self.lives.append(life)
        return life

    def reap(self, t0: float) -> Incarnation | None:
        """The current incarnation when it has just been seen to exit (its end recorded), else None."""
        cur = self.current
        if cur is None or cur.ended is not None or cur.proc.poll() is None:
            return None
        cur.ended, cur.exit_code = time.monotonic() - t0, cur.proc.returncode
        killpg(cur.proc.pid, signal.SIGKILL)  # what it started (the engine core) goes with it
        return cur

    def signal(self, sig: int) -> int | None:
        """Send `sig` to the whole process group of the current incarnation; its pid, or None when none runs."""
        pid = self.pid
        if pid is not None:
            killpg(pid, sig)
        return pid


def killpg(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _group(pgid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
                out.append(int(stat.parent.name))
    return out


def usage(pgid: int) -> tuple[int, int, int] | None:
    """(RSS bytes, open fds, threads) summed over the live processes of a process group; None when it has none."""
    rss = fds = threads = 0
    pids = _group(pgid)
    for pid in pids:
        with contextlib.suppress(OSError, ValueError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    rss += int(line.split()[1]) * 1024
                elif line.startswith("Threads:"):
                    threads += int(line.split()[1])
            fds += len(os.listdir(f"/proc/{pid}/fd"))
    return (rss, fds, threads) if pids else None


def marked(soak_id: str) -> list[tuple[int, str]]:
    """(pid, command line) of every live process carrying this soak's marker in its environment."""
    needle = f"{MARKER}={soak_id}".encode()
    found = []
    for d in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            if needle in (d / "environ").read_bytes().split(b"\0"):
                state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state not in ("Z", "X") and int(d.name) != os.getpid():
                    found.append((int(d.name), (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]))
    return found


def build_services(out: Path, model: Path, runs: Path, ports: dict[str, int], soak_id: str) -> dict[str, Service]:
    py = sys.executable
    env = {**os.environ, MARKER: soak_id, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    staging = out / "staging"
    staging.mkdir(parents=True, exist_ok=True)
    argv = {
        # --backend vllm: the product engine (auto picks the torch sampler for the tiny model)
        "rollout": [py, "-m", "rollout_service", "--model", str(model), "--backend", "vllm", "--host", "127.0.0.1",
                    "--port", str(ports["rollout"]), "--kv-cache-gib", "1", "--seed", "0",
                    "--staging-dir", str(staging), "--allowed-roots", str(out)],
        "trainer": [py, "-m", "trainer_service", "--host", "127.0.0.1", "--port", str(ports["trainer"]),
                    "--runs-root", str(runs), "--allowed-roots", str(out), "--rollout-addresses",
                    f"127.0.0.1:{ports['rollout']}", "--rollout-wait-s", "600", "--threads", "1"],
        "probe": [py, "-m", "probe_service", "--host", "127.0.0.1", "--port", str(ports["probe"]),
                  "--allowed-roots", str(runs), "--jobs-dir", str(out / "probe_jobs"), "--threads", "1",
                  "--device", "cpu", "--max-concurrent-jobs", "1", "--max-queued-jobs", "8"],
    }
    (out / "logs").mkdir(parents=True, exist_ok=True)
    return {name: Service(name, cmd, ports[name], out / "logs" / f"{name}.log", env) for name, cmd in argv.items()}
