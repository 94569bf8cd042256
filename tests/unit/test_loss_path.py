"""The train step's loss path and memory switches change no number: the chunked hidden-state path (the lm_head per
chunk, recomputed in the backward: forkrl/rl/entropy.py) against the logits path it replaced, with untied and tied
embeddings; and activation checkpointing on one process against none.

Tolerance, from the arithmetic (as tests/dist/test_dp_equals_one_rank.py): both paths make the same float32
operations on the same numbers except where they sum in another order (the lm_head gradient summed over chunks
instead of in one product, lse taken apart from the log-softmax); that changes a result of magnitude |v| by a few
float32 roundings (eps = 2**-23 of |v| each) per term it sums; REL = 1e-5 (~84 ulps) leaves room for the ~100
tokens of a step. After u SGD updates (lr eta, clip 1) the weights differ by at most u eta REL max(1, |w|), a
metric by u REL max(1, |v|). A wrong row, temperature or lost gradient term changes them by O(0.1); the counts
(kept and response tokens, micro-batches, updates) must be equal exactly. Activation checkpointing recomputes the
very same operations: the same bound holds (in practice the results are bit for bit equal).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

import forkrl.rl.step as step_module
from forkrl.rl.entropy import causal_lm_logprobs_and_entropy, shift_for_causal_lm, token_logprobs_and_entropy
from forkrl.rl.losses import LossConfig
from forkrl.rl.step import Batch, build_batch, train_step
from forkrl.training.distributed import enable_activation_checkpointing

REL = 1e-5
VOCAB = 31
EXACT = ("kept_tokens", "response_tokens", "micro_batches", "n_updates", "skipped_updates")
LR = 0.3  # SGD steps large enough for the clips to act


def _model(tied: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    if tied:  # Qwen2 with lm_head.weight = embed_tokens.weight (Qwen2.5-1.5B's layout)
        cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                          initializer_range=0.3, tie_word_embeddings=True)
        model = Qwen2ForCausalLM(cfg).float()
        assert model.lm_head.weight is model.model.embed_tokens.weight
        return model
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.3)
    return LlamaForCausalLM(cfg).float()


def _inputs(n: int) -> tuple[Batch, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    prompts, comps, lps = [], [], []
    for _ in range(n):
        prompts.append(torch.randint(3, VOCAB, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g).tolist())
        c = torch.randint(3, VOCAB, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
        comps.append(c)
        lps.append((-torch.rand(len(c), generator=g) * 3).tolist())
    return build_batch(prompts, comps, lps, pad_id=0), torch.randn(n, generator=g)


def _logits_forward(model, mb, temperature, with_entropy, response_mask=None, pack=False):
    """The path before: the model's whole [b, L, V] logits, shifted, then the fp32 log-softmax per position."""
    resp = mb.response_mask if response_mask is None else response_mask
    logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits
    logits, targets = shift_for_causal_lm(logits, mb.input_ids)
    logp, ent = token_logprobs_and_entropy(logits, targets, temperature=temperature, with_entropy=with_entropy)
    return torch.where(resp, logp, 0.0), (torch.where(resp, ent, 0.0) if ent is not None else None)


def _step(model, batch, adv, monkeypatch=None, **extra):
    model = copy.deepcopy(model)
    kept: list[torch.Tensor] = []
    cfg = LossConfig(name="dapo", entropy_top_frac=0.2, tis_cap=2.0, dual_clip_c=2.0)
    metrics = train_step(model, torch.optim.SGD(model.parameters(), lr=LR), batch, adv, cfg, temperature=0.8,
                         micro_batch_size=4, max_grad_norm=1.0, mini_batch_size=8, epochs=2, kept_out=kept, **extra)
    return model, metrics, kept


