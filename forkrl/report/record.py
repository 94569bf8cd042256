"""What the run report needs from training, recorded at each evaluation so the report never runs the model.

    recorder = EvalRecorder(run_dir, cfg, policy, link)    # the loop makes one per run (rank 0)
    recorder.record(step, eval_problems, sampled)          # after an evaluation: eval_samples/step_000050.jsonl
    recorder.refresh(run.event)                            # report.html (forkrl/report/run_page.py), when changed

At each evaluation the engine has sampled the eval prompts at the run's temperature, but it returns only the
sampled tokens' log-probs, not the entropy of each position's distribution. So the first sample of each of the
first SAMPLED_RESPONSES eval prompts is teacher-forced through the trainer's own policy, without gradients:
per-token log-prob and entropy at the sampling temperature (forkrl/rl/entropy.py, the training pass), and the
kept flags are the top-rho mask over that response's tokens (forkrl/rl/mask.py, the training rule applied to one
response; training takes its top-k over a micro-batch). One file per eval step, bounded in size:

    {"kind": "summary", "step": 50, "top_frac": 0.2, "n_responses": 32, "n_tokens": 480, "n_kept": 104,
     "hist_edges": [...], "hist_counts": [...], "hist_below": 3,          # entropy histogram, log-spaced bins
     "kept_tokens": [["*", 31, {"choice": 31}], ...],                   # kept tokens by text (top MAX_RANKED)
     "all_tokens": {"*": 40, ...}, "class_tokens": {...}, "class_kept": {...}}
    {"kind": "response", "step": 50, "prompt_index": 0, "prompt": "3 7 4->25:", "answer": "25",
     "given": "25", "reward": 1.0, "tokens": ["7", "*", ...], "entropy": [...], "logp": [...],
     "kept": [true, ...], "classes": ["choice", ...] or null, "n_tokens": 15, "truncated": false}

The first SHOWN_RESPONSES responses are written token by token (at most MAX_SHOWN_TOKENS tokens each; their kept
flags are those of the whole response); the others only count in the summary line.

Ranks: with a sharded (FSDP2) policy a forward is a collective, so rank 0 tells the other ranks ("tokens",
forkrl/training/ranks.py) and every rank runs the same teacher-forced forwards on the same token ids; only rank 0
keeps the results. Nothing is gathered: each rank's forward already computes the full logits.
"""

from __future__ import annotations

import bisect
import json
import logging
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from forkrl.files import atomic_write
from forkrl.report.data import SAMPLED_RESPONSES, SAMPLES_DIR, SHOWN_RESPONSES
from forkrl.rl.entropy import token_logprobs_and_entropy
from forkrl.rl.mask import forking_token_mask

__all__ = ["HIST_EDGES", "MAX_RANKED", "MAX_SHOWN_TOKENS", "SAMPLED_RESPONSES", "SAMPLES_DIR", "SHOWN_RESPONSES",
           "EvalRecorder", "entropy_histogram", "samples_file", "teacher_forced"]

log = logging.getLogger("forkrl.report")

MAX_SHOWN_TOKENS = 512  # tokens of a shown response written (the rest count in the summary only)
MAX_RANKED = 200  # kept-token texts written per eval step (the most frequent)
# log-spaced entropy bins in nats, 4 per decade from 1e-4 to 100 (ln of any vocabulary size is < 100); entropies
# below the first edge are counted in "hist_below"
HIST_EDGES = [10 ** (k / 4) for k in range(-16, 9)]


