"""forkrl.rl.step: batch layout, logp alignment, gradient accumulation and the mask through a real model."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from forkrl.rl.batch import Batch
from forkrl.rl.losses import LossConfig
from forkrl.rl.step import _forward, build_batch, train_step
from tests.numerics import FP32_EPS

VOCAB = 23


def _model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).float()


def _trajectories(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    prompts, comps, lps = [], [], []
    for _ in range(n):
        p = torch.randint(3, VOCAB, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
        c = torch.randint(3, VOCAB, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist()
        prompts.append(p)
        comps.append(c)
        lps.append([-1.0] * len(c))
    return prompts, comps, lps


def test_build_batch_marks_exactly_the_completion_targets() -> None:
    b = build_batch([[5, 6, 7], [8]], [[9, 10], [11, 12, 13]], [[-0.1, -0.2], [-0.3, -0.4, -0.5]], pad_id=0)
    assert b.input_ids.tolist() == [[5, 6, 7, 9, 10], [8, 11, 12, 13, 0]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    # target j is input_ids[j + 1]: completion targets of row 0 are at 2, 3; of row 1 at 0, 1, 2
    assert b.response_mask.tolist() == [[False, False, True, True], [True, True, True, False]]
    assert b.response_mask.dtype == torch.bool
    assert torch.allclose(b.rollout_logp, torch.tensor([[0, 0, -0.1, -0.2], [-0.3, -0.4, -0.5, 0]]))
    with pytest.raises(ValueError, match="trajectory 0: 2 completion tokens but 1 logprobs"):
        build_batch([[1]], [[2, 3]], [[-1.0]], pad_id=0)
    with pytest.raises(ValueError, match="empty prompt"):
        build_batch([[]], [[2]], [[-1.0]], pad_id=0)


def _build_batch_by_rows(prompts: list[list[int]], comps: list[list[int]], lps: list[list[float]],
                         pad_id: int) -> Batch:
    # the slow reference: one row at a time, straight from the layout's definition
    width = max(len(p) + len(c) for p, c in zip(prompts, comps, strict=True))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    att = torch.zeros((len(prompts), width), dtype=torch.long)
    resp = torch.zeros((len(prompts), width - 1), dtype=torch.bool)
    roll = torch.zeros((len(prompts), width - 1), dtype=torch.float32)
    for i, (p, c, lp) in enumerate(zip(prompts, comps, lps, strict=True)):
        ids[i, : len(p) + len(c)] = torch.tensor(p + c)
        att[i, : len(p) + len(c)] = 1
        for k, x in enumerate(lp):
            resp[i, len(p) - 1 + k] = True
            roll[i, len(p) - 1 + k] = x
    return Batch(ids, att, resp, roll)


@pytest.mark.parametrize("seed", range(4))
def test_build_batch_equals_the_row_by_row_layout(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 12, (1,), generator=g))
    prompts = [torch.randint(3, VOCAB, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]
    comps = [torch.randint(3, VOCAB, (int(torch.randint(0, 9, (1,), generator=g)),), generator=g).tolist()
             for _ in range(n)]  # empty completions included
    lps = [(-torch.rand(len(c), generator=g, dtype=torch.float64)).tolist() for c in comps]
    got, want = build_batch(prompts, comps, lps, pad_id=1), _build_batch_by_rows(prompts, comps, lps, pad_id=1)
    for a, b in zip((got.input_ids, got.attention_mask, got.response_mask, got.rollout_logp),
                    (want.input_ids, want.attention_mask, want.response_mask, want.rollout_logp), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    one = build_batch([[4]], [[]], [[]], pad_id=0)  # a single prompt token, nothing generated: no target at all
    assert one.input_ids.tolist() == [[4]] and tuple(one.response_mask.shape) == (1, 0)


def test_forward_logp_equals_teacher_forced_reference() -> None:
    model = _model()
    prompts, comps, lps = _trajectories(5)
    batch = build_batch(prompts, comps, lps, pad_id=0)
    T = 0.7
    with torch.no_grad():
        logp, ent = _forward(model, batch, T, True)
        for i, (p, c) in enumerate(zip(prompts, comps, strict=True)):
            ids = torch.tensor([p + c])
            ref = torch.log_softmax(model(ids).logits[0].double() / T, -1)
            for k, tok in enumerate(c):
                pos = len(p) - 1 + k
                # Both are float32 forwards (batched with padding vs alone): they differ by float32 rounding
                # of numbers of size |logp| + ln V (the logits of this random model are O(1)); 32 ulps of
                # that is far below what a wrong position or a padding token would change (O(0.1)).
                want_lp = float(ref[pos, tok])
                probs = ref[pos].exp()
                want_ent = float(-(probs * ref[pos]).sum())
                assert abs(float(logp[i, pos]) - want_lp) < 32 * FP32_EPS * (abs(want_lp) + math.log(VOCAB))
                assert abs(float(ent[i, pos]) - want_ent) < 32 * FP32_EPS * (want_ent + math.log(VOCAB))
        assert float(logp[~batch.response_mask].abs().max()) == 0.0


def _update(model, batch, adv, cfg, micro):
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    metrics = train_step(model, opt, batch, adv, cfg, temperature=1.0, micro_batch_size=micro, max_grad_norm=1e9)
    return model, metrics


@pytest.mark.parametrize("loss", ["grpo", "dapo", "dr_grpo", "rloo", "gspo", "cispo"])
def test_gradient_accumulation_equals_full_batch(loss: str) -> None:
    model = _model()
    prompts, comps, lps = _trajectories(8)
    batch = build_batch(prompts, comps, lps, pad_id=0)
    adv = torch.linspace(-1, 1, 8)
    for rho, scope in ((None, "microbatch"), (0.3, "step")):
        cfg = LossConfig(name=loss, max_len=8, entropy_top_frac=rho, mask_scope=scope)
        full, m_full = _update(model, batch, adv, cfg, micro=8)
        accum, m_acc = _update(model, batch, adv, cfg, micro=2)
        assert m_acc["micro_batches"] == 4.0 and m_full["micro_batches"] == 1.0
        # Same denominators, so the only difference is the float32 order of summing 4 micro-batch
        # gradients (and losses): a few ulps of the values, which are <= ~1 here (weights of magnitude 1,
        # updates of ~0.5). 8 ulps of max(1, |value|) allows it; a wrong denominator is off by x2-x4.
        assert m_acc["loss"] == pytest.approx(m_full["loss"], abs=8 * FP32_EPS * max(1.0, abs(m_full["loss"])))
        for (name, a), b in zip(full.named_parameters(), accum.parameters(), strict=True):
            tol = 8 * FP32_EPS * max(1.0, float(a.abs().max()))
            assert torch.allclose(a, b, rtol=0, atol=tol), name
        assert m_acc["kept_tokens"] == m_full["kept_tokens"]


def test_microbatch_mask_keeps_exact_k_per_micro_batch() -> None:
    model = _model()
    prompts, comps, lps = _trajectories(8, seed=3)
    batch = build_batch(prompts, comps, lps, pad_id=0)
    cfg = LossConfig(name="dapo", entropy_top_frac=0.2)
    _, m = _update(model, batch, torch.ones(8), cfg, micro=4)
    counts = [int(batch.response_mask[s:s + 4].sum()) for s in (0, 4)]
    assert m["kept_tokens"] == sum(max(1, -(-c // 5)) for c in counts)  # ceil(c / 5) in integers
    assert m["response_tokens"] == sum(counts)
    assert 0 < m["kept_frac"] < 0.5
    assert m["logp_delta_mean"] > 0  # the fake rollout logprobs (-1) differ from the model's


@pytest.mark.parametrize("scope", ["microbatch", "step"])
def test_kept_out_reports_each_sequences_kept_completion_tokens(scope: str) -> None:
    model = _model()
    prompts, comps, lps = _trajectories(8, seed=4)
    batch = build_batch(prompts, comps, lps, pad_id=0)
    kept: list[torch.Tensor] = []
    cfg = LossConfig(name="grpo", entropy_top_frac=0.2, mask_scope=scope)
    opt = torch.optim.SGD(copy.deepcopy(model).parameters(), lr=0.0)
    m = train_step(model, opt, batch, torch.ones(8), cfg, temperature=1.0, micro_batch_size=3, max_grad_norm=1.0,
                   kept_out=kept)
    assert [len(k) for k in kept] == [len(c) for c in comps]  # one flag per completion token, in batch order
    assert all(k.dtype == torch.bool for k in kept)
    assert sum(int(k.sum()) for k in kept) == m["kept_tokens"]
    # the flags are the kept tokens of the highest entropy: recompute them per micro-batch (3, 3, 2 rows)
    with torch.no_grad():
        ents = [_forward(model, batch.slice(s, min(s + 3, 8)), 1.0, True)[1] for s in (0, 3, 6)]
    resp = [batch.slice(s, min(s + 3, 8)).response_mask for s in (0, 3, 6)]
    from forkrl.rl.mask import forking_token_mask, masks_for_step

    masks = masks_for_step(ents, resp, 0.2, "step") if scope == "step" else \
        [forking_token_mask(e, r, 0.2) for e, r in zip(ents, resp, strict=True)]
    want = [mk.mask[i][r[i]] for mk, r in zip(masks, resp, strict=True) for i in range(len(r))]
    assert all(torch.equal(a, b) for a, b in zip(kept, want, strict=True))


@pytest.mark.parametrize("rho,scope", [(None, "microbatch"), (0.2, "microbatch"), (0.3, "step")])
def test_a_micro_batch_of_empty_completions_is_skipped(rho: float | None, scope: str) -> None:
    """Aborted samples come back with 0 tokens. A micro-batch of only those trains on nothing (it used to
    raise 'response_mask has no real tokens'); the step equals the one without them, bit for bit: the same
    micro-batches in the same order, and the denominators count only sequences with tokens."""
    prompts, comps, lps = _trajectories(8, seed=5)
    for i in (2, 3):  # micro-batch 1 of 4 (micro=2) is all empty
        comps[i], lps[i] = [], []
    adv = torch.linspace(-1, 1, 8)
    cfg = LossConfig(name="dapo", max_len=8, entropy_top_frac=rho, mask_scope=scope)
    with_empty, m = _update(_model(), build_batch(prompts, comps, lps, pad_id=0), adv, cfg, micro=2)
    keep = [0, 1, 4, 5, 6, 7]
    without, m_ref = _update(_model(), build_batch([prompts[i] for i in keep], [comps[i] for i in keep],
                                                   [lps[i] for i in keep], pad_id=0), adv[keep], cfg, micro=2)
    assert m["micro_batches"] == m_ref["micro_batches"] == 3.0
    assert m == m_ref
    for (name, a), b in zip(with_empty.named_parameters(), without.parameters(), strict=True):
        assert torch.equal(a, b), name
    # empty completions inside a micro-batch with real ones (micro=4): trained as well, finite
    _, m4 = _update(_model(), build_batch(prompts, comps, lps, pad_id=0), adv, cfg, micro=4)
    assert m4["micro_batches"] == 2.0 and math.isfinite(m4["loss"]) and m4["response_tokens"] == m["response_tokens"]
    with pytest.raises(ValueError, match="all 2 completions of the step are empty"):
        _update(_model(), build_batch(prompts[2:4], comps[2:4], lps[2:4], pad_id=0), adv[2:4], cfg, micro=2)
