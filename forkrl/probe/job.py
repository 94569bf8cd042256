"""The probe job (algorithms.md §4) in two calls: check and resolve everything it will read, then run it.

    from forkrl.probe import ProbeParams, plan_probe, run_probe
    plan = plan_probe(ProbeParams(checkpoint_root="runs/x/checkpoints", steps=[20, 80], include_final=True))
    summary = run_probe(plan, "probe_out", progress=lambda done, total, stage: print(done, total, stage))

`plan_probe` fails fast, before any model is loaded: the checkpoints (checkpoints.py: typed errors for
missing steps, missing paths and bad checkpoints), the task or dataset, the reward. `run_probe` also takes
the params directly and plans them itself.

For each checkpoint, with the same prompts and seed (worker.py):
1. load it (safetensors only, eager attention), sample `num_samples` responses per prompt at T, grade them;
2. no-grad entropy pass at T (optionally also at T = 1), and over the reference checkpoint's responses;
3. bin every response token: the reference checkpoint (`freeze_bins_from`, default the first; probed first)
   gets rank bins (sampling.rank_bins) and its edges are applied to every other checkpoint;
4. per (bin x correct/incorrect) cell pick up to `max_positions_per_group` positions (at most
   `max_positions_per_trajectory` from one trajectory, if set); ungradable samples (reward None) and NaN/inf
   tokens are left out and counted; degenerate groups (all correct or all wrong: advantage 0) are flagged,
   or left out with `exclude_degenerate_groups`;
5. exact per-position row gradients (gradients.py), then the §4.3 statistics per (cell x target x row set)
   with cluster-bootstrap 95% intervals.
Then, across checkpoints: effective rank at one common n per (target, row set), and the entropy-pattern
overlap; the job writes summary.json, token_probe_records.jsonl, manifest.json and the plots (outputs.py).
Caveat (params.CAVEAT, also in summary.json): these are per-token log-prob gradients under teacher forcing,
not a token's exact contribution to the trainer's aggregated objective.
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
from forkrl.probe.engines import resolve_sampler
from forkrl.probe.metrics import erank_at_n
from forkrl.probe.params import CAVEAT, DATASET_MAX_NEW_TOKENS, ProbeParams
from forkrl.probe.sampling import resolve_reward_name, top_frac_mask
from forkrl.probe.worker import CheckpointProbe, CheckpointResult, Progress, ProgressFn

__all__ = ["DATASET_MAX_NEW_TOKENS", "ProbePlan", "load_problems", "plan_probe", "run_probe"]

OVERLAP_TOP_FRAC = 0.2  # the paper's: top-20% entropy positions


@dataclass(frozen=True)
class ProbePlan:
    """A job that passed every check that needs no model: what it reads, resolved."""

    params: ProbeParams  # as given
    checkpoints: list[CheckpointRef]  # in probing order, labels unique
    task: str  # exactly one of task / dataset is set
    dataset: str  # resolved path, or the '{split}' template as given
    reward: str  # resolved reward name
    max_new_tokens: int  # resolved: params.max_new_tokens, else the task's, else DATASET_MAX_NEW_TOKENS
    reference: int | None = 0  # index into checkpoints of the bin-edge reference; None = rank bins each

    @property
    def base_model(self) -> Path | None:
        return self.checkpoints[0].path if self.params.model else None


def plan_probe(params: ProbeParams, confine: Confine = real_path) -> ProbePlan:
    """Resolve the checkpoints, the prompts' source and the reward; every path through `confine` first."""
    from forkrl.data import tasks
    from forkrl.data.datasets import Fields, check_dataset
    from forkrl.data.prompts import check_prompt_format, check_reward_format
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
    if dataset and not Path(dataset.replace("{split}", params.split)).exists():
        raise ProbeInputError(f"dataset {dataset} does not exist")
    try:
        max_new = params.max_new_tokens or (tasks.get_task(task).max_new_tokens if task else DATASET_MAX_NEW_TOKENS)
        reward = resolve_reward_name(params.reward, dataset, task)
        get_reward_fn(reward)
        check_reward_format(reward, params.prompt_format)
        if dataset:  # every row of the split read and checked before any model is loaded
            check_dataset(dataset, (params.split,), Fields(params.prompt_field, params.answer_field))
        with_tokenizer = [r.path for r in refs if any(r.path.glob("tokenizer*"))]
        if with_tokenizer:  # a chat format needs a chat template: say so before any model is loaded
            check_prompt_format(with_tokenizer[0], params.prompt_format, params.system_prompt)
    except ValueError as exc:  # unknown task or reward: the message names the known ones
        raise ProbeInputError(str(exc)) from exc
    return ProbePlan(params, refs, task, dataset, reward, max_new, _reference(params.freeze_bins_from, refs))


