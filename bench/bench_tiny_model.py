"""The numbers of this machine's embedded default model, which the tests deliberately do not assert.

    python bench/bench_tiny_model.py                  # includes a vLLM engine start
    python bench/bench_tiny_model.py --no-vllm        # the HF numbers only (seconds)

Prints what differs between builds and CPUs: the build record (SFT steps, accuracies), accuracy measured
again on other eval problems, the kinds of groups RL sees (all wrong / mixed / all right with 8 samples),
and how far float32 log-probs are from the exact (float64) values, for HF and for vLLM, next to the bound
the tests use (tests/numerics.py). The tests assert bands derived from these; this prints the values.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="model dir (default: the embedded default)")
    p.add_argument("--no-vllm", action="store_true", help="skip the vLLM log-prob comparison")
    args = p.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM

    from forkrl.data.tasks import DEFAULT_TASK, make_split
    from forkrl.models.tiny import default_model_dir, evaluate_accuracy, load_model_and_tokenizer, read_build_record
    from tests.numerics import float32_logprob_bound, logprob_parity, reference_logprobs

    model_dir = args.model or default_model_dir()
    record = read_build_record(model_dir) or {}
    acc = record.get("accuracy", {})
    print(f"model {model_dir}: {record.get('sft_steps')} SFT steps, sha256 {str(record.get('sha256'))[:12]}, "
          f"recorded T=1 {acc.get('t1')} greedy {acc.get('greedy')} (n={acc.get('final_eval_problems')})")

    model, tok = load_model_and_tokenizer(model_dir)
    m64 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    problems = make_split(record.get("config", {}).get("task", DEFAULT_TASK), "eval", 1024, seed=2)
    t1 = evaluate_accuracy(model, problems, tokenizer=tok, temperature=1.0, seed=123).accuracy
    greedy = evaluate_accuracy(model, problems, tokenizer=tok, temperature=0.0).accuracy
    grouped = evaluate_accuracy(model, problems[:256], tokenizer=tok, n_samples=8, seed=7).per_problem
    kinds = [sum(f == 0 for f in grouped), sum(0 < f < 1 for f in grouped), sum(f == 1 for f in grouped)]
    print(f"measured on 1024 other eval problems: T=1 {t1:.3f}, greedy {greedy:.3f}")
    print(f"groups of 8 samples on 256 problems: all wrong {kinds[0]}, mixed {kinds[1]}, all right {kinds[2]}")

    prompts = [p.prompt for p in problems[:32]]
    if args.no_vllm:
        return 0
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from forkrl.runtime import apply_runtime_env

    apply_runtime_env(threads=1)
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(model_dir), dtype="float32", enforce_eager=True, logprobs_mode="processed_logprobs",
              max_model_len=256, seed=0)
    rows = []
    for temperature, prompt_set, max_tokens in ((1.0, prompts, 11), (0.7, prompts, 11), (1.0, ["hello world"], 120)):
        sp = SamplingParams(temperature=temperature, n=8, max_tokens=max_tokens, logprobs=0, seed=0)
        served, seqs = [], []
        for out in llm.generate(prompt_set, sp, use_tqdm=False):
            for s in out.outputs:
                ids = list(s.token_ids)
                served.append([step[t].logprob for step, t in zip(s.logprobs, ids, strict=True)])
                seqs.append((list(out.prompt_token_ids), ids))
        worst, bound = logprob_parity(served, seqs, model, m64, temperature)
        hf_err = max(float((reference_logprobs(model, p_, c, temperature)[0]
                            - reference_logprobs(m64, p_, c, temperature)[0]).abs().max()) for p_, c in seqs)
        assert bound == float32_logprob_bound(seqs, model, m64, temperature)
        rows.append({"temperature": temperature, "prompts": "task" if prompt_set is prompts else "hello world",
                     "tokens": sum(len(c) for _, c in seqs), "vllm_vs_exact": worst, "hf32_vs_exact": hf_err,
                     "bound": bound})
    print(f"{'T':>4} {'prompts':>12} {'tokens':>7} {'vLLM-exact':>11} {'HF32-exact':>11} {'bound':>9} {'margin':>7}")
    for r in rows:
        print(f"{r['temperature']:4.1f} {r['prompts']:>12} {r['tokens']:7d} {r['vllm_vs_exact']:11.2e} "
              f"{r['hf32_vs_exact']:11.2e} {r['bound']:9.2e} {r['bound'] / max(r['vllm_vs_exact'], 1e-30):6.1f}x")
    print(json.dumps({"groups": kinds, "t1": t1, "greedy": greedy, "logprobs": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
