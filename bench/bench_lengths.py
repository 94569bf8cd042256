"""Long-tailed response lengths: fixed micro-batches vs the token budget vs packed sequences, on 1 and 2 CPU ranks.

    OMP_NUM_THREADS=1 PYTHONPATH=. python bench/bench_lengths.py          # a few minutes on a 2-core machine
    OMP_NUM_THREADS=1 PYTHONPATH=. python bench/bench_lengths.py --ranks 1 --rows 16   # quicker

Lengths. RL responses on reasoning tasks are long-tailed: most are a few hundred tokens, a few run to the
length cap (recipes/dapo_paper.toml: max_new_tokens 20480, most responses 1-5k). The bench draws each
completion length from a log-normal (the usual fit of such lengths: a median, a multiplicative spread, no
negative values), median `--median` 256 tokens, sigma 1 (about 2% beyond 8x the median), truncated at the cap
`--cap` 2048 as the engine truncates: the recipe's shape scaled down ~10x to what a 2-core CPU trains in
seconds. Each row has its own `--prompt` 64-token prompt (distinct prompts: the 1-rank trainer computes a prompt
repeated across a group once, forkrl/rl/forward.py, which would mix that saving into the padding comparison).

Model: a random-init Qwen2 of forkrl/models/random_qwen2.py size `bench` (hidden 256, 2 layers, 4 heads, 2 kv,
intermediate 1024; 2.0 M parameters), loaded as the trainer loads it (AutoModelForCausalLM, fp32, sdpa);
2 ranks: torchrun, gloo, FSDP2 (forkrl/training/distributed.py `shard_model`, as the trainer); 1 torch thread
per rank. The step: forkrl/rl/step.py `train_step`, grpo, no entropy mask (rho = 1: no extra pass), one update
on the whole batch, AdamW (fused, as the trainer). Per (ranks, mode) a fresh process (or torchrun launch): one
warm-up step, then `--steps` timed steps (median), barriers around each.

Modes (the same batch of `--rows` rows):
- fixed:  micro_batch_size `--micro` rows in sample order, each padded to its longest row, dealt in blocks.
- budget: max_tokens_per_micro_batch `--tokens` (rows x longest row <= T, by length, dealt by tokens).
- packed: the budget plus pack_sequences (one row of <= T tokens per micro-batch, no padding).
- floor:  the padding-free floor: the same number of tokens in `--rows` rows of equal length, fixed micro-batches.

Columns: padded % = the share of the tokens the forwards see that are padding (from the step's own plan,
forkrl/rl/microbatch.py); tok/s = real tokens (prompt + completion) of the batch / step time; / floor = tok/s over
the floor's at the same ranks; slow/mean = the most loaded rank's forward tokens (padding included) over the mean
rank's; peak MiB = the largest rank's peak RSS growth over the steps (ru_maxrss - RSS before the warm-up; a
fresh process per measurement, so it is that mode's);
FLOP/s ratio = the step's useful FLOPs (6 x decoder linear weights x tokens + causal attention 6 x hidden x L^2
per sequence and layer + 6 x hidden x vocab per scored token; padding and the masked half of attention are
not useful) / step time / (ranks x this machine's dense fp32 matmul rate at the model's shapes, measured by each
rank in the same process, 1 thread, [2048 x 256] x [256 x 1024] and [2048 x 256] x [256 x 256] products): the CPU
analogue of MFU. Goals (issue 45): padded <= 5% with the budget, tok/s >= 0.9 x floor, slow/mean <= 1.1.
Nothing asserts (tests/unit/test_bench_lengths.py checks the table's invariants at tiny sizes).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ("fixed", "budget", "packed", "floor")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", default="1,2", help="comma-separated rank counts (torchrun, gloo, FSDP2 for > 1)")
    p.add_argument("--rows", type=int, default=32, help="sequences in the batch")
    p.add_argument("--median", type=float, default=256.0, help="median completion length (log-normal, sigma 1)")
    p.add_argument("--cap", type=int, default=2048, help="max completion length (the recipe's max_new_tokens)")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens per row")
    p.add_argument("--micro", type=int, default=8, help="micro_batch_size of the fixed and floor modes")
    p.add_argument("--tokens", type=int, default=4096, help="max_tokens_per_micro_batch of budget and packed")
    p.add_argument("--steps", type=int, default=2, help="timed steps per measurement (after one warm-up)")
    p.add_argument("--size", default="bench", help="forkrl/models/random_qwen2.py size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--matmul-s", type=float, default=0.3, help="seconds per shape of the matmul-rate measurement")
    p.add_argument("--json", default="", help="also write the rows as JSON here")
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)  # a mode: one measurement
    p.add_argument("--model-dir", default="", help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def completion_lengths(n: int, median: float, cap: int, seed: int) -> list[int]:
    """Log-normal(ln median, 1) completion lengths, truncated to [1, cap] (module docstring)."""
    rng = random.Random(seed)
    return [max(1, min(cap, round(rng.lognormvariate(math.log(median), 1.0)))) for _ in range(n)]


def batch_lengths(a: argparse.Namespace, mode: str) -> list[int]:
    """Completion lengths of the mode's batch: the long-tailed draw, or (floor) the same total in equal rows."""
    comps = completion_lengths(a.rows, a.median, a.cap, a.seed)
    if mode != "floor":
        return comps
    total = sum(comps)
    return [total // a.rows + (1 if i < total % a.rows else 0) for i in range(a.rows)]  # the same tokens


def _rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def matmul_rate(hidden: int, inter: int, n: int = 2048, seconds: float = 0.3) -> float:
    """Dense fp32 FLOP/s of this process (its torch threads) at the model's linear shapes."""
    import torch

    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, hidden, generator=g)
    ws = [torch.randn(hidden, inter, generator=g), torch.randn(hidden, hidden, generator=g)]
    flops, t = 0.0, 0.0
    for w in ws:
        x @ w  # warm
        reps, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            x @ w
            reps += 1
        t += time.perf_counter() - t0
        flops += 2.0 * n * w.shape[0] * w.shape[1] * reps
    return flops / t


