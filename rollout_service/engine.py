"""The rollout engine: request validation, sampling, policy versions and weight swaps around a backend.

`RolloutEngine` owns everything but the model: validation (errors name the field and value), seeds derived
per (seed, prompt, sample), the swap gate and the policy version, weight checks, counters. The model is
behind the `Backend` protocol (`types.py`): `VllmBackend` (`vllm_backend.py`) or a fake in the plumbing tests, so
this logic is tested without a model. Pushed weights are received and verified in `receive.py`.

Swap protocols (`swap_mode`):
- "inplace" (default): the weights are applied between two engine steps with the requests in flight kept scheduled
  and the version bumped before any later token is seen: the backend pauses vLLM's scheduler in its "keep" mode,
  reloads and resumes; generation stalls for the reload, never for the samples in flight (bench/bench_swap.py
  measures it). A sample in flight during a push continues under the new weights (its KV cache of earlier tokens
  stays), so its tokens may come from two versions: it reports `policy_version` = the version served when it was
  submitted (no older than its first token's) and `last_policy_version` = the version served when it finished (never
  older than its last token's: the version is bumped before the engine resumes). Its per-token logprobs are those of
  the weights that sampled each token, which is what the behaviour correction needs. The prefix cache is salted with
  the weights (vllm_backend.py), so no later request reuses KV blocks of replaced weights. Health stays SERVING.
- "drain" ("drain, then swap", see `gate.py`): a weight update closes the gate for new samples, waits until
  every sample already submitted to the engine has finished, reloads, resets the prefix cache, bumps the
  version and reopens the gate, so every trajectory reports the one version that produced it. Health is
  NOT_SERVING from the moment the gate closes until it reopens.
  A drain that outlasts `drain_timeout_s` aborts the samples still running (their Generate calls end with
  UNAVAILABLE, which the trainer answers by sampling the step again) and swaps: a stuck or endless request
  cannot hold the weights back forever.

The lease: a push must be `target_version == served + 1` and come from the run that holds the rollout. The first
run to push takes the lease; it keeps it until it releases it (its run ended) or `lease_timeout_s` pass without a
push from it; `release_lease(force=True)` is the operator's reset. So no caller can push the version out of reach
(2^63-1) and two runs cannot take turns overwriting each other's weights.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from forkrl.seeds import sample_seed
from forkrl.weights.chunks import TensorMeta, validate_metas
from forkrl.weights.finite import first_nonfinite
from forkrl.weights.safetensors import (
    DTYPES,
    WeightsError,
    check_data_section,
    checkpoint_files,
    iter_safetensors,
    read_checkpoint_specs,
)
from forkrl.weights.shm import private_dir
from rollout_service.gate import SwapGate
from rollout_service.receive import default_staging_dir, received_weights
from rollout_service.transfer import WeightTransfer
from rollout_service.types import (
    Backend,
    Completion,
    Counters,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Sample,
    SamplingSpec,
    StaleVersion,
    SwapResult,
    Unavailable,
)

log = logging.getLogger("rollout_service")
SWAP_MODES = ("inplace", "drain")


class RolloutEngine:
    def __init__(
        self,
        backend: Backend,
        *,
        max_samples_per_request: int = 65536,
        staging_dir: str | Path | None = None,
        on_serving: Callable[[bool], Awaitable[None]] | None = None,
        swap_mode: str = "inplace",
        lease_timeout_s: float = 900.0,
        drain_timeout_s: float | None = None,
        transfer_timeout_s: float = 300.0,
    ) -> None:
        if swap_mode not in SWAP_MODES:
            raise ValueError(f"swap_mode must be one of {SWAP_MODES}, got {swap_mode!r}")
        self.swap_mode = swap_mode
        self.backend = backend
        self.version = 0
        self.counters = Counters()
        self.max_samples_per_request = max_samples_per_request
        self.staging_dir = Path(staging_dir) if staging_dir else default_staging_dir()
        private_dir(self.staging_dir)  # 0700, this user's: UnsafeDirectory for a folder another user could write
        self._on_serving = on_serving
        self.gate = SwapGate()
        self.apply_lock = asyncio.Lock()
        self.broken: str | None = None  # set when a reload failed half-way
        self.lease_timeout_s = lease_timeout_s
        self.drain_timeout_s = drain_timeout_s
        self._lease = ""  # the run holding the rollout ("" = none)
        self._lease_until = 0.0  # clock() when it expires
        self.clock: Callable[[], float] = time.monotonic  # the lease's clock (a test moves it instead of waiting)
        self._running: dict[str, asyncio.Task[Completion]] = {}  # every engine request in flight
        self._swap_aborted: set[str] = set()  # requests aborted by a drain timeout
        self.specs = read_checkpoint_specs(backend.model)
        tied = bool(backend.engine_settings.get("tie_word_embeddings"))
        # HF state dicts of tied models carry lm_head.weight; checkpoints (and vLLM) do not.
        self.ignorable = {"lm_head.weight"} if tied and "lm_head.weight" not in self.specs else set()
        self.transfer = WeightTransfer(self, transfer_timeout_s)  # pushes through vLLM's weight-transfer API

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
        if self.broken:
            raise FailedPrecondition(self.broken)
        offsets = list(prompt_offsets) or list(range(len(prompt_ids)))
        total = len(prompt_ids) * spec.n

        await self.gate.enter(total)
        version = self.version
        self.counters.requests += 1
        base = f"{tag or 'gen'}-{uuid.uuid4().hex[:12]}"
        done: asyncio.Queue[tuple[int, int, str, asyncio.Task[Completion], int]] = asyncio.Queue()
        pending: dict[str, asyncio.Task[Completion]] = {}

        def on_done(task: asyncio.Task[Completion], i: int, j: int, rid: str) -> None:
            # Leaving the gate when the engine is done (not when the client has read the sample) keeps
            # a slow reader from holding up a weight swap.
            self.gate.leave(1)
            done.put_nowait((i, j, rid, task, self.version))  # the newest version that can have sampled it

        for i, ids in enumerate(prompt_ids):
            for j in range(spec.n):
                rid = f"{base}-{i}-{j}"
                seed = None if spec.seed is None else sample_seed(spec.seed, offsets[i], j)
                task = asyncio.create_task(self.backend.generate_one(rid, ids, spec, seed))
                task.add_done_callback(lambda t, i=i, j=j, rid=rid: on_done(t, i, j, rid))
                pending[rid] = self._running[rid] = task
        try:
            left = total
            while left:
                ready = [await done.get()]
                while not done.empty():  # everything that finished in the same engine step
                    ready.append(done.get_nowait())
                batch = []
                for i, j, rid, task, last_version in ready:
                    del pending[rid]
                    self._running.pop(rid, None)
                    if rid in self._swap_aborted:
                        raise Unavailable(f"sample {rid} was aborted: a weight swap waited drain_timeout_s "
                                          f"{self.drain_timeout_s:g} s for it; sample again")
                    c = task.result()  # an engine error ends the call; `finally` aborts the rest
                    if self.broken:  # an in-place reload failed while this sample ran: its weights are unknown
                        raise FailedPrecondition(self.broken)
                    self.counters.samples += 1
                    self.counters.prompt_tokens += len(prompt_ids[i])
                    self.counters.generated_tokens += len(c.token_ids)
                    batch.append(Sample(i, j, prompt_ids[i], c.token_ids, c.text, c.logprobs, c.finish_reason, version,
                                        last_version))
                left -= len(batch)
                yield batch
        finally:
            for rid in pending:
                self._running.pop(rid, None)
            self._swap_aborted.difference_update(f"{base}-{i}-{j}" for i in range(len(prompt_ids))
                                                 for j in range(spec.n))
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
        if target_version != self.version + 1:
            raise FailedPrecondition(
                f"target_version must be the served version + 1 = {self.version + 1}, got {target_version}"
            )

    def lease(self) -> tuple[str, float]:
        """(the run holding the lease or "", seconds until it expires); an expired lease is dropped here."""
        left = self._lease_until - self.clock()
        if self._lease and left <= 0:
            log.info("the lease of run %s expired (no push for %.0f s)", self._lease, self.lease_timeout_s)
            self._lease = ""
        return self._lease, max(left, 0.0) if self._lease else 0.0

    def check_push(self, run_id: str, target_version: int) -> None:
        holder, left = self.lease()
        if holder and run_id != holder:
            who = f"run {run_id!r}" if run_id else "a push without run_id"
            raise FailedPrecondition(
                f"the rollout is leased to run {holder!r} (for {left:.0f} s more unless it pushes again); {who} "
                "is refused. The lease ends when that run ends; an operator can reset it with "
                "`python -m rollout_service.admin reset-lease --address HOST:PORT`"
            )
        self._check_version(target_version)

    def take_lease(self, run_id: str) -> None:
        """Take (or renew) the lease for `run_id`; a push without a run id takes none."""
        if run_id:
            self._lease, self._lease_until = run_id, self.clock() + self.lease_timeout_s

    def commit(self, target_version: int) -> None:
        """The weights of `target_version` are in place (the engine not yet resumed): serve them as that version."""
        self.broken = None
        self.version = target_version
        self.counters.weight_reloads += 1

    async def mark_broken(self, why: str) -> None:
        """The served weights are unknown (a reload or a weight transfer failed half-way): FAILED_PRECONDITION for
        every Generate and NOT_SERVING until a push or load succeeds."""
        self.broken = why
        await self.set_serving(False)

    def release_lease(self, run_id: str, force: bool = False) -> str:
        """Give up the lease: its holder (`run_id`), or anyone with `force` (the operator's reset). Returns the run
        that held it ("" = none)."""
        holder, _ = self.lease()
        if holder and not force and run_id != holder:
            raise FailedPrecondition(f"the lease is held by run {holder!r}, not {run_id!r}; force resets it")
        if holder:
            log.info("lease of run %s released%s", holder, " (operator reset)" if force else "")
        self._lease, self._lease_until = "", 0.0
        return holder

    def _check_metas(self, metas: Sequence[TensorMeta], total_bytes: int) -> None:
        try:
            validate_metas(metas, total_bytes, self.specs, self.ignorable, field="header.tensors")
        except WeightsError as e:
            raise InvalidArgument(str(e).replace("total_bytes", "header.total_bytes")) from None

    async def _check_finite(self, path: str | Path, what: str) -> None:
        """InvalidArgument naming the first tensor under `path` whose bytes lie outside its file (a truncated file)
        or that holds a NaN or inf in its dtype or the served one (7e4 is inf in float16): such weights never reach
        the engine (one fused reduction per tensor over the file's memory map, in a thread: generation goes on)."""
        files, served = checkpoint_files(path), DTYPES.get(str(self.backend.engine_settings.get("served_dtype")))

        def scan() -> str | None:
            for f in files:
                check_data_section(f)
            return first_nonfinite(iter_safetensors(files), served)

        try:
            bad = await asyncio.to_thread(scan)
        except WeightsError as e:
            raise InvalidArgument(f"{what}: {e}") from None
        if bad is not None:
            raise InvalidArgument(f"{what}: tensor {bad!r} holds NaN or inf values (in its dtype or the served "
                                  f"{served}); refused, version {self.version} keeps serving")

    async def update_weights(
        self,
        target_version: int,
        metas: Sequence[TensorMeta],
        total_bytes: int,
        sha256: str,
        chunks: AsyncIterator[bytes],
        run_id: str = "",
    ) -> SwapResult:
        """Receive a pushed state dict into a staging safetensors file, verify it (size, sha256, every tensor
        finite), then swap.

        Everything is checked before the engine is touched; any failure (including the caller's stream
        being cancelled) leaves the served weights and version as they were."""
        try:
            self.check_push(run_id, target_version)
            self._check_metas(metas, total_bytes)
            async with received_weights(self.staging_dir, target_version, metas, total_bytes, sha256, chunks) as staged:
                await self._check_finite(staged.path, "the pushed weights")
                # the swap owns the file from here: the reload may outlive this call (a cancelled push)
                result = await self._swap(str(staged.path), target_version, run_id, staged=staged.hand_over())
            result.receive_s, result.bytes_received = staged.receive_s, staged.bytes_received
            return result
        except BaseException:
            self.counters.rejected_weight_updates += 1
            raise

    async def load_weights(self, path: str, target_version: int, run_id: str = "") -> SwapResult:
        """Swap in the weights of a checkpoint directory (or one .safetensors file) after checking it (names, dtypes
        and shapes against the served model, every tensor finite)."""
        try:
            self.check_push(run_id, target_version)
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
            await self._check_finite(p, f"checkpoint {path!r}")
            return await self._swap(str(p), target_version, run_id)
        except BaseException:
            self.counters.rejected_weight_updates += 1
            raise

    async def _swap(self, path: str, target_version: int, run_id: str, staged: Path | None = None) -> SwapResult:
        """Drain and reload from `path`; `staged` (a staging file) is removed once the reload is over."""
        try:
            async with self.apply_lock:
                self.check_push(run_id, target_version)  # again: another swap may have won the race
                self.take_lease(run_id)  # before the reload: a second run waiting for the lock is refused
                # The reload runs as its own task: if the caller's RPC is cancelled mid-reload (or while
                # draining), the reload still completes and the version is committed, so version and
                # weights never disagree. The task, not the caller, removes the staged file afterwards.
                swap = self._drain_and_reload if self.swap_mode == "drain" else self._reload_in_place
                task = asyncio.create_task(swap(path, target_version))
                if staged is not None:
                    task.add_done_callback(lambda _t, f=staged: f.unlink(missing_ok=True))
                    staged = None
                return await asyncio.shield(task)
        finally:
            if staged is not None:  # the reload never started (stale version, cancelled waiting for the lock)
                staged.unlink(missing_ok=True)

    async def _drain_and_reload(self, path: str, target_version: int) -> SwapResult:
        t0 = time.perf_counter()
        await self.set_serving(False)
        try:
            async with self.gate.closed(self.drain_timeout_s) as drained:
                if not drained:
                    self.abort_for_swap()
                    await self.gate.wait_drained()
                t1 = time.perf_counter()
                try:
                    await self.backend.reload(path)
                except Exception as e:
                    self.broken = (
                        f"a weight reload failed half-way ({type(e).__name__}: {e}); the served weights "
                        "are unknown until a push or load succeeds"
                    )
                    log.exception("weight reload from %s failed", path)
                    raise FailedPrecondition(self.broken) from e
                self.commit(target_version)
                t2 = time.perf_counter()
        finally:
            if not self.broken:
                await self.set_serving(True)
        log.info("weights v%d in place: drain %.3f s, apply %.3f s", target_version, t1 - t0, t2 - t1)
        return SwapResult(version=target_version, apply_s=t2 - t1, drain_s=t1 - t0)

    async def _reload_in_place(self, path: str, target_version: int) -> SwapResult:
        """Pause between engine steps (requests in flight stay scheduled), apply, bump the version, resume."""
        t0 = time.perf_counter()
        was_broken = self.broken is not None

        try:
            await self.backend.reload(path, keep_running=True, before_resume=lambda: self.commit(target_version))
        except Exception as e:
            self.broken = (
                f"an in-place weight reload failed half-way ({type(e).__name__}: {e}); the served weights are "
                "unknown until a push or load succeeds"
            )
            log.exception("in-place weight reload from %s failed", path)
            await self.set_serving(False)
            raise FailedPrecondition(self.broken) from e
        t1 = time.perf_counter()
        if was_broken:
            await self.set_serving(True)
        log.info("weights v%d in place (in flight kept): apply %.3f s", target_version, t1 - t0)
        return SwapResult(version=target_version, apply_s=t1 - t0, drain_s=0.0)

    def abort_for_swap(self) -> None:
        """The drain timed out: cancel every sample still running (their calls end UNAVAILABLE) so the swap goes on."""
        rids = list(self._running)
        log.warning("drain_timeout_s %.1f s passed with %d samples running: aborting them for the swap",
                    self.drain_timeout_s or 0, len(rids))
        self._swap_aborted.update(rids)
        self.counters.aborted_requests += len(rids)
        for rid in rids:
            self._running[rid].cancel()
        asyncio.ensure_future(self.backend.abort(rids))

    async def set_serving(self, serving: bool) -> None:
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
            "lease": self.lease(),
        }


def _itemsize(dtype: str) -> int:
    if dtype not in DTYPES:
        raise InvalidArgument(f"checkpoint tensor dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    return DTYPES[dtype].itemsize
