"""Process environment defaults for CPU runs of torch and vLLM.

Call `apply_runtime_env()` *before* importing torch or vLLM (thread counts are read at import).
Every value is a default: a variable already set by the user wins.

Why each one (the measurements: docs/results.md, "Numbers moved out of docstrings"):
- VLLM_CPU_KVCACHE_SPACE: unset, vLLM's CPU backend claims most of the RAM and starts several times slower.
- VLLM_HOST_IP: otherwise the engine's message queue binds the machine's external address.
- VLLM_RPC_BASE_PATH / VLLM_CACHE_ROOT / TORCHINDUCTOR_CACHE_DIR: keep sockets and compile caches in
  the project's cache dir instead of /tmp and ~/.cache. A unix socket's path has at most 107 bytes, so where the
  checkout's cache dir is too long for vLLM's sockets (`<dir>/<uuid4>`) they go to a per-user folder of the
  temporary directory instead, created 0700 and refused unless this user owns it and it is private (`rpc_dir`).
- OMP_NUM_THREADS: two CPU-bound processes with a thread per core each oversubscribe the cores and slow each
  other down by an order of magnitude.
- OMP_WAIT_POLICY=PASSIVE for the engines (rollout, probe): their waiting OpenMP threads sleep instead of spinning
  on cores that the trainer needs while an async run trains beside generation. The trainer process sets none:
  libgomp's default (a waiting thread spins a few milliseconds, then sleeps) is the faster one while it has the
  cores (a sync run's update); where other busy work shares the cores (a CI runner, several jobs), export
  OMP_WAIT_POLICY=PASSIVE before starting anything (scripts/test.sh does).

`mark_service_process()` / `die_with_service()`: the processes a service's engine starts (vLLM's engine core,
its worker) end when the service's main process ends, also when it was SIGKILLed (nothing runs in it then).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SOCKET_PATH_MAX = 107  # bytes of a unix socket's path (sockaddr_un.sun_path, less its NUL)
_RPC_NAME = 37  # vLLM binds its engine's sockets at <VLLM_RPC_BASE_PATH>/<uuid4>


def cache_dir() -> Path:
    return Path(os.environ.get("FORKRL_CACHE_DIR", REPO_ROOT / ".cache"))


def rpc_dir(cache: Path) -> Path:
    """Where vLLM's engine binds its unix sockets: `<cache>/vllm-rpc`, or, when a socket there would be longer than
    SOCKET_PATH_MAX (a checkout under a long folder: every engine failed to start), `forkrl-rpc-<uid>` in the
    temporary directory: created 0700, and RuntimeError naming it unless it is a folder (not a link) this user owns
    that no one else may enter."""
    wanted = cache / "vllm-rpc"
    if len(os.fsencode(wanted)) + _RPC_NAME <= SOCKET_PATH_MAX:
        return wanted
    import stat
    import tempfile

    short = Path(tempfile.gettempdir()) / f"forkrl-rpc-{os.getuid()}"
    try:
        short.mkdir(mode=0o700)
        short.chmod(0o700)  # mkdir's mode is filtered by the umask
    except FileExistsError:
        pass
    st = short.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
        raise RuntimeError(f"{short} (vLLM's socket folder: the cache dir {cache} is too long for a socket path) must "
                           f"be a folder owned by uid {os.getuid()} with mode 0700, got mode "
                           f"{stat.S_IMODE(st.st_mode):04o}, owner {st.st_uid}: remove it, or set VLLM_RPC_BASE_PATH "
                           f"or FORKRL_CACHE_DIR to a folder of at most {SOCKET_PATH_MAX - _RPC_NAME} bytes")
    return short


def apply_runtime_env(threads: int | None = None) -> None:
    """Set CPU-friendly defaults for torch/vLLM in this process (and the workers it spawns)."""
    cache = cache_dir()
    defaults = {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_HOST_IP": "127.0.0.1",
        "VLLM_CACHE_ROOT": str(cache / "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_WAIT_POLICY": "PASSIVE",  # the engine's processes inherit it (module docstring)
    }
    if threads is not None:
        defaults["OMP_NUM_THREADS"] = str(threads)
        defaults["MKL_NUM_THREADS"] = str(threads)
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    if "VLLM_RPC_BASE_PATH" not in os.environ:
        os.environ["VLLM_RPC_BASE_PATH"] = str(rpc_dir(cache))
    Path(os.environ["VLLM_RPC_BASE_PATH"]).mkdir(parents=True, exist_ok=True)


def release_memory() -> None:
    """Free what a finished run held now: its model, gradients and optimizer state sit in reference cycles (the
    session, its callbacks and threads point at each other), which only a full garbage collection frees, and
    CPython runs one when allocation counts say so, not when a run ends. Without it a service's next run loads
    its model beside the last one's (a 0.5B model's fp32 training state is 8 GB). On CUDA the cached blocks go back
    too. Call it where nothing refers to the run any more (after an exception's traceback is gone)."""
    import gc

    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity mask: taskset, a container's cpuset), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def train_threads(setting: int | str, *, async_run: bool) -> int:
    """torch threads for a run's training. A number: that number. "auto": the budget (OMP_NUM_THREADS when the
    environment sets it, as vLLM honours it, else the usable cores) shared among the ranks of this machine
    (LOCAL_WORLD_SIZE, set by torchrun): all of it in a sync run, where generation and training take turns and
    each phase may use the whole machine; half of it (at least 1) in an async run (max_staleness > 0), where the
    rollout service samples the next batch while the trainer trains."""
    if setting != "auto":
        return int(setting)
    omp = os.environ.get("OMP_NUM_THREADS", "")
    budget = int(omp) if omp.isdigit() and int(omp) > 0 else usable_cores()
    share = budget // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    return max(1, share // 2 if async_run else share)


SERVICE_PID_ENV = "FORKRL_SERVICE_PID"


def mark_service_process() -> None:
    """Record this process as the service whose descendants must die with it (`die_with_service`): its pid in
    FORKRL_SERVICE_PID, which the processes it starts inherit. Call before starting the engine."""
    os.environ[SERVICE_PID_ENV] = str(os.getpid())


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22): with the pid, an identity that
    a reused pid does not share; None when it is gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def die_with_service(every_s: float = 0.5) -> threading.Thread | None:
    """In a descendant of the process `mark_service_process` recorded: `die_with` that process. None (nothing
    watched) outside a service or in the service itself."""
    try:
        service = int(os.environ.get(SERVICE_PID_ENV, "0"))
    except ValueError:
        return None
    return die_with(service, every_s) if service != os.getpid() else None


