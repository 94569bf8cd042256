"""scripts/memory_plan.py against a measured train step on CPU: the same formulas, a model small enough to run.

    python bench/bench_memory.py       # 1 process (fp32) and 2 gloo ranks (FSDP2, fp32 and bf16), checkpointing off/on
    python bench/bench_memory.py --ranks 2 --precision bf16 --micro 2     # one unpadded row per rank (no mask)
    python bench/bench_memory.py --ranks 2 --grad-sync last               # gradients unsharded between micro-batches

A random-init Qwen2 (built from a Qwen2Config in memory, as forkrl/models/random_qwen2.py builds its sizes;
defaults: hidden 512, 4 layers, 8 heads / 2 kv heads, intermediate 1536, vocab 16384, untied: 28.8 M
parameters) and one fixed batch (8 rows of a 64-token prompt and a 448- or 440-token response, so rows of a
micro-batch are right-padded: SDPA's mask path), trained by forkrl's own step (`train_step`
on 1 process, FSDP2 `shard_model` on 2 ranks under torchrun; bf16 = its MixedPrecisionPolicy, as on CUDA) in
one update of micro-batches of `--micro` rows (dealt over the ranks), dapo, micro-batch top-k 0.2, AdamW, the
gradients reduce-scattered every micro-batch (train_step's default; `--grad-sync last`: once per update).
One warm-up step creates AdamW's state; the second step runs under torch.profiler with profile_memory=True, whose
allocation events give the live tensor bytes at every instant (CPU tensors have no allocator statistics; RSS
would mix in the interpreter and freed pages). Sentinel allocations (sizes no tensor of the step has) mark the
start and end of the step and of each forward in the same event stream. Compared with the plan (CPU: no runtime,
fragmentation or device-copy terms), on rank 0:
- static (exact, by count): fp32 weights (local shards), AdamW exp_avg + exp_avg_sq + step counters;
- gradients: the live bytes at the start of the second micro-batch minus at the step's start;
- forward end: the live bytes when the second micro-batch's model forward returns minus at its start (the saved
  activations, the final norm's saved tensors and its output; on 2 ranks the root unit, gathered until the
  backward), before the chunked loss runs;
- peak: the step's highest live bytes minus at its start (gradients, FSDP2 working set, activations, loss).
Prints predicted, measured and measured / predicted. Nothing asserts: the static rows are exact by
construction, the others are estimates (docs/results.md has a run).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import memory_plan as plan  # noqa: E402  (torch-free formulas)

MIB = 1 << 20
# byte sizes of the sentinel allocations that mark instants in the profiler's event stream (sizes no tensor of
# the step has)
SENTINELS = {"step_start": 1_000_003, "step_end": 1_000_033, "fwd_start": 1_000_037, "fwd_end": 1_000_039}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", default="1,2", help="comma-separated process counts")
    p.add_argument("--checkpointing", default="off,on", help="comma-separated: off, on")
    p.add_argument("--precision", default="fp32,bf16", help="comma-separated: fp32, bf16 (FSDP2's "
                   "MixedPrecisionPolicy, as on CUDA; with 2+ ranks only)")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--inter", type=int, default=1536)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--rows", type=int, default=8, help="rows of the batch (a multiple of 4)")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens per row")
    p.add_argument("--response", type=int, default=448, help="response tokens of the longest rows (every other "
                   "row has 8 fewer)")
    p.add_argument("--micro", default="4", help="comma-separated micro_batch_size values (rows of a micro-batch over "
                   "all ranks; micro = ranks: one unpadded row per rank, no mask, as the recipe on 4+ ranks)")
    p.add_argument("--grad-sync", choices=["every", "last"], default="every", help="train_step's grad_sync (2+ ranks)")
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)  # "on|off,fp32|bf16,MICRO": one measurement
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def config(a: argparse.Namespace) -> dict:
    return dict(model_type="qwen2", vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.inter,
                num_hidden_layers=a.layers, num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False)


def run_of(a: argparse.Namespace, micro: int) -> plan.Run:
    return plan.Run(prompts_per_step=a.rows // 4, group_size=4, mini_batch_prompts=0, micro_batch_size=micro,
                    max_new_tokens=a.response, prompt_tokens=a.prompt)


def worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from forkrl.rl.losses import LossConfig
    from forkrl.rl.step import build_batch, train_step
    from forkrl.training.distributed import init_from_env, shard_model

    torch.set_num_threads(1)
    info = init_from_env()
    ckpt, precision, micro = a.worker.split(",")
    ckpt, bf16, run = ckpt == "on", precision == "bf16", run_of(a, int(micro))
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(max_position_embeddings=a.prompt + a.response, **config(a))).float()
    if info.world_size > 1:
        model = shard_model(model, "cpu", mixed_precision=bf16, activation_checkpointing=ckpt)
    elif ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    g = torch.Generator().manual_seed(1)
    n, seq, prompt = run.seqs, run.prompt_tokens + run.max_new_tokens, run.prompt_tokens
    prompts = [torch.randint(3, a.vocab, (prompt,), generator=g).tolist() for _ in range(n)]
    comps = [torch.randint(3, a.vocab, (seq - prompt - 8 * (i % 2),), generator=g).tolist() for i in range(n)]
    batch = build_batch(prompts, comps, [[-1.0] * len(c) for c in comps], pad_id=0)
    adv = torch.randn(n, generator=g)
    loss_cfg = LossConfig(name="dapo", entropy_top_frac=0.2, mask_scope="microbatch")

    def step() -> None:
        train_step(model, opt, batch, adv, loss_cfg, temperature=1.0, micro_batch_size=run.micro_batch_size,
                   max_grad_norm=1.0, grad_sync=a.grad_sync)

    step()  # AdamW's state exists from here on

    def mark(kind: str) -> None:  # a sentinel allocation of a size nothing else has: a mark in the event stream
        torch.empty(SENTINELS[kind], dtype=torch.uint8)

    # before FSDP2's own pre-forward (it gathers the root unit) and after its post-forward
    model.register_forward_pre_hook(lambda *_: mark("fwd_start"), prepend=True)
    model.register_forward_hook(lambda *_: mark("fwd_end"))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        mark("step_start")
        step()
        mark("step_end")
    # the allocator's events in the order they happened (a stable sort on time: an allocation and a free in the
    # same nanosecond keep their order); the live bytes before each event, the marks' positions
    events = sorted(((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                     if e.name() == "[memory]"), key=lambda tb: tb[0])
    kinds = {size: kind for kind, size in SENTINELS.items()}
    live, total, marks = [], 0, []
    for _, b in events:
        if abs(b) in kinds:
            if b > 0:
                marks.append((kinds[b], len(live)))
            continue
        live.append(total)
        total += b
    live.append(total)

    def at(kind: str, n: int) -> int:
        return live[[i for k, i in marks if k == kind][n]]

    base = at("step_start", 0)
    first, last = [i for k, i in marks if k == "step_start"][0], [i for k, i in marks if k == "step_end"][0]
    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    adam = sum(local(v).numel() * local(v).element_size() for s in opt.state.values() for v in s.values())
    out = {
        "weights": sum(local(p).numel() * 4 for p in model.parameters()),
        "adam": adam,
        # forwards of the step: micro-batch 0, micro-batch 1 (the last); approx_kl's pass only with kl_pass (off)
        "grads": at("fwd_start", 1) - base,
        "fwd_end": at("fwd_end", 1) - at("fwd_start", 1),
        "peak": max(live[first: last + 1]) - base,
    }
    if info.rank == 0:
        Path(a.out).write_text(json.dumps(out))
    if dist.is_initialized():
        dist.destroy_process_group()


def launch(a: argparse.Namespace, ranks: int, ckpt: str, precision: str, micro: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        keys = ("hidden", "layers", "inter", "vocab", "rows", "prompt", "response", "grad_sync")
        dims = [f"--{k.replace('_', '-')}={getattr(a, k)}" for k in keys]
        cmd = [sys.executable, "-m", "forkrl.launch", f"--nproc-per-node={ranks}",
               str(Path(__file__).resolve()), f"--worker={ckpt},{precision},{micro}", f"--out={out}", *dims]
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"{ranks} rank(s), checkpointing {ckpt}, {precision}, micro-batch {micro} failed:\n"
                     f"{proc.stderr[-4000:]}")
        return json.loads(out.read_text())


def predicted(a: argparse.Namespace, ranks: int, ckpt: bool, bf16: bool, run: plan.Run) -> dict[str, float]:
    shape = plan.Shape.from_config(config(a), "check")
    tr = plan.Trainer(ranks=ranks, device="cpu", checkpointing=ckpt, grad_sync=a.grad_sync, mixed_precision=bf16)
    terms = {n: b for _, n, b in plan.trainer_terms(shape, run, tr)}
    static = sum(v for k, v in terms.items() if k.startswith(("fp32 master", "AdamW")))
    rows = max(1, -(-run.micro_batch_size // ranks))
    seq, cb = run.prompt_tokens + run.max_new_tokens, 2 if bf16 else 4
    saved = next(v for k, v in terms.items() if k.startswith("activations saved"))
    root = cb * shape.root_params if ranks > 1 else 0.0  # gathered by the forward, kept until the backward
    return {
        "weights": terms["fp32 master weights (sharded)"],
        "adam": terms["AdamW exp_avg + exp_avg_sq (sharded)"] + terms["AdamW step counters"],
        "grads": next(v for k, v in terms.items() if k.startswith("fp32 gradients")),
        # + the final norm's output (the last hidden states), before the chunked loss selects its rows
        "fwd_end": saved + root + terms["the final RMSNorm's saved tensors"] + cb * rows * seq * shape.hidden,
        "peak": terms["total per rank"] - static,
    }


def main() -> None:
    a = parse()
    if a.worker:
        worker(a)
        return
    shape, run = plan.Shape.from_config(config(a), "check"), run_of(a, 4)
    print(f"model: Qwen2 hidden {a.hidden}, {a.layers} layers, intermediate {a.inter}, vocab {a.vocab} "
          f"({shape.params / 1e6:.1f} M params); {run.seqs} rows of <= {run.prompt_tokens}+{run.max_new_tokens} "
          "tokens; MiB on rank 0", flush=True)
    print("| ranks | compute | checkpointing | micro-batch (rows per rank) | term | predicted | measured | "
          "measured / predicted |")
    print("|---|---|---|---|---|---|---|---|")
    for ranks in (int(r) for r in a.ranks.split(",")):
        for precision in a.precision.split(","):
            if precision == "bf16" and ranks == 1:
                continue  # one process trains in fp32 (no FSDP2, no mixed precision)
            for micro in (int(m) for m in a.micro.split(",")):
                for ckpt in a.checkpointing.split(","):
                    got = launch(a, ranks, ckpt, precision, micro)
                    want = predicted(a, ranks, ckpt == "on", precision == "bf16", run_of(a, micro))
                    rows = -(-micro // ranks)
                    for k in ("weights", "adam", "grads", "fwd_end", "peak"):
                        print(f"| {ranks} | {precision} | {ckpt} | {micro} ({rows}) | {k} | {want[k] / MIB:.2f} | "
                              f"{got[k] / MIB:.2f} | {got[k] / want[k]:.3f} |", flush=True)


if __name__ == "__main__":
    main()
