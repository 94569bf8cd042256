"""Exact batched probe gradients == one full autograd backward per position (float64, tiny random Llama).

Also a guard: the outer-product shortcut g_t x_t^T is *wrong* for layer-0 k_proj (algorithms.md §4.2),
so nobody "optimizes" the probe into it.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from forkrl.probe.gradients import (
    build_targets,
    exact_row_grads,
    parse_row_spec,
    reference_row_grads,
)
from tests.numerics import ATTN_FP32_RTOL

V = 37


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    m = LlamaForCausalLM(cfg).to(torch.float64).eval()
    with torch.no_grad():  # wider init than HF's 0.02 so the distributions are far from uniform
        for p in m.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.3)
    m.requires_grad_(False)
    return m


@pytest.fixture(scope="module")
def batch() -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int]]]:
    g = torch.Generator().manual_seed(1)
    lengths = [12, 9, 14]
    ids = torch.zeros(3, 14, dtype=torch.long)  # right padding with id 0
    mask = torch.zeros(3, 14, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, :n] = torch.randint(1, V, (n,), generator=g)
        mask[b, :n] = 1
    positions = [(0, 3), (0, 7), (0, 11), (1, 1), (1, 8), (2, 5), (2, 13), (2, 9)]
    return ids, mask, positions


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    # an exactly-zero reference (k_proj for the token right after position 0: a lone key gets no
    # gradient through a one-element softmax) must be matched exactly-ish too
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("method", ["vmap", "replicate", "loop"])
def test_exact_batched_equals_per_position_autograd(model, batch, method):
    ids, mask, positions = batch
    targets = build_targets(
        model,
        modules=("k_proj", "down_proj", "lm_head"),
        layers=(0, -1),
        row_specs=("random:8", "start"),
        seed=3,
    )
    names = {t.name for t in targets}
    assert {"layers.0.self_attn.k_proj", "layers.2.mlp.down_proj", "lm_head"} <= names
    # chunk 3 < K = 8: exercises chunking and graph reuse across chunks
    res = exact_row_grads(model, ids, mask, positions, targets, temperature=0.7, chunk_size=3, method=method)
    assert res.method == method
    ref = reference_row_grads(model, ids, mask, positions, targets, temperature=0.7)
    for t in targets:
        got, want = res.grads[t.name], ref[t.name]
        assert got.dtype == torch.float64 and got.shape == want.shape == (
            8,
            len(t.rows),
            t.linear.in_features,
        )
        for k in range(len(positions)):
            if want[k].norm() == 0:
                assert got[k].abs().max() < 1e-12, (t.name, k)
            else:
                assert _rel(got[k], want[k]) < ATTN_FP32_RTOL, (t.name, k)  # padded vs alone: numerics.py
        assert want.norm() > 0


@pytest.mark.parametrize("method", ["vmap", "replicate"])
def test_logp_matches_plain_forward(model, batch, method):
    ids, mask, positions = batch
    targets = build_targets(model, modules=("lm_head",), row_specs=("start",))
    res = exact_row_grads(model, ids, mask, positions, targets, temperature=1.3, method=method)
    with torch.no_grad():
        logq = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits / 1.3, -1)
    want = torch.stack([logq[b, t - 1, ids[b, t]] for b, t in positions])
    # the probe re-pads each chunk to its own width: float64 model, float32 attention softmax (numerics.py)
    torch.testing.assert_close(res.logp, want, rtol=ATTN_FP32_RTOL, atol=ATTN_FP32_RTOL)


def test_outer_product_shortcut_is_wrong_for_layer0_k_proj(model, batch):
    """One summed backward, then row r of g_t x_t^T: exact only for position-local modules (§4.2)."""
    ids, mask, positions = batch
    targets = build_targets(model, modules=("k_proj", "lm_head"), layers=(0,), row_specs=("start",))
    ref = reference_row_grads(model, ids, mask, positions, targets)
    cache: dict[str, dict[str, torch.Tensor]] = {}
    handles = []
    for t in targets:

        def hook(mod, inp, out, name=t.name):
            out = out.detach().requires_grad_(True) if not out.requires_grad else out
            cache[name] = {"x": inp[0].detach(), "y": out}
            return out

        handles.append(t.linear.register_forward_hook(hook))
    errs: dict[str, float] = {}
    try:
        for t in targets:
            errs[t.name] = 0.0
        for j, (b, tpos) in enumerate(positions):
            n = int(mask[b].sum())
            with torch.enable_grad():
                logits = model(input_ids=ids[b : b + 1, :n]).logits[0]
                lp = torch.log_softmax(logits, -1)[tpos - 1, ids[b, tpos]]
                gys = torch.autograd.grad(lp, [cache[t.name]["y"] for t in targets])
            for t, gy in zip(targets, gys, strict=True):
                # the position that predicts the token: lm_head at t-1, k_proj "at" the same position
                p = tpos - 1
                approx = torch.outer(gy[0, p, t.rows], cache[t.name]["x"][0, p])
                errs[t.name] = max(errs[t.name], _rel(approx, ref[t.name][j]))
    finally:
        for h in handles:
            h.remove()
    assert errs["lm_head"] < 1e-10  # position-local: the shortcut is exact here ...
    assert errs["layers.0.self_attn.k_proj"] > 0.1  # ... and badly wrong here


def test_row_specs(model):
    assert parse_row_spec("start", 64, head_dim=8) == tuple(range(8))
    assert parse_row_spec("last", 64, head_dim=8) == tuple(range(56, 64))
    assert parse_row_spec("mid", 64, head_dim=8) == tuple(range(32, 40))
    assert parse_row_spec("mid", 100, block_rows=10) == tuple(range(45, 55))
    assert parse_row_spec("0,5,-1", 10) == (0, 5, 9)
    r = parse_row_spec("random:5", 100, seed=1, salt="a")
    assert len(r) == 5 and r == parse_row_spec("random:5", 100, seed=1, salt="a")
    assert r != parse_row_spec("random:5", 100, seed=2, salt="a")
    heads = parse_row_spec("random:12", 64, head_dim=8, seed=0)  # 12 rows -> 2 whole heads
    assert len(heads) == 16 and all(heads[i] % 8 == i % 8 for i in range(16))
    with pytest.raises(ValueError, match="out of range"):
        parse_row_spec("3,10", 10)
    with pytest.raises(ValueError, match="row spec"):
        parse_row_spec("first", 10)
    # k_proj of the tiny model: 2 KV heads x head_dim 8 = 16 rows; random:32 -> all (whole) heads
    (t,) = build_targets(model, modules=("k_proj",), layers=(0,))
    assert t.rows == list(range(16))
    with pytest.raises(ValueError, match="layer 5 out of range"):
        build_targets(model, layers=(5,))


def test_vmap_failure_falls_back_to_exact_loop(model, batch, monkeypatch):
    """A kernel without a vmap batching rule makes is_grads_batched raise: the result must still be exact."""
    ids, mask, positions = batch
    targets = build_targets(model, modules=("k_proj",), layers=(0,), row_specs=("start",))
    real_grad = torch.autograd.grad

    def no_vmap(*args, **kwargs):
        if kwargs.get("is_grads_batched"):
            raise RuntimeError("Batching rule not implemented for aten::fake_attention")
        return real_grad(*args, **kwargs)

    monkeypatch.setattr(torch.autograd, "grad", no_vmap)
    res = exact_row_grads(model, ids, mask, positions, targets, chunk_size=4, method="vmap")
    assert res.method == "loop"
    ref = reference_row_grads(model, ids, mask, positions, targets)
    name = targets[0].name
    # the loop cuts each trajectory after its last scored token, the reference does not: different attention
    # row lengths, float32 attention softmax (numerics.py). The rel. error of each position's gradient:
    for k in range(len(positions)):
        assert _rel(res.grads[name][k], ref[name][k]) < ATTN_FP32_RTOL, k
