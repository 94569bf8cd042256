"""The benchmark eval in two calls: resolve and check everything it reads, then sample, grade and write.

    from forkrl.eval import EvalParams, plan_eval, run_eval
    plan = plan_eval(EvalParams(checkpoint_root="runs/x/checkpoints", steps=[20], include_final=True,
                                model="/models/Qwen3-8B-Base", benchmarks=["aime24.parquet", "math500.parquet"]))
    summary = run_eval(plan, "eval_out")        # eval_results.json, samples.jsonl, avg_vs_step.png

`plan_eval` fails before any model is loaded: the checkpoints (as the probe's: forkrl/probe/checkpoints.py), the
run's settings, every benchmark row, the prompt format against the model's tokenizer, the reward against the
format. `run_eval`, per checkpoint: one sampling call over every benchmark's problems (in-process vLLM, the
transformers sampler, or a running rollout service: forkrl/probe/engines.py), decoded without special tokens,
graded by the run's reward function exactly as in training (forkrl.data.prompts.run_reward_fn: math-verify in its
process pool, timeouts counted), then avg@n, pass@k and maj@k (forkrl/eval/metrics.py).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from forkrl.data.datasets import Fields, benchmark_names, load_benchmark, load_problems
from forkrl.data.prompts import PromptEncoder, check_prompt_format, check_reward_format, final_answer, run_reward_fn
from forkrl.data.rewards import get_reward_fn
from forkrl.data.tasks import DEFAULT_TASK, TASKS, Problem, get_task
from forkrl.eval.metrics import ProblemResult, aggregate
from forkrl.eval.params import DEFAULT_MAX_NEW_TOKENS, EvalParams
from forkrl.probe.checkpoints import CheckpointRef, resolve_checkpoints
from forkrl.probe.params import ProbeParams

ProgressFn = Callable[[str], None]
RUN_KEYS = ("prompt_format", "system_prompt", "prompt_field", "answer_field", "reward", "temperature",
            "max_new_tokens", "eval_dataset", "dataset", "model", "task", "eval_prompts", "seed")
DEFAULT_TASK_PROBLEMS = 128  # problems of a built-in task's eval split when neither the run nor --max-problems says


class EvalInputError(ValueError):
    """An eval that cannot run as asked, found before any model is loaded."""


@dataclass
class Benchmark:
    name: str
    path: str
    problems: list[Problem]


@dataclass
class EvalPlan:
    params: EvalParams
    checkpoints: list[CheckpointRef]  # base first, then steps ascending, final, explicit paths; `step` where known
    benchmarks: list[Benchmark]
    prompt_format: str
    system_prompt: str
    reward: str
    temperature: float
    max_new_tokens: int
    ks: list[int]  # the k of pass@k / maj@k that fit num_samples
    run_config: str  # the file the defaults came from ("" = none)
    notes: list[str] = field(default_factory=list)


def read_run_config(path: str | Path) -> dict[str, Any]:
    """The settings of a run's config.json (JSON) or of a recipe (TOML)."""
    path = Path(path)
    try:
        if path.suffix == ".toml":
            import tomllib

            return tomllib.loads(path.read_text())
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise EvalInputError(f"run_config {str(path)!r}: {exc}") from None
    if not isinstance(data, dict):
        raise EvalInputError(f"run_config {str(path)!r} is not a run's settings (a JSON object)")
    return data


def _run_settings(p: EvalParams) -> tuple[dict[str, Any], str]:
    path = p.run_config
    if not path and p.checkpoint_root:
        beside = Path(p.checkpoint_root).expanduser().resolve().parent / "config.json"
        path = str(beside) if beside.is_file() else ""
    if not path:
        return {}, ""
    run = read_run_config(path)
    return {k: run[k] for k in RUN_KEYS if k in run and run[k] not in (None, "")}, path


