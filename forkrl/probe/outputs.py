"""The files of a probe job, each written to a temp file and renamed into place (`forkrl.files`):

    summary.json               per checkpoint: counts, accuracy, entropy, cells; `results`: one entry per
                               checkpoint x entropy bin x correctness x target x row set (§4.3 statistics)
    token_probe_records.jsonl  one line per probed token x parameter x row set (record_grain "row", the seed's)
                               or per token (record_grain "token"): token, its context (the text before
                               and after it), entropy, logp, bin, grad norm(s)
    manifest.json              the parameters, what they resolved to, weight hashes, versions, timings
    plot_<checkpoint>.png      median row-gradient norm by entropy bin, correct vs incorrect
    entropy_overlap.png        the entropy-pattern overlap across checkpoints (when bins are frozen)

NaN/inf never reach a file: they are written as null, and the JSON is strict (`allow_nan=False`); the job
counts them first (summary["n_nonfinite"]: tokens, gradient vectors left out, values written as null).
"""

from __future__ import annotations

import json
import math
import platform
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

from forkrl.files import atomic_write, atomic_write_json

__all__ = [
    "MANIFEST",
    "RECORDS",
    "SUMMARY",
    "clean",
    "count_nonfinite",
    "plot_checkpoint",
    "plot_overlap",
    "plot_name",
    "versions",
    "write_json",
    "write_records",
]

SUMMARY, RECORDS, MANIFEST = "summary.json", "token_probe_records.jsonl", "manifest.json"


def plot_name(label: str) -> str:
    return f"plot_{label}.png"


def clean(x: Any) -> Any:
    """NaN/inf -> None: the JSON stays strict and a NaN can never hide in a summary."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [clean(v) for v in x]
    if isinstance(x, Path):
        return str(x)
    return x


def count_nonfinite(x: Any) -> int:
    """How many NaN/inf floats `clean` would write as null."""
    if isinstance(x, float):
        return 0 if math.isfinite(x) else 1
    if isinstance(x, dict):
        return sum(count_nonfinite(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return sum(count_nonfinite(v) for v in x)
    return 0


def write_json(path: Path, data: Any) -> None:
    atomic_write_json(path, clean(data), allow_nan=False)


def write_records(f: IO[str], records: Iterable[dict]) -> int:
    """Append records as JSON lines to an open (atomic) file; returns how many."""
    n = 0
    for r in records:
        f.write(json.dumps(clean(r), allow_nan=False) + "\n")
        n += 1
    return n


def plot_checkpoint(path: Path, label: str, results: list[dict], n_bins: int) -> None:
    """Median row-gradient norm by entropy bin, correct vs incorrect, one panel per target x row set."""
    from matplotlib.figure import Figure  # no pyplot: no global state, safe in worker threads

    keys = sorted({(r["target"], r["row_set"]) for r in results})
    fig = Figure(figsize=(4.2 * max(1, len(keys)), 3.4), layout="constrained")
    axes = fig.subplots(1, max(1, len(keys)), squeeze=False)[0]
    for ax, (target, rs) in zip(axes, keys, strict=False):
        for correct, color in ((True, "tab:green"), (False, "tab:red")):
            pts = [
                (r["bin"], r["grad_norm"]["median"])
                for r in results
                if (r["target"], r["row_set"], r["correct"]) == (target, rs, correct) and r["grad_norm"]["median"]
            ]
            ax.plot([x for x, _ in pts], [y for _, y in pts], "o-", color=color,
                    label="correct" if correct else "incorrect")  # fmt: skip
        ax.set_yscale("log")
        ax.set_xticks(range(n_bins))
        ax.set_xlabel("entropy bin (0 = lowest)")
        ax.set_ylabel("median row grad norm")
        ax.set_title(f"{target}\n[{rs}]", fontsize=8)
        ax.legend(fontsize=7)
    fig.suptitle(f"checkpoint {label}", fontsize=9)
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=90), binary=True)


OVERLAP_PLOT = "entropy_overlap.png"


def plot_overlap(path: Path, overlap: dict) -> None:
    """The entropy-pattern overlap per checkpoint (fraction of the reference's top-20% entropy positions that
    stay top-20% when its responses are teacher-forced under that checkpoint)."""
    from matplotlib.figure import Figure

    labels = list(overlap["overlap"])
    vals = [overlap["overlap"][k] if overlap["overlap"][k] is not None else float("nan") for k in labels]
    fig = Figure(figsize=(max(3.0, 0.9 * len(labels) + 1.5), 3.2), layout="constrained")
    ax = fig.subplots()
    ax.plot(range(len(labels)), vals, "o-")
    ax.set_xticks(range(len(labels)), labels, rotation=30, fontsize=7)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel(f"top-{overlap['top_frac']:.0%} entropy overlap")
    ax.set_title(f"vs {overlap['reference']} ({overlap['n_tokens']} response tokens)", fontsize=8)
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=90), binary=True)


def versions() -> dict[str, str]:
    import torch
    import transformers

    import forkrl

    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "forkrl": getattr(forkrl, "__version__", "unknown"),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
