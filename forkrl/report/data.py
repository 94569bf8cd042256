"""A run directory read back for the report: metrics.jsonl, config.json and the eval samples (forkrl/report/record.py),
and what the page derives from them (pure Python, no model, no plotting).

    run = read_run(run_dir)
    ranking = kept_ranking(run.summaries())          # the most frequent kept tokens over the run's evals
    moves = rank_moves(first, last)                  # how that list moved from the first eval to the last
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from forkrl.data.problem import TOKEN_CLASSES

__all__ = ["SAMPLED_RESPONSES", "SAMPLES_DIR", "SHOWN_RESPONSES", "RunData", "kept_ranking", "mean_class_breakdown",
           "rank_moves", "read_jsonl", "read_run"]

# The eval samples' layout in a run directory: written by forkrl/report/record.py during training, read here.
SAMPLES_DIR = "eval_samples"
SHOWN_RESPONSES = 4  # responses written token by token (the page shows them)
SAMPLED_RESPONSES = 32  # responses teacher-forced at each eval: the histogram and the kept-token counts


def read_jsonl(path: Path) -> list[dict]:
    """The JSON objects of a JSONL file, blank lines skipped; a missing file is empty."""
    if not path.is_file():
        return []
    return [json.loads(s) for s in path.read_text().splitlines() if s.strip()]


@dataclass
class EvalSamples:
    """One eval step's recorded sample: the summary line and the responses written token by token."""

    step: int
    summary: dict
    responses: list[dict] = field(default_factory=list)

    @property
    def kept_shown(self) -> int:
        """Kept flags among the tokens written (what the page marks)."""
        return sum(sum(bool(k) for k in r["kept"]) for r in self.responses)


@dataclass
class RunData:
    run_dir: Path
    config: dict
    train: list[dict]  # metrics.jsonl lines of kind "train", in step order
    evals: list[dict]  # lines of kind "eval"
    samples: list[EvalSamples]  # by step

    def summaries(self) -> list[dict]:
        return [s.summary for s in self.samples]

    def eval_at(self, step: int) -> dict | None:
        found = [e for e in self.evals if e["step"] == step]
        return found[-1] if found else None


def read_run(run_dir: Path) -> RunData:
    """Everything the run report shows, from files only. A run dir without metrics.jsonl raises FileNotFoundError."""
    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise FileNotFoundError(f"{run_dir} holds no metrics.jsonl: not a forkrl run directory")
    lines = read_jsonl(metrics)
    cfg_path = run_dir / "config.json"
    config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    samples = []
    for path in sorted((run_dir / SAMPLES_DIR).glob("step_*.jsonl")):
        rows = read_jsonl(path)
        summary = next((r for r in rows if r.get("kind") == "summary"), None)
        if summary is None:
            continue
        samples.append(EvalSamples(int(summary["step"]), summary, [r for r in rows if r.get("kind") == "response"]))
    samples.sort(key=lambda s: s.step)
    train = sorted((m for m in lines if m.get("kind") == "train"), key=lambda m: m["step"])
    evals = sorted((m for m in lines if m.get("kind") == "eval"), key=lambda m: m["step"])
    return RunData(run_dir, config, train, evals, samples)


@dataclass
class RankRow:
    """One kept token over the run: its text, how often it was kept, how often it occurred (in the tokens counted:
    the kept ones' texts, see record.py), the kept count per class, and its rank (1 = most frequent)."""

    rank: int
    text: str
    kept: int
    seen: int
    classes: dict[str, int]

    @property
    def main_class(self) -> str:
        return max(self.classes.items(), key=lambda kv: (kv[1], kv[0]))[0] if self.classes else ""

    @property
    def rate(self) -> float | None:
        return self.kept / self.seen if self.seen else None


def kept_ranking(summaries: Sequence[dict], top: int | None = None) -> list[RankRow]:
    """The kept tokens of these eval steps summed by text, most frequent first (ties: by text), ranks from 1."""
    kept: Counter = Counter()
    seen: Counter = Counter()
    classes: dict[str, Counter] = defaultdict(Counter)
    for s in summaries:
        for text, n, by_class in s.get("kept_tokens", []):
            kept[text] += n
            classes[text].update(by_class)
        for text, n in s.get("all_tokens", {}).items():
            seen[text] += n
    order = sorted(kept, key=lambda t: (-kept[t], t))[:top]
    return [RankRow(i + 1, t, kept[t], seen[t], {c: n for c, n in classes[t].items() if c}) for i, t in
            enumerate(order)]


def rank_moves(first: dict, last: dict, top: int = 15) -> list[dict]:
    """The `top` kept tokens of the last eval with their rank at the first eval: {"text", "rank", "count",
    "before" (rank at the first eval or None: not kept then), "move" (before - rank; positive = climbed)}, and
    after them the tokens of the first eval's top that left the last eval's top ("rank" None)."""
    a = {r.text: r for r in kept_ranking([first])}
    b = kept_ranking([last])
    rows = []
    for r in b[:top]:
        before = a[r.text].rank if r.text in a else None
        rows.append({"text": r.text, "rank": r.rank, "count": r.kept, "before": before,
                     "move": None if before is None else before - r.rank, "main_class": r.main_class})
    shown = {r["text"] for r in rows}
    in_b = {r.text: r for r in b}
    for r in sorted(a.values(), key=lambda r: r.rank)[:top]:
        if r.text not in shown:
            now = in_b.get(r.text)
            rows.append({"text": r.text, "rank": now.rank if now else None, "count": now.kept if now else 0,
                         "before": r.rank, "move": None if now is None else r.rank - now.rank,
                         "main_class": r.main_class, "dropped": True})
    return rows


def mean_class_breakdown(lines: Sequence[dict]) -> dict[str, dict[str, float | None]]:
    """{class: {"all", "kept", "rate"}}: the breakdown's shares averaged over the metrics lines that have them
    (train steps of metrics.jsonl), the rate over the steps where the class occurred (None: never). {} without a
    breakdown."""
    out: dict[str, dict[str, float]] = {}
    present = [k.removeprefix("all_share_") for k in (lines[0] if lines else {}) if k.startswith("all_share_")]
    order = {c: i for i, c in enumerate(TOKEN_CLASSES)}  # metrics.jsonl sorts its keys: back to the class order
    classes = sorted(present, key=lambda c: (order.get(c, len(order)), c))
    for c in classes:
        rows = [m for m in lines if f"all_share_{c}" in m]
        rates = [m[f"kept_rate_{c}"] for m in rows if f"kept_rate_{c}" in m]
        out[c] = {"all": sum(m[f"all_share_{c}"] for m in rows) / len(rows),
                  "kept": sum(m[f"kept_share_{c}"] for m in rows) / len(rows),
                  "rate": sum(rates) / len(rates) if rates else None}
    return out
