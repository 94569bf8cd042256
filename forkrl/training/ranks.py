"""The trainer's ranks in lockstep: rank 0 runs the service and the loop, every other rank follows it.

    link = init_ranks()              # torchrun's env: a process group when WORLD_SIZE > 1, else a no-op link
    if link.rank != 0:
        follow(device)               # ranks > 0: wait for rank 0's commands until "exit"
    ...                              # rank 0: the gRPC service; run_training(run, link=link)

Rank 0 tells the other ranks (`RankLink.tell`, a broadcast of a small pickled object) each thing that
needs every rank, just before doing it itself:

| command | rank 0 then | every other rank |
|---|---|---|
| `start` (config, run dir) | `load_policy` | `load_policy`: the same model, sharded (FSDP2) over all ranks |
| `update` (step, rewards and token ids) | `Policy.set_lr`, `Policy.update` | the same: `train_step` on its share |
| `state` | `Policy.full_state()` for the push | `Policy.full_state()` (the finite check, the gather) |
| `check` | `Policy.check_finite()` before any push | the same (its shards; the flag reduced over the ranks) |
| `transfer` | streams the model into the rollout services | `join_transfer`: the same per-parameter gathers |
| `checkpoint` (run dir, name) | `Policy.save`: HF files + its AdamW shards | the same (DCP, its shards) |
| `tokens` (token ids, temperature) | the run report's teacher-forced eval sample | the same forwards (FSDP2) |
| `end` | the run is over (any outcome) | drops the policy |
| `exit` | the service stops | returns |

Inside those commands the ranks decide together: a stop (rank 0's flag, MAX-reduced before every micro-batch),
a skipped update (a non-finite loss or gradient norm on any rank) and non-finite weights (before a push or a
checkpoint) are reduced over the ranks, so every rank stops, skips or refuses at the same point and a follower
carries on with the next command (forkrl/rl/step.py, forkrl/training/policy.py).

Rank 0 alone talks to the rollout services and the clients, scores, writes metrics and checkpoints. The
other ranks never see gRPC. A failure on one rank inside a collective leaves the others waiting until the
process group's timeout (`TIMEOUT`): the run is not recoverable then; restart the service (torchrun).
"""

from __future__ import annotations

import datetime
import logging
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from forkrl.rl.collectives import rank_world
from forkrl.rl.step import StepStopped
from forkrl.runtime import release_memory

__all__ = ["TIMEOUT", "RankLink", "UpdatePayload", "follow", "init_ranks"]

log = logging.getLogger("forkrl.ranks")

# Followers wait in a broadcast while the service is idle between runs; gloo/nccl raise after the group's
# timeout, so it is long. A real hang therefore also takes this long to surface.
TIMEOUT = datetime.timedelta(days=7)


@dataclass(frozen=True)
class _Trajectory:
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    logprobs: list[float]


@dataclass(frozen=True)
class UpdatePayload:
    """What `Policy.update` reads from a ScoredBatch: the rewards [groups, G] and the trajectories."""

    rewards: torch.Tensor
    trajectories: list[_Trajectory]

    @classmethod
    def of(cls, scored: Any) -> UpdatePayload:
        return cls(scored.rewards.detach().cpu(), [
            _Trajectory(list(t.prompt_token_ids), list(t.completion_token_ids), list(t.logprobs))
            for t in scored.trajectories])


class RankLink:
    """Rank 0's side of the lockstep; with one process every `tell` is a no-op."""

    def __init__(self) -> None:
        self.rank, self.world_size = rank_world()

    @property
    def active(self) -> bool:
        return self.world_size > 1

    def tell(self, op: str, *args: Any) -> None:
        if not self.active:
            return
        if self.rank != 0:
            raise RuntimeError(f"only rank 0 gives commands (this is rank {self.rank})")
        dist.broadcast_object_list([op, args], src=0)


def init_ranks(backend: str | None = None) -> RankLink:
    """Join torchrun's process group (WORLD_SIZE > 1) with the long TIMEOUT; return rank 0's link."""
    import os

    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend or ("nccl" if cuda else "gloo"), timeout=TIMEOUT)
    return RankLink()


def _receive() -> tuple[str, tuple]:
    box: list[Any] = [None, None]
    dist.broadcast_object_list(box, src=0)
    return box[0], box[1]


def follow(device: str = "auto", threads: int | str = "auto") -> None:
    """Ranks > 0: do what rank 0 says until it says "exit". SIGTERM is ignored: torchrun sends it to every
    rank at once, and rank 0 still needs the others for its final checkpoint before it says "exit"."""
    from forkrl.training.policy import NonFiniteWeights, load_policy

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    rank = dist.get_rank()
    policy = None
    while True:
        op, args = _receive()
        if op == "start":
            cfg, run_dir = args
            try:  # rank 0 fails the same way on a bad config and tells "end"; this rank stays available
                policy = load_policy(cfg, Path(run_dir), device, threads)
                log.info("rank %d: run started (%s)", rank, cfg.model)
            except Exception:
                log.exception("rank %d: could not load the policy", rank)
                policy = None
        elif op == "update":
            assert policy is not None, "update before start"
            step, payload = args
            policy.set_lr(step)
            try:
                policy.update(payload, policy.cfg.loss_config())
            except StepStopped:  # rank 0's stop reached every rank at the same micro-batch
                log.info("rank %d: step %d stopped before any update", rank, step)
            if policy.device.type == "cuda":  # rank 0's is the step's gpu_mem_peak_gib (scripts/gpu_check.sh)
                log.info("rank %d: step %d: gpu_mem_peak_gib %.3f", rank, step,
                         torch.cuda.max_memory_allocated(policy.device) / 2**30)
        elif op in ("check", "state", "checkpoint"):
            assert policy is not None, f"{op} before start"
            try:
                if op == "check":
                    policy.check_finite()
                elif op == "state":
                    policy.full_state()
                else:
                    run_dir, name = args
                    policy.save(Path(run_dir), name, None)
            except NonFiniteWeights as e:  # every rank found it (a reduced check): rank 0 fails the run
                log.error("rank %d: %s: not %s", rank, e, {"check": "pushed", "state": "gathered"}.get(op, "saved"))
        elif op == "tokens":  # the run report's eval sample (forkrl/report/record.py): join the sharded forwards
            assert policy is not None, "tokens before start"
            from forkrl.report.record import teacher_forced

            seqs, temperature = args
            teacher_forced(policy.model, seqs, temperature, policy.device)
        elif op == "transfer":
            assert policy is not None, "transfer before start"
            from forkrl.training.rollouts import join_transfer

            join_transfer(policy.model)
        elif op == "end":
            policy = None
            release_memory()  # the run's shards and optimizer state, before the next "start" loads new ones
        elif op == "exit":
            return
        else:
            raise RuntimeError(f"rank {rank}: unknown command {op!r} from rank 0")