def useful_flops(model, lengths: list[int], scored: int) -> float:  # noqa: ANN001
    """One update's useful FLOPs (module docstring): linear, causal attention, the head on scored tokens."""
    import torch

    cfg = model.config
    lin = sum(m.weight.numel() for name, m in model.named_modules()
              if isinstance(m, torch.nn.Linear) and "lm_head" not in name)
    h, layers = cfg.hidden_size, cfg.num_hidden_layers
    attn = 6.0 * h * layers * sum(n * n for n in lengths)  # QK^T and AV: 4 h L^2, causal half, x 3 fwd + bwd
    return 6.0 * lin * sum(lengths) + attn + 6.0 * h * cfg.vocab_size * scored


def rank_tokens(a: argparse.Namespace, mode: str, lengths: list[int], resp: list[int], world: int) -> list[int]:
    """Tokens each rank's forwards see (padding included), from the plan the step itself makes."""
    from forkrl.rl.microbatch import fixed_plan, padded_size, token_plan

    n = len(lengths)
    if mode in ("budget", "packed"):
        plan = token_plan(lengths, resp, n, a.tokens, world, packed=mode == "packed")
    else:
        plan = fixed_plan(resp, n, a.micro, world)
    size = (lambda rows: sum(lengths[i] for i in rows)) if mode == "packed" else \
        (lambda rows: padded_size(rows, lengths))
    return [sum(size(slot[r]) for slots in plan for slot in slots) for r in range(world)]


