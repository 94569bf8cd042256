"""Optimizer updates of policy-gradient training on one rollout batch (pure torch, no I/O).

    batch = build_batch(prompt_ids, completion_ids, rollout_logprobs, pad_id)
    metrics = train_step(model, optimizer, batch, advantages, loss_cfg, temperature=1.0,
                         micro_batch_size=64, max_grad_norm=1.0)                 # one update (default)
    metrics = train_step(..., mini_batch_size=32 * G, epochs=1)                  # B/32 updates (PPO/DAPO)

What happens (algorithms.md §0–§3, §3.8):
1. The batch is split into mini-batches of `mini_batch_size` sequences (default: one mini-batch = the whole
   batch); the caller passes a multiple of the group size so that groups stay whole. Every mini-batch is one
   optimizer update, repeated for `epochs` passes over the batch (same order every epoch).
2. π_old (the "proximal" policy of §3.8): with one update in all, the detached log-probs of that update's own
   forward pass — exactly the single-update arithmetic, ratios exactly 1. With several updates, one no-grad
   pass before the first update over every micro-batch (the same slicing as the updates), so the ratio of
   later updates measures how far the policy moved since the batch began and the clip acts.
3. Each update: its mini-batch is split into micro-batches (one with only empty completions, e.g. aborted
   samples, is skipped); the global denominators of the mini-batch (kept
   tokens, response tokens, sequences) are computed once, before any backward, from token counts alone
   (§2.3). For `mask_scope="step"` a no-grad pass first computes the entropies of every micro-batch of the
   mini-batch so that one top-k is taken over the whole update. Per micro-batch: forward in fp32 → logp and
   entropy at the sampling temperature in one chunked pass → forking-token mask (entropy of the *current*
   weights, §1.3) → the optional truncated-IS weight (forkrl/rl/tis.py, `loss_cfg.tis_cap`; for CISPO the
   behaviour log-probs become its IS weight's denominator instead) → the loss's
   share of the update loss → backward. Then gradient clipping and the optimizer step.
4. After the last update, one no-grad pass gives approx_kl = k3 estimate of KL(π_old ‖ π_new) on the kept
   tokens of each micro-batch's last update (and on all response tokens: approx_kl_all).

Metrics (floats): loss, pg_loss, kl_loss and grad_norm are means over updates (grad_norm_max the largest
pre-clip norm); clip fractions are over the kept tokens of all updates, ratio_mean/min/max over their response
tokens; kept_tokens and response_tokens are summed over updates (E epochs count every token E times);
entropy statistics, mask_threshold (the lowest) and the trainer-vs-rollout |Δlogp| (π_old vs the engine's
log-probs, §6 P6) are over the tokens of every update; n_updates, micro_batches (per epoch).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from forkrl.rl.entropy import response_logprobs_and_entropy, shift_for_causal_lm
from forkrl.rl.losses import LossConfig, policy_loss, step_denominator
from forkrl.rl.mask import MaskResult, forking_token_mask, masks_for_step
from forkrl.rl.tis import tis_metrics, tis_weights


@dataclass
class Batch:
    """Right-padded trajectories. Shapes: N sequences, L = longest prompt+completion.

    input_ids [N, L] long; attention_mask [N, L] long; response_mask [N, L-1] bool, True where the
    *target* token (input_ids[:, 1:]) is a completion token; rollout_logp [N, L-1] fp32, the engine's
    log-probs at those positions (0 elsewhere).
    """

    input_ids: Tensor
    attention_mask: Tensor
    response_mask: Tensor
    rollout_logp: Tensor

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def to(self, device: torch.device | str) -> Batch:
        return Batch(*(t.to(device, non_blocking=True) for t in
                       (self.input_ids, self.attention_mask, self.response_mask, self.rollout_logp)))

    def slice(self, start: int, stop: int) -> Batch:
        # Trim the padding columns this micro-batch does not need (saves attention and lm_head work).
        width = int(self.attention_mask[start:stop].sum(dim=1).max())
        return Batch(self.input_ids[start:stop, :width], self.attention_mask[start:stop, :width],
                     self.response_mask[start:stop, : width - 1], self.rollout_logp[start:stop, : width - 1])


def build_batch(
    prompt_ids: list[list[int]], completion_ids: list[list[int]], rollout_logprobs: list[list[float]], pad_id: int
) -> Batch:
    if not (len(prompt_ids) == len(completion_ids) == len(rollout_logprobs)):
        raise ValueError(f"got {len(prompt_ids)} prompts, {len(completion_ids)} completions and "
                         f"{len(rollout_logprobs)} logprob lists; they must match")
    if not prompt_ids:
        raise ValueError("build_batch needs at least one trajectory")
    width = max(len(p) + len(c) for p, c in zip(prompt_ids, completion_ids, strict=False))
    n = len(prompt_ids)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.long)
    response = torch.zeros((n, width - 1), dtype=torch.bool)
    rollout = torch.zeros((n, width - 1), dtype=torch.float32)
    for i, (p, c, lp) in enumerate(zip(prompt_ids, completion_ids, rollout_logprobs, strict=False)):
        if not p:
            raise ValueError(f"trajectory {i} has an empty prompt (a causal LM needs a token to condition on)")
        if len(lp) != len(c):
            raise ValueError(f"trajectory {i}: {len(c)} completion tokens but {len(lp)} logprobs")
        seq = list(p) + list(c)
        input_ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        attention[i, : len(seq)] = 1
        # target index j predicts input_ids[j + 1]: completion token k sits at len(p) + k, target len(p)+k-1
        response[i, len(p) - 1 : len(p) - 1 + len(c)] = True
        if c:
            rollout[i, len(p) - 1 : len(p) - 1 + len(c)] = torch.tensor(lp, dtype=torch.float32)
    return Batch(input_ids, attention, response, rollout)


_SUMMED = ("loss", "pg_loss", "kl_loss", "kept_tokens", "response_tokens")
_PER_UPDATE = ("loss", "pg_loss", "kl_loss")  # shares of one update's loss: averaged over updates


def _forward(model: torch.nn.Module, mb: Batch, temperature: float, with_entropy: bool) -> tuple[Tensor, Tensor | None]:
    logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits
    logits, targets = shift_for_causal_lm(logits, mb.input_ids)
    return response_logprobs_and_entropy(logits, targets, mb.response_mask, temperature=temperature,
                                         with_entropy=with_entropy)


def _quantiles(values: Tensor, qs: tuple[float, ...]) -> list[float]:
    if values.numel() == 0:
        return [0.0] * len(qs)
    s = values.double().sort().values
    return [float(s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]) for q in qs]


@dataclass
class _Acc:
    """What the updates of one batch accumulate for the step's metrics."""

    sums: dict[str, float] = field(default_factory=dict)
    all_ent: list[Tensor] = field(default_factory=list)
    kept_ent: list[Tensor] = field(default_factory=list)
    d_all: list[Tensor] = field(default_factory=list)
    d_kept: list[Tensor] = field(default_factory=list)
    thresholds: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    tis: list[tuple[Tensor, Tensor, Tensor]] = field(default_factory=list)  # (raw ratio, resp, kept) per micro
    # per micro-batch (mini-batch k, micro j): π_old and the kept mask of its last update, for approx_kl
    old: dict[tuple[int, int], Tensor] = field(default_factory=dict)
    kept: dict[tuple[int, int], Tensor] = field(default_factory=dict)


