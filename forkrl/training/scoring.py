"""Rewards for sampled groups: the scored batch of one training step (with DAPO's dynamic-sampling refill) and
the accuracy evaluation.

    scored = collect_batch(rollouts, data, reward_fn, cfg, step)   # groups [B][G], rewards [B, G], counters
    metrics = scored.metrics()                                      # reward/accuracy/lengths of the step
    evaluate(rollouts, reward_fn, eval_problems, cfg)               # {"eval_accuracy", "eval_greedy_accuracy"}

Both take `stop` (the run's stop flag): it is read before every Generate call (each dynamic-sampling round, each
half of an evaluation) and SamplingStopped is raised when set, so a stop waits for one Generate call at most.

Seeds: round r of step s samples with run_seed("gen", seed, s, r), every evaluation with run_seed("eval", seed)
(forkrl/seeds.py, frozen formats), so resumed runs see the same trajectories as uninterrupted ones.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import torch

from forkrl.data.order import DataOrder
from forkrl.data.rewards import RewardFn
from forkrl.data.tasks import Problem
from forkrl.rl.advantages import dynamic_sampling_keep, soft_overlong_penalty
from forkrl.seeds import run_seed
from forkrl.training.config import RunConfig
from forkrl.training.rollouts import Rollouts
from forkrl.wire.rollout.v1.rollout_pb2 import FINISH_REASON_LENGTH


class SamplingStopped(Exception):
    """A stop was requested: no further Generate call was made."""


def _check_stop(stop: Callable[[], bool] | None, what: str) -> None:
    if stop is not None and stop():
        raise SamplingStopped(f"stopped before {what}")


@dataclass
class ScoredBatch:
    """The groups one step trains on, their rewards and how they were collected."""

    groups: list[list[Any]]  # trajectories by prompt: groups[i][j] is sample j of problems[i]
    problems: list[Problem]
    correctness: torch.Tensor  # [len(groups), G] float32: the reward function's grade (None -> 0), no penalty
    rewards: torch.Tensor  # [len(groups), G] float32: correctness + the soft overlong penalty (if configured)
    rounds: int  # generation rounds (> 1 only with dynamic sampling)
    seen_groups: int
    mixed_groups: int  # groups whose correctness was not all equal (0 < #correct < G)
    time_generate_s: float
    time_score_s: float

    @property
    def trajectories(self) -> list[Any]:
        """Row-major: prompt 0 samples 0..G-1, prompt 1 ... (the order of the advantages)."""
        return [t for g in self.groups for t in g]

    def metrics(self) -> dict[str, float]:
        r, c = self.rewards, self.correctness
        out = {
            "reward_mean": float(r.mean()) if r.numel() else 0.0,
            "reward_std": float(r.std()) if r.numel() > 1 else 0.0,
            "accuracy": float((c > 0).float().mean()) if c.numel() else 0.0,
            "groups_mixed_frac": self.mixed_groups / max(self.seen_groups, 1),
            "gen_rounds": float(self.rounds),
            "groups_used": float(len(self.groups)),
        }
        flat = self.trajectories
        if flat:
            lengths = [len(t.completion_token_ids) for t in flat]
            out.update(
                response_len_mean=sum(lengths) / len(lengths),
                truncated_frac=sum(t.finish_reason == FINISH_REASON_LENGTH for t in flat) / len(flat),
                rollout_policy_version=float(min(t.policy_version for t in flat)),
                # sampled across an in-place push: first tokens from one version, later ones from a newer
                rollout_mixed_frac=sum(t.last_policy_version > t.policy_version for t in flat) / len(flat),
            )
        return out

    @property
    def response_tokens(self) -> int:
        return sum(len(t.completion_token_ids) for t in self.trajectories)


def score(reward_fn: RewardFn, groups: list[list[Any]], problems: list[Problem],
          cfg: RunConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(correctness, rewards), both [B, G] float32: the reward function's grades (None → 0), and the reward
    trained on = correctness + DAPO's soft overlong penalty when configured (else the same tensor)."""
    flat = [t for g in groups for t in g]
    probs = [p for p, g in zip(problems, groups, strict=True) for _ in g]
    result = reward_fn([t.completion_text for t in flat], probs)
    rewards = torch.tensor([0.0 if r is None else float(r) for r in result.rewards], dtype=torch.float32)
    correctness = rewards.view(len(groups), -1)
    if cfg.overlong_cache_len <= 0:
        return correctness, correctness
    lengths = torch.tensor([len(t.completion_token_ids) for t in flat]).view_as(correctness)
    return correctness, correctness + soft_overlong_penalty(lengths, cfg.max_new_tokens, cfg.overlong_cache_len)


Encode = Callable[[Sequence[Problem]], list[list[int]]]  # problems -> the prompt token ids (forkrl/data/prompts.py)


