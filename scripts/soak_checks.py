"""What a soak (scripts/soak.py) watches while it runs and checks at the end, and its table.

Checks (each a row; the soak exits 1 when any fails):
  steps (metrics.jsonl)   the train lines are steps 1..N, each exactly once
  steps (logger)          TensorBoard's train/policy_version scalar (as a reader sees it): steps 1..N, each once
  checkpoints             every step_* dir is complete (trainer_state.json, model.safetensors loads with safetensors,
                          every tensor finite, trainer_state step = the name's) or absent; no final/ half-written
  served version          GetInfo on the rollout at the end = the policy_version of the trainer's last push
  orphans                 no process carrying the soak's marker is alive 5 s after the SIGTERM of every service
  growth <service>        per incarnation that lived >= GROWTH_MIN_S after its warm-up (WARMUP_S or 20 % of its
                          life): RSS slope <= 5 %/h of its mean (least squares over the samples), open fds and
                          threads: last-minute median - first-minute median <= FD_SLACK / THREAD_SLACK. Shorter
                          lives are listed, not judged: a slope over minutes extrapolated to an hour is noise.
  probe jobs              every job submitted is done, or failed with an error
  faults                  no fault failed to apply (an error); applied per kind; those that found no window
                          (missed: no push / checkpoint in WINDOW_S), were not reached (their lane behind its
                          schedule at the end) or skipped (disk_full without root) are counted, not failed
and, not judged, the cost of each fault: from the fault to the first train line written after it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WARMUP_S = 120.0
GROWTH_MIN_S = 480.0
RSS_PCT_PER_H = 5.0
# gRPC channels, log and metrics files open and close with connections and steps; a leak of one per step or per
# fault passes these within minutes
FD_SLACK, THREAD_SLACK = 16, 8


@dataclass
class Fault:
    kind: str
    t: float
    target: str
    detail: str
    cost_s: float | None = None


@dataclass
class Result:
    name: str
    ok: bool
    detail: str


class Monitor:
    """Tails metrics.jsonl (the time each train line was first seen) and samples the services' resources."""

    def __init__(self, run_dir: Path, t0: float) -> None:
        self.run_dir, self.t0 = run_dir, t0
        self.seen: dict[int, float] = {}  # step -> when a train line of it was first seen (the latest write)
        self.writes: list[tuple[float, int]] = []  # (t, step) every time a new train line appeared
        self.offset = 0
        self.lock = threading.Lock()
        self.next_sample = 0.0
        self.notes: list[str] = []
        self.probe_ids: list[str] = []

    def note(self, text: str) -> None:
        t = time.monotonic() - self.t0
        self.notes.append(f"t={t:.0f} s {text}")
        print(f"[soak] t={t:.0f} s: {text}", flush=True)

    def last_step_on_disk(self) -> int:
        self.read_metrics()
        return max((s for _, s in self.writes), default=0)

    def read_metrics(self) -> None:
        """Read the train lines appended since the last call (incremental: metrics.jsonl grows by MiBs an hour); a
        file that shrank (a resume dropped lines) is read again from the start. Called by the fault lanes just before
        each signal, so that a line written before a fault is never taken for the first line after it."""
        path = self.run_dir / "metrics.jsonl"
        with self.lock, contextlib.suppress(OSError), open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < self.offset:
                self.offset = 0
                self.writes.append((time.monotonic() - self.t0, 0))
            f.seek(self.offset)
            data = f.read(size - self.offset)
            whole = data[:data.rfind(b"\n") + 1]
            self.offset += len(whole)
            t = time.monotonic() - self.t0
            for ln in whole.splitlines():
                with contextlib.suppress(ValueError):
                    m = json.loads(ln)
                    if m.get("kind") == "train":
                        self.writes.append((t, int(m["step"])))

    def poll(self, services: dict, force: bool = False) -> None:
        from soak_stack import usage

        self.read_metrics()
        now = time.monotonic() - self.t0
        if now < self.next_sample and not force:
            return
        self.next_sample = now + 5
        for svc in services.values():
            life = svc.current
            if life is not None and life.ended is None and svc.pid is not None:
                u = usage(svc.pid)
                if u is not None:
                    life.samples.append((now, *u))

    def probe_states(self, port: int, deadline: float) -> dict[str, dict]:
        """Each submitted job's final status (waits for queued/running ones until `deadline`)."""
        import httpx

        from forkrl.remote.channel import http_headers

        states: dict[str, dict] = {}
        while True:
            with contextlib.suppress(httpx.HTTPError, ValueError):
                for jid in self.probe_ids:
                    r = httpx.get(f"http://127.0.0.1:{port}/probe/{jid}", timeout=10, headers=http_headers())
                    states[jid] = r.json() if r.status_code == 200 else {"state": f"HTTP {r.status_code}"}
            if all(s.get("state") in ("done", "failed", "cancelled") for s in states.values()) and \
                    len(states) == len(self.probe_ids):
                return states
            if time.monotonic() - self.t0 > deadline:
                return states
            time.sleep(2)


