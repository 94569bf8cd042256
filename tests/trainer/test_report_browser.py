"""The reports in a real browser (Debian's Chromium through Playwright, tests/browser.py): the page the trainer
wrote for a real 3-step run (real rollout and trainer services, the committed tiny model) and the page of a probe
job on its checkpoints (python -m forkrl.probe --report) load with no console error and no request; the marked
tokens are the recorded kept flags; the charts hold the data points of metrics.jsonl and summary.json. A
screenshot of each page is saved in the test's tmp dir (CI keeps it as an artefact)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from forkrl.training.config import RunConfig
from tests.browser import open_page
from tests.trainer.helpers import run_to_end

pytestmark = pytest.mark.slow


def _lines(path: Path) -> list[dict]:
    return [json.loads(s) for s in path.read_text().splitlines() if s.strip()]


def _shot(page, path: Path) -> None:  # noqa: ANN001 (a playwright Page)
    page.screenshot(path=str(path), full_page=True)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    print(f"\nscreenshot: {path}")


def test_run_and_probe_reports_in_a_real_browser(rollout_address, trainer, tiny_model_dir, tmp_path) -> None:
    from forkrl.wire.trainer.v1 import trainer_pb2

    address, _ = trainer
    run_dir = tmp_path / "run"
    cfg = RunConfig(model=str(tiny_model_dir), rollout_addresses=[rollout_address], run_dir=str(run_dir), seed=0,
                    num_steps=3, save_every=1, eval_every=2, eval_prompts=8, prompts_per_step=8, group_size=4,
                    entropy_top_frac=0.2)
    _, items, run = run_to_end(address, cfg)
    assert run.state == trainer_pb2.RUN_STATE_SUCCEEDED, run.error
    page_path = run_dir / "report.html"  # written by the trainer at each eval and at the end
    assert any(i.event.path == str(page_path) for i in items if i.HasField("event"))

    # what the trainer recorded: one file per eval (steps 0, 2 and the end), the top-20% of each response
    files = sorted((run_dir / "eval_samples").glob("step_*.jsonl"))
    assert [f.name for f in files] == ["step_000000.jsonl", "step_000002.jsonl", "step_000003.jsonl"]
    responses = [r for f in files for r in _lines(f) if r["kind"] == "response"]
    assert len(responses) == 3 * min(4, 8)
    for r in responses:
        assert not r["truncated"] and len(r["kept"]) == r["n_tokens"]
        assert sum(r["kept"]) == max(1, math.ceil(0.2 * r["n_tokens"])) if r["n_tokens"] else sum(r["kept"]) == 0
        kept_h = [h for h, k in zip(r["entropy"], r["kept"], strict=True) if k]
        other = [h for h, k in zip(r["entropy"], r["kept"], strict=True) if not k]
        assert not other or min(kept_h) >= max(other)
    kept_marks = sum(sum(r["kept"]) for r in responses)
    metrics = _lines(run_dir / "metrics.jsonl")
    train = [m for m in metrics if m["kind"] == "train"]
    evals = [m for m in metrics if m["kind"] == "eval"]
    assert len(train) == 3 and len(evals) == 3

    # the probe job of two of its checkpoints (step 2, an eval step that retention keeps, and final), with its page
    probe_dir = tmp_path / "probe"
    proc = subprocess.run([sys.executable, "-m", "forkrl.probe", "--checkpoint-root", str(run_dir / "checkpoints"),
                           "--steps", "2", "--include-final", "--num-prompts", "4", "--num-samples", "4",
                           "--max-positions-per-group", "4", "--bootstrap", "20", "--sampler", "transformers",
                           "--output-dir", str(probe_dir), "--no-progress", "--report"],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((probe_dir / "summary.json").read_text())

    with open_page(tmp_path) as watch:
        page = watch.open(page_path)
        assert page.locator(".tok.kept").count() == kept_marks > 0
        assert page.locator(".tok").count() == sum(len(r["tokens"]) for r in responses)
        # hovering a token shows its recorded entropy and log-prob
        last = [r for r in responses if r["step"] == 3][0]
        tok = page.locator(f'.response[data-step="3"][data-prompt="{last["prompt_index"]}"] .tok').first
        tok.hover()
        tip = tok.evaluate("e => getComputedStyle(e, '::after').content")
        assert f"entropy {last['entropy'][0]:.4f} nats" in tip and f"log-prob {last['logp'][0]:.4f}" in tip, tip

        def points(gid: str) -> int:
            return page.locator(f'[id="{gid}"] use').count()

        assert points("reward--reward_mean") == points("kept--kept_frac") == len(train)
        assert points("reward--eval_accuracy") == len(evals)
        assert points("entropy--entropy_mean") == sum(m["entropy_mean"] > 0 for m in train)
        assert points("time--time_step_s") == len(train)
        assert points("class_shares--kept_share_choice") == len(train)  # countdown labels its tokens
        for f in files:
            s = _lines(f)[0]
            assert points(f"entropy_hist--step_{s['step']}") == sum(n > 0 for n in s["hist_counts"])
        assert page.locator('#class-table tr[data-class="choice"]').count() == 1
        _shot(page, tmp_path / "run_report.png")

        probe_page = watch.open(probe_dir / "report.html")
        assert summary["caveat"] in probe_page.locator("#caveat").inner_text()
        labels = [c["label"] for c in summary["checkpoints"]]
        charts = probe_page.locator('figure[data-chart^="grad-"]')
        assert charts.count() == len({(r["target"], r["row_set"]) for r in summary["results"]}) > 0
        for i in range(charts.count()):
            fig = charts.nth(i)
            target, _, row_set = fig.locator("figcaption").inner_text().partition(" · rows ")
            chart_id = fig.get_attribute("data-chart")
            for label in labels:
                for correct in (True, False):
                    cells = [r for r in summary["results"] if (r["target"], r["row_set"], r["checkpoint"],
                             r["correct"]) == (target, row_set, label, correct)]
                    expect = sum((r.get("grad_norm") or {}).get("median") not in (None, 0) for r in cells)
                    gid = f"{chart_id}--{label}--{'correct' if correct else 'incorrect'}"
                    assert probe_page.locator(f'[id="{gid}"] use').count() == expect, gid
        assert probe_page.locator("#overlap-table tr").count() == 1 + len(labels)
        assert probe_page.locator(".examples .tok").count() > 0
        _shot(probe_page, tmp_path / "probe_report.png")

    assert watch.console_errors == [], watch.console_errors
    assert watch.blocked == [] and sorted(set(watch.requests)) == sorted(
        {page_path.resolve().as_uri(), (probe_dir / "report.html").resolve().as_uri()}), watch.requests
