"""One rank of the 2-rank check (tests/dist/test_dp_equals_one_rank.py launches it with torchrun).

Every rank builds the same tiny random-init Qwen2 model and the same batch from fixed seeds, runs the
1-rank reference (`train_step` over a process group of its own rank alone: no collective) and the same
`train_step` over both ranks on a replicated copy (DDP-style all_reduce) and on an FSDP2 copy (`fully_shard`
per decoder layer + root, gloo), and rank 0 writes, per case, the largest |2 ranks - 1 rank| of every metric
and of the updated weights to argv[1], with the kept-token flags of both (`kept_out`) and what every rank
returned for the guard cases (an inf gradient on rank 1 only, a stop on rank 0 only, an inf weight in rank 1's
shard).

    python -m forkrl.launch --nproc-per-node 2 tests/dist/dp_worker.py OUT.json [CKPT_DIR]

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

from forkrl.rl.collectives import first_nonfinite
from forkrl.rl.losses import LossConfig
from forkrl.rl.step import Batch, StepStopped, build_batch, train_step
from forkrl.training.distributed import full_state_dict, init_from_env, save_full_pretrained, shard_model

VOCAB = 29
GROUP = 4


def build_model(tied_heads: bool, shared_embeddings: bool = False) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      initializer_range=0.3, tie_word_embeddings=shared_embeddings)
    model = Qwen2ForCausalLM(cfg).float()
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == shared_embeddings
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
    # name, loss config, tied heads, rows, global micro-batch, optimizer[, extra train_step arguments]
    ("token_mean", LossConfig(name="dapo"), False, 16, 8, "sgd"),
    ("step_top0.2", LossConfig(name="dapo", entropy_top_frac=0.2, mask_scope="step"), False, 16, 8, "sgd"),
    ("micro_top0.2", LossConfig(name="grpo", entropy_top_frac=0.2), False, 16, 8, "sgd"),
    ("step_top0.2_ties", LossConfig(name="dapo", entropy_top_frac=0.2, mask_scope="step"), True, 16, 8, "sgd"),
    ("micro_top0.3_ties", LossConfig(name="dapo", entropy_top_frac=0.3), True, 16, 8, "sgd"),
    ("dr_grpo_empty_share", LossConfig(name="dr_grpo", max_len=12, entropy_top_frac=0.2, mask_scope="step"),
     False, 13, 6, "sgd"),
    ("seq_mean_adamw", LossConfig(name="grpo", entropy_top_frac=0.2, mask_scope="step"), False, 16, 8, "adamw"),
    # the recipe's mechanics: 2 mini-batches of 2 groups (G = 4) x 2 epochs = 4 updates, pi_old from the no-grad
    # pass, rho 0.2, TIS, dual clip; micro-batches of 4 rows, 2 per rank
    ("recipe", LossConfig(name="dapo", entropy_top_frac=0.2, tis_cap=2.0, dual_clip_c=2.0), False, 16, 4,
     "sgd_recipe", {"mini_batch_size": 8, "epochs": 2}),
    ("recipe_step_kl", LossConfig(name="grpo", entropy_top_frac=0.2, mask_scope="step", tis_cap=2.0, dual_clip_c=3.0,
                                  kl_beta=0.05), False, 16, 4, "sgd_recipe", {"mini_batch_size": 8, "epochs": 2}),
    ("recipe_adamw_empty_share", LossConfig(name="dapo", entropy_top_frac=0.2, tis_cap=2.0, dual_clip_c=3.0),
     False, 13, 3, "adamw", {"mini_batch_size": 8, "epochs": 2}),
    # the recipe with tied embeddings (lm_head.weight is embed_tokens.weight, in FSDP2's root unit): its gradient
    # sums the loss path's lm_head term and the embedding's
    ("recipe_tied_embeddings", LossConfig(name="dapo", entropy_top_frac=0.2, tis_cap=2.0, dual_clip_c=2.0), False,
     16, 4, "sgd_recipe", {"mini_batch_size": 8, "epochs": 2}),
]
SHARED_EMBEDDINGS = {"recipe_tied_embeddings"}
LR = {"sgd": 1.0, "adamw": 1e-6, "sgd_recipe": 0.3}  # sgd_recipe: large enough steps for both clips to act
# More modes for some cases: FSDP2 with activation checkpointing (exact), with bf16 compute on CPU (the
# MixedPrecisionPolicy the GPU path uses: fp32 master weights and reduction; compared loosely), and with the
# gradients reduce-scattered on an update's last micro-batch only (grad_sync="last"; "fsdp" is the default, every
# micro-batch).
MODES = {"step_top0.2": ("ddp", "fsdp", "fsdp_ac", "fsdp_bf16"),
         "micro_top0.2": ("ddp", "fsdp", "fsdp_last"),
         "recipe": ("ddp", "fsdp", "fsdp_last"),
         "recipe_adamw_empty_share": ("ddp", "fsdp", "fsdp_last"),
         "recipe_tied_embeddings": ("ddp", "fsdp", "fsdp_last", "fsdp_ac")}


def make_opt(model: torch.nn.Module, kind: str) -> torch.optim.Optimizer:
    if kind.startswith("sgd"):
        return torch.optim.SGD(model.parameters(), lr=LR[kind])
    return torch.optim.AdamW(model.parameters(), lr=LR[kind], weight_decay=0.01)


def full(model: torch.nn.Module, sharded: bool) -> dict[str, torch.Tensor]:
    return full_state_dict(model) if sharded else {k: v.detach().clone() for k, v in model.state_dict().items()}


def compare(m: dict, m_ref: dict, got: dict, want: dict) -> dict:
    assert set(m) == set(m_ref), sorted(set(m) ^ set(m_ref))
    dw = max(float((got[k] - want[k]).abs().max()) for k in want)
    scale = max(float(v.abs().max()) for v in want.values())
    dm = {k: abs(m[k] - m_ref[k]) if math.isfinite(m_ref[k]) else (0.0 if m[k] == m_ref[k] else 1e9) for k in m_ref}
    return {"metrics": m, "metric_delta": dm, "weight_delta": dw, "weight_scale": scale,
            "dtypes": sorted({str(v.dtype) for v in got.values()})}


def equality_cases(info, solo, ckpt_dir: str | None) -> dict:
    results = {}
    for name, cfg, tied, n, micro, opt_kind, *more in CASES:
        extra = more[0] if more else {}
        batch, adv = build_inputs(n)
        kw = dict(temperature=0.9, micro_batch_size=micro, max_grad_norm=1.0, kl_pass=True, **extra)
        shared = name in SHARED_EMBEDDINGS
        ref = build_model(tied, shared)
        ref_model = build_model(tied, shared) if cfg.kl_beta > 0 else None
        ref_opt = make_opt(ref, opt_kind)
        kept_ref: list[torch.Tensor] = []
        m_ref = train_step(ref, ref_opt, batch, adv, cfg, ref_model=ref_model, kept_out=kept_ref, group=solo, **kw)
        want = {k: v.detach().clone() for k, v in ref.state_dict().items()}
        case = {"ref": m_ref}
        save = ckpt_dir is not None and name == CASES[0][0]
        if save and info.rank == 0:
            ref.save_pretrained(f"{ckpt_dir}/ref", safe_serialization=True)
        for mode in MODES.get(name, ("ddp", "fsdp")):
            model = build_model(tied, shared)
            if mode.startswith("fsdp"):
                model = shard_model(model, "cpu", activation_checkpointing=mode == "fsdp_ac",
                                    mixed_precision=mode == "fsdp_bf16")
            opt = make_opt(model, opt_kind)
            kept: list[torch.Tensor] = []
            # how many parameters hold a (sharded) gradient when each forward with grad starts (before FSDP2's own
            # pre-forward gathers the root)
            grads_at_forward: list[int] = []
            hook = model.register_forward_pre_hook(lambda *_, model=model, seen=grads_at_forward: seen.append(
                sum(p.grad is not None for p in model.parameters())) if torch.is_grad_enabled() else None,
                prepend=True)
            m = train_step(model, opt, batch, adv, cfg, ref_model=ref_model, kept_out=kept,
                           grad_sync="last" if mode == "fsdp_last" else "every", **kw)
            hook.remove()
            if save and mode == "fsdp":
                save_full_pretrained(model, f"{ckpt_dir}/fsdp")
            got = full(model, mode.startswith("fsdp"))
            if info.rank == 0:
                case[mode] = compare(m, m_ref, got, want)
                case[mode]["kept_equal"] = len(kept) == len(kept_ref) == n and all(
                    torch.equal(a, b) for a, b in zip(kept, kept_ref, strict=True))
                case[mode]["grads_at_forward"] = grads_at_forward
                case[mode]["n_params"] = len(list(model.parameters()))
            del model, opt
        results[name] = case
        dist.barrier()
    return results


class StopAt:
    """Rank 0's stop flag: True from its n-th reading on (the other rank passes no stop at all)."""

    def __init__(self, n: int) -> None:
        self.n, self.calls = n, 0

    def __call__(self) -> bool:
        self.calls += 1
        return self.calls >= self.n


