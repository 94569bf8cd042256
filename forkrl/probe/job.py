"""The whole probe job (algorithms.md §4): checkpoints -> samples -> entropy bins -> positions -> exact
gradients -> cell statistics -> files.

    from forkrl.probe import ProbeParams, run_probe
    params = ProbeParams(checkpoint_root="runs/x/checkpoints", steps=[20, 80], include_final=True)
    summary = run_probe(params, "probe_out", progress=lambda done, total, stage: print(done, total, stage))

For each checkpoint (same prompts and seed for every checkpoint):
1. load it (safetensors only, eager attention), sample `group_size` responses per prompt at T, grade them;
2. no-grad entropy pass at T (optionally also at T = 1);
3. rank-bin every response token (sampling.rank_bins);
4. per (bin x correct/incorrect) cell pick up to `max_positions_per_group` positions, at most
   `max_positions_per_trajectory` from one trajectory within a cell; degenerate groups (all correct or all
   wrong: advantage 0) are flagged, or left out with `exclude_degenerate_groups`;
5. exact per-position row gradients (gradients.py), then the §4.3 statistics per (cell x target x row set).

Outputs, each written to a temp file and renamed into place: summary.json, token_probe_records.jsonl,
manifest.json, plot_<checkpoint>.png.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from forkrl.files import atomic_file, atomic_write, atomic_write_json, sha256_file
from forkrl.probe.gradients import METHODS, ProbeTarget, build_targets, exact_row_grads
from forkrl.probe.metrics import cell_metrics, drop_tiny
from forkrl.probe.sampling import (
    Trajectory,
    grade,
    pad_right,
    rank_bins,
    resolve_reward_name,
    sample_trajectories,
    seeded_generator,
    select_positions,
    token_stats,
)
from forkrl.weights.safetensors import checkpoint_files

__all__ = [
    "CheckpointNotFound",
    "CheckpointRef",
    "ProbeCancelled",
    "ProbeParams",
    "list_steps",
    "load_checkpoint",
    "load_prompts",
    "resolve_checkpoints",
    "run_probe",
    "validate_params",
    "weight_files",
]

STEP_RE = re.compile(r"^step_(\d{6,})$")
ProgressFn = Callable[[int, int, str], None]


class ProbeCancelled(Exception):
    """Raised inside the job when its cancel check says so."""


class CheckpointNotFound(FileNotFoundError):
    """Requested steps that do not exist; carries what does."""

    def __init__(self, root: Path, missing: list[int], available: list[int], has_final: bool, final_missing: bool):
        self.root, self.missing, self.available, self.has_final = root, missing, available, has_final
        what = ([f"steps {missing}"] if missing else []) + (["final"] if final_missing else [])
        super().__init__(
            f"{' and '.join(what)} not found under {root}; available steps: {available}"
            + (" (and final)" if has_final else " (no final)")
        )


@dataclass
class ProbeParams:
    """All knobs of one probe job. Defaults follow algorithms.md §4 and §7; the service schema documents each."""

    checkpoint_root: str | None = None
    steps: list[int] = field(default_factory=list)
    include_final: bool = False
    checkpoints: list[str] = field(default_factory=list)
    model: str | None = None
    task: str = ""
    dataset: str = ""
    split: str = "train"
    reward: str = ""
    num_prompts: int = 16
    group_size: int = 8
    temperature: float = 1.0
    max_new_tokens: int = 0
    seed: int = 0
    entropy_bins: int = 5
    max_positions_per_group: int = 64
    max_positions_per_trajectory: int = 4
    exclude_degenerate_groups: bool = False
    entropy_at_t1: bool = False
    modules: list[str] = field(default_factory=lambda: ["k_proj", "down_proj"])
    layers: list[int] = field(default_factory=lambda: [0, -1])
    row_specs: list[str] = field(default_factory=lambda: ["random:32"])
    whole_kv_heads: bool = True
    proj_k: list[int] = field(default_factory=lambda: [1, 4, 16])
    erank_draws: int = 20
    grad_chunk_size: int = 16
    grad_method: str = "vmap"
    sample_batch_size: int = 64
    dtype: str = "float32"
    device: str = "auto"


@dataclass
class CheckpointRef:
    label: str
    path: Path
    step: int | None = None


# ---------------------------------------------------------------------------------------------- checkpoints


def list_steps(root: Path) -> tuple[dict[int, Path], bool]:
    """`step_NNNNNN` dirs under a checkpoint root (by step) and whether `final/` exists."""
    steps: dict[int, Path] = {}
    if root.is_dir():
        for p in root.iterdir():
            m = STEP_RE.match(p.name)
            if m and p.is_dir():
                steps[int(m.group(1))] = p
    return dict(sorted(steps.items())), (root / "final").is_dir()


def resolve_checkpoints(params: ProbeParams) -> list[CheckpointRef]:
    """Base model (if any), then the requested steps ascending, then final, then explicit paths."""
    refs: list[CheckpointRef] = [CheckpointRef("base", Path(params.model))] if params.model else []
    if params.steps or params.include_final:
        if not params.checkpoint_root:
            raise ValueError("steps and include_final need checkpoint_root")
        root = Path(params.checkpoint_root)
        if not root.is_dir():
            raise FileNotFoundError(f"checkpoint_root {root} is not a directory")
        available, has_final = list_steps(root)
        missing = [s for s in params.steps if s not in available]
        final_missing = params.include_final and not has_final
        if missing or final_missing:
            raise CheckpointNotFound(root, missing, list(available), has_final, final_missing)
        refs += [CheckpointRef(available[s].name, available[s], s) for s in sorted(set(params.steps))]
        if params.include_final:
            refs.append(CheckpointRef("final", root / "final"))
    refs += [CheckpointRef(Path(p).name or "checkpoint", Path(p)) for p in params.checkpoints]
    if not refs:
        raise ValueError("no checkpoint to probe: give checkpoint_root with steps/include_final, checkpoints, or model")
    seen: dict[str, int] = {}
    for r in refs:  # unique, filesystem-safe labels (they name the plot files)
        base = re.sub(r"[^A-Za-z0-9_.-]", "_", r.label)
        seen[base] = seen.get(base, 0) + 1
        r.label = base if seen[base] == 1 else f"{base}-{seen[base]}"
    return refs


def weight_files(path: Path) -> list[Path]:
    """The model's safetensors weight files (plus a shard index, if any); never the optimizer state."""
    return checkpoint_files(path) + sorted(path.glob("*.safetensors.index.json"))


