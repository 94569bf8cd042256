"""One checkpoint of a probe job (algorithms.md §4): load -> sample and grade -> entropy pass -> rank bins ->
positions per (bin x correct) cell -> exact row gradients -> cell statistics, records, plot.

`CheckpointProbe(...).run(out_dir)` returns a `CheckpointResult`; the job (job.py) runs one per checkpoint
with the same prompts and seed, and writes the files. Progress and cancellation go through `Progress`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from forkrl.files import sha256_file
from forkrl.probe.bootstrap import bootstrap_ci
from forkrl.probe.checkpoints import CheckpointRef, eos_and_pad, load_checkpoint, weight_files
from forkrl.probe.engines import encode_prompts, resolve_sampler, sample_with_rollout, sample_with_vllm
from forkrl.probe.gradients import ProbeTarget, build_targets, exact_row_grads
from forkrl.probe.metrics import cell_metrics
from forkrl.probe.outputs import plot_checkpoint, plot_name
from forkrl.probe.params import ProbeParams
from forkrl.probe.sampling import (
    Trajectory,
    bin_edges,
    edge_bins,
    grade,
    pad_right,
    rank_bins,
    sample_trajectories,
    seeded_generator,
    select_positions,
    token_stats,
)

__all__ = ["CheckpointProbe", "CheckpointResult", "Progress", "ProbeCancelled"]

ProgressFn = Callable[[int, int, str], None]
CONTEXT_TOKENS = 16  # a record's context: this many tokens before the probed one, half as many after it


class ProbeCancelled(Exception):
    """Raised inside the job when its cancel check says so."""


class Progress:
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


@dataclass
class CheckpointResult:
    info: dict  # summary["checkpoints"] entry
    results: list[dict]  # summary["results"] entries
    records: list[dict]  # token_probe_records.jsonl lines
    manifest: dict  # manifest["checkpoints"] entry
    methods: set[str] = field(default_factory=set)  # gradient methods that actually ran
    grams: list[tuple[torch.Tensor, int]] = field(default_factory=list)  # per result: its (kept) Gram, D
    edges: list[float] = field(default_factory=list)  # the bin edges used (the reference's, or its own)
    trajectories: list[Trajectory] = field(default_factory=list)
    overlap_entropy: torch.Tensor | None = None  # entropy of the overlap responses under this checkpoint
    notes: list[str] = field(default_factory=list)  # warnings for summary.json


class CheckpointProbe:
    """Everything done for checkpoint number `index` of a job. `problems` are the job's prompts, `reward` the
    resolved reward name, `tokenizer_fallback` the base model dir (for checkpoints saved without tokenizer).
    `edges`: frozen bin edges of a reference checkpoint (None: rank bins of its own, whose edges it returns);
    `overlap_trajs`: the reference's responses, teacher-forced here for the entropy-pattern overlap."""

    def __init__(
        self,
        index: int,
        ref: CheckpointRef,
        params: ProbeParams,
        problems: Sequence,
        *,
        max_new_tokens: int,
        reward: str,
        tokenizer_fallback: Path | None,
        device: torch.device,
        progress: Progress,
        edges: list[float] | None = None,
        overlap_trajs: list[Trajectory] | None = None,
    ):
        self.edges, self.overlap_trajs = edges, overlap_trajs
        self.notes: list[str] = []
        self.index, self.ref, self.p, self.problems = index, ref, params, problems
        self.max_new, self.reward, self.tokenizer_fallback = max_new_tokens, reward, tokenizer_fallback
        self.device, self.prog = device, progress
        self.timings: dict[str, float] = {}
        self.methods: set[str] = set()
        self.sampler = resolve_sampler(params.sampler)

    def _timed(self, name: str, t0: float) -> None:
        self.timings[name] = time.perf_counter() - t0

    def run(self, out: Path) -> CheckpointResult:
        p, ref, prog = self.p, self.ref, self.prog
        t0 = time.perf_counter()
        hashes = [{"file": f.name, "sha256": sha256_file(f), "bytes": f.stat().st_size} for f in weight_files(ref.path)]
        model, tok = load_checkpoint(ref.path, getattr(torch, p.dtype), self.device, self.tokenizer_fallback)
        eos, pad = eos_and_pad(model, tok)
        self._timed("load", t0)
        prog.check()

        t0 = time.perf_counter()
        trajs = self._sample(model, tok, eos, pad)
        grade(trajs, tok, self.problems, self.reward, prompt_format=p.prompt_format)
        self._timed("sample", t0)
        prog.advance(1, f"{ref.label}: sampled {len(trajs)} responses ({self.sampler})")

        t0 = time.perf_counter()
        stats = token_stats(model, trajs, temperature=p.temperature, also_t1=p.entropy_at_t1,
                            batch_size=p.sample_batch_size, pad_id=pad, check=prog.check)  # fmt: skip
        overlap = torch.cat([s.entropy for s in stats]) if stats else torch.zeros(0, dtype=torch.float64)
        if self.overlap_trajs is not None:
            ostats = token_stats(model, self.overlap_trajs, temperature=p.temperature,
                                 batch_size=p.sample_batch_size, pad_id=pad, check=prog.check)  # fmt: skip
            overlap = torch.cat([s.entropy for s in ostats]) if ostats else torch.zeros(0, dtype=torch.float64)
        self._timed("entropy", t0)
        prog.advance(1, f"{ref.label}: entropy pass")

        tab = _TokenTable(trajs, stats)
        # ungradable samples (reward None) and tokens whose entropy/logp is NaN/inf never enter a cell
        eligible = tab.gradable_of & tab.finite
        if p.exclude_degenerate_groups:
            eligible &= ~tab.degenerate_of
        if self.edges is None:
            bins = rank_bins(tab.entropy, p.entropy_bins, seeded_generator(p.seed, "bins", ref.label))
            self.edges = bin_edges(tab.entropy, bins, p.entropy_bins)
        else:
            bins = edge_bins(tab.entropy, self.edges)
        chosen, available = select_positions(
            bins, tab.traj_of, tab.correct_of, eligible, n_bins=p.entropy_bins, per_cell=p.max_positions_per_group,
            per_traj=p.max_positions_per_trajectory, seed=p.seed, salt=ref.label,
        )  # fmt: skip
        selected = [(cell, i) for cell, idx in chosen.items() for i in idx]
        prog.plan(self.index, len(selected))

        t0 = time.perf_counter()
        targets = build_targets(model, p.modules, p.layer_indices, p.row_spec, seed=p.seed,
                                whole_kv_heads=p.whole_kv_heads, row_mode=p.row_mode, clamp_layers=p.clamp_layers,
                                notes=self.notes)  # fmt: skip
        grads, logp_grad = self._gradients(model, trajs, tab, selected, targets, pad)
        self._timed("gradients", t0)

        t0 = time.perf_counter()
        cres, grams = self._cell_results(tab, selected, targets, grads)
        self._timed("metrics", t0)

        recs = self._records(tok, trajs, tab, selected, targets, grads, eos)
        info = self._info(trajs, tab, bins, chosen, available, selected)
        t0 = time.perf_counter()
        plot_checkpoint(out / plot_name(ref.label), ref.label, cres, p.entropy_bins)
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
            "sampler": self.sampler,
        }
        return CheckpointResult(info, cres, recs, man, self.methods, grams, self.edges, trajs, overlap, self.notes)

    def _sample(self, model, tok, eos: list[int], pad: int) -> list[Trajectory]:
        """Responses from the job's sampler (forkrl.probe.engines); prompt-major, cut after the first EOS."""
        p = self.p
        ids = encode_prompts(tok, self.problems, p.prompt_format, p.system_prompt)  # as training encodes them
        kw = dict(group_size=p.num_samples, temperature=p.temperature, max_new_tokens=self.max_new, seed=p.seed,
                  eos_ids=eos)  # fmt: skip
        if self.sampler == "vllm":
            vt: dict[str, float] = {}
            out = sample_with_vllm(self.ref.path, ids, check=self.prog.check, notes=self.notes, timings=vt, **kw)
            self.timings.update({f"vllm_{k}": v for k, v in vt.items()})
            return out
        if self.sampler == "rollout":
            return sample_with_rollout(p.rollout_address, ids, check=self.prog.check, **kw)
        return sample_trajectories(model, ids, pad_id=pad, batch_size=p.sample_batch_size, check=self.prog.check,
                                   **kw)  # fmt: skip

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

    def _cell_results(self, tab, selected, targets: list[ProbeTarget], grads) -> tuple[list[dict], list]:
        """§4.3 statistics per cell x target x row set, with cluster-bootstrap 95% intervals (`ci95`). Each
        result's Gram matrix comes back too: the job computes effective rank at one n for all checkpoints."""
        p = self.p
        cell_rows: dict[tuple[int, bool], list[int]] = {}
        for j, (cell, _) in enumerate(selected):
            cell_rows.setdefault(cell, []).append(j)
        cells = sorted(cell_rows.items(), key=lambda kv: (kv[0][0], not kv[0][1]))
        out: list[dict] = []
        grams: list = []
        for t in targets:
            if not selected:
                break
            stacked = torch.stack(grads[t.name])
            for rs in t.row_sets:
                ridx = t.row_index(rs)
                for cell, js in cells:
                    block = stacked[js][:, ridx].double()
                    trajs = [int(tab.traj_of[selected[j][1]]) for j in js]
                    m = cell_metrics(block, trajs, ks=p.proj_k, seed=p.seed, n_common=None,
                                     erank_draws=p.erank_draws, keep_gram=True)  # fmt: skip
                    grams.append(m.pop("_gram"))
                    ci = bootstrap_ci(block, trajs, ks=p.proj_k, seed=p.seed, draws=p.bootstrap) if p.bootstrap else {}
                    out.append({
                        "checkpoint": self.ref.label, "bin": cell[0], "correct": cell[1], "target": t.name,
                        "parameter": t.name, "module": t.module, "layer": t.layer, "row_set": rs.spec,
                        "row": rs.spec, "rows": list(rs.rows), "n_rows": len(rs.rows), "n_selected": len(js),
                        **m, "ci95": ci,
                    })  # fmt: skip
            self.prog.check()
        return out, grams

    def _records(self, tok, trajs, tab, selected, targets: list[ProbeTarget], grads, eos) -> list[dict]:
        """record_grain "row": one record per token x parameter x row set (the seed's grain); "token": one per
        token with every grad norm in `grad_norms` ('<parameter>|<row spec>')."""
        row_idx = {t.name: {rs.spec: (rs, t.row_index(rs)) for rs in t.row_sets} for t in targets}
        recs = []
        for j, ((b, c), i) in enumerate(selected):
            tr = trajs[int(tab.traj_of[i])]
            rp = int(tab.resp_pos[i])
            tid = tr.response_ids[rp]
            rec = {
                "checkpoint": self.ref.label, "trajectory": tr.index, "prompt_index": tr.prompt_index,
                "position": len(tr.prompt_ids) + rp, "response_position": rp, "token_id": tid,
                "token_text": tok.decode([tid]), "is_eos": tid in eos,
                # the token in context (the report's examples): up to CONTEXT_TOKENS before it (prompt included)
                # and after it in the response
                "context_before": tok.decode((tr.prompt_ids + tr.response_ids[:rp])[-CONTEXT_TOKENS:],
                                             skip_special_tokens=True),
                "context_after": tok.decode(tr.response_ids[rp + 1:rp + 1 + CONTEXT_TOKENS // 2],
                                            skip_special_tokens=True),
                "entropy": float(tab.entropy[i]),
                "logp": float(tab.logp[i]), "bin": b, "correct": c, "reward": tr.reward,
                "degenerate_group": bool(tab.degenerate_t[tr.index]),
            }  # fmt: skip
            if tab.entropy_t1 is not None:
                rec["entropy_t1"] = float(tab.entropy_t1[i])
            norms = {
                (t.name, spec): float(grads[t.name][j][ri].double().norm())
                for t in targets
                for spec, (_, ri) in row_idx[t.name].items()
            }
            if self.p.record_grain == "token":
                recs.append({**rec, "grad_norms": {f"{n}|{spec}": v for (n, spec), v in norms.items()}})
                continue
            for t in targets:
                for spec, (rs, _) in row_idx[t.name].items():
                    recs.append({
                        **rec, "parameter": t.name, "module": t.module, "layer": t.layer, "row": spec,
                        "rows": list(rs.rows), "grad_norm": norms[(t.name, spec)],
                    })  # fmt: skip
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
            # ungradable samples (reward None) are excluded from cells and from accuracy, and counted here
            "n_ungradable": sum(t.reward is None for t in trajs),
            "accuracy": (
                sum(t.correct for t in trajs if t.reward is not None) / n_grad
                if (n_grad := sum(t.reward is not None for t in trajs)) else None
            ),
            "finished_frac": sum(t.finished for t in trajs) / nt,
            "mean_response_tokens": n_tok / nt,
            "n_response_tokens": n_tok,
            "mean_entropy": float(tab.entropy.mean()) if n_tok else None,
            "frac_entropy_below_1e-2": float((tab.entropy < 1e-2).double().mean()) if n_tok else None,
            "n_nonfinite_tokens": int((~tab.finite).sum()),
            "bin_edges": self.edges,
            "bin_counts": [int((bins == b).sum()) for b in range(k)],
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
        self.finite = torch.isfinite(self.entropy) & torch.isfinite(self.logp)
        groups: dict[int, list[bool]] = {}
        for t in trajs:
            if t.reward is not None:  # the advantage of a group is over its gradable samples
                groups.setdefault(t.prompt_index, []).append(t.correct)
        # advantage is 0 in all-correct and all-wrong groups (§4.1)
        degenerate = {q: all(v) or not any(v) for q, v in groups.items()}
        self.n_degenerate_groups = sum(degenerate.values())
        self.degenerate_t = torch.tensor([degenerate.get(t.prompt_index, True) for t in trajs], dtype=torch.bool)
        self.gradable_of = torch.tensor([t.reward is not None for t in trajs], dtype=torch.bool)[self.traj_of]
        self.correct_of = torch.tensor([t.correct for t in trajs])[self.traj_of]
        self.degenerate_of = self.degenerate_t[self.traj_of]
