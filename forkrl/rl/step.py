"""The train step: the optimizer updates of one rollout batch on 1..N ranks (pure torch, no I/O).

    batch = build_batch(prompt_ids, completion_ids, rollout_logprobs, pad_id)      # forkrl/rl/batch.py
    metrics = train_step(model, optimizer, batch, advantages, loss_cfg, temperature=1.0,
                         micro_batch_size=64, max_grad_norm=1.0)                 # one update (default)
    metrics = train_step(..., mini_batch_size=32 * G, epochs=1)                  # B/32 updates (PPO/DAPO)
    metrics = train_step(..., max_tokens_per_micro_batch=32768)                 # micro-batches by tokens
    metrics = train_step(..., max_tokens_per_micro_batch=32768, pack_sequences=True)  # one packed row each
    metrics = train_step(..., stop=event.is_set, skipped_out=reasons)           # the guards (below)

Ranks (docs/scaling.md). Under torch.distributed every rank of `group` passes the **whole** batch and its
advantages (computed per group from all rewards: step-global without a collective); with one process, or a group
of one rank, no collective runs. Every rank computes the same plan (forkrl/rl/microbatch.py): the mini-batches, and
per mini-batch the micro-batch slots with each rank's rows. Fixed micro-batches (`micro_batch_size`): each global
micro-batch is dealt to the ranks in contiguous rank-ordered row blocks (forkrl/rl/collectives.py `deal`), so rank
r's rows follow rank r-1's in the 1-rank order. Micro-batches by tokens (`max_tokens_per_micro_batch` T): the rows
of each mini-batch are packed by length into micro-batches of at most T padded tokens, which are dealt to the ranks
balanced by tokens; a rank with fewer of them joins the others' slots with empty shares. Everything step-global is
computed across ranks: the denominators from all-reduced counts, the forking-token top-k over the all-gathered
entropies (the very same `forking_token_mask` / `masks_for_step` selects, ties included; in step scope over the
entropies in batch-row order, so the kept set does not depend on the plan), gradients summed (FSDP2
reduce-scatter with divide factor 1, after every micro-batch by default or on an update's last one with
grad_sync="last"; a replicated model: one all_reduce per parameter), metrics reduced (forkrl/rl/step_metrics.py).
A rank whose share of a micro-batch holds no response token still runs a forward (and a backward of 0 x its
log-probs) under FSDP2, which needs every rank in every all-gather and reduce-scatter. N ranks therefore equal
one rank up to float32 rounding of the summation order; counts are exact (tests/dist/test_dp_equals_one_rank.py).
Likewise micro-batches by tokens equal fixed ones (step scope; the micro-batch scope needs fixed micro-batches:
docs/algorithms-departures.md §6), on 1 and N ranks (tests/unit/test_microbatch.py,
tests/dist/test_token_budget_ranks.py); only the `micro_batches` count differs. So do packed sequences
(`pack_sequences`: each token-budget micro-batch one row, its sequences end to end with position ids restarting,
no padding; forkrl/rl/forward.py `packed_rows`).

What happens (algorithms.md §0-§3, §3.8):
1. The batch is split into mini-batches of `mini_batch_size` sequences (default: one = the whole batch); the
   caller passes a multiple of the group size so that groups stay whole. Every mini-batch is one optimizer
   update, repeated for `epochs` passes over the batch (same order every epoch).
2. π_old (the "proximal" policy of §3.8): with one update in all, the detached log-probs of that update's own
   forward pass (the single-update arithmetic, ratios exactly 1). With several updates, one no-grad pass before
   the first update over every micro-batch (the same slicing as the updates), so later updates' ratios measure
   how far the policy moved since the batch began and the clip acts.
3. Each update: its mini-batch is split into micro-batches (rows of only empty completions, e.g. aborted
   samples, are skipped); the denominators of the mini-batch (kept tokens, response tokens, sequences) are
   computed once, before any backward, from token counts alone (§2.3). For `mask_scope="step"` a no-grad pass
   first computes the entropies of every micro-batch of the mini-batch so that one top-k is taken over the whole
   update. Per micro-batch: forward (fp32 master weights) → logp and entropy at the sampling temperature from the
   final hidden states of the response positions, chunk by chunk (forkrl/rl/entropy.py: the logits of the
   micro-batch are never materialized, the backward recomputes each chunk's) → forking-token mask (entropy of the
   *current* weights, §1.3) → the optional truncated-IS weight (forkrl/rl/tis.py, `loss_cfg.tis_cap`; for CISPO
   the behaviour log-probs become its IS weight's denominator instead) → the loss's share of the update loss →
   backward. Then the guard, the gradient clip and the optimizer step.
4. With `kl_pass` (off by default: it costs one more forward over the batch; docs/results.md has its share),
   after the last update one no-grad pass gives approx_kl = k3 estimate of KL(π_old ‖ π_new) on the kept tokens
   of each micro-batch's last update (and on all response tokens: approx_kl_all). Always, and free: the loss
   passes' approx_kl_start (forkrl/rl/step_metrics.py), the KL from π_old to the weights each update starts from.

Guards. Before each optimizer step: a non-finite loss (on any rank) or gradient norm skips that update (the
gradients are dropped, no optimizer step: weights and optimizer state unchanged); it is counted
(`skipped_updates`) and described in `skipped_out` (the loss, or the first parameter whose gradient is
non-finite). Stop: `stop()` (rank 0's; the other ranks pass None) is read before every micro-batch of every
pass and before each optimizer step, MAX-reduced over the ranks, so all of them stop at the same point; the
update in progress is abandoned (its half-accumulated gradient is never stepped). If no update of the step was
applied yet, `StepStopped` is raised (weights and optimizer state as before the step); otherwise the metrics
of the updates applied come back with `stopped` = 1.

Metrics: forkrl/rl/step_metrics.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

from forkrl.rl.batch import Batch, build_batch
from forkrl.rl.collectives import (
    GradSync,
    first_nonfinite,
    gather_segments,
    is_fsdp,
    rank_world,
    reduce_floats,
    reshard_root,
    set_grad_sync,
    sum_replicated_grads,
)
from forkrl.rl.entropy import causal_lm_logprobs_and_entropy
from forkrl.rl.head import check_packing
from forkrl.rl.losses import LossConfig, StepDenominator, policy_loss
from forkrl.rl.mask import forking_token_mask, kept_denominator, masks_for_step
from forkrl.rl.microbatch import Plan, fixed_plan, token_plan
from forkrl.rl.options import check_budget_scope, check_pack_budget
from forkrl.rl.step_metrics import Tally, record_micro, step_metrics
from forkrl.rl.tis import tis_weights
from forkrl.rl.varlen import varlen_attention

__all__ = ["Batch", "StepStopped", "build_batch", "train_step"]


class StepStopped(Exception):
    """A stop arrived before any update of the step was applied: weights and optimizer state are as before it."""


class _Stop(Exception):
    pass


def _forward(model: torch.nn.Module, mb: Batch, temperature: float, with_entropy: bool,
             response_mask: Tensor | None = None, pack: bool = False) -> tuple[Tensor, Tensor | None]:
    """logp and entropy [b, L-1] of the response tokens, from the final hidden states in chunks (forkrl/rl/entropy.py:
    the logits of the micro-batch never exist as a whole), each distinct prompt computed once (forkrl/rl/forward.py)
    except under FSDP2 or activation checkpointing, or with `pack` the rows packed into one row without padding.
    `response_mask` overrides the batch's (the join: none)."""
    share = not is_fsdp(model) and not getattr(model, "is_gradient_checkpointing", False)
    out = causal_lm_logprobs_and_entropy(model, mb.input_ids, mb.attention_mask,
                                         mb.response_mask if response_mask is None else response_mask,
                                         temperature=temperature, with_entropy=with_entropy, share_prefix=share,
                                         pack=pack)
    if not torch.is_grad_enabled():
        reshard_root(model)  # no backward will: free the root unit's gathered parameters now
    return out


