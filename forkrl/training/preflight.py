"""Resolve and check a run config once, before the run starts (the trainer service calls it in StartRun).

    cfg = preflight(RunConfig(entropy_top_frac=0.2))   # model dir, task, reward, max_new_tokens filled in; the
                                                       # dataset's rows, the prompt format and the reward checked
    cfg = check_values(cfg)     # the same checks except those that need the files (recipes, tests)

ValueError → the request is wrong (INVALID_ARGUMENT; a path field's message starts with the field's name, and a
path the file system cannot read, too long or unreadable, is one too); PermissionError → this trainer does not
allow it (PERMISSION_DENIED: a path outside its roots, a rollout address it does not know, a custom reward);
FileNotFoundError → the world is not ready for it (FAILED_PRECONDITION: e.g. resume without a checkpoint).
The training loop receives the resolved config and never resolves again.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from forkrl.cli import shown
from forkrl.data.datasets import Fields, check_dataset, load_benchmark
from forkrl.data.prompts import check_prompt_format, check_reward_format
from forkrl.data.rewards import get_reward_fn
from forkrl.data.tasks import DEFAULT_TASK, get_task
from forkrl.models.tiny import default_model_dir
from forkrl.rl.head import check_packing, logits_post
from forkrl.security import OutsideRoots
from forkrl.training.config import RunConfig
from forkrl.training.rules import RunRules, confine_run
from forkrl.weights.checkpoint import latest_checkpoint

DATASET_MAX_NEW_TOKENS = 1024  # max_new_tokens of a run on a JSONL dataset when none is given


def resolve(cfg: RunConfig) -> RunConfig:
    """Fill the defaults that depend on the environment (model dir, task, reward, max_new_tokens)."""
    updates: dict[str, Any] = {}
    if not cfg.model:
        updates["model"] = str(default_model_dir())
    if not cfg.dataset and not cfg.task:
        updates["task"] = DEFAULT_TASK
    if not cfg.reward:
        updates["reward"] = "math_verify" if cfg.dataset else get_task(cfg.task or DEFAULT_TASK).reward
    if cfg.max_new_tokens == 0:
        updates["max_new_tokens"] = (get_task(cfg.task or DEFAULT_TASK).max_new_tokens if not cfg.dataset
                                     else DATASET_MAX_NEW_TOKENS)
    return cfg.model_copy(update=updates)


def check_values(cfg: RunConfig) -> RunConfig:
    """The resolved config, after every check that needs no file: task, reward, the loss's combinations."""
    cfg = resolve(cfg)
    if cfg.task and not cfg.dataset:
        get_task(cfg.task)  # raises ValueError naming the known tasks
    get_reward_fn(cfg.reward)  # raises ValueError for an unknown reward
    cfg.check_overlong()  # max_new_tokens is known now
    check_reward_format(cfg.reward, cfg.prompt_format)  # the reward reads the answer where the format puts it
    cfg.loss_config()  # raises ValueError for a combination the loss cannot honour
    if "wandb" in cfg.log_to:
        import importlib.util

        if importlib.util.find_spec("wandb") is None:
            raise ValueError("log_to wandb: the trainer has no wandb package (pip install 'forkrl[wandb]')")
    return cfg


def check_context(cfg: RunConfig) -> None:
    """ValueError when max_new_tokens cannot fit in the model's context (config.json's max_position_embeddings,
    less one token of prompt): the rollout service would refuse every request of the run. A model with
    rope_scaling may serve more than that (vLLM scales its max_model_len): not checked here."""
    try:
        model_config = json.loads((Path(cfg.model) / "config.json").read_text())
        context = model_config.get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        return  # an unreadable config is reported by the caller (not an HF checkpoint directory)
    rope = model_config.get("rope_scaling") or model_config.get("rope_parameters") or {}
    scaled = isinstance(rope, dict) and rope.get("rope_type", rope.get("type", "default")) != "default"
    if isinstance(context, int) and not scaled and cfg.max_new_tokens >= context:
        raise ValueError(f"max_new_tokens {cfg.max_new_tokens:,} does not fit in the model's context: its "
                         f"max_position_embeddings is {context:,} (prompt tokens included)")


