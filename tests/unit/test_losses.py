"""forkrl.rl.losses: the seven losses, their aggregators, the mask and step-global denominators (§0, §3)."""

from __future__ import annotations

import math

import pytest
import torch

from forkrl.rl.losses import AGGREGATORS, LOSS_NAMES, LossConfig, StepDenominator, policy_loss, step_denominator
from forkrl.rl.mask import forking_token_mask, masks_for_step

F64 = torch.float64

# ---------------------------------------------------------------------------------------------------------
# Hand-computed example. Two sequences, the second has 2 real tokens:
#   logp  = [[-1.0, -0.5, -2.0], [-0.2, -1.5, pad]]
#   ratio = [[ 1.5,  1.0,  0.5], [ 1.1,  0.5, pad]]   (old_logp = logp - ln ratio)
#   A     = [1, -2]
# PPO eps 0.2/0.2 terms  max(-rA, -clip(r)A):
#   seq 0 (A=1):  r=1.5 -> -min(1.5, 1.2) = -1.2;  r=1 -> -1.0;  r=0.5 -> -min(0.5, 0.8) = -0.5
#   seq 1 (A=-2): r=1.1 -> 2.2 (inside);  r=0.5 -> max(1.0, 1.6) = 1.6 (low clip active)
# ---------------------------------------------------------------------------------------------------------
RESP = torch.tensor([[True, True, True], [True, True, False]])
KEEP = torch.tensor([[True, False, True], [False, True, False]])  # a forking mask (subset of RESP)


def _hand_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    logp = torch.tensor([[-1.0, -0.5, -2.0], [-0.2, -1.5, 0.0]], dtype=F64, requires_grad=True)
    ratio = torch.tensor([[1.5, 1.0, 0.5], [1.1, 0.5, 1.0]], dtype=F64)
    return logp, logp.detach() - ratio.log(), torch.tensor([1.0, -2.0], dtype=F64)


