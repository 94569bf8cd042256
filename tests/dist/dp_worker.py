"""One rank of the 2-rank check (tests/dist/test_dp_equals_one_rank.py launches it with torchrun).

Every rank builds the same tiny random-init Qwen2 model and the same batch from fixed seeds, runs the
1-rank reference (`train_step`, no collective) and the data-parallel step (`dp_train_step`) on a replicated
copy (DDP-style all_reduce) and on an FSDP2 copy (`fully_shard` per decoder layer + root, gloo), and rank 0
writes, per case, the largest |2 ranks - 1 rank| of every metric and of the updated weights to argv[1].

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/dist/dp_worker.py OUT.json [CKPT_DIR]

With CKPT_DIR, the first case also writes the 1-rank result (ref/) and the FSDP2 result gathered on rank 0
(fsdp/, `save_full_pretrained`) as HF checkpoints.
"""

from __future__ import annotations

import json
import math
import sys

import torch
import torch.distributed as dist
from transformers import Qwen2Config, Qwen2ForCausalLM

from forkrl.rl.dp import dp_train_step
from forkrl.rl.losses import LossConfig
from forkrl.rl.step import Batch, build_batch, train_step
from forkrl.training.distributed import full_state_dict, init_from_env, save_full_pretrained, shard_model

VOCAB = 29
GROUP = 4


def build_model(tied_heads: bool) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      initializer_range=0.3, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(cfg).float()
    if tied_heads:  # every logit 0: every response token has entropy exactly ln V, all tied
        with torch.no_grad():
            model.lm_head.weight.zero_()
    return model


def build_inputs(n: int) -> tuple[Batch, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    prompts, comps, lps = [], [], []
    for _ in range(n):
        p = torch.randint(3, VOCAB, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g).tolist()
        c = torch.randint(3, VOCAB, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
        prompts.append(p)
        comps.append(c)
        lps.append((-torch.rand(len(c), generator=g) * 3).tolist())
    adv = torch.randn(n, generator=g)  # one per sequence, as the group advantages would be
    return build_batch(prompts, comps, lps, pad_id=0), adv


CASES = [
    # name, loss config, tied heads, rows, global micro-batch, optimizer
    ("token_mean", LossConfig(name="dapo"), False, 16, 8, "sgd"),
    ("step_top0.2", LossConfig(name="dapo", entropy_top_frac=0.2, mask_scope="step"), False, 16, 8, "sgd"),
    ("micro_top0.2", LossConfig(name="grpo", entropy_top_frac=0.2), False, 16, 8, "sgd"),
    ("step_top0.2_ties", LossConfig(name="dapo", entropy_top_frac=0.2, mask_scope="step"), True, 16, 8, "sgd"),
    ("micro_top0.3_ties", LossConfig(name="dapo", entropy_top_frac=0.3), True, 16, 8, "sgd"),
    ("dr_grpo_empty_share", LossConfig(name="dr_grpo", max_len=12, entropy_top_frac=0.2, mask_scope="step"),
     False, 13, 6, "sgd"),
    ("seq_mean_adamw", LossConfig(name="grpo", entropy_top_frac=0.2, mask_scope="step"), False, 16, 8, "adamw"),
]
LR = {"sgd": 1.0, "adamw": 1e-6}
# More modes for one case: FSDP2 with activation checkpointing (exact), and with bf16 compute on CPU (the
# MixedPrecisionPolicy the GPU path uses: fp32 master weights and reduction; compared loosely).
MODES = {"step_top0.2": ("ddp", "fsdp", "fsdp_ac", "fsdp_bf16")}


def make_opt(model: torch.nn.Module, kind: str) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=LR[kind])
    return torch.optim.AdamW(model.parameters(), lr=LR[kind], weight_decay=0.01)


def main(out_path: str, ckpt_dir: str | None) -> None:
    info = init_from_env()
    assert info.world_size == 2, info
    results = {}
    for name, cfg, tied, n, micro, opt_kind in CASES:
        batch, adv = build_inputs(n)
        kw = dict(temperature=0.9, micro_batch_size=micro, max_grad_norm=1.0)
        ref = build_model(tied)
        ref_opt = make_opt(ref, opt_kind)
        m_ref = train_step(ref, ref_opt, batch, adv, cfg, **kw)
        want = {k: v.detach().clone() for k, v in ref.state_dict().items()}
        case = {"ref": m_ref}
        save = ckpt_dir is not None and name == CASES[0][0]
        if save and info.rank == 0:
            ref.save_pretrained(f"{ckpt_dir}/ref", safe_serialization=True)
        for mode in MODES.get(name, ("ddp", "fsdp")):
            model = build_model(tied)
            if mode.startswith("fsdp"):
                model = shard_model(model, "cpu", activation_checkpointing=mode == "fsdp_ac",
                                    mixed_precision=mode == "fsdp_bf16")
            opt = make_opt(model, opt_kind)
            m = dp_train_step(model, opt, batch, adv, cfg, **kw)
            if save and mode == "fsdp":
                save_full_pretrained(model, f"{ckpt_dir}/fsdp")
            got = full_state_dict(model) if mode.startswith("fsdp") \
                else {k: v.detach() for k, v in model.state_dict().items()}
            if info.rank == 0:
                assert set(m) == set(m_ref), (sorted(set(m) ^ set(m_ref)))
                dw = max(float((got[k] - want[k]).abs().max()) for k in want)
                scale = max(float(v.abs().max()) for v in want.values())
                dm = {k: abs(m[k] - m_ref[k]) if math.isfinite(m_ref[k]) else (0.0 if m[k] == m_ref[k] else 1e9)
                      for k in m_ref}
                case[mode] = {"metrics": m, "metric_delta": dm, "weight_delta": dw, "weight_scale": scale,
                              "dtypes": sorted({str(v.dtype) for v in got.values()})}
            del model, opt
        results[name] = case
        dist.barrier()
    if info.rank == 0:
        with open(out_path, "w") as f:
            json.dump({"world_size": info.world_size, "lr": LR, "cases": results}, f, indent=1, sort_keys=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
