"""Entropy-gradient probe (algorithms.md §4).

For a set of checkpoints: sample responses, bin every response token by its policy entropy, pick positions
per (entropy bin x correctness) cell, compute the *exact* gradient of logp(token) with respect to chosen
rows of chosen weight matrices, and summarize those gradients per cell (norm, cosine, energy fraction,
effective rank).

    from forkrl.probe import ProbeParams, run_probe
    summary = run_probe(ProbeParams(checkpoints=["runs/x/checkpoints/step_000020"]), out_dir="probe_out")

Modules:
    gradients  exact batched per-position row gradients (forward hooks + is_grads_batched VJP)
    metrics    float64 cell statistics (§4.3)
    sampling   seeded batched sampling with a KV cache, EOS trimming, grading, the no-grad entropy pass
    job        the whole job: checkpoints -> sampling -> bins -> selection -> gradients -> files
"""

from __future__ import annotations

from typing import Any

__all__ = ["ProbeCancelled", "ProbeParams", "resolve_checkpoints", "run_probe"]


def __getattr__(name: str) -> Any:
    # lazy: `forkrl.probe.gradients` and `.metrics` stay importable without pulling in the job machinery
    if name in __all__:
        from forkrl.probe import job

        return getattr(job, name)
    raise AttributeError(f"module 'forkrl.probe' has no attribute {name!r}")
