"""Weight pushes through vLLM's weight-transfer API: the session rules around the backend's five calls.

The trainer drives a push as vLLM's `VLLMWeightSyncClient` does (forkrl/remote/rollout.py): InitWeightTransfer
once per trainer connection (the engine's workers join the trainer's process group: gloo on CPU, vLLM's nccl on a
GPU), then per push StartWeightUpdate, one UpdateWeightChunk per chunk (the workers receive the chunk's tensors
from the trainer's broadcast during the call), FinishWeightUpdate. Rules (`WeightTransfer`):
- StartWeightUpdate follows the lease and version rules of every push (engine.py: `target_version` = served + 1,
  the run holding the lease) and holds the engine's swap lock until the session ends, so no other push
  interleaves. Swap mode inplace: vLLM's scheduler pauses in its "keep" mode (requests in flight stay scheduled,
  KV cache kept) until the end; drain: the gate closes first and waits for the samples in flight, as a push does.
- UpdateWeightChunk names, dtypes and shapes are checked against the served model before the engine is touched;
  a refused chunk ends the session: with gloo it is still received (and dropped), so the trainer's broadcast
  completes; with nccl nothing is received and both sides abort their communicator (forkrl/weights/deadline.py).
  With nccl every receive also has a deadline (`timeout_s`), past which the workers abort it.
  With gloo a chunk also names the one that follows, whose receives the workers post at once (the trainer sends
  it while they load this one).
- FinishWeightUpdate needs every tensor of the served model once; it finalizes vLLM's reload, bumps the version
  (also vLLM's weight_version), salts the prefix cache anew and resumes: a sample in flight reports both versions
  (policy_version / last_policy_version), as with any in-place push.
- A session that ends any other way (a refused or failed chunk, AbortWeightUpdate, or no call for `timeout_s`:
  the trainer is gone) finalizes vLLM's reload (every layer that received nothing gets its kept tensors back) and
  resumes. Once a chunk reached the engine, the weights are a mix: the service then says so (FAILED_PRECONDITION
  and NOT_SERVING) until a push succeeds, as after a reload that failed half-way. Before that, the old weights
  serve on. Any such end also leaves the process group (receives may be posted for chunks that will not come):
  the trainer calls InitWeightTransfer again before its next push.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from forkrl.weights.safetensors import DTYPES
from rollout_service.types import FailedPrecondition, InvalidArgument, PushTarget

if TYPE_CHECKING:
    from collections.abc import Awaitable, Coroutine

log = logging.getLogger("rollout_service")
T = TypeVar("T")


def _detached(coro: Coroutine[Any, Any, T]) -> Awaitable[T]:
    """Run `coro` as a task of its own that a cancelled caller does not cancel."""
    task = asyncio.ensure_future(coro)
    task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved: never "never retrieved"
    return asyncio.shield(task)


@dataclass
class _Session:
    run_id: str
    target_version: int
    started: float = field(default_factory=time.perf_counter)
    last_call: float = field(default_factory=time.monotonic)
    busy: bool = False  # a chunk is being received (bounded by the process group's timeout)
    touched: bool = False  # a chunk reached the engine: ending without Finish leaves a mix of weights
    received: set[str] = field(default_factory=set)
    gate: contextlib.AsyncExitStack = field(default_factory=contextlib.AsyncExitStack)
    watchdog: asyncio.Task[None] | None = None


class _EngineStuck(Exception):
    """The engine did not answer a receive within twice its deadline (`WeightTransfer._receive`)."""


class WeightTransfer:
    """The weight-transfer sessions of one engine (RolloutEngine, as a PushTarget; one session at a time)."""

    def __init__(self, engine: PushTarget, timeout_s: float) -> None:
        self.engine = engine
        self.timeout_s = timeout_s
        self.backend_name = str(engine.backend.engine_settings.get("weight_transfer_backend", ""))
        self.initialized = False
        self._session: _Session | None = None

    # ------------------------------------------------------------------------------------------ calls
    # Each call runs to its end even when the caller's RPC is cancelled (a trainer that died mid-call): the
    # session's state always matches the engine's, and a session left open is ended by the watchdog.
    async def init(self, run_id: str, info: dict[str, Any]) -> None:
        return await _detached(self._init(run_id, info))

    async def start(self, run_id: str, target_version: int) -> None:
        return await _detached(self._start(run_id, target_version))

    async def chunk(self, run_id: str, target_version: int, names: Sequence[str], dtype_names: Sequence[str],
                    shapes: Sequence[Sequence[int]], following: dict[str, Any] | None = None,
                    digest: str = "") -> None:
        """`following`: the next chunk's names, dtypes and shapes (gloo: its receives are posted behind this one's).
        `digest`: gloo, the chunk's keyed digest the workers check before loading it."""
        return await _detached(self._chunk(run_id, target_version, names, dtype_names, shapes, following, digest))

    async def finish(self, run_id: str, target_version: int) -> float:
        """Commit the session; returns the seconds from Start to the resume (generation paused meanwhile)."""
        return await _detached(self._finish(run_id, target_version))

    async def abort(self, run_id: str, target_version: int) -> bool:
        """End the session of (run_id, target_version) without committing it; False when there is none."""
        return await _detached(self._abort(run_id, target_version))

    async def shutdown(self, run_id: str) -> None:
        return await _detached(self._shutdown(run_id))

    async def _init(self, run_id: str, info: dict[str, Any]) -> None:
        """Join the trainer's process group (replacing an earlier one)."""
        if not self.backend_name:
            raise FailedPrecondition("this rollout service runs without a weight-transfer backend "
                                     "(--weight-transfer none); push with UpdateWeights or LoadWeights")
        if self._session is not None:
            raise FailedPrecondition(f"a weight update of run {self._session.run_id!r} to version "
                                     f"{self._session.target_version} is in progress")
        holder, _ = self.engine.lease()
        if holder and run_id != holder:
            raise FailedPrecondition(f"the rollout is leased to run {holder!r}; run {run_id!r} is refused")
        workers = int(self.engine.backend.engine_settings.get("weight_transfer_workers", 1) or 1)
        address, port = str(info.get("master_address", "")), int(info.get("master_port", 0))
        world, offset = int(info.get("world_size", 0)), int(info.get("rank_offset", 0))
        if not address or len(address) > 255:
            raise InvalidArgument(f"master_address must be a host name or address, got {address[:80]!r}")
        if not 0 < port < 65536:
            raise InvalidArgument(f"master_port must be in [1, 65535], got {port}")
        if not 1 <= offset or offset + workers > world:
            raise InvalidArgument(f"rank_offset must be >= 1 and rank_offset + this engine's {workers} worker(s) <= "
                                  f"world_size, got rank_offset {offset}, world_size {world}")
        if self.backend_name == "gloo":
            secret = str(info.get("secret", ""))
            if len(secret) != 64 or any(c not in "0123456789abcdef" for c in secret):
                raise InvalidArgument(f"secret must be the group's 32-byte secret in lowercase hex (64 characters), "
                                      f"got {len(secret)} characters")
        # gloo: the group's timeout; nccl: the workers' deadline on each receive (forkrl/weights/deadline.py)
        info = info | {"timeout_s": self.timeout_s}
        self.initialized = False
        try:
            await self.engine.backend.init_weight_transfer(info)
        except Exception as e:  # an unreachable rendezvous, a group that never formed
            raise FailedPrecondition(f"joining the weight-transfer group at {address}:{port} failed "
                                     f"({type(e).__name__}: {e})") from None
        self.initialized = True
        log.info("weight transfer (%s): joined the process group of run %s at %s:%s (world size %s, rank offset %s)",
                 self.backend_name, run_id, info.get("master_address"), info.get("master_port"),
                 info.get("world_size"), info.get("rank_offset"))

    async def _start(self, run_id: str, target_version: int) -> None:
        engine = self.engine
        if not self.initialized:
            raise FailedPrecondition("no weight-transfer process group: InitWeightTransfer first")
        if self._session is not None:
            raise FailedPrecondition(f"a weight update of run {self._session.run_id!r} to version "
                                     f"{self._session.target_version} is in progress")
        await engine.apply_lock.acquire()  # released when the session ends
        try:
            engine.check_push(run_id, target_version)  # again under the lock: another push may have won
            if not self.initialized:  # an earlier session's failure dropped the group while this one waited
                raise FailedPrecondition("no weight-transfer process group: InitWeightTransfer first")
            engine.take_lease(run_id)
            s = _Session(run_id, target_version)
            if engine.swap_mode == "drain":
                await engine.set_serving(False)
                drained = await s.gate.enter_async_context(engine.gate.closed(engine.drain_timeout_s))
                if not drained:
                    engine.abort_for_swap()
                    await engine.gate.wait_drained()
            try:
                await engine.backend.start_weight_update()
            except BaseException as e:
                await s.gate.aclose()
                if not engine.broken:
                    await engine.set_serving(True)
                if isinstance(e, Exception):
                    raise FailedPrecondition(f"starting the weight update failed ({type(e).__name__}: {e})") from e
                raise
        except BaseException:
            engine.counters.rejected_weight_updates += 1
            engine.apply_lock.release()
            raise
        s.watchdog = asyncio.create_task(self._watch(s))
        self._session = s

    async def _chunk(self, run_id: str, target_version: int, names: Sequence[str], dtype_names: Sequence[str],
                     shapes: Sequence[Sequence[int]], following: dict[str, Any] | None, digest: str) -> None:
        s = self._current(run_id, target_version)
        info: dict[str, Any] = {"names": list(names), "dtype_names": list(dtype_names),
                                "shapes": [list(x) for x in shapes]}
        if following and self.backend_name == "gloo":
            info["next"] = following
        if self.backend_name == "gloo":
            info["digest"] = digest
        s.busy = True
        try:
            try:
                self._check_chunk(s, info)
            except InvalidArgument as e:
                # gloo: received into scratch buffers and dropped (its `discard`), so the trainer's broadcast
                # completes. nccl: vLLM's NCCLWeightTransferUpdateInfo has no such field and its receive loads into
                # the model, so nothing is received; leaving the group (`_end`) aborts this side's communicator
                # and the trainer aborts its own on the refusal (forkrl/training/rollouts.py)
                gloo = self.backend_name == "gloo"
                await self._end(s, f"a refused chunk ({e})",
                                drain={k: v for k, v in info.items() if k != "next"} if gloo else None)
                raise
            s.touched = True
            try:
                await self._receive(s, info)
            except _EngineStuck as e:
                raise FailedPrecondition(str(e)) from None
            except Exception as e:
                # a NaN or inf the workers refused (forkrl/weights/transfer_gloo.py; vLLM passes a worker's error
                # on as its message): the trainer's fault. A digest that differs: the bytes were altered on the
                # channel. Either way gloo's workers loaded none of the chunk (vLLM's nccl engine loads each tensor
                # as it comes): with no chunk before it, the old weights are whole. Anything else: the group failed.
                nonfinite = "holds NaN or inf" in str(e)
                refused = nonfinite or "does not match the digest" in str(e)
                if refused and self.backend_name == "gloo" and not s.received:
                    s.touched = False
                await self._end(s, f"a chunk failed ({type(e).__name__}: {e})")
                raise (InvalidArgument if nonfinite else FailedPrecondition)(
                    f"UpdateWeightChunk failed ({e}); " + ("the old weights serve on" if not s.touched else
                                                          "the served weights are broken until a push or load "
                                                          "succeeds")) from None
            s.received.update(info["names"])
        finally:
            s.busy, s.last_call = False, time.monotonic()

    async def _receive(self, s: _Session, info: dict[str, Any]) -> None:
        """The engine receives a chunk. With nccl the workers' own deadline (timeout_s: the communicator is aborted,
        the receive fails) bounds it; should the engine still not answer by twice that, the service is marked
        broken here and the session dropped without touching the engine again (its calls would queue behind)."""
        if self.backend_name != "nccl":
            return await self.engine.backend.update_weights(info)
        try:
            return await asyncio.wait_for(_detached(self.engine.backend.update_weights(info)), 2 * self.timeout_s)
        except asyncio.TimeoutError:  # noqa: UP041 - Python 3.10's asyncio raises its own
            why = (f"a weight chunk was not received within {2 * self.timeout_s:g} s (the NCCL receive's deadline "
                   f"is {self.timeout_s:g} s); the engine is stuck: restart the rollout service")
            self._close(s)
            self.initialized = False
            self.engine.counters.rejected_weight_updates += 1
            await self.engine.mark_broken(why)
            await self._release(s)
            log.error("weight update of run %s to version %d: %s", s.run_id, s.target_version, why)
            raise _EngineStuck(why) from None

    async def _finish(self, run_id: str, target_version: int) -> float:
        s = self._current(run_id, target_version)
        engine = self.engine
        missing = sorted(set(engine.specs) - s.received - engine.ignorable)
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            await self._end(s, f"FinishWeightUpdate with {len(missing)} tensor(s) never sent")
            raise InvalidArgument(f"FinishWeightUpdate: the update lacks {len(missing)} tensor(s) of the served "
                                  f"model: {shown}")
        self._close(s)
        try:
            await engine.backend.finish_weight_update(target_version, lambda: engine.commit(target_version))
        except Exception as e:
            await engine.mark_broken(f"finishing the weight update to version {target_version} failed "
                                     f"({type(e).__name__}: {e})")
            raise FailedPrecondition(engine.broken or "") from e
        finally:
            await self._release(s)
        apply_s = time.perf_counter() - s.started
        log.info("weights v%d in place (weight transfer, %d tensors): paused %.3f s", target_version,
                 len(s.received), apply_s)
        return apply_s

    async def _abort(self, run_id: str, target_version: int) -> bool:
        s = self._session
        if s is None or (s.run_id, s.target_version) != (run_id, target_version):
            return False
        await self._end(s, "AbortWeightUpdate")
        return True

    async def _shutdown(self, run_id: str) -> None:
        holder, _ = self.engine.lease()
        if holder and run_id != holder:
            raise FailedPrecondition(f"the rollout is leased to run {holder!r}; run {run_id!r} is refused")
        if self._session is not None:
            raise FailedPrecondition("a weight update is in progress: finish or abort it first")
        if self.initialized:
            self.initialized = False
            await self.engine.backend.shutdown_weight_transfer()

    # ---------------------------------------------------------------------------------------- helpers
    def _current(self, run_id: str, target_version: int) -> _Session:
        s = self._session
        if s is None:
            raise FailedPrecondition(f"no weight update in progress (run {run_id!r}, version {target_version}): "
                                     "StartWeightUpdate first; a session ends on any error and after "
                                     f"{self.timeout_s:g} s without a call")
        if (s.run_id, s.target_version) != (run_id, target_version):
            raise FailedPrecondition(f"the weight update in progress is run {s.run_id!r}'s to version "
                                     f"{s.target_version}, not run {run_id!r}'s to version {target_version}")
        if s.busy:
            raise FailedPrecondition("a chunk of this weight update is still being received")
        return s

    def _check_chunk(self, s: _Session, info: dict[str, Any]) -> None:
        specs, ignorable = self.engine.specs, self.engine.ignorable
        if not info["names"]:
            raise InvalidArgument("names is empty")
        if not len(info["names"]) == len(info["dtype_names"]) == len(info["shapes"]):
            raise InvalidArgument(f"names, dtype_names and shapes must have one entry per tensor, got "
                                  f"{len(info['names'])}, {len(info['dtype_names'])}, {len(info['shapes'])}")
        seen: set[str] = set()
        for i, (name, dtype, shape) in enumerate(zip(info["names"], info["dtype_names"], info["shapes"],
                                                    strict=True)):
            where = f"names[{i}] ({name!r})"
            if name in s.received or name in seen:
                raise InvalidArgument(f"{where}: sent twice in this update")
            seen.add(name)
            if dtype not in DTYPES:
                raise InvalidArgument(f"dtype_names[{i}] ({name!r}) must be one of {', '.join(DTYPES)}, got {dtype!r}")
            if name not in specs and name not in ignorable:
                raise InvalidArgument(f"{where}: no tensor of that name in the served model")
            want = list(specs[name][1]) if name in specs else None
            if any(d < 0 for d in shape) or (want is not None and list(shape) != want):
                raise InvalidArgument(f"shapes[{i}] ({name!r}) must be {want} (the served model's), got {shape}")

    async def _watch(self, s: _Session) -> None:
        """End a session that saw no call for timeout_s (a chunk in progress is bounded by the group's timeout:
        gloo's, or with nccl the workers' deadline and `_receive`'s)."""
        while self._session is s:
            left = s.last_call + self.timeout_s - time.monotonic()
            if left > 0 or s.busy:
                await asyncio.sleep(max(left, 1.0))
                continue
            log.warning("weight update of run %s to version %d: no call for %.0f s: abandoned", s.run_id,
                        s.target_version, self.timeout_s)
            await self._end(s, f"no call for {self.timeout_s:g} s (the trainer went away?)")
            return

    def _close(self, s: _Session) -> None:
        self._session = None
        if s.watchdog is not None and s.watchdog is not asyncio.current_task():
            s.watchdog.cancel()

    async def _release(self, s: _Session) -> None:
        await s.gate.aclose()
        engine = self.engine
        if not engine.broken:  # drain mode's NOT_SERVING, or a broken state a commit mended
            await engine.set_serving(True)
        engine.apply_lock.release()

    async def _end(self, s: _Session, why: str, *, drain: dict[str, Any] | None = None) -> None:
        """End `s` without a commit: receive a refused chunk (`drain`), finalize vLLM's reload, resume, and leave the
        process group (receives may be posted ahead for chunks that will not come: the trainer forms it again)."""
        if self._session is not s:
            return
        self._close(s)
        engine = self.engine
        engine.counters.rejected_weight_updates += 1
        try:
            if drain is not None:
                with contextlib.suppress(Exception):  # received and dropped: the trainer's broadcast completes
                    await engine.backend.update_weights(drain | {"discard": True})
            try:
                await engine.backend.abort_weight_update()
            except Exception as e:  # noqa: BLE001 - the model's state is unknown
                s.touched = True
                log.exception("ending the weight update failed: %s", e)
            if s.touched:
                await engine.mark_broken(f"a weight update to version {s.target_version} ended half-way ({why}); "
                                         "the served weights are unknown until a push or load succeeds")
            log.warning("weight update of run %s to version %d ended without a commit: %s%s", s.run_id,
                        s.target_version, why, "; the weights are broken" if s.touched else "; the old weights serve")
            if self.initialized:
                self.initialized = False
                with contextlib.suppress(Exception):
                    await engine.backend.shutdown_weight_transfer()
        finally:
            await self._release(s)
