"""scripts/memory_plan.py: its static terms against the byte counts of real models + AdamW, and its layout search.

The activation terms are estimates, checked against a measured step by bench/bench_memory.py (docs/results.md);
what is exact is checked exactly here: parameter counts and shapes of every preset against transformers' own
modules (on the meta device: no memory), the bytes of weights, gradients and AdamW state after a real step,
FSDP2's padded shard size, and which layout the search picks on cases built so that the answer is known.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "scripts"))
import memory_plan as plan  # noqa: E402

GIB = 1 << 30


def _hf_model(cfg: dict, device: str = "cpu") -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    kind = cfg["model_type"]
    config_cls, model_cls = (Qwen3Config, Qwen3ForCausalLM) if kind == "qwen3" else (Qwen2Config, Qwen2ForCausalLM)
    keys = {k: v for k, v in cfg.items() if k != "model_type"}
    with torch.device(device):
        return model_cls(config_cls(**keys))


@pytest.mark.parametrize("name", list(plan.PRESETS))
def test_preset_parameters_equal_the_transformers_model(name: str) -> None:
    model = _hf_model(plan.PRESETS[name], device="meta")
    shape = plan.load_shape(name)
    params = list(model.parameters())  # tied embeddings appear once
    assert shape.params == sum(p.numel() for p in params)
    want = sorted((p.shape[0], p[0].numel() if p.dim() > 1 else 1) for p in params)
    assert sorted(shape.tensors()) == want


def test_qwen25_32b_parameter_count_is_the_published_one() -> None:
    assert plan.load_shape("qwen2.5-32b").params == 32_763_876_352


def test_a_config_json_path_reads_like_its_preset(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(plan.PRESETS["qwen3-14b"]))
    assert replace(plan.load_shape(str(tmp_path)), name="x") == replace(plan.load_shape("qwen3-14b"), name="x")
    assert plan.load_shape(str(tmp_path / "config.json")).params == plan.load_shape("qwen3-14b").params


TINY = {
    "qwen2": dict(model_type="qwen2", vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    "qwen2-tied": dict(model_type="qwen2", vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", vocab_size=101, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False),
}


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("name", list(TINY))
def test_static_terms_equal_the_bytes_of_a_real_model_and_adamw_after_a_step(name: str) -> None:
    torch.manual_seed(0)
    model = _hf_model(TINY[name]).float()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, TINY[name]["vocab_size"], (2, 9))
    model(input_ids=ids).logits.float().pow(2).mean().backward()
    opt.step()  # gradients kept: no zero_grad

    run = plan.Run(prompts_per_step=1, group_size=2, mini_batch_prompts=0, micro_batch_size=2, max_new_tokens=4,
                   prompt_tokens=5)
    terms = {n: b for _, n, b in plan.trainer_terms(plan.Shape.from_config(TINY[name], name), run,
                                                    plan.Trainer(ranks=1, device="cpu"))}
    params = list(model.parameters())
    assert terms["fp32 master weights (sharded)"] == _bytes(params)
    assert terms["fp32 gradients (sharded)"] == _bytes(p.grad for p in params)
    state = [opt.state[p] for p in params]
    moments = (s[k] for s in state for k in ("exp_avg", "exp_avg_sq"))
    assert terms["AdamW exp_avg + exp_avg_sq (sharded)"] == _bytes(moments)
    assert terms["AdamW step counters"] == _bytes(s["step"] for s in state)


@pytest.mark.parametrize("ranks", [2, 3, 5, 64])
def test_shards_are_fsdp2s_padded_dim0_chunks(ranks: int) -> None:
    # fully_shard splits each parameter with torch.chunk on dim 0 and pads every rank to the first chunk's size
    model = _hf_model(TINY["qwen3"])
    shape = plan.Shape.from_config(TINY["qwen3"], "qwen3")
    want = sum(torch.chunk(p.detach(), ranks, dim=0)[0].numel() for p in model.parameters())
    assert plan.shard_elems(shape.tensors(), ranks) == want
    assert plan.shard_elems(shape.tensors(), 1) == shape.params


def test_unsharded_gradients_when_the_ranks_sync_on_the_last_micro_batch_only() -> None:
    shape, run = plan.load_shape("qwen3-8b"), plan.Run()  # 128 micro-batches per update
    last = {n: b for _, n, b in plan.trainer_terms(shape, run, plan.Trainer(ranks=8, grad_sync="last"))}
    every = {n: b for _, n, b in plan.trainer_terms(shape, run, plan.Trainer(ranks=8, grad_sync="every"))}
    assert last["fp32 gradients, unsharded (accumulated without reduce-scatter)"] == 4 * shape.params
    assert every["fp32 gradients (sharded)"] == 4 * plan.shard_elems(shape.tensors(), 8)
    one_micro = replace(run, micro_batch_size=run.mini_batch_prompts * run.group_size)  # nothing to accumulate
    terms = {n for _, n, _ in plan.trainer_terms(shape, one_micro, plan.Trainer(ranks=8, grad_sync="last"))}
    assert "fp32 gradients (sharded)" in terms


def _total(shape: plan.Shape, run: plan.Run, tr: plan.Trainer, ranks: int) -> float:
    return plan.trainer_terms(shape, run, replace(tr, ranks=ranks))[-1][2]


def test_layout_search_picks_the_fewest_ranks_that_fit() -> None:
    shape, run, tr = plan.load_shape("qwen3-14b"), plan.Run(), plan.Trainer(**plan.AS_CODED)
    t2, t3 = _total(shape, run, tr, 2), _total(shape, run, tr, 3)
    assert t2 > t3  # the case is built on this: 2 ranks need more per rank than 3
    assert plan.smallest_ranks(shape, run, tr, gpu=t3) == (3, t3)  # exactly fits at 3
    assert plan.smallest_ranks(shape, run, tr, gpu=t2) == (2, t2)
    got = plan.smallest_ranks(shape, run, tr, gpu=t3 - 1)  # one byte short at 3: the next count that fits
    assert got is not None and got[0] > 3 and got[1] <= t3 - 1
    assert all(_total(shape, run, tr, w) > t3 - 1 for w in range(1, got[0]))
    assert plan.smallest_ranks(shape, run, tr, gpu=1 * GIB) is None  # less than the activations of one row


def test_engine_tp_search_skips_tp_sizes_that_do_not_divide_the_heads() -> None:
    run = plan.Run(max_new_tokens=1000, prompt_tokens=24)
    shape = plan.load_shape("qwen2.5-7b")  # 28 heads: TP 1, 2, 4 divide them, 8 does not
    kv_seq = 2 * shape.layers * shape.kv_heads * shape.head_dim * 2 * 1024  # bf16 K and V of one 1024-token row
    assert plan.engine_terms(shape, run, plan.Engine(tp=1))[1] // kv_seq == plan.engine_terms(
        shape, run, plan.Engine(tp=1))[2]
    fixed = sum(b for n, b in plan.engine_terms(shape, run, plan.Engine(tp=1))[0] if not n.startswith("KV"))
    # a GPU that holds TP 1's weights and runtime but not one sequence's KV: TP 2 (half the weights) fits
    gpu = (fixed + kv_seq / 2) / 0.9
    assert plan.smallest_tp(shape, run, plan.Engine(gpu=gpu)) == (2, plan.engine_terms(
        shape, run, plan.Engine(tp=2, gpu=gpu))[2])
    odd = replace(shape, heads=7, kv_heads=7)  # only TP 1 divides 7 of 1/2/4/8
    assert plan.smallest_tp(odd, run, plan.Engine(gpu=gpu / 2)) is None


def test_the_cli_prints_every_term_and_the_tables(capsys: pytest.CaptureFixture[str]) -> None:
    assert plan.main(["--model", "qwen2.5-1.5b", "--ranks", "4", "--gpu", "80"]) == 0
    out = capsys.readouterr().out
    for name in ("fp32 master weights", "AdamW exp_avg", "FSDP2: 2 decoder layers", "final hidden states",
                 "runtime: CUDA context", "total per rank", "bf16 weights", "KV cache left"):
        assert name in out
    assert plan.main(["--model", "qwen2.5-1.5b", "--gpu", "141"]) == 0
    assert "| qwen2.5-1.5b | 1.54 B | 141 GB |" in capsys.readouterr().out
    assert plan.main(["--model", "qwen3-8b", "--ranks", "8", "--gpu", "80", "--no-checkpointing", "--grad-sync",
                      "last"]) == 0
    out = capsys.readouterr().out
    assert "every layer's tensors" in out and "fp32 gradients, unsharded" in out


def test_the_recipe_decides_activation_checkpointing(tmp_path: Path) -> None:
    recipe = tmp_path / "r.toml"
    recipe.write_text("max_new_tokens = 100\nactivation_checkpointing = false\n")
    run = plan.Run.from_recipe(recipe)
    assert (run.max_new_tokens, run.activation_checkpointing) == (100, False)
    assert plan.Run.from_recipe(REPO_ROOT / "recipes" / "dapo_paper.toml").activation_checkpointing
    shape = plan.load_shape("qwen2.5-1.5b")
    names = {n for _, n, _ in plan.trainer_terms(shape, run, plan.Trainer(**plan.AS_CODED))}
    assert "activations saved: every layer's tensors" in names  # as coded = the run's setting
    on = {n for _, n, _ in plan.trainer_terms(shape, run, plan.Trainer(checkpointing=True))}
    assert "activations saved: each layer's input (checkpointing)" in on


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_chunked_loss_saves_the_planned_rows_and_no_logits(dtype: torch.dtype) -> None:
    # what the loss keeps for its backward, counted by autograd's own saved-tensor hooks: the response rows' hidden
    # states (the plan's term, to the byte), their targets and one lse per row; nothing of size rows x V
    from forkrl.rl.entropy import hidden_logprobs_and_entropy

    n, h, v = 300, 48, 1000
    hidden = torch.randn(n, h, dtype=dtype, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(v, h, dtype=dtype) * 0.1)
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp, _ = hidden_logprobs_and_entropy(hidden, weight, torch.randint(0, v, (n,)), chunk_size=64)
    new = [t for t in saved if t.data_ptr() not in (hidden.data_ptr(), weight.data_ptr())]
    cb = torch.finfo(dtype).bits // 8
    shape = plan.Shape.from_config(dict(TINY["qwen2"], vocab_size=v, hidden_size=h), "x")
    terms = plan.loss_terms(shape, rows=1, seq=n + 1, resp=n, cb=cb, sharded=False)
    assert terms["the response rows' final hidden states (kept for the backward)"] == _bytes([hidden])
    assert _bytes(new) == n * 8 + n * 4  # targets (int64) and lse (fp32): no [n, V] tensor kept
    assert max(t.numel() for t in saved) == v * h  # the largest is the lm_head weight itself (not a copy)
    logp.sum().backward()
    assert weight.grad is not None and weight.grad.dtype == dtype


def _act(shape: plan.Shape, run: plan.Run, ranks: int) -> dict[str, float]:
    return {n: b for _, n, b in plan.trainer_terms(shape, run, plan.Trainer(ranks=ranks, **plan.AS_CODED))}


@pytest.mark.parametrize("ranks", [1, 8])
def test_a_token_budget_plans_whole_micro_batches_per_rank(ranks: int) -> None:
    """By tokens, a micro-batch is not dealt over the ranks: T = 2 x (prompt + response) plans what 2 full rows on
    every rank plan with fixed micro-batches (micro_batch_size 2 x ranks), whatever the rank count."""
    shape = plan.load_shape("qwen3-14b")
    fixed = plan.Run(micro_batch_size=2 * ranks)
    budget = plan.Run(micro_batch_size=1, max_tokens_per_micro_batch=2 * fixed.seq)
    assert budget.micro_shapes(ranks) == [(2, fixed.seq, 2 * fixed.max_new_tokens)] * 2
    assert _act(shape, budget, ranks) == _act(shape, fixed, ranks)
    # micro_batch_size is not read by the budget path (the old plan read it: 1 row, about half the activations)
    assert _act(shape, budget, ranks)["total per rank"] > _act(shape, plan.Run(micro_batch_size=1), 8)["total per rank"]


def test_a_budget_that_is_not_a_multiple_of_the_row_plans_its_largest_micro_batch() -> None:
    """T = 1.5 rows: one full row (alone), or 2 rows of 0.75 rows each (1.5 rows' tokens, masked): the larger."""
    shape = plan.load_shape("qwen2.5-7b")
    run = plan.Run(max_tokens_per_micro_batch=3 * plan.Run().seq // 2)
    one, two = run.micro_shapes(8)
    assert one == (1, run.seq, run.max_new_tokens) and two[0] == 2 and two[1] == run.max_tokens_per_micro_batch // 2
    total = _act(shape, run, 8)["total per rank"]
    assert total == max(plan._trainer_terms(shape, run, plan.Trainer(ranks=8), *s)[-1][2] for s in (one, two))
    assert total > plan._trainer_terms(shape, run, plan.Trainer(ranks=8), *one)[-1][2]
    assert run.micros_per_update == 32 * 16  # every row at full length: one per micro-batch


def test_the_cli_takes_the_budget_from_the_recipe_or_the_flag(capsys: pytest.CaptureFixture[str],
                                                               tmp_path: Path) -> None:
    recipe = tmp_path / "r.toml"
    recipe.write_text("max_new_tokens = 2048\nmax_tokens_per_micro_batch = 16384\n")
    assert plan.Run.from_recipe(recipe).max_tokens_per_micro_batch == 16384
    assert plan.main(["--recipe", str(recipe), "--model", "qwen2.5-1.5b", "--ranks", "4", "--gpu", "80",
                      "--max-tokens-per-micro-batch", "8192", "--prompt-tokens", "2048"]) == 0
    out = capsys.readouterr().out
    assert "micro-batches of <= 8192 padded tokens each" in out and "total per rank" in out
