"""The train step's log-probs and entropies are the model's own, on every architecture it accepts and on every path
(plain, shared-prompt, the chunked head), or the model is refused by name (forkrl/rl/head.py).

Tiny random-init float64 models built from configs (no downloads), each with the feature that the hidden-state path
must reproduce: Phi's lm_head bias (random, so it matters), Gemma 2's final soft-capping (with a sliding window of 4
too), Cohere's `logit_scale`, Granite's `logits_scaling`, Mistral and Qwen2 with a sliding window of 4 tokens, shorter
than the rows. The batch is GRPO-shaped: 3 prompts of 2-6 tokens with 3 samples each of 1-7 tokens, right-padded.
The reference is `token_logprobs_and_entropy` on the logits of the model's own `forward` (the same fp math from
logits, forkrl/rl/entropy.py). In float64 the two agree to ~1e-15 (TOL 1e-9 leaves 6 orders for the different
matmul shapes and none for a dropped bias, cap or scale: those move log-probs by O(1)), and so do the gradients of
every parameter (bias included) through the chunked head's own backward (TOL_GRAD_SHARED below for the shared-prompt
path); one float32 model is held to TOL32 (a few float32 roundings of values of magnitude ~10).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import (
    CohereConfig,
    CohereForCausalLM,
    FalconH1Config,
    FalconH1ForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    GraniteConfig,
    GraniteForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PhiConfig,
    PhiForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from forkrl.probe.sampling import Trajectory, token_stats
from forkrl.rl.batch import Batch, build_batch
from forkrl.rl.entropy import causal_lm_logprobs_and_entropy, token_logprobs_and_entropy
from forkrl.rl.forward import shared_prefix_rows
from forkrl.rl.head import LogitsPost, UnsupportedModel, attention_window, logits_post
from forkrl.rl.step import _forward as train_step_forward
from forkrl.training.config import RunConfig
from forkrl.training.preflight import check_architecture, preflight

V = 37
T = 0.7
TOL = 1e-9
TOL32 = 2e-5
# gradients through the shared-prompt path: HF's RMSNorm computes in float32 even in a float64 model, and that path
# sums a prompt's gradient over its samples before the norm's backward (the plain path after), so its gradients
# carry float32 roundings: measured 4e-8 of the largest entry (embed_tokens, Qwen2); a dropped feature moves O(0.1)
TOL_GRAD_SHARED = 1e-6
SHAPE = dict(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, max_position_embeddings=64, initializer_range=0.5)


def _phi() -> torch.nn.Module:
    m = PhiForCausalLM(PhiConfig(**SHAPE))
    torch.nn.init.normal_(m.lm_head.bias, std=1.0)  # HF initializes it to 0: a dropped bias would go unseen
    return m


BUILD = {
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**SHAPE)),
    "qwen2-window": lambda: Qwen2ForCausalLM(Qwen2Config(**SHAPE, use_sliding_window=True, sliding_window=4,
                                                         max_window_layers=1)),
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**SHAPE)),
    "phi-bias": _phi,
    "gemma2-softcap": lambda: Gemma2ForCausalLM(Gemma2Config(**SHAPE, head_dim=8, final_logit_softcapping=2.0,
                                                             sliding_window=4)),
    "cohere-scale": lambda: CohereForCausalLM(CohereConfig(**SHAPE, logit_scale=0.3)),
    "granite-scaling": lambda: GraniteForCausalLM(GraniteConfig(**SHAPE, logits_scaling=3.0)),
    "mistral-window": lambda: MistralForCausalLM(MistralConfig(**SHAPE, sliding_window=4)),
}
WINDOWED = {"qwen2-window", "gemma2-softcap", "mistral-window"}


def _model(name: str, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    torch.manual_seed(0)
    return BUILD[name]().to(dtype)


def _grpo_batch() -> Batch:
    """3 prompts (2, 4, 6 tokens) x 3 samples (1, 4, 7 tokens): rows of 3-13 tokens, right-padded."""
    gen = torch.Generator().manual_seed(1)
    prompts, comps = [], []
    for k in range(3):
        p = torch.randint(1, V, (2 + 2 * k,), generator=gen).tolist()
        for s in range(3):
            prompts.append(p)
            comps.append(torch.randint(1, V, (1 + 3 * s,), generator=gen).tolist())
    return build_batch(prompts, comps, [[0.0] * len(c) for c in comps], pad_id=0)


def _weights(shape: torch.Size) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def _reference(model: torch.nn.Module, b: Batch) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """logp, entropy and the gradient of sum(w * logp) from the model's own logits."""
    logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits[:, :-1]
    logp, ent = token_logprobs_and_entropy(logits, b.input_ids[:, 1:], temperature=T)
    (logp * _weights(logp.shape).to(logp.dtype))[b.response_mask].sum().backward()
    return logp.detach(), ent, _grads(model)


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> float:
    err = float((a - b).abs().max())
    assert err <= tol * max(1.0, float(b.abs().max())), err
    return err


