"""Entropy-gradient probe (algorithms.md §4).

For a set of checkpoints: sample responses, bin every response token by its policy entropy, pick positions
per (entropy bin x correctness) cell, compute the *exact* gradient of logp(token) with respect to chosen
rows of chosen weight matrices, and summarize those gradients per cell (norm, cosine, energy fraction,
effective rank).

    from forkrl.probe import ProbeParams, run_probe
    summary = run_probe(ProbeParams(checkpoints=["runs/x/checkpoints/step_000020"]), out_dir="probe_out")

Modules:
    params       ProbeParams: every knob of a job, one pydantic model (HTTP body, job, CLI)
    checkpoints  which checkpoints a job reads (typed errors), loading one
    job          plan_probe (every check that needs no model) and run_probe (the whole job)
    worker       one checkpoint: sampling -> bins -> selection -> gradients -> statistics
    outputs      summary.json, token_probe_records.jsonl, manifest.json, plots
    sampling     trajectories (forkrl.models.sampling underneath), grading, the entropy pass, bins, selection
    gradients    exact batched per-position row gradients (forward hooks + is_grads_batched VJP)
    metrics      float64 cell statistics (§4.3), effective rank at a given n
    bootstrap    cluster-bootstrap 95% intervals of the cell statistics (trajectories resampled)
    __main__     the CLI: `python -m forkrl.probe --help` (the seed script's flags)

Caveat: per-token log-prob gradients under teacher forcing, not a token's exact contribution to the trainer's
aggregated DAPO/GRPO objective (params.CAVEAT).
"""

from __future__ import annotations

from typing import Any

__all__ = ["ProbeCancelled", "ProbeParams", "ProbePlan", "plan_probe", "run_probe"]

_HOME = {
    "ProbeParams": "params",
    "ProbeCancelled": "worker",
    "ProbePlan": "job",
    "plan_probe": "job",
    "run_probe": "job",
}


def __getattr__(name: str) -> Any:
    # lazy: `forkrl.probe.params`, `.gradients` and `.metrics` stay importable without the job machinery
    if name in _HOME:
        import importlib

        return getattr(importlib.import_module(f"forkrl.probe.{_HOME[name]}"), name)
    raise AttributeError(f"module 'forkrl.probe' has no attribute {name!r}")