def load_checkpoint(path: Path, dtype: torch.dtype, device: torch.device, tokenizer_fallback: Path | None = None):
    """Model and tokenizer of a HF checkpoint dir. Refuses a checkpoint without safetensors weights: .bin/.pt
    weights would be unpickled, which can run arbitrary code."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json: not a HF checkpoint directory")
    if not any(p.suffix == ".safetensors" for p in weight_files(path)):
        raise ValueError(f"{path} has no *.safetensors weights; refusing to load pickled (.bin/.pt) weights")
    model = AutoModelForCausalLM.from_pretrained(
        path, use_safetensors=True, dtype=dtype, attn_implementation="eager", trust_remote_code=False
    )
    model.to(device).eval().requires_grad_(False)
    if getattr(model, "is_gradient_checkpointing", False):
        model.gradient_checkpointing_disable()  # recomputation would fire the probe's hooks twice
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):
        if tokenizer_fallback is None:
            raise
        tok = AutoTokenizer.from_pretrained(tokenizer_fallback)
    return model, tok


def _eos_and_pad(model, tok) -> tuple[list[int], int]:
    eos: set[int] = set()
    for src in (tok.eos_token_id, getattr(model.generation_config, "eos_token_id", None), model.config.eos_token_id):
        if isinstance(src, int):
            eos.add(src)
        elif isinstance(src, (list, tuple)):
            eos.update(int(x) for x in src)
    if not eos:
        raise ValueError("the checkpoint defines no EOS token")
    return sorted(eos), int(tok.pad_token_id if tok.pad_token_id is not None else min(eos))


# ------------------------------------------------------------------------------------------------- prompts


def resolve_task(params: ProbeParams) -> tuple[str, str]:
    """(task, dataset) as training resolves them: a dataset wins; neither -> $RL_DATASET_PATH, else the
    default task."""
    from forkrl.data import tasks

    if params.task and params.dataset:
        raise ValueError("task and dataset are mutually exclusive: give one")
    if params.dataset or params.task:
        return params.task, params.dataset
    env = os.environ.get("RL_DATASET_PATH", "")
    return ("", env) if env else (tasks.DEFAULT_TASK, "")


def load_prompts(params: ProbeParams) -> tuple[list, int]:
    """The job's problems and the default max_new_tokens (the task's, or 1024 for a dataset)."""
    from forkrl.data import tasks
    from forkrl.data.datasets import load_problems

    task, dataset = resolve_task(params)
    default_new = tasks.get_task(task).max_new_tokens if task else 1024
    problems = load_problems(task or None, dataset or None, params.split, params.num_prompts, params.seed)
    return list(problems), default_new


def validate_params(p: ProbeParams) -> None:
    """Semantic checks that need no model; raises ValueError with a plain message."""
    from forkrl.data import tasks

    task, dataset = resolve_task(p)
    if task:
        tasks.get_task(task)  # names the known tasks when it fails
    elif not Path(dataset.replace("{split}", p.split)).is_file():
        raise ValueError(f"dataset {dataset} is not a file")
    if p.split not in tasks.SPLITS:
        raise ValueError(f"split must be one of {tasks.SPLITS}, got {p.split!r}")
    if p.reward:
        from forkrl.data.rewards import get_reward_fn

        get_reward_fn(p.reward)
    if p.dtype not in ("float32", "float64", "bfloat16", "float16"):
        raise ValueError(f"dtype must be float32, float64, bfloat16 or float16, got {p.dtype!r}")
    if p.grad_method not in METHODS:
        raise ValueError(f"grad_method must be one of {METHODS}, got {p.grad_method!r}")
    for name in ("num_prompts", "group_size", "entropy_bins", "max_positions_per_group",
                 "max_positions_per_trajectory", "grad_chunk_size", "sample_batch_size", "erank_draws"):  # fmt: skip
        if getattr(p, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(p, name)}")
    if not p.temperature > 0:
        raise ValueError(f"temperature must be > 0, got {p.temperature}")


# ------------------------------------------------------------------------------------------------- outputs


def _clean(x: Any) -> Any:
    """NaN/inf -> None: the JSON stays strict and a NaN can never hide in a summary."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, Path):
        return str(x)
    return x


