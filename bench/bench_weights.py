"""Weight push, per sync route, vs the engine's own in-process reload of the same tensors; and the trainer's peak
extra memory per push.

    python bench/bench_weights.py                                 # qwen2-400m and qwen2-1.5g, every route
    python bench/bench_weights.py --models tiny --routes transfer,shm --reps 5

For each model (random-init Qwen2 architecture built from a config, forkrl/models/random_qwen2.py, into
.cache/bench-models/; never committed) a rollout service (its own process) and an in-process engine are up at the
same time and the repetitions alternate:
- each route through the trainer's own code (`Rollouts.push`, forkrl/training/rollouts.py), this process being the
  trainer, wall time as the trainer sees it:
  - transfer: vLLM's weight-transfer API with the gloo backend (forkrl/weights/transfer_gloo.py) between this
    process and the service's engine process: StartWeightUpdate (pause), per layerwise group an UpdateWeightChunk
    concurrent with its gloo broadcast over loopback TCP, FinishWeightUpdate (resume); the group is formed at the
    first push, outside the timed ones (a warm-up push per route comes first);
  - stream: UpdateWeights (sha256 pass, 4 MiB chunks over loopback gRPC, server-side sha256 + staging file in
    /dev/shm, finite check, engine reload from it, prefix-cache reset);
  - shm: the tensors copied into a shared-memory safetensors file rewritten in place, LoadWeights on it;
  - path: safetensors written into the run dir (disk), LoadWeights on it;
- in-process: `vllm.LLM` with the same engine settings in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0),
  `collective_rpc("reload_weights", weights_iterator=...)` on the same tensors + `reset_prefix_cache()`:
  no serialization and no transport at all, the floor for any route.
Prints medians, the ratio route / in-process (goal <= 1.5) side by side for the models, where each route's time
goes (the service's apply: drain + reload, or for transfer the whole paused session), and the trainer's peak extra
memory per push: this process's peak resident memory during the push above its resident memory before it (the
kernel's high-water mark, reset before each push through /proc/self/clear_refs), and for transfer the most bytes
of layerwise groups it held gathered at once (two: the one sent and the one before it, still in flight; for a
model that is not sharded they are its own parameters, so nothing is added). The machine's other load shows in
every number: say so with them.
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
ROUTES = ("transfer", "stream", "shm", "path")


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


def _status_kib(field: str) -> int:
    """VmRSS / VmHWM of this process in KiB (Linux); 0 where unavailable."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _reset_peak() -> int:
    """Reset this process's peak resident memory to its current one; returns the current one (KiB)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    return _status_kib("VmRSS")


def bench_model(name: str, routes: list[str], args: argparse.Namespace) -> dict[str, dict[str, float]]:
    import torch
    from transformers import AutoModelForCausalLM
    from vllm import LLM

    from forkrl.training.rollouts import Rollouts
    from tests.service_fixtures import start_rollout_service

    path = model_dir(name)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)  # what a trainer holds: CPU fp32
    state = {k: v.detach() for k, v in model.state_dict().items()}  # the same storage
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    print(f"\n== {name}: {path} ({nbytes / 2**20:.1f} MiB, {len(state)} tensors)", flush=True)

    llm = LLM(
        model=str(path), dtype="float32", enforce_eager=True, seed=0, kv_cache_memory_bytes=1 << 30,
        logprobs_mode="processed_logprobs", enable_chunked_prefill=False,
        worker_extension_cls="rollout_service.worker_ext.WeightReloadExtension",
    )
    times: dict[str, list[float]] = {r: [] for r in ["inproc", *routes]}
    apply: dict[str, list[float]] = {r: [] for r in routes}
    peak: dict[str, list[float]] = {r: [] for r in routes}  # MiB above the resident memory before the push
    largest = 0.0
    version = 0
    with tempfile.TemporaryDirectory(prefix="bench-weights-") as tmp, \
            start_rollout_service(path, threads=args.threads, allowed_roots=tmp,
                                  extra_env={"OMP_NUM_THREADS": str(args.threads)}) as addr:
        rollouts = Rollouts([addr], token="")
        rollouts.wait_ready(120)
        try:
            for rep in range(-1, args.reps):  # rep -1: a warm-up push per route (the transfer group forms there)
                line = []
                for route in routes:
                    version += 1
                    gc.collect()
                    before = _reset_peak()
                    t = rollouts.push(model if route == "transfer" else state, version, route, Path(tmp))  # type: ignore[arg-type]
                    extra = (_status_kib("VmHWM") - before) / 1024
                    if rep >= 0:
                        times[route].append(t)
                        apply[route].append(rollouts.last_swap["swap_apply_s"])
                        peak[route].append(extra)
                    if route == "transfer":
                        largest = rollouts.last_transfer["peak_held_bytes"] / 2**20
                    line.append(f"{route} {t:.3f} s (apply {rollouts.last_swap['swap_apply_s']:.3f}, +{extra:.0f} MiB)")
                t = time.perf_counter()
                llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(state.items())})
                llm.reset_prefix_cache()
                if rep >= 0:
                    times["inproc"].append(time.perf_counter() - t)
                print(f"rep {rep}: " + "; ".join(line) + f"; in-process {time.perf_counter() - t:.3f} s", flush=True)
        finally:
            rollouts.close()
    del llm, state, model
    gc.collect()
    med = {k: statistics.median(v) for k, v in times.items()}
    out: dict[str, dict[str, float]] = {"inproc": {"s": med["inproc"], "mib": nbytes / 2**20}}
    for r in routes:
        out[r] = {"s": med[r], "ratio": med[r] / med["inproc"], "apply": statistics.median(apply[r]),
                  "peak_mib": max(peak[r]), "largest_mib": largest if r == "transfer" else float("nan")}
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
    print("\npush time / in-process reload time (goal <= 1.5), medians of", args.reps, "reps; the trainer's peak "
          "extra memory per push (max over reps)")
    print(f"{'route':8s}" + "".join(f"  {n:>46s}" for n in names))
    print(f"{'size':8s}" + "".join(f"  {results[n]['inproc']['mib']:>42.0f} MiB" for n in names))
    print(f"{'inproc':8s}" + "".join(f"  {results[n]['inproc']['s']:>44.3f} s" for n in names))
    for r in routes:
        cells = []
        for n in names:
            x = results[n][r]
            held = f", held {x['largest_mib']:.0f}" if r == "transfer" else ""
            cells.append(f"{x['s']:.3f} s x{x['ratio']:.2f} (apply {x['apply']:.3f}) +{x['peak_mib']:.0f} MiB{held}")
        print(f"{r:8s}" + "".join(f"  {c:>46s}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
