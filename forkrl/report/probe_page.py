"""The probe report: one self-contained HTML page per probe job, from its output directory.

    html = render_probe_report(job_dir)       # GET /probe/{id}/report serves this
    path = write_probe_report(job_dir)        # <job_dir>/report.html (python -m forkrl.probe --report, or
                                              # python -m forkrl.report JOB_DIR)

What it shows, from summary.json and token_probe_records.jsonl (forkrl/probe/outputs.py):
- the caveat (forkrl.probe.params.CAVEAT) and what it means in plain words;
- each checkpoint's responses, accuracy, entropy and bins;
- for each probed parameter and row set, the median per-token gradient norm by entropy bin x correctness, one
  line per checkpoint and correctness, with the cluster-bootstrap 95% interval as a band when the job ran one,
  and the same numbers as a table;
- the entropy-pattern overlap across checkpoints (jobs with frozen bins);
- example tokens of each bin in their context (the records' context_before / context_after).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from forkrl.files import atomic_write
from forkrl.report.charts import COLORS, Series, line_chart
from forkrl.report.render import entropy_scale, render

__all__ = ["EXAMPLES_PER_BIN", "probe_context", "render_probe_report", "write_probe_report"]

EXAMPLES_PER_BIN = 6  # example tokens per checkpoint x entropy bin (half correct, half incorrect when there are)
# the settings the page names, as a job of an older forkrl may lack some
SETTINGS_SHOWN = {k: None for k in ("task", "dataset", "num_prompts", "num_samples", "temperature", "entropy_bins",
                                    "max_positions_per_group", "layer_indices", "row_spec", "bootstrap")}
CI_KEY = "grad_norm.median"  # the statistic charted, and its interval in a result's ci95

PLAIN_CAVEAT = (
    "In plain words: for each sampled token the probe measures how strongly that token's own log-probability pulls "
    "on a few rows of the chosen weight matrices when the finished response is fed back to the model. A training "
    "step does more than that: it multiplies each token's pull by the response's advantage (positive for a correct "
    "response, negative for a wrong one, zero in a group where every response scored the same), leaves out "
    "clipped tokens and the tokens the entropy mask drops, divides by the token count and adds everything up, so "
    "large pulls of opposite sign can cancel. Read these numbers as where the gradient can come from, not as how "
    "much each token moved the weights."
)


def _records(path: Path) -> Iterator[dict]:
    if path.is_file():
        with open(path) as f:
            for line in f:
                if line.strip():
                    yield json.loads(line)


def examples(path: Path, per_bin: int = EXAMPLES_PER_BIN) -> dict[str, dict[int, list[dict]]]:
    """{checkpoint: {bin: [record, ...]}}: the first `per_bin` distinct probed tokens of each checkpoint and bin
    (as many correct as incorrect when both exist), read in one pass over the records."""
    seen: set[tuple] = set()
    out: dict[str, dict[int, dict[bool, list[dict]]]] = {}
    for r in _records(path):
        key = (r["checkpoint"], r["trajectory"], r["response_position"])
        if key in seen:
            continue
        seen.add(key)
        cell = out.setdefault(r["checkpoint"], {}).setdefault(int(r["bin"]), {True: [], False: []})
        if len(cell[bool(r["correct"])]) < per_bin:
            cell[bool(r["correct"])].append(r)
    picked: dict[str, dict[int, list[dict]]] = {}
    for ckpt, bins in out.items():
        for b, cell in bins.items():
            ok, bad = cell[True], cell[False]
            n_bad = min(len(bad), per_bin - min(len(ok), per_bin // 2))
            chosen = ok[:min(len(ok), per_bin - n_bad)] + bad[:n_bad]
            picked.setdefault(ckpt, {})[b] = sorted(chosen, key=lambda r: r["entropy"])
    return picked


def grad_charts(summary: dict) -> list[dict[str, Any]]:
    """Per (parameter, row set): the chart of median grad norm by bin and the table of the same numbers."""
    results = summary.get("results", [])
    labels = [c["label"] for c in summary.get("checkpoints", [])]
    n_bins = int(summary.get("settings", {}).get("entropy_bins") or 1 + max((r["bin"] for r in results), default=0))
    keys = sorted({(r["target"], r["row_set"]) for r in results}, key=lambda k: (k[0].split(".")[1:], k))
    out = []
    for n, (target, row_set) in enumerate(keys):
        series, rows = [], {b: {} for b in range(n_bins)}
        for ci, label in enumerate(labels):
            for correct in (True, False):
                cells = {r["bin"]: r for r in results if (r["target"], r["row_set"], r["checkpoint"], r["correct"]) ==
                         (target, row_set, label, correct)}
                med = [(cells[b].get("grad_norm") or {}).get("median") if b in cells else None for b in range(n_bins)]
                ci95 = [(cells[b].get("ci95") or {}).get(CI_KEY) if b in cells else None for b in range(n_bins)]
                lo = [c[0] if c else None for c in ci95]
                hi = [c[1] if c else None for c in ci95]
                key = f"{label}--{'correct' if correct else 'incorrect'}"
                series.append(Series(key, f"{label} {'correct' if correct else 'incorrect'}", list(range(n_bins)), med,
                                     "-" if correct else "--", COLORS[ci % len(COLORS)],
                                     band=(lo, hi) if any(c for c in ci95) else None))
                for b in range(n_bins):
                    rows[b][key] = {"median": med[b], "ci": ci95[b], "n": cells[b]["n"] if b in cells else 0}
        chart = line_chart(f"grad-{n}", f"{target} · rows {row_set}", series, "median row grad norm (log)",
                           xlabel="entropy bin (0 = lowest)", logy=True, size=(5.2, 2.9))
        cols = [s.key for s in series]
        out.append({"target": target, "row_set": row_set, "chart": chart,
                    "columns": [(s.key, s.label) for s in series],
                    "rows": [{"bin": b, "cells": [rows[b][k] for k in cols]} for b in range(n_bins)]})
    return out


def _bin_ranges(ckpt: dict) -> list[str]:
    """'H <= 0.0013', '0.0013 < H <= 0.0084', ... from a checkpoint's bin edges (rank bins of its own tokens)."""
    edges = ckpt.get("bin_edges") or []
    if not edges:
        return []
    out = [f"H ≤ {edges[0]:.3g}"]
    out += [f"{a:.3g} < H ≤ {b:.3g}" for a, b in zip(edges[:-1], edges[1:], strict=True)]
    return out + [f"H > {edges[-1]:.3g}"]


