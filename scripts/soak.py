"""A soak: the stack (rollout on vLLM, trainer, probe; each its own process group) trains one long run with
checkpoints, evaluations and probe jobs while faults from a seeded schedule hit it; at the end a table of checks.

    python scripts/soak.py --minutes 60 --seed 1                 # the hour (>= 21 faults of every kind)
    python scripts/soak.py --minutes 10 --seed 1 --out /tmp/soak  # a short one (the stall range scales down)
    python scripts/soak.py --minutes 3 --seed 7 --faults kill_trainer,kill_rollout,kill_checkpoint,stop_probe

Faults (`--faults`, comma list; default all), each `--per-hour` times an hour (default 21), at seeded random times
(stratified: one per equal slot, so the counts are exact), in three lanes that run side by side (the rollout's,
the trainer's, the probe's: a fault of one service can fall inside another's), each lane one fault at a time:
  kill_rollout, kill_trainer, kill_probe     SIGKILL of the service's process group
  term_rollout, term_trainer, term_probe     SIGTERM (the graceful stop), SIGKILL after 90 s
  stop_rollout, stop_trainer, stop_probe     SIGSTOP for 10-60 s (x minutes/60 when shorter than an hour), SIGCONT
  kill_push         SIGKILL of the trainer or the rollout (seeded) the moment the rollout logs a new weight version
                    in place: the push is applied there and the trainer has not yet recorded the step (waits up
                    to 90 s for a push; "missed" when none comes)
  kill_checkpoint   SIGKILL of the trainer while <run_dir>/checkpoints/.tmp-* exists (a checkpoint being written;
                    waits up to 90 s for one)
  disk_full         the runs root is a 64 MiB tmpfs (root only; else skipped and said): a ballast file fills it
                    until the run fails (naming the full run dir) or 30 s pass, then it is removed
A 60-minute soak then trains 15 minutes without faults (`--quiet-minutes`), so that the last life of each service
is long enough for the growth check. A killed or stopped service is restarted at once (docker's restart policy);
a trainer that comes back, or a run that failed, gets StartRun(resume=True) on the same run dir. Network
partitions: not yet (scripts/cluster_sim.py exists, the multi-host layout does not). The checks and the table:
scripts/soak_checks.py. Exit status 0 when every check passes, 1 otherwise, 2 when the stack could not start.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from soak_checks import Fault, Monitor, check_all, print_table  # noqa: E402
from soak_stack import MARKER, Service, build_services, killpg, usage  # noqa: E402

LANES = {"rollout": ("kill_rollout", "term_rollout", "stop_rollout", "kill_push"),
         "trainer": ("kill_trainer", "term_trainer", "stop_trainer", "kill_checkpoint", "disk_full"),
         "probe": ("kill_probe", "term_probe", "stop_probe")}
KINDS = tuple(k for lane in LANES.values() for k in lane)
PER_HOUR = 21
WARMUP_S = 45.0  # after the first step, before the first fault
QUIET_S = 20.0  # no fault in the last seconds: the run must show it recovered
WINDOW_S = 90.0  # kill_push / kill_checkpoint: how long to wait for a push or a checkpoint write
FULL_S = 30.0  # disk_full: the longest the disk stays full (less when the run fails first)
IN_PLACE = re.compile(rb"weights v(\d+) in place")


def schedule(minutes: float, span_s: float, seed: int, kinds: list[str],
             per_hour: float) -> list[tuple[float, str, float]]:
    """ceil(per_hour x minutes / 60) faults of each kind, one in each equal slot of `span_s` seconds: (seconds into
    the span, kind, a parameter: the stall's length, or the push kill's target draw)."""
    rng = random.Random(seed)
    span = max(span_s, 30.0)
    n = max(1, math.ceil(per_hour * minutes / 60))
    scale = min(1.0, minutes / 60)
    lo, hi = max(2.0, 10 * scale), max(4.0, 60 * scale)
    out = []
    for kind in kinds:
        for i in range(n):
            out.append(((i + rng.uniform(0.05, 0.95)) * span / n, kind, rng.uniform(lo, hi)))
    return sorted(out)


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.t0 = args, time.monotonic()
        self.out = Path(args.out).resolve()
        self.runs = self.out / "runs"
        self.run_dir = self.runs / "soak"
        self.stop_faults = threading.Event()
        self.failed_starts: list[str] = []
        self.run_errors: list[str] = []
        self.faults: list[Fault] = []
        self.tmpfs = False
        self.run_id = ""
        self.resume_at = 0.0
        self.run_done = False
        self.backing_off = False
        self.ended_seen = False

    def now(self) -> float:
        return time.monotonic() - self.t0

    # -- setup
    def setup(self) -> None:
        from forkrl.models.embedded import install_default  # the committed tiny model, as compose's `model`
        from forkrl.security import TOKEN_ENV
        from tests.service_fixtures import free_port

        if self.out.exists():
            with contextlib.suppress(subprocess.CalledProcessError):
                subprocess.run(["umount", str(self.runs)], check=True, capture_output=True)
            shutil.rmtree(self.out)
        self.runs.mkdir(parents=True)
        if "disk_full" in self.args.kinds:
            r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(self.runs)],
                               capture_output=True, text=True)
            self.tmpfs = r.returncode == 0
            if not self.tmpfs:
                print(f"[soak] disk_full skipped: cannot mount a tmpfs ({r.stderr.strip()})", flush=True)
        self.model = self.out / "model"
        install_default(self.model)
        os.environ.setdefault(TOKEN_ENV, "soak-" + uuid.uuid4().hex)
        os.environ.pop("FORKRL_TOKEN_FILE", None)
        self.soak_id = uuid.uuid4().hex
        ports = {n: free_port() for n in ("rollout", "trainer", "probe")}
        self.services = build_services(self.out, self.model, self.runs, ports, self.soak_id)
        self.monitor = Monitor(self.run_dir, self.t0)

    # -- the run
    def config(self, resume: bool):
        from forkrl.training.config import RunConfig, to_proto

        cfg = RunConfig(model=str(self.model), rollout_addresses=[f"127.0.0.1:{self.services['rollout'].port}"],
                        num_steps=10**6, run_dir=str(self.run_dir), prompts_per_step=8, group_size=4,
                        eval_prompts=16, eval_every=10, save_every=2, keep_checkpoints=3, seed=self.args.seed,
                        resume=resume)
        return to_proto(cfg)

    def trainer_call(self, method: str, request, timeout: float = 30):
        from forkrl.remote.channel import grpc_channel
        from forkrl.wire.trainer.v1 import trainer_pb2_grpc

        with grpc_channel(f"127.0.0.1:{self.services['trainer'].port}") as ch:
            return getattr(trainer_pb2_grpc.TrainerServiceStub(ch), method)(request, timeout=timeout)

    def ensure_run(self) -> None:
        """StartRun (resume after the first) whenever the trainer serves and the run is not running."""
        import grpc

        from forkrl.wire.trainer.v1 import trainer_pb2 as pb

        if self.run_done or self.services["trainer"].pid is None or self.now() < self.resume_at:
            return
        try:
            if self.run_id:
                run = self.trainer_call("GetRun", pb.GetRunRequest(run_id=self.run_id), 10)
                if run.state in (pb.RUN_STATE_STARTING, pb.RUN_STATE_RUNNING, pb.RUN_STATE_STOPPING):
                    return
                if run.error and not self.ended_seen:  # each failure once
                    self.ended_seen = True
                    self.run_errors.append(run.error)
                    print(f"[soak] t={self.now():.0f} s: the run ended {pb.RunState.Name(run.state)}: "
                          f"{run.error[:300]}", flush=True)
                if run.state == pb.RUN_STATE_FAILED and not self.backing_off:  # e.g. a full disk: not in a tight loop
                    self.backing_off, self.resume_at = True, self.now() + 3
                    return
            self.backing_off = False
            resume = (self.run_dir / "run_id").exists()
            self.run_id = self.trainer_call("StartRun", pb.StartRunRequest(config=self.config(resume)), 60).run_id
            self.ended_seen = False
            self.monitor.note(f"StartRun(resume={resume}) -> {self.run_id}")
        except grpc.RpcError as e:
            if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                self.monitor.note(f"StartRun/GetRun: {e.code().name}: {e.details()}")
                self.resume_at = self.now() + 5  # e.g. resuming while the disk is full: try again later
            if e.code() == grpc.StatusCode.NOT_FOUND:
                self.run_id = ""

    # -- supervision
    def supervise(self) -> None:
        for svc in self.services.values():
            with svc.lock:
                if svc.held:
                    continue
                gone = svc.reap(self.t0)
                if gone is not None:
                    self.monitor.note(f"{svc.name} #{gone.n} exited with {gone.exit_code}; restarted")
                    svc.start(self.t0)
        self.ensure_run()
        self.monitor.poll(self.services)

    def probe_jobs(self) -> None:
        """A small probe job against the run's latest checkpoint, about once a minute."""
        import httpx

        from forkrl.remote.channel import http_headers
        from forkrl.weights.checkpoint import list_checkpoints

        if self.now() < getattr(self, "next_probe", 0) or self.services["probe"].pid is None:
            return
        self.next_probe = self.now() + 60
        saved = list_checkpoints(self.run_dir)
        if not saved:
            return
        body = {"checkpoint_root": str(self.run_dir / "checkpoints"), "sampler": "transformers",
                "steps": [saved[-1][0]], "num_prompts": 4, "group_size": 4, "entropy_bins": 3,
                "max_positions_per_group": 4, "max_positions_per_trajectory": 2, "modules": ["lm_head"]}
        with contextlib.suppress(httpx.HTTPError):
            r = httpx.post(f"http://127.0.0.1:{self.services['probe'].port}/probe", json=body, timeout=10,
                           headers=http_headers())
            if r.status_code == 202:
                self.monitor.probe_ids.append(r.json()["id"])

    # -- faults
    def lane(self, name: str, plan: list[tuple[float, str, float]]) -> None:
        for i, (at, kind, param) in enumerate(plan):
            while not self.stop_faults.is_set() and self.now() < self.fault_t0 + at:
                time.sleep(0.2)
            if self.stop_faults.is_set():  # the lane fell behind its schedule: said, counted
                for _, late, _ in plan[i:]:
                    self.faults.append(Fault(late, self.now(), name, "not reached: the lane was behind its schedule"))
                return
            try:
                self.inject(kind, param)
            except Exception as e:  # a fault that could not be applied is reported, never fatal
                self.faults.append(Fault(kind, self.now(), "", f"not applied: {e!r}"[:200]))

    def inject(self, kind: str, param: float) -> None:
        verb, _, target = kind.partition("_")
        if kind == "kill_push":
            self.kill_in_push(param)
        elif kind == "kill_checkpoint":
            self.kill_in_checkpoint()
        elif kind == "disk_full":
            self.fill_disk()
        elif not self.wait_alive(self.services[target]):
            self.faults.append(Fault(kind, self.now(), target, "missed: the service was not running for 60 s"))
        elif verb == "stop":
            svc = self.services[target]
            with svc.lock:
                svc.held = True
                pid = self.fault_signal(svc, signal.SIGSTOP)
            t = self.now()
            self.faults.append(Fault(kind, t, target, f"pid {pid} stopped {param:.0f} s"))
            time.sleep(param)
            with svc.lock:
                svc.signal(signal.SIGCONT)
                svc.held = False
        else:
            svc = self.services[target]
            sig = signal.SIGKILL if verb == "kill" else signal.SIGTERM
            with svc.lock:
                svc.held = True
                pid = self.fault_signal(svc, sig)
            self.faults.append(Fault(kind, self.now(), target, f"pid {pid}"))
            deadline = time.monotonic() + 90
            while svc.pid is not None and time.monotonic() < deadline:
                time.sleep(0.1)
            if svc.pid is not None:
                svc.signal(signal.SIGKILL)
                self.faults[-1].detail += "; still running 90 s after SIGTERM: SIGKILL"
            with svc.lock:
                svc.held = False  # the supervisor restarts it

    def wait_alive(self, svc: Service) -> bool:
        """Whether the service runs (within 60 s): a fault that finds it down (killed a moment ago) hits the next
        life, at its start or resume (a kill in a resume, twice in a row), rather than nothing."""
        deadline = time.monotonic() + 60
        while svc.pid is None or svc.held:
            if time.monotonic() > deadline or self.stop_faults.is_set():
                return False
            time.sleep(0.05)
        return True

    def fault_signal(self, svc: Service, sig: int) -> int | None:
        """Read the metrics lines written so far (they are not the fault's recovery), then signal."""
        self.monitor.read_metrics()
        return svc.signal(sig)

    def kill_in_push(self, draw: float) -> None:
        target = "trainer" if draw * 1000 % 2 < 1 else "rollout"
        svc, log = self.services[target], self.services["rollout"].log
        with open(log, "rb") as f:
            f.seek(0, os.SEEK_END)  # only lines written from now on
            tail = b""
            deadline = time.monotonic() + WINDOW_S
            while time.monotonic() < deadline and not self.stop_faults.is_set():
                tail = (tail + f.read())[-4096:]
                found = IN_PLACE.findall(tail)
                if found:
                    with svc.lock:
                        svc.held = True
                        pid = self.fault_signal(svc, signal.SIGKILL)
                    recorded = self.monitor.last_step_on_disk()
                    self.faults.append(Fault("kill_push", self.now(), target,
                                             f"pid {pid} at v{int(found[-1])} in place; metrics at step {recorded}"))
                    time.sleep(0.5)
                    with svc.lock:
                        svc.held = False
                    return
                time.sleep(0.003)
        self.faults.append(Fault("kill_push", self.now(), target,
                                 f"missed: no push in {WINDOW_S:.0f} s (the run was not stepping)"))

    def kill_in_checkpoint(self) -> None:
        svc, root = self.services["trainer"], self.run_dir / "checkpoints"
        deadline = time.monotonic() + WINDOW_S
        while time.monotonic() < deadline and not self.stop_faults.is_set():
            with contextlib.suppress(OSError):
                tmp = [p.name for p in os.scandir(root) if p.name.startswith(".tmp-")]
                if tmp:
                    with svc.lock:
                        svc.held = True
                        pid = self.fault_signal(svc, signal.SIGKILL)
                    self.faults.append(Fault("kill_checkpoint", self.now(), "trainer", f"pid {pid} writing {tmp[0]}"))
                    time.sleep(0.5)
                    with svc.lock:
                        svc.held = False
                    return
            time.sleep(0.001)
        self.faults.append(Fault("kill_checkpoint", self.now(), "trainer",
                                 f"missed: no checkpoint write in {WINDOW_S:.0f} s (the run was not stepping)"))

    def fill_disk(self) -> None:
        if not self.tmpfs:
            self.faults.append(Fault("disk_full", self.now(), "trainer", "skipped: no tmpfs (needs root)"))
            return
        self.monitor.read_metrics()
        ballast = self.runs / "ballast"
        errors = len(self.run_errors)
        t = self.now()
        with open(ballast, "wb") as f, contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()
        with contextlib.suppress(OSError):  # the last partial MiB
            with open(ballast, "ab") as f:
                while True:
                    f.write(b"\0" * 4096)
                    f.flush()
        deadline = time.monotonic() + FULL_S
        while time.monotonic() < deadline and len(self.run_errors) == errors and not self.stop_faults.is_set():
            time.sleep(0.2)
        ballast.unlink()
        why = self.run_errors[-1][:160] if len(self.run_errors) > errors else f"the run wrote nothing in {FULL_S:.0f} s"
        self.faults.append(Fault("disk_full", t, "trainer", f"full {self.now() - t:.0f} s; {why}"))

    # -- the whole soak
    def run(self) -> int:
        self.setup()
        for svc in self.services.values():
            svc.start(self.t0)
        print(f"[soak] out {self.out}; services on ports "
              + ", ".join(f"{s.name} {s.port}" for s in self.services.values()), flush=True)
        try:
            while self.monitor.last_step_on_disk() < 1:
                self.supervise()
                time.sleep(0.5)
                if self.now() > 900:
                    print("[soak] no step after 900 s; see the logs under", self.out / "logs", flush=True)
                    return 2
            end = self.now() + self.args.minutes * 60  # the faults' minutes count from the first step
            self.fault_t0 = self.now() + WARMUP_S
            plan = schedule(self.args.minutes, end - QUIET_S - self.fault_t0, self.args.seed, self.args.kinds,
                            self.args.per_hour)
            planned = {k: sum(1 for _, kk, _ in plan if kk == k) for k in self.args.kinds}
            print(f"[soak] t={self.now():.0f} s: first step; {len(plan)} faults planned: {planned}", flush=True)
            lanes = [threading.Thread(target=self.lane, args=(n, [p for p in plan if p[1] in kinds]), daemon=True)
                     for n, kinds in LANES.items()]
            for th in lanes:
                th.start()
            while self.now() < end:
                self.supervise()
                self.probe_jobs()
                time.sleep(0.3)
            self.stop_faults.set()
            for th in lanes:
                th.join(timeout=240)
            if self.args.quiet_minutes:
                self.monitor.note(f"faults over; {self.args.quiet_minutes:g} quiet minutes (the growth check)")
            quiet_end = self.now() + self.args.quiet_minutes * 60
            while self.now() < quiet_end:
                self.supervise()
                self.probe_jobs()
                time.sleep(0.3)
            self.settle()
        finally:
            self.stop_faults.set()
            self.shutdown()
        results = check_all(self)
        print_table(results, self)
        (self.out / "soak.json").write_text(json.dumps({"results": [r.__dict__ for r in results],
                                                        "faults": [f.__dict__ for f in self.faults],
                                                        "probe_jobs": getattr(self, "probe_states", {}),
                                                        "notes": self.monitor.notes,
                                                        "samples": {n: [{"life": x.n, "t_rss_fds_threads": x.samples}
                                                                        for x in svc.lives]
                                                                    for n, svc in self.services.items()}}))
        return 0 if all(r.ok for r in results) else 1

    def settle(self) -> None:
        """After the last fault: every service up, the run steps again, then StopRun and wait for its end."""
        from forkrl.wire.trainer.v1 import trainer_pb2 as pb

        before = self.monitor.last_step_on_disk()
        deadline = self.now() + 600
        while self.now() < deadline and self.monitor.last_step_on_disk() <= before + 1:
            self.supervise()
            time.sleep(0.3)
        self.run_done = True
        with contextlib.suppress(Exception):
            self.trainer_call("StopRun", pb.StopRunRequest(run_id=self.run_id))
            while self.now() < deadline:
                if self.trainer_call("GetRun", pb.GetRunRequest(run_id=self.run_id), 10).state not in (
                        pb.RUN_STATE_STARTING, pb.RUN_STATE_RUNNING, pb.RUN_STATE_STOPPING):
                    break
                time.sleep(0.5)
        self.monitor.poll(self.services, force=True)
        self.final_info = self.rollout_info()
        self.probe_states = self.monitor.probe_states(self.services["probe"].port, self.now() + 300)

    def rollout_info(self):
        from forkrl.remote.rollout import RolloutClient

        try:
            with RolloutClient(f"127.0.0.1:{self.services['rollout'].port}") as c:
                return c.info()
        except Exception as e:  # reported by the check
            return e

    def shutdown(self) -> None:
        """SIGTERM every service (dependents first), wait; what is left counts as an orphan (then killed)."""
        for name in ("probe", "trainer", "rollout"):
            svc = self.services.get(name) if hasattr(self, "services") else None
            if svc is None:
                continue
            with svc.lock:
                svc.held = True
                svc.signal(signal.SIGCONT)
                pid = svc.signal(signal.SIGTERM)
            if pid is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    svc.current.proc.wait(90)
            svc.reap(self.t0)
        time.sleep(5)
        from soak_stack import marked

        self.orphans = marked(self.soak_id) if hasattr(self, "soak_id") else []
        for pid, _ in self.orphans:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for svc in getattr(self, "services", {}).values():
            for life in svc.lives:
                killpg(life.proc.pid, signal.SIGKILL)
        if self.tmpfs:
            keep = self.out / "runs_copy"
            shutil.copytree(self.runs, keep, dirs_exist_ok=True)
            subprocess.run(["umount", str(self.runs)], check=False)
            shutil.rmtree(self.runs, ignore_errors=True)
            keep.rename(self.runs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/soak.py", description=__doc__.split("\n\n")[0],
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=60.0, help="how long the faults go on (default 60)")
    p.add_argument("--seed", type=int, default=1, help="the fault schedule's and the run's seed (default 1)")
    p.add_argument("--faults", default=",".join(KINDS), help="comma list of fault kinds (default: all)")
    p.add_argument("--per-hour", type=float, default=PER_HOUR, help=f"faults of each kind an hour ({PER_HOUR})")
    p.add_argument("--quiet-minutes", type=float, default=None,
                   help="minutes of training without faults after them, so that each service lives long enough for "
                        "the growth check (default: 15 when --minutes >= 60, else 0)")
    p.add_argument("--out", default="/tmp/forkrl-soak", help="where the run, logs and soak.json go")
    args = p.parse_args(argv)
    if args.quiet_minutes is None:
        args.quiet_minutes = 15.0 if args.minutes >= 60 else 0.0
    args.kinds = [k.strip() for k in args.faults.split(",") if k.strip()]
    bad = sorted(set(args.kinds) - set(KINDS))
    if bad:
        p.error(f"--faults: unknown kind(s) {', '.join(bad)}; known: {', '.join(KINDS)}")
    _ = usage, MARKER, Service
    return Soak(args).run()


if __name__ == "__main__":
    sys.exit(main())
