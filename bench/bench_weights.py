"""Weight push: UpdateWeights over gRPC vs the engine's own in-process reload of the same tensors.

    python bench/bench_weights.py                    # the tiny model and a ~0.4 GB random Llama
    python bench/bench_weights.py --models tiny --reps 5

For each model both sides are up at the same time and repetitions alternate:
- service: `RolloutClient.update_weights(state_dict, v)` wall time as the trainer sees it (pack + sha256,
  stream in 4 MiB chunks, server-side checksum + staging file in /dev/shm, engine reload, prefix-cache
  reset); the server's receive/apply split is printed too;
- in-process: `vllm.LLM` with the same engine settings in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0),
  `collective_rpc("reload_weights", weights_iterator=...)` on the same tensors + `reset_prefix_cache()`:
  no serialization at all, the floor for any transport.
Prints medians and the ratio service / in-process (target <= 1.5). The 0.4 GB model is built once into
.cache/bench-models/ (git-ignored); it is not committed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODELS = {
    # name: build_random_llama kwargs (None = the embedded tiny model when built)
    "tiny": None,
    "llama-400m": dict(hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=16, head_dim=64,
                       intermediate_size=2816, max_position_embeddings=512),
}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="tiny,llama-400m", help=f"comma-separated, from {list(MODELS)}")
    p.add_argument("--reps", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    return p.parse_args()


def model_dir(name: str) -> Path:
    from tests.service_fixtures import build_random_llama

    if name == "tiny" and (ROOT / "models" / "tiny" / "model.safetensors").exists():
        return ROOT / "models" / "tiny"
    out = ROOT / ".cache" / "bench-models" / name
    if not (out / "model.safetensors").exists():
        print(f"building {out} ...", flush=True)
        build_random_llama(out, **(MODELS[name] or {}))
    return out


def bench_model(name: str, args: argparse.Namespace) -> dict[str, float]:
    from safetensors.torch import load_file
    from vllm import LLM

    from forkrl.clients.rollout import RolloutClient
    from forkrl.weights.wire import pack_state_dict
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
    service_s, inproc_s, receive_s, apply_s, hash_s = [], [], [], [], []
    with start_rollout_service(path, threads=args.threads, extra_env={"OMP_NUM_THREADS": str(args.threads)}) as addr:
        client = RolloutClient(addr, timeout_s=600)
        client.wait_ready(120)
        for rep in range(args.reps):
            t = time.perf_counter()
            pack_state_dict(state)  # the client's sha256 pass alone, for the breakdown
            hash_s.append(time.perf_counter() - t)

            t = time.perf_counter()
            assert client.update_weights(state, rep + 1) == rep + 1
            service_s.append(time.perf_counter() - t)
            r = client.last_weights_response
            receive_s.append(r.receive_s)
            apply_s.append(r.apply_s)

            t = time.perf_counter()
            llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(state.items())})
            llm.reset_prefix_cache()
            inproc_s.append(time.perf_counter() - t)
            print(f"rep {rep}: UpdateWeights {service_s[-1]:.3f} s (client sha256 {hash_s[-1]:.3f}, server receive "
                  f"{receive_s[-1]:.3f}, apply {apply_s[-1]:.3f})   in-process reload {inproc_s[-1]:.3f} s", flush=True)
        client.close()
    del llm
    med = {k: statistics.median(v) for k, v in
           dict(service=service_s, inproc=inproc_s, receive=receive_s, apply=apply_s, hash=hash_s).items()}
    ratio, rate = med["service"] / med["inproc"], nbytes / 2**20 / med["service"]
    print(f"{name}: median UpdateWeights {med['service']:.3f} s vs in-process {med['inproc']:.3f} s -> ratio "
          f"{ratio:.2f} (target <= 1.5); {rate:.0f} MiB/s end to end", flush=True)
    return med | {"mib": nbytes / 2**20}


def main() -> int:
    args = parse()
    from rollout_service.config import RolloutSettings, apply_engine_env

    apply_engine_env(RolloutSettings(model="unused", threads=args.threads))  # in-process vLLM: uni, same env
    results = {name: bench_model(name, args) for name in args.models.split(",")}
    print("\nmodel        MiB   UpdateWeights  in-process  ratio   (client sha256 / server receive / apply)")
    for name, m in results.items():
        ratio = m["service"] / m["inproc"]
        print(f"{name:11s} {m['mib']:6.1f}   {m['service']:9.3f} s  {m['inproc']:8.3f} s  {ratio:5.2f}"
              f"   ({m['hash']:.3f} / {m['receive']:.3f} / {m['apply']:.3f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
