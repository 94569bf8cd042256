"""A run's numbers after the fact: the paired bootstrap interval of the eval gain, and the curves as PNGs.

    lines = read_metrics(run_dir)                                   # metrics.jsonl as dicts
    gain = eval_gain(run_dir)                                       # first -> last eval, per prompt, paired
    gain = paired_bootstrap(before, after, draws=2000, seed=0)     # {"mean", "lo", "hi", "n_prompts", ...}
    plot_run_curve(path, lines)                                     # eval accuracy and reward vs step, one run
    plot_arm_curves(path, {"top 20%": [curve_seed0, ...], ...})     # eval accuracy vs step, band across seeds

The gain of a run is a paired statistic: the same eval prompts are scored before and after (`eval_prompts.jsonl`,
each prompt's accuracy at every evaluation, forkrl/training/metrics.py). The bootstrap resamples *prompts* with
replacement, keeping each prompt's (before, after) pair together, and takes the 2.5% and 97.5% percentiles of
the resampled mean difference. It measures how much the gain depends on which prompts were drawn; the sampling
noise of the 4 samples per prompt is inside each prompt's value, the run-to-run (seed) spread is not — that is
what several seeds show.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from forkrl.training.metrics import EVAL_PROMPTS_FILE

__all__ = ["eval_gain", "mean_sd", "paired_bootstrap", "plot_arm_curves", "plot_run_curve", "read_metrics"]


def read_metrics(run_dir: Path) -> list[dict]:
    """The run's metrics.jsonl lines (train and eval), in file order."""
    return [json.loads(s) for s in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if s.strip()]


def paired_bootstrap(before: Sequence[float], after: Sequence[float], *, draws: int = 2000, seed: int = 0,
                     level: float = 0.95) -> dict[str, float]:
    """Mean of after − before over prompts and its bootstrap interval (module docstring). Draw b picks n prompt
    indices uniformly with replacement (numpy Generator seeded with `seed`) and averages their differences; the
    interval is the (1−level)/2 and (1+level)/2 quantiles (linear interpolation) of the draws."""
    b, a = np.asarray(before, dtype=np.float64), np.asarray(after, dtype=np.float64)
    if b.shape != a.shape or b.ndim != 1 or b.size == 0:
        raise ValueError(f"paired_bootstrap: before and after must be equal-length non-empty 1-d, got "
                         f"{b.shape} and {a.shape}")
    if draws < 1:
        raise ValueError(f"paired_bootstrap: draws must be >= 1, got {draws}")
    d = a - b
    idx = np.random.default_rng(seed).integers(0, d.size, size=(draws, d.size))
    means = d[idx].mean(axis=1)
    q = (1 - level) / 2
    lo, hi = np.quantile(means, [q, 1 - q])
    return {"mean": float(d.mean()), "lo": float(lo), "hi": float(hi), "n_prompts": int(d.size),
            "before": float(b.mean()), "after": float(a.mean()), "draws": draws}


def eval_gain(run_dir: Path, key: str = "eval_accuracy", **kw: float) -> dict[str, float] | None:
    """paired_bootstrap of the first vs the last evaluation of a run (per prompt, from eval_prompts.jsonl);
    None when the run has fewer than two evaluations with per-prompt values."""
    path = Path(run_dir) / EVAL_PROMPTS_FILE
    if not path.is_file():
        return None
    evals = [e for e in (json.loads(s) for s in path.read_text().splitlines() if s.strip()) if key in e]
    if len(evals) < 2:
        return None
    return paired_bootstrap(evals[0][key], evals[-1][key], **kw) | {"step_before": evals[0]["step"],
                                                                    "step_after": evals[-1]["step"]}


def _save(fig, path: Path) -> Path:  # noqa: ANN001 (matplotlib Figure)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fig.savefig(tmp, format="png", dpi=90)
    tmp.replace(path)
    return path


def plot_run_curve(path: Path, lines: Sequence[Mapping], title: str = "") -> Path:
    """One run: eval accuracy (T=1 and greedy) vs step on the left axis, train reward (mean per step, and a
    moving average over ~10% of the steps) on the right one. `lines`: metrics.jsonl dicts."""
    from matplotlib.figure import Figure  # no pyplot: no global state

    evals = [m for m in lines if m.get("kind") == "eval" and "eval_accuracy" in m]
    train = [m for m in lines if m.get("kind") == "train" and "reward_mean" in m]
    fig = Figure(figsize=(6.4, 3.6), layout="constrained")
    ax = fig.subplots()
    if evals:
        ax.plot([e["step"] for e in evals], [e["eval_accuracy"] for e in evals], "o-", color="tab:blue",
                label="eval accuracy (T=1)")
        if all("eval_greedy_accuracy" in e for e in evals):
            ax.plot([e["step"] for e in evals], [e["eval_greedy_accuracy"] for e in evals], "s--",
                    color="tab:purple", label="eval accuracy (greedy)")
    if train:
        steps, rew = [m["step"] for m in train], [m["reward_mean"] for m in train]
        ax.plot(steps, rew, color="tab:orange", alpha=0.3, lw=0.8, label="train reward (per step)")
        k = max(1, len(rew) // 10)
        smooth = [sum(rew[max(0, i - k + 1):i + 1]) / (i + 1 - max(0, i - k + 1)) for i in range(len(rew))]
        ax.plot(steps, smooth, color="tab:orange", lw=1.8, label=f"train reward ({k}-step mean)")
    ax.set_xlabel("step")
    ax.set_ylabel("accuracy / reward")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    if evals or train:
        ax.legend(fontsize=7, loc="upper left")
    if title:
        ax.set_title(title, fontsize=9)
    return _save(fig, path)


def plot_arm_curves(path: Path, arms: Mapping[str, Sequence[Sequence[tuple[int, float]]]], title: str = "",
                    ylabel: str = "eval accuracy (T=1)") -> Path:
    """Several arms, several seeds each: arms[name] = one curve [(step, value), ...] per seed. Draws the mean
    over seeds at each step and a band of ± one sample sd (min..max with 2 seeds; no band with 1), at the
    steps every seed of the arm has."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 3.8), layout="constrained")
    ax = fig.subplots()
    colors = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown")
    for i, (name, curves) in enumerate(arms.items()):
        curves = [dict(c) for c in curves if c]
        if not curves:
            continue
        steps = sorted(set.intersection(*(set(c) for c in curves)))
        vals = np.array([[c[s] for s in steps] for c in curves], dtype=np.float64)  # [seeds, steps]
        mean = vals.mean(axis=0)
        color = colors[i % len(colors)]
        ax.plot(steps, mean, "o-", color=color, label=f"{name} (n={len(curves)})")
        if len(curves) == 2:
            ax.fill_between(steps, vals.min(axis=0), vals.max(axis=0), color=color, alpha=0.2)
        elif len(curves) > 2:
            sd = vals.std(axis=0, ddof=1)
            ax.fill_between(steps, mean - sd, mean + sd, color=color, alpha=0.2)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if any(arms.values()):
        ax.legend(fontsize=7)
    if title:
        ax.set_title(title, fontsize=9)
    return _save(fig, path)


def mean_sd(xs: Sequence[float]) -> tuple[float, float]:
    """Mean and sample sd (ddof 1; 0.0 for a single value, NaN for none)."""
    if not xs:
        return math.nan, math.nan
    m = sum(xs) / len(xs)
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    return m, sd