def _step_of(ref: CheckpointRef) -> int | None:
    if ref.label == "base":
        return 0
    if ref.step is not None:
        return ref.step
    try:
        return int(json.loads((ref.path / "trainer_state.json").read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def plan_eval(params: EvalParams) -> EvalPlan:
    """Resolve the checkpoints, the run's defaults, the benchmarks (every row read and checked), the prompt format
    and the reward. EvalInputError (or the probe's typed checkpoint errors) for anything wrong."""
    p = params
    run, run_path = _run_settings(p)
    refs = resolve_checkpoints(ProbeParams(checkpoint_root=p.checkpoint_root, steps=p.steps,
                                           include_final=p.include_final, checkpoints=p.checkpoints, model=p.model))
    for ref in refs:
        ref.step = _step_of(ref)
    fmt = p.prompt_format or run.get("prompt_format", "raw")
    system = p.system_prompt if p.system_prompt is not None else run.get("system_prompt", "")
    fields = Fields(p.prompt_field if p.prompt_field is not None else run.get("prompt_field", ""),
                    p.answer_field if p.answer_field is not None else run.get("answer_field", ""))
    paths = p.benchmarks or list(run.get("eval_dataset", []))
    if not paths and run_path and not run.get("dataset"):
        paths = [run.get("task") or DEFAULT_TASK]  # a run on a built-in task: its held-out split
    if not paths:
        raise EvalInputError("no benchmarks: give benchmarks (files, folders or a built-in task's name: "
                             f"{', '.join(TASKS)}), or a run whose config names eval_dataset or a built-in task")
    tasks = [_builtin_task(path) for path in paths]
    only_tasks = {t for t in tasks if t} if all(tasks) else set()
    # a built-in task's own grader when every benchmark is that task (countdown's answers are not math answers)
    reward = (p.reward or run.get("reward") or (get_task(only_tasks.pop()).reward if len(only_tasks) == 1 else "")
              or "math_verify")
    notes = []
    ks = sorted({k for k in p.pass_k if k <= p.num_samples})
    if len(ks) < len(set(p.pass_k)):
        notes.append(f"pass_k {sorted(k for k in set(p.pass_k) if k > p.num_samples)} > num_samples "
                     f"{p.num_samples}: left out")
    if not ks:
        ks = [p.num_samples]
    try:
        get_reward_fn(reward)
        check_reward_format(reward, fmt)
        check_prompt_format(next((r.path for r in refs if any(r.path.glob("tokenizer*"))), refs[0].path), fmt,
                            system)
        benchmarks = []
        for name, path, task in zip(benchmark_names(paths), paths, tasks, strict=True):
            problems = _task_problems(task, p, run) if task else load_benchmark(path, fields)
            benchmarks.append(Benchmark(name, str(path), problems[:p.max_problems] if p.max_problems
                                        else list(problems)))
    except ValueError as exc:
        raise EvalInputError(str(exc)) from None
    temperature = p.temperature if p.temperature is not None else float(run.get("temperature", 1.0))
    max_new = p.max_new_tokens or int(run.get("max_new_tokens") or DEFAULT_MAX_NEW_TOKENS)
    return EvalPlan(p, refs, benchmarks, fmt, system, reward, temperature, max_new, ks, run_path, notes)


def _builtin_task(path: str) -> str:
    """The built-in task a benchmark names (its name, when no file or folder of that name exists), else ""."""
    return path if path in TASKS and not Path(path).exists() else ""


def _task_problems(task: str, p: EvalParams, run: dict[str, Any]) -> list[Problem]:
    """A built-in task's held-out (eval) split: the problems the run's own evaluation drew (its eval_prompts and seed,
    as forkrl/training/loop.py draws them), or the first --max-problems of them."""
    n = p.max_problems or int(run.get("eval_prompts") or DEFAULT_TASK_PROBLEMS)
    return list(load_problems(task, None, "eval", n, seed=int(run.get("seed", 0))))


def _eos_ids(path: Path, tok: Any) -> list[int]:
    """Every EOS id the tokenizer, the generation config and the model config name."""
    eos: set[int] = set()
    sources: list[Any] = [tok.eos_token_id]
    for name in ("generation_config.json", "config.json"):
        try:
            sources.append(json.loads((path / name).read_text()).get("eos_token_id"))
        except (OSError, ValueError):
            pass
    for src in sources:
        if isinstance(src, int):
            eos.add(src)
        elif isinstance(src, list):
            eos.update(int(x) for x in src)
    if not eos:
        raise EvalInputError(f"{path} defines no EOS token")
    return sorted(eos)


def _sample(plan: EvalPlan, ref: CheckpointRef, ids: list[list[int]], eos: list[int], tok: Any, device: str):
    """The trajectories of every prompt (prompt-major, num_samples each), from the plan's sampler."""
    from forkrl.probe.engines import resolve_sampler, sample_with_rollout, sample_with_vllm

    p = plan.params
    kw = dict(group_size=p.num_samples, temperature=plan.temperature, max_new_tokens=plan.max_new_tokens,
              seed=p.seed, eos_ids=eos)
    sampler = resolve_sampler(p.sampler)
    if sampler == "vllm":
        return sample_with_vllm(ref.path, ids, top_p=p.top_p, notes=plan.notes, **kw)
    if sampler == "rollout":
        return sample_with_rollout(p.rollout_address, ids, top_p=p.top_p, **kw)
    import torch

    from forkrl.probe.checkpoints import load_checkpoint
    from forkrl.probe.sampling import sample_trajectories

    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
    model, _ = load_checkpoint(ref.path, torch.float32, dev,
                               plan.checkpoints[0].path if plan.params.model else None)  # tokenizer fallback
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    try:
        return sample_trajectories(model, ids, pad_id=pad, **kw)
    finally:
        del model


def evaluate_checkpoint(plan: EvalPlan, ref: CheckpointRef,
                        device: str = "auto") -> tuple[dict[str, list[ProblemResult]], dict[str, int]]:
    """({benchmark name: one ProblemResult per problem, the texts in `extra`}, the reward's counters) of one
    checkpoint."""
    from transformers import AutoTokenizer

    base = plan.checkpoints[0].path if plan.params.model else None
    try:
        tok = AutoTokenizer.from_pretrained(str(ref.path))
    except (OSError, ValueError):
        if base is None:
            raise
        tok = AutoTokenizer.from_pretrained(str(base))  # a checkpoint saved without its tokenizer
    enc = PromptEncoder(tok, plan.prompt_format, plan.system_prompt)
    problems = [q for b in plan.benchmarks for q in b.problems]
    ids = enc.encode(problems)
    eos = _eos_ids(ref.path, tok)
    trajs = _sample(plan, ref, ids, eos, tok, device)
    n = plan.params.num_samples
    texts = [tok.decode(t.response_ids, skip_special_tokens=True) for t in trajs]
    graded = run_reward_fn(plan.reward, plan.prompt_format)(texts, [problems[t.prompt_index] for t in trajs])
    out: dict[str, list[ProblemResult]] = {}
    start = 0
    for b in plan.benchmarks:
        rows = []
        for i in range(start, start + len(b.problems)):
            ts, rs, xs = trajs[i * n:(i + 1) * n], graded.rewards[i * n:(i + 1) * n], texts[i * n:(i + 1) * n]
            rows.append(ProblemResult(
                rewards=list(rs), answers=[final_answer(x, plan.reward, plan.prompt_format) for x in xs],
                lengths=[t.n_response for t in ts], truncated=[not t.finished for t in ts], extra={"texts": xs}))
        out[b.name] = rows
        start += len(b.problems)
    return out, dict(graded.counters)


def run_eval(plan: EvalPlan | EvalParams, out_dir: str | Path, *, device: str = "auto",
             progress: ProgressFn | None = None) -> dict[str, Any]:
    """Evaluate every checkpoint on every benchmark; write eval_results.json, samples.jsonl and (when a
    checkpoint has a step) avg_vs_step.png into `out_dir`; return the summary (eval_results.json's content)."""
    from forkrl.eval import outputs

    if isinstance(plan, EvalParams):
        plan = plan_eval(plan)
    p = plan.params
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    say = progress or (lambda msg: print(msg, file=sys.stderr))
    with_maj = plan.reward in ("math_verify", "exact_match", "countdown")
    results: dict[str, dict[str, Any]] = {b.name: {} for b in plan.benchmarks}
    counters: dict[str, dict[str, int]] = {}
    problems: list[dict[str, Any]] = []
    with open(out / outputs.SAMPLES, "w") as samples:
        for ref in plan.checkpoints:
            say(f"{ref.label}: sampling {sum(len(b.problems) for b in plan.benchmarks)} problems x {p.num_samples}")
            per, counters[ref.label] = evaluate_checkpoint(plan, ref, device)
            for b in plan.benchmarks:
                rows = per[b.name]
                results[b.name][ref.label] = aggregate(rows, plan.ks, with_maj)
                for i, (q, r) in enumerate(zip(b.problems, rows, strict=True)):
                    problems.append(outputs.problem_record(b.name, ref.label, i, q, r, plan.ks, with_maj))
                    outputs.write_samples(samples, b.name, ref.label, i, r)
            say(f"{ref.label}: " + ", ".join(f"{b.name} avg@{p.num_samples} "
                                             f"{results[b.name][ref.label].get(f'avg@{p.num_samples}', 0):.3f}"
                                             for b in plan.benchmarks))
    summary = outputs.summary(plan, results, counters, problems)
    summary["files"] = [outputs.RESULTS, outputs.SAMPLES]
    if any(c["step"] is not None for c in summary["checkpoints"]):
        outputs.plot_avg_vs_step(out / outputs.PLOT, summary)
        summary["files"].append(outputs.PLOT)
    outputs.write_json(out / outputs.RESULTS, summary)
    if p.log_to:
        run_name = Path(plan.run_config).parent.name if plan.run_config.endswith("config.json") else "eval"
        outputs.log_results(out, summary, p.log_to, p.wandb_project, f"{run_name}-eval")
    return summary