def outcome(fn) -> dict:
    try:
        return {"metrics": fn(), "stopped_before_any_update": False}
    except StepStopped:
        return {"metrics": {}, "stopped_before_any_update": True}


def guard_cases(info, solo) -> dict:
    """Per mode, what each rank returned: an inf gradient injected on rank 1 only; a stop on rank 0 only (before
    update 1's second micro-batch, and before update 3); an inf weight in rank 1's shard."""
    cfg = LossConfig(name="dapo", entropy_top_frac=0.2, tis_cap=2.0, dual_clip_c=3.0)
    batch, adv = build_inputs(16)
    kw = dict(temperature=0.9, micro_batch_size=4, max_grad_norm=1.0, mini_batch_size=8, epochs=2)
    res: dict = {}
    # the same stop schedule on 1 rank: the same check points in the same order (4 pi_old micro-batches, then
    # per update 2 micro-batches + 1 before the step); reading 6 = update 1's second micro-batch, 12 = update 3's
    # first one (after 2 updates)
    refs = {}
    for at in (6, 12):
        ref = build_model(False)
        refs[at] = (outcome(lambda ref=ref, at=at: train_step(ref, make_opt(ref, "sgd_recipe"), batch, adv, cfg,
                                                              stop=StopAt(at), group=solo, **kw)),
                    {k: v.detach().clone() for k, v in ref.state_dict().items()})
    for mode in ("ddp", "fsdp"):
        r: dict = {}
        model = build_model(False)
        if mode == "fsdp":
            model = shard_model(model, "cpu")
        before = full(model, mode == "fsdp")
        opt = make_opt(model, "adamw")
        handles = []
        if info.rank == 1:  # rank 1's final hidden states get an inf gradient: every gradient below is non-finite
            def poison(_mod, _inp, out):
                if out.requires_grad:  # not in the no-grad passes
                    out.register_hook(lambda g: g * math.inf)
            handles.append(model.model.norm.register_forward_hook(poison))
        reasons: list[str] = []
        m = train_step(model, opt, batch, adv, cfg, skipped_out=reasons, **kw)
        for h in handles:
            h.remove()
        after = full(model, mode == "fsdp")
        r["inf_grad"] = {"metrics": m, "reasons": reasons, "optimizer_state": len(opt.state),
                         "unchanged": info.rank != 0 or all(torch.equal(after[k], before[k]) for k in before)}
        for at in (6, 12):
            model = build_model(False)
            if mode == "fsdp":
                model = shard_model(model, "cpu")
            opt = make_opt(model, "sgd_recipe")
            stop = StopAt(at) if info.rank == 0 else None
            got = outcome(lambda model=model, opt=opt, stop=stop: train_step(model, opt, batch, adv, cfg, stop=stop,
                                                                             **kw))
            w = full(model, mode == "fsdp")
            want_out, want = refs[at]
            r[f"stop_{at}"] = {**got, "ref": want_out, "weight_delta": max(float((w[k] - want[k]).abs().max())
                                                                            for k in want) if info.rank == 0 else 0.0}
        if mode == "fsdp":  # an inf in rank 1's shard of one weight: both ranks name it
            name, p = list(model.named_parameters())[4]
            if info.rank == 1:
                with torch.no_grad():
                    p.to_local().view(-1)[0] = math.inf
            r["inf_weight"] = {"expected": name, "found": first_nonfinite(list(model.named_parameters()),
                                                                           torch.device("cpu"))}
        res[mode] = r
    per_rank: list = [None] * info.world_size
    dist.all_gather_object(per_rank, res)
    return {"per_rank": per_rank}


def main(out_path: str, ckpt_dir: str | None) -> None:
    info = init_from_env()
    assert info.world_size == 2, info
    solo_groups = [dist.new_group([r]) for r in range(info.world_size)]  # the 1-rank reference: no collective
    solo = solo_groups[info.rank]
    results = equality_cases(info, solo, ckpt_dir)
    guards = guard_cases(info, solo)
    if info.rank == 0:
        with open(out_path, "w") as f:
            json.dump({"world_size": info.world_size, "lr": LR, "cases": results, "guards": guards}, f, indent=1,
                      sort_keys=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
