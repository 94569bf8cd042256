"""Weight push, per sync route, vs the engine's own in-process reload of the same tensors.

    python bench/bench_weights.py                                 # qwen2-400m and qwen2-1.5g, every route
    python bench/bench_weights.py --models tiny --routes stream,shm --reps 5

For each model (random-init Qwen2 architecture built from a config, forkrl/models/random_qwen2.py, into
.cache/bench-models/; never committed) a rollout service and an in-process engine are up at the same time
and the repetitions alternate:
- each route through the trainer's own code (`Rollouts.push`, forkrl/training/rollouts.py), wall time as the
  trainer sees it:
  - stream: UpdateWeights (sha256 pass, 4 MiB chunks over loopback gRPC, server-side sha256 + staging file in
    /dev/shm, engine reload from it, prefix-cache reset);
  - shm: the tensors copied into a shared-memory safetensors file rewritten in place, LoadWeights on it;
  - path: safetensors written into the run dir (disk), LoadWeights on it;
- in-process: `vllm.LLM` with the same engine settings in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0),
  `collective_rpc("reload_weights", weights_iterator=...)` on the same tensors + `reset_prefix_cache()`:
  no serialization and no transport at all, the floor for any route.
Prints medians, the ratio route / in-process (goal <= 1.5) side by side for the models, and where each
route's time goes (the service's apply = drain + reload + prefix-cache reset; the rest is the trainer's side
and the transport).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODELS = {"tiny": "tiny", "qwen2-400m": "400m", "qwen2-1.5g": "1.5g"}  # name -> random_qwen2 size
ROUTES = ("stream", "shm", "path")


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="qwen2-400m,qwen2-1.5g", help=f"comma-separated, from {list(MODELS)}")
    p.add_argument("--routes", default=",".join(ROUTES), help=f"comma-separated, from {list(ROUTES)}")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    return p.parse_args()


def model_dir(name: str) -> Path:
    from forkrl.models.random_qwen2 import build_random_qwen2

    out = ROOT / ".cache" / "bench-models" / name
    print(f"model {out} ...", flush=True)
    return build_random_qwen2(out, MODELS[name])


def bench_model(name: str, routes: list[str], args: argparse.Namespace) -> dict[str, dict[str, float]]:
    from safetensors.torch import load_file
    from vllm import LLM

    from forkrl.training.rollouts import Rollouts
    from tests.service_fixtures import start_rollout_service

    path = model_dir(name)
    state = load_file(str(path / "model.safetensors"))  # what a trainer holds: CPU fp32 tensors
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    print(f"\n== {name}: {path} ({nbytes / 2**20:.1f} MiB, {len(state)} tensors)", flush=True)

    llm = LLM(
        model=str(path), dtype="float32", enforce_eager=True, seed=0, kv_cache_memory_bytes=1 << 30,
        logprobs_mode="processed_logprobs", enable_chunked_prefill=False,
        worker_extension_cls="rollout_service.worker_ext.WeightReloadExtension",
    )
    times: dict[str, list[float]] = {r: [] for r in ["inproc", *routes]}
    apply: dict[str, list[float]] = {r: [] for r in routes}
    version = 0
    with tempfile.TemporaryDirectory(prefix="bench-weights-") as tmp, \
            start_rollout_service(path, threads=args.threads, allowed_roots=tmp,
                                  extra_env={"OMP_NUM_THREADS": str(args.threads)}) as addr:
        rollouts = Rollouts([addr], token="")
        rollouts.wait_ready(120)
        try:
            for rep in range(args.reps):
                line = []
                for route in routes:
                    version += 1
                    t = rollouts.push(state, version, route, Path(tmp))  # type: ignore[arg-type]
                    times[route].append(t)
                    apply[route].append(rollouts.last_swap["swap_apply_s"])
                    line.append(f"{route} {t:.3f} s (apply {apply[route][-1]:.3f})")
                t = time.perf_counter()
                llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(state.items())})
                llm.reset_prefix_cache()
                times["inproc"].append(time.perf_counter() - t)
                print(f"rep {rep}: " + "; ".join(line) + f"; in-process {times['inproc'][-1]:.3f} s", flush=True)
        finally:
            rollouts.close()
    del llm, state
    gc.collect()
    med = {k: statistics.median(v) for k, v in times.items()}
    out: dict[str, dict[str, float]] = {"inproc": {"s": med["inproc"], "mib": nbytes / 2**20}}
    for r in routes:
        out[r] = {"s": med[r], "ratio": med[r] / med["inproc"], "apply": statistics.median(apply[r])}
    return out


def main() -> int:
    args = parse()
    from rollout_service.config import RolloutSettings, apply_engine_env

    apply_engine_env(RolloutSettings(model="unused", threads=args.threads))  # in-process vLLM: uni, same env
    routes = [r for r in args.routes.split(",") if r]
    bad = sorted(set(routes) - set(ROUTES))
    if bad:
        raise SystemExit(f"unknown route(s) {bad}; choose from {list(ROUTES)}")
    names = args.models.split(",")
    results = {name: bench_model(name, routes, args) for name in names}
    print("\npush time / in-process reload time (goal <= 1.5), medians of", args.reps, "reps")
    print(f"{'route':8s}" + "".join(f"  {n:>30s}" for n in names))
    print(f"{'size':8s}" + "".join(f"  {results[n]['inproc']['mib']:>26.0f} MiB" for n in names))
    print(f"{'inproc':8s}" + "".join(f"  {results[n]['inproc']['s']:>28.3f} s" for n in names))
    for r in routes:
        cells = [f"{results[n][r]['s']:.3f} s  x{results[n][r]['ratio']:.2f}  (apply {results[n][r]['apply']:.3f})"
                 for n in names]
        print(f"{r:8s}" + "".join(f"  {c:>30s}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
