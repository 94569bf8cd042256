"""The trainer's Policy on 1 or N ranks: train 3 steps with a checkpoint after step 2, or resume one and train
step 3. Run by tests/dist/test_resume_across_ranks.py, under torchrun for N > 1, plain python for 1.

    # OUT JOB...; a job is MODE:RUN:TAG (train a fresh run OUT/RUN, or resume it), run one after the other
    python -m forkrl.launch --nproc-per-node 2 tests/dist/resume_worker.py OUT train:run2:t2
    python -m forkrl.launch --nproc-per-node 2 tests/dist/resume_worker.py OUT resume:run2:r22
    python tests/dist/resume_worker.py OUT train:run1:t1 resume:run2:r21           # 1 rank; 2 -> 1

It drives the same code the trainer runs (load_policy, Policy.set_lr / update / save) on the embedded tiny
model with three fixed synthetic batches (the same on every rank and in every launch: the rollout is not
what is tested here). Rank 0 writes OUT/<tag>.json (per-step metrics) and OUT/<tag>.safetensors:
`w2.<param>` / `o2.<param>.<exp_avg|exp_avg_sq|step>` = weights and AdamW state after step 2 (train: as
saved; resume: as loaded), `w3.` / `o3.` = after step 3.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from forkrl.models.tiny import default_model_dir
from forkrl.training.config import RunConfig
from forkrl.training.policy import load_policy
from forkrl.training.ranks import RankLink, UpdatePayload, _Trajectory, init_ranks
from forkrl.weights.sharded import gathered_optimizer_state

GROUPS, G, LR = 4, 4, 1e-3


def payload(step: int, vocab: int) -> UpdatePayload:
    g = torch.Generator().manual_seed(100 + step)
    trajs = []
    for _ in range(GROUPS * G):
        p = torch.randint(3, vocab, (int(torch.randint(3, 7, (1,), generator=g)),), generator=g).tolist()
        c = torch.randint(3, vocab, (int(torch.randint(2, 11, (1,), generator=g)),), generator=g).tolist()
        trajs.append(_Trajectory(p, c, (-torch.rand(len(c), generator=g) * 3).tolist()))
    rewards = torch.randint(0, 2, (GROUPS, G), generator=g).float()
    rewards[:, 0], rewards[:, 1] = 1.0, 0.0  # every group has signal
    return UpdatePayload(rewards, trajs)


def main(out: str, jobs: list[str]) -> None:
    link = init_ranks("gloo")
    for job in jobs:
        mode, run_name, tag = job.split(":")
        run_job(link, mode, Path(out), run_name, tag)
    if dist.is_initialized():
        dist.destroy_process_group()


def run_job(link: RankLink, mode: str, out_dir: Path, run_name: str, tag: str) -> None:
    rank = link.rank
    run_dir = out_dir / run_name
    cfg = RunConfig(model=str(default_model_dir()), run_dir=str(run_dir), resume=mode == "resume", lr=LR,
                    entropy_top_frac=0.2, mask_scope="step", micro_batch_size=8, max_new_tokens=16,
                    weight_decay=0.01, loss="dapo")
    loss_cfg = cfg.loss_config()
    policy = load_policy(cfg, run_dir, "cpu")
    vocab = policy.model.config.vocab_size
    dumps: dict[str, torch.Tensor] = {}
    metrics: dict[int, dict[str, float]] = {}

    def dump(prefix: str) -> None:
        w = policy.full_state()  # gathered on rank 0 ({} elsewhere)
        o = gathered_optimizer_state(policy.model, policy.optimizer)  # every rank
        if rank == 0:
            dumps.update({f"w{prefix}.{k}": v.detach().clone().contiguous() for k, v in w.items()})
            dumps.update({f"o{prefix}.{k}": v.contiguous() for k, v in o.items()})

    if mode == "resume":
        assert policy.resumed and policy.start_step == 2, (policy.resumed, policy.start_step)
        dump("2")
    else:  # a checkpoint before any optimizer step: no moments to write, and the optimizer stays untouched
        policy.save(run_dir, "step_000000", {"step": 0, "data_cursor": 0, "run_id": tag} if rank == 0 else None)
        assert not policy.optimizer.state
    for step in range(policy.start_step + 1, 4):
        policy.set_lr(step)
        metrics[step] = policy.update(payload(step, vocab), loss_cfg)
        if step == 2 and mode == "train":
            policy.save(run_dir, "step_000002", {"step": 2, "data_cursor": 8, "run_id": tag} if rank == 0 else None)
            dump("2")
    dump("3")
    if rank == 0:
        save_file(dumps, str(out_dir / f"{tag}.safetensors"))
        (out_dir / f"{tag}.json").write_text(json.dumps({"world_size": link.world_size, "metrics": metrics,
                                                         "lr": LR, "weight_decay": cfg.weight_decay}))
    if dist.is_initialized():
        dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
