"""Rollout overhead: the same prompts and seeds through the gRPC service vs vLLM's AsyncLLM in-process.

    python bench/bench_rollout.py                       # the embedded tiny model (or a random Llama), 64 prompts x 8
    python bench/bench_rollout.py --model DIR --prompts 64 --n 8 --max-new-tokens 32 --rounds 4

Both engines are started with the same settings (RolloutSettings defaults + --threads) and stay up side by
side; rounds alternate between them so that load from other processes hits both alike. The in-process
side calls `AsyncLLM.generate` directly, one request per sample with the exact SamplingParams the service
uses (FINAL_ONLY, sampled-token logprobs, per-sample seeds); the service side is RolloutClient.generate
(gRPC stream, validation, gate, proto conversion). Prints generated tokens/s of each round and the ratio
service / in-process (target >= 0.97).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help="HF checkpoint dir (default: the embedded tiny model, else a random Llama)")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--threads", type=int, default=2, help="engine threads (both sides)")
    p.add_argument("--engine-mode", default="uni", choices=["uni", "mp"])
    return p.parse_args()


def model_dir(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    from forkrl.models.tiny import default_model_dir

    tiny = default_model_dir()
    if (tiny / "model.safetensors").exists():
        return tiny
    from tests.service_fixtures import build_random_llama

    out = ROOT / ".cache" / "bench-models" / "random-tiny"
    return out if (out / "model.safetensors").exists() else build_random_llama(out)


def prompts(count: int) -> list[str]:
    from forkrl.data.tasks import DEFAULT_TASK, make_split

    return [p.prompt for p in make_split(DEFAULT_TASK, "eval", count, seed=0)]


async def inprocess_round(backend, prompt_ids: list[list[int]], args: argparse.Namespace, seed: int) -> int:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from forkrl.seeds import sample_seed

    llm = backend._llm

    async def one(i: int, j: int) -> int:
        params = SamplingParams(
            n=1, temperature=1.0, top_p=1.0, max_tokens=args.max_new_tokens, seed=sample_seed(seed, i, j),
            logprobs=0, flat_logprobs=True, output_kind=RequestOutputKind.FINAL_ONLY,
        )
        final = None
        prompt = {"type": "token", "prompt_token_ids": prompt_ids[i]}
        async for out in llm.generate(prompt, params, request_id=f"b{seed}-{i}-{j}"):
            final = out
        return len(final.outputs[0].token_ids)

    counts = await asyncio.gather(*[one(i, j) for i in range(len(prompt_ids)) for j in range(args.n)])
    return sum(counts)


def main() -> int:
    args = parse()
    from rollout_service.config import RolloutSettings, apply_engine_env

    model = model_dir(args.model)
    settings = RolloutSettings(model=str(model), threads=args.threads, engine_mode=args.engine_mode)
    apply_engine_env(settings)

    import psutil

    from forkrl.remote.rollout import RolloutClient
    from rollout_service.vllm_backend import VllmBackend
    from tests.service_fixtures import start_rollout_service

    def cpu_s(procs: list[psutil.Process]) -> float:
        total = 0.0
        for pr in procs:
            try:
                t = pr.cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
        return total

    texts = prompts(args.prompts)
    loop = asyncio.new_event_loop()
    backend = loop.run_until_complete(VllmBackend.start(settings))
    prompt_ids = [backend.encode(t) for t in texts]
    service_kwargs = {"threads": args.threads, "engine_mode": args.engine_mode}
    rows = []
    with start_rollout_service(model, extra_env={"OMP_NUM_THREADS": str(args.threads)}, **service_kwargs) as addr:
        client = RolloutClient(addr, timeout_s=600)
        client.wait_ready(120)
        me = psutil.Process()
        service_tree = [psutil.Process(addr.process.pid)]
        service_tree += service_tree[0].children(recursive=True)
        service_pids = {pr.pid for pr in service_tree}
        inproc_tree = [me] + [pr for pr in me.children(recursive=True) if pr.pid not in service_pids]
        # warm-up both (first calls compile sampler ops)
        list(client.generate(texts[:4], n=2, max_new_tokens=4, seed=999))
        loop.run_until_complete(inprocess_round(backend, prompt_ids[:4], argparse.Namespace(**{**vars(args), "n": 2}),
                                                999))
        for r in range(args.rounds):
            seed = 1000 + r
            # CPU seconds of every process involved: robust to other load on a shared machine, where
            # wall-clock tokens/s of alternating rounds swings widely.
            c0, t = cpu_s(service_tree) + cpu_s([me]), time.perf_counter()
            toks_g = sum(len(tr.completion_token_ids) for tr in client.generate(
                texts, n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens, seed=seed))
            dt_g, cpu_g = time.perf_counter() - t, cpu_s(service_tree) + cpu_s([me]) - c0
            c0, t = cpu_s(inproc_tree), time.perf_counter()
            toks_i = loop.run_until_complete(inprocess_round(backend, prompt_ids, args, seed))
            dt_i, cpu_i = time.perf_counter() - t, cpu_s(inproc_tree) - c0
            rows.append((toks_g / dt_g, toks_i / dt_i, toks_g, toks_i, cpu_g, cpu_i))
            print(f"round {r}: grpc {toks_g / dt_g:6.0f} tok/s {cpu_g:5.2f} cpu-s | in-process {toks_i / dt_i:6.0f} "
                  f"tok/s {cpu_i:5.2f} cpu-s | wall ratio {(toks_g / dt_g) / (toks_i / dt_i):.3f}, "
                  f"cpu ratio {cpu_i / cpu_g:.3f}", flush=True)
        client.close()
    backend.shutdown()
    pending = asyncio.all_tasks(loop)
    for task in pending:
        task.cancel()
    loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    loop.close()
    ratios = [row[0] / row[1] for row in rows]
    same = all(row[2] == row[3] for row in rows)
    print(f"model {model}  {args.prompts} prompts x n={args.n} x <= {args.max_new_tokens} tokens, "
          f"threads={args.threads}, engine_mode={args.engine_mode}")
    print(f"identical token counts on both sides (same seeds): {same}")
    total_g = sum(r[2] for r in rows) / sum(r[2] / r[0] for r in rows)
    total_i = sum(r[3] for r in rows) / sum(r[3] / r[1] for r in rows)
    cpu_g, cpu_i = sum(r[4] for r in rows), sum(r[5] for r in rows)
    print(f"all rounds, wall: grpc {total_g:.0f} tok/s, in-process {total_i:.0f} tok/s, ratio {total_g / total_i:.3f}")
    print(f"all rounds, CPU: grpc {sum(r[2] for r in rows) / cpu_g:.0f} tok per cpu-s, in-process "
          f"{sum(r[3] for r in rows) / cpu_i:.0f} tok per cpu-s, ratio {cpu_i / cpu_g:.3f} (the noise-robust number)")
    print(f"tokens/s ratio grpc / in-process: median {statistics.median(ratios):.3f} "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f}; target >= 0.97)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
