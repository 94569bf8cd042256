"""The training loop of one run: rollouts → rewards → advantages → mask + loss → AdamW → weight push.

    run_training(run, device="auto", tensorboard=True)   # `run`: anything with the RunHandle attributes

The trainer service calls it in the run's own thread with the config already resolved by preflight(). Every
step emits one metrics item (run.emit → WatchRun), one line of `metrics.jsonl` and TensorBoard scalars; checkpoints
are written atomically after a free-space check, keep_checkpoints of them kept (forkrl/weights/retention.py). Each
evaluation also records a few eval responses token by token for the report (<run_dir>/report.html).

Determinism: the data order is a seeded permutation walked by a cursor (forkrl/data/order.py), the sampling
seed of step s is derived from (seed, s) and the rollout service derives each sample's seed from it. With the
same weights served, a resumed run therefore sees the same trajectories as an uninterrupted one.

Faults: with several rollout services, one that fails (UNAVAILABLE, a deadline, a broken stream) is taken out of
the pool and the step goes on with the others: its groups are sampled again there, and it is let back in once it
answers and holds the current weights (forkrl/training/pool.py). A fault no other service can stand in for (the last
one in the pool, or one service only), or a batch holding a trajectory not sampled by the policy the trainer pushed
(a restarted service serves its initial weights again): wait up to `rollout_wait_s` for health SERVING, push the
current weights again to the services that lost them and redo the operation (same prompts, same seeds;
forkrl/training/recovery.py); `foreign_batches` counts such batches. A run
that fails anyway first writes a checkpoint of its last trained step, so `--resume` loses nothing but the step in
progress. The run's id (kept in <run_dir>/run_id; a resume keeps it) holds the rollout lease; it is released at the end.

Guards (nothing silently wrong): a step's update skipped for a non-finite loss or gradient norm is logged as a
LOG event naming the tensor (forkrl/rl/step.py); after cfg.max_bad_steps consecutive steps with every update
skipped the run fails, its last good checkpoint kept. Weights are checked finite before every push and
checkpoint (forkrl/training/policy.py): non-finite weights fail the run with a sentence naming the step, and are
neither pushed nor saved, also not by the failure's checkpoint.

Stops: StopRun sets `stop_requested`; the sampling reads it before every Generate call, the train step before
every micro-batch (an update in progress is abandoned; a step with no applied update is not trained). The run
then writes a checkpoint of its last trained step (unless already saved) and ends STOPPED.

Async (cfg.max_staleness = k >= 1, forkrl/training/pipeline.py): the batches of the next steps are sampled on a
second thread, at most k steps ahead, while this one trains; each batch is checked against the staleness rule
(trainer version − the trajectory's version <= k) and dropped if it breaks it. Checkpoints store the data
cursor of the last trained batch. With k = 0 the loop below is the sync loop, unchanged.
"""

from __future__ import annotations

import copy
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from forkrl.data.datasets import Fields, load_eval_sets, load_problems
from forkrl.data.order import DataOrder
from forkrl.data.prompts import PromptEncoder, run_reward_fn
from forkrl.data.rewards import RewardFn
from forkrl.data.tasks import Problem
from forkrl.report.record import EvalRecorder
from forkrl.rl.step import StepStopped
from forkrl.training.config import RunConfig
from forkrl.training.metrics import MetricsSink, per_set_means
from forkrl.training.pipeline import AheadCollector, staleness
from forkrl.training.policy import NonFiniteWeights, Policy, load_policy
from forkrl.training.ranks import RankLink, UpdatePayload
from forkrl.training.recovery import ForeignBatch, Recovery
from forkrl.training.rollouts import PolicyWeights, Rollouts
from forkrl.training.scoring import SamplingStopped, ScoredBatch, collect_batch, evaluate
from forkrl.weights.checkpoint import checkpoint_name, latest_checkpoint

TRAIN_POOL = 20000  # built-in task: size of the train pool the data order walks through
log = logging.getLogger("forkrl.training")