def probe_context(job_dir: Path) -> dict[str, Any]:
    job_dir = Path(job_dir)
    summary = json.loads((job_dir / "summary.json").read_text())
    ex = examples(job_dir / "token_probe_records.jsonl")
    scale = entropy_scale([r["entropy"] for bins in ex.values() for recs in bins.values() for r in recs])
    ckpts = summary.get("checkpoints", [])
    example_view = []
    for c in ckpts:
        bins = ex.get(c["label"], {})
        ranges = _bin_ranges(c)
        example_view.append({"label": c["label"], "bins": [
            {"bin": b, "range": ranges[b] if b < len(ranges) else "", "records": [
                {**r, "bg": scale.colors(r["entropy"])[0], "fg": scale.colors(r["entropy"])[1]} for r in bins[b]]}
            for b in sorted(bins)]})
    overlap = summary.get("entropy_pattern_overlap")
    charts = grad_charts(summary)
    return {"title": f"forkrl probe job {job_dir.name}", "job_dir": str(job_dir), "summary": summary,
            "caveat": summary.get("caveat", ""), "plain_caveat": PLAIN_CAVEAT, "checkpoints": ckpts,
            "settings": {**SETTINGS_SHOWN, **summary.get("settings", {})}, "grads": charts, "overlap": overlap,
            "examples": example_view,
            "has_context": any("context_before" in r for b in ex.values() for rs in b.values() for r in rs),
            "scale": scale, "charts": [g["chart"] for g in charts if g["chart"] is not None]}


def render_probe_report(job_dir: Path) -> str:
    """The page of a probe job's output directory (summary.json; records optional)."""
    return render("probe.html.j2", probe_context(job_dir))


def write_probe_report(job_dir: Path, out: Path | None = None) -> Path:
    out = Path(out) if out is not None else Path(job_dir) / "report.html"
    atomic_write(out, render_probe_report(job_dir))
    return out

