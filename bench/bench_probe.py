"""Benchmark the probe: sampling (vLLM vs transformers) and gradients on realistic shapes, and the exact
batched gradients against one backward per position on the tiny model.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_probe.py                      # --part qwen2 (default)
    .venv/bin/python bench/bench_probe.py --num-prompts 4 --max-new-tokens 128  # smaller
    .venv/bin/python bench/bench_probe.py --part tiny [--model DIR] [--positions 64] [--repeats 3]

--part qwen2 (issue 14 item 6): a random-init Qwen2-architecture model of ~100M parameters (hidden 768,
12 layers, 12 heads, 2 KV heads, intermediate 2816, a synthetic vocabulary of 8192 ids: prompts are random
token ids, so no tokenizer is involved), saved to a temp dir (no downloads). Prompts of mixed lengths
(16..96 tokens), --num-prompts x --num-samples responses of exactly --max-new-tokens tokens (EOS ignored),
sampled side by side by the transformers KV-cache sampler (which batches equal-length prompts only) and by
in-process vLLM (float32, engine start included); then the probe's teacher-forced entropy pass and the exact
row gradients of --positions positions (k_proj and down_proj of the first and last layer, rows
start/mid/last: the seed's grain). Prints sampling vs gradient time, records/s and the vLLM/transformers
sampling speed-up.

--part tiny (the earlier benchmark):
1. The same `--positions` positions (<= 4 per trajectory, sampled responses of the default task) and the
   default targets (k_proj and down_proj of the first and last layer, 32 seeded rows each):
   - exact batched: trajectories packed into forward batches of 16 positions, one `is_grads_batched`
     backward per batch (forkrl.probe.gradients.exact_row_grads);
   - reference: one forward per trajectory, then one full-weight `autograd.grad` per position.
   Prints both times, the speed ratio (target >= 10x) and the max relative difference.
2. A default probe job (ProbeParams defaults) on one checkpoint: records per second, overall and for the
   gradient stage alone.
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


QWEN2_SHAPE = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=2,
                   intermediate_size=2816, vocab_size=8192)  # fmt: skip


def build_qwen2(out: Path) -> tuple[Path, int]:
    """A random-init Qwen2ForCausalLM of ~100M parameters saved as safetensors (no tokenizer)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(**QWEN2_SHAPE, max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=1,
                      eos_token_id=2, pad_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    model.save_pretrained(out, safe_serialization=True)
    return out, sum(p.numel() for p in model.parameters())


def bench_qwen2(tmp: Path, num_prompts: int, num_samples: int, max_new: int, n_positions: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from forkrl.probe.engines import sample_with_vllm
    from forkrl.probe.gradients import build_targets, exact_row_grads
    from forkrl.probe.sampling import pad_right, sample_trajectories, token_stats

    t0 = time.perf_counter()
    model_dir, n_params = build_qwen2(tmp / "qwen2_100m")
    print(f"model: random-init Qwen2 {n_params / 1e6:.1f}M params {QWEN2_SHAPE} (built in "
          f"{time.perf_counter() - t0:.1f} s); torch threads {torch.get_num_threads()}", flush=True)  # fmt: skip
    g = torch.Generator().manual_seed(0)
    vocab = QWEN2_SHAPE["vocab_size"]
    lengths = torch.randint(16, 97, (num_prompts,), generator=g).tolist()
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
    no_eos = [vocab]  # an id the model cannot draw: every response runs to max_new tokens
    kw = dict(group_size=num_samples, temperature=1.0, max_new_tokens=max_new, seed=0)
    n_tok = num_prompts * num_samples * max_new
    print(f"sampling {num_prompts} prompts (lengths {min(lengths)}..{max(lengths)}, {len(set(lengths))} distinct) "
          f"x {num_samples} samples x {max_new} new tokens = {n_tok} tokens", flush=True)  # fmt: skip

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    model.eval().requires_grad_(False)
    t0 = time.perf_counter()
    hf = sample_trajectories(model, prompts, eos_ids=no_eos, pad_id=0, **kw)
    t_hf = time.perf_counter() - t0
    print(f"  transformers: {t_hf:.1f} s", flush=True)
    t0 = time.perf_counter()
    vt: dict[str, float] = {}
    trajs = sample_with_vllm(model_dir, prompts, eos_ids=[2], ignore_eos=True, timings=vt, **kw)
    t_vllm = time.perf_counter() - t0
    print(f"  vllm:         {t_vllm:.1f} s (engine start {vt['engine_start']:.1f} s)", flush=True)
    assert all(t.n_response == max_new for t in trajs + hf)

    t0 = time.perf_counter()
    stats = token_stats(model, trajs, temperature=1.0, batch_size=8)
    t_ent = time.perf_counter() - t0
    # positions: spread over trajectories (seeded), as the probe's cells do
    picks: dict[int, list[int]] = {}
    for k in range(n_positions):
        tr = k % len(trajs)
        picks.setdefault(tr, []).append(int(torch.randint(0, max_new, (1,), generator=g)))
    targets = build_targets(model, ("k_proj", "down_proj"), (0, -1), ("start", "mid", "last"), row_mode="row")
    n_rows = sum(len(t.row_sets) for t in targets)
    t0 = time.perf_counter()
    order = sorted(picks)
    for s in range(0, len(order), 4):  # a few trajectories per backward batch, like the job's grad_chunk_size
        batch = order[s : s + 4]
        ids, attn = pad_right([trajs[x].ids for x in batch], 0)
        pos = [(b, len(trajs[x].prompt_ids) + j) for b, x in enumerate(batch) for j in sorted(picks[x])]
        exact_row_grads(model, ids, attn, pos, targets, chunk_size=16, method="vmap")
    t_grad = time.perf_counter() - t0
    records = n_positions * n_rows
    assert len(stats) == len(trajs)

    def row(name: str, sec: float, extra: str = "") -> None:
        print(f"| {name:42s} | {sec:9.1f} | {extra:34s} |")

    print(f"\n| {'stage':42s} | {'seconds':>9s} | {'':34s} |\n|{'-' * 44}|{'-' * 10}:|{'-' * 36}|")
    row("sampling, transformers (KV cache)", t_hf, f"{n_tok / t_hf:.1f} tok/s")
    row("sampling, vLLM in-process (total)", t_vllm, f"{n_tok / t_vllm:.1f} tok/s")
    row("  of which vLLM engine start", vt["engine_start"], "")
    row("  of which vLLM generate", vt["generate"], f"{n_tok / vt['generate']:.1f} tok/s")
    row("entropy pass (teacher-forced, fp32)", t_ent, f"{n_tok / t_ent:.0f} tok/s")
    row(f"gradients ({n_positions} positions, vmap)", t_grad, f"{records} records, {records / t_grad:.1f} rec/s")
    job_vllm, job_hf = t_vllm + t_ent + t_grad, t_hf + t_ent + t_grad
    row("probe total with vLLM sampling", job_vllm, f"{records / job_vllm:.2f} records/s")
    row("probe total with transformers sampling", job_hf, f"{records / job_hf:.2f} records/s")
    print(f"\nvLLM / transformers sampling speed-up: {t_hf / t_vllm:.2f}x with engine start, "
          f"{t_hf / vt['generate']:.2f}x generate only; sampling share of the job: "
          f"{t_vllm / job_vllm:.0%} (vLLM), {t_hf / job_hf:.0%} (transformers)")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=["qwen2", "tiny"], default="qwen2")
    ap.add_argument("--model", help="--part tiny: HF checkpoint dir (default: the embedded tiny model)")
    ap.add_argument("--positions", type=int, default=0, help="positions to differentiate (qwen2: 24, tiny: 64)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--num-samples", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=512)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        if args.part == "qwen2":
            bench_qwen2(tmp, args.num_prompts, args.num_samples, args.max_new_tokens, args.positions or 24)
            return
        model_dir, what = _model_dir(args.model, tmp)
        print(f"model: {model_dir} ({what})")
        bench_ratio(model_dir, args.positions or 64, args.repeats)
        bench_job(model_dir, tmp)


if __name__ == "__main__":
    main()
