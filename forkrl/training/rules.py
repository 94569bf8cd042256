"""What a StartRun request may ask of the trainer: which files it may read, where it may write, which rollout
services it may talk to, which reward code it may run. The trainer service builds the rules from its settings
(trainer_service/config.py: TrainerSettings.rules) and preflight applies them before anything is read.

    rules = RunRules(runs_root=Path("/data/runs").resolve(), read_roots=[Path("/data").resolve()],
                     rollout_addresses=("127.0.0.1:50051",), allow_custom_rewards=False)
    confine_run(cfg, rules)   # -> cfg with real paths; OutsideRoots / NotAllowed (PERMISSION_DENIED) or
                              #    ValueError (INVALID_ARGUMENT), each naming the setting that decides

Imports nothing heavy (the trainer's settings use it before torch is imported).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forkrl.security import OutsideRoots, confine_path

# forkrl.data.rewards.BUILTIN_REWARDS (a test checks)
BUILTIN_REWARD_NAMES = ("exact_match", "countdown", "math_verify")
RUNS_ROOT = "the trainer's runs_root (--runs-root, TRAINER_RUNS_ROOT)"
READ_ROOTS = "the trainer's allowed_roots (--allowed-roots, TRAINER_ALLOWED_ROOTS; runs_root counts too)"


class NotAllowed(PermissionError):
    """A request this trainer is not configured to accept (PERMISSION_DENIED); the message names the setting."""


@dataclass(frozen=True)
class RunRules:
    runs_root: Path  # real path
    read_roots: list[Path]  # real paths
    rollout_addresses: tuple[str, ...] = ("127.0.0.1:50051",)
    allow_custom_rewards: bool = False
    # caps on the work of one step (TrainerSettings: --max-step-samples, ...); the defaults are the settings'
    max_step_samples: int = 16384
    max_step_tokens: int = 1 << 25
    max_eval_tokens: int = 1 << 25


def address_allowed(address: str, allowed: tuple[str, ...]) -> bool:
    """`host:port` equals an entry, or the entry is `host:*` with the same host. The one rule for every
    rollout address a request names: the trainer's StartRun and the probe service's sampler rollout."""
    host, _, _ = address.strip().rpartition(":")
    return any(address.strip() == a or (a.endswith(":*") and a[:-2] == host) for a in allowed)


def is_forkrl_run(run_dir: Path) -> bool:
    """A directory a forkrl run wrote: it holds checkpoints/, or its config.json is a run config (it names
    rollout_addresses and loss)."""
    if (run_dir / "checkpoints").is_dir():
        return True
    try:
        cfg = json.loads((run_dir / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and "rollout_addresses" in cfg and "loss" in cfg


def _raise_it(name: str, needed: int) -> str:
    return (f"an operator can allow it: start the trainer with --{name.replace('_', '-')} {needed} "
            f"(TRAINER_{name.upper()}={needed})")


def check_bounds(cfg: Any, rules: RunRules) -> None:
    """ValueError (INVALID_ARGUMENT) when a resolved RunConfig asks for more work per step than the rules
    allow; the message names the product, the limit and the setting that raises it."""
    samples = cfg.prompts_per_step * cfg.group_size
    if samples > rules.max_step_samples:
        raise ValueError(f"prompts_per_step {cfg.prompts_per_step} x group_size {cfg.group_size} = {samples:,} "
                         f"samples per step exceed this trainer's max_step_samples {rules.max_step_samples:,}; "
                         + _raise_it("max_step_samples", samples))
    rounds = cfg.max_gen_batches if cfg.dynamic_sampling else 1
    tokens = samples * cfg.max_new_tokens * rounds
    if tokens > rules.max_step_tokens:
        times = f" x max_gen_batches {rounds} (dynamic_sampling)" if cfg.dynamic_sampling else ""
        raise ValueError(f"one step may generate prompts_per_step {cfg.prompts_per_step} x group_size "
                         f"{cfg.group_size} x max_new_tokens {cfg.max_new_tokens}{times} = {tokens:,} tokens, more "
                         f"than this trainer's max_step_tokens {rules.max_step_tokens:,}; "
                         + _raise_it("max_step_tokens", tokens))
    sets = max(1, len(getattr(cfg, "eval_dataset", [])))  # eval_prompts of each benchmark file
    evals = cfg.eval_prompts * sets * cfg.max_new_tokens  # eval_every 0 still evaluates before and after
    if evals > rules.max_eval_tokens:
        files = f" x {sets} eval_dataset files" if sets > 1 else ""
        raise ValueError(f"one evaluation may generate eval_prompts {cfg.eval_prompts}{files} x max_new_tokens "
                         f"{cfg.max_new_tokens} = {evals:,} tokens, more than this trainer's max_eval_tokens "
                         f"{rules.max_eval_tokens:,}; " + _raise_it("max_eval_tokens", evals))


def confine_dataset(path: str, roots: list[Path]) -> str:
    """The real path of a dataset path, and every file it names confined: with `{split}` (one file per split) each
    substituted path (train, eval) is checked, not the template as written: `data/{split}.jsonl` may name a
    symlink out, and the template's other braces are refused (forkrl/data/datasets.py: split_path)."""
    from forkrl.data.datasets import SPLIT_FIELD, split_path
    from forkrl.data.tasks import SPLITS

    for split in SPLITS:  # ValueError for a brace other than {split}, before any path is resolved
        confine_path(split_path(path, split), roots, "dataset", READ_ROOTS)
    real = str(confine_path(path, roots, "dataset", READ_ROOTS))
    if SPLIT_FIELD in path:  # the template's folders resolved: what the run opens must still be inside
        for split in SPLITS:
            confine_path(split_path(real, split), roots, "dataset", READ_ROOTS)
    return real