def die_with(ancestor: int, every_s: float = 0.5) -> threading.Thread | None:
    """End this process (SIGKILL) once the process `ancestor` is gone, also when it was SIGKILLed, killing first the
    processes between the two (vLLM's engine core between the rollout service and a worker of `--engine-mode mp`).
    Why not vLLM's own mechanism: vLLM gives its workers a death pipe from the engine core, but nothing ties the
    engine core to its front-end; and not PR_SET_PDEATHSIG: it fires when the *thread* that started the child ends
    (the engine is built in a thread pool), so a daemon thread polls /proc every `every_s` instead. Returns that
    thread; None (nothing watched) outside Linux or when `ancestor` is not an ancestor of this process."""
    if ancestor <= 1 or not sys.platform.startswith("linux"):
        return None
    between: list[tuple[int, int | None]] = []  # (pid, start time) of each process from the parent up
    pid = os.getppid()
    while pid != ancestor:
        if pid <= 1 or len(between) >= 8:
            return None  # not a descendant (the variable leaked into an unrelated process)
        between.append((pid, _start_time(pid)))
        pid = _parent(pid)
    born = _start_time(ancestor)

    def watch() -> None:
        while born is not None and _start_time(ancestor) == born:
            time.sleep(every_s)
        print(f"forkrl: process {ancestor} is gone: ending process {os.getpid()}, which it started",
              file=sys.stderr, flush=True)
        for p, started in between:
            if started is not None and _start_time(p) == started:
                os.kill(p, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    thread = threading.Thread(target=watch, name="forkrl-die-with", daemon=True)
    thread.start()
    return thread