def _run(cfg: LossConfig, token_mask=None, ref_logp=None, logp=None, old=None, adv=None, resp=RESP):
    lp, o, a = _hand_inputs()
    lp = lp if logp is None else logp
    o = o if old is None else old
    a = a if adv is None else adv
    denom = step_denominator(cfg, [resp], None if token_mask is None else [token_mask])
    return policy_loss(cfg, lp, o, a, resp, token_mask, denom, ref_logp=ref_logp)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        # grpo: seq means (-1.2 - 1.0 - 0.5)/3 = -0.9 and (2.2 + 1.6)/2 = 1.9 -> (-0.9 + 1.9)/2 = 0.5
        ({"name": "grpo"}, 0.5),
        # token_mean: (-2.7 + 3.8) / 5 = 0.22
        ({"name": "grpo", "agg": "token_mean"}, 0.22),
        # seq_sum_const, L_max = 4: 1.1 / (2 * 4) = 0.1375
        ({"name": "grpo", "agg": "seq_sum_const", "max_len": 4}, 0.1375),
        # seq_mean_token_sum: 1.1 / 2 = 0.55
        ({"name": "grpo", "agg": "seq_mean_token_sum"}, 0.55),
        # dr_grpo (eps 0.2/0.2, seq_sum_const): 1.1 / (2 * 4) = 0.1375
        ({"name": "dr_grpo", "max_len": 4}, 0.1375),
        # dapo eps 0.2/0.28: r=1.5 -> -1.28; sum = -1.28 - 1.0 - 0.5 + 2.2 + 1.6 = 1.02; / 5 = 0.204
        ({"name": "dapo"}, 0.204),
        # gspo: s0 = (1.5 * 1 * 0.5)^(1/3) = 0.75^(1/3) = 0.9085602964160698 (A=1: unclipped min -> -s0),
        # s1 = (1.1 * 0.5)^(1/2) = 0.7416 < 1 - 3e-4, A=-2 -> max(2 s1, 2 * 0.9997) = 1.9994.
        # (-0.9085602964160698 + 1.9994) / 2 = 0.5454198517919651
        ({"name": "gspo"}, 0.5454198517919651),
        # cispo cap 5 (inactive): -r A logp = 1.5, 0.5, 1.0 | -0.44, -1.5 -> 1.06 / 5 = 0.212
        ({"name": "cispo"}, 0.212),
        # cispo cap 1.2: 1.5 -> 1.2: 1.2 + 0.5 + 1.0 - 0.44 - 1.5 = 0.76 -> / 5 = 0.152
        ({"name": "cispo", "cispo_max_weight": 1.2}, 0.152),
        # cispo, seq_mean_token_mean: (3.0/3 + (-1.94)/2) / 2 = (1.0 - 0.97) / 2 = 0.015
        ({"name": "cispo", "agg": "seq_mean_token_mean"}, 0.015),
        # reinforce/rloo: -A logp = 1, 0.5, 2 | -0.4, -3.0; seq_mean_token_sum: (3.5 - 3.4)/2 = 0.05
        ({"name": "reinforce"}, 0.05),
        ({"name": "rloo"}, 0.05),
        # token_mean: 0.1 / 5 = 0.02; seq_sum_const L=10: 0.1 / 20 = 0.005
        ({"name": "reinforce", "agg": "token_mean"}, 0.02),
        ({"name": "rloo", "agg": "seq_sum_const", "max_len": 10}, 0.005),
    ],
)
def test_hand_computed_unmasked(kwargs: dict, expected: float):
    loss, _ = _run(LossConfig(**kwargs))
    assert loss.item() == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        # Kept tokens: (0,0), (0,2), (1,1).
        # dapo kept: (-1.28 - 0.5 + 1.6) / 3 = -0.06 ; all: -0.18 / 5 = -0.036
        ({"name": "dapo"}, -0.06),
        ({"name": "dapo", "mask_norm": "all"}, -0.036),
        # grpo kept: ((-1.2 - 0.5)/2 + 1.6/1) / 2 = 0.375 ; all: (-1.7/3 + 1.6/2) / 2 = 0.11666666666666667
        ({"name": "grpo"}, 0.375),
        ({"name": "grpo", "mask_norm": "all"}, 0.11666666666666667),
        # dr_grpo: (-1.2 - 0.5 + 1.6) / (2 * 4) = -0.0125 (constant normalizer, mask_norm has no effect)
        ({"name": "dr_grpo", "max_len": 4}, -0.0125),
        ({"name": "dr_grpo", "max_len": 4, "mask_norm": "all"}, -0.0125),
        # gspo-token, default 1/|o_i|: (2 * -0.9085602964160698 / 3 + 1.9994 / 2) / 2 = 0.19699656786131
        ({"name": "gspo"}, 0.19699656786131),
        # gspo-token, kept norm: per-sequence mean of equal values = the unmasked value
        ({"name": "gspo", "mask_norm": "kept"}, 0.5454198517919651),
        # cispo: 1.5 + 1.0 - 1.5 = 1.0 -> kept 1/3, all 1/5
        ({"name": "cispo"}, 1 / 3),
        ({"name": "cispo", "mask_norm": "all"}, 0.2),
        # reinforce: (1 + 2 - 3) / 2 = 0 ; rloo token_mean kept: 0 / 3
        ({"name": "reinforce"}, 0.0),
        # rloo seq_mean_token_mean kept: ((1 + 2)/2 + (-3)/1) / 2 = -0.75
        ({"name": "rloo", "agg": "seq_mean_token_mean"}, -0.75),
    ],
)
def test_hand_computed_masked(kwargs: dict, expected: float):
    loss, metrics = _run(LossConfig(entropy_top_frac=0.5, **kwargs), token_mask=KEEP)
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    assert metrics["kept_tokens"] == 3 and metrics["response_tokens"] == 5


def test_hand_computed_gradient_dapo():
    # d/dlogp of -rA = -rA where unclipped, 0 where the clip is active; / 5 tokens.
    # (0,0) r=1.5 clipped -> 0; (0,1) -1/5; (0,2) -0.5/5; (1,0) 2.2/5; (1,1) clipped -> 0; pad 0.
    logp, old, adv = _hand_inputs()
    loss, _ = _run(LossConfig(name="dapo"), logp=logp, old=old, adv=adv)
    loss.backward()
    expected = torch.tensor([[0.0, -0.2, -0.1], [0.44, 0.0, 0.0]], dtype=F64)
    torch.testing.assert_close(logp.grad, expected, rtol=0, atol=1e-12)


