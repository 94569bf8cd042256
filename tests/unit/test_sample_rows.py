"""forkrl's batched sampler (`forkrl.models.sampling.sample_rows`, the rollout service's torch backend): every
logprob is log_softmax(z / T) of a teacher-forced forward of the row alone (the padding, the shared prefill and
the neighbours change nothing beyond float32 rounding), draws depend only on the row's own generator, and EOS,
length limits, stop and abort end rows as the rollout contract says."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from forkrl.models.sampling import _nucleus, sample_rows
from tests.numerics import float32_logprob_bound


@pytest.fixture(scope="module")
def models(tiny_model_dir: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    m32 = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    m64 = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64).eval()
    return tok, m32, m64


PROMPTS = ["1+2+3=", "12+34+5=", "hello world", "7+8="]  # different lengths: left padding in one batch


def _rows(tok, model, temperature: float, top_p: float = 1.0, seed: int = 0, n: int = 3, limit: int = 16,
          prompts: list[str] = PROMPTS):
    ids = [tok.encode(p) for p in prompts for _ in range(n)]
    gens = [torch.Generator().manual_seed(seed * 1000 + r) for r in range(len(ids))]
    rows = sample_rows(model, ids, [limit] * len(ids), gens, temperature=temperature, top_p=top_p,
                       eos_ids=[tok.eos_token_id], pad_id=tok.pad_token_id)
    return ids, rows


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_logprobs_equal_a_teacher_forced_forward_of_each_row_alone(models, temperature: float) -> None:
    tok, m32, m64 = models
    ids, rows = _rows(tok, m32, temperature)
    seqs = [(p, r.tokens) for p, r in zip(ids, rows, strict=True)]
    bound = 2 * float32_logprob_bound(seqs, m32, m64, temperature or 1.0)  # each side within the fp32 bound
    worst = 0.0
    with torch.no_grad():
        for (prompt, tokens), row in zip(seqs, rows, strict=True):
            assert len(row.logprobs) == len(tokens) >= 1 and all(math.isfinite(x) for x in row.logprobs)
            logits = m64(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1: -1]
            ref = torch.log_softmax(logits / (temperature or 1.0), -1)
            exact = ref.gather(-1, torch.tensor(tokens)[:, None])[:, 0]
            worst = max(worst, (exact - torch.tensor(row.logprobs, dtype=torch.float64)).abs().max().item())
            if temperature == 0:  # greedy: every token is the argmax of its step
                assert ref.argmax(-1).tolist() == tokens
    assert worst <= bound, (worst, bound)


def test_a_row_draws_the_same_tokens_alone_as_in_any_batch(models) -> None:
    tok, m32, _ = models
    ids, rows = _rows(tok, m32, 1.0, seed=3)
    for r in (0, 5, len(ids) - 1):
        alone = sample_rows(m32, [ids[r]], [16], [torch.Generator().manual_seed(3000 + r)], temperature=1.0,
                            eos_ids=[tok.eos_token_id], pad_id=tok.pad_token_id)[0]
        assert alone.tokens == rows[r].tokens and alone.finish == rows[r].finish
        assert alone.logprobs == pytest.approx(rows[r].logprobs, abs=1e-4)
    # the same prompt with other seeds samples other responses (3 rows per prompt, 12 rows in all)
    assert len({tuple(r.tokens) for r in rows}) > len(PROMPTS)


def test_drawing_ahead_in_chunks_draws_what_one_draw_per_step_would(models, monkeypatch) -> None:
    """The Exp(1) draws come several steps at a time (`_draw_ahead`); on CPU torch draws element by element, so the
    chunk size changes nothing: chunks of 3 steps, of 1 step (one draw per row and step) and of the whole response
    sample the same tokens, rows of different limits included."""
    from forkrl.models import sampling

    tok, m32, _ = models
    ids = [tok.encode(p) for p in PROMPTS for _ in range(3)]
    limits = [16 if r % 2 else 5 for r in range(len(ids))]
    vocab = m32.config.vocab_size
    outs = []
    for elements in (vocab * 3, 1, vocab * 64):
        monkeypatch.setattr(sampling, "DRAW_AHEAD_ELEMENTS", elements)
        gens = [torch.Generator().manual_seed(700 + r) for r in range(len(ids))]
        rows = sample_rows(m32, ids, limits, gens, temperature=1.0, eos_ids=[tok.eos_token_id],
                           pad_id=tok.pad_token_id)
        outs.append([(r.tokens, r.finish) for r in rows])
    assert outs[0] == outs[1] == outs[2]
    assert max(len(t) for t, _ in outs[0]) > 3  # some row ran past the first chunk of 3 steps
    assert all(len(t) <= lim for (t, _), lim in zip(outs[0], limits, strict=True))


def test_eos_is_kept_and_limits_and_callbacks_end_rows(models) -> None:
    tok, m32, _ = models
    ids, rows = _rows(tok, m32, 1.0, limit=16)
    for row in rows:
        if row.finish == "stop":
            assert row.tokens[-1] == tok.eos_token_id and tok.eos_token_id not in row.tokens[:-1]
        else:
            assert row.finish == "length" and len(row.tokens) == 16 and tok.eos_token_id not in row.tokens
    assert any(r.finish == "stop" for r in rows)  # the model answers its own task in ~8 tokens
    # per-row limits; a stop from on_token; an abort before the third step; on_done once per row
    limits = [1, 2, 3, 16]
    seen: list[int] = []
    steps = {"n": 0}

    def between() -> None:
        steps["n"] += 1

    gens = [torch.Generator().manual_seed(r) for r in range(4)]
    # rows 2 and 3 on the prompt the model does not know ("hello world"): it runs long, no early EOS
    out = sample_rows(m32, [ids[0], ids[3], ids[6], ids[7]], limits, gens, temperature=1.0,
                      eos_ids=[tok.eos_token_id], pad_id=tok.pad_token_id, between_steps=between,
                      on_token=lambda r, row: r == 3 and len(row.tokens) == 2,
                      on_done=lambda r, row: seen.append(r), aborted=lambda r: r == 2 and steps["n"] >= 2)
    assert sorted(seen) == [0, 1, 2, 3]
    assert len(out[0].tokens) == 1 and len(out[1].tokens) <= 2
    assert tok.eos_token_id not in out[2].tokens + out[3].tokens[:-1]
    assert out[2].finish == "abort" and len(out[2].tokens) == 2
    assert out[3].finish == "stop" and len(out[3].tokens) == 2 and out[3].tokens[-1] != tok.eos_token_id
    assert steps["n"] <= 3  # no forward pass once every row has ended


def test_top_p_logprobs_are_renormalized_over_the_nucleus(models) -> None:
    tok, m32, _ = models
    logp = torch.log_softmax(torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]]), -1)
    p = logp.exp()[0]
    kept = _nucleus(logp, 0.8)[0]
    # the smallest top set with mass >= 0.8: p0 + p1 = 0.865 (p0 = 0.636 alone is not enough)
    assert torch.isfinite(kept[:2]).all() and torch.isinf(kept[2:]).all()
    assert kept[:2].exp().tolist() == pytest.approx((p[:2] / p[:2].sum()).tolist(), rel=1e-6)
    ids, rows = _rows(tok, m32, 1.0, top_p=0.5)
    with torch.no_grad():
        for prompt, row in zip(ids, rows, strict=True):
            logits = m32(torch.tensor([prompt + row.tokens])).logits[0, len(prompt) - 1: -1]
            nucleus = _nucleus(torch.log_softmax(logits, -1), 0.5)
            picked = nucleus.gather(-1, torch.tensor(row.tokens)[:, None])[:, 0]
            assert torch.isfinite(picked).all()  # never a token outside the nucleus
            assert picked.tolist() == pytest.approx(row.logprobs, abs=1e-4)


def test_a_padding_row_gone_non_finite_is_an_error_not_a_sample(tiny_model_dir: Path) -> None:
    """Eager float64 attention turns the fully masked attention rows of left padding into NaN, which leaks into the
    real rows: the sampler raises instead of handing on NaN logprobs (the torch backend loads models with sdpa)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64, attn_implementation="eager")
    ids = [tok.encode(p) for p in PROMPTS]  # of different lengths: padded
    with pytest.raises(RuntimeError, match="non-finite logits at decode step"):
        sample_rows(model, ids, [16] * len(ids), [torch.Generator().manual_seed(r) for r in range(len(ids))],
                    temperature=1.0, eos_ids=[tok.eos_token_id], pad_id=tok.pad_token_id)