def _update(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    k: int,
    bounds: list[tuple[int, int]],
    micros: list[Batch],
    old_logps: list[Tensor] | None,
    advantages: Tensor,
    loss_cfg: LossConfig,
    temperature: float,
    max_grad_norm: float,
    ref_model: torch.nn.Module | None,
    acc: _Acc,
) -> None:
    """One optimizer update on mini-batch k (its micro-batches), accumulating metrics into acc."""
    rho, scope = loss_cfg.entropy_top_frac, loss_cfg.mask_scope
    denom = step_denominator(loss_cfg, [mb.response_mask for mb in micros])

    step_masks: list[MaskResult] | None = None
    if loss_cfg.mask_on and scope == "step":
        with torch.no_grad():
            ents = [_forward(model, mb, temperature, True)[1] for mb in micros]
        step_masks = masks_for_step(ents, [mb.response_mask for mb in micros], rho, "step")

    model.train()
    optimizer.zero_grad(set_to_none=True)
    sums = acc.sums
    for j, ((s, e), mb) in enumerate(zip(bounds, micros, strict=False)):
        logp, ent = _forward(model, mb, temperature, True)
        assert ent is not None
        if step_masks is not None:
            res = step_masks[j]
        else:
            res = forking_token_mask(ent, mb.response_mask, rho)
        token_mask = res.mask
        acc.thresholds.append(res.threshold)
        ref_logp = None
        if ref_model is not None and loss_cfg.kl_beta > 0:
            with torch.no_grad():
                ref_logp, _ = _forward(ref_model, mb, temperature, False)
        old_logp = logp.detach() if old_logps is None else old_logps[j]
        is_weight = behav_logp = None
        if loss_cfg.tis_cap is not None:
            is_weight, raw = tis_weights(old_logp, mb.rollout_logp, mb.response_mask, loss_cfg.tis_cap,
                                         per_sequence=loss_cfg.name == "gspo")
            acc.tis.append((raw, mb.response_mask, token_mask))
            if loss_cfg.name == "cispo":  # its own IS weight takes π_behav as denominator, no extra w_t (§3.8)
                is_weight, behav_logp = None, mb.rollout_logp
        loss, m = policy_loss(loss_cfg, logp, old_logp, advantages[s:e], mb.response_mask, token_mask, denom,
                              ref_logp=ref_logp, is_weight=is_weight, behav_logp=behav_logp)
        loss.backward()
        for key, v in m.items():
            if key == "ratio_max":
                sums[key] = max(sums.get(key, v), v)
                continue
            if key == "ratio_min":
                sums[key] = min(sums.get(key, v), v)
                continue
            # micro metrics are shares of the update loss (summed), or fractions over this micro-batch's kept
            # tokens (clip fractions) or response tokens (means): turn fractions back into counts
            w = 1.0 if key in _SUMMED else m["kept_tokens"] if key.endswith("clip_frac") or "clip_frac_" in key \
                else m["response_tokens"]
            sums[key] = sums.get(key, 0.0) + v * w
        with torch.no_grad():
            resp = mb.response_mask
            acc.all_ent.append(ent[resp])
            acc.kept_ent.append(ent[token_mask])
            delta = (old_logp - mb.rollout_logp).abs()
            acc.d_all.append(delta[resp])
            acc.d_kept.append(delta[token_mask])
            acc.old[(k, j)] = old_logp
            acc.kept[(k, j)] = token_mask
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    acc.grad_norms.append(float(grad_norm))