class Diverged(RuntimeError):
    """The run failed a guard: non-finite weights, or max_bad_steps steps in a row with every update skipped."""


def _stopped_by(e: BaseException | None) -> bool:
    """Whether `e` (or what caused it: the async sampler's error is wrapped) is a stop of the sampling or the step."""
    while e is not None:
        if isinstance(e, StepStopped | SamplingStopped):
            return True
        e = e.__cause__
    return False


class RunHandle(Protocol):
    """What the loop needs from the run that owns it (trainer_service/runs.py: Run)."""

    run_id: str
    run_dir: Path
    config: RunConfig  # resolved (preflight) config
    start_step: int
    step: int
    stop_requested: threading.Event  # set: stop within a micro-batch or a Generate call, checkpoint, return

    def emit(self, item: dict[str, Any]) -> None: ...

    def event(self, kind: str, message: str = "", step: int | None = None, values: dict | None = None,
              path: str = "") -> None: ...


def run_training(run: RunHandle, *, device: str = "auto", tensorboard: bool = True,
                 token: str | None = None, link: RankLink | None = None, rollout_wait_s: float = 300.0,
                 threads: int | str = "auto") -> None:
    """Run `run.config` to its end. `token`: the bearer token sent to the rollout services (None: from the
    environment). `link`: the other ranks of a multi-rank trainer (forkrl/training/ranks.py); None or a
    1-process link: this process alone. `rollout_wait_s`: after a rollout fault, how long to wait for the
    services to be SERVING again before the run fails. `threads`: torch threads of the run (forkrl/runtime.py
    `train_threads`)."""
    link = link or RankLink()
    cfg, run_dir = run.config, run.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(cfg.model_dump(), indent=2, sort_keys=True))
    link.tell("start", cfg, str(run_dir))
    try:
        _run(run, cfg, run_dir, device, tensorboard, link, token, rollout_wait_s, threads)
    finally:
        link.tell("end")


def lease_id(run_dir: Path, run_id: str, resume: bool) -> str:
    """The run's id, which also holds the rollout lease, written to <run_dir>/run_id: a resume finds it there and
    keeps it (trainer_service/runs.py: RunManager.start gives a resumed run the id of the run it continues), so
    one id names the run across resumes. (`resume` is not needed any more; the call site keeps passing it.)"""
    f = run_dir / "run_id"
    if not (f.is_file() and f.read_text().strip() == run_id):
        f.write_text(run_id + "\n")
    return run_id


def _run(run: RunHandle, cfg: RunConfig, run_dir: Path, device: str, tensorboard: bool, link: RankLink,
         token: str | None, rollout_wait_s: float, threads: int | str) -> None:
    policy = load_policy(cfg, run_dir, device, threads)
    run.start_step = run.step = policy.start_step
    rid = lease_id(run_dir, run.run_id, cfg.resume)
    sink = MetricsSink.for_run(run_dir, cfg, rid, tensorboard, policy.start_step if policy.resumed else None)
    if policy.resumed:
        sink.drop_after(policy.start_step)  # lines of steps after the checkpoint: those steps run again
    # a dataset: every train problem, read lazily (forkrl/data/datasets.py); a task: a generated pool
    fields = Fields(cfg.prompt_field, cfg.answer_field)
    train_problems = load_problems(cfg.task or None, cfg.dataset or None, "train",
                                   None if cfg.dataset else TRAIN_POOL, cfg.seed, fields)
    eval_sets = load_eval_sets(cfg.task or None, cfg.dataset or None, cfg.eval_dataset, cfg.eval_prompts, cfg.seed,
                               fields)
    # the trainer formats and tokenizes; the rollout service samples from exactly these ids (forkrl/data/prompts.py)
    encoder = PromptEncoder(copy.deepcopy(policy.tokenizer), cfg.prompt_format, cfg.system_prompt)  # own copy
    s = _Session(run, cfg, policy, DataOrder(train_problems, cfg.seed, policy.data_cursor),
                 run_reward_fn(cfg.reward, cfg.prompt_format), sink,
                 Rollouts(cfg.rollout_addresses, token, rid), [p for _, ps in eval_sets for p in ps],
                 link, wait_s=rollout_wait_s, trained_step=policy.start_step, saved_step=policy.start_step,
                 trained_cursor_at=policy.data_cursor, encode=encoder.encode,
                 eval_sets=[(name, len(ps)) for name, ps in eval_sets],
                 recorder=EvalRecorder(run_dir, cfg, policy, link))  # the run report's eval samples
    try:
        _steps(s)
    except NonFiniteWeights as e:  # never pushed, never saved, also not by save_on_failure
        if s.pending is not None:
            s.report(*s.pending)
        raise Diverged(s.nonfinite_sentence(e)) from e
    except Exception:
        s.save_on_failure()
        raise
    finally:
        s.rollouts.release()  # the lease, for the next run
        s.rollouts.close()  # and the shared-memory weights file of --weight-sync auto/shm
        s.sink.close()
        if s.recorder is not None:
            s.recorder.refresh(run.event)  # report.html, whatever the outcome


