"""The training loop of one run: rollouts → rewards → advantages → mask + loss → AdamW → weight push.

Runs in the run's own thread (runs.py). Every step emits one metrics item (WatchRun), one line of
`metrics.jsonl` and TensorBoard scalars; checkpoints are written atomically (forkrl/weights/checkpoint.py).

Determinism: the data order is a seeded permutation walked by a cursor, the sampling seed of step s is
derived from (seed, s), and the rollout service derives each sample's seed from it. With the same weights
served, a resumed run therefore sees the same trajectories as an uninterrupted one.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from forkrl.clients.rollout import RolloutClient
from forkrl.data.datasets import load_problems
from forkrl.data.rewards import get_reward_fn
from forkrl.data.tasks import DEFAULT_TASK, Problem, get_task
from forkrl.files import atomic_write
from forkrl.models.tiny import default_model_dir
from forkrl.rl.advantages import compute_advantages, dynamic_sampling_keep, soft_overlong_penalty
from forkrl.rl.losses import LossConfig
from forkrl.rl.step import build_batch, train_step
from forkrl.seeds import run_seed
from forkrl.training.config import RunConfig
from forkrl.weights.checkpoint import (
    checkpoint_name,
    latest_checkpoint,
    load_optimizer_state,
    read_state,
    save_checkpoint,
)
from trainer_service.config import TrainerSettings
from trainer_service.runs import Run

log = logging.getLogger("trainer_service")
TRAIN_POOL = 20000  # built-in task: size of the train pool the data order walks through


def resolve(cfg: RunConfig) -> RunConfig:
    """Fill the defaults that depend on the environment (model dir, task, reward, max_new_tokens)."""
    updates: dict[str, Any] = {}
    if not cfg.model:
        updates["model"] = str(default_model_dir())
    if not cfg.dataset and not cfg.task:
        updates["task"] = DEFAULT_TASK
    if not cfg.reward:
        updates["reward"] = "math_verify" if cfg.dataset else "exact_match"
    if cfg.max_new_tokens == 0:
        updates["max_new_tokens"] = get_task(cfg.task or DEFAULT_TASK).max_new_tokens if not cfg.dataset else 1024
    return cfg.model_copy(update=updates)


def loss_config(cfg: RunConfig) -> LossConfig:
    return LossConfig(
        name=cfg.loss, clip_low=cfg.clip_low, clip_high=cfg.clip_high, dual_clip_c=cfg.dual_clip_c,
        kl_beta=cfg.kl_beta, cispo_max_weight=cfg.cispo_max_weight, max_len=cfg.max_new_tokens,
        mask_norm=cfg.mask_norm,
        entropy_top_frac=cfg.entropy_top_frac, mask_scope=cfg.mask_scope,
    )


def preflight(cfg: RunConfig, runs_root: Path) -> RunConfig:
    """Checks that need the filesystem, done in StartRun so a bad run fails before it starts.

    ValueError → INVALID_ARGUMENT; FileNotFoundError → FAILED_PRECONDITION.
    """
    cfg = resolve(cfg)
    model = Path(cfg.model)
    if not (model / "config.json").is_file():
        raise ValueError(f"model: {cfg.model!r} is not an HF checkpoint directory (no config.json)")
    if cfg.dataset and not Path(cfg.dataset).is_file():
        raise ValueError(f"dataset: no such file {cfg.dataset!r}")
    if cfg.task and not cfg.dataset:
        get_task(cfg.task)  # raises ValueError naming the known tasks
    get_reward_fn(cfg.reward)  # raises ValueError for an unknown reward
    loss_config(cfg)  # raises ValueError for a combination the loss cannot honour
    if cfg.run_dir:
        run_dir = Path(cfg.run_dir)
        has_ckpt = latest_checkpoint(run_dir) is not None
        if cfg.resume and not has_ckpt:
            raise FileNotFoundError(f"resume: no complete checkpoint in {run_dir / 'checkpoints'}")
        if not cfg.resume and has_ckpt:
            raise ValueError(f"run_dir {str(run_dir)!r} already holds checkpoints: pass resume to continue it "
                             "or choose another run_dir")
    return cfg


class DataOrder:
    """Deterministic, resumable prompt order: epoch e walks a permutation seeded by (seed, e)."""

    def __init__(self, problems: list[Problem], seed: int, cursor: int = 0) -> None:
        self.problems, self.seed, self.cursor = problems, seed, cursor
        self._epoch, self._order = -1, []

    def take(self, k: int) -> list[Problem]:
        out = []
        n = len(self.problems)
        for _ in range(k):
            epoch, pos = divmod(self.cursor, n)
            perm = self._perm(epoch)
            out.append(self.problems[perm[pos]])
            self.cursor += 1
        return out

    def _perm(self, epoch: int) -> list[int]:
        if epoch != self._epoch:
            self._order = list(range(len(self.problems)))
            random.Random(run_seed("data", self.seed, epoch)).shuffle(self._order)
            self._epoch = epoch
        return self._order


class MetricsSink:
    """metrics.jsonl (always) + TensorBoard (optional). Lines are flushed per step: nothing lost on a crash."""

    def __init__(self, run_dir: Path, tensorboard: bool) -> None:
        self.path = run_dir / "metrics.jsonl"
        self.writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(run_dir / "tb"))

    def write(self, step: int, values: dict[str, float], kind: str = "train") -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, "kind": kind, **values}, sort_keys=True) + "\n")
        if self.writer is not None:
            for k, v in values.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self.writer.add_scalar(f"{kind}/{k}", v, step)
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class Rollouts:
    """Spreads prompts over one or more rollout services and pushes weights to all of them."""

    def __init__(self, addresses: list[str]) -> None:
        self.clients = [RolloutClient(a) for a in addresses]
        self.pool = ThreadPoolExecutor(max_workers=len(self.clients))

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        for c in self.clients:
            c.wait_ready(timeout_s)

    def generate(self, prompts: list[str], n: int, temperature: float, max_new_tokens: int,
                 seed: int) -> list[list[Any]]:
        """Trajectories grouped by prompt: result[i] holds the n samples of prompts[i] in sample order."""
        shards = [list(range(j, len(prompts), len(self.clients))) for j in range(len(self.clients))]

        def run(j: int) -> list[tuple[int, Any]]:
            idx = shards[j]
            if not idx:
                return []
            out = []
            # seeds per global prompt index: the result does not depend on how prompts are sharded
            for t in self.clients[j].generate([prompts[i] for i in idx], n=n, temperature=temperature,
                                              max_new_tokens=max_new_tokens, seed=seed, prompt_offsets=idx):
                out.append((idx[t.prompt_index], t))
            return out

        groups: list[list[Any]] = [[None] * n for _ in prompts]
        for part in self.pool.map(run, range(len(self.clients))):
            for i, t in part:
                groups[i][t.sample_index] = t
        missing = sum(t is None for g in groups for t in g)
        if missing:
            raise RuntimeError(f"rollout returned {missing} fewer trajectories than asked")
        return groups

    def version(self) -> int:
        return max(c.info().version for c in self.clients)

    def serve_initial(self, model_dir: str) -> bool:
        """True when every service still serves the checkpoint it started with and that is `model_dir`."""
        want = Path(model_dir).resolve()
        return all(i.version == 0 and Path(i.model).resolve() == want for i in (c.info() for c in self.clients))

    def push(self, model: torch.nn.Module, version: int, mode: str, run_dir: Path) -> float:
        state = {k: v.detach() for k, v in model.state_dict().items()}
        t0 = time.perf_counter()
        if mode == "path":
            from safetensors.torch import save

            sync = run_dir / "weights_sync"
            sync.mkdir(parents=True, exist_ok=True)
            blob = save({k: v.contiguous() for k, v in _dedupe(state).items()})
            atomic_write(sync / "model.safetensors", blob)
            versions = list(self.pool.map(lambda c: c.load_weights(str(sync), version), self.clients))
        else:
            versions = list(self.pool.map(lambda c: c.update_weights(state, version), self.clients))
        if any(v != version for v in versions):
            raise RuntimeError(f"rollout services report versions {versions} after pushing version {version}")
        return time.perf_counter() - t0


def _dedupe(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop tensors that share storage with an earlier one (tied embeddings) — safetensors refuses them."""
    seen, out = set(), {}
    for k, v in state.items():
        key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape))
        if key not in seen:
            seen.add(key)
            out[k] = v
    return out


