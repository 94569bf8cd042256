"""forkrl against TRL's GRPOTrainer on the same machine: s/step with its breakdown, the ratio, and learning.

    python bench/bench_peers.py                                   # both sizes, arms sync async trl, seed 0
    python bench/bench_peers.py --sizes tiny --seeds 0 1 --num-steps 60
    python bench/bench_peers.py --sizes 0.5b --big-steps 3 --big-shape 8 4 32
    python bench/bench_peers.py --smoke                           # 2 steps, 32 eval prompts (tests/unit)

Needs the optional extra `bench` (pip install -e ".[bench]": TRL and accelerate). Arms (`--arms`):
  sync    forkrl through its services (the rollout service behind gRPC + the trainer service, as compose.yaml
          starts them, vLLM's engine generating), generate -> train -> push, the services' defaults otherwise
  async   the same with --max-staleness 1 (the next batch is sampled while the trainer trains)
  trl     TRL's GRPOTrainer in this process (HF generate), torch threads = --trl-threads (bench/peers_trl.py
          lists every setting that is not TRL's default and why)
Every arm gets the same model, countdown prompts in the same order (forkrl's DataOrder over its train pool,
walked in order by TRL with shuffle_dataset=False), hyper-parameters (prompts x samples per step, lr, T=1,
new tokens, one update per batch, micro-batches of --micro-batch, loss grpo, the top-20% entropy mask:
entropy_top_frac / top_entropy_quantile) and reward (forkrl's countdown reward). Sizes (`--sizes`):
  tiny    the embedded default model: speed and learning (32 x 8 x 16 tokens, --num-steps steps)
  0.5b    a random-init Qwen2 of ~0.5B parameters (forkrl/models/random_qwen2.py): speed only, --big-steps
          steps of --big-shape (prompts, samples, new tokens; the issue's 64 x 4 x 128 by default); its TRL
          runs start after the services stop (each side holds the model, its gradients and AdamW state)
One evaluator scores every arm's final model and the initial one (`evaluate_model`: forkrl's transformers sampler,
--eval-prompts prompts of the countdown eval split, T=1 with 4 samples each and greedy, forkrl's reward).

Printed per size: per run and per arm (mean ± sd over seeds) s/step with generation / training / push (means
over the steps after --warmup-steps; in the async arm generation overlaps training, so the parts do not add up;
TRL has no push), the ratio forkrl/TRL and the issue-28 goals (sync <= 1.0x TRL, async <= 0.6x) as met/missed
(a miss smaller than the sd of the per-seed ratios is said to be one), with 2+ seeds the ratio seed by seed (each
forkrl run over the TRL run of its seed), for a missed goal what bounds it (from the measured
parts), eval before/after and the gain. JSON of every run in --out.

Each run's directory (<data-dir>/runs/...: its checkpoints, at 0.5b several GB per run with the optimizer state) is
deleted once the bench has read what it needs from it (the evaluation of its final model at size tiny);
--keep-runs keeps them.

--device cuda: the services use the GPU (their device auto), TRL generates with vLLM (use_vllm, colocate
mode), the evaluator runs on the GPU: both sides with vLLM generation. That code path is present but has not
been run on a GPU yet.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from bench.bench_learning import _fmt, run_to_end  # noqa: E402
from bench.peers_trl import run_trl, trl_version  # noqa: E402

ARMS = ("sync", "async", "trl")
LABELS = {"sync": "forkrl sync", "async": "forkrl async k=1", "trl": "TRL GRPOTrainer"}
GOALS = {"sync": 1.0, "async": 0.6}  # issue 28: forkrl s/step <= this x TRL's
SIZES = ("tiny", "0.5b")
TASK, REWARD = "countdown", "countdown"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python bench/bench_peers.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 2)[2])
    p.add_argument("--sizes", nargs="+", default=list(SIZES), choices=SIZES, metavar="SIZE")
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS, metavar="ARM")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--num-steps", type=int, default=200, help="steps per run at size tiny (default 200)")
    p.add_argument("--prompts-per-step", type=int, default=32, help="size tiny (default 32)")
    p.add_argument("--group-size", type=int, default=8, help="size tiny (default 8)")
    p.add_argument("--max-new-tokens", type=int, default=16, help="size tiny (default 16)")
    p.add_argument("--big-steps", type=int, default=4, help="steps per run at size 0.5b (default 4)")
    p.add_argument("--big-shape", type=int, nargs=3, default=[64, 4, 128], metavar=("PROMPTS", "SAMPLES", "TOKENS"),
                   help="size 0.5b: prompts per step, samples per prompt, new tokens (default 64 4 128)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--micro-batch", type=int, default=64, help="sequences per micro-batch (default 64)")
    p.add_argument("--top-frac", type=float, default=0.2, help="entropy mask: top fraction trained (default 0.2)")
    p.add_argument("--eval-prompts", type=int, default=512, help="held-out prompts per evaluation (size tiny)")
    p.add_argument("--warmup-steps", type=int, default=5,
                   help="steps left out of the s/step means (fewer when a run is shorter; default 5)")
    p.add_argument("--trl-threads", type=int, default=os.cpu_count() or 1, help="TRL's torch threads (default: "
                   "every core; the sync forkrl loop's phases take turns the same way)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--smoke", action="store_true",
                   help="2 steps per run (also at 0.5b, whose shape shrinks to 8 x 2 x 8), 32 eval prompts")
    p.add_argument("--data-dir", type=Path, default=REPO_ROOT / "runs" / "bench-peers")
    p.add_argument("--out", type=Path, default=None, help="results JSON (default: <data-dir>/results.json)")
    p.add_argument("--keep-runs", action="store_true",
                   help="keep each run's directory (checkpoints; at 0.5b several GB per run) instead of deleting it "
                        "once measured and evaluated")
    p.add_argument("--report", type=Path, default=None, metavar="JSON",
                   help="run nothing: print the tables of an earlier --out file (e.g. of an interrupted bench)")
    args = p.parse_args(argv)
    args.arms, args.seeds = list(dict.fromkeys(args.arms)), list(dict.fromkeys(args.seeds))
    if args.smoke:
        args.num_steps = args.big_steps = 2
        args.eval_prompts = min(args.eval_prompts, 32)
        args.big_shape = [8, 2, 8]
    for name in ("num_steps", "prompts_per_step", "group_size", "max_new_tokens", "big_steps", "micro_batch",
                 "trl_threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if min(args.big_shape) < 1:
        p.error(f"--big-shape values must be >= 1, got {args.big_shape}")
    if not 0 < args.top_frac <= 1:
        p.error(f"--top-frac must be in (0, 1], got {args.top_frac}")
    if "trl" in args.arms and trl_version() is None and not args.report:
        p.error("arm trl needs TRL: pip install -e '.[bench]' (or leave it out: --arms sync async)")
    args.data_dir = args.data_dir.resolve()
    args.out = args.out or args.data_dir / "results.json"
    return args


def shape_of(args: argparse.Namespace, size: str) -> dict[str, int]:
    if size == "tiny":
        return {"prompts": args.prompts_per_step, "group": args.group_size, "tokens": args.max_new_tokens,
                "steps": args.num_steps}
    prompts, group, tokens = args.big_shape
    return {"prompts": prompts, "group": group, "tokens": tokens, "steps": args.big_steps}


def train_prompts(seed: int, n: int) -> list:
    """The first n prompts forkrl's trainer takes for a run of `seed` (its train pool and data order)."""
    from forkrl.data.datasets import load_problems
    from forkrl.data.order import DataOrder
    from forkrl.training.loop import TRAIN_POOL

    return DataOrder(list(load_problems(TASK, None, "train", TRAIN_POOL, seed)), seed).take(n)


