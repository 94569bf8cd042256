"""Probe sampling: responses are cut at the first EOS with the EOS kept, padding never reaches a statistic
or a record (algorithms.md §4.1, §6 P1/P5); rank bins and per-cell selection."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from forkrl.models.sampling import trim_at_eos
from forkrl.probe.sampling import (
    pad_right,
    rank_bins,
    sample_trajectories,
    seeded_generator,
    select_positions,
    token_stats,
)
from tests.numerics import ATTN_FP32_RTOL
from tests.service_fixtures import build_random_llama

EOS, PAD, V = 2, 0, 13


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
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.3)
    return m.requires_grad_(False)


PROMPTS = [[1, 5, 6], [1, 7], [1, 8, 9, 10, 11], [1, 4]]  # mixed lengths: batched by length


def test_trim_at_eos_keeps_the_eos():
    assert trim_at_eos([5, 6, 2, 7, 2], {2}) == ([5, 6, 2], True)
    assert trim_at_eos([2, 0, 0], {2}) == ([2], True)
    assert trim_at_eos([5, 6, 7], {2}) == ([5, 6, 7], False)
    assert trim_at_eos([5, 9, 6], {2, 9}) == ([5, 9], True)


def test_sampled_responses_end_at_first_eos(model):
    trajs = sample_trajectories(
        model,
        PROMPTS,
        group_size=8,
        temperature=1.0,
        max_new_tokens=10,
        seed=0,
        eos_ids=[EOS],
        pad_id=PAD,
        batch_size=12,
    )
    assert len(trajs) == 32 and [t.prompt_index for t in trajs[:9]] == [0] * 8 + [1]
    finished = [t for t in trajs if t.finished]
    assert 0 < len(finished) < len(trajs)  # both kinds present, so both paths are exercised
    for t in trajs:
        assert 1 <= t.n_response <= 10
        assert EOS not in t.response_ids[:-1]  # nothing after the first EOS survives
        assert t.finished == (t.response_ids[-1] == EOS)  # ... and the EOS itself is kept
        assert t.finished or t.n_response == 10
    again = sample_trajectories(
        model,
        PROMPTS,
        group_size=8,
        temperature=1.0,
        max_new_tokens=10,
        seed=0,
        eos_ids=[EOS],
        pad_id=PAD,
        batch_size=12,
    )
    assert [t.response_ids for t in again] == [t.response_ids for t in trajs]  # seeded


def test_batched_sampling_equals_one_by_one(model):
    """Near-greedy sampling: batched (KV cache, mixed prompt lengths) picks the same tokens as one prompt alone."""
    kw = dict(group_size=1, temperature=1e-4, max_new_tokens=8, seed=0, eos_ids=[EOS], pad_id=PAD)
    batched = sample_trajectories(model, PROMPTS, batch_size=4, **kw)
    single = [sample_trajectories(model, [p], batch_size=1, **kw)[0] for p in PROMPTS]
    assert [t.response_ids for t in batched] == [t.response_ids for t in single]


def test_entropy_pass_scores_exactly_the_response_tokens(model):
    trajs = sample_trajectories(
        model, PROMPTS, group_size=3, temperature=0.8, max_new_tokens=10, seed=1, eos_ids=[EOS], pad_id=PAD
    )
    stats = token_stats(model, trajs, temperature=0.8, also_t1=True, batch_size=5, pad_id=PAD)
    for t, s in zip(trajs, stats, strict=True):
        assert s.entropy.shape == s.logp.shape == s.entropy_t1.shape == (t.n_response,)
        # reference: this trajectory alone, no padding anywhere
        ids = torch.tensor([t.ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0]
        p0 = len(t.prompt_ids)
        z = logits[p0 - 1 : p0 - 1 + t.n_response]
        logq = torch.log_softmax(z / 0.8, -1)
        want_lp = logq.gather(-1, torch.tensor(t.response_ids)[:, None]).squeeze(-1)
        # float64 model, but HF's eager attention softmax is float32: a row padded to the batch's width
        # and the same row alone agree to float32 precision only (tests/numerics.py). A wrong position
        # or a scored padding token would be off by O(0.1).
        tol = dict(rtol=ATTN_FP32_RTOL, atol=ATTN_FP32_RTOL)
        torch.testing.assert_close(s.logp, want_lp, **tol)
        torch.testing.assert_close(s.entropy, -(logq.exp() * logq).sum(-1), **tol)
        lq1 = torch.log_softmax(z, -1)
        torch.testing.assert_close(s.entropy_t1, -(lq1.exp() * lq1).sum(-1), **tol)


def test_pad_right():
    ids, attn = pad_right([[3, 4, 5], [6]], pad_id=PAD)
    assert ids.tolist() == [[3, 4, 5], [6, 0, 0]] and attn.tolist() == [[1, 1, 1], [1, 0, 0]]


def test_job_records_never_touch_padding(tmp_path):
    """Select every token of every response: the records are then exactly the response tokens, EOS
    included, and not one prompt or padding position."""
    from forkrl.probe import ProbeParams, run_probe

    ckpt = build_random_llama(tmp_path / "ckpts" / "step_000001", hidden_size=32, num_layers=2)
    params = ProbeParams(
        checkpoint_root=str(ckpt.parent),
        steps=[1],
        num_prompts=3,
        group_size=4,
        max_new_tokens=12,
        max_positions_per_group=10_000,
        max_positions_per_trajectory=10_000,
        modules=["lm_head"],
        row_specs=["start"],
        proj_k=[1],
        sampler="transformers",  # unit tests start no vLLM (tests/probe/test_probe_vllm.py does)
    )
    summary = run_probe(params, tmp_path / "out")
    recs = [json.loads(x) for x in (tmp_path / "out" / "token_probe_records.jsonl").read_text().splitlines()]
    info = summary["checkpoints"][0]
    assert len(recs) == info["n_response_tokens"] == summary["n_records"]
    by_traj: dict[int, list[dict]] = {}
    for r in recs:
        by_traj.setdefault(r["trajectory"], []).append(r)
    assert len(by_traj) == info["n_trajectories"] == 12
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt)
    n_eos = 0
    for rs in by_traj.values():
        rs.sort(key=lambda r: r["response_position"])
        assert [r["response_position"] for r in rs] == list(range(len(rs)))  # contiguous from 0
        assert all(r["position"] - r["response_position"] == rs[0]["position"] for r in rs)  # prompt length
        eos_at = [i for i, r in enumerate(rs) if r["token_id"] == tok.eos_token_id]
        assert eos_at in ([], [len(rs) - 1])  # at most one EOS, and it is the last scored token
        n_eos += len(eos_at)
        assert all(r["is_eos"] == (r["token_id"] == tok.eos_token_id) for r in rs)
    assert n_eos == round(info["finished_frac"] * 12)
    assert sum(c["n_selected"] for c in info["cells"]) == len(recs)


def test_rank_bins_equal_counts_despite_ties():
    # 60% exact zeros: value-quantile edges would collapse; rank bins stay equal-sized
    h = torch.cat([torch.zeros(60), torch.linspace(0.1, 3.0, 40)]).double()
    bins = rank_bins(h, 5, seeded_generator(0, "bins"))
    assert torch.bincount(bins, minlength=5).tolist() == [20] * 5
    assert (bins[60:] >= 3).all()  # the 40 non-zero entropies hold the top two bins
    assert bool(h[bins == 4].min() >= h[bins == 3].max())  # bins are ordered by entropy
    assert rank_bins(h, 5, seeded_generator(0, "bins")).tolist() == bins.tolist()  # seeded tie-break
    assert rank_bins(h, 5, seeded_generator(1, "bins")).tolist() != bins.tolist()


def test_select_positions_caps_per_cell_and_per_trajectory():
    n = 200
    traj_of = torch.arange(n) // 10  # 20 trajectories of 10 tokens
    correct_of = traj_of % 2 == 0
    bins = torch.arange(n) % 2  # 2 bins
    eligible = traj_of != 4  # trajectory 4 excluded (say, a degenerate group)
    chosen, available = select_positions(bins, traj_of, correct_of, eligible, n_bins=2, per_cell=12, per_traj=2, seed=0)
    assert available[(0, True)] == 45 and available[(0, False)] == 50
    for cell, idx in chosen.items():
        assert len(idx) == len(set(idx)) <= 12
        assert all(int(bins[i]) == cell[0] and bool(correct_of[i]) == cell[1] and bool(eligible[i]) for i in idx)
        per = torch.bincount(traj_of[idx], minlength=20)
        assert int(per.max()) <= 2
    assert len(chosen[(0, True)]) == 12  # 9 eligible trajectories x 2 >= 12
    again, _ = select_positions(bins, traj_of, correct_of, eligible, n_bins=2, per_cell=12, per_traj=2, seed=0)
    assert again == chosen


def test_checkpoint_without_safetensors_is_refused(tmp_path):
    from forkrl.probe.checkpoints import load_checkpoint

    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "pytorch_model.bin").write_bytes(b"a pickle would run code on load")
    with pytest.raises(ValueError, match="refusing to load pickled"):
        load_checkpoint(tmp_path, torch.float32, torch.device("cpu"))
