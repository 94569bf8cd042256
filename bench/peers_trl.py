"""The TRL arm of bench/bench_peers.py: TRL's GRPOTrainer on forkrl's prompts, reward and hyper-parameters.

    from bench.peers_trl import run_trl
    result = run_trl(model_dir, prompts, reward_fn, out_dir, shape, seed=0, threads=2, device="cpu")

The prompts come as the whole ordered list forkrl's data order hands out (DataOrder over the same train pool),
`shuffle_dataset=False`, so TRL's sampler walks them in that order: step s trains on prompts [s*P, (s+1)*P).
Settings that differ from TRL's defaults, each to match forkrl's: fp32 (TRL: bf16), no gradient checkpointing (TRL:
on; forkrl's activation_checkpointing is off by default), a constant learning rate (TRL: linear decay), beta 0
(no reference model), top_k 0 and top_p 1 (plain sampling at T), one optimizer update per generation batch
(steps_per_generation = gradient_accumulation_steps, num_iterations 1), micro-batches of `micro_batch` sequences.
TRL's own mask normalizer stays (the token count of the whole sequence, forkrl's mask_norm "all"); forkrl keeps
its default (the kept tokens): each framework as a user gets it, with the same mask fraction.

Timing: a step is TrainerCallback.on_step_begin -> on_step_end; its generation is the time spent in
`_generate_and_score_completions` (sampling, decoding, the reward), measured by a subclass that wraps the call;
training is the rest. TRL has no push (the policy samples in process).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def trl_version() -> str | None:
    """TRL's version, None when it is not installed (the optional extra `bench`)."""
    try:
        import trl
    except ImportError:
        return None
    return str(trl.__version__)


def trl_config(out_dir: Path, shape: dict[str, int], *, steps: int, lr: float, seed: int, device: str,
               top_frac: float, micro_batch: int) -> Any:
    """The GRPOConfig of one run (see the module docstring for every setting that is not TRL's default)."""
    from trl import GRPOConfig

    samples = shape["prompts"] * shape["group"]
    per_device = math.gcd(micro_batch, samples)  # micro-batches of `micro_batch` (or what divides the batch)
    accum = samples // per_device
    return GRPOConfig(
        output_dir=str(out_dir), max_steps=steps, seed=seed, data_seed=seed, shuffle_dataset=False,
        per_device_train_batch_size=per_device, gradient_accumulation_steps=accum, steps_per_generation=accum,
        num_generations=shape["group"], num_iterations=1, max_completion_length=shape["tokens"],
        temperature=1.0, top_p=1.0, top_k=0, learning_rate=lr, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, max_grad_norm=1.0, beta=0.0, loss_type="grpo",
        epsilon=0.2, top_entropy_quantile=top_frac, bf16=False, fp16=False, gradient_checkpointing=False,
        use_cpu=device == "cpu", use_vllm=device == "cuda", vllm_mode="colocate",
        model_init_kwargs={"dtype": "float32"}, logging_steps=1, report_to="none", save_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0, remove_unused_columns=False, log_completions=False,
    )


def run_trl(model_dir: Path, problems: Sequence[Any], reward_fn: Callable, out_dir: Path, shape: dict[str, int], *,
            steps: int, lr: float, seed: int, threads: int, device: str = "cpu", top_frac: float = 0.2,
            micro_batch: int = 64) -> dict[str, Any]:
    """Train `steps` GRPO steps on `problems` (steps x prompts of them, in order); the final model in
    <out_dir>/final. Returns per-step times (step, generation, training) in seconds."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    torch.set_num_threads(threads)
    problems = list(problems)[: steps * shape["prompts"]]
    if len(problems) < steps * shape["prompts"]:
        raise ValueError(f"{len(problems)} prompts for {steps} steps x {shape['prompts']} prompts")
    data = Dataset.from_list([{"prompt": p.prompt, "idx": i} for i, p in enumerate(problems)])

    def reward(prompts: list[str], completions: list[str], idx: list[int], **_: Any) -> list[float]:
        res = reward_fn(list(completions), [problems[i] for i in idx]).rewards
        return [0.0 if r is None else float(r) for r in res]

    gen_s: list[float] = []

    class TimedGRPOTrainer(GRPOTrainer):
        def _generate_and_score_completions(self, inputs: Any) -> Any:  # noqa: ANN401
            t0 = time.perf_counter()
            try:
                return super()._generate_and_score_completions(inputs)
            finally:
                gen_s.append(time.perf_counter() - t0)

    step_s: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:  # noqa: ANN401
            self.t0 = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:  # noqa: ANN401
            step_s.append(time.perf_counter() - self.t0)

    cfg = trl_config(out_dir, shape, steps=steps, lr=lr, seed=seed, device=device, top_frac=top_frac,
                     micro_batch=micro_batch)
    tok = AutoTokenizer.from_pretrained(model_dir)
    trainer = TimedGRPOTrainer(model=str(model_dir), reward_funcs=reward, args=cfg, train_dataset=data,
                               processing_class=tok, callbacks=[StepTimer()])
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    trainer.save_model(str(out_dir / "final"))
    tok.save_pretrained(str(out_dir / "final"))
    if len(gen_s) != len(step_s):
        raise RuntimeError(f"TRL generated {len(gen_s)} times in {len(step_s)} steps: not one generation per step")
    return {"step_s": step_s, "generate_s": gen_s, "train_s": [s - g for s, g in zip(step_s, gen_s, strict=True)],
            "push_s": [0.0] * len(step_s), "wall_s": wall, "final": str(out_dir / "final"),
            "config": {"per_device_train_batch_size": cfg.per_device_train_batch_size,
                       "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
                       "generation_batch_size": cfg.generation_batch_size, "threads": threads}}
