"""The policy being trained: fp32 master weights, AdamW, the tokenizer, the optional KL reference, and the
update of one step (advantages → batch → masked loss over micro-batches → optimizer step).

    policy = load_policy(cfg, run_dir, device="auto")   # from cfg.model, or the latest checkpoint on resume
    policy.set_lr(step)
    metrics = policy.update(scored, cfg.loss_config(), stop=event.is_set, skipped=reasons)   # the step's updates
                                              # (+ kept-token shares by answer-token class on a built-in task)
    policy.save(run_dir, "step_000010", {"step": 10, ...})   # refuses non-finite weights, as full_state()

Guards: `full_state()` (what a push sends) and `save()` first check that every weight is finite (one fused
max-|w| per tensor on each rank's shards, reduced over the ranks) and raise NonFiniteWeights otherwise, on every
rank: non-finite weights are never pushed or saved. The update's own guards (a non-finite loss or gradient norm
skips the update, a stop abandons it) are the train step's (forkrl/rl/step.py).

Determinism: torch is seeded with run_seed("torch", seed) before the model is loaded, and a resume restores
the optimizer state, so a resumed run ends with the same weights as an uninterrupted one (on CPU; with
the same number of ranks — on another number the steps after the resume differ by float32 rounding).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from forkrl.data.tasks import TASKS, token_classes
from forkrl.rl.advantages import compute_advantages
from forkrl.rl.collectives import first_nonfinite
from forkrl.rl.losses import LossConfig
from forkrl.rl.step import build_batch, train_step
from forkrl.seeds import run_seed
from forkrl.training.config import RunConfig
from forkrl.training.distributed import enable_activation_checkpointing, full_state_dict, shard_model
from forkrl.training.metrics import class_breakdown
from forkrl.training.scoring import ScoredBatch
from forkrl.weights.checkpoint import latest_checkpoint, read_state, save_checkpoint
from forkrl.weights.retention import check_free_space, prune_checkpoints
from forkrl.weights.sharded import load_optimizer_any, save_sharded_checkpoint


class NonFiniteWeights(RuntimeError):
    """The policy's weights hold an inf or a NaN (`name`: the first such parameter): never pushed or saved."""

    def __init__(self, name: str) -> None:
        super().__init__(f"{name} holds an inf or a NaN")
        self.name = name