def write_json(path: Path, data: Any) -> None:
    atomic_write_json(path, _clean(data), allow_nan=False)


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


def _versions() -> dict[str, str]:
    import transformers

    import forkrl

    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "forkrl": getattr(forkrl, "__version__", "unknown"),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


# ----------------------------------------------------------------------------------------------------- job


class _Progress:
    """done/total in work units: per checkpoint 1 (sampling) + 1 (entropy) + one per probed position."""

    def __init__(self, fn: ProgressFn | None, cancel: Callable[[], bool] | None, n_ckpt: int, guess: int):
        self.fn, self.cancel, self.done = fn, cancel, 0
        self.planned = [2 + guess] * n_ckpt

    def check(self) -> None:
        if self.cancel is not None and self.cancel():
            raise ProbeCancelled("cancelled")

    def plan(self, i: int, n_positions: int) -> None:
        self.planned[i] = 2 + n_positions
        self.advance(0, "")

    def advance(self, n: int, stage: str) -> None:
        self.done += n
        if self.fn is not None:
            self.fn(self.done, max(sum(self.planned), self.done), stage)
        self.check()


def run_probe(
    params: ProbeParams,
    out_dir: str | Path,
    *,
    progress: ProgressFn | None = None,
    should_cancel: Callable[[], bool] | None = None,
) -> dict:
    """Run the whole job, write its files into `out_dir`, return the summary dict."""
    validate_params(params)
    t_job, started_at = time.perf_counter(), time.time()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    refs = resolve_checkpoints(params)
    auto = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(auto if params.device == "auto" else params.device)
    problems, default_new = load_prompts(params)
    max_new = params.max_new_tokens or default_new
    prog = _Progress(progress, should_cancel, len(refs), params.entropy_bins * 2 * params.max_positions_per_group)
    prog.advance(0, "starting")

    infos, results, manifests, methods = [], [], [], set()
    n_records = 0
    with atomic_file(out / "token_probe_records.jsonl") as rec_f:
        for ci, ref in enumerate(refs):
            probe = _CheckpointProbe(ci, ref, params, problems, max_new, device, prog)
            info, cres, recs, man = probe.run(out)
            infos.append(info)
            results.extend(cres)
            manifests.append(man)
            methods |= probe.methods
            rec_f.writelines(json.dumps(_clean(r), allow_nan=False) + "\n" for r in recs)
            n_records += len(recs)

    task, dataset = resolve_task(params)
    summary = {
        "checkpoints": infos,
        "results": results,
        "n_records": n_records,
        "gradient_method": sorted(methods),
        "settings": {
            "task": task, "dataset": dataset, "split": params.split, "num_prompts": len(problems),
            "group_size": params.group_size, "temperature": params.temperature, "max_new_tokens": max_new,
            "entropy_bins": params.entropy_bins, "max_positions_per_group": params.max_positions_per_group,
            "max_positions_per_trajectory": params.max_positions_per_trajectory, "seed": params.seed,
        },
    }  # fmt: skip
    write_json(out / "summary.json", summary)
    write_json(
        out / "manifest.json",
        {
            "params": dataclasses.asdict(params),
            "resolved": {
                "task": task,
                "dataset": dataset,
                "reward": resolve_reward_name(params.reward, dataset),
                "max_new_tokens": max_new,
                "device": str(device),
                "num_prompts": len(problems),
            },  # fmt: skip
            "checkpoints": manifests,
            "versions": _versions(),
            "gradient_method": sorted(methods),
            "n_records": n_records,
            "files": ["summary.json", "token_probe_records.jsonl", "manifest.json"]
            + [f"plot_{c['label']}.png" for c in infos],
            "started_at": started_at,
            "finished_at": time.time(),
            "timings_s": {"total": time.perf_counter() - t_job, **{m["label"]: m["timings_s"] for m in manifests}},
        },
    )
    return _clean(summary)


