"""Packed sequences (forkrl/rl/forward.py `packed_rows`, `pack_sequences`): the rows of a micro-batch end to end in one
row, position ids restarting per row, no attention mask, no cache. Their log-probs, entropies and gradients equal
the plain (padded) forward's on EVERY model type the train step accepts (forkrl/rl/head.py), each a tiny random-init
model built from its config, with a sliding window of 4 tokens (shorter than the rows) where the type has one, so
a window applied across sequences or by packed position would show; in sdpa, and in eager for the windowed
types. Float64 (0 to ~3e-15 measured on log-probs and entropies; TOL 1e-9; gradients TOL_GRAD: Gemma's and Cohere's
norms compute in float32 even in a float64 model, and their weight gradients sum the tokens in another order, 2e-6
of 28 measured); the MoE types in float32 (their expert matmuls take no float64: ~5e-6 measured, TOL32).
A model or attention implementation not checked is refused by name, and so is packing without the token budget
(the packed row's length budget). The train step on packed micro-batches equals fixed micro-batches:
tests/unit/test_microbatch.py, tests/dist/test_token_budget_ranks.py (2 ranks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from forkrl.rl import head
from forkrl.rl.batch import Batch, build_batch
from forkrl.rl.entropy import causal_lm_logprobs_and_entropy
from forkrl.rl.forward import packed_rows
from forkrl.rl.head import UnsupportedModel, check_packing, supported_model_types
from forkrl.rl.losses import LossConfig
from forkrl.rl.step import train_step
from forkrl.rl.varlen import NAME, varlen_attention
from forkrl.training.config import RunConfig
from forkrl.training.preflight import check_architecture

V, T = 37, 0.7
TOL, TOL_GRAD, TOL32 = 1e-9, 1e-6, 2e-5
SHAPE = dict(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, max_position_embeddings=64, initializer_range=0.5, pad_token_id=0)
WINDOW = dict(sliding_window=4)
EXTRA: dict[str, dict] = {
    "qwen2": dict(use_sliding_window=True, sliding_window=4, max_window_layers=1),
    "mistral": WINDOW, "ministral": dict(WINDOW, head_dim=8), "mixtral": WINDOW, "starcoder2": WINDOW,
    "phi3": WINDOW, "cohere2": WINDOW, "exaone4": WINDOW, "olmo3": WINDOW,
    "gemma2": dict(WINDOW, head_dim=8, final_logit_softcapping=2.0), "gemma3_text": dict(WINDOW, head_dim=8),
    "glm": dict(head_dim=8), "glm4": dict(head_dim=8), "cohere": dict(logit_scale=0.3),
    "granite": dict(logits_scaling=3.0),
    "qwen2_moe": dict(moe_intermediate_size=8, shared_expert_intermediate_size=8, num_experts=4),
    "qwen3_moe": dict(moe_intermediate_size=8, num_experts=4, num_experts_per_tok=2),
    "granitemoe": dict(num_local_experts=4), "granitemoeshared": dict(num_local_experts=4, shared_intermediate_size=8),
    "gptj": dict(n_embd=16, n_layer=2, n_head=2, rotary_dim=4, n_positions=64),
}
FLOAT32 = {"mixtral", "qwen2_moe", "qwen3_moe", "granitemoe", "granitemoeshared"}  # grouped expert matmuls


def _model(model_type: str, attn: str = "sdpa") -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(model_type, **SHAPE, **EXTRA.get(model_type, {}))
    if model_type == "gptj":
        attn = "eager"  # its only implementation
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn)
    return model.float() if model_type in FLOAT32 else model.double()


def _batch() -> Batch:
    """3 prompts (2, 4, 6 tokens) x 3 samples (1, 4, 7 tokens): rows of 3-13 tokens, right-padded."""
    gen = torch.Generator().manual_seed(1)
    prompts, comps = [], []
    for k in range(3):
        p = torch.randint(1, V, (2 + 2 * k,), generator=gen).tolist()
        for s in range(3):
            prompts.append(p)
            comps.append(torch.randint(1, V, (1 + 3 * s,), generator=gen).tolist())
    return build_batch(prompts, comps, [[0.0] * len(c) for c in comps], pad_id=0)


def _run(model: torch.nn.Module, b: Batch, pack: bool) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    lp, ent = causal_lm_logprobs_and_entropy(model, b.input_ids, b.attention_mask, b.response_mask, temperature=T,
                                             chunk_size=5, pack=pack)
    w = torch.randn(lp.shape, generator=torch.Generator().manual_seed(7), dtype=lp.dtype)
    (lp * w).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    assert ent is not None
    return lp.detach(), ent, grads


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> None:
    err = float((a - b).abs().max())
    assert err <= tol * max(1.0, float(b.abs().max())), err


def _check(model: torch.nn.Module, tol: float, tol_grad: float, ref: torch.nn.Module | tuple | None = None) -> None:
    """Packed `model` against the padded forward of `ref` (default: the same model; or its `_run` result)."""
    b = _batch()
    rm = b.response_mask
    ref_lp, ref_ent, ref_g = ref if isinstance(ref, tuple) else _run(model if ref is None else ref, b, pack=False)
    lp, ent, g = _run(model, b, pack=True)
    _close(lp[rm], ref_lp[rm], tol)
    _close(ent[rm], ref_ent[rm], tol)
    assert float(lp[~rm].abs().max()) == 0.0
    assert g.keys() == ref_g.keys()
    for k, v in g.items():
        _close(v, ref_g[k], tol_grad)


@pytest.mark.parametrize("varlen", [False, True], ids=["block-mask", "varlen"])
@pytest.mark.parametrize("model_type", supported_model_types())
def test_packed_rows_equal_the_padded_forward_on_every_accepted_model_type(model_type: str, varlen: bool) -> None:
    """transformers' sdpa over the whole packed row with its block-diagonal mask, and forkrl/rl/varlen.py's sdpa
    per sequence (the train step's), against the padded forward on plain sdpa."""
    model = _model(model_type)
    check_packing(model.config, model.config._attn_implementation)  # accepted
    tols = (TOL32, TOL32) if model_type in FLOAT32 else (TOL, TOL_GRAD)
    b = _batch()
    ref = _run(model, b, pack=False)
    with varlen_attention(model if varlen else None):
        assert (model.config._attn_implementation == NAME) == (varlen and model_type != "gptj")  # gptj: eager
        _check(model, *tols, ref=ref)
    assert model.config._attn_implementation in ("sdpa", "eager")  # switched back


@pytest.mark.parametrize("model_type", ["qwen2", "mistral", "gemma2"])
def test_packed_rows_equal_the_padded_forward_in_eager_attention(model_type: str) -> None:
    """Eager's softmax runs in float32 even in a float64 model (~1e-6). The reference is sdpa's padded forward of
    the same weights: eager's own padded forward has NaN gradients under a window shorter than the padding (a pad
    query whose window holds only pad keys: a fully masked softmax row), which packing, having no pad, has not.
    Gemma 2 soft-caps its attention scores in eager and not in sdpa, so its reference is its own eager forward,
    with the window widened to 16 (past every row) for finite padded gradients."""
    if model_type == "gemma2":
        model = _model(model_type, "eager")
        model.config.sliding_window = 16
        _check(model, TOL32, TOL32)
    else:
        _check(_model(model_type, "eager"), TOL32, TOL32, ref=_model(model_type))


def test_the_packed_row_is_one_forward_of_every_token_without_padding() -> None:
    model = _model("qwen2")
    b = _batch()
    seen: list[tuple[int, ...]] = []
    handle = model.get_decoder().register_forward_pre_hook(
        lambda _m, _a, kw: seen.append(tuple(kw["input_ids"].shape)), with_kwargs=True)
    with torch.no_grad():
        rows = packed_rows(model, b.input_ids, b.attention_mask, b.response_mask)
    handle.remove()
    assert seen == [(1, int(b.attention_mask.sum()))]  # one row: every real token once, no pad token
    assert rows.shape == (int(b.response_mask.sum()), 16)


def test_packing_a_left_padded_batch_is_refused() -> None:
    model = _model("qwen2")
    b = _batch()
    left = b.attention_mask.flip(1)
    with pytest.raises(ValueError, match="packed rows need right-padded rows"):
        packed_rows(model, b.input_ids, left, b.response_mask)


def test_a_model_or_attention_not_checked_for_packing_is_refused(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Path) -> None:
    batch = _batch()
    adv = torch.randn(len(batch))
    model = _model("qwen2").float()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kw = dict(temperature=1.0, micro_batch_size=4, max_grad_norm=1.0, max_tokens_per_micro_batch=64,
              pack_sequences=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(UnsupportedModel, match="the attention implementation 'flex_attention' is not one that "
                                               "separates packed sequences"):
        train_step(model, opt, batch, adv, LossConfig(name="grpo"), **kw)
    model.config._attn_implementation = "sdpa"
    monkeypatch.setattr(head, "_PACKED", frozenset())  # a type added to the table but not checked packed
    with pytest.raises(UnsupportedModel, match="pack_sequences: model_type 'qwen2' is not checked for packed"):
        train_step(model, opt, batch, adv, LossConfig(name="grpo"), **kw)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # refused before any work
    # StartRun's preflight reads config.json: the same refusal, naming the setting
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    with pytest.raises(ValueError, match="model: pack_sequences: model_type 'qwen2' is not checked"):
        check_architecture(RunConfig(model=str(tmp_path), max_tokens_per_micro_batch=64, pack_sequences=True))
    check_architecture(RunConfig(model=str(tmp_path), max_tokens_per_micro_batch=64))  # packing off: fine
    monkeypatch.undo()
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "attn_implementation": "flex_attention"}))
    with pytest.raises(ValueError, match="model: pack_sequences: the attention implementation 'flex_attention'"):
        check_architecture(RunConfig(model=str(tmp_path), max_tokens_per_micro_batch=64, pack_sequences=True))