@pytest.mark.parametrize("name", list(BUILD))
def test_train_step_logprobs_are_the_models_own(name: str) -> None:
    model = _model(name)
    b = _grpo_batch()
    rm = b.response_mask
    ref_lp, ref_ent, ref_grads = _reference(model, b)
    for share in (False, True):
        lp, ent = causal_lm_logprobs_and_entropy(model, b.input_ids, b.attention_mask, rm, temperature=T,
                                                 chunk_size=5, share_prefix=share)  # several chunks
        assert ent is not None
        (lp * _weights(lp.shape)).sum().backward()
        _close(lp.detach()[rm], ref_lp[rm], TOL)
        _close(ent[rm], ref_ent[rm], TOL)
        assert float(lp.detach()[~rm].abs().max()) == 0.0
        grads = _grads(model)
        assert grads.keys() == ref_grads.keys()  # the head's bias among them (Phi)
        for key, g in grads.items():
            _close(g, ref_grads[key], TOL_GRAD_SHARED if share else TOL)
    with torch.no_grad():  # the train step's own forward (it picks the shared-prompt path on one process)
        lp, ent = train_step_forward(model, b, T, True)
    _close(lp[rm], ref_lp[rm], TOL)
    _close(ent[rm], ref_ent[rm], TOL)
    # the shared-prompt path ran where it may; under a window the rows cross (13 tokens > 4) it falls back
    used = shared_prefix_rows(model, b.input_ids, b.attention_mask, rm) is not None
    assert used == (name not in WINDOWED)


def test_float32_model_within_float32_rounding() -> None:
    model = _model("gemma2-softcap", torch.float32)
    b = _grpo_batch()
    with torch.no_grad():
        logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits[:, :-1]
        ref_lp, ref_ent = token_logprobs_and_entropy(logits, b.input_ids[:, 1:], temperature=T)
        for share in (False, True):
            lp, ent = causal_lm_logprobs_and_entropy(model, b.input_ids, b.attention_mask, b.response_mask,
                                                     temperature=T, share_prefix=share)
            _close(lp[b.response_mask], ref_lp[b.response_mask], TOL32)
            _close(ent[b.response_mask], ref_ent[b.response_mask], TOL32)


@pytest.mark.parametrize("name", ["mistral-window", "gemma2-softcap"])
def test_shared_prompt_path_runs_exactly_up_to_the_window(name: str) -> None:
    """The padded second pass spans P_max + (C_max - 1) = 6 + 6 = 12 cache positions: with a window of 12 no key is
    out of reach and the shared path runs, equal to the model's own; with 11 it would not be, and it falls back."""
    b = _grpo_batch()
    for window, shared in ((12, True), (11, False)):
        model = _model(name)
        model.config.sliding_window = window
        ref_lp, ref_ent, _ = _reference(model, b)
        with torch.no_grad():
            rows = shared_prefix_rows(model, b.input_ids, b.attention_mask, b.response_mask)
            lp, ent = causal_lm_logprobs_and_entropy(model, b.input_ids, b.attention_mask, b.response_mask,
                                                     temperature=T, share_prefix=True)
        assert (rows is not None) == shared, window
        _close(lp[b.response_mask], ref_lp[b.response_mask], TOL)
        _close(ent[b.response_mask], ref_ent[b.response_mask], TOL)


