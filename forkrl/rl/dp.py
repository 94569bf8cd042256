"""Data-parallel `train_step`: W ranks of torch.distributed train one optimizer step that equals 1 rank.

    metrics = dp_train_step(model, optimizer, batch, advantages, loss_cfg, temperature=1.0,
                            micro_batch_size=64, max_grad_norm=1.0)     # same arguments as train_step

Every rank passes the **whole** step batch and its advantages (the token ids of one step are small next to
the weights; the advantages are computed per group from all rewards, so they are already step-global and
no collective is needed for them). `micro_batch_size` keeps its 1-rank meaning: the step is cut into the
same global micro-batches as `train_step` cuts it, and each global micro-batch is dealt to the ranks in
contiguous, rank-ordered row blocks (`shard_rows`; with micro_batch_size a multiple of W x group size,
every rank gets whole groups). Rank r's rows of micro-batch j therefore follow rank r-1's in the 1-rank
row order, and every step-global quantity is computed across ranks in that order:

- the denominators (algorithms.md §0): per global micro-batch token and sequence counts, all-reduced
  (SUM), then the same `kept_denominator` / `StepDenominator` as 1 rank, before any backward;
- the forking-token top-k (§2.3): the entropies of the response tokens are all-gathered (pad, gather,
  drop the padding, §6 P2) and put back in the 1-rank order (micro-batch major, rank minor), and the very
  same `forking_token_mask` / `masks_for_step` selects from them, so the kept set, ties included (a stable
  sort: the earlier token in the 1-rank order wins), is the set 1 rank keeps; each rank takes its slice;
- gradients: each rank's loss is its share of the global sum, so gradients are all-reduced with SUM
  (a replicated model: one all_reduce per parameter after the last micro-batch; an FSDP2 model
  (`fully_shard`): reduce-scatter with divide factor 1, synced on the last micro-batch only), then the
  clip over the summed gradients and the optimizer step, as 1 rank;
- telemetry: summed shares and counts all-reduced (SUM), maxima (MAX), entropy/|Δlogp| tensors gathered in
  the 1-rank order, so the quantiles and means are taken over the same numbers.

A rank whose share of a micro-batch is empty still runs a forward/backward with a zero loss (FSDP2 needs
every rank in every collective). Without an initialized process group, or with world size 1, this is
`train_step` itself (the same call, bit-identical).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from forkrl.rl.losses import LossConfig, StepDenominator, policy_loss
from forkrl.rl.mask import forking_token_mask, kept_denominator, masks_for_step
from forkrl.rl.step import _SUMMED, Batch, _forward, _quantiles, train_step

__all__ = ["dp_rank_world", "dp_train_step", "gather_segments", "shard_rows"]


def dp_rank_world(group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """(rank, world size) of `group`; (0, 1) without an initialized process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def shard_rows(n: int, micro_batch_size: int, world: int, rank: int) -> list[tuple[int, int]]:
    """This rank's (start, stop) rows of each global micro-batch [j*M, min((j+1)*M, n)).

    Contiguous, rank-ordered blocks: rank r gets rows [s + floor(r*b/W), s + floor((r+1)*b/W)) of a
    micro-batch of b rows starting at s; a block may be empty (b < W).
    """
    if n < 1 or micro_batch_size < 1 or world < 1 or not 0 <= rank < world:
        raise ValueError(f"shard_rows needs n >= 1, micro_batch_size >= 1, 0 <= rank < world; got n={n}, "
                         f"micro_batch_size={micro_batch_size}, world={world}, rank={rank}")
    out = []
    for s in range(0, n, micro_batch_size):
        b = min(s + micro_batch_size, n) - s
        out.append((s + rank * b // world, s + (rank + 1) * b // world))
    return out


def gather_segments(local: Sequence[Tensor], group: dist.ProcessGroup | None = None) -> list[Tensor]:
    """All ranks' 1-D segments in the global order: for each index j, rank 0's j-th, rank 1's j-th, ...

    Every rank passes the same number J of segments of one dtype (lengths may differ, zero included);
    every rank gets the W*J segments back (counts all-gathered first, values padded to the longest rank).
    """
    _, world = dp_rank_world(group)
    if not local:
        raise ValueError("gather_segments needs at least one segment")
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


def _is_fsdp(model: torch.nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return False
    return isinstance(model, FSDPModule)


def _grad_sync(model: torch.nn.Module, on: bool) -> None:
    if _is_fsdp(model):
        model.set_requires_gradient_sync(on)  # type: ignore[operator]


def _all_reduce_grads(model: torch.nn.Module, group: dist.ProcessGroup | None) -> None:
    """SUM the gradients of a replicated model (a parameter without a gradient counts as zeros)."""
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=group)


def _zero_loss(model: torch.nn.Module, batch: Batch) -> Tensor:
    """A forward on one row with loss 0 x logits: the rank joins FSDP's collectives, adds no gradient."""
    one = batch.slice(0, 1).to(next(model.parameters()).device)
    logits = model(input_ids=one.input_ids, attention_mask=one.attention_mask, use_cache=False).logits
    return logits.float().sum() * 0.0


def _step_denominator(cfg: LossConfig, micros: Sequence[Batch | None], device: torch.device,
                      group: dist.ProcessGroup | None) -> tuple[StepDenominator, list[int]]:
    """The 1-rank StepDenominator from all-reduced per-micro-batch counts; also the global token counts."""
    local = torch.zeros((len(micros), 2), dtype=torch.long, device=device)
    for j, mb in enumerate(micros):
        if mb is not None:
            local[j, 0] = mb.response_mask.sum()
            local[j, 1] = mb.response_mask.any(dim=-1).sum()
    dist.all_reduce(local, op=dist.ReduceOp.SUM, group=group)
    counts = local[:, 0].tolist()
    n_resp, seqs = sum(counts), int(local[:, 1].sum())
    if n_resp == 0:
        raise ValueError("response_masks have no response tokens in the whole step (all zero)")
    pg = kept_denominator(counts, cfg.entropy_top_frac, cfg.mask_scope) \
        if cfg.mask_on and cfg.norm == "kept" else n_resp
    return StepDenominator(pg_tokens=pg, response_tokens=n_resp, seqs=seqs), counts


def _scatter(response_mask: Tensor, keep_flat: Tensor) -> Tensor:
    mask = torch.zeros_like(response_mask)
    mask[response_mask] = keep_flat
    return mask


def _resp_of(mb: Batch | None, x: Tensor | None, device: torch.device) -> Tensor:
    if mb is None or x is None:
        return torch.zeros(0, dtype=torch.float32, device=device)
    return x.detach()[mb.response_mask].float()


def dp_train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    advantages: Tensor,
    loss_cfg: LossConfig,
    *,
    temperature: float,
    micro_batch_size: int,
    max_grad_norm: float,
    ref_model: torch.nn.Module | None = None,
    mini_batch_size: int | None = None,
    epochs: int = 1,
    kept_out: list[Tensor] | None = None,
    group: dist.ProcessGroup | None = None,
) -> dict[str, float]:
    """`train_step` over the ranks of `group` (the default group); see the module docstring.

    Several updates per batch (`mini_batch_size`, `epochs`) run at world size 1 only for now."""
    rank, world = dp_rank_world(group)
    if world == 1:
        return train_step(model, optimizer, batch, advantages, loss_cfg, temperature=temperature,
                          micro_batch_size=micro_batch_size, max_grad_norm=max_grad_norm, ref_model=ref_model,
                          mini_batch_size=mini_batch_size, epochs=epochs, kept_out=kept_out)
    if loss_cfg.tis_cap is not None:
        raise ValueError(f"truncated importance sampling (tis_cap) is not built across ranks yet (world size {world})")
    if (mini_batch_size is not None and mini_batch_size < len(batch)) or epochs != 1:
        raise ValueError("several updates per rollout batch (mini_batch_prompts, ppo_epochs) are not built across "
                         f"ranks yet; run them with one rank (world size {world})")
    # kept_out (the kept-token breakdown by class) stays empty across ranks: not built there yet
    n = len(batch)
    if advantages.shape != (n,):
        raise ValueError(f"advantages must have shape ({n},) (one per sequence), got {tuple(advantages.shape)}")
    device = next(model.parameters()).device
    advantages = advantages.to(device)
    rows = shard_rows(n, micro_batch_size, world, rank)
    micros: list[Batch | None] = [batch.slice(s, e).to(device) if e > s else None for s, e in rows]
    rho, n_micro = loss_cfg.entropy_top_frac, len(rows)
    denom, _ = _step_denominator(loss_cfg, micros, device, group)
    fsdp = _is_fsdp(model)

    step_keep: list[Tensor] | None = None  # this rank's kept flags per micro-batch (step scope)
    step_threshold = float("nan")
    if loss_cfg.mask_on and loss_cfg.mask_scope == "step":
        with torch.no_grad():
            ents = []
            for mb in micros:
                if mb is None:
                    _zero_loss(model, batch)
                    ents.append(_resp_of(None, None, device))
                else:
                    ents.append(_resp_of(mb, _forward(model, mb, temperature, True)[1], device))
        segs = gather_segments(ents, group)  # 1-rank order: micro-batch major, rank minor
        res = masks_for_step([s.unsqueeze(0) for s in segs],
                             [torch.ones((1, s.numel()), dtype=torch.bool, device=device) for s in segs], rho, "step")
        step_keep = [res[j * world + rank].mask[0] for j in range(n_micro)]
        step_threshold = res[0].threshold

    model.train()
    optimizer.zero_grad(set_to_none=True)
    sums: dict[str, float] = {}
    maxima: dict[str, float] = {}
    thresholds: list[float] = []
    ent_all, ent_kept, d_all, d_kept = [], [], [], []
    olds: dict[int, tuple[Tensor, Tensor]] = {}  # micro-batch j -> (π_old, kept mask), for approx_kl
    empty = _resp_of(None, None, device)
    for j, ((s, e), mb) in enumerate(zip(rows, micros, strict=True)):
        if fsdp:
            _grad_sync(model, j == n_micro - 1)
        trainable = mb is not None and bool(mb.response_mask.any())
        logp = ent = None
        if trainable:
            assert mb is not None
            logp, ent = _forward(model, mb, temperature, True)
        # the mask for this micro-batch (a collective in microbatch scope: every rank joins)
        token_mask = mb.response_mask.clone() if trainable and mb is not None else None
        if step_keep is not None:
            if trainable and mb is not None:
                token_mask = _scatter(mb.response_mask, step_keep[j])
            thresholds.append(step_threshold)
        elif loss_cfg.mask_on:
            segs = gather_segments([_resp_of(mb, ent, device)], group)
            vals = torch.cat(segs)
            res = forking_token_mask(vals.unsqueeze(0), torch.ones((1, vals.numel()), dtype=torch.bool,
                                                                   device=device), rho)
            start = sum(int(x.numel()) for x in segs[:rank])
            if trainable and mb is not None:
                token_mask = _scatter(mb.response_mask, res.mask[0, start : start + segs[rank].numel()])
            thresholds.append(res.threshold)
        elif trainable and ent is not None and mb is not None:
            thresholds.append(float(ent[mb.response_mask].min()))  # the mask is off: the min (MIN-reduced)
        if not trainable:
            _zero_loss(model, batch if mb is None else mb).backward()
            for lst in (ent_all, ent_kept, d_all, d_kept):
                lst.append(empty)
            continue
        assert logp is not None and ent is not None and token_mask is not None
        ref_logp = None
        if ref_model is not None and loss_cfg.kl_beta > 0:
            with torch.no_grad():
                ref_logp, _ = _forward(ref_model, mb, temperature, False)
        loss, m = policy_loss(loss_cfg, logp, logp.detach(), advantages[s:e], mb.response_mask, token_mask, denom,
                              ref_logp=ref_logp)
        loss.backward()
        for k, v in m.items():
            if k == "ratio_max":
                maxima[k] = max(maxima.get(k, v), v)
                continue
            if k == "ratio_min":
                maxima[k] = min(maxima.get(k, v), v)
                continue
            w = 1.0 if k in _SUMMED else m["kept_tokens"] if k.endswith("clip_frac") or "clip_frac_" in k \
                else m["response_tokens"]
            sums[k] = sums.get(k, 0.0) + v * w
        with torch.no_grad():
            resp = mb.response_mask
            ent_all.append(ent[resp])
            ent_kept.append(ent[token_mask])
            delta = (logp.detach() - mb.rollout_logp).abs()
            d_all.append(delta[resp])
            d_kept.append(delta[token_mask])
            olds[j] = (logp.detach(), token_mask)
    if not fsdp:
        _all_reduce_grads(model, group)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP2
        grad_norm = grad_norm.full_tensor()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    out = _reduce_metrics(sums, maxima, thresholds, ent_all, ent_kept, d_all, d_kept, float(grad_norm), n_micro,
                          device, group)
    kl_kept, kl_all = _approx_kl(model, batch, micros, olds, temperature, device, group)
    out.update(n_updates=1.0, grad_norm_max=out["grad_norm"], approx_kl=kl_kept, approx_kl_all=kl_all)
    return out


def _approx_kl(model: torch.nn.Module, batch: Batch, micros: Sequence[Batch | None],
               olds: dict[int, tuple[Tensor, Tensor]], temperature: float, device: torch.device,
               group: dist.ProcessGroup | None) -> tuple[float, float]:
    """train_step's approx_kl over the ranks: k3 of KL(π_old ‖ π_new) after the update, on kept and all
    tokens; every rank runs a forward per micro-batch (FSDP's all-gathers), sums travel in one all_reduce."""
    sums = torch.zeros(4, dtype=torch.float64, device=device)  # kept sum, kept n, all sum, all n
    with torch.no_grad():
        for j, mb in enumerate(micros):
            if j not in olds or mb is None:
                _zero_loss(model, batch if mb is None else mb)
                continue
            old, kept = olds[j]
            logp, _ = _forward(model, mb, temperature, False)
            d = (logp - old).double().clamp(-20.0, 20.0)
            k3 = d.exp() - d - 1.0
            sums += torch.stack([k3[kept].sum(), kept.sum().double(), k3[mb.response_mask].sum(),
                                 mb.response_mask.sum().double()])
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    return float(sums[0] / sums[1].clamp(min=1)), float(sums[2] / sums[3].clamp(min=1))


def _min_all(values: list[float], device: torch.device, group: dist.ProcessGroup | None) -> float:
    t = torch.tensor([min(values, default=float("inf"))], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return float(t)


def _reduce_metrics(sums: dict[str, float], maxima: dict[str, float], thresholds: list[float],
                    ent_all: list[Tensor], ent_kept: list[Tensor], d_all: list[Tensor], d_kept: list[Tensor],
                    grad_norm: float, n_micro: int, device: torch.device,
                    group: dist.ProcessGroup | None) -> dict[str, float]:
    """train_step's metrics over every rank: sums SUM, maxima MAX, value tensors gathered in 1-rank order."""
    # Every rank that trained a micro-batch has the same keys; a rank with none has an empty dict, so the
    # key list travels with the values (rank 0 may be the empty one, hence all_gather_object).
    keys_per_rank: list[list[str] | None] = [None] * dp_rank_world(group)[1]
    dist.all_gather_object(keys_per_rank, sorted(sums), group=group)
    keys = sorted({k for ks in keys_per_rank if ks for k in ks})
    vec = torch.tensor([sums.get(k, 0.0) for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(vec, op=dist.ReduceOp.SUM, group=group)
    tot = dict(zip(keys, vec.tolist(), strict=True))
    out: dict[str, float] = {}
    n_resp, n_kept = tot["response_tokens"], max(tot["kept_tokens"], 1.0)
    for k, v in tot.items():
        out[k] = v if k in _SUMMED else v / (n_kept if k.endswith("clip_frac") or "clip_frac_" in k else n_resp)
    if any("ratio" in k for k in keys):
        mx = torch.tensor([maxima.get("ratio_max", -float("inf"))], dtype=torch.float64, device=device)
        dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=group)
        mn = torch.tensor([maxima.get("ratio_min", float("inf"))], dtype=torch.float64, device=device)
        dist.all_reduce(mn, op=dist.ReduceOp.MIN, group=group)
        out["ratio_max"], out["ratio_min"] = float(mx), float(mn)
    out["kept_frac"] = tot["kept_tokens"] / n_resp
    ea, ek, da, dk = (torch.cat(gather_segments(x, group)) for x in (ent_all, ent_kept, d_all, d_kept))
    p50, p80, p90, p99 = _quantiles(ea, (0.5, 0.8, 0.9, 0.99))
    out.update(
        entropy_mean=float(ea.mean()), entropy_p50=p50, entropy_p80=p80, entropy_p90=p90, entropy_p99=p99,
        entropy_kept_mean=float(ek.mean()) if ek.numel() else 0.0,
        mask_threshold=_min_all(thresholds, device, group), grad_norm=grad_norm,
        logp_delta_mean=float(da.mean()), logp_delta_max=float(da.max()),
        logp_delta_kept_mean=float(dk.mean()) if dk.numel() else 0.0,
        logp_delta_kept_max=float(dk.max()) if dk.numel() else 0.0,
        micro_batches=float(n_micro),
    )
    return out
