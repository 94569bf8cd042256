"""The metrics of one train step (forkrl/rl/step.py): what each micro-batch adds, and the step's floats over
every update and every rank.

Per micro-batch, `record_micro` turns the loss's metrics (forkrl/rl/losses.py: shares of the update loss,
fractions of the micro-batch's kept or response tokens) back into sums and counts, and adds this rank's
entropy, |Δlogp| (π_old vs the engine's log-probs, algorithms.md §6 P6) and TIS statistics as float64 sums,
maxima and minima. An update's tally joins the step's only when the update ran to its end (`Tally.merge`).
`step_metrics` reduces the tallies over the ranks (SUM / MAX / MIN, one all_reduce each) and gathers the
response tokens' entropies in the 1-rank order for the quantiles, so every rank returns the same dict, equal
to one rank's within float32 rounding of the summation order (counts exactly).

The floats: loss, pg_loss, kl_loss are means over the updates run; grad_norm the mean pre-clip norm and
grad_norm_max the largest; clip fractions are over the kept tokens of all updates, ratio_mean over their
response tokens, ratio_min/max over all; kept_tokens and response_tokens summed over updates (E epochs count
every token E times); entropy statistics, mask_threshold (the lowest) and logp_delta_* over the tokens of every
update; n_updates (applied), skipped_updates (non-finite loss or gradient norm, no optimizer step),
micro_batches (the forward/backward slots every rank runs per epoch: forkrl/rl/microbatch.py); approx_kl_start =
the k3 estimate of KL(π_old ‖ π_θ) over the kept tokens of every update's loss pass, i.e. with the weights each
update starts from (0 when the step has one update: π_θ = π_old there; free: the loss pass has both log-probs);
approx_kl / approx_kl_all (after the last update, one more forward: forkrl/rl/step.py `kl_pass`) when asked for
and the step ran to its end; `stopped` = 1 when a stop cut it short after at least one applied update.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from forkrl.rl.collectives import gather_segments, reduce_floats, union_keys
from forkrl.rl.tis import tis_from_tally, tis_tally

__all__ = ["Tally", "quantiles", "record_micro", "step_metrics"]

_SUMMED = ("loss", "pg_loss", "kl_loss", "kept_tokens", "response_tokens")
_PER_UPDATE = ("loss", "pg_loss", "kl_loss")  # shares of one update's loss: averaged over updates


@dataclass
class Tally:
    """Float64 sums, maxima and minima by name (python floats: exact order, no device sync per add)."""

    sums: dict[str, float] = field(default_factory=dict)
    maxs: dict[str, float] = field(default_factory=dict)
    mins: dict[str, float] = field(default_factory=dict)
    entropies: list[Tensor] = field(default_factory=list)  # per micro-batch: response-token entropies
    grad_norms: list[float] = field(default_factory=list)  # per update (the global norm: equal on every rank)

    def add(self, key: str, v: float) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + v

    def hi(self, key: str, v: float) -> None:
        self.maxs[key] = max(self.maxs.get(key, v), v)

    def lo(self, key: str, v: float) -> None:
        self.mins[key] = min(self.mins.get(key, v), v)

    def merge(self, other: Tally) -> None:
        for k, v in other.sums.items():
            self.add(k, v)
        for k, v in other.maxs.items():
            self.hi(k, v)
        for k, v in other.mins.items():
            self.lo(k, v)
        self.entropies += other.entropies
        self.grad_norms += other.grad_norms

    def reduced(self, device: torch.device, group: dist.ProcessGroup | None) -> Tally:
        """The tally over every rank (keys: the union; a rank without a key adds 0 / -inf / +inf)."""
        keys = union_keys([f"s{k}" for k in self.sums] + [f"M{k}" for k in self.maxs] + [f"m{k}" for k in self.mins],
                          group)
        out = Tally(entropies=self.entropies, grad_norms=self.grad_norms)
        for tag, src, dst, empty, op in (("s", self.sums, out.sums, 0.0, "sum"),
                                         ("M", self.maxs, out.maxs, -math.inf, "max"),
                                         ("m", self.mins, out.mins, math.inf, "min")):
            names = [k[1:] for k in keys if k[0] == tag]
            dst.update(zip(names, reduce_floats([src.get(k, empty) for k in names], op, device, group), strict=True))
        return out


def record_micro(t: Tally, m: dict[str, float], ent: Tensor, delta: Tensor, kept: Tensor, threshold: float,
                 tis_raw: Tensor | None, tis_cap: float | None, log_ratio: Tensor) -> None:
    """Add one micro-batch: the loss metrics `m` of policy_loss, and over its response tokens (1-D, row-major)
    the entropies, |π_old − π_behav| log-prob gaps, the kept flags, the raw TIS ratios (None: TIS off) and the
    log-ratios log π_θ − log π_old of the loss pass (for approx_kl_start: k3 = e^d − d − 1 on the kept tokens)."""
    for key, v in m.items():
        if key == "ratio_max":
            t.hi(key, v)
        elif key == "ratio_min":
            t.lo(key, v)
        else:  # shares (summed) or fractions over this micro-batch's kept / response tokens: back to counts
            w = 1.0 if key in _SUMMED else m["kept_tokens"] if key.endswith("clip_frac") or "clip_frac_" in key \
                else m["response_tokens"]
            t.add(key, v * w)
    ent64, d64 = ent.double(), delta.double()
    lr64 = log_ratio.detach().double().clamp(-20.0, 20.0)
    t.entropies.append(ent.detach())
    ninf = torch.full((), -math.inf, dtype=torch.float64, device=d64.device)
    # one device sync for all of them (the response has >= 1 token: the micro-batch would not be trained else)
    e_sum, e_kept, d_sum, d_kept, d_max, d_kept_max, k3_kept = torch.stack([
        ent64.sum(), torch.where(kept, ent64, 0.0).sum(), d64.sum(), torch.where(kept, d64, 0.0).sum(),
        d64.max(), torch.where(kept, d64, ninf).max(), torch.where(kept, lr64.exp() - lr64 - 1.0, 0.0).sum()]).tolist()
    t.add("~entropy", e_sum)
    t.add("~entropy_kept", e_kept)
    t.add("~delta", d_sum)
    t.add("~delta_kept", d_kept)
    t.hi("~delta_max", d_max)
    t.add("~k3_kept", k3_kept)
    if d_kept_max > -math.inf:
        t.hi("~delta_kept_max", d_kept_max)
    t.lo("mask_threshold", threshold)
    if tis_raw is not None and tis_cap is not None:
        sums, maxs = tis_tally(tis_raw, kept, tis_cap)
        for k, v in sums.items():
            t.add(f"~{k}", v)
        for k, v in maxs.items():
            t.hi(f"~{k}", v)


def quantiles(values: Tensor, qs: tuple[float, ...]) -> list[float]:
    if values.numel() == 0:
        return [0.0] * len(qs)
    s = values.double().sort().values
    return [float(s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]) for q in qs]


def step_metrics(local: Tally, *, n_applied: int, n_skipped: int, micro_batches: int, tis_on: bool,
                 device: torch.device, group: dist.ProcessGroup | None) -> dict[str, float]:
    """The step's floats (module docstring) from this rank's tally of the updates that ran to their end; a
    collective: every rank calls it and gets the same dict."""
    t = local.reduced(device, group)
    n_run = max(n_applied + n_skipped, 1)
    s = t.sums
    n_resp, n_kept = s.get("response_tokens", 0.0), s.get("kept_tokens", 0.0)
    out: dict[str, float] = {}
    for key, v in s.items():
        if key.startswith("~"):
            continue
        if key in _PER_UPDATE:
            out[key] = v / n_run
        elif key in _SUMMED:
            out[key] = v
        else:
            out[key] = v / max(n_kept if key.endswith("clip_frac") or "clip_frac_" in key else n_resp, 1.0)
    if "ratio_max" in t.maxs:
        out["ratio_max"] = t.maxs["ratio_max"]
    if "ratio_min" in t.mins:
        out["ratio_min"] = t.mins["ratio_min"]
    ents = torch.cat(gather_segments(t.entropies, group)) if t.entropies else torch.zeros(0)
    p50, p80, p90, p99 = quantiles(ents, (0.5, 0.8, 0.9, 0.99))
    norms = t.grad_norms
    d_kept_max = t.maxs.get("~delta_kept_max", -math.inf)
    out.update(
        kept_frac=n_kept / max(n_resp, 1.0),
        entropy_mean=s.get("~entropy", 0.0) / max(n_resp, 1.0), entropy_p50=p50, entropy_p80=p80,
        entropy_p90=p90, entropy_p99=p99,
        entropy_kept_mean=s.get("~entropy_kept", 0.0) / n_kept if n_kept else 0.0,
        mask_threshold=t.mins.get("mask_threshold", math.nan),
        grad_norm=sum(norms) / len(norms) if norms else math.nan,
        grad_norm_max=float(torch.tensor(norms, dtype=torch.float64).max()) if norms else math.nan,
        logp_delta_mean=s.get("~delta", 0.0) / max(n_resp, 1.0),
        logp_delta_max=t.maxs.get("~delta_max", 0.0),
        logp_delta_kept_mean=s.get("~delta_kept", 0.0) / n_kept if n_kept else 0.0,
        logp_delta_kept_max=d_kept_max if d_kept_max > -math.inf else 0.0,
        approx_kl_start=s.get("~k3_kept", 0.0) / n_kept if n_kept else 0.0,
        micro_batches=float(micro_batches), n_updates=float(n_applied), skipped_updates=float(n_skipped),
    )
    if tis_on:
        out.update(tis_from_tally({k[1:]: v for k, v in s.items() if k.startswith("~tis")},
                                  {k[1:]: v for k, v in t.maxs.items() if k.startswith("~tis")}, n_resp, n_kept))
    return out
