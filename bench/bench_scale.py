"""Trainer step time on CPU: 1 rank vs 2 ranks (torchrun, gloo), replicated (DDP-style) and FSDP2.

    python bench/bench_scale.py                         # both modes, 3 timed steps after 1 warm-up
    python bench/bench_scale.py --modes fsdp --steps 5 --hidden 256 --layers 4 --rows 32
    python bench/bench_scale.py --mini 16 --epochs 2 --tis-cap 2     # the recipe's mechanics: 4 updates a step

One random-init Qwen2 model and one fixed batch of `--rows` trajectories; each run is a fresh torchrun
(`--nproc-per-node 1` or `2`) whose rank 0 reports the median wall time of `train_step` (forkrl/rl/step.py:
forward, backward, gradient reduction, AdamW; with `--mini`/`--epochs` the π_old pass and several updates)
over the timed steps; world size 1 is the same code without collectives.
Prints the times and the ratio 2 ranks / 1 rank (< 1 means 2 ranks are faster). Nothing asserts it: on a
machine with 2 cores shared with other work, 2 ranks mostly measure the gloo collectives and contention.
Each rank uses `--threads` intra-op threads.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="ddp,fsdp", help="comma-separated: ddp (replicated + all_reduce), fsdp")
    p.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up step)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--rows", type=int, default=32, help="trajectories per step")
    p.add_argument("--length", type=int, default=64, help="max prompt+completion tokens")
    p.add_argument("--micro", type=int, default=16, help="global micro-batch size (rows)")
    p.add_argument("--mini", type=int, default=0, help="rows per update (mini-batch); 0 = one update per step")
    p.add_argument("--epochs", type=int, default=1, help="passes over the mini-batches per step")
    p.add_argument("--tis-cap", type=float, default=0.0, help="truncated IS cap (0 = off)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)  # fsdp|ddp: run one rank, write JSON
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from forkrl.rl.losses import LossConfig
    from forkrl.rl.step import build_batch, train_step
    from forkrl.training.distributed import init_from_env, shard_model

    torch.set_num_threads(args.threads)
    info = init_from_env()
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 64),
                      num_key_value_heads=max(1, args.hidden // 128), max_position_embeddings=2 * args.length)
    model = Qwen2ForCausalLM(cfg).float()
    if args.worker == "fsdp" and info.world_size > 1:
        model = shard_model(model, "cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    g = torch.Generator().manual_seed(1)
    prompts, comps, lps = [], [], []
    for _ in range(args.rows):
        p = int(torch.randint(4, args.length // 4, (1,), generator=g))
        c = int(torch.randint(1, args.length - p, (1,), generator=g))
        prompts.append(torch.randint(3, args.vocab, (p,), generator=g).tolist())
        comps.append(torch.randint(3, args.vocab, (c,), generator=g).tolist())
        lps.append([-1.0] * c)
    batch = build_batch(prompts, comps, lps, pad_id=0)
    adv = torch.randn(args.rows, generator=g)
    loss_cfg = LossConfig(name="dapo", entropy_top_frac=0.2, mask_scope="step", tis_cap=args.tis_cap or None)
    times = []
    for step in range(args.steps + 1):
        if info.world_size > 1:
            dist.barrier()
        t0 = time.perf_counter()
        train_step(model, opt, batch, adv, loss_cfg, temperature=1.0, micro_batch_size=args.micro,
                   max_grad_norm=1.0, mini_batch_size=args.mini or None, epochs=args.epochs)
        if step:  # the first step warms up allocators and gloo
            times.append(time.perf_counter() - t0)
    if info.rank == 0:
        Path(args.out).write_text(json.dumps({"median_s": statistics.median(times), "times": times,
                                              "params": sum(p.numel() for p in model.parameters()) *
                                              (info.world_size if args.worker == "fsdp" else 1)}))
    if dist.is_initialized():
        dist.destroy_process_group()


def launch(args: argparse.Namespace, mode: str, nproc: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        passthrough = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in (
            "steps", "hidden", "layers", "vocab", "rows", "length", "micro", "mini", "epochs", "tis_cap", "threads")]
        cmd = [sys.executable, "-m", "forkrl.launch", f"--nproc-per-node={nproc}",
               str(Path(__file__).resolve()), f"--worker={mode}", f"--out={out}", *passthrough]
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(args.threads))
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"{mode} with {nproc} rank(s) failed:\n{proc.stderr[-4000:]}")
        return json.loads(out.read_text())


def main() -> None:
    args = parse()
    if args.worker:
        worker(args)
        return
    print(f"model: Qwen2 hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; batch {args.rows} rows "
          f"<= {args.length} tokens, micro-batch {args.micro}, updates of {args.mini or args.rows} rows x "
          f"{args.epochs} epoch(s); dapo, step-scope top-k 0.2, TIS {args.tis_cap or 'off'}; "
          f"{args.threads} thread(s) per rank; median of {args.steps} steps", flush=True)
    one = launch(args, "ddp", 1)
    print(f"1 rank: {one['median_s']:.3f} s/step ({one['params'] / 1e6:.1f} M params)", flush=True)
    for mode in args.modes.split(","):
        two = launch(args, mode, 2)
        print(f"2 ranks {mode}: {two['median_s']:.3f} s/step; ratio 2 ranks / 1 rank = "
              f"{two['median_s'] / one['median_s']:.2f}", flush=True)


if __name__ == "__main__":
    main()
