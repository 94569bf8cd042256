"""Does RL learn on the embedded default? Arms that change one thing each, several seeds, mean ± sd and curves.

    python bench/bench_learning.py --seeds 0 1 2                        # every arm, 150 steps each
    python bench/bench_learning.py --seeds 0 1 2 --arms top20 full      # issue 11: top-20% vs full mask
    python bench/bench_learning.py --seeds 0 1 2 --arms top20 async mb4 --num-steps 60   # issue 12

Arms (`--arms`, any subset; `top20` is the reference every other arm changes one thing of):
  top20   top-20% entropy mask, sync (generate -> train -> push), one optimizer update per rollout batch
  full    the full mask (every response token)
  async   --max-staleness 1: the next batch is sampled while the trainer trains (one step off-policy)
  mb4     --mini-batch-prompts P with P = prompts per step / 4: four optimizer updates per rollout batch

Starts the rollout and trainer services once through the local launcher (the compose.yaml commands), runs every
(seed, arm) with identical settings otherwise, and prints per run and per arm (mean ± sample sd over seeds) eval
accuracy before and after (T=1 with 4 samples per prompt, and greedy), the gain, mean step time and the async/sync
ratio of step times; per run also the paired bootstrap 95% interval of the gain over eval prompts. Writes a PNG
of eval accuracy vs step per arm (mean, band ± 1 sd across seeds; --plot) and the results as JSON (--out,
rewritten after every run), plus the kept-token breakdown by answer-token class of each arm.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

# arm -> the RunConfig fields it sets on top of the shared settings ("mini_batch_prompts" is filled per run)
ARMS: dict[str, dict] = {
    "top20": {"entropy_top_frac": 0.2},
    "full": {"entropy_top_frac": None},
    "async": {"entropy_top_frac": 0.2, "max_staleness": 1},
    "mb4": {"entropy_top_frac": 0.2, "mini_batch_prompts": 4},  # 4 = the number of updates, see arm_config
}
LABELS = {"top20": "top 20%", "full": "full mask", "async": "async k=1", "mb4": "4 updates/batch"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python bench/bench_learning.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 2)[2])
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS), metavar="ARM",
                   help=f"arms to run, any of {', '.join(ARMS)} (default: all)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="run seeds (default: 0)")
    p.add_argument("--num-steps", type=int, default=150)
    p.add_argument("--prompts-per-step", type=int, default=32)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--loss", default="grpo")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--eval-prompts", type=int, default=512)
    p.add_argument("--eval-every", type=int, default=50, help="0 = before and after only")
    p.add_argument("--task", default="", help="built-in task (default countdown; sum3: a short chain)")
    p.add_argument("--data-dir", type=Path, default=REPO_ROOT / "runs" / "bench-learning")
    p.add_argument("--out", type=Path, default=None, help="results JSON (default: <data-dir>/results.json)")
    p.add_argument("--plot", type=Path, default=None,
                   help="eval accuracy vs step PNG (default: <data-dir>/learning_curves.png)")
    p.add_argument("--merge", type=Path, nargs="+", default=None, metavar="JSON",
                   help="run nothing: print the tables and write the plot from earlier --out files (e.g. one "
                        "invocation per seed), keeping the --arms and --seeds given")
    args = p.parse_args(argv)
    args.arms = list(dict.fromkeys(args.arms))  # order kept, duplicates dropped
    args.seeds = list(dict.fromkeys(args.seeds))
    if any(s < 0 for s in args.seeds):
        p.error("--seeds must be >= 0")
    if "mb4" in args.arms and args.prompts_per_step % 4:
        p.error(f"arm mb4 needs --prompts-per-step divisible by 4, got {args.prompts_per_step}")
    args.out = args.out or args.data_dir / "results.json"
    args.plot = args.plot or args.data_dir / "learning_curves.png"
    return args


def arm_config(arm: str, prompts_per_step: int) -> dict:
    """The RunConfig fields of an arm (ARMS), with mb4's prompts per update resolved to 4 updates per batch."""
    fields = dict(ARMS[arm])
    if "mini_batch_prompts" in fields:
        fields["mini_batch_prompts"] = prompts_per_step // fields["mini_batch_prompts"]
    return fields


def _fmt(xs: list[float], prec: int = 3) -> str:
    from forkrl.training.curves import mean_sd

    m, sd = mean_sd(xs)
    return f"{m:.{prec}f} ± {sd:.{prec}f}"


