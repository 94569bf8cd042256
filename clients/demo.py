"""The whole loop in one command on the embedded default: build, serve, train with the mask, probe, report.

    python clients/demo.py                  # what `bash scripts/demo.sh` runs after setting up the venv
    python clients/demo.py --seed 1 --num-steps 100 --entropy-top-frac 1.0

1. copies the embedded tiny model (committed in forkrl/models/default, or $FORKRL_MODEL_DIR) into the data dir,
2. starts the three services with the local launcher (the same commands as compose.yaml),
3. runs `clients/start_run.py --entropy-top-frac 0.2` (progress bar, checkpoints every --save-every steps),
4. POSTs a probe of two of its checkpoints (`?wait=true`),
5. prints eval accuracy before → after with the gain's paired bootstrap 95% interval over eval prompts, reward
   first → last steps, what the mask keeps by answer-token class
   (choice / computed / copied / separator / EOS), and grad_norm by entropy bin,
6. writes the run's training curve (eval accuracy and reward vs step) to <run dir>/training_curve.png,
7. stops every service (also on Ctrl-C or an error), and ends with the path of the run's HTML report
   (<run dir>/report.html, written by the trainer: the tokens the mask keeps, coloured by entropy, and the curves)
   and of the probe's (GET /probe/{id}/report, kept in the job's dir).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python clients/demo.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--num-steps", type=int, default=200, help="RL steps")
    p.add_argument("--entropy-top-frac", type=float, default=0.2, help="forking-token fraction (1.0 = all tokens)")
    p.add_argument("--prompts-per-step", type=int, default=32, help="prompts per step")
    p.add_argument("--group-size", type=int, default=8, help="samples per prompt")
    p.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate")
    p.add_argument("--eval-prompts", type=int, default=512,
                   help="eval-split prompts for before/after accuracy (and the bootstrap interval of the gain)")
    p.add_argument("--eval-every", type=int, default=50, help="also evaluate every N steps (the curve's points)")
    p.add_argument("--data-dir", type=Path, default=REPO_ROOT / "runs" / "demo",
                   help="where the stack keeps its model, runs and probe jobs")
    p.add_argument("--seed", type=int, default=0, help="run seed")
    return p.parse_args(argv)


def _post_probe(url: str, body: dict, timeout_s: float, token: str | None) -> tuple[dict, str]:
    """The finished job's summary, and its URL (the Location header)."""
    import httpx

    from forkrl.remote.channel import http_headers, http_verify

    resp = httpx.post(f"{url}/probe", params={"wait": "true"}, json=body, timeout=timeout_s,
                      headers=http_headers(token), verify=http_verify())  # FORKRL_TLS_CA when set
    if resp.status_code != 200:
        raise RuntimeError(f"probe failed: HTTP {resp.status_code}: {resp.text[:2000]}")
    return resp.json(), resp.headers["location"]


def _get_probe_report(job_url: str, token: str | None) -> None:
    """GET the job's report once: the service renders it and keeps it in the job's dir (report.html)."""
    import httpx

    from forkrl.remote.channel import http_headers, http_verify

    resp = httpx.get(f"{job_url}/report", timeout=300, headers=http_headers(token), verify=http_verify())
    if resp.status_code != 200:
        raise RuntimeError(f"probe report failed: HTTP {resp.status_code}: {resp.text[:2000]}")


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) if j else c.ljust(w) for j, (c, w) in enumerate(zip(r, widths, strict=True)))
             for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def class_table(train: list[dict]) -> list[str]:
    """What the mask keeps by answer-token class (mean over the run's steps), when the task labels its tokens."""
    from forkrl.report.data import mean_class_breakdown

    shares = mean_class_breakdown(train)
    if not shares:
        return []
    rows = [["token class", "share of all tokens", "share of kept tokens", "kept rate"]]
    rows += [[c, f"{v['all']:.3f}", f"{v['kept']:.3f}", "-" if v["rate"] is None else f"{v['rate']:.3f}"]
             for c, v in shares.items()]
    return ["", "Kept tokens by class (mean over steps; kept rate = kept / tokens of the class)", _table(rows)]


