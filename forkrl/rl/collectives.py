"""The collectives of the train step (forkrl/rl/step.py): which rank this is, how a micro-batch is dealt to the
ranks, the gathers and reductions that let N ranks compute what 1 rank computes, the gradient sync, and the
cross-rank finiteness check of the guards.

With no initialized process group, or a group of one rank, every function here is the trivial case: no
collective runs and values come back as they went in. With W > 1 ranks every rank must make the same calls in
the same order (torch.distributed's rule); the train step guarantees it by running the same plan on every rank.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["GradSync", "deal", "first_nonfinite", "gather_segments", "is_fsdp", "rank_world", "reduce_floats",
           "reshard_root", "set_grad_sync", "sum_replicated_grads", "union_keys"]

ReduceOp = Literal["sum", "max", "min"]
_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def rank_world(group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """(rank, world size) of `group`; (0, 1) without an initialized process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def deal(start: int, stop: int, world: int, rank: int) -> tuple[int, int]:
    """This rank's contiguous block of the rows [start, stop) of one global micro-batch of b = stop - start rows:
    [start + floor(r b / W), start + floor((r + 1) b / W)). Rank r's block follows rank r - 1's, so the blocks
    in rank order are the 1-rank micro-batch row for row; sizes differ by at most one; a block may be empty."""
    if not (0 <= start <= stop and world >= 1 and 0 <= rank < world):
        raise ValueError(f"deal needs 0 <= start <= stop and 0 <= rank < world; got start={start}, stop={stop}, "
                         f"world={world}, rank={rank}")
    b = stop - start
    return start + rank * b // world, start + (rank + 1) * b // world


def gather_segments(local: Sequence[Tensor], group: dist.ProcessGroup | None = None) -> list[Tensor]:
    """All ranks' 1-D segments in the 1-rank order: for each index j, rank 0's j-th, rank 1's j-th, ...

    Every rank passes the same number J of segments of one dtype (lengths may differ, zero included) and gets
    the W*J segments back (counts all-gathered first, values padded to the longest rank and the padding dropped,
    algorithms.md §6 P2). One rank: the segments themselves.
    """
    _, world = rank_world(group)
    if not local:
        raise ValueError("gather_segments needs at least one segment")
    if world == 1:
        return [t.reshape(-1) for t in local]
    ref = local[0]
    counts = torch.tensor([t.numel() for t in local], dtype=torch.long, device=ref.device)
    all_counts = [torch.empty_like(counts) for _ in range(world)]
    dist.all_gather(all_counts, counts, group=group)
    totals = [int(c.sum()) for c in all_counts]
    width = max(max(totals), 1)
    flat = torch.zeros(width, dtype=ref.dtype, device=ref.device)
    mine = torch.cat([t.reshape(-1) for t in local])
    flat[: mine.numel()] = mine
    bufs = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(bufs, flat, group=group)
    per_rank = [list(torch.split(bufs[r][: totals[r]], all_counts[r].tolist())) for r in range(world)]
    return [per_rank[r][j] for j in range(len(local)) for r in range(world)]


def reduce_floats(values: Sequence[float], op: ReduceOp, device: torch.device,
                  group: dist.ProcessGroup | None = None) -> list[float]:
    """Element-wise SUM / MAX / MIN of equally long float lists over the ranks (float64, one all_reduce)."""
    if rank_world(group)[1] == 1 or not values:
        return list(values)
    t = torch.tensor(list(values), dtype=torch.float64, device=device)
    dist.all_reduce(t, op=_OPS[op], group=group)
    return t.tolist()


def union_keys(keys: Iterable[str], group: dist.ProcessGroup | None = None) -> list[str]:
    """The sorted union of every rank's keys (a rank that trained no token has none)."""
    mine = sorted(set(keys))
    _, world = rank_world(group)
    if world == 1:
        return mine
    per_rank: list[list[str] | None] = [None] * world
    dist.all_gather_object(per_rank, mine, group=group)
    return sorted({k for ks in per_rank if ks for k in ks})


def is_fsdp(model: torch.nn.Module) -> bool:
    """Whether `model` is sharded with FSDP2 (`fully_shard`)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return False
    return isinstance(model, FSDPModule)


GradSync = Literal["every", "last"]
"""When FSDP2 reduce-scatters an update's gradients (`train_step(grad_sync=...)`):
- "every" (the default): after every micro-batch's backward. Each rank then holds only its fp32 shard of the
  gradient, 4 P / W bytes, at the price of one reduce-scatter per micro-batch instead of per update (FSDP2 runs
  them during the backward of the layers below).
- "last": only after the update's last micro-batch; before it, FSDP2 accumulates every unit's gradient unsharded
  in fp32 (`set_requires_gradient_sync(False)`), 4 P bytes on every rank whatever W: 122 GiB at 32B
  (docs/scaling.md "Memory plan"). Worth it only for a model whose whole gradient fits beside everything else
  and micro-batches so short that the collectives show.
Rule for the default: memory decides whether the paper's recipe runs at all, the collectives only how fast, so
"every". Both give the same update up to float32 rounding of the summation order
(tests/dist/test_dp_equals_one_rank.py). A replicated (not sharded) model ignores it: one all_reduce per update.
"""


def set_grad_sync(model: torch.nn.Module, on: bool) -> None:
    """FSDP2: reduce-scatter the gradients in this backward, or accumulate them unsharded (GradSync)."""
    if is_fsdp(model):
        model.set_requires_gradient_sync(on)  # type: ignore[operator]


def reshard_root(model: torch.nn.Module) -> None:
    """FSDP2: free the root unit's gathered parameters (embeddings, final norm, lm_head). The root is not resharded
    after its forward (forkrl/training/distributed.py `shard_model`: the chunked loss reads the lm_head weight after
    the forward, and the backward reshards it); after a forward with no backward, call this, on every rank."""
    if is_fsdp(model):
        model.reshard()  # type: ignore[operator]


def sum_replicated_grads(model: torch.nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """A replicated (not sharded) model on W > 1 ranks: SUM every gradient over the ranks (a parameter without a
    gradient counts as zeros). Each rank's loss is its share of the global sum, so the sum is the 1-rank one."""
    if rank_world(group)[1] == 1 or is_fsdp(model):
        return
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=group)


def _local(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # a DTensor (FSDP2 shard) -> this rank's part


def first_nonfinite(named: Sequence[tuple[str, Tensor | None]], device: torch.device,
                    group: dist.ProcessGroup | None = None) -> str | None:
    """The name of the first tensor (in `named` order) holding an inf or a NaN on any rank, else None.

    Cheap: one fused max-|x| reduction per tensor (`torch._foreach_norm(ord=inf)`, which is inf or NaN exactly
    when an element is) over this rank's part (its FSDP2 shard), then one MIN all_reduce of the per-tensor flags,
    so every rank returns the same name. A None tensor (a parameter without a gradient) counts as finite.
    """
    parts = [(i, _local(t).detach()) for i, (_, t) in enumerate(named) if t is not None]
    parts = [(i, t) for i, t in parts if t.numel() > 0]
    ok = torch.ones(len(named), dtype=torch.float64, device=device)
    if parts:
        norms = torch._foreach_norm([t for _, t in parts], math.inf)
        finite = torch.stack([n.float().to(device) for n in norms]).isfinite()
        ok[torch.tensor([i for i, _ in parts], device=device)] = finite.to(torch.float64)
    if rank_world(group)[1] > 1:
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    bad = (ok < 0.5).nonzero()
    return named[int(bad[0])][0] if bad.numel() else None
