"""One rank of tests/dist/test_transfer_two_ranks.py: a 2-rank FSDP2 trainer pushing through the gloo
weight-transfer backend (torchrun, gloo, CPU).

    python -m forkrl.launch --nproc-per-node 2 tests/dist/transfer_worker.py ADDRESS MODEL OUT

Every rank loads the model, perturbs it with the same seed and shards it (`fully_shard` per decoder layer + root).
Rank 0 writes the full state (gathered) to OUT/pushed.safetensors, then pushes with the trainer's own code
(`Rollouts.push`, --weight-sync transfer), telling the other rank to join the per-parameter gathers when the
stream begins, as forkrl/training/ranks.py does; it writes its report to OUT/report.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from forkrl.training.distributed import full_state_dict, init_from_env, shard_model
from forkrl.training.rollouts import PolicyWeights, Rollouts, join_transfer


def tell(op: str) -> None:
    dist.broadcast_object_list([op], src=0)


def main(address: str, model_dir: str, out: str) -> None:
    info = init_from_env()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * p.std() * torch.randn(p.shape, generator=g))
    model = shard_model(model, info.device)
    state = full_state_dict(model)  # a collective: rank 0 gets the full tensors
    if info.rank != 0:
        while True:  # rank 0's commands
            box: list = [None]
            dist.broadcast_object_list(box, src=0)
            if box[0] == "transfer":
                join_transfer(model)
            else:
                return
    save_file({k: v.contiguous() for k, v in state.items()}, str(Path(out) / "pushed.safetensors"))
    nbytes = sum(v.numel() * v.element_size() for v in state.values())
    del state
    rollouts = Rollouts([address], run_id="fsdp-transfer")
    try:
        rollouts.wait_ready(120)
        rollouts.adopt(0)
        rollouts.push(PolicyWeights(lambda: {}, model, lambda: tell("transfer")), 1, "auto", Path(out))
        report = {"routes": rollouts.routes, "version": rollouts.clients[0].info().version, "model_bytes": nbytes,
                  **rollouts.last_transfer}
    finally:
        tell("end")
        rollouts.close()
    (Path(out) / "report.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(*sys.argv[1:4])
    dist.destroy_process_group()