def pick_device(name: str) -> torch.device:
    """'auto' = cuda when present, else cpu; anything else as torch names it."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


@dataclass
class Policy:
    cfg: RunConfig
    model: torch.nn.Module
    tokenizer: Any
    optimizer: torch.optim.Optimizer
    ref_model: torch.nn.Module | None  # the initial policy, for the k3 KL term (kl_beta > 0)
    device: torch.device
    start_step: int  # 0, or the step of the checkpoint resumed from
    data_cursor: int  # prompts already drawn (DataOrder cursor) at start_step
    resumed: bool
    world_size: int = 1  # > 1: the model is sharded with FSDP2 over the ranks (forkrl/training/ranks.py)
    token_texts: dict[int, str | None] = field(default_factory=dict)  # token id -> decoded text (None: EOS)

    @property
    def pad_id(self) -> int:
        tok = self.tokenizer
        return tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    def set_lr(self, step: int) -> float:
        """Linear warm-up over cfg.warmup_steps, then constant."""
        cfg = self.cfg
        lr = cfg.lr * min(1.0, step / cfg.warmup_steps) if cfg.warmup_steps else cfg.lr
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        return lr

    def update(self, scored: ScoredBatch, loss_cfg: LossConfig, *, stop: Callable[[], bool] | None = None,
               skipped: list[str] | None = None) -> dict[str, float]:
        """The optimizer updates of one step on the scored groups (one per mini-batch of cfg.mini_batch_prompts
        groups, cfg.ppo_epochs passes); returns the step's loss/mask/entropy/ratio metrics, and on a built-in
        task the kept and all-token shares per answer-token class (forkrl/training/metrics.py). Sharded: every
        rank calls it with the same batch (forkrl/training/ranks.py). `stop` (rank 0's) and `skipped` (a
        sentence per update skipped for a non-finite loss or gradient): forkrl/rl/step.py's guards; raises
        StepStopped when the stop came before any update was applied."""
        cfg = self.cfg
        adv = compute_advantages(cfg.loss, scored.rewards).reshape(-1)
        flat = scored.trajectories
        batch = build_batch([list(t.prompt_token_ids) for t in flat], [list(t.completion_token_ids) for t in flat],
                            [list(t.logprobs) for t in flat], self.pad_id)
        spec = TASKS.get(cfg.task) if cfg.task and not cfg.dataset else None
        kept: list[torch.Tensor] | None = [] if spec is not None and spec.classes else None
        mini = cfg.mini_batch_prompts * scored.rewards.shape[1] if cfg.mini_batch_prompts else None  # x G samples
        # under torch.distributed every rank passes the whole batch and trains its share (docs/scaling.md)
        metrics = train_step(self.model, self.optimizer, batch, adv, loss_cfg, temperature=cfg.temperature,
                             micro_batch_size=cfg.micro_batch_size, max_grad_norm=cfg.max_grad_norm,
                             max_tokens_per_micro_batch=cfg.max_tokens_per_micro_batch,
                             pack_sequences=cfg.pack_sequences,
                             ref_model=self.ref_model, mini_batch_size=mini, epochs=cfg.ppo_epochs, kept_out=kept,
                             skipped_out=skipped, stop=stop, kl_pass=cfg.kl_pass)
        # every rank gathers the kept flags (a collective); rank 0 alone has the problems to label them with
        if spec is not None and kept is not None and len(kept) == len(flat) and hasattr(scored, "problems"):
            problems = [p for p, g in zip(scored.problems, scored.groups, strict=True) for _ in g]
            labels = [token_classes(p, [self.token_text(i) for i in t.completion_token_ids])
                      for p, t in zip(problems, flat, strict=True)]
            if all(seq is not None for seq in labels):
                metrics.update(class_breakdown(labels, [k.tolist() for k in kept], spec.classes))
        return metrics

    def token_text(self, token_id: int) -> str | None:
        """The decoded text of one token (cached), None for the EOS token."""
        if token_id not in self.token_texts:
            eos = token_id == self.tokenizer.eos_token_id
            self.token_texts[token_id] = None if eos else self.tokenizer.decode([token_id])
        return self.token_texts[token_id]

    def check_finite(self) -> None:
        """Raise NonFiniteWeights naming the first parameter that holds an inf or a NaN. Sharded: a collective
        (every rank checks its shards and gets the same answer)."""
        name = first_nonfinite(list(self.model.named_parameters()), self.device)
        if name is not None:
            raise NonFiniteWeights(name)

    def full_state(self) -> dict[str, torch.Tensor]:
        """The full fp32 weights, checked finite first (NonFiniteWeights); sharded: gathered (every rank must
        call), on rank 0 only ({} elsewhere)."""
        self.check_finite()
        if self.world_size > 1:
            return full_state_dict(self.model)
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def save(self, run_dir: Path, name: str, state: dict[str, Any] | None) -> Path | None:
        """Write the checkpoint `name`; returns its path (None on ranks > 0). Sharded: every rank calls it (rank
        0's `state` is written): the gathered weights as HF files and the AdamW state sharded with
        torch.distributed.checkpoint (forkrl/weights/sharded.py). One rank: forkrl/weights/checkpoint.py.
        Non-finite weights are never saved: NonFiniteWeights, and nothing is written. Once the new checkpoint is
        complete, rank 0 deletes those cfg.keep_checkpoints does not keep (forkrl/weights/retention.py)."""
        self.check_finite()
        if self.world_size > 1:
            path = save_sharded_checkpoint(run_dir, name, self.model, self.tokenizer, self.optimizer, state)
        else:
            path = save_checkpoint(run_dir, name, self.model, self.tokenizer, self.optimizer, state or {})
        if path is not None:
            prune_checkpoints(run_dir, self.cfg.keep_checkpoints, self.cfg.eval_every)
        return path

    def check_space(self, run_dir: Path, name: str) -> None:
        """Rank 0, before any rank starts a save: InsufficientSpace (the folder, the bytes needed and free) when
        the checkpoint `name` would not fit; nothing is written then, and the earlier checkpoints stay."""
        check_free_space(run_dir, name, self.model)


def load_policy(cfg: RunConfig, run_dir: Path, device: str = "auto", threads: int | str = "auto") -> Policy:
    """The initial policy of cfg.model, or with cfg.resume the latest complete checkpoint in run_dir; with
    cfg.activation_checkpointing its decoder layers recompute their activations in the backward (1 or N ranks).
    Sets the process's torch threads for the run: `threads` resolved by forkrl/runtime.py `train_threads` (auto:
    every core in a sync run, half in an async one)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from forkrl.runtime import train_threads

    torch.set_num_threads(train_threads(threads, async_run=cfg.max_staleness > 0))

    world = dist.get_world_size() if dist.is_initialized() else 1
    resume_from = latest_checkpoint(run_dir) if cfg.resume else None
    start_step, cursor = 0, 0
    load_dir = Path(cfg.model)
    if resume_from is not None:
        state = read_state(resume_from)
        if state.get("optimizer_saved") is False:  # written by a multi-rank trainer before DCP checkpoints
            raise ValueError(f"cannot resume from {resume_from}: it holds no optimizer state (a multi-rank "
                             "checkpoint of an older trainer); start a new run from its weights with --model")
        start_step, cursor = int(state["step"]), int(state["data_cursor"])
        load_dir = resume_from
    torch.manual_seed(run_seed("torch", cfg.seed))

    tokenizer = AutoTokenizer.from_pretrained(load_dir)
    model = AutoModelForCausalLM.from_pretrained(load_dir, dtype=torch.float32, use_safetensors=True)
    dev = pick_device(device)
    if world > 1 and dev.type == "cuda":
        dev = torch.device("cuda", torch.cuda.current_device())  # init_ranks set it to LOCAL_RANK
    model.to(dev)  # fp32 master weights; the engine may serve bf16 (pushed fp32 tensors are cast)
    if world > 1:  # FSDP2 per decoder layer + root; the optimizer holds the shards
        model = shard_model(model, dev, activation_checkpointing=cfg.activation_checkpointing)
    elif cfg.activation_checkpointing:
        enable_activation_checkpointing(model)
    ref_model = None
    if cfg.kl_beta > 0:
        ref_model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32, use_safetensors=True)
        ref_model.to(dev).eval().requires_grad_(False)
    # fused: one vectorized kernel over all tensors on CPU and CUDA (torch's CPU default is a Python loop per
    # tensor; docs/results.md compares them); the same AdamW update, and HF Trainer's default.
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                  weight_decay=cfg.weight_decay, eps=1e-8, fused=dev.type in ("cpu", "cuda"))
    if resume_from is not None:  # any checkpoint onto any number of ranks (forkrl/weights/sharded.py)
        load_optimizer_any(resume_from, model, optimizer)
    return Policy(cfg, model, tokenizer, optimizer, ref_model, dev, start_step, cursor, resume_from is not None,
                  world)