def summary_table(results: list[dict]) -> list[str]:
    """Per arm, mean ± sd over its seeds: eval T=1 before/after, gain, greedy after, s/step; and the ratios of
    step times to the top20 arm (async/sync is the issue-12 number)."""
    arms = list(dict.fromkeys(r["arm"] for r in results))
    rows = [f"{'arm':>16} {'seeds':>5} {'T=1 before':>15} {'T=1 after':>15} {'gain':>15} {'greedy after':>15} "
            f"{'s/step':>13} {'updates':>7}"]
    step_s = {}
    for arm in arms:
        rs = [r for r in results if r["arm"] == arm]
        step_s[arm] = sum(r["step_s"] for r in rs) / len(rs)
        gains = [r["acc_after"] - r["acc_before"] for r in rs]
        rows.append(f"{LABELS[arm]:>16} {len(rs):5d} {_fmt([r['acc_before'] for r in rs]):>15} "
                    f"{_fmt([r['acc_after'] for r in rs]):>15} {_fmt(gains):>15} "
                    f"{_fmt([r['greedy_after'] for r in rs]):>15} {_fmt([r['step_s'] for r in rs], 2):>13} "
                    f"{rs[0]['updates']:7.0f}")
    if "top20" in step_s:
        for arm in arms:
            if arm != "top20":
                name = "async/sync" if arm == "async" else f"{arm}/top20"
                rows.append(f"ratio of mean s/step {name}: {step_s[arm] / step_s['top20']:.2f}")
    return rows


def run_table(results: list[dict]) -> list[str]:
    rows = [f"{'arm':>16} {'seed':>4} {'kept':>6} {'T=1 before':>10} {'T=1 after':>9} {'gain [95% CI]':>25} "
            f"{'greedy':>13} {'wall s':>7} {'s/step':>6}"]
    for r in results:
        g = r["gain"]
        ci = "-" if g is None else f"{g['mean']:+.3f} [{g['lo']:+.3f}, {g['hi']:+.3f}]"
        rows.append(f"{LABELS[r['arm']]:>16} {r['seed']:4d} {r['kept_frac']:6.3f} {r['acc_before']:10.3f} "
                    f"{r['acc_after']:9.3f} {ci:>25} {r['greedy_before']:.3f}->{r['greedy_after']:.3f} "
                    f"{r['wall_s']:7.0f} {r['step_s']:6.2f}")
    return rows


def write_plot(path: Path, results: list[dict], title: str) -> Path:
    from forkrl.training.curves import plot_arm_curves

    arms: dict[str, list] = {}
    for r in results:
        arms.setdefault(LABELS[r["arm"]], []).append([(s, a) for s, a, _ in r["curve"]])
    return plot_arm_curves(path, arms, title=title)


def run_to_end(stub, cfg, label: str) -> list[dict]:  # noqa: ANN001 (TrainerServiceStub, RunConfig)
    """Start `cfg` on the trainer service, follow it to its end (printing its evaluations), and return its
    metrics.jsonl lines; RuntimeError when the run does not succeed. Shared with bench/bench_peers.py."""
    from forkrl.training.config import to_proto
    from forkrl.training.curves import read_metrics
    from forkrl.wire.trainer.v1 import trainer_pb2

    started = stub.StartRun(trainer_pb2.StartRunRequest(config=to_proto(cfg)), timeout=120)
    for item in stub.WatchRun(trainer_pb2.WatchRunRequest(run_id=started.run_id)):
        if item.HasField("event") and item.event.kind == trainer_pb2.EVENT_KIND_EVAL:
            v = item.event.values
            print(f"  {label} step {item.event.step:4d}: eval T=1 {v['eval_accuracy']:.3f} "
                  f"greedy {v['eval_greedy_accuracy']:.3f}", flush=True)
    run = stub.GetRun(trainer_pb2.GetRunRequest(run_id=started.run_id), timeout=30)
    if run.state != trainer_pb2.RUN_STATE_SUCCEEDED:
        raise RuntimeError(f"run {label} failed: {run.error}")
    return read_metrics(Path(cfg.run_dir))


def _run_one(stub, stack, args: argparse.Namespace, model: Path, arm: str, seed: int) -> dict:  # noqa: ANN001
    from forkrl.report.data import mean_class_breakdown
    from forkrl.training.config import RunConfig
    from forkrl.training.curves import eval_gain

    run_dir = args.data_dir / "runs" / f"{args.loss}-{arm}-seed{seed}-{time.strftime('%H%M%S')}"
    fields = arm_config(arm, args.prompts_per_step)
    cfg = RunConfig(model=str(model), rollout_addresses=[stack.addresses["rollout"]], loss=args.loss,
                    num_steps=args.num_steps, prompts_per_step=args.prompts_per_step, group_size=args.group_size,
                    lr=args.lr, eval_prompts=args.eval_prompts, eval_every=args.eval_every, seed=seed,
                    run_dir=str(run_dir), task=args.task, **fields)
    t0 = time.monotonic()
    lines = run_to_end(stub, cfg, f"{arm} seed {seed}")
    evals = [m for m in lines if m["kind"] == "eval"]
    train = [m for m in lines if m["kind"] == "train" and "time_step_s" in m]
    return {
        "arm": arm, "seed": seed, "config": fields, "steps": args.num_steps, "run_dir": str(run_dir),
        "settings": settings(args),
        "wall_s": time.monotonic() - t0, "step_s": sum(m["time_step_s"] for m in train) / len(train),
        "updates": sum(m.get("n_updates", 1.0) for m in train) / len(train),
        "kept_frac": sum(m["kept_frac"] for m in train) / len(train),
        "acc_before": evals[0]["eval_accuracy"], "acc_after": evals[-1]["eval_accuracy"],
        "greedy_before": evals[0]["eval_greedy_accuracy"], "greedy_after": evals[-1]["eval_greedy_accuracy"],
        "curve": [(e["step"], e["eval_accuracy"], e["eval_greedy_accuracy"]) for e in evals],
        "gain": eval_gain(run_dir), "classes": mean_class_breakdown(train),
    }


