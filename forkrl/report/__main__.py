"""Write the HTML report of a run directory or of a probe job's output directory.

    python -m forkrl.report runs/demo/runs/demo-20261201-120000          # -> <run dir>/report.html
    python -m forkrl.report runs/demo/probe_jobs/6f9649df26b24a3a        # a probe job (summary.json) -> report.html
    python -m forkrl.report RUN_DIR --out /tmp/run.html

The page is self-contained (inline SVG charts, no script, nothing fetched): open it from disk or send it as one
file. Exit status 0 on success, 2 when the directory is neither a run (metrics.jsonl) nor a probe job
(summary.json).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

PROG = "python -m forkrl.report"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("directory", type=Path, help="a run directory (metrics.jsonl) or a probe job's output directory "
                   "(summary.json)")
    p.add_argument("--out", type=Path, default=None, help="where to write the page (default: <directory>/report.html)")
    args = p.parse_args(argv)
    d: Path = args.directory
    if (d / "metrics.jsonl").is_file():
        from forkrl.report.run_page import write_run_report

        path = write_run_report(d, args.out)
    elif (d / "summary.json").is_file():
        from forkrl.report.probe_page import write_probe_report

        path = write_probe_report(d, args.out)
    else:
        print(f"{PROG}: error: {d} holds neither metrics.jsonl (a run directory) nor summary.json (a probe job's "
              "output directory)", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