class _CheckpointProbe:
    """Everything done for one checkpoint; `run` returns (summary info, cell results, records, manifest)."""

    def __init__(self, index, ref, params, problems, max_new, device, prog):
        self.index, self.ref, self.p, self.problems = index, ref, params, problems
        self.max_new, self.device, self.prog = max_new, device, prog
        self.timings: dict[str, float] = {}
        self.methods: set[str] = set()

    def _timed(self, name: str, t0: float) -> None:
        self.timings[name] = time.perf_counter() - t0

    def run(self, out: Path):
        p, ref, prog = self.p, self.ref, self.prog
        t0 = time.perf_counter()
        hashes = [{"file": f.name, "sha256": sha256_file(f), "bytes": f.stat().st_size} for f in weight_files(ref.path)]
        model, tok = load_checkpoint(ref.path, getattr(torch, p.dtype), self.device, Path(p.model) if p.model else None)
        eos, pad = _eos_and_pad(model, tok)
        self._timed("load", t0)
        prog.check()

        t0 = time.perf_counter()
        trajs = sample_trajectories(
            model, [tok(q.prompt)["input_ids"] for q in self.problems], group_size=p.group_size,
            temperature=p.temperature, max_new_tokens=self.max_new, seed=p.seed, eos_ids=eos, pad_id=pad,
            batch_size=p.sample_batch_size, check=prog.check,
        )  # fmt: skip
        grade(trajs, tok, self.problems, p.reward, resolve_task(p)[1])
        self._timed("sample", t0)
        prog.advance(1, f"{ref.label}: sampled {len(trajs)} responses")

        t0 = time.perf_counter()
        stats = token_stats(model, trajs, temperature=p.temperature, also_t1=p.entropy_at_t1,
                            batch_size=p.sample_batch_size, pad_id=pad, check=prog.check)  # fmt: skip
        self._timed("entropy", t0)
        prog.advance(1, f"{ref.label}: entropy pass")

        tab = _TokenTable(trajs, stats)
        eligible = ~tab.degenerate_of if p.exclude_degenerate_groups else torch.ones_like(tab.correct_of)
        bins = rank_bins(tab.entropy, p.entropy_bins, seeded_generator(p.seed, "bins", ref.label))
        chosen, available = select_positions(
            bins, tab.traj_of, tab.correct_of, eligible, n_bins=p.entropy_bins, per_cell=p.max_positions_per_group,
            per_traj=p.max_positions_per_trajectory, seed=p.seed, salt=ref.label,
        )  # fmt: skip
        selected = [(cell, i) for cell, idx in chosen.items() for i in idx]
        prog.plan(self.index, len(selected))

        t0 = time.perf_counter()
        targets = build_targets(model, p.modules, p.layers, p.row_specs, seed=p.seed, whole_kv_heads=p.whole_kv_heads)
        grads, logp_grad = self._gradients(model, trajs, tab, selected, targets, pad)
        self._timed("gradients", t0)

        t0 = time.perf_counter()
        cres = self._cell_results(tab, selected, targets, grads)
        self._timed("metrics", t0)

        recs = self._records(tok, trajs, tab, selected, targets, grads, eos)
        info = self._info(trajs, tab, bins, chosen, available, selected)
        t0 = time.perf_counter()
        plot_checkpoint(out / f"plot_{ref.label}.png", ref.label, cres, p.entropy_bins)
        self._timed("plot", t0)
        logp_gap = max((abs(logp_grad[j] - float(tab.logp[i])) for j, (_, i) in enumerate(selected)), default=0.0)
        man = {
            "label": ref.label,
            "path": str(ref.path),
            "weight_files": hashes,
            "targets": [{"name": t.name, "row_sets": {rs.spec: list(rs.rows) for rs in t.row_sets}} for t in targets],
            # the gradient pass recomputes logp from scratch; it must agree with the entropy pass
            "max_abs_logp_gap_entropy_vs_grad_pass": logp_gap,
            "timings_s": self.timings,
        }
        return info, cres, recs, man

    def _gradients(self, model, trajs, tab, selected, targets: list[ProbeTarget], pad: int):
        """Row gradients of every selected position; trajectories go in right-padded batches of about
        `grad_chunk_size` positions (vmap/loop then run one trajectory at a time, replicate one row each)."""
        p = self.p
        by_traj: dict[int, list[int]] = {}
        for j, (_, i) in enumerate(selected):
            by_traj.setdefault(int(tab.traj_of[i]), []).append(j)
        grads: dict[str, list[torch.Tensor]] = {t.name: [None] * len(selected) for t in targets}
        logp_grad = [0.0] * len(selected)
        order = sorted(by_traj)
        batch: list[int] = []
        for k, tr in enumerate(order):
            batch.append(tr)
            if sum(len(by_traj[x]) for x in batch) < p.grad_chunk_size and k < len(order) - 1:
                continue
            ids, attn = pad_right([trajs[x].ids for x in batch], pad, self.device)
            js = [j for x in batch for j in by_traj[x]]
            positions = [
                (b, len(trajs[x].prompt_ids) + int(tab.resp_pos[selected[j][1]]))
                for b, x in enumerate(batch)
                for j in by_traj[x]
            ]
            res = exact_row_grads(model, ids, attn, positions, targets, temperature=p.temperature,
                                  chunk_size=p.grad_chunk_size, method=p.grad_method)  # fmt: skip
            self.methods.add(res.method)
            for n, g in res.grads.items():
                g = g.cpu()
                for q, j in enumerate(js):
                    grads[n][j] = g[q]
            for q, j in enumerate(js):
                logp_grad[j] = float(res.logp[q])
            batch = []
            self.prog.advance(len(js), f"{self.ref.label}: gradients")
        return grads, logp_grad

    def _cell_results(self, tab, selected, targets: list[ProbeTarget], grads) -> list[dict]:
        """§4.3 statistics per cell x target x row set; erank also at the smallest n among this checkpoint's
        cells (erank grows with n, so cells are compared at a common n)."""
        p = self.p
        cell_rows: dict[tuple[int, bool], list[int]] = {}
        for j, (cell, _) in enumerate(selected):
            cell_rows.setdefault(cell, []).append(j)
        cells = sorted(cell_rows.items(), key=lambda kv: (kv[0][0], not kv[0][1]))
        out: list[dict] = []
        for t in targets:
            if not selected:
                break
            stacked = torch.stack(grads[t.name])
            for rs in t.row_sets:
                ridx = t.row_index(rs)
                blocks = {cell: stacked[js][:, ridx].double() for cell, js in cells}
                kept = [drop_tiny(b.reshape(b.shape[0], -1))[0].shape[0] for b in blocks.values()]
                n_common = min((n for n in kept if n >= 2), default=None)
                for cell, js in cells:
                    m = cell_metrics(blocks[cell], [int(tab.traj_of[selected[j][1]]) for j in js], ks=p.proj_k,
                                     seed=p.seed, n_common=n_common, erank_draws=p.erank_draws)  # fmt: skip
                    out.append({
                        "checkpoint": self.ref.label, "bin": cell[0], "correct": cell[1], "target": t.name,
                        "module": t.module, "layer": t.layer, "row_set": rs.spec, "n_rows": len(rs.rows),
                        "n_selected": len(js), **m,
                    })  # fmt: skip
            self.prog.check()
        return out

    def _records(self, tok, trajs, tab, selected, targets: list[ProbeTarget], grads, eos) -> list[dict]:
        row_idx = {t.name: {rs.spec: t.row_index(rs) for rs in t.row_sets} for t in targets}
        recs = []
        for j, ((b, c), i) in enumerate(selected):
            tr = trajs[int(tab.traj_of[i])]
            rp = int(tab.resp_pos[i])
            tid = tr.response_ids[rp]
            rec = {
                "checkpoint": self.ref.label, "trajectory": tr.index, "prompt_index": tr.prompt_index,
                "position": len(tr.prompt_ids) + rp, "response_position": rp, "token_id": tid,
                "token_text": tok.decode([tid]), "is_eos": tid in eos, "entropy": float(tab.entropy[i]),
                "logp": float(tab.logp[i]), "bin": b, "correct": c, "reward": tr.reward,
                "degenerate_group": bool(tab.degenerate_t[tr.index]),
            }  # fmt: skip
            if tab.entropy_t1 is not None:
                rec["entropy_t1"] = float(tab.entropy_t1[i])
            rec["grad_norms"] = {
                f"{t.name}|{spec}": float(grads[t.name][j][ri].double().norm())
                for t in targets
                for spec, ri in row_idx[t.name].items()
            }
            recs.append(rec)
        return recs

    def _info(self, trajs, tab, bins, chosen, available, selected) -> dict:
        n_tok, nt = int(tab.entropy.numel()), max(len(trajs), 1)
        k = self.p.entropy_bins
        return {
            "label": self.ref.label,
            "path": str(self.ref.path),
            "step": self.ref.step,
            "n_trajectories": len(trajs),
            "n_prompts": len(self.problems),
            "accuracy": sum(t.correct for t in trajs) / nt,
            "finished_frac": sum(t.finished for t in trajs) / nt,
            "mean_response_tokens": n_tok / nt,
            "n_response_tokens": n_tok,
            "mean_entropy": float(tab.entropy.mean()) if n_tok else None,
            "frac_entropy_below_1e-2": float((tab.entropy < 1e-2).double().mean()) if n_tok else None,
            "bin_upper_entropy": [
                float(tab.entropy[bins == b].max()) if bool((bins == b).any()) else None for b in range(k)
            ],  # fmt: skip
            "n_degenerate_groups": tab.n_degenerate_groups,
            "n_selected": len(selected),
            "cells": [
                {
                    "bin": b,
                    "correct": c,
                    "n_available": available[(b, c)],
                    "n_selected": len(chosen[(b, c)]),
                    "n_trajectories": len({int(tab.traj_of[i]) for i in chosen[(b, c)]}),
                }
                for b in range(k)
                for c in (True, False)
            ],  # fmt: skip
        }


class _TokenTable:
    """Every response token of every trajectory (no prompt, no padding), flattened."""

    def __init__(self, trajs: list[Trajectory], stats):
        self.traj_of = torch.cat([torch.full((t.n_response,), t.index, dtype=torch.long) for t in trajs])
        self.resp_pos = torch.cat([torch.arange(t.n_response) for t in trajs])
        self.entropy = torch.cat([s.entropy for s in stats])
        self.logp = torch.cat([s.logp for s in stats])
        t1 = [s.entropy_t1 for s in stats]
        self.entropy_t1 = torch.cat(t1) if t1 and t1[0] is not None else None
        groups: dict[int, list[bool]] = {}
        for t in trajs:
            groups.setdefault(t.prompt_index, []).append(t.correct)
        # advantage is 0 in all-correct and all-wrong groups (§4.1)
        degenerate = {q: all(v) or not any(v) for q, v in groups.items()}
        self.n_degenerate_groups = sum(degenerate.values())
        self.degenerate_t = torch.tensor([degenerate[t.prompt_index] for t in trajs])
        self.correct_of = torch.tensor([t.correct for t in trajs])[self.traj_of]
        self.degenerate_of = self.degenerate_t[self.traj_of]
