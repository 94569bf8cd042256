"""Benchmark the probe's exact batched gradients against one backward per position, and a default job.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_probe.py [--model DIR] [--positions 64] [--repeats 3]

1. The same `--positions` positions (<= 4 per trajectory, sampled responses of the default task) and the
   default targets (k_proj and down_proj of the first and last layer, 32 seeded rows each):
   - exact batched: trajectories packed into forward batches of 16 positions, one `is_grads_batched`
     backward per batch (forkrl.probe.gradients.exact_row_grads);
   - reference: one forward per trajectory, then one full-weight `autograd.grad` per position.
   Prints both times, the speed ratio (target >= 10x) and the max relative difference.
2. A default probe job (ProbeParams defaults: 16 prompts x 8 samples, 5 bins, 64 positions per cell) on one
   checkpoint: records per second, overall and for the gradient stage alone.

The model is the embedded tiny model (forkrl/models/default or $FORKRL_MODEL_DIR) when present, otherwise a random
Llama of the same shape (hidden 128, 2 layers, 4 heads, 2 KV heads) with the character tokenizer.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path


def _model_dir(arg: str | None, tmp: Path) -> tuple[Path, str]:
    if arg:
        return Path(arg), "given"
    from forkrl.models.tiny import default_model_dir

    d = default_model_dir()
    if (d / "model.safetensors").is_file():
        return d, "embedded tiny model"
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from forkrl.models.tiny import build_tokenizer

    tok = build_tokenizer()
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.1)
    out = tmp / "random_tiny"
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out, "random Llama (tiny shape; no tiny model found)"


def bench_ratio(model_dir: Path, n_positions: int, repeats: int) -> None:
    import torch

    from forkrl.probe.checkpoints import load_checkpoint
    from forkrl.probe.gradients import build_targets, exact_row_grads, reference_row_grads
    from forkrl.probe.job import load_problems, plan_probe
    from forkrl.probe.params import ProbeParams
    from forkrl.probe.sampling import pad_right, sample_trajectories

    model, tok = load_checkpoint(model_dir, torch.float32, torch.device("cpu"))
    plan = plan_probe(ProbeParams(model=str(model_dir), num_prompts=16))
    problems, max_new = load_problems(plan), plan.max_new_tokens
    prompt_ids = [tok(p.prompt)["input_ids"] for p in problems]
    trajs = sample_trajectories(
        model,
        prompt_ids,
        group_size=8,
        temperature=1.0,
        max_new_tokens=max_new,
        seed=0,
        eos_ids=[tok.eos_token_id],
        pad_id=tok.pad_token_id,
    )
    g = torch.Generator().manual_seed(0)
    picks: list[tuple[int, int]] = []  # (trajectory, token index in the full sequence)
    for t in [trajs[i] for i in torch.randperm(len(trajs), generator=g).tolist()]:
        k = min(4, t.n_response, n_positions - len(picks))
        for j in sorted(torch.randperm(t.n_response, generator=g)[:k].tolist()):
            picks.append((t.index, len(t.prompt_ids) + j))
        if len(picks) >= n_positions:
            break
    targets = build_targets(model)
    by_traj: dict[int, list[int]] = {}
    for tr, pos in picks:
        by_traj.setdefault(tr, []).append(pos)

    order = sorted(by_traj)
    ids, attn = pad_right([trajs[x].ids for x in order], tok.pad_token_id)
    pos = [(b, p) for b, x in enumerate(order) for p in by_traj[x]]

    def exact(method: str, chunk: int):
        return lambda: exact_row_grads(model, ids, attn, pos, targets, chunk_size=chunk, method=method).grads

    def reference() -> dict[str, torch.Tensor]:
        return reference_row_grads(model, ids, attn, pos, targets)

    def naive() -> dict[str, torch.Tensor]:
        # what a first script does: a fresh forward and backward per position
        out: dict[str, list[torch.Tensor]] = {t.name: [] for t in targets}
        for b, p in pos:
            r = reference_row_grads(model, ids[b : b + 1], attn[b : b + 1], [(0, p)], targets)
            for n, v in r.items():
                out[n].append(v)
        return {n: torch.cat(v) for n, v in out.items()}

    def timed(fn) -> tuple[float, dict]:
        best, res = float("inf"), {}
        for _ in range(repeats):
            t0 = time.perf_counter()
            res = fn()
            best = min(best, time.perf_counter() - t0)
        return best, res

    t_ref, g_ref = timed(reference)
    t_naive, _ = timed(naive)
    print(f"positions: {len(picks)} from {len(by_traj)} trajectories; targets: {[t.name for t in targets]}")
    print(f"{'method':34s} {'ms':>8s} {'pos/s':>8s} {'vs retain_graph':>16s} {'vs naive':>9s} {'max rel err':>12s}")
    print(
        f"{'reference: retain_graph, 1 bwd/pos':34s} {t_ref * 1e3:8.1f} {len(picks) / t_ref:8.1f} {1.0:15.1f}x "
        f"{t_naive / t_ref:8.1f}x {'-':>12s}"
    )
    print(
        f"{'naive: fwd + bwd per position':34s} {t_naive * 1e3:8.1f} {len(picks) / t_naive:8.1f} "
        f"{t_ref / t_naive:15.1f}x {1.0:8.1f}x {'-':>12s}"
    )
    for method, chunk in (("vmap", 16), ("replicate", 16), ("replicate", 64), ("loop", 16)):
        t, g = timed(exact(method, chunk))
        err = max(
            float(((g[n] - g_ref[n]).norm(dim=(1, 2)) / g_ref[n].norm(dim=(1, 2)).clamp_min(1e-30)).max()) for n in g
        )
        print(
            f"{f'exact {method} (chunk {chunk})':34s} {t * 1e3:8.1f} {len(picks) / t:8.1f} {t_ref / t:15.1f}x "
            f"{t_naive / t:8.1f}x {err:12.2e}"
        )


def bench_job(model_dir: Path, tmp: Path) -> None:
    import json

    from forkrl.probe import ProbeParams, run_probe

    ckroot = tmp / "ckpts"
    ckroot.mkdir()
    (ckroot / "step_000001").symlink_to(model_dir.resolve(), target_is_directory=True)
    params = ProbeParams(checkpoint_root=str(ckroot), steps=[1])
    t0 = time.perf_counter()
    summary = run_probe(params, tmp / "out")
    total = time.perf_counter() - t0
    timings = json.loads((tmp / "out" / "manifest.json").read_text())["timings_s"]["step_000001"]
    n = summary["n_records"]
    c = summary["checkpoints"][0]
    print(
        f"default job: {c['n_trajectories']} responses, {c['n_response_tokens']} tokens, accuracy "
        f"{c['accuracy']:.2f}, {n} records, method {summary['gradient_method']}"
    )
    print("stage seconds: " + ", ".join(f"{k} {v:.2f}" for k, v in timings.items()))
    print(f"records/s: {n / total:.1f} end to end ({total:.1f} s), {n / timings['gradients']:.1f} gradient stage")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="HF checkpoint dir (default: the embedded tiny model)")
    ap.add_argument("--positions", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model_dir, what = _model_dir(args.model, tmp)
        print(f"model: {model_dir} ({what})")
        bench_ratio(model_dir, args.positions, args.repeats)
        bench_job(model_dir, tmp)


if __name__ == "__main__":
    main()