@dataclass(frozen=True)
class _Micro:
    """This rank's share of one micro-batch slot (forkrl/rl/microbatch.py): its batch rows (ascending), their
    indices on the device, and mb None when they hold no response token (no rows, or only empty completions)."""

    rows: list[int]
    idx: Tensor
    mb: Batch | None


@dataclass
class _Ctx:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    cfg: LossConfig
    temperature: float
    ref_model: torch.nn.Module | None
    group: dist.ProcessGroup | None
    rank: int
    world: int
    device: torch.device
    batch: Batch
    stop: Callable[[], bool] | None
    grad_sync: GradSync
    resp: list[int]  # completion tokens per batch row
    pack: bool  # packed sequences: each micro-batch one row (forkrl/rl/forward.py `packed_rows`)

    def flags(self, *local: float) -> tuple[bool, list[float]]:
        """(stop requested on any rank, the MAX over ranks of `local`): one all_reduce on N ranks."""
        out = reduce_floats([1.0 if self.stop is not None and self.stop() else 0.0, *local], "max", self.device,
                            self.group)
        return out[0] > 0, out[1:]

    def check_stop(self) -> None:
        if self.flags()[0]:
            raise _Stop

    def forward(self, mb: Batch, with_entropy: bool) -> tuple[Tensor, Tensor | None]:
        return _forward(self.model, mb, self.temperature, with_entropy, pack=self.pack)

    def join(self, grad: bool) -> Tensor | None:
        """A share without tokens under FSDP2: a forward on one row scoring no token, so this rank joins the
        all-gathers of the others; with grad, returns 0 x (the sum of no log-prob), whose backward reaches every
        parameter with zeros (the lm_head's from the loss path itself), so this rank joins the reduce-scatters with
        the same tensors as the others and adds no gradient."""
        if not is_fsdp(self.model):
            return None
        one = self.batch.slice(0, 1).to(self.device)
        with torch.set_grad_enabled(grad):
            logp, _ = _forward(self.model, one, self.temperature, False, torch.zeros_like(one.response_mask),
                               self.pack)
        return logp.sum() * 0.0 if grad else None

    def local(self, slot: list[list[int]]) -> _Micro:
        rows = slot[self.rank]
        has = any(self.resp[i] for i in rows)
        return _Micro(rows, torch.tensor(rows, dtype=torch.long, device=self.device),
                      self.batch.select(rows).to(self.device) if has else None)