def _steps(s: _Session) -> None:
    run, cfg, policy, link = s.run, s.cfg, s.policy, s.link
    loss_cfg = cfg.loss_config()
    run.event("LOG", f"waiting for rollout service(s) {', '.join(cfg.rollout_addresses)}")
    s.rollouts.wait_ready()
    s.version = s.rollouts.version()
    s.rollouts.adopt(s.version)
    # The rollout must serve our policy: on resume, or when it serves anything but our initial checkpoint, push it
    if policy.resumed or not s.rollouts.serve_initial(cfg.model):
        s.version += 1
        s.resilient("the first push", s.push_current)
    ranks = f" x {link.world_size} ranks (FSDP2)" if link.active else ""
    run.event("STARTED", f"run {run.run_id} on {policy.device}{ranks}: loss {cfg.loss}, entropy_top_frac "
              f"{cfg.entropy_top_frac}, {len(s.data.problems)} train / {len(s.eval_problems)} eval prompts, "
              f"from step {policy.start_step}", path=str(run.run_dir))
    step = policy.start_step
    if step == 0:
        s.evaluate(0)
    ahead = None
    start_cursor = s.data.cursor  # async: where the data stands before the first batch is taken
    if cfg.max_staleness > 0:
        ahead = AheadCollector(s.collect_ahead, step + 1, cfg.num_steps, cfg.max_staleness)
    try:
        while step < cfg.num_steps and not run.stop_requested.is_set():
            step += 1
            t_step = time.perf_counter()
            lr = policy.set_lr(step)
            if ahead is None:
                scored = s.resilient(f"sampling step {step}", lambda step=step: s.collect(step))
            else:
                scored, ahead = s.take_ahead(ahead, step, start_cursor)
            metrics = scored.metrics()
            metrics.update(time_generate_s=scored.time_generate_s, time_score_s=scored.time_score_s, lr=lr,
                           foreign_batches=float(s.foreign_batches), rollout_recoveries=float(s.recoveries),
                           **s.rollouts.pool_metrics())
            if ahead is not None:
                metrics.update(s.check_staleness(scored, step), time_wait_s=time.perf_counter() - t_step)
            if not scored.groups:
                run.event("LOG", "no group to train on (dynamic sampling or staleness); step skipped", step=step)
                s.report(step, metrics | {"policy_version": float(s.version),
                                          "time_step_s": time.perf_counter() - t_step})
                if ahead is not None:
                    ahead.done(step)
                continue
            t0 = time.perf_counter()
            link.tell("update", step, UpdatePayload.of(scored))  # the other ranks train on their shares
            skipped: list[str] = []
            metrics.update(policy.update(scored, loss_cfg, stop=run.stop_requested.is_set, skipped=skipped))
            s.trained(step, metrics)
            s.guard(step, metrics, skipped)  # events for skipped updates; fails after max_bad_steps in a row
            if metrics.get("stopped"):  # a stop cut the step short after some of its updates: it ends here
                break
            t_train = time.perf_counter() - t0
            if policy.device.type == "cuda":  # rank 0's peak since the process started (scripts/gpu_check.sh)
                import torch

                metrics["gpu_mem_peak_gib"] = torch.cuda.max_memory_allocated(policy.device) / 2**30
            s.version += 1
            t_push = s.resilient(f"the push after step {step}", s.push_current)  # served before the next step samples
            if ahead is not None:
                ahead.done(step)  # sampling may move on to step + 1 + max_staleness
            metrics.update(s.rollouts.last_swap)  # the rollout's drain + apply: how long generation stalled
            metrics.update(policy_version=float(s.version), time_train_s=t_train, time_push_s=t_push,
                           time_step_s=time.perf_counter() - t_step, data_cursor=float(s.trained_cursor),
                           tokens_per_s=scored.response_tokens / max(scored.time_generate_s, 1e-9))
            s.report(step, metrics)
            s.pending = None
            if cfg.save_every and step % cfg.save_every == 0:
                s.checkpoint(step, checkpoint_name(step))
            if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.num_steps:
                s.evaluate(step)
    except Exception as e:
        if not _stopped_by(e):
            raise
    finally:
        if ahead is not None:
            ahead.close(timeout_s=600)
    if run.stop_requested.is_set() and (s.trained_step < cfg.num_steps or s.pending is not None):
        s.end_stopped()
    else:
        s.checkpoint(step, "final")
        s.evaluate(step)