def test_hand_computed_kl_not_masked():
    # ref - logp = ln 2 at (0,0) and (1,1): k3 = 2 - ln 2 - 1 = 0.3068528194400547, else 0.
    # KL, seq_mean_token_mean over all tokens: (k3/3 + k3/2) / 2 = 0.12785534143335612
    logp, _, _ = _hand_inputs()
    ref = logp.detach().clone()
    ref[0, 0] += math.log(2)
    ref[1, 1] += math.log(2)
    loss, m = _run(LossConfig(name="grpo", kl_beta=0.1), ref_logp=ref)
    assert loss.item() == pytest.approx(0.5 + 0.1 * 0.12785534143335612, abs=1e-12)
    assert m["kl_mean"] == pytest.approx(2 * 0.3068528194400547 / 5, abs=1e-12)
    # Masked (kept norm): pg 0.375, KL unchanged because it ignores the entropy mask.
    loss, _ = _run(LossConfig(name="grpo", kl_beta=0.1, entropy_top_frac=0.5), token_mask=KEEP, ref_logp=ref)
    assert loss.item() == pytest.approx(0.375 + 0.1 * 0.12785534143335612, abs=1e-12)


def test_hand_computed_dual_clip():
    # One sequence, A = -2, r = [5, 0.5]. r=5: max(10, 2.4) = 10 -> dual clip min(10, -A c = 6) = 6.
    # r=0.5: max(1.0, 1.6) = 1.6. grpo seq mean: with c=3 (6 + 1.6)/2 = 3.8, without (10 + 1.6)/2 = 5.8.
    logp = torch.tensor([[-1.0, -1.0]], dtype=F64, requires_grad=True)
    old = logp.detach() - torch.tensor([[5.0, 0.5]], dtype=F64).log()
    resp = torch.ones(1, 2, dtype=torch.bool)
    adv = torch.tensor([-2.0], dtype=F64)
    for c, expected in ((3.0, 3.8), (None, 5.8)):
        cfg = LossConfig(name="grpo", dual_clip_c=c)
        loss, m = policy_loss(cfg, logp, old, adv, resp, None, step_denominator(cfg, [resp]))
        assert loss.item() == pytest.approx(expected, abs=1e-12)
    assert m.get("dual_clip_frac") is None
    cfg = LossConfig(name="grpo", dual_clip_c=3.0)
    _, m = policy_loss(cfg, logp, old, adv, resp, None, step_denominator(cfg, [resp]))
    assert m["dual_clip_frac"] == 0.5 and m["clip_frac_low"] == 0.5 and m["clip_frac_high"] == 0.0


def test_metrics_hand_computed():
    _, m = _run(LossConfig(name="grpo"))
    # high clip: A>0 & r>1.2 -> (0,0); low clip: A<0 & r<0.8 -> (1,1). ratio mean (1.5+1+0.5+1.1+0.5)/5.
    assert m["clip_frac_high"] == 0.2 and m["clip_frac_low"] == 0.2
    assert m["ratio_mean"] == pytest.approx(0.92) and m["ratio_max"] == pytest.approx(1.5)
    assert m["kept_frac"] == 1.0 and "kl_mean" not in m
    _, m = _run(LossConfig(name="cispo", cispo_max_weight=1.2))
    assert m["clip_frac_high"] == 0.2 and m["clip_frac_low"] == 0.0  # weight capped at (0,0)
    _, m = _run(LossConfig(name="dapo", entropy_top_frac=0.5), token_mask=KEEP)
    assert m["clip_frac_high"] == pytest.approx(1 / 3) and m["clip_frac_low"] == pytest.approx(1 / 3)
    assert all(isinstance(v, float) for v in m.values())


def test_padding_garbage_never_reaches_loss_or_grads():
    logp, old, adv = _hand_inputs()
    lp = logp.detach().clone()
    lp[1, 2] = float("nan")
    lp.requires_grad_(True)
    old = old.clone()
    old[1, 2] = float("inf")
    ref = lp.detach().clone()
    ref[1, 2] = float("-inf")
    for name in LOSS_NAMES:
        cfg = LossConfig(name=name, max_len=4, kl_beta=0.1)
        loss, m = _run(cfg, logp=lp, old=old, adv=adv, ref_logp=ref)
        loss.backward()
        assert math.isfinite(loss.item()) and torch.isfinite(lp.grad).all() and lp.grad[1, 2] == 0
        lp.grad = None
        assert all(math.isfinite(v) for v in m.values())