def test_packing_needs_the_token_budget() -> None:
    both = "pack_sequences needs max_tokens_per_micro_batch > 0.*got max_tokens_per_micro_batch 0"
    with pytest.raises(ValueError, match=both):
        RunConfig(pack_sequences=True)
    batch = _batch()
    model = _model("qwen2").float()
    with pytest.raises(ValueError, match=both):
        train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), batch, torch.randn(len(batch)),
                   LossConfig(name="grpo"), temperature=1.0, micro_batch_size=4, max_grad_norm=1.0,
                   pack_sequences=True)
    assert RunConfig(pack_sequences=True, max_tokens_per_micro_batch=4096).pack_sequences


def test_varlen_attention_attends_within_each_sequence_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under varlen_attention each sdpa call covers one sequence (its length), never the whole packed row; outside
    it, the packed row is one call per layer (transformers' block mask) and the model is on sdpa again."""
    model = _model("qwen2")
    b = _batch()
    seen: list[int] = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        seen.append(q.shape[2])
        return real(q, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    lengths = b.attention_mask.sum(1).tolist()
    with torch.no_grad():
        with varlen_attention(model):
            packed_rows(model, b.input_ids, b.attention_mask, b.response_mask)
        assert sorted(seen) == sorted(lengths * 2)  # 2 layers, each sequence alone
        seen.clear()
        packed_rows(model, b.input_ids, b.attention_mask, b.response_mask)
    assert seen == [sum(lengths)] * 2 and model.config._attn_implementation == "sdpa"


def test_packed_step_with_activation_checkpointing_equals_fixed_micro_batches() -> None:
    """Activation checkpointing recomputes each layer's forward in the backward: under the packed step that is the
    same per-sequence attention (varlen_attention spans the backward), so the update equals fixed micro-batches'."""
    from forkrl.training.distributed import enable_activation_checkpointing
    from tests.dist.budget_worker import BUDGET, CASES, KW, build_inputs
    from tests.dist.dp_worker import build_model

    cfg, _ = CASES["dapo"]
    out = []
    for budget, pack, ckpt in ((0, False, False), (BUDGET, True, True)):
        batch, adv = build_inputs()
        model = build_model(False)
        if ckpt:
            enable_activation_checkpointing(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.3)
        m = train_step(model, opt, batch, adv, cfg, micro_batch_size=4, max_tokens_per_micro_batch=budget,
                       pack_sequences=pack, **KW)
        out.append((m, {k: v.detach().clone() for k, v in model.state_dict().items()}))
        assert model.config._attn_implementation == "sdpa"
    (ref, w_ref), (got, w) = out
    assert got["kept_tokens"] == ref["kept_tokens"] and got["n_updates"] == ref["n_updates"] == 4
    assert abs(got["loss"] - ref["loss"]) <= 4e-5 * max(1.0, abs(ref["loss"]))
    scale = max(1.0, max(float(v.abs().max()) for v in w_ref.values()))
    assert max(float((w[k] - w_ref[k]).abs().max()) for k in w_ref) <= 4 * 0.3 * 1e-5 * scale  # u lr REL
