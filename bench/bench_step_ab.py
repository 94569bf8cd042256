"""Train-step time of two checkouts of forkrl, interleaved: did a change make the step slower?

    python bench/bench_step_ab.py --trees /path/to/before,.            # the tiny default, 1 process
    python bench/bench_step_ab.py --trees /path/to/before,. --ranks 2  # 2 gloo ranks (FSDP2)
    python bench/bench_step_ab.py --trees .,. --grad-sync last,every --ranks 2   # one checkout, two settings
    python bench/bench_step_ab.py --trees /path/to/before,. --vocab 16384 --hidden 256 --layers 4   # a big vocab

Each measurement is a fresh process (torchrun with `--ranks` processes) that imports forkrl from one checkout
(PYTHONPATH), builds the model and one fixed batch from fixed seeds, runs one warm-up step and `--steps` timed
steps of that checkout's own `train_step` (forkrl/rl/step.py) and reports the median; the checkouts alternate,
`--reps` times, so that a slow spell of a shared machine hits both. Model: the embedded tiny default
(forkrl/models/default, Llama) unless `--vocab` is given (then a random-init Qwen2 of `--hidden`/`--layers`).
Batch: the tiny default recipe's shape (32 prompts x 8 samples, micro-batches of 64, grpo, micro-batch top-k
0.2): prompts of 12-24 tokens, completions of 1-40. Prints every median and, per setting, the median over the
reps and its range. Nothing asserts (docs/results-history.md has runs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trees", required=True, help="two comma-separated forkrl checkouts (a git worktree or archive)")
    p.add_argument("--grad-sync", default="", help="comma-separated grad_sync per tree (2+ ranks); empty: the "
                   "checkout's default (a checkout without the option must be given empty)")
    p.add_argument("--ranks", type=int, default=1)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=5, help="timed steps per measurement (after one warm-up)")
    p.add_argument("--vocab", type=int, default=0, help="random-init Qwen2 with this vocabulary (0: the tiny default)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)  # grad_sync or "-": one measurement
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from forkrl.rl.losses import LossConfig
    from forkrl.rl.step import build_batch, train_step
    from forkrl.training.distributed import init_from_env, shard_model

    torch.set_num_threads(1)
    info = init_from_env()
    torch.manual_seed(0)
    if a.vocab:
        cfg = Qwen2Config(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=4 * a.hidden,
                          num_hidden_layers=a.layers, num_attention_heads=max(1, a.hidden // 64),
                          num_key_value_heads=max(1, a.hidden // 128))
        model, vocab = Qwen2ForCausalLM(cfg).float(), a.vocab
    else:
        from forkrl.models.tiny import default_model_dir

        model = AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32)
        vocab = model.config.vocab_size
    if info.world_size > 1:
        model = shard_model(model, "cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    g = torch.Generator().manual_seed(1)
    prompts, comps = [], []
    for _ in range(32):
        p = torch.randint(3, vocab, (int(torch.randint(12, 25, (1,), generator=g)),), generator=g).tolist()
        for _ in range(8):
            prompts.append(p)
            comps.append(torch.randint(3, vocab, (int(torch.randint(1, 41, (1,), generator=g)),), generator=g).tolist())
    batch = build_batch(prompts, comps, [[-1.0] * len(c) for c in comps], pad_id=0)
    adv = torch.randn(len(comps), generator=g)
    loss_cfg = LossConfig(name="grpo", entropy_top_frac=0.2)
    extra = {} if a.worker == "-" else {"grad_sync": a.worker}
    times = []
    for step in range(a.steps + 1):
        if dist.is_initialized():
            dist.barrier()
        t0 = time.perf_counter()
        train_step(model, opt, batch, adv, loss_cfg, temperature=1.0, micro_batch_size=64, max_grad_norm=1.0,
                   **extra)
        if step:
            times.append(time.perf_counter() - t0)
    if info.rank == 0:
        Path(a.out).write_text(json.dumps({"median_s": statistics.median(times)}))
    if dist.is_initialized():
        dist.destroy_process_group()


def measure(a: argparse.Namespace, tree: str, grad_sync: str) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        dims = [f"--{k}={getattr(a, k)}" for k in ("steps", "vocab", "hidden", "layers")]
        cmd = [sys.executable, "-m", "forkrl.launch", f"--nproc-per-node={a.ranks}",
               str(Path(__file__).resolve()), "--trees=-", f"--worker={grad_sync or '-'}", f"--out={out}", *dims]
        env = dict(os.environ, PYTHONPATH=str(Path(tree).resolve()), OMP_NUM_THREADS="1")
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tree)
        if proc.returncode != 0:
            sys.exit(f"{tree} failed:\n{proc.stderr[-4000:]}")
        return json.loads(out.read_text())["median_s"]


def main() -> None:
    a = parse()
    if a.worker:
        worker(a)
        return
    trees = a.trees.split(",")
    syncs = a.grad_sync.split(",") if a.grad_sync else [""] * len(trees)
    settings = list(zip(trees, syncs, strict=True))
    model = f"Qwen2 V={a.vocab} h={a.hidden} L={a.layers}" if a.vocab else "the tiny default"
    print(f"{model}, {a.ranks} rank(s), 256 rows in micro-batches of 64, median of {a.steps} steps per "
          f"measurement, {a.reps} reps interleaved", flush=True)
    got: dict[tuple[str, str], list[float]] = {s: [] for s in settings}
    for rep in range(a.reps):
        for tree, sync in settings:
            got[(tree, sync)].append(measure(a, tree, sync))
            print(f"rep {rep + 1} {tree} {sync or '(default)'}: {got[(tree, sync)][-1]:.3f} s/step", flush=True)
    for (tree, sync), ts in got.items():
        print(f"{tree} {sync or '(default)'}: median {statistics.median(ts):.3f} s/step, range {min(ts):.3f}-"
              f"{max(ts):.3f} over {len(ts)} reps")


if __name__ == "__main__":
    main()