def samples_file(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / SAMPLES_DIR / f"step_{step:06d}.jsonl"


@torch.no_grad()
def teacher_forced(model: torch.nn.Module, seqs: Sequence[tuple[Sequence[int], Sequence[int]]], temperature: float,
                   device: torch.device) -> list[tuple[list[float], list[float]]]:
    """(logp, entropy) of each completion token of each (prompt ids, completion ids), one sequence at a time (no
    padding, logits only for the completion's positions), in fp32 at `temperature` (forkrl/rl/entropy.py). A
    sharded model: every rank must call it with the same `seqs` (each forward is a collective)."""
    was_training = model.training
    model.eval()
    out = []
    try:
        for prompt, completion in seqs:
            if not completion:
                out.append(([], []))
                continue
            ids = torch.tensor([list(prompt) + list(completion)], dtype=torch.long, device=device)
            # the last C + 1 positions: position p predicts token p + 1, so the first C of them score the completion
            logits = model(input_ids=ids, use_cache=False, logits_to_keep=len(completion) + 1).logits[:, :-1]
            targets = ids[:, -len(completion):]
            logp, ent = token_logprobs_and_entropy(logits, targets, temperature=temperature)
            out.append((logp[0].float().cpu().tolist(), ent[0].float().cpu().tolist()))
    finally:
        model.train(was_training)
    return out


def entropy_histogram(entropies: Sequence[float]) -> tuple[list[int], int]:
    """(counts per HIST_EDGES bin, count below the first edge); the last bin also holds values past its edge."""
    counts = [0] * (len(HIST_EDGES) - 1)
    below = 0
    for h in entropies:
        k = bisect.bisect_right(HIST_EDGES, h) - 1
        if k < 0:
            below += 1
        else:
            counts[min(k, len(counts) - 1)] += 1
    return counts, below


class EvalRecorder:
    """Rank 0's recorder of one run (module docstring). `policy`: forkrl/training/policy.py's Policy (its model,
    tokenizer, token_text); `link`: the other ranks (forkrl/training/ranks.py)."""

    def __init__(self, run_dir: Path, cfg: Any, policy: Any, link: Any = None) -> None:
        self.run_dir, self.cfg, self.policy, self.link = Path(run_dir), cfg, policy, link
        self._rendered: tuple | None = None
        self._announced = False
        if getattr(policy, "resumed", False):  # a resume runs the steps after its checkpoint again
            self.drop_after(policy.start_step)

    def drop_after(self, step: int) -> list[Path]:
        """Remove the samples of eval steps after `step` (as MetricsSink.drop_after does with their metrics lines);
        returns the files removed."""
        gone = [f for f in (self.run_dir / SAMPLES_DIR).glob("step_*.jsonl") if int(f.stem.split("_")[1]) > step]
        for f in gone:
            f.unlink()
        return gone

    def record(self, step: int, problems: Sequence[Any], sampled: Sequence[tuple[Sequence[Any], Sequence[Any]]]
               ) -> dict[str, float]:
        """Teacher-force the first sample of each of the first SAMPLED_RESPONSES prompts and write the step's file.
        `sampled[i]`: (the trajectories of problems[i] sampled at the run's temperature, their rewards). Returns
        the time it took, for the eval's metrics line."""
        t0 = time.perf_counter()
        pairs = enumerate(zip(problems, sampled, strict=True))
        chosen = [(i, p, group[0], rewards[0]) for i, (p, (group, rewards)) in pairs if group][:SAMPLED_RESPONSES]
        if not chosen:
            return {}
        seqs = [(list(t.prompt_token_ids), list(t.completion_token_ids)) for _, _, t, _ in chosen]
        if self.link is not None and self.link.active:
            self.link.tell("tokens", seqs, self.cfg.temperature)  # every rank joins the sharded forwards
        stats = teacher_forced(self.policy.model, seqs, self.cfg.temperature, self.policy.device)
        lines = self._lines(step, chosen, stats)
        path = samples_file(self.run_dir, step)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, "".join(json.dumps(x, allow_nan=False) + "\n" for x in lines))
        return {"time_eval_samples_s": time.perf_counter() - t0}

    def _lines(self, step: int, chosen: list, stats: list[tuple[list[float], list[float]]]) -> list[dict]:
        from forkrl.data.prompts import final_answer
        from forkrl.data.tasks import token_classes

        top_frac = self.cfg.entropy_top_frac
        responses: list[dict] = []
        all_h: list[float] = []
        kept_by_text: dict[str, Counter] = defaultdict(Counter)
        all_by_text: Counter = Counter()
        class_all: Counter = Counter()
        class_kept: Counter = Counter()
        n_kept = 0
        for j, ((index, problem, traj, reward), (logp, ent)) in enumerate(zip(chosen, stats, strict=True)):
            ids = list(traj.completion_token_ids)
            texts = [self.policy.token_text(i) for i in ids]  # None: the end-of-sequence token
            classes = token_classes(problem, texts) if ids else None
            kept = [False] * len(ids)
            if ids:
                h = torch.tensor(ent, dtype=torch.float32)[None]
                kept = forking_token_mask(h, torch.ones_like(h, dtype=torch.bool), top_frac).mask[0].tolist()
            shown = ["" if t is None else t for t in texts]
            all_h += ent
            n_kept += sum(kept)
            for k, (text, flag) in enumerate(zip(texts, kept, strict=True)):
                key = "<eos>" if text is None else text
                cls = classes[k] if classes else ""  # "": the task labels no classes (a dataset)
                all_by_text[key] += 1
                if flag:
                    kept_by_text[key][cls] += 1
                if cls:
                    class_all[cls] += 1
                    class_kept[cls] += flag
            if j >= SHOWN_RESPONSES:
                continue
            m = MAX_SHOWN_TOKENS
            responses.append({
                "kind": "response", "step": step, "prompt_index": index, "prompt": problem.prompt,
                "answer": problem.answer, "given": final_answer(traj.completion_text, self.cfg.reward,
                                                                 self.cfg.prompt_format),
                "reward": None if reward is None else float(reward), "tokens": shown[:m],
                "eos": [t is None for t in texts[:m]], "entropy": ent[:m], "logp": logp[:m], "kept": kept[:m],
                "classes": classes[:m] if classes else None, "n_tokens": len(ids), "truncated": len(ids) > m})
        counts, below = entropy_histogram(all_h)
        ranked = sorted(kept_by_text.items(), key=lambda kv: (-sum(kv[1].values()), kv[0]))[:MAX_RANKED]
        summary = {
            "kind": "summary", "step": step, "top_frac": top_frac, "temperature": self.cfg.temperature,
            "n_responses": len(chosen), "n_tokens": len(all_h), "n_kept": n_kept,
            "hist_edges": HIST_EDGES, "hist_counts": counts, "hist_below": below,
            "kept_tokens": [[text, sum(c.values()), dict(c)] for text, c in ranked],
            "all_tokens": {text: all_by_text[text] for text, _ in ranked},
            "class_tokens": dict(class_all), "class_kept": dict(class_kept),
        }
        return [summary, *responses]

    def write_report(self) -> Path | None:
        """Render report.html (forkrl/report/run_page.py) when metrics.jsonl or the samples changed since the last
        render; returns its path (None: nothing changed)."""
        from forkrl.report.run_page import write_run_report

        metrics = self.run_dir / "metrics.jsonl"
        files = sorted((self.run_dir / SAMPLES_DIR).glob("step_*.jsonl"))
        key = (metrics.stat().st_size if metrics.is_file() else 0, tuple((f.name, f.stat().st_mtime_ns) for f in files))
        if key == self._rendered:
            return None
        path = write_run_report(self.run_dir)
        self._rendered = key
        return path

    def refresh(self, event: Callable[..., None]) -> None:
        """write_report(), for the trainer: the first page's path goes out as a LOG event (`event`: the run's), and
        a page that cannot be rendered is logged as one and the run goes on (`python -m forkrl.report <run dir>`
        writes it again from the files)."""
        t0 = time.perf_counter()
        try:
            path = self.write_report()
        except Exception as e:
            log.exception("the run report could not be written")
            event("LOG", f"the run report could not be written ({type(e).__name__}: {e}); "
                  f"`python -m forkrl.report {self.run_dir}` writes it from the run's files")
            return
        if path is not None and not self._announced:
            self._announced = True
            event("LOG", f"run report: {path} (written in {time.perf_counter() - t0:.1f} s; rewritten at each "
                  "evaluation and at the end)", path=str(path))