def _reference(spec: str, refs: list[CheckpointRef]) -> int | None:
    """Index of the checkpoint named by freeze_bins_from: '' = the first, 'none' = no frozen edges."""
    spec = spec.strip()
    if not spec:
        return 0
    if spec.lower() == "none":
        return None
    for i, r in enumerate(refs):
        if r.label == spec or (spec.isdigit() and r.step == int(spec)):
            return i
    raise ProbeInputError(
        f"freeze_bins_from {spec!r} names no probed checkpoint; probed: {[r.label for r in refs]} (a step or label)"
    )


def load_problems(plan: ProbePlan) -> list:
    """The job's prompts: the same `num_prompts` problems (by seed) for every checkpoint."""
    from forkrl.data.datasets import Fields
    from forkrl.data.datasets import load_problems as load

    p = plan.params
    fields = Fields(p.prompt_field, p.answer_field)
    return list(load(plan.task or None, plan.dataset or None, p.split, p.num_prompts, p.seed, fields))


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

    # the reference checkpoint goes first: its rank-bin edges and its responses are used by all the others
    ref_i = plan.reference
    order = list(range(len(plan.checkpoints)))
    if ref_i is not None:
        order = [ref_i] + [i for i in order if i != ref_i]
    done: list[CheckpointResult] = []
    methods: set[str] = set()
    n_records = 0
    with atomic_file(out / outputs.RECORDS) as rec_f:
        for pos, ci in enumerate(order):
            first = done[0] if done and ref_i is not None else None
            probe = CheckpointProbe(
                pos, plan.checkpoints[ci], p, problems, max_new_tokens=plan.max_new_tokens, reward=plan.reward,
                tokenizer_fallback=plan.base_model, device=dev, progress=prog,
                edges=first.edges if first else None,
                overlap_trajs=(first.trajectories if first else None) if ref_i is not None else None,
            )  # fmt: skip
            res = probe.run(out)
            done.append(res)
            methods |= res.methods
            n_records += outputs.write_records(rec_f, res.records)
            res.records = []  # written; keep memory flat

    results = [r for res in done for r in res.results]
    common = _common_erank(done, p.erank_draws, p.seed)
    notes = sorted({n for res in done for n in res.notes})
    summary = {
        "caveat": CAVEAT,
        "checkpoints": [res.info for res in done],
        "results": results,
        "n_records": n_records,
        "record_grain": p.record_grain,
        "gradient_method": sorted(methods),
        "bins": {
            "frozen_from": plan.checkpoints[ref_i].label if ref_i is not None else None,
            "edges": done[0].edges if ref_i is not None and done else None,
        },
        "effective_rank_common_n": common,
        "entropy_pattern_overlap": _overlap(done) if ref_i is not None else None,
        "n_ungradable": sum(res.info["n_ungradable"] for res in done),
        "n_nonfinite": {
            "tokens": sum(res.info["n_nonfinite_tokens"] for res in done),
            "gradient_vectors": sum(r["n_nonfinite"] for r in results),
        },
        "warnings": notes,
        "settings": {
            "task": plan.task, "dataset": plan.dataset, "split": p.split, "num_prompts": len(problems),
            "num_samples": p.num_samples, "temperature": p.temperature, "max_new_tokens": plan.max_new_tokens,
            "entropy_bins": p.entropy_bins, "max_positions_per_group": p.max_positions_per_group,
            "max_positions_per_trajectory": p.max_positions_per_trajectory, "seed": p.seed,
            "layer_indices": p.layer_indices, "row_spec": p.row_spec, "row_mode": p.row_mode,
            "bootstrap": p.bootstrap, "sampler": resolve_sampler(p.sampler), "prompt_format": p.prompt_format,
        },
    }  # fmt: skip
    # NaN/inf are written as null (strict JSON): say how many, so a null is never a silent NaN
    summary["n_nonfinite"]["written_as_null"] = outputs.count_nonfinite(summary)
    outputs.write_json(out / outputs.SUMMARY, summary)
    plots = [outputs.plot_name(res.info["label"]) for res in done]
    if summary["entropy_pattern_overlap"]:
        outputs.plot_overlap(out / outputs.OVERLAP_PLOT, summary["entropy_pattern_overlap"])
        plots.append(outputs.OVERLAP_PLOT)
    manifests = [res.manifest for res in done]
    outputs.write_json(
        out / outputs.MANIFEST,
        {
            "params": p.model_dump(),
            "resolved": {
                "task": plan.task, "dataset": plan.dataset, "reward": plan.reward,
                "max_new_tokens": plan.max_new_tokens, "device": str(dev), "num_prompts": len(problems),
            },  # fmt: skip
            "caveat": CAVEAT,
            "checkpoints": manifests,
            "versions": outputs.versions(),
            "gradient_method": sorted(methods),
            "n_records": n_records,
            "files": [outputs.SUMMARY, outputs.RECORDS, outputs.MANIFEST, *plots],
            "started_at": started_at,
            "finished_at": time.time(),
            "timings_s": {"total": time.perf_counter() - t_job, **{m["label"]: m["timings_s"] for m in manifests}},
        },
    )
    return outputs.clean(summary)


