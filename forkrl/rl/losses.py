"""Policy-gradient losses with the forking-token mask and step-global denominators (algorithms.md §0, §3).

Every loss is per-token terms l[i, t] plus one aggregator (§0). Each micro-batch returns its *share* of the
step loss: its masked sum divided by a denominator computed once per optimizer step over all micro-batches
(and all DP ranks), so the sum of the micro-batch losses and of their gradients equals the full-batch loss
(§6 P7: never average per-micro-batch means).

r = exp(clamp(logp - old, -20, 20)) (§0):

| loss      | adv. est. | per-token term                            | default aggregator    | clip (l / h) |
|-----------|-----------|-------------------------------------------|-----------------------|--------------|
| grpo      | grpo      | PPO(r, A; eps_l, eps_h) [+ dual clip c]   | seq_mean_token_mean   | 0.2 / 0.2    |
| dr_grpo   | dr_grpo   | PPO(r, A; eps_l, eps_h) [+ dual clip c]   | seq_sum_const (L_max) | 0.2 / 0.2    |
| dapo      | grpo      | PPO(r, A; eps_l, eps_h) [+ dual clip c]   | token_mean            | 0.2 / 0.28   |
| gspo      | grpo      | PPO(s_it, A), GSPO-token, s_i all tokens  | seq_mean_token_mean   | 3e-4 / 4e-4  |
| cispo     | grpo      | -sg(min(r, cispo_max_weight)) * A * logp  | token_mean            | cap 5.0      |
|           |           | (with tis_cap: r = π_θ / π_behav, below)  |                       |              |
| reinforce | reinforce | -A * logp (no ratio, on-policy)           | seq_mean_token_sum    | none         |
| rloo      | rloo      | -A * logp (no ratio, on-policy)           | seq_mean_token_sum    | none         |

CISPO's behaviour correction (§3.8): CISPO already is an IS weight, so with `tis_cap` set its denominator is the
behaviour policy itself, r_behav = exp(clamp(logp - behav_logp, -20, 20)), truncated at cispo_max_weight, with no
extra TIS weight w_t (the stale/mismatched sampler is corrected by the one truncated ratio π_θ / π_behav). The
ratio metrics stay π_θ / π_old; clip_frac_high is then the fraction of kept tokens whose r_behav was truncated.

PPO(r, A) = max(-r A, -clip(r, 1 - eps_l, 1 + eps_h) A); with dual clip c > 1, terms with A < 0 are capped
at -c A (verl `clip_ratio_c`). Optional k3 KL: + kl_beta * (exp(ref - logp) - (ref - logp) - 1), exponent
clamped to +-20 and the term to +-10 (verl); the KL covers **all** response tokens, never the entropy mask
(§2.3), normalized like the aggregator with all response tokens.

Aggregators over the whole step, w = token weight (forking mask AND response mask):
- token_mean:          sum w l / D_tok, D_tok = kept tokens of the step (mask_norm "kept", paper v2 and
                       official code) or all response tokens ("all", TRL behaviour, §2.2)
- seq_mean_token_mean: (1 / N_seq) sum_i [sum_t w l / n_i], n_i = kept tokens of sequence i ("kept"; a
                       sequence with none kept contributes 0 but still counts in N_seq) or |o_i| ("all")
- seq_sum_const:       sum w l / (N_seq * L_max), L_max = cfg.max_len (= max_new_tokens), fixed
- seq_mean_token_sum:  (1 / N_seq) sum w l
N_seq = sequences with >= 1 response token in the step. The constant-normalizer aggregators count no
tokens, so mask_norm does not change them (the mask still removes terms). mask_norm default: "kept",
except gspo: "all" (1/|o_i|, the GSPO-token default of §3.7).

The mask is honoured by every loss: its terms are multiplied by the bool mask. GSPO uses the GSPO-token
form always (§3.5: same value, clip decision and gradient as sequence GSPO when unmasked): the sequence
ratio s_i covers all response tokens, the gradient reaches only kept tokens (§3.7). GSPO only allows
seq_mean_token_mean; clip settings for losses without a clip raise instead of being ignored.

Trainer step with micro-batches (microbatch-scope mask, the default):

    cfg = LossConfig(name="dapo", entropy_top_frac=0.2, max_len=max_new_tokens)
    denom = step_denominator(cfg, [mb.response_mask for mb in micro_batches])   # once, from counts only
    for mb in micro_batches:                          # response_mask [b, L-1] bool marks target tokens
        logp, ent = causal_lm_logprobs_and_entropy(model, mb.input_ids, mb.attention_mask, mb.response_mask,
                                                   temperature=T)   # forkrl/rl/entropy.py
        token_mask = forking_token_mask(ent, mb.response_mask, cfg.entropy_top_frac).mask
        loss, metrics = policy_loss(cfg, logp, mb.old_logp, mb.advantages, mb.response_mask, token_mask,
                                    denom)
        loss.backward()                               # metrics: floats for this micro-batch
    optimizer.step(); optimizer.zero_grad()

Step scope: masks = masks_for_step(entropies, response_masks, rho, "step") from a no-grad pass first. With
data parallelism, build `denom` from every rank's masks (or sum the counts) and all-reduce gradients with
SUM: each rank's loss is already its share of the global sum (DDP averages, so multiply by world size).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from forkrl.rl.mask import kept_denominator
from forkrl.rl.options import (
    AGGREGATORS,
    LOSS_NAMES,
    MASK_NORMS,
    MASK_SCOPES,
    Aggregator,
    LossName,
    MaskNorm,
    MaskScope,
    check_top_frac,
    mask_is_on,
)

__all__ = [
    "AGGREGATORS",
    "DEFAULT_CISPO_MAX_WEIGHT",
    "LOSS_NAMES",
    "MASK_NORMS",
    "LossConfig",
    "LossName",
    "StepDenominator",
    "policy_loss",
    "step_denominator",
]

DEFAULT_CISPO_MAX_WEIGHT = 5.0  # TRL default citing ScaleRL (§3.6, §7); verl's example is 1.2

_DEFAULT_AGG = {
    "grpo": "seq_mean_token_mean",
    "dr_grpo": "seq_sum_const",
    "dapo": "token_mean",
    "gspo": "seq_mean_token_mean",
    "cispo": "token_mean",
    "reinforce": "seq_mean_token_sum",
    "rloo": "seq_mean_token_sum",
}
_DEFAULT_CLIP = {"grpo": (0.2, 0.2), "dr_grpo": (0.2, 0.2), "dapo": (0.2, 0.28), "gspo": (3e-4, 4e-4)}
_NEEDS_OLD_LOGP = frozenset({"grpo", "dr_grpo", "dapo", "gspo", "cispo"})
_LOG_RATIO_CLAMP = 20.0  # §0: r = exp(clamp(delta, -20, 20)), as verl
_KL_CLAMP = 10.0


@dataclass(frozen=True)
class LossConfig:
    """Loss settings; None means the per-loss default (see the module table). Validated on creation.

    name: one of LOSS_NAMES. clip_low/clip_high: eps_l/eps_h of the PPO clip (PPO losses only).
    dual_clip_c: cap -c*A for A < 0, c > 1 (PPO losses except gspo). kl_beta: weight of the k3 KL.
    cispo_max_weight: absolute cap on the CISPO IS weight (cispo only; default 5.0).
    max_len: L_max of seq_sum_const (= max_new_tokens); required for that aggregator, unused otherwise.
    agg: aggregator override. mask_norm: "kept" | "all". entropy_top_frac: rho in (0, 1], None/1 = off.
    mask_scope: "microbatch" | "step" (only used to count kept tokens in step_denominator).
    tis_cap: C of truncated importance sampling on the behaviour policy, >= 1 (forkrl/rl/tis.py); None = off.
        For cispo it switches on the behaviour correction of its own IS weight (π_θ / π_behav, truncated at
        cispo_max_weight; C is then only the threshold of the tis_* mismatch statistics).
    """

    name: LossName
    clip_low: float | None = None
    clip_high: float | None = None
    dual_clip_c: float | None = None
    kl_beta: float = 0.0
    cispo_max_weight: float | None = None
    max_len: int | None = None
    agg: Aggregator | None = None
    mask_norm: MaskNorm | None = None
    entropy_top_frac: float | None = None
    mask_scope: MaskScope = "microbatch"
    tis_cap: float | None = None

    def __post_init__(self) -> None:
        n = self.name
        if n not in LOSS_NAMES:
            raise ValueError(f"unknown loss name {n!r}; valid names: {', '.join(LOSS_NAMES)}")
        if self.agg is not None and self.agg not in AGGREGATORS:
            raise ValueError(f"unknown agg {self.agg!r}; valid aggregators: {', '.join(AGGREGATORS)}")
        if n == "gspo" and self.aggregator != "seq_mean_token_mean":
            raise ValueError(
                f"loss 'gspo' is sequence-level and needs agg 'seq_mean_token_mean', got {self.agg!r}"
            )
        if self.mask_norm is not None and self.mask_norm not in MASK_NORMS:
            raise ValueError(f"mask_norm must be one of {MASK_NORMS}, got {self.mask_norm!r}")
        if self.mask_scope not in MASK_SCOPES:
            raise ValueError(f"mask_scope must be one of {MASK_SCOPES}, got {self.mask_scope!r}")
        check_top_frac(self.entropy_top_frac)
        for field in ("clip_low", "clip_high", "dual_clip_c"):
            if getattr(self, field) is not None and n not in _DEFAULT_CLIP:
                raise ValueError(f"{field} is not used by loss {n!r} (it has no PPO clip); leave it None")
        if self.dual_clip_c is not None and n == "gspo":
            raise ValueError("dual_clip_c is not defined for loss 'gspo' (sequence clip); leave it None")
        if self.clip_low is not None and not 0.0 <= self.clip_low < 1.0:
            raise ValueError(f"clip_low must be in [0, 1), got {self.clip_low}")
        if self.clip_high is not None and not self.clip_high >= 0.0:
            raise ValueError(f"clip_high must be >= 0, got {self.clip_high}")
        if self.dual_clip_c is not None and not self.dual_clip_c > 1.0:
            raise ValueError(f"dual_clip_c must be > 1, got {self.dual_clip_c}")
        if self.cispo_max_weight is not None:
            if n != "cispo":
                raise ValueError(f"cispo_max_weight is only used by loss 'cispo', not {n!r}; leave it None")
            if not self.cispo_max_weight > 0.0:
                raise ValueError(f"cispo_max_weight must be > 0, got {self.cispo_max_weight}")
        if self.tis_cap is not None:
            if not (self.tis_cap >= 1.0 and math.isfinite(self.tis_cap)):
                raise ValueError(f"tis_cap must be a finite number >= 1, got {self.tis_cap}")
        if not (self.kl_beta >= 0.0 and math.isfinite(self.kl_beta)):
            raise ValueError(f"kl_beta must be a finite number >= 0, got {self.kl_beta}")
        if self.max_len is not None and not (isinstance(self.max_len, int) and self.max_len >= 1):
            raise ValueError(f"max_len must be a positive int, got {self.max_len!r}")
        if self.aggregator == "seq_sum_const" and self.max_len is None:
            raise ValueError(f"loss {n!r} with agg 'seq_sum_const' needs max_len (= max_new_tokens)")

    @property
    def aggregator(self) -> str:
        return self.agg if self.agg is not None else _DEFAULT_AGG[self.name]

    @property
    def norm(self) -> str:
        if self.mask_norm is not None:
            return self.mask_norm
        return "all" if self.name == "gspo" else "kept"

    @property
    def clip(self) -> tuple[float, float] | None:
        """(eps_low, eps_high) for PPO-clipped losses, None otherwise."""
        if self.name not in _DEFAULT_CLIP:
            return None
        lo, hi = _DEFAULT_CLIP[self.name]
        lo = lo if self.clip_low is None else self.clip_low
        hi = hi if self.clip_high is None else self.clip_high
        return lo, hi

    @property
    def cispo_cap(self) -> float:
        return DEFAULT_CISPO_MAX_WEIGHT if self.cispo_max_weight is None else self.cispo_max_weight

    @property
    def mask_on(self) -> bool:
        return mask_is_on(self.entropy_top_frac)


@dataclass(frozen=True)
class StepDenominator:
    """Global denominators of one optimizer step (all micro-batches, all ranks).

    pg_tokens: D_tok of token_mean for the policy term (kept tokens, or response tokens if mask_norm is
    "all" or the mask is off). response_tokens: all response tokens (the KL term). seqs: N_seq.
    """

    pg_tokens: int
    response_tokens: int
    seqs: int


def _check_mask(t: object, name: str, shape: tuple[int, ...] | None = None) -> Tensor:
    if not isinstance(t, Tensor) or t.dtype != torch.bool:
        got = t.dtype if isinstance(t, Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a bool tensor, got {got}")
    if shape is None and t.dim() != 2:
        raise ValueError(f"{name} must have shape [B, T], got {tuple(t.shape)}")
    if shape is not None and tuple(t.shape) != shape:
        raise ValueError(f"{name} shape {tuple(t.shape)} does not match response_mask shape {shape}")
    return t


def step_denominator(
    cfg: LossConfig, response_masks: Sequence[Tensor], token_masks: Sequence[Tensor] | None = None
) -> StepDenominator:
    """Denominators for one optimizer step. Call once, before the first backward.

    response_masks: bool [B_m, T_m] per micro-batch (every rank's, under data parallelism).
    token_masks: optional bool forking masks per micro-batch. If given, kept tokens are counted from them;
    otherwise from the counts alone via `kept_denominator(response_masks, rho, cfg.mask_scope)`.
    """
    if len(response_masks) == 0:
        raise ValueError("response_masks is empty: pass one bool [B, T] mask per micro-batch")
    rms = [_check_mask(m, f"response_masks[{j}]") for j, m in enumerate(response_masks)]
    n_resp = sum(int(m.sum()) for m in rms)
    if n_resp == 0:
        raise ValueError("response_masks have no response tokens in the whole step (all zero)")
    seqs = sum(int(m.any(dim=-1).sum()) for m in rms)
    pg_tokens = n_resp
    if token_masks is not None:
        if len(token_masks) != len(rms):
            raise ValueError(f"got {len(token_masks)} token_masks for {len(rms)} response_masks")
        pairs = list(zip(token_masks, rms, strict=True))
        tms = [_check_mask(t, f"token_masks[{j}]", tuple(m.shape)) for j, (t, m) in enumerate(pairs)]
        if any(bool((t & ~m).any()) for t, m in zip(tms, rms, strict=True)):
            raise ValueError("token_masks select tokens outside response_masks (padding or prompt)")
        if cfg.mask_on and cfg.norm == "kept":
            pg_tokens = sum(int(t.sum()) for t in tms)
    elif cfg.mask_on and cfg.norm == "kept":
        pg_tokens = kept_denominator(rms, cfg.entropy_top_frac, cfg.mask_scope)
    return StepDenominator(pg_tokens=pg_tokens, response_tokens=n_resp, seqs=seqs)


def _aggregate(
    term: Tensor, w: Tensor, resp: Tensor, agg: str, norm: str, tokens: int, seqs: int, max_len: int | None
) -> Tensor:
    """Share of this micro-batch in the step aggregate of `term` [B, T] over weights w (bool [B, T])."""
    x = torch.where(w, term, 0.0)
    if agg == "token_mean":
        return x.sum() / tokens
    if agg == "seq_mean_token_mean":
        n_i = (w if norm == "kept" else resp).sum(dim=-1).clamp_min(1).to(x.dtype)  # 0 kept -> row sum 0
        return (x.sum(dim=-1) / n_i).sum() / seqs
    if agg == "seq_sum_const":
        assert max_len is not None  # LossConfig guarantees it
        return x.sum() / (seqs * max_len)
    return x.sum() / seqs  # seq_mean_token_sum


def _ppo(ratio: Tensor, adv: Tensor, eps_low: float, eps_high: float, dual_c: float | None) -> Tensor:
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high))
    if dual_c is not None:  # dual clip: for A < 0 the term is at most -c A (verl clip_ratio_c)
        pg = torch.where(adv < 0, torch.minimum(pg, -adv * dual_c), pg)
    return pg


def _check_inputs(
    cfg: LossConfig, logp: Tensor, others: dict[str, Tensor | None], advantages: Tensor, denom: object
) -> None:
    if not isinstance(cfg, LossConfig):
        raise ValueError(f"cfg must be a LossConfig, got {type(cfg).__name__}")
    if not isinstance(logp, Tensor) or logp.dim() != 2 or not logp.is_floating_point():
        raise ValueError(f"logp must be a float tensor of shape [B, T], got {getattr(logp, 'shape', logp)}")
    shape = tuple(logp.shape)
    for name, t in others.items():
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} does not match logp shape {shape}")
    if not isinstance(advantages, Tensor) or tuple(advantages.shape) != shape[:1]:
        got = tuple(advantages.shape) if isinstance(advantages, Tensor) else type(advantages).__name__
        raise ValueError(f"advantages must have shape [B] = {shape[:1]} (one per sequence), got {got}")
    if not isinstance(denom, StepDenominator):
        raise ValueError(f"denom must be a StepDenominator (step_denominator()), got {type(denom).__name__}")


def policy_loss(
    cfg: LossConfig,
    logp: Tensor,
    old_logp: Tensor | None,
    advantages: Tensor,
    response_mask: Tensor,
    token_mask: Tensor | None,
    denom: StepDenominator,
    ref_logp: Tensor | None = None,
    is_weight: Tensor | None = None,
    behav_logp: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """This micro-batch's share of the step loss, and its metrics.

    Args:
        logp: [B, T] current-policy log-probs (differentiable; values at padding are ignored).
        old_logp: [B, T] π_old, the trainer's log-probs before the batch's first update (required except for
            reinforce/rloo, where it only feeds the ratio metrics). advantages: [B], one per sequence.
            response_mask: [B, T] bool.
        token_mask: [B, T] bool forking mask (subset of response_mask), or None = response_mask. Required
            when cfg.entropy_top_frac < 1 (a mask that is silently off is §6 P3).
        denom: from step_denominator() over the whole step. ref_logp: [B, T], required if kl_beta > 0
            (with kl_beta = 0 it only feeds the kl_mean metric). is_weight: [B, T] detached per-token
            weight multiplying the policy term (truncated IS on the behaviour policy, forkrl/rl/tis.py); None = 1.
            behav_logp: [B, T] π_behav, the rollout engine's log-probs: cispo only (its behaviour correction,
            §3.8, needs cfg.tis_cap): the IS weight becomes sg(min(π_θ / π_behav, cispo_max_weight)).
    Returns:
        (loss, metrics). loss: scalar, this micro-batch's share (sum over the step's micro-batches = the
        step loss). metrics (floats): loss, pg_loss, kl_loss (unweighted KL) are shares too; clip_frac_low,
        clip_frac_high (and dual_clip_frac) are fractions of this micro-batch's kept tokens; ratio_mean,
        ratio_min, ratio_max, kl_mean are over its response tokens (ratio metrics only when old_logp is given, KL ones
        only when ref_logp is); kept_tokens, response_tokens, kept_frac are counts in this micro-batch.
    """
    _check_inputs(cfg, logp, {"old_logp": old_logp, "ref_logp": ref_logp, "is_weight": is_weight,
                              "behav_logp": behav_logp}, advantages, denom)
    if behav_logp is not None and not (cfg.name == "cispo" and cfg.tis_cap is not None):
        raise ValueError(f"behav_logp is only used by loss 'cispo' with tis_cap set (its behaviour correction); "
                         f"got loss {cfg.name!r} with tis_cap={cfg.tis_cap}")
    if cfg.name == "cispo" and cfg.tis_cap is not None and behav_logp is None:
        raise ValueError("loss 'cispo' with tis_cap needs behav_logp (the rollout engine's log-probs)")
    resp = _check_mask(response_mask, "response_mask", tuple(logp.shape))
    w = resp if token_mask is None else _check_mask(token_mask, "token_mask", tuple(logp.shape))
    if old_logp is None and cfg.name in _NEEDS_OLD_LOGP:
        raise ValueError(f"loss {cfg.name!r} needs old_logp (the behaviour log-probs), got None")
    if cfg.kl_beta > 0 and ref_logp is None:
        raise ValueError(f"kl_beta={cfg.kl_beta} needs ref_logp, got None")
    if cfg.mask_on and token_mask is None:
        raise ValueError(
            f"entropy_top_frac={cfg.entropy_top_frac} but token_mask is None: "
            "pass forking_token_mask(...).mask"
        )
    n_resp, n_w, n_seq, outside, differs = torch.stack(
        [resp.sum(), w.sum(), resp.any(dim=-1).sum(), (w & ~resp).sum(), (w != resp).sum()]
    ).tolist()
    if n_resp == 0:
        raise ValueError("response_mask has no response tokens (all zero): nothing to train on")
    if outside:
        raise ValueError(f"token_mask selects {outside} tokens outside response_mask (padding or prompt)")
    if differs and not cfg.mask_on:
        raise ValueError(
            f"token_mask drops {differs} response tokens but entropy_top_frac={cfg.entropy_top_frac} "
            "(mask off)"
        )
    if n_resp > denom.response_tokens or n_w > denom.pg_tokens or n_seq > denom.seqs:
        raise ValueError(
            f"denom {denom} is smaller than this micro-batch alone (response tokens {n_resp}, kept {n_w}, "
            f"sequences {n_seq}); compute it once per step over all micro-batches with step_denominator()"
        )

    # Padding may hold anything (even NaN): zero it before any arithmetic so no NaN reaches a gradient.
    lp = torch.where(resp, logp, 0.0)
    adv = advantages.to(lp.dtype).unsqueeze(-1)  # [B, 1], broadcast to tokens (§0)
    ratio = None
    if old_logp is not None:
        delta = lp - torch.where(resp, old_logp.to(lp.dtype), 0.0)
        if cfg.name == "gspo":
            # GSPO-token (§3.5): log s_it = sg(log s_i) + logp - sg(logp); s_i over ALL response tokens.
            log_s = delta.sum(dim=-1, keepdim=True) / resp.sum(dim=-1, keepdim=True).clamp_min(1)
            delta = torch.where(resp, log_s.detach() + lp - lp.detach(), 0.0)
        ratio = torch.exp(delta.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))

    clip = cfg.clip
    capped: Tensor | None = None
    if clip is not None:
        assert ratio is not None
        pg = _ppo(ratio, adv, clip[0], clip[1], cfg.dual_clip_c)
    elif cfg.name == "cispo":
        assert ratio is not None
        is_ratio = ratio
        if behav_logp is not None:  # behaviour correction (§3.8): π_behav is the IS weight's denominator
            d_behav = lp.detach() - torch.where(resp, behav_logp.detach().to(lp.dtype), 0.0)
            is_ratio = torch.exp(d_behav.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))
        capped = is_ratio.detach() > cfg.cispo_cap  # clip_frac_high: the tokens whose IS weight was truncated
        pg = -is_ratio.detach().clamp(max=cfg.cispo_cap) * adv * lp  # sg(r_hat) A logp (§3.6)
    else:  # reinforce, rloo: no importance ratio (§3.4)
        pg = -adv * lp
    if is_weight is not None:  # TIS (§3.8): a detached per-token weight, 1 = off
        pg = pg * torch.where(resp, is_weight.detach().to(pg.dtype), 1.0)
    agg, max_len = cfg.aggregator, cfg.max_len
    pg_loss = _aggregate(pg, w, resp, agg, cfg.norm, denom.pg_tokens, denom.seqs, max_len)
    loss = pg_loss

    kl_loss, k3 = None, None
    if ref_logp is not None:
        with torch.set_grad_enabled(torch.is_grad_enabled() and cfg.kl_beta > 0):  # beta 0: metric only
            d = torch.where(resp, ref_logp.to(lp.dtype), 0.0) - lp
            k3 = torch.exp(d.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)) - d - 1.0
            k3 = k3.clamp(-_KL_CLAMP, _KL_CLAMP)
            # The KL is not masked by the entropy mask (§2.3): weights and counts are all response tokens.
            kl_loss = _aggregate(k3, resp, resp, agg, "all", denom.response_tokens, denom.seqs, max_len)
        if cfg.kl_beta > 0:
            loss = loss + cfg.kl_beta * kl_loss
    return loss, _metrics(cfg, ratio, adv, w, resp, k3, loss, pg_loss, kl_loss, n_w, n_resp, capped)


def _metrics(
    cfg: LossConfig,
    ratio: Tensor | None,
    adv: Tensor,
    w: Tensor,
    resp: Tensor,
    k3: Tensor | None,
    loss: Tensor,
    pg_loss: Tensor,
    kl_loss: Tensor | None,
    n_w: int,
    n_resp: int,
    capped: Tensor | None,
) -> dict[str, float]:
    names: list[str] = ["loss", "pg_loss"]
    with torch.no_grad():
        f64 = torch.float64  # exact fractions in the logs, whatever the training dtype
        vals = [loss.detach(), pg_loss.detach()]
        zero = torch.zeros((), dtype=loss.dtype, device=loss.device)
        kept = max(n_w, 1)
        if ratio is not None:
            r = ratio.detach()
            clip = cfg.clip
            if clip is not None:
                low, high = (adv < 0) & (r < 1 - clip[0]), (adv > 0) & (r > 1 + clip[1])
            else:  # cispo: the IS weight is capped from above only; reinforce/rloo clip nothing
                low = torch.zeros_like(w)
                high = capped if capped is not None else torch.zeros_like(w)
            names += ["clip_frac_low", "clip_frac_high", "ratio_mean", "ratio_max", "ratio_min"]
            vals += [
                (low & w).sum().to(f64) / kept,
                (high & w).sum().to(f64) / kept,
                torch.where(resp, r, zero).sum() / n_resp,
                torch.where(resp, r, torch.full_like(r, -math.inf)).max(),
                torch.where(resp, r, torch.full_like(r, math.inf)).min(),
            ]
            if cfg.dual_clip_c is not None:
                names.append("dual_clip_frac")
                vals.append(((adv < 0) & (r > cfg.dual_clip_c) & w).sum().to(f64) / kept)
        if k3 is not None and kl_loss is not None:
            names += ["kl_mean", "kl_loss"]
            vals += [torch.where(resp, k3.detach(), zero).sum() / n_resp, kl_loss.detach()]
        out = dict(zip(names, torch.stack([v.to(f64) for v in vals]).tolist(), strict=True))
    out.update(kept_tokens=float(n_w), response_tokens=float(n_resp), kept_frac=n_w / n_resp)
    return out
