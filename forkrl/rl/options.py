"""The allowed values of the RL settings, each defined once, and the one rule for entropy_top_frac.

The (0, 1] rule is written once, in `check_top_frac`. Where it is applied: `RunConfig`'s validator (the run's
boundary: flags, TOML, and again from the proto in the trainer, the trust boundary), `LossConfig` at
construction (the RL math's entry, for code that builds one itself: the run's comes from
`RunConfig.loss_config()`), and the public functions of forkrl/rl/mask.py at their entry (a float comparison;
their helpers, `mask_is_on` included, take the checked value and do not check again).

Every other list is derived from these Literals: `LOSS_NAMES = get_args(LossName)` here, the `RunConfig`
field types and `--help` choices (forkrl/training/config.py), the proto enum mapping (by name, checked by
tests/unit/test_run_config.py), and the checks in `LossConfig` and the mask functions.

Torch-free on purpose: the client CLI and the configs import it, and `--help` must answer at once. The RL
modules re-export what they use (`forkrl.rl.mask.check_top_frac`, `forkrl.rl.losses.LOSS_NAMES`).
"""

from __future__ import annotations

from typing import Literal, get_args

__all__ = [
    "AGGREGATORS",
    "LOSS_NAMES",
    "MASK_NORMS",
    "MASK_SCOPES",
    "Aggregator",
    "LossName",
    "MaskNorm",
    "MaskScope",
    "check_budget_scope",
    "check_pack_budget",
    "check_top_frac",
    "mask_is_on",
]

LossName = Literal["grpo", "dr_grpo", "dapo", "reinforce", "rloo", "gspo", "cispo"]
"""The policy losses of forkrl/rl/losses.py (the table in its docstring)."""
Aggregator = Literal["token_mean", "seq_mean_token_mean", "seq_sum_const", "seq_mean_token_sum"]
"""How per-token loss terms become the step loss (algorithms.md §0)."""
MaskScope = Literal["microbatch", "step"]
"""Where the forking-token top-k is taken: per micro-batch (paper) or over the whole optimizer step."""
MaskNorm = Literal["kept", "all"]
"""Token normalizer under the mask: kept tokens (paper v2) or all response tokens (TRL)."""

LOSS_NAMES: tuple[LossName, ...] = get_args(LossName)
AGGREGATORS: tuple[Aggregator, ...] = get_args(Aggregator)
MASK_SCOPES: tuple[MaskScope, ...] = get_args(MaskScope)
MASK_NORMS: tuple[MaskNorm, ...] = get_args(MaskNorm)


def check_top_frac(top_frac: float | None) -> None:
    """Raise ValueError unless top_frac is None or in (0, 1] (the one place this rule is written)."""
    if top_frac is None:
        return
    if isinstance(top_frac, bool) or not isinstance(top_frac, (int, float)):
        raise ValueError(f"entropy_top_frac must be a float in (0, 1] or None, got {top_frac!r}")
    if not (0.0 < top_frac <= 1.0):  # NaN fails too
        raise ValueError(f"entropy_top_frac must be in (0, 1], got {top_frac}")


def mask_is_on(top_frac: float | None) -> bool:
    """True when rho actually drops tokens (rho < 1). `top_frac` is a checked value (check_top_frac)."""
    return top_frac is not None and top_frac < 1.0


def check_budget_scope(max_tokens_per_micro_batch: int, mask_on: bool, mask_scope: str) -> None:
    """Raise ValueError for token-budget micro-batches with the micro-batch-scope top-k (docs/algorithms-departures.md
    §6): which rows share a token-budget micro-batch depends on their lengths and on the number of ranks, so a top-k
    per micro-batch would make the kept tokens depend on both; the step scope keeps the same tokens whatever the
    grouping. Without the mask (rho = 1) the scope selects nothing and any value passes."""
    if max_tokens_per_micro_batch and mask_on and mask_scope == "microbatch":
        raise ValueError(f"max_tokens_per_micro_batch ({max_tokens_per_micro_batch}) needs mask_scope 'step' when "
                         "entropy_top_frac < 1, got mask_scope 'microbatch': token-budget micro-batches group rows by "
                         "length and rank count, so a per-micro-batch top-k would change with them (set "
                         "--mask-scope step, or max_tokens_per_micro_batch 0 for fixed micro-batches)")


def check_pack_budget(pack_sequences: bool, max_tokens_per_micro_batch: int) -> None:
    """Raise ValueError for packed sequences without the token budget: a packed row holds the sequences of one
    token-budget micro-batch (forkrl/rl/microbatch.py `fill`), at most max_tokens_per_micro_batch tokens."""
    if pack_sequences and not max_tokens_per_micro_batch:
        raise ValueError("pack_sequences needs max_tokens_per_micro_batch > 0 (the packed row's length budget), got "
                         "max_tokens_per_micro_batch 0 (set --max-tokens-per-micro-batch, e.g. 32768, or turn "
                         "pack_sequences off)")
