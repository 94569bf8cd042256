"""The benchmark eval from the command line: avg@n, pass@k and maj@k of a base model and a run's checkpoints.

    python -m forkrl.eval --checkpoint-root runs/x/checkpoints --steps 20,80 --include-final \\
        --model /models/Qwen3-8B-Base --benchmarks data/aime24.parquet,data/math500.parquet --num-samples 16
    python -m forkrl.eval --help          # every flag, with its default and documentation

Every flag is a field of `forkrl.eval.params.EvalParams`, in kebab-case. Unset settings (prompt format, reward,
temperature, max new tokens, the benchmarks) come from the run's config.json beside --checkpoint-root (or
--run-config, a config.json or a recipe TOML). Prints the paper-style table (benchmark x checkpoint) of avg@n and of
pass@k at the largest k; writes eval_results.json (every problem's samples graded), samples.jsonl (every completion)
and avg_vs_step.png into --output-dir. Exit status 0 on success, 2 on a bad flag or input, 1 when sampling fails.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from pydantic_settings import SettingsConfigDict

from forkrl.cli import ModelToolSettings, parse_settings
from forkrl.eval.params import EvalParams

PROG = "python -m forkrl.eval"


class EvalCliSettings(ModelToolSettings, EvalParams):
    """avg@n, pass@k and maj@k of a base model and checkpoints on benchmark files, graded by the run's reward."""

    model_config = SettingsConfigDict(cli_prog_name=PROG)

    output_dir: str = "eval_out"
    """Directory for eval_results.json, samples.jsonl and avg_vs_step.png."""
    device: str = "auto"
    """torch device of the transformers sampler: auto (cuda if present), cpu, cuda."""

    def params(self) -> EvalParams:
        return EvalParams.model_validate(self.model_dump(include=set(EvalParams.model_fields)))


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_settings(EvalCliSettings, argv)
    settings.apply_threads()
    from forkrl.eval import outputs
    from forkrl.eval.run import EvalInputError, plan_eval, run_eval
    from forkrl.probe.checkpoints import ProbeInputError

    try:
        plan = plan_eval(settings.params())
    except (EvalInputError, ProbeInputError, FileNotFoundError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    labels = ", ".join(c.label for c in plan.checkpoints)
    names = ", ".join(f"{b.name} ({len(b.problems)})" for b in plan.benchmarks)
    print(f"evaluating {labels} on {names}: {plan.params.num_samples} samples each at T={plan.temperature}, "
          f"prompt format {plan.prompt_format}, reward {plan.reward}", file=sys.stderr)
    summary = run_eval(plan, settings.output_dir, device=settings.device)
    n = plan.params.num_samples
    print(outputs.table(summary, f"avg@{n}"))
    print()
    print(outputs.table(summary, f"pass@{max(plan.ks)}"))
    for label, counters in summary["reward_counters"].items():
        if counters.get("timeouts"):
            print(f"warning: {label}: {counters['timeouts']} samples timed out in grading (scored 0)", file=sys.stderr)
    for note in summary["notes"]:
        print(f"note: {note}", file=sys.stderr)
    print("wrote " + ", ".join(os.path.join(settings.output_dir, f) for f in summary["files"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