# ---------------------------------------------------------------------------------------------------------
# Slow, obviously-correct reference: Python loops over sequences and tokens, float64, written from §0/§3.
# ---------------------------------------------------------------------------------------------------------
def _ref_loss(cfg: LossConfig, logp, old, adv, resp, keep, ref_logp) -> torch.Tensor:
    B, T = resp.shape
    seqs = [i for i in range(B) if resp[i].any()]
    n_seq = len(seqs)
    toks = {i: [t for t in range(T) if resp[i, t]] for i in seqs}
    kept = {i: [t for t in toks[i] if keep[i, t]] for i in seqs}
    agg, norm = cfg.aggregator, cfg.norm
    masked = cfg.mask_on

    if cfg.name == "gspo" and not masked:
        # Sequence form (§3.5): s_i = exp(mean_t (logp - old)), J_i = min(s A, clip(s) A), mean over seqs.
        el, eh = cfg.clip
        total = 0.0
        for i in seqs:
            s = torch.exp(sum(logp[i, t] - old[i, t] for t in toks[i]) / len(toks[i]))
            total = total - torch.minimum(s * adv[i], torch.clamp(s, 1 - el, 1 + eh) * adv[i])
        pg = total / n_seq
    else:
        terms = {}
        for i in seqs:
            if cfg.name == "gspo":  # GSPO-token (§3.5 Eq. 13-14)
                log_s = sum(logp[i, t] - old[i, t] for t in toks[i]) / len(toks[i])
            for t in kept[i]:
                a = adv[i]
                if cfg.name in ("reinforce", "rloo"):
                    term = -a * logp[i, t]
                elif cfg.name == "cispo":
                    r = torch.exp(logp[i, t] - old[i, t]).detach()
                    term = -torch.clamp(r, max=cfg.cispo_cap) * a * logp[i, t]
                else:
                    if cfg.name == "gspo":
                        r = torch.exp(log_s.detach() + logp[i, t] - logp[i, t].detach())
                    else:
                        r = torch.exp(logp[i, t] - old[i, t])
                    el, eh = cfg.clip
                    term = torch.maximum(-a * r, -a * torch.clamp(r, 1 - el, 1 + eh))
                    if cfg.dual_clip_c is not None and a < 0:
                        term = torch.minimum(term, -a * cfg.dual_clip_c)
                terms[i, t] = term
        pg = _ref_aggregate(terms, seqs, kept, toks, agg, norm, n_seq, cfg.max_len)
    if cfg.kl_beta == 0:
        return pg
    kl_terms = {}
    for i in seqs:
        for t in toks[i]:
            d = ref_logp[i, t] - logp[i, t]
            kl_terms[i, t] = torch.exp(d) - d - 1
    return pg + cfg.kl_beta * _ref_aggregate(kl_terms, seqs, toks, toks, agg, "all", n_seq, cfg.max_len)


def _ref_aggregate(terms, seqs, kept, toks, agg, norm, n_seq, max_len):
    total = sum(terms.values()) if terms else torch.zeros((), dtype=F64)
    if agg == "token_mean":
        n = sum(len(kept[i]) for i in seqs) if norm == "kept" else sum(len(toks[i]) for i in seqs)
        return total / n
    if agg == "seq_mean_token_mean":
        out = torch.zeros((), dtype=F64)
        for i in seqs:
            n_i = len(kept[i]) if norm == "kept" else len(toks[i])
            if n_i and kept[i]:
                out = out + sum(terms[i, t] for t in kept[i]) / n_i
        return out / n_seq
    if agg == "seq_sum_const":
        return total / (n_seq * max_len)
    return total / n_seq


def _random_batch(seed: int, B: int = 4, T: int = 6, ratio_scale: float = 0.3):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0 if seed % 3 == 0 else 1, T + 1, (B,), generator=gen)
    lengths[0] = T  # at least one full sequence; seed % 3 == 0 may give an empty row
    resp = torch.arange(T)[None, :] < lengths[:, None]
    logp = -(torch.rand(B, T, generator=gen, dtype=F64) * 3).requires_grad_(True)
    old = logp.detach() + torch.randn(B, T, generator=gen, dtype=F64) * ratio_scale
    ref = logp.detach() + torch.randn(B, T, generator=gen, dtype=F64) * 0.3
    adv = torch.randn(B, generator=gen, dtype=F64)
    ent = torch.rand(B, T, generator=gen)
    return logp.detach().requires_grad_(True), old, adv, resp, ent, ref


