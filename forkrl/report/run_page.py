"""The run report: one self-contained HTML page per run, from the run dir's files only.

    path = write_run_report(run_dir)          # <run_dir>/report.html (also: python -m forkrl.report RUN_DIR)
    html = render_run_report(run_dir)

What it shows (each from a file the run wrote):
- what the mask keeps by answer-token class (metrics.jsonl `kept_share_<class>`, `all_share_<class>`: the table the
  demo prints) and those shares over the steps;
- the recorded eval responses (eval_samples/, forkrl/report/record.py) at each eval step, every token coloured by
  its entropy, the kept (top-rho) tokens outlined, a tooltip with its entropy, log-prob and class;
- the most frequent kept tokens over the run (a ranked list and a word cloud) and how they moved from the first
  eval to the last; the entropy histogram of each eval step (log-spaced bins, log scale);
- the learning curves (metrics.jsonl): reward and accuracy, entropy and its quantiles, kept fraction, clip
  fractions, ratio, KL and log-prob drift, loss and gradient norm, step time by phase, response length.
The page is rendered with Jinja2 (forkrl/report/templates/) and holds its charts as inline SVG: it loads nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from forkrl.files import atomic_write
from forkrl.report.charts import Chart, Series, bar_chart, histogram_chart, line_chart
from forkrl.report.data import (
    SAMPLED_RESPONSES,
    SHOWN_RESPONSES,
    RunData,
    kept_ranking,
    mean_class_breakdown,
    rank_moves,
    read_run,
)
from forkrl.report.render import class_color, entropy_scale, render

__all__ = ["REPORT_FILE", "render_run_report", "run_context", "write_run_report"]

REPORT_FILE = "report.html"
TOP_RANKED = 30  # rows of the kept-token table; the cloud shows as many
MAX_PAGE_EVALS = 12  # eval steps whose responses the page shows token by token: the first, the last, spread between

# (chart id, title, y label, [(kind, metric or "prefix*", label)], options): a series per metric present
CURVES: list[tuple[str, str, str, list[tuple[str, str, str]], dict[str, Any]]] = [
    ("reward", "Reward and accuracy", "reward / accuracy",
     [("train", "reward_mean", "train reward"), ("train", "accuracy", "train accuracy"),
      ("eval", "eval_accuracy", "eval accuracy (T)"), ("eval", "eval_greedy_accuracy", "eval accuracy (greedy)"),
      ("eval", "eval_accuracy_*", "")], {}),
    ("entropy", "Token entropy of the training batches (nats)", "entropy (nats), log",
     [("train", "entropy_mean", "mean"), ("train", "entropy_kept_mean", "mean over kept tokens"),
      ("train", "entropy_p*", ""), ("train", "mask_threshold", "mask threshold")], {"logy": True}),
    ("kept", "Kept fraction of response tokens", "kept / response tokens",
     [("train", "kept_frac", "kept fraction")], {"ylim": (0.0, 1.05)}),
    ("clip", "Clip fractions (of kept tokens)", "fraction", [("train", "clip_frac*", "")], {}),
    ("ratio", "Importance ratio", "ratio",
     [("train", "ratio_mean", "mean"), ("train", "ratio_min", "min"), ("train", "ratio_max", "max")], {}),
    ("kl", "KL and trainer-vs-rollout log-prob drift", "nats, log",
     [("train", "approx_kl_start", "approx KL at update start (kept)"),
      ("train", "approx_kl", "approx KL (kept)"), ("train", "approx_kl_all", "approx KL (all)"),
      ("train", "kl_loss", "KL loss"), ("train", "logp_delta_*", "")], {"logy": True}),
    ("loss", "Loss and gradient norm", "value",
     [("train", "loss", "loss"), ("train", "pg_loss", "policy-gradient loss"), ("train", "grad_norm", "grad norm"),
      ("train", "grad_norm_max", "grad norm (max)")], {}),
    ("time", "Step time by phase (s)", "seconds, log",
     [("train", "time_step_s", "whole step"), ("train", "time_generate_s", "generate"),
      ("train", "time_score_s", "score"), ("train", "time_train_s", "train"), ("train", "time_push_s", "push"),
      ("train", "time_wait_s", "wait for samples"), ("train", "swap_drain_s", "rollout drain"),
      ("train", "swap_apply_s", "rollout apply"), ("eval", "time_eval_s", "eval"),
      ("eval", "time_eval_samples_s", "eval sample (report)")], {"logy": True}),
    ("length", "Response length (tokens)", "tokens", [("train", "response_len_mean", "mean response length")], {}),
]


def _series(lines: Sequence[dict], kind: str, pattern: str, label: str, style: str) -> list[Series]:
    keys = sorted({k for m in lines for k in m if k.startswith(pattern[:-1])}) if pattern.endswith("*") \
        else [pattern]
    out = []
    for key in keys:
        pts = [(m["step"], m[key]) for m in lines if isinstance(m.get(key), int | float)]
        if pts:
            out.append(Series(key, label or key.replace("_", " "), [p[0] for p in pts], [p[1] for p in pts],
                              style="--" if kind == "eval" else style))
    return out


def curves(run: RunData) -> list[Chart]:
    charts = []
    for chart_id, title, ylabel, specs, opts in CURVES:
        series = [s for kind, pattern, label in specs
                  for s in _series(run.train if kind == "train" else run.evals, kind, pattern, label, "-")]
        chart = line_chart(chart_id, title, series, ylabel, **opts)
        if chart is not None:
            charts.append(chart)
    return charts


def class_section(run: RunData) -> dict[str, Any] | None:
    """What the mask keeps by class: the table (mean over steps), a bar chart of it, the shares over steps, and a
    sentence saying what they show; None when the task labels no classes."""
    shares = mean_class_breakdown(run.train)
    if not shares:
        return None
    classes = list(shares)
    rows = [{"cls": c, "all": v["all"], "kept": v["kept"], "rate": v["rate"], "color": class_color(c)}
            for c, v in shares.items()]
    bars = bar_chart("classes", "Share of all tokens vs share of kept tokens, by class", classes,
                     [("all tokens", [shares[c]["all"] for c in classes]),
                      ("kept tokens", [shares[c]["kept"] for c in classes])],
                     "share", colors=("#b8c4d6", "#1f3a93"))
    over = []  # per class: its share of the kept tokens (solid, in the legend) and of all tokens (dashed)
    for c in classes:
        over += [Series(s.key, c, s.xs, s.ys, "-", class_color(c))
                 for s in _series(run.train, "train", f"kept_share_{c}", "", "-")]
        over += [Series(s.key, "", s.xs, s.ys, "--", class_color(c))
                 for s in _series(run.train, "train", f"all_share_{c}", "", "--")]
    steps_chart = line_chart("class_shares", "Class shares over steps: of kept tokens (solid), of all tokens (dashed)",
                             over, "share", ylim=(0.0, 1.0))
    top = max(rows, key=lambda r: r["kept"] - r["all"])
    return {"rows": rows, "bars": bars, "over_steps": steps_chart, "top": top,
            "others": [r for r in rows if r is not top and r["rate"] is not None]}


def _token_view(r: dict, scale: Any) -> dict[str, Any]:
    toks = []
    classes = r.get("classes") or [None] * len(r["tokens"])
    for text, eos, h, lp, kept, cls in zip(r["tokens"], r.get("eos") or [False] * len(r["tokens"]), r["entropy"],
                                           r["logp"], r["kept"], classes, strict=True):
        bg, fg = scale.colors(h)
        tip = f"entropy {h:.4f} nats · log-prob {lp:.4f} (p {math.exp(lp):.3f})"
        tip += f" · class {cls}" if cls else ""
        tip += " · kept (top-ρ)" if kept else " · not kept"
        toks.append({"text": "⟨eos⟩" if eos else text, "eos": eos, "h": h, "logp": lp, "kept": bool(kept),
                     "cls": cls or "", "bg": bg, "fg": fg, "tip": tip, "newline": "\n" in text})
    return {**r, "toks": toks, "n_kept": sum(t["kept"] for t in toks)}


def spread(n: int, k: int) -> list[int]:
    """k indices of range(n) spread evenly, the first and the last included (all of them when n <= k)."""
    if n <= k:
        return list(range(n))
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})


def samples_section(run: RunData) -> dict[str, Any] | None:
    if not run.samples:
        return None
    shown = [run.samples[i] for i in spread(len(run.samples), MAX_PAGE_EVALS)]  # the page's size stays bounded
    scale = entropy_scale([h for s in shown for r in s.responses for h in r["entropy"]])
    steps = []
    for s in shown:
        ev = run.eval_at(s.step) or {}
        steps.append({"step": s.step, "eval_accuracy": ev.get("eval_accuracy"), "open": s is shown[-1],
                      "summary": s.summary, "responses": [_token_view(r, scale) for r in s.responses]})
    return {"steps": steps, "scale": scale, "kept_marked": sum(s.kept_shown for s in shown),
            "top_frac": run.samples[-1].summary.get("top_frac"), "n_evals": len(run.samples)}


def tokens_section(run: RunData) -> dict[str, Any] | None:
    summaries = run.summaries()
    ranking = kept_ranking(summaries, TOP_RANKED)
    if not ranking:
        return None
    top = ranking[0].kept
    cloud = [{"text": r.text, "count": r.kept, "cls": r.main_class, "color": class_color(r.main_class),
              "size": 0.8 + 2.6 * math.sqrt(r.kept / top)} for r in ranking]
    cloud.sort(key=lambda c: c["text"])  # a cloud, not a list: the size says the rank
    moves = rank_moves(summaries[0], summaries[-1]) if len(summaries) >= 2 else []
    hist = histogram_chart("entropy_hist", "Entropy of the recorded eval responses' tokens, per eval step",
                           summaries[-1]["hist_edges"],
                           [(f"step {s['step']}", s["hist_counts"], s["hist_below"]) for s in summaries])
    total_kept = sum(s["n_kept"] for s in summaries)
    return {"ranking": ranking, "cloud": cloud, "moves": moves, "hist": hist, "total_kept": total_kept,
            "first_step": summaries[0]["step"], "last_step": summaries[-1]["step"],
            "n_responses": summaries[-1]["n_responses"], "n_evals": len(summaries)}


def run_context(run: RunData) -> dict[str, Any]:
    cfg = run.config
    last = run.train[-1] if run.train else {}
    evals = [e for e in run.evals if "eval_accuracy" in e]
    facts = {
        "model": cfg.get("model") or "the embedded tiny model", "task": cfg.get("dataset") or cfg.get("task"),
        "loss": cfg.get("loss"), "entropy_top_frac": cfg.get("entropy_top_frac"),
        "steps": f"{last.get('step', 0)} of {cfg.get('num_steps', '?')}", "temperature": cfg.get("temperature"),
        "group": f"{cfg.get('prompts_per_step', '?')} prompts x {cfg.get('group_size', '?')} samples",
        "eval": (f"{evals[0]['eval_accuracy']:.3f} (step {evals[0]['step']}) → {evals[-1]['eval_accuracy']:.3f} "
                 f"(step {evals[-1]['step']})") if len(evals) >= 2 else None,
    }
    return {"title": f"forkrl run {run.run_dir.name}", "run_dir": str(run.run_dir), "facts": facts,
            "classes": class_section(run), "samples": samples_section(run), "tokens": tokens_section(run),
            "curves": curves(run), "n_train": len(run.train), "n_evals": len(run.evals),
            "shown_responses": SHOWN_RESPONSES, "sampled_responses": SAMPLED_RESPONSES}


def render_run_report(run_dir: Path) -> str:
    return render("run.html.j2", run_context(read_run(run_dir)))


def write_run_report(run_dir: Path, out: Path | None = None) -> Path:
    """Write the page (atomically: a browser never reads half of it) to `out`, default <run_dir>/report.html."""
    out = Path(out) if out is not None else Path(run_dir) / REPORT_FILE
    atomic_write(out, render_run_report(run_dir))
    return out