def _score(reward_fn, groups: list[list[Any]], problems: list[Problem], cfg: RunConfig) -> torch.Tensor:
    """Rewards [B, G] (None → 0 and counted). DAPO's soft overlong penalty is added when configured."""
    flat = [t for g in groups for t in g]
    probs = [p for p, g in zip(problems, groups, strict=True) for _ in g]
    result = reward_fn([t.completion_text for t in flat], probs)
    rewards = torch.tensor([0.0 if r is None else float(r) for r in result.rewards], dtype=torch.float32)
    rewards = rewards.view(len(groups), -1)
    if cfg.overlong_cache_len > 0:
        lengths = torch.tensor([len(t.completion_token_ids) for t in flat]).view_as(rewards)
        rewards = rewards + soft_overlong_penalty(lengths, cfg.max_new_tokens, cfg.overlong_cache_len)
    return rewards


def evaluate(rollouts: Rollouts, reward_fn, problems: list[Problem], cfg: RunConfig, samples: int = 4) -> dict:
    """Accuracy on eval prompts through the rollout service: sampled at T (n=samples) and greedy."""
    if not problems:
        return {}
    prompts = [p.prompt for p in problems]
    out = {}
    for name, temp, n in (("eval_accuracy", cfg.temperature, samples), ("eval_greedy_accuracy", 0.0, 1)):
        groups = rollouts.generate(prompts, n=n, temperature=temp, max_new_tokens=cfg.max_new_tokens,
                                   seed=run_seed("eval", cfg.seed))
        flat = [t for g in groups for t in g]
        probs = [p for p, g in zip(problems, groups, strict=True) for _ in g]
        rewards = reward_fn([t.completion_text for t in flat], probs).rewards
        out[name] = sum(1.0 for r in rewards if r is not None and r > 0) / len(rewards)
    return out