def _ref_cases():
    cases = []
    for name in LOSS_NAMES:
        aggs = ["seq_mean_token_mean"] if name == "gspo" else list(AGGREGATORS)
        for agg in aggs:
            default = agg == LossConfig(name=name, max_len=8).aggregator
            for mask in ("off", "kept", "all"):
                for seed in range(8 if default else 2):
                    cases.append((name, agg, mask, seed))
    return cases


def test_vectorized_matches_loop_reference():
    n_checked = 0
    for name, agg, mask, seed in _ref_cases():
        extra = {}
        if name in ("grpo", "dr_grpo", "dapo") and seed % 2 == 1:
            extra["dual_clip_c"] = 1.5
        if name == "cispo" and seed % 2 == 1:
            extra["cispo_max_weight"] = 1.1
        cfg = LossConfig(
            name=name,
            agg=agg,
            max_len=8,
            kl_beta=0.05 if seed % 4 == 2 else 0.0,
            entropy_top_frac=None if mask == "off" else 0.3,
            mask_norm=None if mask == "off" else mask,
            **extra,
        )
        logp, old, adv, resp, ent, ref = _random_batch(seed, ratio_scale=3e-4 if name == "gspo" else 0.3)
        keep = resp if mask == "off" else forking_token_mask(ent, resp, 0.3).mask
        denom = step_denominator(cfg, [resp])  # from counts alone
        loss, _ = policy_loss(cfg, logp, old, adv, resp, None if mask == "off" else keep, denom, ref_logp=ref)
        (grad,) = torch.autograd.grad(loss, logp)
        ref_loss = _ref_loss(cfg, logp, old, adv, resp, keep, ref)
        (ref_grad,) = torch.autograd.grad(ref_loss, logp, allow_unused=True)
        ref_grad = torch.zeros_like(logp) if ref_grad is None else ref_grad
        msg = f"{name} agg={agg} mask={mask} seed={seed}"
        torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-12, msg=msg)
        torch.testing.assert_close(grad, ref_grad, rtol=0, atol=1e-12, msg=msg)
        n_checked += 1
    assert n_checked == len(_ref_cases()) > 250


# ---------------------------------------------------------------------------------------------------------
# Autograd: gradient only through kept tokens; rho = 1 is bitwise the unmasked loss.
# ---------------------------------------------------------------------------------------------------------
def _onpolicy_4x12():
    gen = torch.Generator().manual_seed(7)
    logp = -(torch.rand(4, 12, generator=gen) * 2 + 0.1)
    ent = torch.rand(4, 12, generator=gen)
    resp = torch.ones(4, 12, dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0, 0.5, -2.0])
    return logp, ent, resp, adv


@pytest.mark.parametrize("name", LOSS_NAMES)
def test_grad_only_on_kept_tokens(name: str):
    logp0, ent, resp, adv = _onpolicy_4x12()
    mask = forking_token_mask(ent, resp, 0.2)
    assert mask.kept == 10 and mask.total == 48  # ceil(0.2 * 48) = 10
    for rho, token_mask, expected_nonzero in ((0.2, mask.mask, mask.mask), (None, None, resp)):
        logp = logp0.clone().requires_grad_(True)
        cfg = LossConfig(name=name, max_len=12, entropy_top_frac=rho)
        # old = logp: ratio 1, inside every clip range, so every contributing token has a gradient.
        loss, m = policy_loss(cfg, logp, logp.detach(), adv, resp, token_mask, step_denominator(cfg, [resp]))
        loss.backward()
        nonzero = logp.grad != 0
        assert torch.equal(nonzero, expected_nonzero), name
        assert int(nonzero.sum()) == (10 if rho else 48)
        assert m["kept_tokens"] == (10 if rho else 48)


@pytest.mark.parametrize("name", LOSS_NAMES)
def test_kl_gradient_reaches_every_token_under_mask(name: str):
    logp0, ent, resp, adv = _onpolicy_4x12()
    ref = logp0 + 0.1
    logp = logp0.clone().requires_grad_(True)
    cfg = LossConfig(name=name, max_len=12, entropy_top_frac=0.2, kl_beta=0.1)
    token_mask = forking_token_mask(ent, resp, 0.2).mask
    loss, _ = policy_loss(cfg, logp, logp.detach(), adv, resp, token_mask, step_denominator(cfg, [resp]), ref)
    loss.backward()
    assert int((logp.grad != 0).sum()) == 48


