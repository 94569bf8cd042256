"""Reports people open in a browser: one self-contained HTML page per run and per probe job.

    python -m forkrl.report RUN_DIR                 # <RUN_DIR>/report.html (a probe job's dir: its report.html)
    from forkrl.report import write_run_report, write_probe_report

- The run report (run_page.py) reads metrics.jsonl, config.json and eval_samples/, which the trainer records at
  each evaluation (record.py: a few eval responses teacher-forced for per-token entropy, log-prob and the kept
  flags), so it never runs the model; the trainer also rewrites it at each evaluation and at the end.
- The probe report (probe_page.py) reads a probe job's summary.json and token_probe_records.jsonl; the probe
  service serves it (GET /probe/{id}/report), the probe CLI writes it with --report.

Pages are Jinja2 templates (templates/, package data) with matplotlib charts inlined as SVG: no script, font,
image or style is fetched from anywhere. This package is core: it imports no service.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__all__ = ["render_probe_report", "render_run_report", "write_probe_report", "write_run_report"]

if TYPE_CHECKING:
    from forkrl.report.probe_page import render_probe_report, write_probe_report
    from forkrl.report.run_page import render_run_report, write_run_report


def __getattr__(name: str):  # noqa: ANN202 (lazy: `import forkrl.report` stays light, no matplotlib)
    if name in ("render_run_report", "write_run_report"):
        from forkrl.report import run_page

        return getattr(run_page, name)
    if name in ("render_probe_report", "write_probe_report"):
        from forkrl.report import probe_page

        return getattr(probe_page, name)
    raise AttributeError(name)