def settings(args: argparse.Namespace) -> dict:
    """What every arm of one invocation shares (printed as the title; kept in each result for --merge)."""
    from forkrl.data.tasks import DEFAULT_TASK

    return {"task": args.task or DEFAULT_TASK, "loss": args.loss, "steps": args.num_steps,
            "prompts_per_step": args.prompts_per_step, "group_size": args.group_size, "lr": args.lr,
            "eval_prompts": args.eval_prompts}


def title_of(results: list[dict]) -> str:
    """One line of the shared settings (several values joined by '/' when merged runs differ) and the seeds."""
    keys = list(results[0]["settings"])
    v = {k: "/".join(dict.fromkeys(str(r["settings"][k]) for r in results)) for k in keys}
    seeds = " ".join(map(str, dict.fromkeys(r["seed"] for r in results)))
    return (f"task {v['task']}, {v['loss']}, {v['steps']} steps x {v['prompts_per_step']} prompts x "
            f"{v['group_size']} samples, lr {v['lr']}, eval on {v['eval_prompts']} eval-split prompts "
            f"(T=1: 4 samples per prompt), seeds {seeds}")


def load_results(paths: list[Path], arms: list[str], seeds: list[int]) -> list[dict]:
    """The results of earlier --out files whose arm and seed were asked for, seeds outer, each (seed, arm) once
    (the last file wins)."""
    by_key = {}
    for path in paths:
        for r in json.loads(Path(path).read_text())["results"]:
            by_key[(r["seed"], r["arm"])] = r
    return [by_key[(s, a)] for s in seeds for a in arms if (s, a) in by_key]


def report(args: argparse.Namespace, results: list[dict]) -> None:
    title = title_of(results)
    print(f"\n{title}")
    print("\n".join(run_table(results)))
    print("\nper arm, mean ± sd over seeds")
    print("\n".join(summary_table(results)))
    if any(r["classes"] for r in results):
        print("\nkept tokens by answer-token class (mean over steps, first seed's run): share of all / of kept")
        firsts: dict[str, dict] = {}
        for r in results:
            firsts.setdefault(r["arm"], r)
        classes = list(next(iter(firsts.values()))["classes"])
        print(f"{'arm':>16} " + " ".join(f"{c:>17}" for c in classes))
        for arm, r in firsts.items():
            cells = [f"{r['classes'][c]['all']:.3f} / {r['classes'][c]['kept']:.3f}" for c in classes]
            print(f"{LABELS[arm]:>16} " + " ".join(f"{x:>17}" for x in cells))
    short = title.replace(" (T=1: 4 samples per prompt)", "").replace(", eval on", "\neval on")
    print(f"\nplot:    {write_plot(args.plot, results, short)}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.merge:
        results = load_results(args.merge, args.arms, args.seeds)
        if not results:
            print("no results for these arms and seeds in " + " ".join(map(str, args.merge)), file=sys.stderr)
            return 1
        report(args, results)
        return 0
    from clients.stack import Stack
    from forkrl.remote.channel import grpc_channel
    from forkrl.wire.trainer.v1 import trainer_pb2_grpc

    args.data_dir = args.data_dir.resolve()
    model = args.data_dir / "models" / "tiny"  # installed by the stack's one-shot `model` service
    results: list[dict] = []
    with Stack(data_dir=args.data_dir, services=["rollout", "trainer"], echo=False) as stack:
        stub = trainer_pb2_grpc.TrainerServiceStub(grpc_channel(stack.addresses["trainer"], token=stack.token))
        for seed in args.seeds:  # seeds outer: an interrupted bench still has every arm on its first seeds
            for arm in args.arms:
                try:
                    results.append(_run_one(stub, stack, args, model, arm, seed))
                except RuntimeError as e:
                    print(e, file=sys.stderr)
                    return 1
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                "results": results}, indent=2))
    report(args, results)
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