def run_training(run: Run, settings: TrainerSettings) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = preflight(run.config, Path(settings.runs_root))
    run.config = cfg
    run_dir = run.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(cfg.model_dump(), indent=2, sort_keys=True))

    resume_from = latest_checkpoint(run_dir) if cfg.resume else None
    start_step, cursor = 0, 0
    load_dir = Path(cfg.model)
    if resume_from is not None:
        state = read_state(resume_from)
        start_step, cursor = int(state["step"]), int(state["data_cursor"])
        load_dir = resume_from
    run.start_step = run.step = start_step
    torch.manual_seed(run_seed("torch", cfg.seed))

    tokenizer = AutoTokenizer.from_pretrained(load_dir)
    model = AutoModelForCausalLM.from_pretrained(load_dir, dtype=torch.float32, use_safetensors=True)
    device = torch.device("cuda" if settings.device == "auto" and torch.cuda.is_available() else
                          "cpu" if settings.device == "auto" else settings.device)
    model.to(device)  # fp32 master weights; the engine may serve bf16 (pushed fp32 tensors are cast)
    ref_model = None
    if cfg.kl_beta > 0:
        ref_model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32, use_safetensors=True)
        ref_model.to(device).eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                  weight_decay=cfg.weight_decay, eps=1e-8)
    if resume_from is not None:
        load_optimizer_state(resume_from, model, optimizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    train_problems = load_problems(cfg.task or None, cfg.dataset or None, "train", TRAIN_POOL, cfg.seed)
    eval_problems = load_problems(cfg.task or None, cfg.dataset or None, "eval", cfg.eval_prompts, cfg.seed) \
        if cfg.eval_prompts else []
    data = DataOrder(train_problems, cfg.seed, cursor)
    reward_fn = get_reward_fn(cfg.reward)
    loss_cfg = loss_config(cfg)
    sink = MetricsSink(run_dir, settings.tensorboard)

    rollouts = Rollouts(cfg.rollout_addresses)
    run.event("LOG", f"waiting for rollout service(s) {', '.join(cfg.rollout_addresses)}")
    rollouts.wait_ready()
    version = rollouts.version()
    # The rollout must serve exactly the policy we train: on resume, or when it serves anything but our
    # initial checkpoint (another model, another run's weights), push ours first.
    if resume_from is not None or not rollouts.serve_initial(cfg.model):
        version += 1
        rollouts.push(model, version, cfg.weight_sync, run_dir)
    run.event("STARTED", f"run {run.run_id} on {device}: loss {cfg.loss}, entropy_top_frac {cfg.entropy_top_frac}, "
              f"{len(train_problems)} train / {len(eval_problems)} eval prompts, from step {start_step}",
              path=str(run_dir))

    def do_eval(step: int) -> None:
        if not eval_problems:
            return
        t0 = time.perf_counter()
        res = evaluate(rollouts, reward_fn, eval_problems, cfg)
        res["time_eval_s"] = time.perf_counter() - t0
        sink.write(step, res, kind="eval")
        run.event("EVAL", f"eval on {len(eval_problems)} prompts", step=step, values=res)

    def checkpoint(step: int, name: str) -> None:
        path = save_checkpoint(run_dir, name, model, tokenizer, optimizer,
                               {"step": step, "data_cursor": data.cursor, "run_id": run.run_id,
                                "config": cfg.model_dump(), "policy_version": version})
        run.event("CHECKPOINT", f"saved {name}", step=step, path=str(path))

    if start_step == 0:
        do_eval(0)
    step = start_step
    try:
        while step < cfg.num_steps and not run.stop_requested.is_set():
            step += 1
            t_step = time.perf_counter()
            lr = cfg.lr * min(1.0, step / cfg.warmup_steps) if cfg.warmup_steps else cfg.lr
            for g in optimizer.param_groups:
                g["lr"] = lr

            # 1. rollouts (+ DAPO dynamic sampling: keep mixed groups, refill, bounded)
            t0 = time.perf_counter()
            groups, problems, rewards_list = [], [], []
            t_score = 0.0
            rounds, seen_groups, mixed_groups = 0, 0, 0
            while True:
                batch_probs = data.take(cfg.prompts_per_step)
                g = rollouts.generate([p.prompt for p in batch_probs], n=cfg.group_size,
                                      temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens,
                                      seed=run_seed("gen", cfg.seed, step, rounds))
                ts = time.perf_counter()
                r = _score(reward_fn, g, batch_probs, cfg)
                t_score += time.perf_counter() - ts
                rounds += 1
                seen_groups += len(g)
                keep = dynamic_sampling_keep(r) if cfg.group_size > 1 else torch.ones(len(g), dtype=torch.bool)
                mixed_groups += int(keep.sum())
                if cfg.dynamic_sampling:
                    idx = keep.nonzero().flatten().tolist()
                    g, batch_probs, r = [g[i] for i in idx], [batch_probs[i] for i in idx], r[keep]
                groups += g
                problems += batch_probs
                rewards_list.append(r)
                if not cfg.dynamic_sampling or len(groups) >= cfg.prompts_per_step or rounds >= cfg.max_gen_batches:
                    break
            if cfg.dynamic_sampling:
                groups, problems = groups[: cfg.prompts_per_step], problems[: cfg.prompts_per_step]
            rewards = torch.cat(rewards_list)[: len(groups)]
            t_gen = time.perf_counter() - t0 - t_score

            metrics: dict[str, float] = {
                "reward_mean": float(rewards.mean()) if rewards.numel() else 0.0,
                "reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
                "accuracy": float((rewards > 0).float().mean()) if rewards.numel() else 0.0,
                "groups_mixed_frac": mixed_groups / max(seen_groups, 1),
                "gen_rounds": float(rounds),
                "groups_used": float(len(groups)),
            }
            flat = [t for grp in groups for t in grp]
            if not flat:
                metrics.update(time_generate_s=t_gen, time_score_s=t_score, lr=lr, policy_version=float(version))
                run.event("LOG", "no group with mixed rewards after dynamic sampling; step skipped", step=step)
                metrics["time_step_s"] = time.perf_counter() - t_step
                sink.write(step, metrics)
                run.emit({"type": "metrics", "step": step, "values": metrics})
                continue
            lengths = [len(t.completion_token_ids) for t in flat]
            metrics.update(
                response_len_mean=sum(lengths) / len(lengths),
                truncated_frac=sum(t.finish_reason == 2 for t in flat) / len(flat),
                rollout_policy_version=float(min(t.policy_version for t in flat)),
            )

            # 2. advantages and the update
            t0 = time.perf_counter()
            adv = compute_advantages(cfg.loss, rewards).reshape(-1)
            batch = build_batch([list(t.prompt_token_ids) for t in flat], [list(t.completion_token_ids) for t in flat],
                                [list(t.logprobs) for t in flat], pad_id)
            metrics.update(train_step(model, optimizer, batch, adv, loss_cfg, temperature=cfg.temperature,
                                      micro_batch_size=cfg.micro_batch_size, max_grad_norm=cfg.max_grad_norm,
                                      ref_model=ref_model))
            t_train = time.perf_counter() - t0

            # 3. push the new policy and check the rollout serves it
            version += 1
            t_push = rollouts.push(model, version, cfg.weight_sync, run_dir)

            t_total = time.perf_counter() - t_step
            metrics.update(lr=lr, policy_version=float(version), time_generate_s=t_gen, time_score_s=t_score,
                           time_train_s=t_train, time_push_s=t_push, time_step_s=t_total,
                           tokens_per_s=sum(lengths) / max(t_gen, 1e-9), data_cursor=float(data.cursor))
            sink.write(step, metrics)
            run.emit({"type": "metrics", "step": step, "values": metrics})

            if cfg.save_every and step % cfg.save_every == 0:
                checkpoint(step, checkpoint_name(step))
            if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.num_steps:
                do_eval(step)
        if run.stop_requested.is_set() and step < cfg.num_steps:
            if not (cfg.save_every and step % cfg.save_every == 0):
                checkpoint(step, checkpoint_name(step))
        else:
            checkpoint(step, "final")
            do_eval(step)
    finally:
        sink.close()
