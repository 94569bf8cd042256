"""The rollout engine: request validation, sampling, policy versions and weight swaps around vLLM.

Two layers, so that the logic can be tested without a model:
- `VllmBackend` is the only code that touches vLLM (`AsyncLLM`): one engine request per sample, abort,
  in-place reload through the worker extension, prefix-cache reset.
- `RolloutEngine` owns everything else: validation (errors name the field and value), seeds derived per
  (seed, prompt, sample), the swap gate and the policy version, weight staging and checks, counters.

Swap protocol ("drain, then swap"): a weight update first closes the gate for new samples, waits until
every sample already submitted to the engine has finished, reloads, resets the prefix cache, bumps the
version and reopens the gate. Every trajectory was therefore produced by one set of weights and reports
that version. New Generate calls wait at the gate (they are not rejected); health is NOT_SERVING from
the moment the gate closes until it reopens. vLLM's own `pause_generation(mode="keep")` would swap
faster under load but mixes versions inside a trajectory, which the trainer's ratios cannot use.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from forkrl.seeds import sample_seed
from forkrl.weights.safetensors import DTYPES, WeightsError, checkpoint_files, read_checkpoint_specs, safetensors_prefix
from forkrl.weights.wire import CHUNK_BYTES, TensorMeta, validate_metas

log = logging.getLogger("rollout_service")


# ---------------------------------------------------------------------------------------------- errors
class RolloutError(Exception):
    """An error the caller can act on; `server.py` maps each subclass to a gRPC status code."""


class InvalidArgument(RolloutError):
    """INVALID_ARGUMENT"""


class NotFound(RolloutError):
    """NOT_FOUND"""


class StaleVersion(RolloutError):
    """ABORTED"""


class ChecksumMismatch(RolloutError):
    """DATA_LOSS"""


class Unavailable(RolloutError):
    """UNAVAILABLE"""


class FailedPrecondition(RolloutError):
    """FAILED_PRECONDITION"""


class ResourceExhausted(RolloutError):
    """RESOURCE_EXHAUSTED"""


# ------------------------------------------------------------------------------------------ core types
@dataclass
class SamplingSpec:
    n: int
    temperature: float
    max_new_tokens: int
    top_p: float | None = None
    stop: list[str] = field(default_factory=list)
    seed: int | None = None


@dataclass
class Completion:
    """What the backend returns for one finished engine request."""

    token_ids: list[int]
    text: str
    logprobs: list[float]
    finish_reason: str  # "stop" | "length" | "abort"


@dataclass
class Sample:
    prompt_index: int
    sample_index: int
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    completion_text: str
    logprobs: list[float]
    finish_reason: str
    policy_version: int


@dataclass
class Counters:
    requests: int = 0
    samples: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    aborted_requests: int = 0
    weight_reloads: int = 0
    rejected_weight_updates: int = 0
    running_requests: int = 0


@dataclass
class SwapResult:
    version: int
    apply_s: float
    drain_s: float
    receive_s: float = 0.0
    bytes_received: int = 0


# ------------------------------------------------------------------------------------------- the gate
class SwapGate:
    """Samples enter and leave; a swap closes the gate, waits for zero samples inside, and reopens."""

    def __init__(self) -> None:
        self._active = 0
        self._open = asyncio.Event()
        self._open.set()
        self._drained = asyncio.Event()
        self._drained.set()

    @property
    def active(self) -> int:
        return self._active

    async def enter(self, k: int) -> None:
        while not self._open.is_set():
            await self._open.wait()
        self._active += k
        if self._active:
            self._drained.clear()

    def leave(self, k: int) -> None:  # sync: called from task done-callbacks
        self._active -= k
        if self._active == 0:
            self._drained.set()

    @contextlib.asynccontextmanager
    async def closed(self) -> AsyncIterator[None]:
        self._open.clear()
        try:
            await self._drained.wait()
            yield
        finally:
            self._open.set()


# ------------------------------------------------------------------------------------------- backend
class Backend(Protocol):
    """What RolloutEngine needs from an inference engine (VllmBackend; a fake in plumbing tests)."""

    model: str
    vocab_size: int  # tokenizer length (reported)
    vocab_limit: int  # ids must be < this (max of tokenizer length and the model's vocab_size)
    eos_token_id: int
    max_model_len: int
    engine_settings: dict[str, Any]

    def encode(self, text: str) -> list[int]: ...
    async def generate_one(
        self, request_id: str, prompt_ids: list[int], spec: SamplingSpec, seed: int | None
    ) -> Completion: ...
    async def abort(self, request_ids: list[str]) -> None: ...
    async def reload(self, path: str) -> None: ...
    def num_unfinished(self) -> int: ...
    def errored(self) -> bool: ...
    def shutdown(self) -> None: ...


def default_staging_dir() -> Path:
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return shm / "forkrl-rollout"
    from forkrl.runtime import cache_dir

    return cache_dir() / "weights-staging"


# -------------------------------------------------------------------------------------------- engine
class RolloutEngine:
    def __init__(
        self,
        backend: Backend,
        *,
        max_samples_per_request: int = 65536,
        staging_dir: str | Path | None = None,
        on_serving: Callable[[bool], Awaitable[None]] | None = None,
    ) -> None:
        self.backend = backend
        self.version = 0
        self.counters = Counters()
        self.max_samples_per_request = max_samples_per_request
        self.staging_dir = Path(staging_dir) if staging_dir else default_staging_dir()
        self.staging_dir.mkdir(parents=True, exist_ok=True)
        self._on_serving = on_serving
        self._gate = SwapGate()
        self._apply_lock = asyncio.Lock()
        self._broken: str | None = None  # set when a reload failed half-way
        self.specs = read_checkpoint_specs(backend.model)
        tied = bool(backend.engine_settings.get("tie_word_embeddings"))
        # HF state dicts of tied models carry lm_head.weight; checkpoints (and vLLM) do not.
        self.ignorable = {"lm_head.weight"} if tied and "lm_head.weight" not in self.specs else set()

    # ----------------------------------------------------------------------------------- validation
    def prepare_prompts(self, prompts: Sequence[str | Sequence[int] | None]) -> list[list[int]]:
        """Token ids per prompt; InvalidArgument naming the prompt for empty/unknown/out-of-vocab input."""
        if not prompts:
            raise InvalidArgument("prompts must not be empty")
        out: list[list[int]] = []
        limit = self.backend.vocab_limit
        for i, p in enumerate(prompts):
            if p is None:
                raise InvalidArgument(f"prompts[{i}] has neither text nor token_ids")
            if isinstance(p, str):
                if not p:
                    raise InvalidArgument(f"prompts[{i}].text is empty")
                ids = self.backend.encode(p)
                if not ids:
                    raise InvalidArgument(f"prompts[{i}].text {p[:40]!r} encodes to no tokens")
            else:
                ids = [int(t) for t in p]
                if not ids:
                    raise InvalidArgument(f"prompts[{i}].token_ids is empty")
                for k, t in enumerate(ids):
                    if not 0 <= t < limit:
                        raise InvalidArgument(
                            f"prompts[{i}].token_ids[{k}] must be in [0, {limit}) (the vocabulary), got {t}"
                        )
            out.append(ids)
        return out

    def validate_sampling(self, spec: SamplingSpec, prompt_ids: list[list[int]]) -> None:
        if spec.n <= 0:
            raise InvalidArgument(f"sampling.n must be > 0, got {spec.n}")
        if math.isnan(spec.temperature) or spec.temperature < 0:
            raise InvalidArgument(f"sampling.temperature must be >= 0, got {spec.temperature:.6g}")
        if spec.temperature > 2:
            raise InvalidArgument(f"sampling.temperature must be <= 2 (vLLM's limit), got {spec.temperature:.6g}")
        if 0 < spec.temperature < 0.01:
            # vLLM would silently raise it to 0.01: the logprobs would not be at the requested temperature
            raise InvalidArgument(f"sampling.temperature must be 0 (greedy) or >= 0.01, got {spec.temperature:.6g}")
        if spec.top_p is not None and not (0 < spec.top_p <= 1):
            raise InvalidArgument(f"sampling.top_p must be in (0, 1], got {spec.top_p:.6g}")
        if spec.max_new_tokens <= 0:
            raise InvalidArgument(f"sampling.max_new_tokens must be > 0, got {spec.max_new_tokens}")
        for k, s in enumerate(spec.stop):
            if not s:
                raise InvalidArgument(f"sampling.stop[{k}] is empty")
        total = len(prompt_ids) * spec.n
        if total > self.max_samples_per_request:
            raise InvalidArgument(
                f"len(prompts) * sampling.n = {total} exceeds max_samples_per_request "
                f"{self.max_samples_per_request}"
            )
        max_len = self.backend.max_model_len
        for i, ids in enumerate(prompt_ids):
            if len(ids) + spec.max_new_tokens > max_len:
                raise InvalidArgument(
                    f"prompts[{i}] has {len(ids)} tokens: {len(ids)} + sampling.max_new_tokens "
                    f"{spec.max_new_tokens} exceeds max_model_len {max_len}"
                )

    # ----------------------------------------------------------------------------------- generation
    async def generate(
        self,
        prompts: Sequence[str | Sequence[int] | None],
        spec: SamplingSpec,
        *,
        prompt_offsets: Sequence[int] = (),
        tag: str = "",
    ) -> AsyncIterator[list[Sample]]:
        """Yield samples as soon as they finish (any order), as lists of those that finished together.
        Closing the iterator early (client cancel/disconnect) cancels and aborts the engine requests
        still running."""
        prompt_ids = self.prepare_prompts(prompts)
        self.validate_sampling(spec, prompt_ids)
        if prompt_offsets and len(prompt_offsets) != len(prompt_ids):
            raise InvalidArgument(
                f"prompt_offsets must be empty or have one entry per prompt ({len(prompt_ids)}), "
                f"got {len(prompt_offsets)}"
            )
        if len(tag) > 64:
            raise InvalidArgument(f"request_tag must be at most 64 characters, got {len(tag)}")
        if self._broken:
            raise FailedPrecondition(self._broken)
        offsets = list(prompt_offsets) or list(range(len(prompt_ids)))
        total = len(prompt_ids) * spec.n

        await self._gate.enter(total)
        version = self.version
        self.counters.requests += 1
        base = f"{tag or 'gen'}-{uuid.uuid4().hex[:12]}"
        done: asyncio.Queue[tuple[int, int, str, asyncio.Task[Completion]]] = asyncio.Queue()
        pending: dict[str, asyncio.Task[Completion]] = {}

        def on_done(task: asyncio.Task[Completion], i: int, j: int, rid: str) -> None:
            # Leaving the gate when the engine is done (not when the client has read the sample) keeps
            # a slow reader from holding up a weight swap.
            self._gate.leave(1)
            done.put_nowait((i, j, rid, task))

        for i, ids in enumerate(prompt_ids):
            for j in range(spec.n):
                rid = f"{base}-{i}-{j}"
                seed = None if spec.seed is None else sample_seed(spec.seed, offsets[i], j)
                task = asyncio.create_task(self.backend.generate_one(rid, ids, spec, seed))
                task.add_done_callback(lambda t, i=i, j=j, rid=rid: on_done(t, i, j, rid))
                pending[rid] = task
        try:
            left = total
            while left:
                ready = [await done.get()]
                while not done.empty():  # everything that finished in the same engine step
                    ready.append(done.get_nowait())
                batch = []
                for i, j, rid, task in ready:
                    del pending[rid]
                    c = task.result()  # an engine error ends the call; `finally` aborts the rest
                    self.counters.samples += 1
                    self.counters.prompt_tokens += len(prompt_ids[i])
                    self.counters.generated_tokens += len(c.token_ids)
                    batch.append(Sample(i, j, prompt_ids[i], c.token_ids, c.text, c.logprobs, c.finish_reason, version))
                left -= len(batch)
                yield batch
        finally:
            if pending:
                self.counters.aborted_requests += len(pending)
                for t in pending.values():
                    t.cancel()
                # vLLM's generate() aborts on cancellation too; this makes it explicit and immediate.
                with contextlib.suppress(Exception):
                    await self.backend.abort(list(pending))
                log.info("generate %s: aborted %d unfinished samples", base, len(pending))

    # ------------------------------------------------------------------------------------ weights
    def _check_version(self, target_version: int) -> None:
        if target_version <= self.version:
            raise StaleVersion(
                f"target_version must be greater than the served version {self.version}, got {target_version}"
            )

    def _check_metas(self, metas: Sequence[TensorMeta], total_bytes: int) -> None:
        try:
            validate_metas(metas, total_bytes, self.specs, self.ignorable, field="header.tensors")
        except WeightsError as e:
            raise InvalidArgument(str(e).replace("total_bytes", "header.total_bytes")) from None

    async def update_weights(
        self,
        target_version: int,
        metas: Sequence[TensorMeta],
        total_bytes: int,
        sha256: str,
        chunks: AsyncIterator[bytes],
    ) -> SwapResult:
        """Receive a pushed state dict into a staging safetensors file, verify it, then swap.

        Everything is checked before the engine is touched; any failure (including the caller's stream
        being cancelled) leaves the served weights and version as they were."""
        t0 = time.perf_counter()
        path: Path | None = None
        try:
            self._check_version(target_version)
            self._check_metas(metas, total_bytes)
            if len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256.lower()):
                raise InvalidArgument(f"header.sha256 must be 64 hex characters, got {sha256[:80]!r}")
            prefix = safetensors_prefix(metas)
            free = shutil.disk_usage(self.staging_dir).free
            if free < len(prefix) + total_bytes:
                raise ResourceExhausted(
                    f"staging dir {self.staging_dir} has {free} bytes free, the weights need {total_bytes}"
                )
            fd, name = tempfile.mkstemp(prefix=f"v{target_version}-", suffix=".safetensors", dir=self.staging_dir)
            path = Path(name)
            received = 0
            stager = _Stager(os.fdopen(fd, "wb", buffering=0), prefix)
            try:
                async for chunk in chunks:
                    if len(chunk) > CHUNK_BYTES:
                        raise InvalidArgument(f"chunk of {len(chunk)} bytes exceeds the 4 MiB limit")
                    received += len(chunk)
                    if received > total_bytes:
                        raise InvalidArgument(f"received more than header.total_bytes ({total_bytes}) bytes")
                    await stager.put(chunk)
                got = await stager.finish()
            finally:
                stager.close()
            receive_s = time.perf_counter() - t0
            log.info("v%d: received %d bytes in %.3f s (%.3f s hashing and staging)", target_version, received,
                     receive_s, stager.busy_s)
            if received != total_bytes:
                raise InvalidArgument(
                    f"the stream ended after {received} of header.total_bytes {total_bytes} bytes"
                )
            if got != sha256.lower():
                raise ChecksumMismatch(f"sha256 of the received bytes is {got}, header.sha256 says {sha256}")
            staged, path = path, None  # the swap owns the file now: the reload may outlive this call
            result = await self._swap(str(staged), target_version, staged=staged)
            result.receive_s, result.bytes_received = receive_s, received
            return result
        except BaseException:
            self.counters.rejected_weight_updates += 1
            raise
        finally:
            if path is not None:
                path.unlink(missing_ok=True)

    async def load_weights(self, path: str, target_version: int) -> SwapResult:
        """Swap in the weights of a checkpoint directory (or one .safetensors file) after checking it."""
        try:
            self._check_version(target_version)
            if not path:
                raise InvalidArgument("path is empty")
            p = Path(path)
            if not p.exists():
                raise NotFound(f"path {path!r} does not exist (on the rollout service's machine)")
            if not checkpoint_files(p):
                raise InvalidArgument(f"path {path!r} holds no *.safetensors files")
            try:
                specs = read_checkpoint_specs(p)
            except WeightsError as e:
                raise InvalidArgument(f"path {path!r}: {e}") from None
            metas = [
                {"name": n, "dtype": d, "shape": s, "nbytes": math.prod(s) * _itemsize(d)}
                for n, (d, s) in specs.items()
            ]
            try:
                validate_metas(metas, sum(m["nbytes"] for m in metas), self.specs, self.ignorable,
                               field=f"checkpoint {path!r}")
            except WeightsError as e:
                raise InvalidArgument(str(e)) from None
            return await self._swap(str(p), target_version)
        except BaseException:
            self.counters.rejected_weight_updates += 1
            raise

    async def _swap(self, path: str, target_version: int, staged: Path | None = None) -> SwapResult:
        """Drain and reload from `path`; `staged` (a staging file) is removed once the reload is over."""
        try:
            async with self._apply_lock:
                self._check_version(target_version)  # again: another swap may have won the race
                # The reload runs as its own task: if the caller's RPC is cancelled mid-reload (or while
                # draining), the reload still completes and the version is committed, so version and
                # weights never disagree. The task, not the caller, removes the staged file afterwards.
                task = asyncio.create_task(self._drain_and_reload(path, target_version))
                if staged is not None:
                    task.add_done_callback(lambda _t, f=staged: f.unlink(missing_ok=True))
                    staged = None
                return await asyncio.shield(task)
        finally:
            if staged is not None:  # the reload never started (stale version, cancelled waiting for the lock)
                staged.unlink(missing_ok=True)

    async def _drain_and_reload(self, path: str, target_version: int) -> SwapResult:
        t0 = time.perf_counter()
        await self._set_serving(False)
        try:
            async with self._gate.closed():
                t1 = time.perf_counter()
                try:
                    await self.backend.reload(path)
                except Exception as e:
                    self._broken = (
                        f"a weight reload failed half-way ({type(e).__name__}: {e}); the served weights "
                        "are unknown until a push or load succeeds"
                    )
                    log.exception("weight reload from %s failed", path)
                    raise FailedPrecondition(self._broken) from e
                self._broken = None
                self.version = target_version
                self.counters.weight_reloads += 1
                t2 = time.perf_counter()
        finally:
            if not self._broken:
                await self._set_serving(True)
        log.info("weights v%d in place: drain %.3f s, apply %.3f s", target_version, t1 - t0, t2 - t1)
        return SwapResult(version=target_version, apply_s=t2 - t1, drain_s=t1 - t0)

    async def _set_serving(self, serving: bool) -> None:
        if self._on_serving is not None:
            await self._on_serving(serving)

    # ------------------------------------------------------------------------------------- info
    def info(self) -> dict[str, Any]:
        counters = asdict(self.counters)
        counters["running_requests"] = self.backend.num_unfinished()
        return {
            "model": self.backend.model,
            "version": self.version,
            "engine": self.backend.engine_settings,
            "counters": counters,
            "vocab_size": self.backend.vocab_size,
            "eos_token_id": self.backend.eos_token_id,
        }


class _Stager:
    """Hash and write received chunks in worker threads while the next ones arrive. sha256 and the
    tmpfs write release the GIL, so neither the event loop (health, generation) nor the receiving
    stalls; at most `depth` chunks (4 MiB each) wait in between."""

    def __init__(self, f: Any, prefix: bytes, depth: int = 8) -> None:
        self._f = f
        self._f.write(prefix)
        self._lock = threading.Lock()  # the file is closed under it: no write can race the close
        self._digest = hashlib.sha256()
        self._queue: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=depth)
        self._task = asyncio.create_task(self._run())
        self.busy_s = 0.0

    async def _run(self) -> None:
        while (chunk := await self._queue.get()) is not None:
            t = time.perf_counter()
            # hash and write the same chunk in two threads: each is a pass over memory (~0.3 s per
            # 400 MB here), so with a free core the staging costs one pass instead of two
            await asyncio.gather(asyncio.to_thread(self._digest.update, chunk), asyncio.to_thread(self._write, chunk))
            self.busy_s += time.perf_counter() - t

    def _write(self, chunk: bytes) -> None:
        with self._lock:
            if not self._f.closed:  # closed: the update was abandoned meanwhile
                self._f.write(chunk)

    async def put(self, chunk: bytes) -> None:
        if self._task.done():  # a write failed: surface it now
            self._task.result()
        await self._queue.put(chunk)

    async def finish(self) -> str:
        await self._queue.put(None)
        await self._task
        return self._digest.hexdigest()

    def close(self) -> None:
        self._task.cancel()
        with self._lock:
            self._f.close()


def _itemsize(dtype: str) -> int:
    if dtype not in DTYPES:
        raise InvalidArgument(f"checkpoint tensor dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    return DTYPES[dtype].itemsize


# --------------------------------------------------------------------------------------- vLLM backend
class VllmBackend:
    """AsyncLLM with one request per sample, FINAL_ONLY outputs and sampled-token logprobs at T.

    Built with `await VllmBackend.start(settings)`; the engine is constructed in a worker thread so the
    gRPC server keeps answering health checks (NOT_SERVING) during the ~10-20 s start."""

    def __init__(self, llm: Any, settings: Any, engine_settings: dict[str, Any]) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        self._llm = llm
        self._SamplingParams = SamplingParams
        self._final_only = RequestOutputKind.FINAL_ONLY
        self.model = settings.model
        tok = llm.get_tokenizer()
        self._tokenizer = tok
        hf_config = llm.model_config.hf_config
        self.vocab_size = len(tok)
        self.vocab_limit = max(len(tok), int(getattr(hf_config, "vocab_size", 0) or 0))
        eos = getattr(tok, "eos_token_id", None)
        self.eos_token_id = int(eos) if eos is not None else -1
        self.max_model_len = int(llm.model_config.max_model_len)
        self.engine_settings = engine_settings | {
            "max_model_len": self.max_model_len,
            "tie_word_embeddings": bool(getattr(hf_config, "tie_word_embeddings", False)),
        }

    @classmethod
    async def start(cls, settings: Any) -> VllmBackend:
        import vllm
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(
            model=settings.model,
            dtype=settings.dtype,
            max_model_len=settings.max_model_len,
            enforce_eager=settings.enforce_eager,
            seed=settings.seed,
            max_num_seqs=settings.max_num_seqs,
            kv_cache_memory_bytes=int(settings.kv_cache_gib * (1 << 30)),
            # log_softmax(logits / T) of the sampled token: the quantity the trainer's ratio needs.
            logprobs_mode="processed_logprobs",
            worker_extension_cls="rollout_service.worker_ext.WeightReloadExtension",
            disable_log_stats=True,
            # vLLM 0.32 CPU bug: a partially prefilled *seeded* request makes the model runner rewind its
            # sampling generator with set_offset(), which CPU generators do not have -> the engine core
            # dies ("CPU Generator does not use offset"). Without chunked prefill every prompt is
            # prefilled in one step (max_num_batched_tokens >= max_model_len), so nothing is rewound.
            enable_chunked_prefill=False if current_platform.is_cpu() else None,
            # No hub at run time: the model is a local directory.
            trust_remote_code=False,
        )
        llm = await asyncio.to_thread(AsyncLLM.from_engine_args, args)
        engine_settings = {
            "dtype": settings.dtype,
            "enforce_eager": settings.enforce_eager,
            "logprobs_mode": "processed_logprobs",
            "kv_cache_gib": settings.kv_cache_gib,
            "device": llm.vllm_config.device_config.device_type,
            "vllm_version": vllm.__version__,
            "engine_mode": settings.engine_mode,
        }
        backend = cls(llm, settings, engine_settings)
        del llm  # the backend owns the engine; see shutdown()
        return backend

    def encode(self, text: str) -> list[int]:
        # add_special_tokens=True: what vLLM itself does for a text prompt (BOS for tokenizers that add it)
        return list(self._tokenizer.encode(text, add_special_tokens=True))

    async def generate_one(
        self, request_id: str, prompt_ids: list[int], spec: SamplingSpec, seed: int | None
    ) -> Completion:
        try:
            params = self._sampling_params(spec, seed)
        except ValueError as e:  # vLLM's own checks (VLLMValidationError): a bad request, not a bug
            raise InvalidArgument(f"sampling: {e}") from None
        final = None
        prompt = {"type": "token", "prompt_token_ids": prompt_ids}  # vllm.inputs.engine.TokensInput
        async for out in self._llm.generate(prompt, params, request_id=request_id):
            final = out
        assert final is not None and final.finished
        c = final.outputs[0]
        token_ids = list(c.token_ids)
        return Completion(token_ids, c.text, _sampled_logprobs(c.logprobs, token_ids), c.finish_reason or "abort")

    def _sampling_params(self, spec: SamplingSpec, seed: int | None) -> Any:
        return self._SamplingParams(
            n=1,
            temperature=spec.temperature,
            top_p=1.0 if spec.top_p is None else spec.top_p,
            max_tokens=spec.max_new_tokens,
            stop=list(spec.stop) or None,
            seed=seed,
            logprobs=0,  # the sampled token's logprob only
            flat_logprobs=True,  # flat lists instead of a dict per token: less GC work per sample
            output_kind=self._final_only,  # n>1 cumulative outputs can miss samples (vllm-cpu-notes)
        )

    async def abort(self, request_ids: list[str]) -> None:
        await self._llm.abort(request_ids)

    async def reload(self, path: str) -> None:
        results = await self._llm.collective_rpc("forkrl_reload_safetensors", args=(path,))
        await self._llm.reset_prefix_cache()
        log.debug("reload results: %s", results)

    def num_unfinished(self) -> int:
        return int(self._llm.get_num_unfinished_requests())

    def errored(self) -> bool:
        """True once the engine core died (e.g. a crash inside a kernel); it never recovers by itself."""
        return bool(self._llm.errored)

    def shutdown(self) -> None:
        import gc

        self._llm.shutdown()
        # Drop the engine now: AsyncLLM.__del__ calls shutdown() again, which fails noisily when it
        # only runs during interpreter teardown.
        del self._llm
        gc.collect()


def _sampled_logprobs(lp: Any, token_ids: list[int]) -> list[float]:
    """Logprob of each sampled token from vLLM's FlatLogprobs (or list-of-dicts) output."""
    if lp is None:
        return []
    if hasattr(lp, "start_indices"):  # FlatLogprobs: with logprobs=0 one entry per position
        if len(lp.logprobs) == len(token_ids) and list(lp.token_ids) == token_ids:
            return list(lp.logprobs)
        out = []
        for k, t in enumerate(token_ids):
            lo, hi = lp.start_indices[k], lp.end_indices[k]
            out.append(lp.logprobs[lo + list(lp.token_ids[lo:hi]).index(t)])
        return out
    return [pos[t].logprob for pos, t in zip(lp, token_ids, strict=True)]
