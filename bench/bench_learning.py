"""Does RL learn on the embedded default? Top-20% entropy mask vs the full mask, same seed and budget.

    python bench/bench_learning.py                       # 150 steps each (a few minutes per run on 2 cores)
    python bench/bench_learning.py --num-steps 300 --fracs 0.2 1.0 0.5

Starts the rollout and trainer services through the local launcher (the compose.yaml commands), runs one
training run per --fracs value with identical settings and seed, and prints eval accuracy (T=1 with 4
samples per prompt, and greedy) before and after, plus wall time and mean step time of each run, and the
kept-token breakdown by answer-token class of each run (share of all tokens vs share of kept tokens).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-steps", type=int, default=150)
    p.add_argument("--fracs", type=float, nargs="+", default=[0.2, 1.0], help="entropy_top_frac values (1.0 = full)")
    p.add_argument("--loss", default="grpo")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--eval-prompts", type=int, default=512)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--task", default="", help="built-in task (default sum3; countdown: a task with real forks)")
    p.add_argument("--data-dir", type=Path, default=REPO_ROOT / "runs" / "bench-learning")
    p.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    args = p.parse_args(argv)

    from clients.stack import Stack
    from forkrl.security import grpc_channel
    from forkrl.training.config import RunConfig, to_proto
    from forkrl.training.metrics import mean_class_breakdown
    from forkrl.wire.trainer.v1 import trainer_pb2, trainer_pb2_grpc

    data = args.data_dir.resolve()
    model = data / "models" / "tiny"  # built (cached) by the stack's one-shot `model` service
    results = []
    with Stack(data_dir=data, services=["rollout", "trainer"], echo=False) as stack:
        stub = trainer_pb2_grpc.TrainerServiceStub(grpc_channel(stack.addresses["trainer"], token=stack.token))
        for frac in args.fracs:
            run_dir = data / "runs" / f"{args.loss}-frac{frac}-seed{args.seed}-{time.strftime('%H%M%S')}"
            cfg = RunConfig(model=str(model), rollout_addresses=[stack.addresses["rollout"]], loss=args.loss,
                            entropy_top_frac=None if frac >= 1.0 else frac, num_steps=args.num_steps,
                            prompts_per_step=32, group_size=8, lr=args.lr, eval_prompts=args.eval_prompts,
                            eval_every=args.eval_every, seed=args.seed, run_dir=str(run_dir), task=args.task)
            t0 = time.monotonic()
            started = stub.StartRun(trainer_pb2.StartRunRequest(config=to_proto(cfg)), timeout=120)
            for item in stub.WatchRun(trainer_pb2.WatchRunRequest(run_id=started.run_id)):
                if item.HasField("event") and item.event.kind == trainer_pb2.EVENT_KIND_EVAL:
                    v = item.event.values
                    print(f"  frac={frac} step {item.event.step:4d}: eval T=1 {v['eval_accuracy']:.3f} "
                          f"greedy {v['eval_greedy_accuracy']:.3f}", flush=True)
            run = stub.GetRun(trainer_pb2.GetRunRequest(run_id=started.run_id), timeout=30)
            if run.state != trainer_pb2.RUN_STATE_SUCCEEDED:
                print(f"run failed: {run.error}", file=sys.stderr)
                return 1
            lines = [json.loads(s) for s in (run_dir / "metrics.jsonl").read_text().splitlines()]
            evals = [m for m in lines if m["kind"] == "eval"]
            train = [m for m in lines if m["kind"] == "train"]
            results.append({
                "entropy_top_frac": frac, "steps": args.num_steps, "wall_s": time.monotonic() - t0,
                "step_s": sum(m["time_step_s"] for m in train) / len(train),
                "kept_frac": sum(m["kept_frac"] for m in train) / len(train),
                "curve": [(e["step"], e["eval_accuracy"], e["eval_greedy_accuracy"]) for e in evals],
                "classes": mean_class_breakdown(train),
            })
    print(f"\ntask {args.task or 'sum3'}, loss {args.loss}, seed {args.seed}, {args.num_steps} steps x 32 prompts "
          f"x 8 samples, lr {args.lr}, "
          f"eval on {args.eval_prompts} eval-split prompts")
    print(f"{'mask':>10} {'kept':>6} {'T=1 before':>11} {'T=1 after':>10} {'greedy before':>14} "
          f"{'greedy after':>13} {'wall s':>7} {'s/step':>7}")
    for r in results:
        (_, a0, g0), (_, a1, g1) = r["curve"][0], r["curve"][-1]
        name = "full" if r["entropy_top_frac"] >= 1.0 else f"top {r['entropy_top_frac']:.0%}"
        print(f"{name:>10} {r['kept_frac']:6.3f} {a0:11.3f} {a1:10.3f} {g0:14.3f} {g1:13.3f} "
              f"{r['wall_s']:7.0f} {r['step_s']:7.2f}")
    if any(r["classes"] for r in results):
        print("\nkept tokens by answer-token class (mean over steps): share of all tokens / share of kept tokens")
        classes = list(results[0]["classes"])
        print(f"{'mask':>10} " + " ".join(f"{c:>17}" for c in classes))
        for r in results:
            name = "full" if r["entropy_top_frac"] >= 1.0 else f"top {r['entropy_top_frac']:.0%}"
            cells = [f"{r['classes'][c]['all']:.3f} / {r['classes'][c]['kept']:.3f}" for c in classes]
            print(f"{name:>10} " + " ".join(f"{x:>17}" for x in cells))
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