def _falcon_h1() -> torch.nn.Module:
    """A model type forkrl does not know, whose forward multiplies its logits (`lm_head_multiplier`)."""
    return FalconH1ForCausalLM(FalconH1Config(
        vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, mamba_d_ssm=16, mamba_n_heads=2, mamba_d_head=8, mamba_d_state=4, mamba_chunk_size=4,
        lm_head_multiplier=0.5))


def test_an_unknown_model_type_is_refused_by_name(tmp_path: Path) -> None:
    b = _grpo_batch()
    with pytest.raises(UnsupportedModel, match="model_type 'falcon_h1' is not supported: its forward multiplies the "
                                               "logits by lm_head_multiplier"):
        causal_lm_logprobs_and_entropy(_falcon_h1(), b.input_ids, b.attention_mask, b.response_mask)
    # at StartRun, from config.json, naming the setting and the model type
    for config, match in (({"model_type": "falcon_h1"}, "model: model_type 'falcon_h1' is not supported"),
                          ({"model_type": "hyperclovax", "logits_scaling": 2.0},
                           "'hyperclovax' is not supported: its forward multiplies the logits by logits_scaling"),
                          ({"model_type": "bloom"}, "'bloom' is not supported: forkrl computes log-probs from"),
                          ({}, "model: its config names no model_type"),
                          ({"model_type": "gemma2", "final_logit_softcapping": -1.0},
                           "'gemma2': its final_logit_softcapping must be a number > 0, got -1.0"),
                          ({"model_type": "granite", "logits_scaling": 0}, "'granite': its logits_scaling must be")):
        (tmp_path / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match=match):
            check_architecture(RunConfig(model=str(tmp_path)))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "falcon_h1"}))
    with pytest.raises(ValueError, match="model: model_type 'falcon_h1' is not supported: its forward multiplies"):
        preflight(RunConfig(model=str(tmp_path)))  # StartRun's check (ValueError: INVALID_ARGUMENT)
    (tmp_path / "config.json").write_text(json.dumps(_model("gemma2-softcap").config.to_dict()))
    check_architecture(RunConfig(model=str(tmp_path)))  # a known one passes


def test_the_rule_read_from_the_config() -> None:
    assert logits_post(_model("gemma2-softcap").config) == LogitsPost(softcap=2.0)
    assert logits_post(_model("cohere-scale").config) == LogitsPost(scale=0.3)
    assert logits_post({"model_type": "granite", "logits_scaling": 4}) == LogitsPost(scale=0.25)
    assert logits_post({"model_type": "gemma2", "final_logit_softcapping": None}).identity
    assert logits_post(_model("phi-bias").config).identity  # the bias is the head module's own
    assert attention_window(_model("qwen2").config) is None
    assert attention_window({"model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": False}) is None
    assert attention_window({"sliding_window": 8, "layer_types": ["full_attention"] * 2}) is None
    assert attention_window(_model("qwen2-window").config) == 4
    assert attention_window(_model("mistral-window").config) == 4


@pytest.mark.parametrize("name", ["phi-bias", "granite-scaling", "gemma2-softcap"])
def test_probe_token_stats_are_the_models_own(name: str) -> None:
    """The probe's entropy pass shares the rule (it used to catch soft-capping and `logit_scale` only)."""
    model = _model(name)
    b = _grpo_batch()
    ref_lp, ref_ent, _ = _reference(model, b)
    trajs = []
    for r in range(b.input_ids.shape[0]):
        idx = b.response_mask[r].nonzero().squeeze(1)
        p0, n = int(idx[0]) + 1, idx.numel()
        ids = b.input_ids[r].tolist()
        trajs.append(Trajectory(r, r // 3, ids[:p0], ids[p0: p0 + n], True))
    stats = token_stats(model, trajs, temperature=T, batch_size=4)
    for r, st in enumerate(stats):
        _close(st.logp, ref_lp[r][b.response_mask[r]], TOL)
        _close(st.entropy, ref_ent[r][b.response_mask[r]], TOL)
