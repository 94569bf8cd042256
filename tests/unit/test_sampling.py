"""The one KV-cache sampler (forkrl/models/sampling.py): greedy is the argmax rollout, sampling draws from
softmax(z / T) with a private seeded generator, responses end at (and keep) the first EOS, and its users
(the tiny builder's evaluations, the probe's and the eval CLI's "transformers" routes) sample through it."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import forkrl.models.sampling as sampling
from forkrl.models.sampling import sample_completions, sample_tokens, trim_at_eos

EOS, PAD, V = 2, 0, 13
PROMPTS = [[1, 5, 6], [1, 7], [1, 8, 9, 10, 11], [1, 4], [1, 9, 3]]  # mixed lengths


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attn_implementation="eager",
        eos_token_id=EOS,
        pad_token_id=PAD,
    )
    m = LlamaForCausalLM(cfg).to(torch.float64).eval()
    with torch.no_grad():  # wider than HF's init, so distributions are far from uniform
        for p in m.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.3)
    return m.requires_grad_(False)


def _argmax_rollout(model, prompt: list[int], max_new: int) -> tuple[list[int], float]:
    """Greedy without a KV cache: the whole sequence re-run for every token. Also the smallest top-1/top-2
    logit margin seen, which bounds how far numerical noise could be from flipping an argmax."""
    seq, margin = list(prompt), math.inf
    for _ in range(max_new):
        with torch.no_grad():
            z = model(input_ids=torch.tensor([seq])).logits[0, -1]
        top2 = z.topk(2).values
        margin = min(margin, float(top2[0] - top2[1]))
        seq.append(int(z.argmax()))
        if seq[-1] == EOS:
            break
    return seq[len(prompt) :], margin


def test_greedy_is_the_argmax_rollout(model):
    got = sample_tokens(model, PROMPTS, temperature=0.0, max_new_tokens=12, eos_ids=[EOS], pad_id=PAD, batch_size=3)
    for prompt, (tokens, finished) in zip(PROMPTS, got, strict=True):
        want, margin = _argmax_rollout(model, prompt, 12)
        assert margin > 1e-9  # fp64 cache vs no-cache differ by ~1e-15: no argmax can flip
        assert tokens == want
        assert finished == (want[-1] == EOS)


def test_first_token_follows_softmax_over_temperature(model):
    """4000 one-token samples of one prompt: each token's count is within 5 binomial standard deviations
    of 4000 * softmax(z / T)_v (a false alarm has probability < 1e-5 per token)."""
    n, temperature = 4000, 0.7
    got = sample_tokens(model, [PROMPTS[0]] * n, temperature=temperature, max_new_tokens=1, eos_ids=[EOS],
                        pad_id=PAD, seed=3, batch_size=1000)  # fmt: skip
    counts = torch.bincount(torch.tensor([t[0] for t, _ in got]), minlength=V).double()
    with torch.no_grad():
        p = torch.softmax(model(input_ids=torch.tensor([PROMPTS[0]])).logits[0, -1] / temperature, -1)
    sd = (n * p * (1 - p)).sqrt()
    assert bool(((counts - n * p).abs() <= 5 * sd + 1).all()), (counts, n * p)
    assert float(p.max()) < 0.9  # not degenerate: the test would pass for a near-greedy sampler otherwise


def test_seeded_private_and_reproducible(model):
    kw = dict(temperature=1.0, max_new_tokens=10, eos_ids=[EOS], pad_id=PAD, batch_size=4)
    state = torch.get_rng_state()
    a = sample_tokens(model, PROMPTS * 4, seed=5, **kw)
    assert torch.equal(torch.get_rng_state(), state)  # the global RNG is neither used nor reset
    torch.manual_seed(123)  # ... nor read
    assert sample_tokens(model, PROMPTS * 4, seed=5, **kw) == a
    assert sample_tokens(model, PROMPTS * 4, seed=6, **kw) != a


def test_responses_end_at_the_first_eos_which_is_kept(model):
    eos_ids = [EOS, 7]  # two EOS ids: either one ends a response
    got = sample_tokens(model, PROMPTS * 8, temperature=1.0, max_new_tokens=9, eos_ids=eos_ids, pad_id=PAD, seed=0)
    assert 0 < sum(f for _, f in got) < len(got)  # both finished and cut-off rows
    for tokens, finished in got:
        assert 1 <= len(tokens) <= 9
        assert not set(tokens[:-1]) & set(eos_ids)  # nothing after the first EOS
        assert finished == (tokens[-1] in eos_ids)
        assert finished or len(tokens) == 9


def test_batched_equals_one_by_one(model):
    kw = dict(temperature=0.0, max_new_tokens=8, eos_ids=[EOS], pad_id=PAD)
    batched = sample_tokens(model, PROMPTS, batch_size=5, **kw)
    assert batched == [sample_tokens(model, [p], batch_size=1, **kw)[0] for p in PROMPTS]


def test_trim_at_eos():
    assert trim_at_eos([5, 6, 2, 7, 2], {2}) == ([5, 6, 2], True)
    assert trim_at_eos([5, 6, 7], {2}) == ([5, 6, 7], False)
    assert trim_at_eos([5, 9, 6], {2, 9}) == ([5, 9], True)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(temperature=-0.5), "temperature"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(eos_ids=[]), "EOS"),
    ],
)
def test_bad_arguments(model, kw, match):
    args = dict(temperature=1.0, max_new_tokens=4, eos_ids=[EOS], pad_id=PAD) | kw
    with pytest.raises(ValueError, match=match):
        sample_tokens(model, PROMPTS, **args)


def test_sample_completions_is_text_up_to_eos(tmp_path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.service_fixtures import build_random_llama

    d = build_random_llama(tmp_path / "m", hidden_size=32, num_layers=1)
    m, tok = AutoModelForCausalLM.from_pretrained(d).eval(), AutoTokenizer.from_pretrained(d)
    prompts = ["1+2=", "10+20+3=", "7="]
    texts = sample_completions(m, tok, prompts, temperature=1.0, n_samples=3, max_new_tokens=6, seed=1)
    assert [len(t) for t in texts] == [3, 3, 3]
    # the same draws through sample_tokens: rows by ascending prompt length, a prompt's samples side by side
    ids = tok(prompts)["input_ids"]
    rows = [i for i in sorted(range(3), key=lambda i: len(ids[i])) for _ in range(3)]
    raw = sample_tokens(m, [ids[i] for i in rows], temperature=1.0, max_new_tokens=6, eos_ids=[tok.eos_token_id],
                        pad_id=tok.pad_token_id, seed=1, batch_size=512)  # fmt: skip
    want: list[list[str]] = [[], [], []]
    for i, (t, fin) in zip(rows, raw, strict=True):
        want[i].append(tok.decode(t[:-1] if fin else t, skip_special_tokens=True))
    assert texts == want


def test_the_probe_and_eval_transformers_routes_sample_through_the_one_decode_loop(tmp_path: Path, monkeypatch):
    """The probe's and the eval CLI's "transformers" sampler routes draw the very tokens a direct `sample_tokens`
    call draws for the same prompts and seed (a route with a decode loop of its own, or its own seeding or row
    order, draws others), and each one's tokens come out of the one decode loop (`_sample_batch`) as it runs."""
    from forkrl.eval.params import EvalParams
    from forkrl.eval.run import EvalPlan
    from forkrl.eval.run import _sample as eval_sample
    from forkrl.probe.checkpoints import CheckpointRef, load_checkpoint
    from forkrl.probe.engines import encode_prompts
    from forkrl.probe.params import ProbeParams
    from forkrl.probe.worker import CheckpointProbe, Progress
    from tests.service_fixtures import build_random_llama

    d = build_random_llama(tmp_path / "m", hidden_size=32, num_layers=1)
    model, tok = load_checkpoint(d, torch.float32, torch.device("cpu"))
    texts = ["1+2=", "10+20+3=", "7=", "4+4="]  # two of one token length: they share a batch
    ids = encode_prompts(tok, texts)
    eos, pad, n, seed, max_new = [tok.eos_token_id], tok.pad_token_id, 3, 5, 8
    direct = sample_tokens(model, [p for p in ids for _ in range(n)], temperature=1.0, max_new_tokens=max_new,
                           eos_ids=eos, pad_id=pad, seed=seed)  # prompt-major: sample g of prompt i at i*n + g
    assert len({tuple(t) for t, _ in direct}) > 1  # the draws differ: equal outputs below are not a coincidence

    loop_calls: list[int] = []
    one_loop = sampling._sample_batch

    def counted(*args, **kwargs):
        loop_calls.append(1)
        return one_loop(*args, **kwargs)

    monkeypatch.setattr(sampling, "_sample_batch", counted)
    ref = CheckpointRef("base", d)

    probe_params = ProbeParams(model=str(d), sampler="transformers", num_samples=n, seed=seed, temperature=1.0)
    probe = CheckpointProbe(0, ref, probe_params, texts, max_new_tokens=max_new, reward="exact_match",
                            tokenizer_fallback=None, device=torch.device("cpu"), progress=Progress(None, None, 1, 0))
    probe_trajs = probe._sample(model, tok, eos, pad)
    assert loop_calls, "the probe's transformers route sampled without the decode loop"
    calls_before_eval = len(loop_calls)

    eval_params = EvalParams(model=str(d), benchmarks=["sum3"], sampler="transformers", num_samples=n, seed=seed)
    plan = EvalPlan(params=eval_params, checkpoints=[ref], benchmarks=[], prompt_format="raw", system_prompt="",
                    reward="exact_match", temperature=1.0, max_new_tokens=max_new, ks=[1], run_config="")
    eval_trajs = eval_sample(plan, ref, ids, eos, tok, "cpu")
    assert len(loop_calls) > calls_before_eval, "the eval CLI's transformers route sampled without the decode loop"

    for trajs in (probe_trajs, eval_trajs):
        assert [(t.prompt_ids, t.response_ids, t.finished) for t in trajs] == [
            (ids[i // n], *direct[i]) for i in range(len(direct))
        ]