def _assert_same_step(a, b) -> None:
    (model_a, m_a, kept_a), (model_b, m_b, kept_b) = a, b
    u = int(m_a["n_updates"])
    assert u == 4 and m_a["skipped_updates"] == 0
    assert m_a["clip_frac_low"] > 0 and m_a["clip_frac_high"] > 0  # the recipe's clips acted
    for k, v in m_a.items():
        if k in EXACT:
            assert m_b[k] == v, k
        elif math.isfinite(v):
            assert abs(m_b[k] - v) <= u * REL * max(1.0, abs(v)), (k, m_b[k], v)
    assert len(kept_a) == len(kept_b) and all(torch.equal(x, y) for x, y in zip(kept_a, kept_b, strict=True))
    wa, wb = model_a.state_dict(), model_b.state_dict()
    for k in wa:
        bound = u * LR * REL * max(1.0, float(wa[k].abs().max()))
        assert float((wa[k] - wb[k]).abs().max()) <= bound, k


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_the_hidden_state_path_equals_the_logits_path_in_a_whole_step(tied: bool,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # the recipe's mechanics (2 mini-batches x 2 epochs, pi_old pass, rho 0.2, TIS, dual clip) at T = 0.8
    model, (batch, adv) = _model(tied), _inputs(16)
    new = _step(model, batch, adv)
    with monkeypatch.context() as m:
        m.setattr(step_module, "_forward", _logits_forward)
        old = _step(model, batch, adv)
    _assert_same_step(old, new)
    start = model.state_dict()
    moved = max(float((new[0].state_dict()[k] - start[k]).abs().max()) for k in start)
    assert moved > 1e3 * 4 * LR * REL  # the step moved the weights far more than the bound allows the paths to differ


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_the_lm_head_runs_on_no_position_and_its_gradient_comes_from_the_chunks(tied: bool) -> None:
    model, (batch, _) = _model(tied), _inputs(6)
    shapes: list[tuple[int, ...]] = []
    model.lm_head.register_forward_hook(lambda _m, _i, out: shapes.append(tuple(out.shape)))
    logp, ent = causal_lm_logprobs_and_entropy(model, batch.input_ids, batch.attention_mask, batch.response_mask,
                                               temperature=0.8)
    assert shapes == [(6, 0, VOCAB)]  # the model's own head scored no position: no [b, L, V] logits
    ref_model = copy.deepcopy(model)
    ref_lp, ref_ent = _logits_forward(ref_model, batch, 0.8, True)
    scale = float(ref_lp.detach().abs().max()) + math.log(VOCAB)
    assert float((logp - ref_lp).detach().abs().max()) <= REL * scale
    assert float((ent - ref_ent).abs().max()) <= REL * scale
    assert (logp[~batch.response_mask] == 0).all() and (ent[~batch.response_mask] == 0).all()
    logp.sum().backward()
    ref_lp.sum().backward()
    head, ref_head = model.lm_head.weight.grad, ref_model.lm_head.weight.grad
    # tied: the embedding's gradient and the head's, summed into the one tensor on both paths
    assert head is not None and float((head - ref_head).abs().max()) <= REL * float(ref_head.abs().max())
    assert float(ref_head.abs().max()) > 0.1


def test_activation_checkpointing_recomputes_the_layers_and_changes_no_number() -> None:
    model, (batch, adv) = _model(False), _inputs(16)
    calls = {"plain": [], "ckpt": []}
    ckpt = copy.deepcopy(model)
    enable_activation_checkpointing(ckpt)
    assert ckpt.is_gradient_checkpointing and not model.is_gradient_checkpointing
    for name, m in (("plain", model), ("ckpt", ckpt)):
        # a pre-hook: the recomputation stops early, once it has the tensors the backward needs, so a layer's
        # forward (post) hook does not fire again
        m.model.layers[0].register_forward_pre_hook(lambda *_, seen=calls[name]: seen.append(torch.is_grad_enabled()))
    plain, with_ckpt = _step(model, batch, adv), _step(ckpt, batch, adv)
    _assert_same_step(plain, with_ckpt)
    # the copies deep-copied the hooks: 8 forwards with grad (4 updates x 2 micro-batches), each recomputed once
    # more in its backward; the no-grad passes (pi_old; approx_kl with kl_pass) are not checkpointed
    grad_forwards = sum(calls["plain"])
    assert grad_forwards == 8 and len(calls["ckpt"]) == len(calls["plain"]) + grad_forwards


def test_load_policy_applies_activation_checkpointing_on_one_process(tiny_model_dir, tmp_path) -> None:
    from forkrl.training.config import RunConfig
    from forkrl.training.policy import load_policy

    for on in (False, True):
        cfg = RunConfig(model=str(tiny_model_dir), run_dir=str(tmp_path / str(on)), activation_checkpointing=on)
        policy = load_policy(cfg, tmp_path / str(on), "cpu")
        assert policy.model.is_gradient_checkpointing is on