def _once(steps: list[int]) -> tuple[bool, str]:
    n = max(steps, default=0)
    dup = sorted({s for s in steps if steps.count(s) > 1})
    missing = sorted(set(range(1, n + 1)) - set(steps))
    ok = n > 0 and not dup and not missing
    return ok, f"N={n}, {len(steps)} lines" + (f"; duplicated {dup[:10]}" if dup else "") + \
        (f"; missing {missing[:10]}" if missing else "")


def check_steps(run_dir: Path) -> list[Result]:
    lines = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    train = [int(m["step"]) for m in lines if m["kind"] == "train"]
    out = [Result("steps (metrics.jsonl)", *_once(train))]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    tb = [e.step for e in acc.Scalars("train/policy_version")] if "train/policy_version" in acc.Tags()["scalars"] \
        else []
    ok, detail = _once(tb)
    same = max(tb, default=0) == max(train, default=0)
    out.append(Result("steps (logger: TensorBoard)", ok and same,
                      detail + ("" if same else f"; metrics.jsonl ends at {max(train, default=0)}")))
    return out


def check_checkpoints(run_dir: Path) -> Result:
    import torch
    from safetensors.torch import load_file

    bad, good = [], []
    root = run_dir / "checkpoints"
    for d in sorted(root.iterdir()) if root.is_dir() else []:
        if d.name.startswith("."):
            continue  # debris of a killed writer (.tmp-*/.old-*): never looks whole; the next save clears it
        try:
            state = json.loads((d / "trainer_state.json").read_text())
            tensors = load_file(str(d / "model.safetensors"))
            nonfinite = [k for k, v in tensors.items() if not torch.isfinite(v).all()]
            if nonfinite:
                raise ValueError(f"non-finite {nonfinite[:3]}")
            if d.name != "final" and int(d.name.split("_")[1]) != state["step"]:
                raise ValueError(f"trainer_state step {state['step']}")
            load_file(str(d / "trainer_state" / "optimizer.safetensors"))
            good.append(d.name)
        except Exception as e:  # noqa: BLE001  (any failure to load is the finding)
            bad.append(f"{d.name}: {e!r}"[:160])
    debris = [p.name for p in root.glob(".*")] if root.is_dir() else []
    return Result("checkpoints", not bad and bool(good),
                  f"{len(good)} complete {good}" + (f"; CORRUPT {bad}" if bad else "") +
                  (f"; debris {debris}" if debris else ""))


def check_growth(name: str, lives: list) -> Result:
    judged, lines, ok = 0, [], True
    for life in lives:
        end = life.ended if life.ended is not None else (life.samples[-1][0] if life.samples else life.started)
        warm = life.started + max(WARMUP_S, 0.2 * (end - life.started))
        s = [x for x in life.samples if x[0] >= warm]
        if not s or s[-1][0] - s[0][0] < GROWTH_MIN_S:
            continue
        judged += 1
        ts = [x[0] for x in s]
        rss = [x[1] for x in s]
        tm, rm = statistics.fmean(ts), statistics.fmean(rss)
        slope = sum((t - tm) * (r - rm) for t, r in zip(ts, rss, strict=True)) / sum((t - tm) ** 2 for t in ts)
        pct_h = slope * 3600 / rm * 100
        first = [x for x in s if x[0] <= s[0][0] + 60]
        last = [x for x in s if x[0] >= s[-1][0] - 60]
        dfd = statistics.median(x[2] for x in last) - statistics.median(x[2] for x in first)
        dth = statistics.median(x[3] for x in last) - statistics.median(x[3] for x in first)
        life_ok = pct_h <= RSS_PCT_PER_H and dfd <= FD_SLACK and dth <= THREAD_SLACK
        ok &= life_ok
        lines.append(f"#{life.n} {s[-1][0] - s[0][0]:.0f} s: RSS {rm / 2**20:.0f} MiB {pct_h:+.1f} %/h, fds "
                     f"{dfd:+.0f}, threads {dth:+.0f}{'' if life_ok else ' FAIL'}")
    peak = max((x[1] for life in lives for x in life.samples), default=0)
    short = len(lives) - judged
    detail = f"{len(lives)} lives, peak RSS {peak / 2**20:.0f} MiB; " + ("; ".join(lines) if lines else "none judged")
    return Result(f"growth {name}", ok, detail + (f"; {short} lives under {GROWTH_MIN_S:.0f} s after warm-up not judged"
                                                   if short else ""))