def _prompts(problems: Sequence[Problem], encode: Encode | None) -> list[str] | list[list[int]]:
    """What the rollout service samples from: the formatted token ids, or (encode None) the raw prompt texts."""
    return encode(problems) if encode is not None else [p.prompt for p in problems]


def collect_batch(rollouts: Rollouts, data: DataOrder, reward_fn: RewardFn, cfg: RunConfig, step: int,
                  encode: Encode | None = None, stop: Callable[[], bool] | None = None) -> ScoredBatch:
    """Sample and score cfg.prompts_per_step groups. With dynamic sampling (DAPO §3.3) only groups of mixed
    correctness (0 < #correct < G, decided on the reward function's grades *before* the overlong penalty, which
    would make an all-correct group of different lengths look mixed) are kept and the batch is refilled from
    fresh prompts, for at most cfg.max_gen_batches rounds; the batch may then hold fewer groups (or none).
    `encode`: the run's prompt format (the service gets token ids); None = the raw texts."""
    t0 = time.perf_counter()
    groups: list[list[Any]] = []
    problems: list[Problem] = []
    rewards_list, correct_list = [], []
    t_score = 0.0
    rounds, seen_groups, mixed_groups = 0, 0, 0
    while True:
        _check_stop(stop, f"generation round {rounds + 1} of step {step}")
        batch_probs = data.take(cfg.prompts_per_step)
        g = rollouts.generate(_prompts(batch_probs, encode), n=cfg.group_size, temperature=cfg.temperature,
                              max_new_tokens=cfg.max_new_tokens, seed=run_seed("gen", cfg.seed, step, rounds))
        ts = time.perf_counter()
        c, r = score(reward_fn, g, batch_probs, cfg)
        t_score += time.perf_counter() - ts
        rounds += 1
        seen_groups += len(g)
        keep = dynamic_sampling_keep(c) if cfg.group_size > 1 else torch.ones(len(g), dtype=torch.bool)
        mixed_groups += int(keep.sum())
        if cfg.dynamic_sampling:
            idx = keep.nonzero().flatten().tolist()
            g, batch_probs, c, r = [g[i] for i in idx], [batch_probs[i] for i in idx], c[keep], r[keep]
        groups += g
        problems += batch_probs
        rewards_list.append(r)
        correct_list.append(c)
        if not cfg.dynamic_sampling or len(groups) >= cfg.prompts_per_step or rounds >= cfg.max_gen_batches:
            break
    if cfg.dynamic_sampling:
        groups, problems = groups[: cfg.prompts_per_step], problems[: cfg.prompts_per_step]
    rewards, correctness = torch.cat(rewards_list)[: len(groups)], torch.cat(correct_list)[: len(groups)]
    t_gen = time.perf_counter() - t0 - t_score
    return ScoredBatch(groups, problems, correctness, rewards, rounds, seen_groups, mixed_groups, t_gen, t_score)


def evaluate(rollouts: Rollouts, reward_fn: RewardFn, problems: Sequence[Problem], cfg: RunConfig,
             samples: int = 4, per_prompt: dict[str, list[float]] | None = None,
             encode: Encode | None = None, stop: Callable[[], bool] | None = None,
             sampled: list[tuple[list[Any], list[float | None]]] | None = None) -> dict[str, float]:
    """Accuracy on eval prompts through the rollout service: sampled at T (n=samples) and greedy. With
    `per_prompt` (a dict), also fills per_prompt[name] with each prompt's accuracy (fraction of its samples
    correct, in `problems` order): what a paired bootstrap over prompts needs (forkrl/training/curves.py). With
    `sampled` (a list), also appends each prompt's (trajectories sampled at T, their rewards), in `problems`
    order: what the run report records (forkrl/report/record.py)."""
    if not problems:
        return {}
    prompts = _prompts(problems, encode)
    out = {}
    for name, temp, n in (("eval_accuracy", cfg.temperature, samples), ("eval_greedy_accuracy", 0.0, 1)):
        _check_stop(stop, f"the evaluation's {name}")
        groups = rollouts.generate(prompts, n=n, temperature=temp, max_new_tokens=cfg.max_new_tokens,
                                   seed=run_seed("eval", cfg.seed))
        flat = [t for g in groups for t in g]
        probs = [p for p, g in zip(problems, groups, strict=True) for _ in g]
        rewards = reward_fn([t.completion_text for t in flat], probs).rewards
        ok = [1.0 if r is not None and r > 0 else 0.0 for r in rewards]
        out[name] = sum(ok) / len(ok)
        if sampled is not None and name == "eval_accuracy":
            starts = list(accumulate((len(g) for g in groups), initial=0))
            sampled += [(list(g), list(rewards[a:a + len(g)])) for g, a in zip(groups, starts, strict=False)]
        if per_prompt is not None:
            ends = list(accumulate(len(g) for g in groups))
            per_prompt[name] = [sum(ok[e - len(g):e]) / len(g) if g else 0.0 for g, e in zip(groups, ends, strict=True)]
    return out