def check_architecture(cfg: RunConfig) -> None:
    """ValueError naming the model type when the train step cannot compute the model's own log-probs from its hidden
    states: a model type whose logits post-processing forkrl does not know (forkrl/rl/head.py), or a bad value
    of the setting it reads (a soft-cap or scale that is not a number > 0); with pack_sequences, a model type
    not checked for packed sequences (forkrl/rl/head.py `check_packing`)."""
    path = Path(cfg.model) / "config.json"
    try:
        model_config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"model: {str(path)!r} could not be read as JSON: {e}") from None
    if not isinstance(model_config, dict):
        raise ValueError(f"model: {str(path)!r} is not a JSON object")
    try:
        logits_post(model_config)
        if cfg.pack_sequences:
            check_packing(model_config, model_config.get("attn_implementation") or model_config.get(
                "_attn_implementation"))
    except ValueError as e:
        raise ValueError(f"model: {e}") from None


def _named(field: str, message: str) -> str:
    """`message` starting with `field`: a dataset reader's "dataset ..." becomes "eval_dataset ..."."""
    if message.startswith(field):
        return message
    if message.startswith("dataset"):
        return field + message[len("dataset"):]
    return f"{field}: {message}"


@contextlib.contextmanager
def _reading(field: str, value: str, rename: bool = True) -> Iterator[None]:
    """The errors of reading the path(s) of one field, as ValueError (INVALID_ARGUMENT) naming the field, wherever
    the path lands: a file system error (a name too long, no permission, a symlink loop, I/O) and, with `rename`,
    the readers' own ValueErrors (a dataset reader says "dataset" also for an eval_dataset file)."""
    try:
        yield
    except OutsideRoots:
        raise
    except OSError as err:
        why = err.strerror or str(err)
        raise ValueError(f"{field} {shown(value, 200)} cannot be read: {why}"
                         + (f" ({shown(err.filename, 200)})" if err.filename and err.filename != value else "")) \
            from None
    except RuntimeError as err:  # Python 3.11's pathlib: "Symlink loop from ..."
        if not str(err).startswith("Symlink loop"):
            raise
        raise ValueError(f"{field} {shown(value, 200)} cannot be read: {err}") from None
    except ValueError as err:
        if not rename:
            raise
        raise ValueError(_named(field, str(err))) from None


def preflight(cfg: RunConfig, rules: RunRules | None = None) -> RunConfig:
    """The resolved config, after the checks that need the filesystem: a bad run fails before it starts.
    With `rules` (the trainer service always passes its own) paths, rollout addresses and the reward are
    confined first, before a custom reward is imported (forkrl/training/rules.py: NotAllowed / OutsideRoots
    are PermissionErrors)."""
    if rules is not None:
        cfg = resolve(cfg)
        cfg = cfg.model_copy(update=confine_run(cfg, rules))
    cfg = check_values(cfg)
    with _reading("model", cfg.model):
        if not (Path(cfg.model) / "config.json").is_file():
            raise ValueError(f"model: {shown(cfg.model, 200)} is not an HF checkpoint directory (no config.json)")
    fields = Fields(cfg.prompt_field, cfg.answer_field)
    if cfg.dataset:  # every row read and checked (and the normalized table cached for the run)
        with _reading("dataset", cfg.dataset):
            check_dataset(cfg.dataset, ("train", "eval") if cfg.eval_prompts and not cfg.eval_dataset
                          else ("train",), fields)
    for bench in cfg.eval_dataset:
        with _reading("eval_dataset", bench):
            load_benchmark(bench, fields)
    check_context(cfg)
    with _reading("model", cfg.model, rename=False):
        check_architecture(cfg)
        check_prompt_format(cfg.model, cfg.prompt_format, cfg.system_prompt)  # a chat format needs a chat template
    if cfg.run_dir:
        run_dir = Path(cfg.run_dir)
        with _reading("run_dir", cfg.run_dir):
            has_ckpt = latest_checkpoint(run_dir) is not None
        if cfg.resume and not has_ckpt:
            raise FileNotFoundError(f"resume: no complete checkpoint in {run_dir / 'checkpoints'}")
        if not cfg.resume and has_ckpt:
            raise ValueError(f"run_dir {str(run_dir)!r} already holds checkpoints: pass resume to continue it "
                             "or choose another run_dir")
    return cfg