@dataclass
class _Session(Recovery):
    """The parts of a running run the loop's steps share; `version` is the policy version the rollout serves."""

    run: RunHandle
    cfg: RunConfig
    policy: Policy
    data: DataOrder
    reward_fn: RewardFn
    sink: MetricsSink
    rollouts: Rollouts
    eval_problems: list[Problem]
    link: RankLink
    version: int = 0
    cursor: int | None = None  # async: the data cursor after the last batch taken (the sampler draws ahead)
    stale_dropped: int = 0  # async: batches dropped for breaking the staleness bound
    wait_s: float = 300.0  # after a rollout fault: longest wait for health SERVING
    foreign_batches: int = 0  # batches sampled again because a trajectory came from another policy version
    recoveries: int = 0  # rollout faults recovered from (waited for health, pushed again, redid the operation)
    trained_step: int = 0  # the last step whose optimizer update is done
    trained_cursor_at: int = 0  # the data cursor of that step's batch
    saved_step: int = 0  # the step of the last checkpoint written
    pending: tuple[int, dict[str, float]] | None = None  # a trained step whose metrics are not written yet
    bad_steps: int = 0  # consecutive steps whose every update was skipped (non-finite loss or gradients)
    encode: Callable[[Any], list[list[int]]] | None = None  # problems -> prompt token ids (the prompt format)
    eval_sets: list[tuple[str, int]] | None = None  # (benchmark name, prompts) in eval_problems order
    recorder: EvalRecorder | None = None  # eval samples and report.html (forkrl/report)

    @property
    def trained_cursor(self) -> int:
        """Prompts drawn up to the batch last taken by the trainer (what a checkpoint must resume from)."""
        return self.data.cursor if self.cursor is None else self.cursor

    def collect_ahead(self, step: int) -> tuple[ScoredBatch, int]:
        """The sampler thread's job for `step` (async): its batch and the data cursor after it."""
        scored = collect_batch(self.rollouts, self.data, self.reward_fn, self.cfg, step, self.encode,
                               stop=self.run.stop_requested.is_set)
        return scored, self.data.cursor

    def check_staleness(self, scored: ScoredBatch, step: int) -> dict[str, float]:
        """Staleness metrics of a batch; a batch with a trajectory older than max_staleness versions is emptied
        (never trained on) and counted."""
        ages = staleness(self.version, scored.trajectories)
        out = {"staleness_max": float(max(ages, default=0)),
               "staleness_mean": sum(ages) / len(ages) if ages else 0.0}
        if ages and max(ages) > self.cfg.max_staleness:
            self.stale_dropped += 1
            self.run.event("LOG", f"batch {max(ages)} versions old > max_staleness {self.cfg.max_staleness}: "
                           "dropped", step=step)
            scored.groups, scored.problems = [], []
        out["stale_batches_dropped"] = float(self.stale_dropped)
        return out

    def collect(self, step: int) -> ScoredBatch:
        """The batch of `step` (sync); ForeignBatch when a trajectory is not of the pushed version. The data
        cursor is put back on any failure, so the step is sampled again from the same prompts."""
        cursor = self.data.cursor
        try:
            scored = collect_batch(self.rollouts, self.data, self.reward_fn, self.cfg, step,  # + dynamic sampling
                                   self.encode, stop=self.run.stop_requested.is_set)
            foreign = sum(t.policy_version != self.version for t in scored.trajectories)
            if foreign:
                self.foreign_batches += 1
                raise ForeignBatch(f"{foreign} of {len(scored.trajectories)} trajectories were not sampled by the "
                                   f"pushed policy version {self.version}")
            return scored
        except BaseException:
            self.data.cursor = cursor
            raise

    def trained(self, step: int, metrics: dict[str, float]) -> None:
        self.trained_step, self.trained_cursor_at, self.pending = step, self.trained_cursor, (step, metrics)

    def guard(self, step: int, metrics: dict[str, float], skipped: list[str]) -> None:
        """A LOG event per skipped update; after cfg.max_bad_steps consecutive steps whose every update was skipped,
        the run fails (Diverged) with the last trained step saved: its weights are the last good ones."""
        for why in skipped:
            self.run.event("LOG", f"step {step}: an update was skipped, no optimizer step: {why}", step=step)
        every = metrics.get("n_updates", 1.0) == 0 and metrics.get("skipped_updates", 0.0) > 0
        self.bad_steps = self.bad_steps + 1 if every else 0
        k = self.cfg.max_bad_steps
        if not (k and self.bad_steps >= k):
            return
        self.report(step, metrics)
        self.pending = None
        if self.trained_step > self.saved_step:
            self.checkpoint(self.trained_step, checkpoint_name(self.trained_step), self.trained_cursor_at)
        raise Diverged(f"{k} steps in a row ({step - k + 1} to {step}) skipped every update for a non-finite loss "
                       f"or gradient norm (the last: {skipped[-1] if skipped else '?'}); the weights are those "
                       f"after step {step - k}, and the last good checkpoint is {self.last_good()}")

    def last_good(self) -> str:
        ckpt = latest_checkpoint(self.run.run_dir)
        return str(ckpt) if ckpt is not None else f"none (the run started from {self.cfg.model or 'its model'})"

    def nonfinite_sentence(self, e: NonFiniteWeights) -> str:
        if self.trained_step == self.policy.start_step:  # no update yet: the weights were loaded that way
            return (f"the initial weights hold an inf or a NaN ({e.name}); they were not pushed or trained on; "
                    f"the last good checkpoint is {self.last_good()}")
        lr = self.policy.optimizer.param_groups[0]["lr"]
        wd = self.policy.optimizer.param_groups[0].get("weight_decay", 0.0)
        return (f"the weights became non-finite in the update of step {self.trained_step} (lr {lr:g}, weight decay "
                f"{wd:g}): {e.name} holds an inf or a NaN; they were not pushed or saved; the last good "
                f"checkpoint is {self.last_good()}")

    def end_stopped(self) -> None:
        """A stop: write the metrics of a step cut short, and a checkpoint of the last trained step unless it is
        saved (a new run stopped before its first update saves its step 0)."""
        if self.pending is not None:
            self.report(*self.pending)
            self.pending = None
        if self.trained_step > self.saved_step or (self.trained_step == 0 and not self.policy.resumed):
            self.checkpoint(self.trained_step, checkpoint_name(self.trained_step), self.trained_cursor_at)

    def save_on_failure(self) -> None:
        """The run is failing: write its last trained step's metrics and a checkpoint of it, unless saved."""
        if self.trained_step <= self.saved_step:
            return
        try:
            if self.pending is not None:
                self.report(*self.pending)
            self.checkpoint(self.trained_step, checkpoint_name(self.trained_step), self.trained_cursor_at)
        except Exception:  # the original error matters more
            log.exception("the checkpoint of step %d after the failure could not be written", self.trained_step)

    def full_state(self) -> dict:
        self.link.tell("state")  # every rank joins the gather of a sharded model
        return self.policy.full_state()

    def policy_weights(self) -> PolicyWeights:
        """What a push sends: the gathered state dict, or (the transfer route) the live model layer by layer, with
        every rank in the gathers. Checked finite first, whatever the route (NonFiniteWeights: nothing is sent)."""
        self.link.tell("check")  # every rank checks its shards (a reduced check)
        self.policy.check_finite()
        return PolicyWeights(self.full_state, self.policy.model, lambda: self.link.tell("transfer"))

    def push_current(self) -> float:
        """Push the current weights as `version` to every service (logs the route of each when it changes)."""
        before = self.rollouts.routes
        elapsed = self.rollouts.push(self.policy_weights(), self.version, self.cfg.weight_sync, self.run.run_dir)
        if self.rollouts.routes != before:
            routes = ", ".join(f"{c.address} {r}" for c, r in zip(self.rollouts.clients, self.rollouts.routes,
                                                                   strict=True))
            self.run.event("LOG", f"weight sync ({self.cfg.weight_sync}): {routes}")
        return elapsed

    def report(self, step: int, metrics: dict[str, float]) -> None:
        self.sink.write(step, metrics)
        self.run.emit({"type": "metrics", "step": step, "values": metrics})

    def evaluate(self, step: int) -> None:
        """Evaluate (nothing when there are no eval prompts, or when a stop comes before a Generate call)."""
        if not self.eval_problems:
            return
        t0 = time.perf_counter()
        per_prompt: dict[str, list[float]] = {}
        sampled: list = []  # each prompt's samples at T and rewards: the report's eval sample

        def run_eval() -> dict[str, float]:
            sampled.clear()  # a retried evaluation starts over
            return evaluate(self.rollouts, self.reward_fn, self.eval_problems, self.cfg, per_prompt=per_prompt,
                            encode=self.encode, stop=self.run.stop_requested.is_set, sampled=sampled)

        try:
            res = self.resilient(f"the evaluation at step {step}", run_eval)
        except SamplingStopped:
            return
        res.update(per_set_means(self.eval_sets or [], per_prompt))  # eval_accuracy_<benchmark>
        res["time_eval_s"] = time.perf_counter() - t0
        if self.recorder is not None:  # teacher-forced entropy and kept flags of a few responses (every rank)
            res.update(self.recorder.record(step, self.eval_problems, sampled))
        self.sink.write(step, res, kind="eval")
        self.sink.write_benchmarks(step, res, [name for name, _ in self.eval_sets or []])  # a table to TB / W&B
        self.sink.write_eval_prompts(step, per_prompt)
        self.run.event("EVAL", f"eval on {len(self.eval_problems)} prompts", step=step, values=res)
        if self.recorder is not None:
            self.recorder.refresh(self.run.event)  # report.html

    def checkpoint(self, step: int, name: str, cursor: int | None = None) -> None:
        self.policy.check_space(self.run.run_dir, name)  # before any rank writes: a full disk fails it clearly
        self.link.tell("checkpoint", str(self.run.run_dir), name)  # every rank writes its optimizer shards
        path = self.policy.save(self.run.run_dir, name, {
            "step": step, "data_cursor": self.trained_cursor if cursor is None else cursor,
            "run_id": self.run.run_id, "config": self.cfg.model_dump(), "policy_version": self.version})
        self.saved_step = max(self.saved_step, step)
        self.run.event("CHECKPOINT", f"saved {name}", step=step, path=str(path))
