"""The probe job (algorithms.md §4) in two calls: check and resolve everything it will read, then run it.

    from forkrl.probe import ProbeParams, plan_probe, run_probe
    plan = plan_probe(ProbeParams(checkpoint_root="runs/x/checkpoints", steps=[20, 80], include_final=True))
    summary = run_probe(plan, "probe_out", progress=lambda done, total, stage: print(done, total, stage))

`plan_probe` fails fast, before any model is loaded: the checkpoints (checkpoints.py: typed errors for
missing steps, missing paths and bad checkpoints), the task or dataset, the reward. `run_probe` also takes
the params directly and plans them itself.

For each checkpoint, with the same prompts and seed (worker.py):
1. load it (safetensors only, eager attention), sample `group_size` responses per prompt at T, grade them;
2. no-grad entropy pass at T (optionally also at T = 1);
3. rank-bin every response token (sampling.rank_bins);
4. per (bin x correct/incorrect) cell pick up to `max_positions_per_group` positions, at most
   `max_positions_per_trajectory` from one trajectory within a cell; degenerate groups (all correct or all
   wrong: advantage 0) are flagged, or left out with `exclude_degenerate_groups`;
5. exact per-position row gradients (gradients.py), then the §4.3 statistics per (cell x target x row set).
Then the job writes summary.json, token_probe_records.jsonl, manifest.json and the plots (outputs.py).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from forkrl.files import atomic_file
from forkrl.probe import outputs
from forkrl.probe.checkpoints import (
    CheckpointRef,
    Confine,
    PathNotFound,
    ProbeInputError,
    real_path,
    resolve_checkpoints,
)
from forkrl.probe.params import ProbeParams
from forkrl.probe.sampling import resolve_reward_name
from forkrl.probe.worker import CheckpointProbe, Progress, ProgressFn

__all__ = ["ProbePlan", "load_problems", "plan_probe", "run_probe"]

DATASET_MAX_NEW_TOKENS = 1024  # a dataset has no per-task limit; 1024 covers most short math answers


@dataclass(frozen=True)
class ProbePlan:
    """A job that passed every check that needs no model: what it reads, resolved."""

    params: ProbeParams  # as given
    checkpoints: list[CheckpointRef]  # in probing order, labels unique
    task: str  # exactly one of task / dataset is set
    dataset: str  # resolved path, or the '{split}' template as given
    reward: str  # resolved reward name
    max_new_tokens: int  # resolved: params.max_new_tokens, else the task's, else DATASET_MAX_NEW_TOKENS

    @property
    def base_model(self) -> Path | None:
        return self.checkpoints[0].path if self.params.model else None


def plan_probe(params: ProbeParams, confine: Confine = real_path) -> ProbePlan:
    """Resolve the checkpoints, the prompts' source and the reward; every path through `confine` first."""
    from forkrl.data import tasks
    from forkrl.data.rewards import get_reward_fn

    refs = resolve_checkpoints(params, confine)
    task, dataset = params.task, params.dataset
    if dataset:
        # a "{split}" template names one file per split; check the one this job reads
        path = dataset.replace("{split}", params.split)
        real = confine(Path(path), "dataset")
        if not real.exists():
            raise PathNotFound(f"dataset {path!r} does not exist")
        dataset = str(real) if "{split}" not in dataset else dataset
    elif not task:  # as training: $RL_DATASET_PATH (the operator's, not confined), else the default task
        dataset = os.environ.get("RL_DATASET_PATH", "")
        task = "" if dataset else tasks.DEFAULT_TASK
    if dataset and not Path(dataset.replace("{split}", params.split)).is_file():
        raise ProbeInputError(f"dataset {dataset} is not a file")
    try:
        max_new = params.max_new_tokens or (tasks.get_task(task).max_new_tokens if task else DATASET_MAX_NEW_TOKENS)
        reward = resolve_reward_name(params.reward, dataset, task)
        get_reward_fn(reward)
    except ValueError as exc:  # unknown task or reward: the message names the known ones
        raise ProbeInputError(str(exc)) from exc
    return ProbePlan(params, refs, task, dataset, reward, max_new)


def load_problems(plan: ProbePlan) -> list:
    """The job's prompts: the same `num_prompts` problems (by seed) for every checkpoint."""
    from forkrl.data.datasets import load_problems as load

    p = plan.params
    return list(load(plan.task or None, plan.dataset or None, p.split, p.num_prompts, p.seed))


def run_probe(
    plan: ProbePlan | ProbeParams,
    out_dir: str | Path,
    *,
    device: str = "auto",
    progress: ProgressFn | None = None,
    should_cancel: Callable[[], bool] | None = None,
) -> dict:
    """Run the whole job on `device` (auto = cuda if present), write its files into `out_dir`, return the
    summary. `should_cancel` is polled between batches; when it says so the job raises ProbeCancelled."""
    if isinstance(plan, ProbeParams):
        plan = plan_probe(plan)
    p = plan.params
    t_job, started_at = time.perf_counter(), time.time()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
    problems = load_problems(plan)
    guess = p.entropy_bins * 2 * p.max_positions_per_group
    prog = Progress(progress, should_cancel, len(plan.checkpoints), guess)
    prog.advance(0, "starting")

    infos, results, manifests, methods = [], [], [], set()
    n_records = 0
    with atomic_file(out / outputs.RECORDS) as rec_f:
        for ci, ref in enumerate(plan.checkpoints):
            probe = CheckpointProbe(
                ci, ref, p, problems, max_new_tokens=plan.max_new_tokens, reward=plan.reward,
                tokenizer_fallback=plan.base_model, device=dev, progress=prog,
            )  # fmt: skip
            res = probe.run(out)
            infos.append(res.info)
            results.extend(res.results)
            manifests.append(res.manifest)
            methods |= res.methods
            n_records += outputs.write_records(rec_f, res.records)

    summary = {
        "checkpoints": infos,
        "results": results,
        "n_records": n_records,
        "gradient_method": sorted(methods),
        "settings": {
            "task": plan.task, "dataset": plan.dataset, "split": p.split, "num_prompts": len(problems),
            "group_size": p.group_size, "temperature": p.temperature, "max_new_tokens": plan.max_new_tokens,
            "entropy_bins": p.entropy_bins, "max_positions_per_group": p.max_positions_per_group,
            "max_positions_per_trajectory": p.max_positions_per_trajectory, "seed": p.seed,
        },
    }  # fmt: skip
    outputs.write_json(out / outputs.SUMMARY, summary)
    outputs.write_json(
        out / outputs.MANIFEST,
        {
            "params": p.model_dump(),
            "resolved": {
                "task": plan.task, "dataset": plan.dataset, "reward": plan.reward,
                "max_new_tokens": plan.max_new_tokens, "device": str(dev), "num_prompts": len(problems),
            },  # fmt: skip
            "checkpoints": manifests,
            "versions": outputs.versions(),
            "gradient_method": sorted(methods),
            "n_records": n_records,
            "files": [outputs.SUMMARY, outputs.RECORDS, outputs.MANIFEST]
            + [outputs.plot_name(c["label"]) for c in infos],
            "started_at": started_at,
            "finished_at": time.time(),
            "timings_s": {"total": time.perf_counter() - t_job, **{m["label"]: m["timings_s"] for m in manifests}},
        },
    )
    return outputs.clean(summary)