def _approx_kl(model: torch.nn.Module, micros: list[list[Batch]], acc: _Acc, temperature: float) -> tuple[float, float]:
    """k3 estimate of KL(π_old ‖ π_now) (r = π_now/π_old, k3 = r - 1 - log r ≥ 0) on kept and all tokens."""
    kept_sum, kept_n, all_sum, all_n = 0.0, 0, 0.0, 0
    with torch.no_grad():
        for k, mbs in enumerate(micros):
            for j, mb in enumerate(mbs):
                logp, _ = _forward(model, mb, temperature, False)
                d = (logp - acc.old[(k, j)]).double().clamp(-20.0, 20.0)
                k3 = d.exp() - d - 1.0
                kept_sum += float(k3[acc.kept[(k, j)]].sum())
                kept_n += int(acc.kept[(k, j)].sum())
                all_sum += float(k3[mb.response_mask].sum())
                all_n += int(mb.response_mask.sum())
    return kept_sum / max(kept_n, 1), all_sum / max(all_n, 1)


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
    ref_model: torch.nn.Module | None = None,
    mini_batch_size: int | None = None,
    epochs: int = 1,
    kept_out: list[Tensor] | None = None,
) -> dict[str, float]:
    """The optimizer updates of one rollout batch; returns floats for logging (module docstring).

    advantages: [N] per sequence (same order as the batch). mini_batch_size: sequences per update (None or
    >= N: one update on the whole batch); pass a multiple of the group size to keep groups whole.
    epochs: passes over the batch.
    kept_out: when given, receives one bool CPU tensor per sequence, in batch order, over that sequence's
    completion tokens in order: True where the mask of the last update kept the token (for a breakdown by
    token class).
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
    device = next(model.parameters()).device
    advantages = advantages.to(device)
    size = n if mini_batch_size is None else min(mini_batch_size, n)
    plan = [[(a, min(a + micro_batch_size, e)) for a in range(s, e, micro_batch_size)]
            for s, e in ((s, min(s + size, n)) for s in range(0, n, size))]
    # A micro-batch of only empty completions (aborted samples) holds no token to train on: skip it. Empty
    # sequences next to real ones need nothing: no token of theirs enters a loss, mask or denominator.
    plan = [kept for kept in ([(a, b) for a, b in bounds if bool(batch.response_mask[a:b].any())]
                              for bounds in plan) if kept]
    if not plan:
        raise ValueError(f"all {n} completions of the step are empty (0 tokens): nothing to train on")
    micros = [[batch.slice(a, b).to(device) for a, b in bounds] for bounds in plan]
    n_updates = len(plan) * epochs

    old: list[list[Tensor]] | None = None
    if n_updates > 1:  # π_old: the weights before the first update, on the same micro-batches (§3.8)
        model.train()
        with torch.no_grad():
            old = [[_forward(model, mb, temperature, False)[0] for mb in mbs] for mbs in micros]

    acc = _Acc()
    for _ in range(epochs):
        for k, (bounds, mbs) in enumerate(zip(plan, micros, strict=True)):
            _update(model, optimizer, k, bounds, mbs, None if old is None else old[k], advantages, loss_cfg,
                    temperature, max_grad_norm, ref_model, acc)
    kl_kept, kl_all = _approx_kl(model, micros, acc, temperature)
    if kept_out is not None:  # completion targets are contiguous per row: row r's in order
        rows = [torch.zeros(0, dtype=torch.bool)] * n  # a skipped (all-empty) micro-batch's rows keep nothing
        for k, (bounds, mbs) in enumerate(zip(plan, micros, strict=True)):
            for j, ((a, _), mb) in enumerate(zip(bounds, mbs, strict=True)):
                tm, rm = acc.kept[(k, j)].cpu(), mb.response_mask.cpu()  # one transfer per micro-batch
                for r in range(len(mb)):
                    rows[a + r] = tm[r][rm[r]]
        kept_out.extend(rows)

    sums = acc.sums
    n_resp, n_kept = sums["response_tokens"], max(sums["kept_tokens"], 1.0)
    out = {}
    for key, v in sums.items():
        if key in _PER_UPDATE:
            out[key] = v / n_updates
        elif key in _SUMMED or key in ("ratio_max", "ratio_min"):
            out[key] = v
        else:
            out[key] = v / (n_kept if key.endswith("clip_frac") or "clip_frac_" in key else n_resp)
    out["kept_frac"] = sums["kept_tokens"] / n_resp
    ent_all, ent_kept = torch.cat(acc.all_ent), torch.cat(acc.kept_ent)
    da, dk = torch.cat(acc.d_all), torch.cat(acc.d_kept)
    p50, p80, p90, p99 = _quantiles(ent_all, (0.5, 0.8, 0.9, 0.99))
    out.update(
        entropy_mean=float(ent_all.mean()), entropy_p50=p50, entropy_p80=p80, entropy_p90=p90, entropy_p99=p99,
        entropy_kept_mean=float(ent_kept.mean()) if ent_kept.numel() else 0.0,
        mask_threshold=min(acc.thresholds), grad_norm=sum(acc.grad_norms) / n_updates,
        logp_delta_mean=float(da.mean()), logp_delta_max=float(da.max()),
        logp_delta_kept_mean=float(dk.mean()) if dk.numel() else 0.0,
        logp_delta_kept_max=float(dk.max()) if dk.numel() else 0.0,
        micro_batches=float(sum(len(mbs) for mbs in micros)),
        n_updates=float(n_updates), grad_norm_max=max(acc.grad_norms), approx_kl=kl_kept, approx_kl_all=kl_all,
    )
    if loss_cfg.tis_cap is not None:
        out.update(tis_metrics(acc.tis, loss_cfg.tis_cap))
    return out