def fault_costs(faults: list[Fault], writes: list[tuple[float, int]]) -> None:
    for f in faults:
        after = [t for t, s in writes if t > f.t and s > 0]
        f.cost_s = (after[0] - f.t) if after else None


def check_all(soak: Any) -> list[Result]:
    res = []
    try:
        res += check_steps(soak.run_dir)
    except Exception as e:  # noqa: BLE001
        res.append(Result("steps", False, f"could not read: {e!r}"))
    res.append(check_checkpoints(soak.run_dir))
    lines = [json.loads(ln) for ln in (soak.run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    pushed = [int(m["policy_version"]) for m in lines if m["kind"] == "train" and "policy_version" in m]
    info = getattr(soak, "final_info", None)
    served = getattr(info, "version", None)
    res.append(Result("served version", bool(pushed) and served == pushed[-1],
                      f"rollout serves {served if served is not None else info!r}, the last push "
                      f"{pushed[-1] if pushed else None}"))
    orphans = getattr(soak, "orphans", [])
    res.append(Result("orphans", not orphans, f"{len(orphans)} left: {orphans[:5]}" if orphans else "none"))
    for name, svc in soak.services.items():
        res.append(check_growth(name, svc.lives))
    states = getattr(soak, "probe_states", {})
    unfinished = {j: s.get("state") for j, s in states.items() if s.get("state") not in ("done", "failed")}
    reasonless = [j for j, s in states.items() if s.get("state") == "failed" and not s.get("error")]
    counts = {k: sum(1 for s in states.values() if s.get("state") == k) for k in ("done", "failed")}
    res.append(Result("probe jobs", not unfinished and not reasonless and len(states) == len(soak.monitor.probe_ids),
                      f"{len(soak.monitor.probe_ids)} submitted, {counts}" +
                      (f"; not finished {unfinished}" if unfinished else "") +
                      (f"; failed without a reason {reasonless}" if reasonless else "") +
                      "".join(f"; failed: {r[:90]!r} x{n}" for r, n in _reasons(states).items())))
    fault_costs(soak.faults, soak.monitor.writes)
    broken = [f for f in soak.faults if f.detail.startswith("not applied")]
    idle = [f for f in soak.faults if f.detail.startswith(("missed", "not reached", "skipped"))]
    by_kind: dict[str, int] = {}
    for f in soak.faults:
        if f not in idle and f not in broken:
            by_kind[f.kind] = by_kind.get(f.kind, 0) + 1
    res.append(Result("faults", not broken, f"{sum(by_kind.values())} applied {by_kind}" +
                      (f"; {len(idle)} missed/not reached/skipped (listed above)" if idle else "") +
                      (f"; NOT APPLIED (an error) {[(f.kind, f.detail) for f in broken][:5]}" if broken else "")))
    return res


def _reasons(states: dict[str, dict]) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in states.values():
        if s.get("state") == "failed" and s.get("error"):
            out[s["error"]] = out.get(s["error"], 0) + 1
    return out


def print_table(results: list[Result], soak: Any) -> None:
    print("\nfaults (t = seconds after the start; cost = to the next train line written):")
    print(f"  {'t':>7}  {'kind':<16} {'cost':>8}  detail")
    for f in soak.faults:
        cost = f"{f.cost_s:.1f} s" if f.cost_s is not None else "-"
        print(f"  {f.t:7.1f}  {f.kind:<16} {cost:>8}  {f.detail[:110]}")
    costs = {}
    for f in soak.faults:
        if f.cost_s is not None:
            costs.setdefault(f.kind, []).append(f.cost_s)
    print("\ncost per kind (median / max s): " + ", ".join(
        f"{k} {statistics.median(v):.0f}/{max(v):.0f}" for k, v in sorted(costs.items())))
    width = max(len(r.name) for r in results)
    print(f"\n{'check':<{width}}  result  detail")
    for r in results:
        print(f"{r.name:<{width}}  {'ok' if r.ok else 'FAIL':<6}  {r.detail}")
    print(f"\n{'PASS' if all(r.ok for r in results) else 'FAIL'}: seed {soak.args.seed}, {soak.args.minutes:g} min, "
          f"{len(soak.faults)} faults; run errors seen {len(soak.run_errors)}; out {soak.out}", flush=True)
    _ = math
