"""Each distinct prompt computed once (forkrl/rl/forward.py) changes no number: the scored rows, log-probs, entropies
and every parameter's gradient against the plain forward, on Llama (untied) and Qwen2 (tied, attention bias), with
prompts of different lengths, completions of one token and empty ones; and a whole train step (the recipe's
mechanics) with and without it.

Tolerance, from the arithmetic (as tests/unit/test_loss_path.py): the two paths make the same float32 operations on
the same numbers, in other shapes (a prompt's rows once instead of G times, its keys and values concatenated with
the completion's in a second pass), so a result of magnitude |v| differs by a few float32 roundings per term it
sums. A gradient sums one term per token of the batch (~100 here): REL_GRAD = 1e-4 of the tensor's largest entry is
~800 ulps, far above that and far below what a lost or doubled gradient path does (a prompt's keys and values feed
every completion of its group: dropping that path changes the gradients of the layers below by O(0.1) of their
size, checked here by breaking it).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

import forkrl.rl.entropy as entropy_module
from forkrl.rl.batch import Batch, build_batch
from forkrl.rl.entropy import causal_lm_logprobs_and_entropy
from forkrl.rl.forward import final_hidden_states, shared_prefix_rows
from forkrl.rl.losses import LossConfig
from forkrl.rl.step import train_step
from forkrl.training.distributed import enable_activation_checkpointing

REL = 1e-5
REL_GRAD = 1e-4
VOCAB = 31
LR = 0.3


def _model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    shape = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.3)
    if kind == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**shape, tie_word_embeddings=True)).float()
    return LlamaForCausalLM(LlamaConfig(**shape)).float()


def _grouped(groups: int, g: int, *, seed: int = 1) -> tuple[Batch, torch.Tensor]:
    """`groups` prompts of 2-8 tokens, `g` completions each of 0-10 tokens (at least one of 1 token), in order."""
    gen = torch.Generator().manual_seed(seed)
    prompts, comps, lps = [], [], []
    for k in range(groups):
        p = torch.randint(3, VOCAB, (int(torch.randint(2, 9, (1,), generator=gen)),), generator=gen).tolist()
        for s in range(g):
            n = 1 if s == 0 else 0 if (s == g - 1 and k % 2) else int(torch.randint(1, 11, (1,), generator=gen))
            c = torch.randint(3, VOCAB, (n,), generator=gen).tolist()
            prompts.append(p)
            comps.append(c)
            lps.append((-torch.rand(n, generator=gen) * 3).tolist())
    return build_batch(prompts, comps, lps, pad_id=0), torch.randn(len(prompts), generator=gen)


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _logp_ent_grads(model: torch.nn.Module, b: Batch, share: bool) -> tuple[torch.Tensor, torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    logp, ent = causal_lm_logprobs_and_entropy(model, b.input_ids, b.attention_mask, b.response_mask,
                                               temperature=0.8, share_prefix=share)
    w = torch.randn(logp.shape, generator=torch.Generator().manual_seed(7))  # a different weight per token
    (logp * w).sum().backward()
    assert ent is not None
    return logp.detach(), ent, _grads(model)


def _assert_grads_close(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        scale = float(a[name].abs().max())
        assert float((a[name] - b[name]).abs().max()) <= REL_GRAD * max(scale, 1e-3), name


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_shared_prompts_give_the_plain_forwards_numbers_and_gradients(kind: str) -> None:
    model, (b, _) = _model(kind), _grouped(4, 4)
    with torch.no_grad():
        rows = shared_prefix_rows(model, b.input_ids, b.attention_mask, b.response_mask)
        plain_rows = final_hidden_states(model, b.input_ids, b.attention_mask)[:, :-1][b.response_mask]
    assert rows is not None and rows.shape == plain_rows.shape
    assert float((rows - plain_rows).abs().max()) <= REL * max(1.0, float(plain_rows.abs().max()))
    lp0, ent0, g0 = _logp_ent_grads(model, b, share=False)
    lp1, ent1, g1 = _logp_ent_grads(model, b, share=True)
    scale = float(lp0.abs().max()) + math.log(VOCAB)
    assert float((lp0 - lp1).abs().max()) <= REL * scale and float((ent0 - ent1).abs().max()) <= REL * scale
    assert (lp1[~b.response_mask] == 0).all() and (ent1[~b.response_mask] == 0).all()
    _assert_grads_close(g0, g1)
    assert all(float(g.abs().max()) > 0 for g in g1.values())


def test_a_lost_path_through_the_prompts_keys_and_values_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    # the check above has teeth: cut the gradient from the completions back into their prompt's keys and values
    model, (b, _) = _model("llama"), _grouped(4, 4)
    _, _, g0 = _logp_ent_grads(model, b, share=False)
    from transformers import DynamicCache

    real = DynamicCache.reorder_cache

    def detached(self: DynamicCache, beam_idx: torch.LongTensor) -> None:
        for layer in self.layers:
            layer.keys, layer.values = layer.keys.detach(), layer.values.detach()
        real(self, beam_idx)

    monkeypatch.setattr(DynamicCache, "reorder_cache", detached)
    _, _, g1 = _logp_ent_grads(model, b, share=True)
    with pytest.raises(AssertionError):
        _assert_grads_close(g0, g1)


def test_no_repeated_prompt_or_another_layout_falls_back_to_the_plain_forward() -> None:
    model = _model("llama")
    distinct = build_batch([[3, 4], [5, 6, 7]], [[8, 9], [10]], [[-1.0, -1.0], [-1.0]], pad_id=0)
    assert shared_prefix_rows(model, distinct.input_ids, distinct.attention_mask, distinct.response_mask) is None
    one = build_batch([[3, 4]], [[8, 9]], [[-1.0, -1.0]], pad_id=0)
    assert shared_prefix_rows(model, one.input_ids, one.attention_mask, one.response_mask) is None
    same = build_batch([[3, 4], [3, 4]], [[8, 9], [10]], [[-1.0, -1.0], [-1.0]], pad_id=0)
    assert shared_prefix_rows(model, same.input_ids, same.attention_mask, same.response_mask) is not None
    # left padding (not build_batch's layout): the plain forward
    left = Batch(torch.tensor([[0, 3, 4, 8], [3, 4, 9, 10]]), torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]),
                 torch.tensor([[False, False, True], [False, True, True]]), torch.zeros(2, 3))
    assert shared_prefix_rows(model, left.input_ids, left.attention_mask, left.response_mask) is None
    # no completion token at all (a rank's empty share in the join)
    assert shared_prefix_rows(model, same.input_ids, same.attention_mask,
                              torch.zeros_like(same.response_mask)) is None


def _step(model: torch.nn.Module, b: Batch, adv: torch.Tensor) -> tuple[torch.nn.Module, dict, list]:
    model = copy.deepcopy(model)
    kept: list[torch.Tensor] = []
    cfg = LossConfig(name="dapo", entropy_top_frac=0.2, tis_cap=2.0, dual_clip_c=2.0)
    metrics = train_step(model, torch.optim.SGD(model.parameters(), lr=LR), b, adv, cfg, temperature=0.8,
                         micro_batch_size=8, max_grad_norm=1.0, mini_batch_size=8, epochs=2, kept_out=kept)
    return model, metrics, kept


def test_a_whole_train_step_shares_the_prompts_and_lands_where_the_plain_one_does(
        monkeypatch: pytest.MonkeyPatch) -> None:
    model, (b, adv) = _model("llama"), _grouped(4, 4, seed=3)
    shared: list[bool] = []
    real = entropy_module.shared_prefix_rows

    def spy(*args: object) -> torch.Tensor | None:
        out = real(*args)  # type: ignore[arg-type]
        shared.append(out is not None)
        return out

    monkeypatch.setattr(entropy_module, "shared_prefix_rows", spy)
    new_model, new_m, new_kept = _step(model, b, adv)
    # every forward of the step (the pi_old pass and each update's) shared its micro-batch's prompts
    assert shared and all(shared)
    monkeypatch.setattr(entropy_module, "shared_prefix_rows", lambda *a: None)
    old_model, old_m, old_kept = _step(model, b, adv)
    u = int(old_m["n_updates"])
    assert u == 4 and old_m["skipped_updates"] == 0
    for k, v in old_m.items():
        if k in ("kept_tokens", "response_tokens", "micro_batches", "n_updates", "skipped_updates"):
            assert new_m[k] == v, k
        elif math.isfinite(v):
            assert abs(new_m[k] - v) <= u * REL_GRAD * max(1.0, abs(v)), (k, new_m[k], v)
    assert all(torch.equal(x, y) for x, y in zip(old_kept, new_kept, strict=True))
    wa, wb = old_model.state_dict(), new_model.state_dict()
    start = model.state_dict()
    for k in wa:
        assert float((wa[k] - wb[k]).abs().max()) <= u * LR * REL_GRAD * max(1.0, float(wa[k].abs().max())), k
    assert max(float((wb[k] - start[k]).abs().max()) for k in start) > 1e2 * u * LR * REL_GRAD  # it moved


def test_activation_checkpointing_keeps_the_plain_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    # HF's checkpointing turns the KV cache off: the step must not try to share (it would silently compute nothing)
    model, (b, adv) = _model("llama"), _grouped(2, 4)
    enable_activation_checkpointing(model)
    calls: list[int] = []
    monkeypatch.setattr(entropy_module, "shared_prefix_rows", lambda *a: calls.append(1))
    _step(model, b, adv)
    assert calls == []
