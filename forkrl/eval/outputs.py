"""What `python -m forkrl.eval` writes and prints: eval_results.json (settings, every benchmark x checkpoint row,
every problem's per-sample rewards, answers and lengths), samples.jsonl (every completion's text), the paper-style
table (benchmark x checkpoint, one metric per table) and avg_vs_step.png; optionally the same numbers to
metrics.jsonl / TensorBoard / W&B through the training's MetricsSink."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import IO, Any

from forkrl.data.tasks import Problem
from forkrl.eval.metrics import ProblemResult

RESULTS = "eval_results.json"
SAMPLES = "samples.jsonl"
PLOT = "avg_vs_step.png"


def problem_record(bench: str, label: str, index: int, problem: Problem, r: ProblemResult, ks: list[int],
                   with_maj: bool) -> dict[str, Any]:
    return {"benchmark": bench, "checkpoint": label, "index": index, "prompt": problem.prompt, "gold": problem.answer,
            "rewards": r.rewards, "answers": r.answers, "response_lens": r.lengths, "truncated": r.truncated,
            "n": len(r.rewards), "correct": sum(r.correct),
            "metrics": r.metrics(ks, with_maj) if r.gradable else None}


def write_samples(f: IO[str], bench: str, label: str, index: int, r: ProblemResult) -> None:
    for g, (text, reward) in enumerate(zip(r.extra.get("texts", []), r.rewards, strict=True)):
        f.write(json.dumps({"benchmark": bench, "checkpoint": label, "index": index, "sample": g, "reward": reward,
                            "text": text}) + "\n")


def summary(plan: Any, results: dict[str, dict[str, Any]], counters: dict[str, dict[str, int]],
            problems: list[dict[str, Any]]) -> dict[str, Any]:
    p = plan.params
    return {
        "settings": {
            "prompt_format": plan.prompt_format, "system_prompt": plan.system_prompt, "reward": plan.reward,
            "num_samples": p.num_samples, "k": plan.ks, "temperature": plan.temperature, "top_p": p.top_p,
            "max_new_tokens": plan.max_new_tokens, "seed": p.seed, "sampler": p.sampler,
            "run_config": plan.run_config, "max_problems": p.max_problems,
        },
        "checkpoints": [{"label": c.label, "path": str(c.path), "step": c.step} for c in plan.checkpoints],
        "benchmarks": [{"name": b.name, "path": b.path, "n_problems": len(b.problems)} for b in plan.benchmarks],
        "results": results,
        "reward_counters": counters,
        "notes": plan.notes,
        "problems": problems,
    }


def write_json(path: Path, data: dict[str, Any]) -> None:
    from forkrl.files import atomic_write

    atomic_write(path, json.dumps(data, indent=1, allow_nan=False).encode())


def table(summary: dict[str, Any], metric: str, percent: bool = True) -> str:
    """The paper's layout: one row per benchmark (and their average), one column per checkpoint, `metric` in %."""
    labels = [c["label"] for c in summary["checkpoints"]]
    names = [b["name"] for b in summary["benchmarks"]]
    scale = 100.0 if percent else 1.0

    def cell(v: Any) -> str:
        return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{scale * v:.1f}"

    width = max(len(metric) + 4, *(len(n) for n in names), len("average"))
    cols = [max(len(lbl), 6) for lbl in labels]
    lines = [f"{metric + (' (%)' if percent else ''):<{width}}  " + "  ".join(f"{lbl:>{w}}" for lbl, w in
                                                                              zip(labels, cols, strict=True))]
    rows = [[summary["results"][n][lbl].get(metric) for lbl in labels] for n in names]
    for n, row in zip(names, rows, strict=True):
        lines.append(f"{n:<{width}}  " + "  ".join(f"{cell(v):>{w}}" for v, w in zip(row, cols, strict=True)))
    if len(names) > 1:
        means = [None if any(r[j] is None for r in rows) else sum(r[j] for r in rows) / len(rows)
                 for j in range(len(labels))]
        lines.append(f"{'average':<{width}}  " + "  ".join(f"{cell(v):>{w}}" for v, w in zip(means, cols,
                                                                                             strict=True)))
    return "\n".join(lines)


def plot_avg_vs_step(path: Path, summary: dict[str, Any]) -> None:
    """avg@n of every benchmark against the checkpoints' steps (those with a known step)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = summary["settings"]["num_samples"]
    points = sorted((c["step"], c["label"]) for c in summary["checkpoints"] if c["step"] is not None)
    fig, ax = plt.subplots(figsize=(6, 4))
    for b in summary["benchmarks"]:
        ys = [summary["results"][b["name"]][lbl].get(f"avg@{n}") for _, lbl in points]
        xs = [s for (s, _), y in zip(points, ys, strict=True) if y is not None]
        ax.plot(xs, [100 * y for y in ys if y is not None], marker="o", label=b["name"])
    ax.set_xlabel("step")
    ax.set_ylabel(f"avg@{n} (%)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def log_results(out: Path, summary: dict[str, Any], log_to: list[str], project: str, name: str) -> None:
    """metrics.jsonl (kind "eval", `<benchmark>/<metric>` at each checkpoint's step) and, with tensorboard / wandb,
    the same scalars plus one benchmark x checkpoint table per metric."""
    from forkrl.training.loggers import WandbLog
    from forkrl.training.metrics import MetricsSink

    loggers = [WandbLog(out, project=project, name=name, config=summary["settings"])] if "wandb" in log_to else []
    sink = MetricsSink(out, tensorboard="tensorboard" in log_to, loggers=loggers)
    try:
        labels = [c["label"] for c in summary["checkpoints"]]
        for c in summary["checkpoints"]:
            if c["step"] is None:
                continue
            values = {f"{b}/{k}": v for b, row in summary["results"].items() for k, v in row[c["label"]].items()
                      if isinstance(v, (int, float))}
            sink.write(c["step"], values, kind="eval")
        metrics = [k for k in next(iter(next(iter(summary["results"].values())).values())) if "@" in k]
        for metric in metrics:
            rows = [[b, *(summary["results"][b][lbl].get(metric) for lbl in labels)] for b in summary["results"]]
            sink.write_table(f"eval/{metric}", ["benchmark", *labels], rows)
    finally:
        sink.close()
