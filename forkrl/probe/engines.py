"""Where the probe's responses come from (issue 14 item 3): the transformers KV-cache sampler, in-process vLLM, or
a running rollout service. Only the sampling moves; entropy and gradients stay teacher-forced in the trainer's
fp32 math (`forkrl.probe.sampling.token_stats`, `forkrl.probe.gradients`).

    ids = encode_prompts(tok, problems, "raw")    # the prompt format: forkrl/data/prompts.py
    trajs = sample_with_vllm(ckpt_dir, ids, group_size=2, temperature=1.0, max_new_tokens=512, seed=0,
                             eos_ids=[2])                           # in-process vllm.LLM, float32
    trajs = sample_with_rollout("127.0.0.1:50051", ids, group_size=2, ...)   # a running rollout service

- "transformers": `forkrl.models.sampling.sample_tokens` (one private torch.Generator per job; batches hold
  prompts of one token length, so mixed lengths run as several batches).
- "vllm": `vllm.LLM` on the checkpoint dir in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0 unless set: no
  engine-core process to start, a much faster start; it seeds the process's global RNG, which the probe never
  uses), float32, eager, the CPU settings of `forkrl.runtime.apply_runtime_env` and of the rollout service (no
  chunked prefill on CPU). Prompts of any length go in one call (vLLM schedules them together). Sample g of prompt
  i is seeded with `sample_seed(seed, i, g)`, as in the rollout service, so the two vLLM paths draw alike. The
  engine is built per checkpoint and dropped after sampling. One engine at a time per process (a lock): an
  in-process engine sets vLLM's process-global model-parallel groups, so a second one built while the first
  lives fails; the probe service's concurrent jobs take turns for the sampling and run the rest side by side.
  Its memory: the weights plus a KV cache of VLLM_CPU_KVCACHE_SPACE GiB (1 unless set), freed with the engine.
  Its threads: vLLM's CPU worker replaces `torch.set_num_threads` process-wide with a no-op; the original is
  put back (and the thread count, if it moved) when the engine is dropped, so the process keeps control of
  its threads for what follows (the gradients, the service's next jobs).
- "rollout": `RolloutClient.generate` against a running rollout service. The service serves ONE model:
  this is only valid when the probed checkpoint is the model it serves (the job therefore takes exactly
  one checkpoint; nothing here can verify the weights are the same).

Every path cuts each response after its first EOS (any of `eos_ids`), keeping it, like the transformers
sampler. A response needing more positions than the model has (max_position_embeddings) is cut short by
vLLM's max_model_len; `sample_with_vllm` reports that in its notes.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from forkrl.data.prompts import PromptEncoder
from forkrl.data.tasks import Problem
from forkrl.models.sampling import trim_at_eos
from forkrl.probe.sampling import Trajectory
from forkrl.seeds import sample_seed

__all__ = ["encode_prompts", "resolve_sampler", "sample_with_rollout", "sample_with_vllm", "vllm_importable"]

_ENGINE_LOCK = threading.Lock()  # one in-process vLLM engine at a time in this process (module docstring)


def vllm_importable() -> bool:
    return importlib.util.find_spec("vllm") is not None


def resolve_sampler(name: str) -> str:
    """auto -> vllm when vllm is importable, else transformers; the other names unchanged."""
    if name == "auto":
        return "vllm" if vllm_importable() else "transformers"
    return name


def encode_prompts(tok, prompts: Sequence[str | Problem], prompt_format: str = "raw", system_prompt: str = "", *,
                   chat_template: bool = False) -> list[list[int]]:
    """Token ids of each prompt (a text or a Problem) in a prompt format, exactly as training encodes them
    (forkrl.data.prompts.PromptEncoder): raw = the plain encoding with the tokenizer's special tokens; chat =
    the prompt as one user message (or a problem's own messages) through the chat template with the generation
    prompt added. `chat_template=True` is the older spelling of prompt_format "chat"."""
    enc = PromptEncoder(tok, "chat" if chat_template else prompt_format, system_prompt)
    return enc.encode([p if isinstance(p, Problem) else Problem(p, "") for p in prompts])


def _rows(prompt_ids: Sequence[Sequence[int]], group_size: int) -> list[tuple[int, int, list[int]]]:
    """(prompt index, sample index, ids) in prompt-major order: row i*G + g is sample g of prompt i."""
    return [(i, g, list(ids)) for i, ids in enumerate(prompt_ids) for g in range(group_size)]


def _trajectories(rows, outputs: Iterable[Sequence[int]], eos: Sequence[int]) -> list[Trajectory]:
    out = []
    for r, ((i, _g, ids), toks) in enumerate(zip(rows, outputs, strict=True)):
        resp, finished = trim_at_eos(list(toks), eos)
        out.append(Trajectory(r, i, ids, resp, finished))
    return out


def _max_positions(model_dir: Path) -> int | None:
    import json

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    v = cfg.get("max_position_embeddings")
    return int(v) if v else None


def sample_with_vllm(
    model_dir: str | Path,
    prompt_ids: Sequence[Sequence[int]],
    *,
    group_size: int,
    temperature: float,
    max_new_tokens: int,
    seed: int,
    eos_ids: Iterable[int],
    top_p: float = 1.0,
    ignore_eos: bool = False,
    check: Callable[[], None] | None = None,
    notes: list[str] | None = None,
    timings: dict[str, float] | None = None,
) -> list[Trajectory]:
    """`group_size` samples per prompt from an in-process float32 vLLM engine on `model_dir`, prompt-major.
    `ignore_eos` (benchmarks): every response runs to max_new_tokens. `timings` gets the seconds of
    "engine_start" and "generate". Waits for the process's engine lock (checking `check` meanwhile)."""
    eos = sorted({int(e) for e in eos_ids})
    rows = _rows(prompt_ids, group_size)
    if not rows:
        return []
    longest = max(len(ids) for _, _, ids in rows)
    limit = _max_positions(Path(model_dir))
    max_len = longest + max_new_tokens
    if limit is not None and max_len > limit:
        if notes is not None:
            notes.append(f"vllm sampler: prompt + max_new_tokens ({max_len}) exceeds the model's "
                         f"max_position_embeddings ({limit}); responses are cut at {limit} positions")  # fmt: skip
        max_len = limit
    while not _ENGINE_LOCK.acquire(timeout=1.0):  # another job's engine is sampling
        if check is not None:
            check()
    try:
        if check is not None:
            check()
        params = dict(temperature=temperature, top_p=top_p, seed=seed, ignore_eos=ignore_eos)
        tokens = _generate(Path(model_dir), rows, eos, max_len, max_new_tokens, params, timings)
    finally:
        _ENGINE_LOCK.release()
    return _trajectories(rows, tokens, [] if ignore_eos else eos)


def _generate(model_dir: Path, rows: list[tuple[int, int, list[int]]], eos: list[int], max_len: int,
              max_new_tokens: int, sampling: dict[str, Any], timings: dict[str, float] | None) -> list[list[int]]:
    """Under the engine lock: build the engine, sample every row, drop the engine, give torch its threads back."""
    import time

    import torch

    from forkrl.runtime import apply_runtime_env

    apply_runtime_env()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams
    from vllm.platforms import current_platform

    set_num_threads, n_threads = torch.set_num_threads, torch.get_num_threads()
    llm = None
    try:
        t0 = time.perf_counter()
        llm = LLM(
            model=str(model_dir),
            dtype="float32",
            enforce_eager=True,
            max_model_len=max_len,
            seed=sampling["seed"],
            skip_tokenizer_init=True,  # token ids in and out: checkpoints saved without a tokenizer work too
            enable_chunked_prefill=False if current_platform.is_cpu() else None,  # see rollout_service/vllm_backend
            kv_cache_memory_bytes=int(float(os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")) * (1 << 30)),
            disable_log_stats=True,
            trust_remote_code=False,
        )
        t1 = time.perf_counter()
        ignore_eos = sampling["ignore_eos"]
        params = [
            SamplingParams(
                n=1, temperature=sampling["temperature"], top_p=sampling["top_p"], top_k=-1,
                seed=sample_seed(sampling["seed"], i, g), max_tokens=max(1, min(max_new_tokens, max_len - len(ids))),
                detokenize=False, stop_token_ids=None if ignore_eos else eos, ignore_eos=ignore_eos,
            )  # fmt: skip
            for i, g, ids in rows
        ]
        outs = llm.generate([{"prompt_token_ids": ids} for _, _, ids in rows], params, use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        if timings is not None:
            timings.update(engine_start=t1 - t0, generate=time.perf_counter() - t1)
        return tokens
    finally:
        del llm
        gc.collect()
        torch.set_num_threads = set_num_threads  # vLLM's CPU worker made it a no-op, process-wide
        if torch.get_num_threads() != n_threads:
            set_num_threads(n_threads)


def sample_with_rollout(
    address: str,
    prompt_ids: Sequence[Sequence[int]],
    *,
    group_size: int,
    temperature: float,
    max_new_tokens: int,
    seed: int,
    eos_ids: Iterable[int],
    top_p: float = 1.0,
    timeout_s: float = 3600.0,
    check: Callable[[], None] | None = None,
) -> list[Trajectory]:
    """`group_size` samples per prompt from a running rollout service (whose model must be the probed
    checkpoint), prompt-major; the service seeds sample g of prompt i with sample_seed(seed, i, g).
    `check` (the job's cancel check: raises when cancelled) is polled while the service is awaited and while the
    stream runs, even when no answer comes: the call is cancelled and `check`'s exception raised within STOP_POLL_S
    (forkrl/remote/rollout.py), so a cancelled job never holds its worker until `timeout_s`."""
    from forkrl.remote.rollout import CallStopped, RolloutClient

    def should_stop() -> bool:
        try:
            check()  # type: ignore[misc]
        except Exception:
            return True
        return False

    stop = should_stop if check is not None else None
    eos = sorted({int(e) for e in eos_ids})
    rows = _rows(prompt_ids, group_size)
    got: dict[tuple[int, int], list[int]] = {}
    try:
        with RolloutClient(address, timeout_s=timeout_s) as client:
            client.wait_ready(timeout_s=min(timeout_s, 300.0), should_stop=stop)
            for t in client.generate([list(p) for p in prompt_ids], n=group_size, temperature=temperature,
                                     top_p=top_p, max_new_tokens=max_new_tokens, seed=seed, should_stop=stop):
                got[(int(t.prompt_index), int(t.sample_index))] = list(t.completion_token_ids)
                if check is not None:
                    check()
    except CallStopped:
        if check is not None:
            check()  # raises the job's own cancellation
        raise
    missing = [(i, g) for i, g, _ in rows if (i, g) not in got]
    if missing:
        raise RuntimeError(f"rollout service {address} returned no sample for (prompt, sample) {missing[:5]}")
    return _trajectories(rows, [got[(i, g)] for i, g, _ in rows], eos)