def _common_erank(done: list[CheckpointResult], draws: int, seed: int) -> dict[str, int | None]:
    """Effective rank at one n per (target, row set) for the whole job: the smallest cell n >= 2 over every
    checkpoint (erank grows with n, so cells and checkpoints are compared at the same n). Fills each result's
    `effective_rank_common_n` / `n_common`; returns {'<target>|<row set>': n}."""
    pairs = [(r, gram) for res in done for r, gram in zip(res.results, res.grams, strict=True)]
    ns: dict[str, int | None] = {}
    for r, _ in pairs:
        key = f"{r['target']}|{r['row_set']}"
        n = r["n"] if r["n"] >= 2 else None
        cur = ns.get(key)
        ns[key] = n if cur is None else (cur if n is None else min(cur, n))
    for r, (g, d) in pairs:
        n_common = ns[f"{r['target']}|{r['row_set']}"]
        r["n_common"] = n_common
        r["effective_rank_common_n"] = erank_at_n(g, d, n_common, draws=draws, seed=seed) if n_common else None
    return ns


def _overlap(done: list[CheckpointResult]) -> dict | None:
    """The entropy-pattern overlap: the reference checkpoint's responses teacher-forced under every
    checkpoint; the fraction of the reference's top-20% entropy positions that are top-20% there too
    (per checkpoint, over all pooled response tokens)."""
    ref = done[0]
    if ref.overlap_entropy is None or not ref.overlap_entropy.numel():
        return None
    base = top_frac_mask(ref.overlap_entropy, OVERLAP_TOP_FRAC)
    per = {}
    for res in done:
        if res.overlap_entropy is None or res.overlap_entropy.numel() != base.numel():
            per[res.info["label"]] = None
            continue
        mask = top_frac_mask(res.overlap_entropy, OVERLAP_TOP_FRAC)
        per[res.info["label"]] = float((mask & base).sum()) / float(base.sum())
    return {
        "reference": ref.info["label"], "top_frac": OVERLAP_TOP_FRAC, "n_tokens": int(base.numel()),
        "overlap": per,
    }  # fmt: skip