@pytest.mark.parametrize("name", LOSS_NAMES)
def test_rho_one_is_bitwise_unmasked(name: str):
    gen = torch.Generator().manual_seed(11)
    logp0 = -torch.rand(4, 12, generator=gen) * 2
    old = logp0 + torch.randn(4, 12, generator=gen) * (3e-4 if name == "gspo" else 0.2)
    resp = torch.arange(12)[None, :] < torch.tensor([12, 7, 3, 10])[:, None]
    ent = torch.rand(4, 12, generator=gen)
    adv = torch.randn(4, generator=gen)
    ref = logp0 + 0.05
    out = []
    for rho in (1.0, None):
        logp = logp0.clone().requires_grad_(True)
        cfg = LossConfig(name=name, max_len=12, entropy_top_frac=rho, kl_beta=0.02)
        tm = forking_token_mask(ent, resp, rho).mask if rho else None
        loss, m = policy_loss(cfg, logp, old, adv, resp, tm, step_denominator(cfg, [resp]), ref)
        loss.backward()
        out.append((loss.detach(), logp.grad, m))
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])
    assert out[0][2] == out[1][2]


def test_gspo_sequence_coupling_without_mask():
    # Unmasked GSPO: s_i couples all tokens of a sequence; with the mask only kept tokens get a gradient
    # even though s_i (the value) still depends on every token (§3.7).
    logp0, ent, resp, adv = _onpolicy_4x12()
    old = logp0 + 0.0001
    cfg = LossConfig(name="gspo", entropy_top_frac=0.2)
    tm = forking_token_mask(ent, resp, 0.2).mask
    lp = logp0.clone().requires_grad_(True)
    loss_masked, _ = policy_loss(cfg, lp, old, adv, resp, tm, step_denominator(cfg, [resp]))
    lp2 = logp0.clone()
    lp2[~tm] -= 0.0002  # move only the dropped tokens: s_i changes, so the masked loss value changes
    loss_moved, _ = policy_loss(cfg, lp2, old, adv, resp, tm, step_denominator(cfg, [resp]))
    assert loss_moved.item() != loss_masked.item()