def evaluate_model(model_dir: Path, n_prompts: int, *, max_new_tokens: int, device: str, samples: int = 4,
                   seed: int = 0) -> dict[str, float]:
    """The one evaluator of every arm: accuracy on the first `n_prompts` countdown eval-split prompts, sampled at
    T=1 (`samples` per prompt) and greedy with forkrl's transformers sampler, graded by forkrl's reward."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from forkrl.data.datasets import load_problems
    from forkrl.data.prompts import run_reward_fn
    from forkrl.models.sampling import sample_completions

    problems = list(load_problems(TASK, None, "eval", n_prompts, 0))
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    reward_fn, out = run_reward_fn(REWARD), {}
    for name, temp, n in (("t1", 1.0, samples), ("greedy", 0.0, 1)):
        texts = sample_completions(model, tok, [p.prompt for p in problems], temperature=temp, n_samples=n,
                                   max_new_tokens=max_new_tokens, seed=seed, batch_size=256)
        rewards = reward_fn([t for ts in texts for t in ts], [p for p in problems for _ in range(n)]).rewards
        out[name] = sum(1.0 for r in rewards if r is not None and r > 0) / len(rewards)
    return out


def step_means(steps: dict[str, list[float]], warmup: int) -> dict[str, float]:
    """Means of each time series over the steps after `warmup` (all steps when a run is not longer)."""
    n = len(steps["step_s"])
    skip = warmup if n > warmup else 0
    return {k: sum(v[skip:]) / (n - skip) for k, v in steps.items()}


def run_forkrl(stub, stack, args: argparse.Namespace, size: str, model: Path, arm: str, seed: int) -> dict:  # noqa: ANN001
    from forkrl.training.config import RunConfig

    shape = shape_of(args, size)
    run_dir = args.data_dir / "runs" / f"{size}-{arm}-seed{seed}-{time.strftime('%H%M%S')}"
    cfg = RunConfig(model=str(model), rollout_addresses=[stack.addresses["rollout"]], task=TASK, reward=REWARD,
                    loss="grpo", num_steps=shape["steps"], prompts_per_step=shape["prompts"],
                    group_size=shape["group"], max_new_tokens=shape["tokens"], temperature=1.0, lr=args.lr,
                    micro_batch_size=args.micro_batch, entropy_top_frac=args.top_frac,
                    max_staleness=1 if arm == "async" else 0, eval_prompts=0, seed=seed, run_dir=str(run_dir))
    t0 = time.monotonic()
    train = [m for m in run_to_end(stub, cfg, f"{size} {arm} seed {seed}")
             if m["kind"] == "train" and "time_step_s" in m]
    steps = {"step_s": [m["time_step_s"] for m in train],
             "generate_s": [m["time_generate_s"] + m.get("time_score_s", 0.0) for m in train],
             "train_s": [m["time_train_s"] for m in train], "push_s": [m["time_push_s"] for m in train]}
    from forkrl.remote.rollout import RolloutClient

    with RolloutClient(stack.addresses["rollout"], token=stack.token, timeout_s=60) as c:
        backend = c.info().engine.backend
    return {"steps": steps, "wall_s": time.monotonic() - t0, "final": str(run_dir / "checkpoints" / "final"),
            "run_dir": str(run_dir), "backend": backend}


def run_one(stub, stack, args: argparse.Namespace, size: str, model: Path, arm: str, seed: int) -> dict:  # noqa: ANN001
    shape = shape_of(args, size)
    if arm == "trl":
        from forkrl.data.prompts import run_reward_fn

        out_dir = args.data_dir / "runs" / f"{size}-trl-seed{seed}-{time.strftime('%H%M%S')}"
        r = run_trl(model, train_prompts(seed, shape["steps"] * shape["prompts"]), run_reward_fn(REWARD), out_dir,
                    shape, steps=shape["steps"], lr=args.lr, seed=seed, threads=args.trl_threads,
                    device=args.device, top_frac=args.top_frac, micro_batch=args.micro_batch)
        run = {"steps": {k: r[k] for k in ("step_s", "generate_s", "train_s", "push_s")}, "wall_s": r["wall_s"],
               "final": r["final"], "run_dir": str(out_dir), "trl": r["config"]}
    else:
        run = run_forkrl(stub, stack, args, size, model, arm, seed)
    run.update(size=size, arm=arm, seed=seed, shape=shape, means=step_means(run["steps"], args.warmup_steps))
    if size == "tiny":
        run["eval_after"] = evaluate_model(Path(run["final"]), args.eval_prompts, max_new_tokens=shape["tokens"],
                                           device=args.device)
    if not args.keep_runs:
        shutil.rmtree(run["run_dir"], ignore_errors=True)  # measured and evaluated: its checkpoints are not needed
        run["run_dir"] = run["final"] = None
    m = run["means"]
    backend = f" [rollout backend {run['backend']}]" if run.get("backend") else ""
    print(f"  {size} {LABELS[arm]}{backend} seed {seed}: {m['step_s']:.3f} s/step (generation {m['generate_s']:.3f}, "
          f"training {m['train_s']:.3f}, push {m['push_s']:.3f})"
          + (f", eval T=1 after {run['eval_after']['t1']:.3f}" if "eval_after" in run else ""), flush=True)
    return run


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def report(results: list[dict], base_eval: dict[str, dict]) -> list[str]:
    """The tables of every size: per arm mean ± sd over seeds, the forkrl/TRL ratios and the goals."""
    lines = []
    for size in dict.fromkeys(r["size"] for r in results):
        rs = [r for r in results if r["size"] == size]
        sh, seeds = rs[0]["shape"], " ".join(str(s) for s in dict.fromkeys(r["seed"] for r in rs))
        lines.append(f"\nsize {size}: {sh['steps']} steps x {sh['prompts']} prompts x {sh['group']} samples, "
                     f"{sh['tokens']} new tokens; seeds {seeds}")
        lines.append(f"{'arm':>18} {'runs':>4} {'s/step':>15} {'generation':>15} {'training':>15} {'push':>15}"
                     + (f" {'T=1 after':>15} {'gain':>15} {'greedy after':>15}" if size in base_eval else ""))
        per_arm: dict[str, float] = {}
        gains: dict[str, list[float]] = {}
        for arm in dict.fromkeys(r["arm"] for r in rs):
            ar = [r for r in rs if r["arm"] == arm]
            per_arm[arm] = _mean([r["means"]["step_s"] for r in ar])
            cells = [_fmt([r["means"][k] for r in ar]) for k in ("step_s", "generate_s", "train_s", "push_s")]
            if arm == "trl":
                cells[3] = "-"
            row = f"{LABELS[arm]:>18} {len(ar):4d} " + " ".join(f"{c:>15}" for c in cells)
            if size in base_eval:
                gains[arm] = [r["eval_after"]["t1"] - base_eval[size]["t1"] for r in ar]
                row += (f" {_fmt([r['eval_after']['t1'] for r in ar]):>15} {_fmt(gains[arm]):>15} "
                        f"{_fmt([r['eval_after']['greedy'] for r in ar]):>15}")
            lines.append(row)
        if size in base_eval:
            b = base_eval[size]
            lines.append(f"eval before (initial model, every arm): T=1 {b['t1']:.3f}, greedy {b['greedy']:.3f}")
        if "trl" in per_arm:
            for arm, goal in GOALS.items():
                if arm in per_arm:
                    ratio = per_arm[arm] / per_arm["trl"]
                    paired = seed_ratios(rs, arm)
                    verdict = "met" if ratio <= goal else "missed"
                    if ratio > goal and len(paired) > 1 and ratio - goal <= _sd(paired):
                        verdict = (f"missed by {ratio - goal:.2f}, less than the per-seed ratios' sd "
                                   f"{_sd(paired):.2f}: level with the goal within this machine's run-to-run spread")
                    lines.append(f"ratio of mean s/step {LABELS[arm]} / TRL: {ratio:.2f}  (goal <= {goal:.1f}: "
                                 f"{verdict})")
                    if len(paired) > 1:
                        lines.append("  per seed (each run / the TRL run of its seed): "
                                     + " / ".join(f"{x:.2f}" for x in paired) + f", mean {_fmt(paired, 2)}")
                    if ratio > goal:
                        lines.append("  what bounds it: " + bound(arm, goal, rs, per_arm["trl"]))
            if gains.get("trl") and len(gains["trl"]) > 1:
                for arm in (a for a in GOALS if a in gains):
                    spread = max(_sd(gains[arm]), _sd(gains["trl"]))
                    diff = _mean(gains[arm]) - _mean(gains["trl"])
                    lines.append(f"learning {LABELS[arm]} - TRL: gain difference {diff:+.3f}, the seeds' spread "
                                 f"(larger sd) {spread:.3f}  (goal |difference| <= spread: "
                                 f"{'met' if abs(diff) <= spread else 'missed'})")
    return lines


def seed_ratios(runs: list[dict], arm: str) -> list[float]:
    """The arm's s/step over TRL's, seed by seed (at size tiny the arms of a seed run one after the other, so a slow
    spell of the machine hits both sides of a pair more alike than two seeds apart); seeds without both runs are
    left out."""
    trl = {r["seed"]: r["means"]["step_s"] for r in runs if r["arm"] == "trl"}
    return [r["means"]["step_s"] / trl[r["seed"]] for r in runs if r["arm"] == arm and r["seed"] in trl]


def bound(arm: str, goal: float, runs: list[dict], trl_step: float) -> str:
    """Why an arm missed its goal, from the measured parts (means over the size's runs)."""
    def part(a: str, k: str) -> float:
        return _mean([r["means"][k] for r in runs if r["arm"] == a])

    gen, train, push = part(arm, "generate_s"), part(arm, "train_s"), part(arm, "push_s")
    if arm == "async" and train > goal * trl_step:
        # a step can end no sooner than its update, which here runs on the cores left by the overlapping sampler
        return (f"the trainer's update alone takes {train:.3f} s/step in this arm = {train / trl_step:.2f}x TRL's "
                f"whole step (goal {goal:.1f}x): the update runs on the cores generation leaves it; a step cannot be "
                f"shorter than its update, so the goal needs more cores or a faster update")
    if arm == "async":
        return (f"generation {gen:.3f} and training {train:.3f} s/step overlap on the same cores (push {push:.3f}); "
                f"the step is {part(arm, 'step_s'):.3f}")
    if "trl" not in {r["arm"] for r in runs}:
        return f"generation {gen:.3f} + training {train:.3f} + push {push:.3f}"
    return (f"generation {gen:.3f} vs TRL's {part('trl', 'generate_s'):.3f}, training {train:.3f} vs TRL's "
            f"{part('trl', 'train_s'):.3f}, push {push:.3f} (TRL has none: it generates with the policy itself)")


def _sd(xs: list[float]) -> float:
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0


def prepare_model(args: argparse.Namespace, size: str) -> tuple[Path, list[str]]:
    """The model dir of a size (under the data dir: the trainer reads models only there) and the compose files of
    its stack (an override that makes the rollout service serve it, for 0.5b)."""
    base = REPO_ROOT / "compose.yaml"
    if size == "tiny":
        return args.data_dir / "models" / "tiny", [str(base)]  # installed by the stack's one-shot `model` service
    from forkrl.models.random_qwen2 import build_random_qwen2

    model = build_random_qwen2(args.data_dir / "models" / "qwen2-0.5b", "0.5b")
    override = args.data_dir / "compose.qwen2-0.5b.yaml"
    override.write_text(json.dumps({"services": {  # JSON is YAML
        "rollout": {"command": ["python", "-m", "rollout_service", "--model", str(model),
                                "--host", "${FORKRL_HOST:-127.0.0.1}", "--port", "${ROLLOUT_PORT:-50051}"],
                    "environment": {"FORKRL_MODEL_DIR": str(model)}},
        "trainer": {"environment": {"FORKRL_MODEL_DIR": str(model)}}}}, indent=1))
    return model, [str(base), str(override)]


def free_ports() -> dict[str, str]:
    """ROLLOUT_PORT and TRAINER_PORT of the stack (compose.yaml's variables): ports free now, so that the bench
    runs next to another stack or a test run (compose.yaml's defaults would collide)."""
    import socket

    socks = [socket.socket() for _ in range(2)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return {"ROLLOUT_PORT": str(socks[0].getsockname()[1]), "TRAINER_PORT": str(socks[1].getsockname()[1])}
    finally:
        for s in socks:
            s.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report:
        data = json.loads(args.report.read_text())
        print("\n".join(report(data["results"], data["base_eval"])))
        return 0
    from clients.stack import Stack
    from forkrl.remote.channel import grpc_channel
    from forkrl.wire.trainer.v1 import trainer_pb2_grpc

    results: list[dict] = []
    base_eval: dict[str, dict] = {}
    print(f"bench_peers: TRL {trl_version()}, device {args.device}, {os.cpu_count()} cores, arms "
          f"{' '.join(args.arms)}, sizes {' '.join(args.sizes)}, seeds {' '.join(map(str, args.seeds))}", flush=True)

    def run_arms(arms: list[str], stub, stack) -> None:  # noqa: ANN001
        for seed in args.seeds:  # seeds outer: an interrupted bench has every arm on its first seeds
            for arm in arms:
                results.append(run_one(stub, stack, args, size, model, arm, seed))
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                "base_eval": base_eval, "results": results}, indent=1))

    try:
        for size in args.sizes:
            model, compose = prepare_model(args, size)
            forkrl_arms = [a for a in args.arms if a != "trl"]
            # tiny: the arms interleaved, each seen under the same load of the machine; 0.5b: TRL after the services
            # stop (each side holds a 0.5B model with its gradients and AdamW state)
            later = [] if size == "tiny" or not forkrl_arms else [a for a in args.arms if a == "trl"]
            with Stack(data_dir=args.data_dir, services=["rollout", "trainer"] if forkrl_arms else ["model"],
                       compose_files=compose, echo=False,
                       env=free_ports()) as stack:
                stub = (trainer_pb2_grpc.TrainerServiceStub(grpc_channel(stack.addresses["trainer"],
                                                                         token=stack.token))
                        if forkrl_arms else None)
                if size == "tiny":
                    base_eval[size] = evaluate_model(model, args.eval_prompts, max_new_tokens=args.max_new_tokens,
                                                     device=args.device)
                run_arms([a for a in args.arms if a not in later], stub, stack)
            run_arms(later, None, None)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    print("\n".join(report(results, base_eval)))
    print(f"\nresults: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