def gain_line(gain: dict | None) -> str:
    """The eval gain with its paired bootstrap interval over eval prompts (forkrl/training/curves.py)."""
    if gain is None:
        return "eval gain: no per-prompt evaluations (eval_prompts.jsonl) to bootstrap"
    return (f"eval accuracy gain (T=1): {gain['mean']:+.3f}  95% CI [{gain['lo']:+.3f}, {gain['hi']:+.3f}]  "
            f"({gain['before']:.3f} -> {gain['after']:.3f}, step {gain['step_before']} -> {gain['step_after']}; "
            f"paired bootstrap over {gain['n_prompts']} eval prompts, {gain['draws']} draws)")


def report(run_dir: Path, summary: dict, probe_dir: Path | None, curve: Path | None = None) -> str:
    from forkrl.training.curves import eval_gain, read_metrics

    lines = read_metrics(run_dir)
    evals = [m for m in lines if m["kind"] == "eval"]
    train = [m for m in lines if m["kind"] == "train"]
    out = []
    k = max(1, len(train) // 10)
    first, last = train[:k], train[-k:]

    def avg(ms: list[dict], key: str) -> float:
        return sum(m[key] for m in ms) / len(ms)

    rows = [["metric", "before", "after"]]
    if len(evals) >= 2:
        rows.append(["eval accuracy (T=1, 4 samples/prompt)", f"{evals[0]['eval_accuracy']:.3f}",
                     f"{evals[-1]['eval_accuracy']:.3f}"])
        rows.append(["eval accuracy (greedy)", f"{evals[0]['eval_greedy_accuracy']:.3f}",
                     f"{evals[-1]['eval_greedy_accuracy']:.3f}"])
    rows.append([f"train reward (mean of first/last {k} steps)", f"{avg(first, 'reward_mean'):.3f}",
                 f"{avg(last, 'reward_mean'):.3f}"])
    rows.append(["kept fraction of response tokens", f"{avg(first, 'kept_frac'):.3f}", f"{avg(last, 'kept_frac'):.3f}"])
    rows.append(["mean token entropy (nats)", f"{avg(first, 'entropy_mean'):.3f}", f"{avg(last, 'entropy_mean'):.3f}"])
    out += ["", "Training", _table(rows), gain_line(eval_gain(run_dir))]
    out += class_table(train)

    results = summary.get("results", [])
    if results:
        down = [r for r in results if "down_proj" in r["target"]]  # last layer's down_proj if probed
        target = max(down, key=lambda r: r["layer"])["target"] if down else results[0]["target"]
        ckpts = [c["label"] for c in summary["checkpoints"]]
        bins = sorted({r["bin"] for r in results})
        header = ["entropy bin"] + [f"{c} {'ok' if ok else 'wrong'}" for c in ckpts for ok in (True, False)]
        rows = [header]
        for b in bins:
            row = [f"{b} ({'low' if b == 0 else 'high' if b == bins[-1] else 'mid'})"]
            for c in ckpts:
                for ok in (True, False):
                    cell = [r for r in results if r["checkpoint"] == c and r["bin"] == b and r["correct"] == ok
                            and r["target"] == target]
                    med = cell[0]["grad_norm"]["median"] if cell and cell[0].get("grad_norm") else None
                    row.append("-" if med is None else f"{med:.3g}")
            rows.append(row)
        out += ["", f"Probe: median per-token grad norm of {target} rows by entropy bin x correctness",
                _table(rows)]
    out += ["", f"run dir:     {run_dir}", f"metrics:     {run_dir / 'metrics.jsonl'} (TensorBoard: {run_dir / 'tb'})",
            f"checkpoints: {run_dir / 'checkpoints'}"]
    if probe_dir is not None:
        out += [f"probe:       {probe_dir} (summary.json, token_probe_records.jsonl, manifest.json, report.html)"]
        out += [f"plot:        {p}" for p in sorted(probe_dir.glob("*.png"))]
    if curve is not None:
        out += [f"curve:       {curve} (eval accuracy and train reward vs step)"]
    return "\n".join(out)


def engine_line(address: str, token: str | None) -> str:
    """What generates, from the rollout service's GetInfo: the demo's log names the engine that ran."""
    from forkrl.remote.rollout import RolloutClient

    with RolloutClient(address, token=token, timeout_s=60) as c:
        e = c.info().engine
    return f"[demo] rollout engine: {e.backend} {e.vllm_version} on {e.device}, {e.dtype}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from clients.stack import Stack
    from forkrl.models.embedded import COMMITTED_DIR, install_default
    from forkrl.models.tiny import build_tiny_model, default_model_dir, read_build_record

    data = args.data_dir.resolve()
    t0 = time.monotonic()
    shared = default_model_dir()
    # where the stack's one-shot `model` service installs it (compose.yaml); a copy (small), not a symlink: the
    # probe only reads inside its allowed root
    model_dir = data / "models" / "tiny"
    if shared.resolve() != COMMITTED_DIR and read_build_record(shared) is None:
        print(f"[demo] building the tiny model into FORKRL_MODEL_DIR={shared}", flush=True)
        build_tiny_model(shared)
    print(f"[demo] the embedded tiny model: {shared} -> {model_dir}", flush=True)
    install_default(model_dir, shared)  # what the stack's `model` service does too (then at once)
    run_dir = data / "runs" / time.strftime("demo-%Y%m%d-%H%M%S")
    save_every = max(1, args.num_steps // 2)
    print(f"[demo] starting rollout, trainer and probe (their logs: {data / 'logs'}/<service>.log)", flush=True)
    with Stack(data_dir=data, echo="launch") as stack:
        addr = stack.addresses
        print(f"[demo] stack up after {time.monotonic() - t0:.0f}s: {addr}", flush=True)
        print(engine_line(addr["rollout"], stack.token), flush=True)
        cmd = [sys.executable, str(REPO_ROOT / "clients" / "start_run.py"),
               "--entropy-top-frac", str(args.entropy_top_frac), "--num-steps", str(args.num_steps),
               "--prompts-per-step", str(args.prompts_per_step), "--group-size", str(args.group_size),
               "--lr", str(args.lr), "--save-every", str(save_every), "--eval-prompts", str(args.eval_prompts),
               "--eval-every", str(args.eval_every),
               "--seed", str(args.seed), "--run-dir", str(run_dir), "--model", str(model_dir),
               "--rollout-addresses", addr["rollout"], "--trainer-address", addr["trainer"]]
        print("[demo] $ " + " ".join(cmd[1:]), flush=True)
        rc = subprocess.run(cmd, env={**stack.client_env(), "PYTHONUNBUFFERED": "1"}).returncode
        if rc != 0:
            print(f"[demo] training failed (exit {rc})", file=sys.stderr)
            return rc
        body = {"checkpoint_root": str(run_dir / "checkpoints"), "steps": [save_every], "include_final": True,
                "model": str(model_dir), "num_prompts": 16, "num_samples": 8, "seed": args.seed,
                # the settings of the demo's probe table (docs/results.md): 32 random rows, 64 positions per
                # cell (at most 4 per trajectory), rank bins per checkpoint
                "row_spec": ["random:32"], "max_positions_per_group": 64, "max_positions_per_trajectory": 4,
                "freeze_bins_from": "none", "bootstrap": 0}
        print(f"[demo] $ curl -X POST '{addr['probe']}/probe?wait=true' -H 'content-type: application/json' "
              f"-d '{json.dumps(body)}'", flush=True)
        t_probe = time.monotonic()
        summary, job_url = _post_probe(addr["probe"], body, timeout_s=900, token=stack.token)
        print(f"[demo] probe done in {time.monotonic() - t_probe:.0f}s", flush=True)
        _get_probe_report(job_url, stack.token)
        jobs = [p for p in (data / "probe_jobs").glob("*") if (p / "summary.json").is_file()]
        probe_dir = max(jobs, key=lambda p: p.stat().st_mtime) if jobs else None
    from forkrl.training.curves import plot_run_curve, read_metrics

    curve = plot_run_curve(run_dir / "training_curve.png", read_metrics(run_dir),
                           title=f"demo: top {args.entropy_top_frac:.0%} mask, seed {args.seed}")
    print(report(run_dir, summary, probe_dir, curve))
    print(f"\n[demo] total {time.monotonic() - t0:.0f}s; all services stopped")
    if probe_dir is not None and (probe_dir / "report.html").is_file():
        print(f"[demo] the probe's report:  {probe_dir / 'report.html'}")
    # the trainer wrote it at each evaluation and at the end: the forking tokens, what the mask keeps, the curves
    print(f"[demo] the run's report (open it in a browser): {run_dir / 'report.html'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