def _denominator(ctx: _Ctx, mus: list[_Micro]) -> StepDenominator:
    """The update's denominators from the counts of every rank (all-reduced), before any backward (§0, §2.3)."""
    local: list[float] = []
    for mu in mus:
        rm = mu.mb.response_mask if mu.mb is not None else None
        local += [float(rm.sum()), float(rm.any(dim=-1).sum())] if rm is not None else [0.0, 0.0]
    tot = reduce_floats(local, "sum", ctx.device, ctx.group)
    counts = [int(c) for c in tot[0::2]]
    n_resp, seqs = sum(counts), int(sum(tot[1::2]))
    cfg = ctx.cfg
    pg = kept_denominator(counts, cfg.entropy_top_frac, cfg.mask_scope) if cfg.mask_on and cfg.norm == "kept" \
        else n_resp
    return StepDenominator(pg_tokens=pg, response_tokens=n_resp, seqs=seqs)


def _resp_entropy(mu: _Micro, ent: Tensor | None, device: torch.device) -> Tensor:
    if mu.mb is None or ent is None:
        return torch.zeros(0, dtype=torch.float32, device=device)
    return ent.detach()[mu.mb.response_mask].float()


def _by_row(ctx: _Ctx, slots: list[list[list[int]]], segs: list[Tensor]) -> dict[int, Tensor]:
    """Each row's part of gathered per-(slot, rank) segments over response tokens (gather_segments' order)."""
    out = {}
    for idx, seg in enumerate(segs):
        rows = slots[idx // ctx.world][idx % ctx.world]
        out.update(zip(rows, torch.split(seg, [ctx.resp[i] for i in rows]), strict=True))
    return out


def _step_scope_keep(ctx: _Ctx, slots: list[list[list[int]]], mus: list[_Micro]) -> tuple[list[Tensor], float]:
    """Step scope: this rank's kept flags per micro-batch (over its response tokens) and the step threshold, from
    one top-k over the entropies of the whole update gathered from every rank and laid out in batch-row order, so
    that the kept set (ties included: the earlier row wins) does not depend on how the rows were grouped into
    micro-batches or dealt to ranks (fixed or token-budget micro-batches, any number of ranks)."""
    ents = []
    with torch.no_grad():
        for mu in mus:
            ctx.check_stop()
            if mu.mb is None:
                ctx.join(grad=False)
            ents.append(_resp_entropy(mu, ctx.forward(mu.mb, True)[1] if mu.mb is not None else None, ctx.device))
    per_row = _by_row(ctx, slots, gather_segments(ents, ctx.group))
    order = sorted(per_row)
    flat = torch.cat([per_row[i] for i in order])
    res = masks_for_step([flat.unsqueeze(0)], [torch.ones((1, flat.numel()), dtype=torch.bool, device=ctx.device)],
                         ctx.cfg.entropy_top_frac, "step")[0]
    kept = dict(zip(order, torch.split(res.mask[0], [ctx.resp[i] for i in order]), strict=True))
    none = torch.zeros(0, dtype=torch.bool, device=ctx.device)
    return [torch.cat([kept[i] for i in mu.rows]) if mu.rows else none for mu in mus], res.threshold


def _micro_keep(ctx: _Ctx, mu: _Micro, ent: Tensor | None) -> tuple[Tensor | None, float]:
    """Micro-batch scope: this rank's kept flags (None: all) and the threshold; a collective when the mask is on."""
    vals = _resp_entropy(mu, ent, ctx.device)
    if not ctx.cfg.mask_on:  # off: the threshold is the lowest entropy (MIN-reduced with the metrics)
        return None, float(vals.min()) if vals.numel() else math.inf
    segs = gather_segments([vals], ctx.group)
    flat = torch.cat(segs)
    res = forking_token_mask(flat.unsqueeze(0), torch.ones((1, flat.numel()), dtype=torch.bool, device=ctx.device),
                             ctx.cfg.entropy_top_frac)
    start = sum(int(s.numel()) for s in segs[: ctx.rank])
    return res.mask[0, start : start + vals.numel()], res.threshold


def _update(ctx: _Ctx, k: int, slots: list[list[list[int]]], mus: list[_Micro], old: list[Tensor | None] | None,
            advantages: Tensor, max_grad_norm: float, acc: Tally, last: dict, skipped_out: list[str] | None) -> bool:
    """One optimizer update on mini-batch k; True when applied, False when the guard skipped it. Its metrics
    and kept masks join `acc` and `last` only when it ran to its end."""
    cfg, model, opt = ctx.cfg, ctx.model, ctx.optimizer
    denom = _denominator(ctx, mus)
    step_keep = _step_scope_keep(ctx, slots, mus) if cfg.mask_on and cfg.mask_scope == "step" else None
    model.train()
    opt.zero_grad(set_to_none=True)
    upd, seen, loss_bad = Tally(), {}, 0.0
    for j, mu in enumerate(mus):
        ctx.check_stop()
        set_grad_sync(model, ctx.grad_sync == "every" or j == len(mus) - 1)
        # the same collectives in the same order on every rank: the forward's, the mask's, the backward's
        zero = ctx.join(grad=True) if mu.mb is None else None
        logp, ent = ctx.forward(mu.mb, True) if mu.mb is not None else (None, None)
        keep, threshold = (step_keep[0][j], step_keep[1]) if step_keep is not None else _micro_keep(ctx, mu, ent)
        mb = mu.mb
        if mb is None or logp is None or ent is None:
            if zero is not None:
                zero.backward()
            upd.entropies.append(_resp_entropy(mu, None, ctx.device))
            seen[(k, j)] = None
            continue
        resp = mb.response_mask
        token_mask = resp.clone()
        if keep is not None:
            token_mask = torch.zeros_like(resp)
            token_mask[resp] = keep
        ref_logp = None
        if ctx.ref_model is not None and cfg.kl_beta > 0:
            with torch.no_grad():
                ref_logp, _ = _forward(ctx.ref_model, mb, ctx.temperature, False, pack=ctx.pack)
        old_logp = logp.detach() if old is None or old[j] is None else old[j]
        assert old_logp is not None
        is_weight = behav_logp = raw = None
        if cfg.tis_cap is not None:
            is_weight, raw = tis_weights(old_logp, mb.rollout_logp, resp, cfg.tis_cap, per_sequence=cfg.name == "gspo")
            if cfg.name == "cispo":  # its own IS weight takes π_behav as denominator, no extra w_t (§3.8)
                is_weight, behav_logp = None, mb.rollout_logp
        loss, m = policy_loss(cfg, logp, old_logp, advantages[mu.idx], resp, token_mask, denom,
                              ref_logp=ref_logp, is_weight=is_weight, behav_logp=behav_logp)
        loss.backward()
        loss_bad = max(loss_bad, 0.0 if math.isfinite(m["loss"]) else 1.0)
        with torch.no_grad():
            record_micro(upd, m, ent[resp].float(), (old_logp - mb.rollout_logp).abs()[resp], token_mask[resp],
                         threshold, None if raw is None else raw[resp], cfg.tis_cap, (logp - old_logp)[resp])
        seen[(k, j)] = (old_logp.detach(), token_mask)
    sum_replicated_grads(model, ctx.group)
    stop, (bad,) = ctx.flags(loss_bad)  # the stop and the loss check: the same decision on every rank
    if stop:
        raise _Stop
    params = list(model.parameters())
    total = get_total_norm([p.grad for p in params if p.grad is not None])
    norm = float(total.full_tensor() if hasattr(total, "full_tensor") else total)  # FSDP2: a DTensor
    upd.grad_norms.append(norm)
    applied = bad == 0 and math.isfinite(norm)
    if applied:
        clip_grads_with_norm_(params, max_grad_norm, total)
        opt.step()
    else:  # skipped: say why (the search for the first bad gradient is a collective: every rank runs it)
        name = None if bad else first_nonfinite([(n, p.grad) for n, p in model.named_parameters()], ctx.device,
                                                ctx.group)
        what = "the loss is non-finite" if bad else f"the gradient of {name} is non-finite" if name \
            else "every gradient is finite but their norm overflows"
        if skipped_out is not None:
            skipped_out.append(f"{what} (grad norm {norm:g})")
    opt.zero_grad(set_to_none=True)
    acc.merge(upd)
    last.update(seen)
    return applied


def _approx_kl(ctx: _Ctx, micros: list[list[_Micro]], last: dict) -> tuple[float, float]:
    """k3 of KL(π_old ‖ π_now) (r = π_now / π_old, k3 = r - 1 - log r >= 0) on the kept and on all response
    tokens of each micro-batch's last update; sums all-reduced."""
    sums = [0.0, 0.0, 0.0, 0.0]  # kept sum, kept n, all sum, all n
    with torch.no_grad():
        for k, mus in enumerate(micros):
            for j, mu in enumerate(mus):
                ctx.check_stop()
                entry = last.get((k, j))
                if mu.mb is None or entry is None:
                    ctx.join(grad=False)
                    continue
                old, kept = entry
                logp, _ = ctx.forward(mu.mb, False)
                d = (logp - old).double().clamp(-20.0, 20.0)
                k3 = d.exp() - d - 1.0
                resp = mu.mb.response_mask
                sums = [a + float(b) for a, b in zip(sums, (k3[kept].sum(), kept.sum(), k3[resp].sum(), resp.sum()),
                                                     strict=True)]
    tot = reduce_floats(sums, "sum", ctx.device, ctx.group)
    return tot[0] / max(tot[1], 1.0), tot[2] / max(tot[3], 1.0)


def _kept_rows(ctx: _Ctx, plan: Plan, micros: list[list[_Micro]], last: dict) -> list[Tensor]:
    """One bool CPU tensor per sequence over its completion tokens: True where the last update's mask kept it,
    gathered from every rank and put back in batch order."""
    segs = []
    for k, mus in enumerate(micros):
        for j, mu in enumerate(mus):
            entry = last.get((k, j))
            keep = entry[1][mu.mb.response_mask] if entry is not None and mu.mb is not None else \
                torch.zeros(0, dtype=torch.bool, device=ctx.device)
            segs.append(keep.to(torch.uint8))
    per_row = _by_row(ctx, [slot for slots in plan for slot in slots], gather_segments(segs, ctx.group))
    # rows of a left-out micro-batch (only empty completions) keep nothing
    none = torch.zeros(0, dtype=torch.bool)
    return [per_row[i].bool().cpu() if i in per_row else none for i in range(len(ctx.batch))]


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    advantages: Tensor,
    loss_cfg: LossConfig,
    *,
    temperature: float,
    micro_batch_size: int,
    max_grad_norm: float,
    max_tokens_per_micro_batch: int = 0,
    pack_sequences: bool = False,
    ref_model: torch.nn.Module | None = None,
    mini_batch_size: int | None = None,
    epochs: int = 1,
    kept_out: list[Tensor] | None = None,
    skipped_out: list[str] | None = None,
    stop: Callable[[], bool] | None = None,
    group: dist.ProcessGroup | None = None,
    grad_sync: GradSync = "every",
    kl_pass: bool = False,
) -> dict[str, float]:
    """The optimizer updates of one rollout batch on every rank of `group` (the default group; one process: no
    collective); returns the step's floats, equal on every rank (module docstring).

    advantages: [N] per sequence (same order as the batch). micro_batch_size: sequences per global micro-batch
    (dealt to the ranks). max_tokens_per_micro_batch: T > 0 groups each mini-batch's rows by length into
    micro-batches of at most T padded tokens each (rows x longest row; a longer row alone), dealt to the ranks by
    tokens (forkrl/rl/microbatch.py), instead of micro_batch_size; with the mask on it needs mask_scope "step".
    pack_sequences: with the budget, each micro-batch is one row of at most T tokens holding its sequences end to
    end, no padding (forkrl/rl/forward.py `packed_rows`; UnsupportedModel for a model it is not checked on).
    mini_batch_size: sequences per update (None or >= N: one update on the whole batch);
    pass a multiple of the group size to keep groups whole. epochs: passes over the batch.
    kept_out: receives one bool CPU tensor per sequence, in batch order, over its completion tokens: True where
    the mask of its last update kept the token (left empty when a stop cut the step short); a gather on N
    ranks: pass it on every rank or on none.
    skipped_out: receives one sentence per update the guard skipped. stop: polled before every micro-batch and
    optimizer step (module docstring); raises StepStopped when no update was applied yet.
    grad_sync: FSDP2 only (forkrl/rl/collectives.py `GradSync`): "every" (default) reduce-scatters each micro-batch's
    gradient, so gradients stay sharded; "last" accumulates them unsharded and reduce-scatters once per update.
    kl_pass: one more no-grad forward after the last update for approx_kl / approx_kl_all (module docstring, 4.).
    """
    n = len(batch)
    if advantages.shape != (n,):
        raise ValueError(f"advantages must have shape ({n},) (one per sequence), got {tuple(advantages.shape)}")
    if mini_batch_size is not None and mini_batch_size < 1:
        raise ValueError(f"mini_batch_size must be >= 1 or None, got {mini_batch_size}")
    if epochs < 1:
        raise ValueError(f"epochs must be >= 1, got {epochs}")
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    if max_tokens_per_micro_batch < 0:
        raise ValueError(f"max_tokens_per_micro_batch must be >= 0 (0 = off), got {max_tokens_per_micro_batch}")
    check_budget_scope(max_tokens_per_micro_batch, loss_cfg.mask_on, loss_cfg.mask_scope)
    check_pack_budget(pack_sequences, max_tokens_per_micro_batch)
    if pack_sequences:  # before any work: a model where packing is not each sequence's own forward
        check_packing(model.config, getattr(model.config, "_attn_implementation", None))
    if grad_sync not in ("every", "last"):
        raise ValueError(f"grad_sync must be 'every' or 'last', got {grad_sync!r}")
    device = next(model.parameters()).device
    rank, world = rank_world(group)
    resp = batch.response_mask.sum(dim=1).tolist()
    ctx = _Ctx(model, optimizer, loss_cfg, temperature, ref_model, group, rank, world, device, batch, stop, grad_sync,
               resp, pack_sequences)
    mini = n if mini_batch_size is None else min(mini_batch_size, n)
    plan = token_plan(batch.attention_mask.sum(dim=1).tolist(), resp, mini, max_tokens_per_micro_batch, world,
                      packed=pack_sequences) if max_tokens_per_micro_batch \
        else fixed_plan(resp, mini, micro_batch_size, world)
    if not plan:
        raise ValueError(f"all {n} completions of the step are empty (0 tokens): nothing to train on")
    # packed rows attend within each sequence only (sdpa models), also in activation checkpointing's recompute
    with varlen_attention(*((model, ref_model) if pack_sequences else ())):
        advantages = advantages.to(device)
        micros = [[ctx.local(slot) for slot in slots] for slots in plan]
        acc, last = Tally(), {}
        applied = skipped = 0
        stopped = False
        try:
            old: list[list[Tensor | None]] | None = None
            if len(plan) * epochs > 1:  # π_old: the weights before the first update, on the same micro-batches (§3.8)
                model.train()
                old = []
                with torch.no_grad():
                    for mus in micros:
                        old.append([])
                        for mu in mus:
                            ctx.check_stop()
                            if mu.mb is None:
                                ctx.join(grad=False)
                            old[-1].append(ctx.forward(mu.mb, False)[0] if mu.mb is not None else None)
            for _ in range(epochs):
                for k, mus in enumerate(micros):
                    if _update(ctx, k, plan[k], mus, None if old is None else old[k], advantages, max_grad_norm, acc,
                               last, skipped_out):
                        applied += 1
                    else:
                        skipped += 1
        except _Stop:
            # the abandoned update's half-accumulated gradient (under FSDP2 with grad_sync="last" the unsynced
            # micro-batches' part also sits on the unsharded parameters until the next synced backward: a stopped run
            # trains no more)
            optimizer.zero_grad(set_to_none=True)
            if applied == 0:
                raise StepStopped("the stop arrived before any update of the step was applied") from None
            stopped = True
        out = step_metrics(acc, n_applied=applied, n_skipped=skipped, micro_batches=sum(len(b) for b in plan),
                           tis_on=loss_cfg.tis_cap is not None, device=device, group=group)
        if stopped:
            out["stopped"] = 1.0
            return out
        if kl_pass:
            try:
                out["approx_kl"], out["approx_kl_all"] = _approx_kl(ctx, micros, last)
            except _Stop:  # every update is applied: only this telemetry is left out
                return out
        if kept_out is not None:
            kept_out.extend(_kept_rows(ctx, plan, micros, last))
        return out