def confine_run(cfg: Any, rules: RunRules) -> dict[str, Any]:
    """Check a RunConfig against the rules; returns the fields to replace (the real paths of model, dataset,
    eval_dataset and run_dir). Runs before the reward is imported and before any path is opened; the caps of one step
    (check_bounds) first."""
    check_bounds(cfg, rules)
    if cfg.reward and cfg.reward not in BUILTIN_REWARD_NAMES and not rules.allow_custom_rewards:
        raise NotAllowed(f"reward {cfg.reward!r}: custom rewards ('module:function') run code in the trainer; "
                         f"this trainer accepts only {' or '.join(BUILTIN_REWARD_NAMES)}. Start it with "
                         "--allow-custom-rewards (TRAINER_ALLOW_CUSTOM_REWARDS=true) to allow them")
    for address in cfg.rollout_addresses:
        if not address_allowed(address, rules.rollout_addresses):
            raise NotAllowed(f"rollout address {address!r} is not one of the trainer's rollout_addresses "
                             f"{list(rules.rollout_addresses)} (--rollout-addresses, TRAINER_ROLLOUT_ADDRESSES): "
                             "the trainer sends prompts and weights only to the services it is configured with")
    updates: dict[str, Any] = {}
    if cfg.model:
        updates["model"] = str(confine_path(cfg.model, rules.read_roots, "model", READ_ROOTS))
    if cfg.dataset:
        updates["dataset"] = confine_dataset(cfg.dataset, rules.read_roots)
    if getattr(cfg, "eval_dataset", None):
        updates["eval_dataset"] = [str(confine_path(p, rules.read_roots, "eval_dataset", READ_ROOTS))
                                   for p in cfg.eval_dataset]
    if cfg.run_dir:
        run_dir = confine_path(cfg.run_dir, [rules.runs_root], "run_dir", RUNS_ROOT)
        if run_dir == rules.runs_root:
            raise OutsideRoots(f"run_dir {cfg.run_dir!r} is {RUNS_ROOT} itself; name a directory inside it")
        if run_dir.exists() and not run_dir.is_dir():
            raise ValueError(f"run_dir {cfg.run_dir!r} is a file")
        if run_dir.is_dir() and any(run_dir.iterdir()) and not is_forkrl_run(run_dir):
            raise ValueError(f"run_dir {cfg.run_dir!r} is a directory that holds something other than a forkrl "
                             "run (no run config.json, no checkpoints/); choose a new or empty directory")
        updates["run_dir"] = str(run_dir)
    return updates
