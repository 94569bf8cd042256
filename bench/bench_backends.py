"""Which rollout backend generates faster at which model size: the rule behind `--backend auto`.

    python bench/bench_backends.py                                  # tiny default + random Llamas of ~4M, ~19M, ~100M
    python bench/bench_backends.py --sizes 0.5m 19m --rounds 5 --threads 2

For each size, two rollout services over real gRPC serve the same checkpoint side by side — `--backend vllm` and
`--backend torch` — and the same Generate call (the tiny recipe's shape by default: 32 countdown prompts x 8
samples, <= 16 new tokens, T = 1, seeded) goes to each in turn, `--rounds` times after one warm-up, so that a
busy spell of the machine hits both. Prints per size the parameters, the median seconds per Generate of each
backend with its range, and torch / vLLM (below 1: the torch backend is faster). The sizes: `0.5m` is the
embedded default model (Llama, 0.5M parameters); the others are random-init Llamas built here from a config with
its character tokenizer (no download). Nothing asserts: docs/results.md ("Which backend generates faster") has
runs and the bound `rollout_service/backends.py` takes from them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# name -> build_random_llama settings (hidden, layers, heads, kv heads, head dim, intermediate)
SIZES = {
    "0.5m": None,  # the embedded default
    "4m": dict(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64, intermediate_size=1024),
    "19m": dict(hidden_size=512, num_layers=6, num_heads=8, num_kv_heads=2, head_dim=64, intermediate_size=1536),
    "100m": dict(hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=2, head_dim=64, intermediate_size=3584),
}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="OMP threads of both services (default: all cores)")
    return p.parse_args(argv)


def model_dir(size: str, root: Path) -> Path:
    if SIZES[size] is None:
        from forkrl.models.tiny import build_tiny_model, default_model_dir

        return build_tiny_model(default_model_dir(), progress=False)
    from tests.service_fixtures import build_random_llama

    return build_random_llama(root / size, max_position_embeddings=256, **SIZES[size])


def main(argv: list[str] | None = None) -> int:
    import contextlib
    import os

    from forkrl.data.tasks import make_split
    from forkrl.remote.rollout import RolloutClient
    from rollout_service.backends import parameter_count
    from tests.service_fixtures import start_rollout_service

    args = parse(argv)
    os.environ.setdefault("FORKRL_TOKEN", "bench-backends")
    prompts = [p.prompt for p in make_split("countdown", "train", args.prompts, seed=0)]
    env = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else {"OMP_NUM_THREADS": str(os.cpu_count() or 1)}
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-backends-") as tmp:
        for size in args.sizes:
            model = model_dir(size, Path(tmp))
            params = parameter_count(str(model))
            times: dict[str, list[float]] = {"vllm": [], "torch": []}
            with contextlib.ExitStack() as stack:
                clients = {}
                for backend in times:
                    addr = stack.enter_context(start_rollout_service(
                        model, backend=backend, seed=0, extra_env=env, log_path=Path(tmp) / f"{size}-{backend}.log"))
                    clients[backend] = stack.enter_context(RolloutClient(addr, timeout_s=1800))
                for r in range(args.rounds + 1):
                    for backend, c in clients.items():
                        t0 = time.perf_counter()
                        out = list(c.generate(prompts, n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens,
                                              seed=r))
                        dt = time.perf_counter() - t0
                        assert len(out) == len(prompts) * args.n
                        if r:  # round 0 warms up (vLLM's first call compiles and allocates)
                            times[backend].append(dt)
                    print(f"  {size} round {r}: " + ", ".join(f"{b} {times[b][-1]:.3f} s" if r else f"{b} warm-up"
                                                              for b in times), flush=True)
            med = {b: statistics.median(t) for b, t in times.items()}
            rows.append((size, params, med, times))
    print(f"\n{args.prompts} prompts x {args.n} samples, <= {args.max_new_tokens} new tokens, T=1, "
          f"{args.rounds} rounds, OMP threads {env['OMP_NUM_THREADS']}")
    print(f"{'size':>6} {'parameters':>12} {'vLLM s/Generate':>22} {'torch s/Generate':>22} {'torch / vLLM':>13}")
    for size, params, med, times in rows:
        cells = [f"{med[b]:.3f} ({min(times[b]):.3f}-{max(times[b]):.3f})" for b in ("vllm", "torch")]
        print(f"{size:>6} {params:>12,} {cells[0]:>22} {cells[1]:>22} {med['torch'] / med['vllm']:>13.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
