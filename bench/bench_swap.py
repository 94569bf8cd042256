"""How long a weight push stalls generation: swap mode "inplace" (staged or not) vs "drain", in engine steps.

    python bench/bench_swap.py                           # the embedded tiny model, 16 slots, 12 pushes
    python bench/bench_swap.py --model DIR --slots 64 --max-new-tokens 128 --pushes 12 --threads 2
    python bench/bench_swap.py --pushes 24 --modes staged --stage-slice-ms 0.5

The rollout service's own RolloutEngine and VllmBackend run in this process (no gRPC: the swap is the same
code), under an async-RL load: `--slots` concurrent generation slots, each submitting one sample after
another (the next as soon as the last finished), as a trainer sampling ahead does. After a warm-up, pushes
(LoadWeights of alternating checkpoints, the three modes taking turns, so all see the same load) come
every `--every-s` seconds. The backend streams tokens (DELTA outputs) only to time them.

Three gaps are timed: between two consecutive tokens of one sample as the engine core stamped them (each
step's outputs carry its time.monotonic(): what the engine itself held up, whatever the front-end's event loop,
which also runs this benchmark's samplers, was doing); the same as the tokens arrived here; and between two
consecutive tokens of one slot across its samples (also the time a slot waits for a new sample to start: what
a drain costs). A gap within a sample never spans two samples, so no prefill of its own is in it. Printed per
mode and push, and per mode (median and max over pushes) with the same measure on a window of the same length
just before each push (the noise floor) and what each push added to it, in units of one engine step (the
median engine-stamped gap within a sample away from pushes); with the staging time (generation goes on), the
worker's copy (staged) or reload (inplace, drain) and the drain. Staged pushes also print the slices and the
longest one and the workers' apply reports, and per mode the longest call of each push into the engine's loop (a
slice or the copy, timed by the worker: the most one engine step was held back by the swap, on the engine's own
clock, free of the noise of the gaps), with the CPU steal (/proc/stat: time the hypervisor ran other guests on
this VM's CPUs, which stretches whatever runs meanwhile) during the pushes and during those that held a step longer
than one step, and the CPU time of the swap's work in that call (the time the hypervisor took the CPU and waits
for one left out: what the swap itself put between two steps). "staged" is staged with this machine's defaults;
"staged-inline" on the engine's thread (--stage-inline, the CPU default), "staged-thread" on a staging thread of
its own (--stage-inline false), "staged-beside" that with --stage-native-beside true (the GPU default). For an
inline push whose longest call exceeded one step, the bench splits that slice's wall time into the work's CPU
time, the engine thread's wait for a core (the kernel's run delay) and the rest (off the CPU otherwise: steal,
when the thread did not block). Inline, it also prints per mode the longest stretch of the swap's work between
two checkpoints (CPU; what one slice cannot end inside of) and the step of the staging it was most often.
The issue's target: a push stalls generation by at most one engine step, i.e. it adds at most one step to the
longest gap of its window ("added by the push"). "staged" (inplace with --stage-weights, the default) loads the
new weights into a shadow model in slices between engine steps while generation goes on and stalls for the copy
alone; "inplace" (--stage-weights false) for pause + vLLM's reload + resume; "drain" for the drain as well.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = ("staged", "staged-inline", "staged-thread", "staged-beside", "inplace", "drain")
sys.path.insert(0, str(ROOT))


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF checkpoint dir (default: the embedded tiny model)")
    p.add_argument("--slots", type=int, default=16, help="concurrent samples")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--pushes", type=int, default=12, help="pushes in all (the modes take turns)")
    p.add_argument("--modes", nargs="+", choices=MODES, default=["staged", "inplace", "drain"],
                   help="swap modes to time (staged: this machine's defaults; staged-inline: --stage-inline; "
                        "staged-thread: --stage-inline false; staged-beside: that with --stage-native-beside true)")
    p.add_argument("--every-s", type=float, default=1.5, help="seconds between pushes")
    p.add_argument("--warmup-s", type=float, default=3.0)
    p.add_argument("--threads", type=int, default=1, help="engine threads")
    p.add_argument("--kv-cache-gib", type=float, default=1.0)
    p.add_argument("--stage-slice-ms", type=float, default=None,
                   help="the longest slice of a staged load between two engine steps (default: the service's)")
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
                               max_num_seqs=max(args.slots, 1),
                               **({} if args.stage_slice_ms is None else {"stage_slice_ms": args.stage_slice_ms}))
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
    # (mode, t0, t1, apply_s, drain_s, worker_s, stage_s)
    pushes: list[tuple[str, float, float, float, float, float, float]] = []
    held: dict[int, float] = {}  # staged pushes: the longest the swap held the engine's loop in one call
    stolen: dict[int, float] = {}  # ... and the share of CPU time the hypervisor took from this VM meanwhile
    worked: dict[int, float] = {}  # ... and the CPU time of the longest slice's (or the copy's) work
    where: dict[int, dict[str, float]] = {}  # ... and where the longest slice's wall time went (inline staging)
    stretches: dict[int, dict] = {}  # ... the longest stretch between two checkpoints (inline): CPU s, at which step
    copies: dict[int, tuple[float, float]] = {}  # ... and the final copy's wall and CPU seconds
    inline, beside = backend.stage_inline, backend.stage_native_beside  # "staged": this machine's defaults
    await asyncio.sleep(args.warmup_s)
    for k in range(args.pushes):
        mode = args.modes[k % len(args.modes)]
        engine.swap_mode = "drain" if mode == "drain" else "inplace"
        backend.stage_weights = mode.startswith("staged")
        backend.stage_inline = {"staged": inline, "staged-inline": True}.get(mode, False)
        backend.stage_native_beside = {"staged": beside, "staged-beside": True}.get(mode, False)
        backend.last_stage_s = backend.last_max_slice_s = backend.last_max_slice_cpu_s = 0.0
        backend.last_stage_slices = backend.last_stage_overruns = 0
        backend.last_longest_stretch = {}
        t0, ticks0 = time.monotonic(), _cpu_ticks()
        r = await engine.load_weights(str(ckpts[(k + 1) % 2]), engine.version + 1)
        pushes.append((mode, t0, time.monotonic(), r.apply_s, r.drain_s, backend.last_reload_s,
                       backend.last_stage_s))
        if mode.startswith("staged"):
            # the longest call of the swap into the engine's loop: a slice (with its 0.3 ms output grace) or the
            # copy; the engine steps between them. What a push held one engine step back by, on the engine's clock
            held[k] = max(backend.last_max_slice_s, backend.last_reload_s)
            # ... and the CPU time of the swap's work in the longest such call (on a VM, time the hypervisor took
            # the CPU and waits for a core are left out: what the swap itself put between two steps)
            worked[k] = max(backend.last_max_slice_cpu_s, backend.last_copy_cpu_s)
            where[k] = dict(backend.last_longest_slice)
            stretches[k] = dict(backend.last_longest_stretch)  # inline only (else empty)
            copies[k] = (backend.last_reload_s, backend.last_copy_cpu_s)
            stolen[k] = _steal_share(ticks0, _cpu_ticks())
            print(f"  {mode} push {k}: {backend.last_stage_slices} slices, longest {backend.last_max_slice_s * 1e3:.2f}"
                  f" ms (its work: {backend.last_max_slice_cpu_s * 1e3:.2f} ms of CPU), "
                  f"{backend.last_stage_overruns} given up on a native call; apply {backend.last_apply}")
        await asyncio.sleep(args.every_s)
    stop.set()
    await asyncio.gather(*tasks)
    backend.shutdown()

    if backend.stage_failures:
        print("the staged swap fell back to pause + reload (see the warning above): no staged numbers")
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
        if mode.startswith("staged"):
            steps = [held[k] / step for k, p in enumerate(pushes) if p[0] == mode]
            over = [stolen[k] for k, p in enumerate(pushes) if p[0] == mode and held[k] > step]
            steal = [stolen[k] for k, p in enumerate(pushes) if p[0] == mode]
            print(f"{mode}: the longest call into the engine's loop per push (a slice or the copy; the engine's "
                  f"clock) / step: median {statistics.median(steps):.2f}, max {max(steps):.2f}, <= 1 step at "
                  f"{sum(x <= 1 for x in steps)}/{len(steps)} pushes; CPU steal during the pushes (the hypervisor's "
                  f"share of this VM's CPU time): median {statistics.median(steal):.1%}, during those over one step: "
                  f"{', '.join(f'{x:.1%}' for x in over) or '-'}")
            for k in (k for k, p in enumerate(pushes) if p[0] == mode and held[k] > step):
                w = where.get(k, {})
                copy_s, copy_cpu_s = copies[k]
                if copy_s >= w.get("wall_s", 0.0):  # the final copy was the push's longest call
                    print(f"  push {k} held the engine {held[k] / step:.2f} steps in its copy: {copy_s * 1e3:.2f} ms, "
                          f"of it CPU {copy_cpu_s * 1e3:.2f} ms")
                elif "queued_s" in w:  # inline: the work ran on the engine's thread, so its wall time splits up
                    rest = w["wall_s"] - w["cpu_s"] - w["queued_s"]
                    print(f"  push {k} held the engine {held[k] / step:.2f} steps: its longest slice "
                          f"{w['wall_s'] * 1e3:.2f} ms = CPU {w['cpu_s'] * 1e3:.2f} + waiting for a core in this VM "
                          f"{w['queued_s'] * 1e3:.2f} + {rest * 1e3:.2f} ms off the CPU otherwise ("
                          + ("the hypervisor's steal: the thread did not block" if not w["blocked"] else
                             f"blocked {int(w['blocked'])} times, on a lock or the GIL, or steal") + ")")
            cpu = [worked[k] / step for k, p in enumerate(pushes) if p[0] == mode]
            print(f"{mode}: the CPU time of the swap's work in the longest slice or the copy per push (time the "
                  f"hypervisor took the CPU and waits for one left out) / step: median {statistics.median(cpu):.2f}, "
                  f"max {max(cpu):.2f}, <= 1 step at {sum(x <= 1 for x in cpu)}/{len(cpu)} pushes")
            longest = [stretches[k] for k, p in enumerate(pushes) if p[0] == mode and stretches.get(k)]
            if longest:  # inline: what bounds a slice, and which step of the staging it was
                ats = "; ".join(f"{a} ({n}x)" for a, n in Counter(x["at"] for x in longest).most_common(2))
                print(f"{mode}: the longest stretch of the swap's work between two checkpoints per push (CPU) / step: "
                      f"median {statistics.median(x['cpu_s'] for x in longest) / step:.2f}, max "
                      f"{max(x['cpu_s'] for x in longest) / step:.2f}; most often {ats}")
        for _, t0, t1, _apply_s, drain_s, worker_s, stage_s in mine:
            longest = ", ".join(f"{name} {_longest(gaps, t0, t1) / step:5.2f}" for name, gaps in gap_sets.items())
            before = _longest(gap_sets["engine, in a sample"], t0 - 0.02 - (t1 - t0), t0 - 0.02) / step
            longest += f" (engine, the window before: {before:5.2f})"
            print(f"  {mode:13s} push: longest gap: {longest} (push {(t1 - t0) * 1e3:.1f} ms: staging "
                  f"{stage_s * 1e3:.1f} ms while generating, the worker's copy/reload {worker_s * 1e3:.2f} ms, "
                  f"drain {drain_s * 1e3:.1f} ms)")
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
            print(f"{mode:13s}: longest gap {name:19s} / step: median {statistics.median(ratios):5.2f}, max "
                  f"{max(ratios):5.2f}; same windows without a push: median "
                  f"{statistics.median(controls) if controls else float('nan'):5.2f}, "
                  f"max {max(controls) if controls else float('nan'):5.2f}; added by the push: median "
                  f"{statistics.median(added) if added else float('nan'):+5.2f}, max "
                  f"{max(added) if added else float('nan'):+5.2f}, <= 1 step at "
                  f"{sum(a <= 1 for a in added)}/{len(added)} pushes")


def _cpu_ticks() -> list[int]:
    """The machine's CPU time counters (/proc/stat, all CPUs); [] where there is no /proc."""
    try:
        return [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return []


def _steal_share(before: list[int], after: list[int]) -> float:
    """The share of CPU time stolen by the hypervisor between two `_cpu_ticks` (the 8th counter)."""
    if len(before) < 8 or len(after) < 8:
        return float("nan")
    delta = [b - a for a, b in zip(before, after, strict=False)]
    return delta[7] / max(1, sum(delta[:8]))


def _gaps(series) -> list[tuple[float, float]]:  # noqa: ANN001
    return [(x, y) for ts in series for x, y in zip(ts, ts[1:], strict=False) if y > x]


def _longest(gaps: list[tuple[float, float]], t0: float, t1: float) -> float:
    """The longest gap overlapping [t0, t1]."""
    return max((y - x for x, y in gaps if y > t0 and x < t1), default=0.0)


def main() -> None:
    asyncio.run(run(parse()))


if __name__ == "__main__":  # vLLM spawns processes that re-import the main module: keep this guard
    main()