# ---------------------------------------------------------------------------------------------------------
# Gradient accumulation: 4 micro-batches with the step denominator == one full batch (§0, §6 P7).
# ---------------------------------------------------------------------------------------------------------
def _accum_case(name: str, agg: str, mask: str, kl: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    B, T = 16, 8
    lengths = torch.randint(1, T + 1, (B,), generator=gen)
    lengths[5] = 0  # a row without response tokens (allowed)
    resp = torch.arange(T)[None, :] < lengths[:, None]
    logp0 = -torch.rand(B, T, generator=gen, dtype=F64) * 2
    old = logp0 + torch.randn(B, T, generator=gen, dtype=F64) * (2e-4 if name == "gspo" else 0.2)
    ref = logp0 + torch.randn(B, T, generator=gen, dtype=F64) * 0.2
    adv = torch.randn(B, generator=gen, dtype=F64)
    ent = torch.rand(B, T, generator=gen)
    rho = None if mask == "off" else 0.3
    scope = "microbatch" if mask == "micro" else "step"
    cfg = LossConfig(
        name=name, agg=agg, max_len=T, kl_beta=0.1 if kl else 0.0, entropy_top_frac=rho, mask_scope=scope,
        mask_norm="all" if mask == "step_all" else None,
    )
    rows = [slice(4 * j, 4 * j + 4) for j in range(4)]
    micro_resp = [resp[r] for r in rows]
    masks = None
    if rho is not None:
        masks = [m.mask for m in masks_for_step([ent[r] for r in rows], micro_resp, rho, scope)]
    # Micro-batches: denominators from the counts alone, before any "forward".
    denom = step_denominator(cfg, micro_resp)
    lp_micro = logp0.clone().requires_grad_(True)
    total = torch.zeros((), dtype=F64)
    for j, r in enumerate(rows):
        loss, _ = policy_loss(cfg, lp_micro[r], old[r], adv[r], resp[r], None if masks is None else masks[j],
                              denom, ref[r] if kl else None)
        loss.backward()
        total = total + loss.detach()
    # Full batch with the same per-token masks.
    full_mask = None if masks is None else torch.cat(masks)
    full_denom = step_denominator(cfg, [resp], None if full_mask is None else [full_mask])
    assert full_denom == denom
    lp_full = logp0.clone().requires_grad_(True)
    loss_full, _ = policy_loss(cfg, lp_full, old, adv, resp, full_mask, full_denom, ref if kl else None)
    loss_full.backward()
    return total, loss_full.detach(), lp_micro.grad, lp_full.grad


@pytest.mark.parametrize("name", LOSS_NAMES)
def test_gradient_accumulation_equals_full_batch(name: str):
    aggs = ["seq_mean_token_mean"] if name == "gspo" else AGGREGATORS
    for agg in aggs:
        for mask in ("off", "step_kept", "step_all", "micro"):
            for kl in (False, True):
                tot, full, g_micro, g_full = _accum_case(name, agg, mask, kl)
                msg = f"{name} {agg} {mask} kl={kl}"
                torch.testing.assert_close(tot, full, rtol=0, atol=1e-6, msg=msg)
                torch.testing.assert_close(g_micro, g_full, rtol=0, atol=1e-6, msg=msg)
                assert g_full.abs().sum() > 0


def test_per_micro_means_would_be_wrong():
    # The P7 bug: averaging per-micro-batch token means != the global token mean with unequal lengths.
    gen = torch.Generator().manual_seed(3)
    resp = torch.arange(6)[None, :] < torch.tensor([6, 1, 2, 6])[:, None]
    lp = -torch.rand(4, 6, generator=gen, dtype=F64)
    adv = torch.randn(4, generator=gen, dtype=F64)
    cfg = LossConfig(name="reinforce", agg="token_mean")
    full, _ = policy_loss(cfg, lp, None, adv, resp, None, step_denominator(cfg, [resp]))
    naive = sum(
        policy_loss(cfg, lp[r], None, adv[r], resp[r], None, step_denominator(cfg, [resp[r]]))[0]
        for r in (slice(0, 2), slice(2, 4))
    ) / 2
    assert abs(naive.item() - full.item()) > 1e-3


# ---------------------------------------------------------------------------------------------------------
# Bad input: say plainly what is wrong.
# ---------------------------------------------------------------------------------------------------------
def test_config_validation():
    with pytest.raises(ValueError, match=r"unknown loss name 'ppo'; valid names: grpo, dr_grpo, dapo"):
        LossConfig(name="ppo")
    with pytest.raises(ValueError, match=r"entropy_top_frac must be in \(0, 1\], got 1.5"):
        LossConfig(name="dapo", entropy_top_frac=1.5)
    with pytest.raises(ValueError, match=r"entropy_top_frac must be in \(0, 1\], got 0"):
        LossConfig(name="dapo", entropy_top_frac=0)
    with pytest.raises(ValueError, match="clip_high is not used by loss 'reinforce'"):
        LossConfig(name="reinforce", clip_high=0.28)
    with pytest.raises(ValueError, match="clip_low is not used by loss 'cispo'"):
        LossConfig(name="cispo", clip_low=0.2)
    with pytest.raises(ValueError, match="cispo_max_weight is only used by loss 'cispo', not 'grpo'"):
        LossConfig(name="grpo", cispo_max_weight=5.0)
    with pytest.raises(ValueError, match="loss 'gspo' is sequence-level and needs agg 'seq_mean_token_mean'"):
        LossConfig(name="gspo", agg="token_mean")
    with pytest.raises(ValueError, match="dual_clip_c is not defined for loss 'gspo'"):
        LossConfig(name="gspo", dual_clip_c=3.0)
    with pytest.raises(ValueError, match=r"loss 'dr_grpo' with agg 'seq_sum_const' needs max_len"):
        LossConfig(name="dr_grpo")
    with pytest.raises(ValueError, match="unknown agg 'mean'"):
        LossConfig(name="grpo", agg="mean")
    with pytest.raises(ValueError, match=r"mask_norm must be one of \('kept', 'all'\), got 'tokens'"):
        LossConfig(name="grpo", mask_norm="tokens")
    with pytest.raises(ValueError, match="mask_scope must be one of .*got 'batch'"):
        LossConfig(name="grpo", mask_scope="batch")
    with pytest.raises(ValueError, match="dual_clip_c must be > 1, got 0.5"):
        LossConfig(name="grpo", dual_clip_c=0.5)
    with pytest.raises(ValueError, match="clip_low must be in"):
        LossConfig(name="dapo", clip_low=1.2)
    with pytest.raises(ValueError, match="kl_beta must be a finite number >= 0, got -0.1"):
        LossConfig(name="grpo", kl_beta=-0.1)


def test_defaults_resolved():
    assert LossConfig(name="grpo").clip == (0.2, 0.2)
    assert LossConfig(name="dapo").clip == (0.2, 0.28)
    assert LossConfig(name="gspo").clip == (3e-4, 4e-4)
    assert LossConfig(name="dr_grpo", max_len=3000).clip == (0.2, 0.2)
    assert LossConfig(name="dapo", clip_high=0.3).clip == (0.2, 0.3)
    assert LossConfig(name="cispo").clip is None and LossConfig(name="cispo").cispo_cap == 5.0
    assert LossConfig(name="reinforce").clip is None
    assert LossConfig(name="gspo").norm == "all" and LossConfig(name="dapo").norm == "kept"
    assert [LossConfig(name=n, max_len=1).aggregator for n in LOSS_NAMES] == [
        "seq_mean_token_mean", "seq_sum_const", "token_mean", "seq_mean_token_sum", "seq_mean_token_sum",
        "seq_mean_token_mean", "token_mean",
    ]


def test_policy_loss_bad_inputs():
    logp, old, adv = _hand_inputs()
    cfg = LossConfig(name="grpo")
    d = step_denominator(cfg, [RESP])
    with pytest.raises(ValueError, match=r"old_logp shape \(2, 2\) does not match logp shape \(2, 3\)"):
        policy_loss(cfg, logp, old[:, :2], adv, RESP, None, d)
    with pytest.raises(ValueError, match=r"ref_logp shape \(3, 3\) does not match logp shape \(2, 3\)"):
        policy_loss(cfg, logp, old, adv, RESP, None, d, ref_logp=torch.zeros(3, 3))
    with pytest.raises(ValueError, match=r"advantages must have shape \[B\] = \(2,\).*got \(2, 1\)"):
        policy_loss(cfg, logp, old, adv[:, None], RESP, None, d)
    with pytest.raises(ValueError, match=r"response_mask shape \(2, 4\) does not match .* \(2, 3\)"):
        policy_loss(cfg, logp, old, adv, torch.ones(2, 4, dtype=torch.bool), None, d)
    with pytest.raises(ValueError, match=r"token_mask shape \(1, 3\) does not match .* \(2, 3\)"):
        policy_loss(LossConfig(name="grpo", entropy_top_frac=0.5), logp, old, adv, RESP, KEEP[:1], d)
    with pytest.raises(ValueError, match="response_mask must be a bool tensor, got torch.float32"):
        policy_loss(cfg, logp, old, adv, RESP.float(), None, d)
    with pytest.raises(ValueError, match=r"response_mask has no response tokens \(all zero\)"):
        policy_loss(cfg, logp, old, adv, torch.zeros(2, 3, dtype=torch.bool), None, d)
    with pytest.raises(ValueError, match="response_masks have no response tokens"):
        step_denominator(cfg, [torch.zeros(2, 3, dtype=torch.bool)])
    with pytest.raises(ValueError, match="loss 'grpo' needs old_logp"):
        policy_loss(cfg, logp, None, adv, RESP, None, d)
    with pytest.raises(ValueError, match="kl_beta=0.1 needs ref_logp"):
        policy_loss(LossConfig(name="grpo", kl_beta=0.1), logp, old, adv, RESP, None, d)
    with pytest.raises(ValueError, match="entropy_top_frac=0.2 but token_mask is None"):
        policy_loss(LossConfig(name="dapo", entropy_top_frac=0.2), logp, old, adv, RESP, None, d)
    with pytest.raises(ValueError, match="token_mask drops 2 response tokens but entropy_top_frac=None"):
        policy_loss(cfg, logp, old, adv, RESP, KEEP, d)
    outside = KEEP.clone()
    outside[1, 2] = True  # padding
    with pytest.raises(ValueError, match="token_mask selects 1 tokens outside response_mask"):
        policy_loss(LossConfig(name="dapo", entropy_top_frac=0.5), logp, old, adv, RESP, outside, d)
    with pytest.raises(ValueError, match="is smaller than this micro-batch alone"):
        policy_loss(cfg, logp, old, adv, RESP, None, StepDenominator(pg_tokens=5, response_tokens=3, seqs=2))
    with pytest.raises(ValueError, match="denom must be a StepDenominator"):
        policy_loss(cfg, logp, old, adv, RESP, None, 5)
    with pytest.raises(ValueError, match="cfg must be a LossConfig, got str"):
        policy_loss("grpo", logp, old, adv, RESP, None, d)
