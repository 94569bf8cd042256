"""How long a weight push stalls generation: swap mode "inplace" vs "drain", in engine steps.

    python bench/bench_swap.py                           # the embedded tiny model, 16 slots, 12 pushes
    python bench/bench_swap.py --model DIR --slots 64 --max-new-tokens 128 --pushes 12 --threads 2

The rollout service's own RolloutEngine and VllmBackend run in this process (no gRPC: the swap is the same
code), under an async-RL load: `--slots` concurrent generation slots, each submitting one sample after
another (the next as soon as the last finished), as a trainer sampling ahead does. After a warm-up, pushes
(LoadWeights of alternating checkpoints, the modes taking turns, so all see the same load) come every
`--every-s` seconds. The backend streams tokens (DELTA outputs) only to time them.

Three gaps are timed: between two consecutive tokens of one sample as the engine core stamped them (each
step's outputs carry its time.monotonic(): what the engine itself held up, whatever the front-end's event loop,
which also runs this benchmark's samplers, was doing); the same as the tokens arrived here; and between two
consecutive tokens of one slot across its samples (also the time a slot waits for a new sample to start: what
a drain costs). A gap within a sample never spans two samples, so no prefill of its own is in it. Printed per
mode and push, and per mode (median and max over pushes) with the same measure on a window of the same length
just before each push (the noise floor) and what each push added to it, in units of one engine step (the
median engine-stamped gap within a sample away from pushes); with the worker's reload and the drain.
"inplace" is the service's default: vLLM's scheduler paused in its "keep" mode + the reload + resume (the
samples in flight stay scheduled, KV cache kept); "drain" waits for the samples in flight first.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = ("inplace", "drain")
sys.path.insert(0, str(ROOT))


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF checkpoint dir (default: the embedded tiny model)")
    p.add_argument("--slots", type=int, default=16, help="concurrent samples")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--pushes", type=int, default=12, help="pushes in all (the modes take turns)")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="swap modes to time")
    p.add_argument("--every-s", type=float, default=1.5, help="seconds between pushes")
    p.add_argument("--warmup-s", type=float, default=3.0)
    p.add_argument("--threads", type=int, default=1, help="engine threads")
    p.add_argument("--kv-cache-gib", type=float, default=1.0)
    return p.parse_args()


def model_dir(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    from forkrl.models.tiny import default_model_dir

    return default_model_dir()


def checkpoints(src: Path, out: Path) -> list[Path]:
    """The served weights and a perturbed copy, as two checkpoint directories."""
    import torch
    from safetensors.torch import load_file, save_file

    from forkrl.weights.safetensors import checkpoint_files

    state = {k: v for f in checkpoint_files(src) for k, v in load_file(f).items()}
    g = torch.Generator().manual_seed(0)
    dirs = []
    for k, scale in enumerate((0.0, 0.1)):
        d = out / f"ckpt{k}"
        d.mkdir()
        st = {n: (v + scale * v.float().std() * torch.randn(v.shape, generator=g)).to(v.dtype).contiguous()
              for n, v in state.items()}
        save_file(st, str(d / "model.safetensors"))
        dirs.append(d)
    return dirs


async def run(args: argparse.Namespace) -> None:
    from rollout_service.config import RolloutSettings, apply_engine_env

    settings = RolloutSettings(model=str(model_dir(args.model)), threads=args.threads, kv_cache_gib=args.kv_cache_gib,
                               max_num_seqs=max(args.slots, 1))
    apply_engine_env(settings)
    from rollout_service.engine import RolloutEngine
    from rollout_service.types import Completion, SamplingSpec
    from rollout_service.vllm_backend import VllmBackend, _sampled_logprobs

    token_times: dict[str, list[float]] = defaultdict(list)  # sample -> arrival time of each generated token
    slot_times: dict[str, list[float]] = defaultdict(list)  # slot -> the same across its samples

    class TimedBackend(VllmBackend):
        """The service's backend, with DELTA outputs so that every token's arrival is timed."""

        async def generate_one(self, request_id, prompt_ids, spec, seed):  # type: ignore[no-untyped-def]
            from vllm.sampling_params import RequestOutputKind

            params = self._sampling_params(spec, seed)
            params.output_kind = RequestOutputKind.DELTA
            slot = request_id.split("-", 1)[0]
            ids: list[int] = []
            lps: list[float] = []
            finish = "abort"
            prompt = {"type": "token", "prompt_token_ids": prompt_ids, "cache_salt": f"w{self._epoch}"}
            async for out in self._llm.generate(prompt, params, request_id=request_id):
                c = out.outputs[0]
                now = time.monotonic()
                token_times[request_id].extend([now] * len(c.token_ids))
                slot_times[slot].extend([now] * len(c.token_ids))
                ids += list(c.token_ids)
                lps += _sampled_logprobs(c.logprobs, list(c.token_ids))
                finish = c.finish_reason or finish
            return Completion(ids, "", lps, finish)

    backend = await TimedBackend.start(settings)
    # The engine core stamps each step's outputs (EngineCoreOutputs.timestamp, time.monotonic() in the engine
    # core process): gaps between those stamps are what the engine itself held up, whatever the front-end's
    # event loop (which also runs this benchmark's samplers) was doing when the tokens arrived.
    engine_times: dict[str, list[float]] = defaultdict(list)  # engine request -> step stamp of each token
    core = backend._llm.engine_core
    get_output = core.get_output_async

    async def stamped_outputs():  # noqa: ANN202
        outputs = await get_output()
        for o in outputs.outputs:
            engine_times[o.request_id].extend([outputs.timestamp] * len(o.new_token_ids))
        return outputs

    core.get_output_async = stamped_outputs
    tmp = Path(tempfile.mkdtemp(prefix="bench-swap-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    ckpts = checkpoints(Path(settings.model), tmp)
    engine = RolloutEngine(backend, staging_dir=tmp / "staging")
    prompt = backend.encode("hello world")
    stop = asyncio.Event()

    async def slot(s: int) -> None:
        k = 0
        while not stop.is_set():
            spec = SamplingSpec(n=1, temperature=1.0, max_new_tokens=args.max_new_tokens, seed=1000 * s + k)
            async for _ in engine.generate([prompt], spec, tag=f"slot{s}"):
                pass
            k += 1

    tasks = [asyncio.create_task(slot(s)) for s in range(args.slots)]
    pushes: list[tuple[str, float, float, float, float, float]] = []  # (mode, t0, t1, apply_s, drain_s, worker_s)
    await asyncio.sleep(args.warmup_s)
    for k in range(args.pushes):
        mode = args.modes[k % len(args.modes)]
        engine.swap_mode = "drain" if mode == "drain" else "inplace"
        t0 = time.monotonic()
        r = await engine.load_weights(str(ckpts[(k + 1) % 2]), engine.version + 1)
        pushes.append((mode, t0, time.monotonic(), r.apply_s, r.drain_s, backend.last_reload_s))
        await asyncio.sleep(args.every_s)
    stop.set()
    await asyncio.gather(*tasks)
    backend.shutdown()

    gap_sets = {"engine, in a sample": _gaps(engine_times.values()), "client, in a sample": _gaps(token_times.values()),
                "client, of a slot": _gaps(slot_times.values())}

    def quiet_median(gaps: list[tuple[float, float]]) -> float:
        return statistics.median(y - x for x, y in gaps if not any(y > t0 and x < t1 for _, t0, t1, *_ in pushes))

    step = quiet_median(gap_sets["engine, in a sample"])
    client_step = quiet_median(gap_sets["client, in a sample"])
    tokens = sum(len(ts) for ts in token_times.values())
    print(f"model {settings.model}, {args.slots} slots, {args.max_new_tokens} new tokens, {args.threads} threads: "
          f"{tokens} tokens; engine step (median gap between a sample's tokens) {step * 1e3:.2f} ms as the engine "
          f"stamped them, {client_step * 1e3:.2f} ms as they arrived; gaps below in engine steps")
    for mode in args.modes:
        mine = [p for p in pushes if p[0] == mode]
        for _, t0, t1, _apply_s, drain_s, worker_s in mine:
            longest = ", ".join(f"{name} {_longest(gaps, t0, t1) / step:5.2f}" for name, gaps in gap_sets.items())
            before = _longest(gap_sets["engine, in a sample"], t0 - 0.02 - (t1 - t0), t0 - 0.02) / step
            longest += f" (engine, the window before: {before:5.2f})"
            print(f"  {mode:7s} push: longest gap: {longest} (push {(t1 - t0) * 1e3:.1f} ms: the worker's reload "
                  f"{worker_s * 1e3:.2f} ms, drain {drain_s * 1e3:.1f} ms)")
        for name, gaps in gap_sets.items():
            ratios = [_longest(gaps, t0, t1) / step for _, t0, t1, *_ in mine]
            # the same measure on a window of the same length without a push, just before the push (the last
            # push ended every_s earlier): what the longest gap is anyway (prefills batched in, the machine's
            # load); each push against its own window: what the push added to the longest gap
            # (a window that holds no gap at all, i.e. one reaching back before the first tokens, is no control)
            pairs = [(_longest(gaps, t0, t1) / step, before / step) for _, t0, t1, *_ in mine
                     if t1 - t0 < args.every_s - 0.04
                     for before in [_longest(gaps, t0 - 0.02 - (t1 - t0), t0 - 0.02)] if before > 0]
            controls = [c for _, c in pairs]
            added = [r - c for r, c in pairs]
            print(f"{mode:7s}: longest gap {name:19s} / step: median {statistics.median(ratios):5.2f}, max "
                  f"{max(ratios):5.2f}; same windows without a push: median "
                  f"{statistics.median(controls) if controls else float('nan'):5.2f}, "
                  f"max {max(controls) if controls else float('nan'):5.2f}; added by the push: median "
                  f"{statistics.median(added) if added else float('nan'):+5.2f}, max "
                  f"{max(added) if added else float('nan'):+5.2f}, <= 1 step at "
                  f"{sum(a <= 1 for a in added)}/{len(added)} pushes")


def _gaps(series) -> list[tuple[float, float]]:  # noqa: ANN001
    return [(x, y) for ts in series for x, y in zip(ts, ts[1:], strict=False) if y > x]


def _longest(gaps: list[tuple[float, float]], t0: float, t1: float) -> float:
    """The longest gap overlapping [t0, t1]."""
    return max((y - x for x, y in gaps if y > t0 and x < t1), default=0.0)


def main() -> None:
    asyncio.run(run(parse()))


if __name__ == "__main__":  # vLLM spawns processes that re-import the main module: keep this guard
    main()