def measure(a: argparse.Namespace, mode: str, model_dir: str) -> dict | None:
    """One (mode, ranks) measurement on this process's rank (the whole group under torchrun); rank 0 returns it."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from forkrl.rl.losses import LossConfig
    from forkrl.rl.step import build_batch, train_step
    from forkrl.training.distributed import init_from_env, shard_model

    torch.set_num_threads(1)
    info = init_from_env()
    world = info.world_size
    comps = batch_lengths(a, mode)
    g = torch.Generator().manual_seed(a.seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    vocab = model.config.vocab_size
    prompts = [torch.randint(3, vocab, (a.prompt,), generator=g).tolist() for _ in comps]
    completions = [torch.randint(3, vocab, (c,), generator=g).tolist() for c in comps]
    batch = build_batch(prompts, completions, [[-1.0] * c for c in comps], pad_id=0)
    adv = torch.randn(len(comps), generator=g)
    lengths = [a.prompt + c for c in comps]
    flops = useful_flops(model, lengths, sum(comps))
    if world > 1:
        model = shard_model(model, "cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    kw: dict = dict(temperature=1.0, micro_batch_size=a.micro, max_grad_norm=1.0)
    if mode in ("budget", "packed"):
        kw.update(max_tokens_per_micro_batch=a.tokens, pack_sequences=mode == "packed")
    rate = matmul_rate(model.config.hidden_size, model.config.intermediate_size, seconds=a.matmul_s)
    rss0 = _rss_kib()
    times, metrics = [], {}
    for step in range(a.steps + 1):
        if dist.is_initialized():
            dist.barrier()
        t0 = time.perf_counter()
        metrics = train_step(model, opt, batch, adv, LossConfig(name="grpo"), **kw)
        if dist.is_initialized():
            dist.barrier()
        if step:  # the first warms allocators (and gloo)
            times.append(time.perf_counter() - t0)
    peak_mib = max(0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
    local = {"rate": rate, "peak_mib": peak_mib}
    every = [local]
    if dist.is_initialized():
        every = [None] * world
        dist.all_gather_object(every, local)
    if info.rank != 0:
        return None
    forward = rank_tokens(a, mode, lengths, [len(c) for c in completions], world)
    t = statistics.median(times)
    rates = [e["rate"] for e in every]
    return {"mode": mode, "ranks": world, "rows": len(comps), "tokens": sum(lengths),
            "forward_tokens": sum(forward), "padded_frac": 1.0 - sum(lengths) / sum(forward),
            "step_s": t, "tok_s": sum(lengths) / t, "slow_over_mean": max(forward) / (sum(forward) / world),
            "peak_mib": max(e["peak_mib"] for e in every), "matmul_flops": statistics.mean(rates),
            "useful_flops": flops, "flop_ratio": flops / t / sum(rates),
            "micro_batches": metrics.get("micro_batches", 0.0), "loss": metrics.get("loss", float("nan"))}


def _launch(a: argparse.Namespace, mode: str, ranks: int, model_dir: str, out: Path) -> dict:
    here = Path(__file__).resolve()
    args = [str(here), "--worker", mode, "--model-dir", model_dir, "--out", str(out), "--rows", str(a.rows),
            "--median", str(a.median), "--cap", str(a.cap), "--prompt", str(a.prompt), "--micro", str(a.micro),
            "--tokens", str(a.tokens), "--steps", str(a.steps), "--seed", str(a.seed), "--matmul-s", str(a.matmul_s),
            "--size", a.size]
    cmd = [sys.executable, *args] if ranks == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(here.parents[1]))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} on {ranks} rank(s) failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


def with_floor(rows: list[dict]) -> list[dict]:
    """Each row with `over_floor`: its tok/s over the floor's at the same rank count."""
    floor = {r["ranks"]: r["tok_s"] for r in rows if r["mode"] == "floor"}
    return [dict(r, over_floor=r["tok_s"] / floor[r["ranks"]] if r["ranks"] in floor else float("nan"))
            for r in rows]


def table(rows: list[dict]) -> str:
    head = (f"{'ranks':>5} {'mode':>7} {'micro':>5} {'padded %':>8} {'tok/s':>8} {'/ floor':>7} {'slow/mean':>9} "
            f"{'peak MiB':>8} {'FLOP/s ratio':>12} {'step s':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['ranks']:>5} {r['mode']:>7} {int(r['micro_batches']):>5} {100 * r['padded_frac']:>8.1f} "
                     f"{r['tok_s']:>8.0f} {r['over_floor']:>7.2f} {r['slow_over_mean']:>9.3f} {r['peak_mib']:>8.0f} "
                     f"{r['flop_ratio']:>12.3f} {r['step_s']:>7.2f}")
    return "\n".join(lines)


def run(a: argparse.Namespace, ranks: list[int], in_process: bool = False) -> list[dict]:
    """Every (ranks, mode) measurement; in_process (1 rank only: the smoke test) runs them in this process."""
    from forkrl.models.random_qwen2 import build_random_qwen2

    with tempfile.TemporaryDirectory(prefix="bench-lengths-") as tmp:
        model_dir = str(build_random_qwen2(Path(tmp) / "model", a.size,
                                           max_position_embeddings=max(2048, a.prompt + a.cap)))
        rows = []
        for n in ranks:
            for mode in MODES:
                if in_process:
                    if n != 1:
                        raise ValueError("in_process runs 1 rank only")
                    got = measure(a, mode, model_dir)
                    assert got is not None
                    rows.append(got)
                else:
                    rows.append(_launch(a, mode, n, model_dir, Path(tmp) / f"{mode}-{n}.json"))
    return with_floor(rows)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.worker:
        got = measure(a, a.worker, a.model_dir)
        if got is not None:
            Path(a.out).write_text(json.dumps(got))
        return 0
    comps = completion_lengths(a.rows, a.median, a.cap, a.seed)
    print(f"bench_lengths: {a.rows} rows, prompt {a.prompt}, completions log-normal median {a.median:g} sigma 1 "
          f"cap {a.cap} (drawn: min {min(comps)}, median {statistics.median(comps):g}, max {max(comps)}, "
          f"{sum(c == a.cap for c in comps)} at the cap); model {a.size}; fixed {a.micro} rows, budget {a.tokens} "
          f"tokens; {a.steps} timed steps", flush=True)
    rows = run(a, [int(x) for x in a.ranks.split(",")])
    print(table(rows))
    print("goals: padded <= 5% with the budget, tok/s >= 0.9 x floor, slow/mean <= 1.1 (forward tokens)")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
