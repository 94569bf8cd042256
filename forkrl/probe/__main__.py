"""The probe job from the command line: the seed script's flags, the same engine as the probe service.

    RL_DATASET_PATH=rl.jsonl python -m forkrl.probe --checkpoint-root <run>/checkpoints \\
        --steps 20,80,160,240 --include-final --num-prompts 24 --num-samples 2 --max-new-tokens 2048 \\
        --entropy-bins 5 --max-positions-per-group 12 --layer-indices 0,14,27 --row-spec start,mid,last \\
        --output-dir <out>
    python -m forkrl.probe --help          # every flag, with its default and documentation

Every job flag is a field of `forkrl.probe.params.ProbeParams` (the HTTP body of `POST /probe` too), in
kebab-case; the older names (--group-size, --layers, --row-specs) are accepted as aliases. The prompts come
from --dataset, else --task, else $RL_DATASET_PATH, else the default task. Only the flags are read (no other
environment variable), so a stray DATASET=... in the shell changes nothing. Writes summary.json,
token_probe_records.jsonl, manifest.json and one plot per checkpoint into --output-dir (with --report also the
job's HTML page, report.html); exit status 0 on success, 2 on a bad flag or input (missing step, path, task),
1 when the job itself fails.

Caveat: per-token log-prob gradients under teacher forcing, not a token's exact contribution to the trainer's
aggregated DAPO/GRPO objective (`forkrl.probe.params.CAVEAT`, also in summary.json).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from pydantic_settings import SettingsConfigDict

from forkrl.cli import ModelToolSettings, parse_settings
from forkrl.probe.params import ProbeParams

PROG = "python -m forkrl.probe"


class ProbeCliSettings(ModelToolSettings, ProbeParams):
    """Entropy-gradient probe of RL checkpoints (per-token log-prob gradient norms by entropy bin x
    correctness x parameter x row). Caveat: teacher-forced per-token log-prob gradients, not a token's exact
    contribution to the trainer's aggregated objective."""

    model_config = SettingsConfigDict(cli_prog_name=PROG, populate_by_name=True)

    output_dir: str = "probe_out"
    """Directory for summary.json, token_probe_records.jsonl, manifest.json and the plots."""
    progress: bool = True
    """A progress bar on stderr (--no-progress: none)."""
    report: bool = False
    """Also write report.html into --output-dir: the job as one self-contained HTML page to open in a browser
    (grad norm by entropy bin x correctness, the overlap, the caveat, example tokens in context; forkrl/report)."""

    def job_params(self) -> ProbeParams:
        return ProbeParams.model_validate(self.model_dump(include=set(ProbeParams.model_fields)))


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_settings(ProbeCliSettings, argv)
    settings.apply_threads()
    from tqdm import tqdm
    from transformers.utils import logging as hf_logging

    from forkrl.probe.checkpoints import ProbeInputError
    from forkrl.probe.job import plan_probe, run_probe
    from forkrl.probe.outputs import MANIFEST, RECORDS, SUMMARY

    try:
        plan = plan_probe(settings.job_params())
    except (ProbeInputError, FileNotFoundError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    hf_logging.disable_progress_bar()  # one bar: the job's (per-load weight bars would interleave with it)
    labels = ", ".join(c.label for c in plan.checkpoints)
    print(f"probing {len(plan.checkpoints)} checkpoint(s): {labels}", file=sys.stderr)
    bar = tqdm(total=1, unit="pos", dynamic_ncols=True, disable=not settings.progress, file=sys.stderr)

    def progress(done: int, total: int, stage: str) -> None:
        bar.total = total
        bar.n = done
        if stage:
            bar.set_description(stage[:60], refresh=False)
        bar.refresh()

    try:
        summary = run_probe(plan, settings.output_dir, device=settings.device, progress=progress)
    finally:
        bar.close()
    for c in summary["checkpoints"]:
        acc = "n/a" if c["accuracy"] is None else f"{c['accuracy']:.3f}"
        print(f"{c['label']}: {c['n_trajectories']} responses ({c['n_ungradable']} ungradable), accuracy {acc}, "
              f"{c['n_selected']} tokens probed")  # fmt: skip
    for w in summary["warnings"]:
        print(f"warning: {w}", file=sys.stderr)
    out = settings.output_dir
    print(f"wrote {out}/{SUMMARY} ({len(summary['results'])} results), {out}/{RECORDS} "
          f"({summary['n_records']} records), {out}/{MANIFEST}")  # fmt: skip
    print(f"caveat: {summary['caveat']}")
    if settings.report:
        from forkrl.report.probe_page import write_probe_report

        print(f"wrote {write_probe_report(Path(out))} (open it in a browser)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
