"""One optimizer step of policy-gradient training on sampled trajectories (pure torch, no I/O).

    batch = build_batch(prompt_ids, completion_ids, rollout_logprobs, pad_id)
    metrics = train_step(model, optimizer, batch, advantages, loss_cfg, temperature=1.0,
                         micro_batch_size=64, max_grad_norm=1.0)

What happens (algorithms.md §0–§3):
1. The step's sequences are split into micro-batches. The global denominators (kept tokens, response
   tokens, sequences) are computed once, before any backward, from token counts alone (§2.3).
2. For `mask_scope="step"` a no-grad pass first computes the entropies of every micro-batch so that one
   top-k can be taken over the whole step.
3. Each micro-batch: forward in fp32 → logp and entropy of the response tokens at the sampling
   temperature in one chunked pass → forking-token mask (entropy of the *current* policy, §1.3) → the loss's
   share of the step loss → backward.
4. Gradient clipping and the optimizer step.

π_old is the trainer's own log-prob of the batch before the update (one update per rollout batch, as verl
recomputes old_log_prob), so ratios start at exactly 1; the rollout engine's log-probs are compared with it
and reported as |Δlogp| (§6 P6) instead of silently entering the ratio.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from forkrl.rl.entropy import response_logprobs_and_entropy, shift_for_causal_lm
from forkrl.rl.losses import LossConfig, policy_loss, step_denominator
from forkrl.rl.mask import MaskResult, forking_token_mask, masks_for_step


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
    kept_out: list[Tensor] | None = None,
) -> dict[str, float]:
    """Forward/backward over micro-batches with step-global denominators, clip, optimizer step.

    advantages: [N] per sequence (same order as the batch). Returns floats for logging.
    kept_out: when given, receives one bool CPU tensor per sequence, in batch order, over that sequence's
    completion tokens in order: True where the mask kept the token (for a breakdown by token class).
    """
    n = len(batch)
    if advantages.shape != (n,):
        raise ValueError(f"advantages must have shape ({n},) (one per sequence), got {tuple(advantages.shape)}")
    device = next(model.parameters()).device
    advantages = advantages.to(device)
    bounds = [(s, min(s + micro_batch_size, n)) for s in range(0, n, micro_batch_size)]
    micros = [batch.slice(s, e).to(device) for s, e in bounds]
    rho, scope = loss_cfg.entropy_top_frac, loss_cfg.mask_scope
    denom = step_denominator(loss_cfg, [mb.response_mask for mb in micros])

    step_masks: list[MaskResult] | None = None
    if loss_cfg.mask_on and scope == "step":
        with torch.no_grad():
            ents = [_forward(model, mb, temperature, True)[1] for mb in micros]
        step_masks = masks_for_step(ents, [mb.response_mask for mb in micros], rho, "step")

    model.train()
    optimizer.zero_grad(set_to_none=True)
    sums: dict[str, float] = {}
    all_ent, kept_ent, d_all, d_kept = [], [], [], []
    thresholds = []
    for j, ((s, e), mb) in enumerate(zip(bounds, micros, strict=False)):
        logp, ent = _forward(model, mb, temperature, True)
        assert ent is not None
        if step_masks is not None:
            res = step_masks[j]
        else:
            res = forking_token_mask(ent, mb.response_mask, rho)
        token_mask = res.mask
        thresholds.append(res.threshold)
        ref_logp = None
        if ref_model is not None and loss_cfg.kl_beta > 0:
            with torch.no_grad():
                ref_logp, _ = _forward(ref_model, mb, temperature, False)
        old_logp = logp.detach()
        loss, m = policy_loss(loss_cfg, logp, old_logp, advantages[s:e], mb.response_mask, token_mask, denom,
                              ref_logp=ref_logp)
        loss.backward()
        for k, v in m.items():
            if k == "ratio_max":
                sums[k] = max(sums.get(k, v), v)
                continue
            # micro metrics are shares of the step loss (summed), or fractions over this micro-batch's kept
            # tokens (clip fractions) or response tokens (means): turn fractions back into counts
            w = 1.0 if k in _SUMMED else m["kept_tokens"] if k.endswith("clip_frac") or "clip_frac_" in k \
                else m["response_tokens"]
            sums[k] = sums.get(k, 0.0) + v * w
        with torch.no_grad():
            resp = mb.response_mask
            if kept_out is not None:  # completion targets are contiguous per row: row r's in order
                tm, rm = token_mask.cpu(), resp.cpu()  # one transfer per micro-batch
                kept_out.extend(tm[r][rm[r]] for r in range(len(mb)))
            all_ent.append(ent[resp])
            kept_ent.append(ent[token_mask])
            delta = (logp.detach() - mb.rollout_logp).abs()
            d_all.append(delta[resp])
            d_kept.append(delta[token_mask])
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

    n_resp, n_kept = sums["response_tokens"], max(sums["kept_tokens"], 1.0)
    out = {}
    for k, v in sums.items():
        if k in _SUMMED or k == "ratio_max":
            out[k] = v
        else:
            out[k] = v / (n_kept if k.endswith("clip_frac") or "clip_frac_" in k else n_resp)
    out["kept_frac"] = sums["kept_tokens"] / n_resp
    ent_all, ent_kept = torch.cat(all_ent), torch.cat(kept_ent)
    da, dk = torch.cat(d_all), torch.cat(d_kept)
    p50, p80, p90, p99 = _quantiles(ent_all, (0.5, 0.8, 0.9, 0.99))
    out.update(
        entropy_mean=float(ent_all.mean()), entropy_p50=p50, entropy_p80=p80, entropy_p90=p90, entropy_p99=p99,
        entropy_kept_mean=float(ent_kept.mean()) if ent_kept.numel() else 0.0,
        mask_threshold=min(thresholds), grad_norm=float(grad_norm),
        logp_delta_mean=float(da.mean()), logp_delta_max=float(da.max()),
        logp_delta_kept_mean=float(dk.mean()) if dk.numel() else 0.0,
        logp_delta_kept_max=float(dk.max()) if dk.numel() else 0.0,
        micro_batches=float(len(micros)),
    )
    return out
