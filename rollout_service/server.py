"""gRPC wiring of the rollout service: proto <-> engine types, status codes, health, reflection, shutdown.

The logic is in `engine.py` (types and errors in `types.py`); this module only translates. Life cycle:
1. listen at once with health NOT_SERVING (clients can connect and watch),
2. start the engine in a thread (seconds; the health checks are answered meanwhile), then SERVING,
3. NOT_SERVING again while weights are swapped (set by the engine),
4. SIGTERM/SIGINT: NOT_SERVING, stop accepting, give in-flight RPCs `grace_s`, shut the engine down.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from forkrl.security import OutsideRoots, confine_path
from forkrl.wire.rollout.v1 import rollout_pb2 as pb
from forkrl.wire.rollout.v1 import rollout_pb2_grpc as pb_grpc
from rollout_service.bounds import check_generate
from rollout_service.config import RolloutSettings
from rollout_service.engine import RolloutEngine
from rollout_service.types import (
    ChecksumMismatch,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    RolloutError,
    Sample,
    SamplingSpec,
    StaleVersion,
    Unavailable,
)
from serving.bind import refuse_open_bind
from serving.grpc_server import add_server_port, grpc_server_options, server_interceptors

log = logging.getLogger("rollout_service")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["RolloutService"].full_name
_CODES: dict[type[RolloutError], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    StaleVersion: grpc.StatusCode.ABORTED,
    ChecksumMismatch: grpc.StatusCode.DATA_LOSS,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
}
LOAD_ROOTS = "the rollout service's allowed_roots (--allowed-roots, ROLLOUT_ALLOWED_ROOTS)"
_FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH, "abort": pb.FINISH_REASON_ABORT}


def _status(e: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(e, RolloutError):
        return _CODES.get(type(e), grpc.StatusCode.UNKNOWN), str(e)
    if type(e).__name__ == "EngineDeadError":
        return grpc.StatusCode.UNAVAILABLE, "the inference engine died; the rollout service must be restarted"
    log.error("internal error", exc_info=e)
    return grpc.StatusCode.INTERNAL, f"internal error ({type(e).__name__}); see the rollout service log"


R = TypeVar("R")


def _mapped(rpc: Callable[..., Awaitable[R]]) -> Callable[..., Awaitable[R]]:
    """An RPC whose errors end the call with the status `_status` gives them (INTERNAL only for a bug, logged); a
    cancelled call is re-raised (the client went away). Generate maps its own: it is a stream."""

    @functools.wraps(rpc)
    async def call(self: Any, request: Any, context: grpc.aio.ServicerContext) -> R:
        try:
            return await rpc(self, request, context)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            await context.abort(*_status(e))
            raise AssertionError("unreachable: context.abort raises") from e

    return call


def trajectory(s: Sample) -> pb.Trajectory:
    return pb.Trajectory(
        prompt_index=s.prompt_index,
        sample_index=s.sample_index,
        prompt_token_ids=s.prompt_token_ids,
        completion_token_ids=s.completion_token_ids,
        completion_text=s.completion_text,
        logprobs=s.logprobs,
        finish_reason=_FINISH.get(s.finish_reason, pb.FINISH_REASON_UNSPECIFIED),
        policy_version=s.policy_version,
        last_policy_version=s.last_policy_version,
    )


def _messages(trajs: list[pb.Trajectory], max_bytes: int = 1 << 20) -> list[list[pb.Trajectory]]:
    """Group trajectories into messages of at most ~max_bytes (clients keep gRPC's 4 MiB default)."""
    groups: list[list[pb.Trajectory]] = [[]]
    size = 0
    for t in trajs:
        n = t.ByteSize()
        if groups[-1] and size + n > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += n
    return groups


def sampling_spec(req: pb.GenerateRequest) -> SamplingSpec:
    if not req.HasField("sampling"):
        raise InvalidArgument("sampling is required")
    sp = req.sampling
    return SamplingSpec(
        n=sp.n,
        temperature=sp.temperature,
        max_new_tokens=sp.max_new_tokens,
        top_p=sp.top_p if sp.HasField("top_p") else None,
        stop=list(sp.stop),
        seed=sp.seed if sp.HasField("seed") else None,
    )


def prompt_inputs(req: pb.GenerateRequest) -> list[str | list[int] | None]:
    out: list[str | list[int] | None] = []
    for p in req.prompts:
        kind = p.WhichOneof("input")
        out.append(p.text if kind == "text" else list(p.token_ids.ids) if kind == "token_ids" else None)
    return out


class RolloutServicer(pb_grpc.RolloutServiceServicer):
    def __init__(self, settings: RolloutSettings, health: HealthServicer) -> None:
        self.settings = settings
        self.health = health
        self.engine: RolloutEngine | None = None

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def load(self, make_backend: Callable[[RolloutSettings], Any] | None = None) -> None:
        """Start the engine (`make_backend` is the seam the plumbing tests use for a fake backend)."""
        if make_backend is None:
            from rollout_service.vllm_backend import VllmBackend

            make_backend = VllmBackend.start
        backend = await make_backend(self.settings)
        self.engine = RolloutEngine(
            backend,
            max_samples_per_request=self.settings.max_samples_per_request,
            staging_dir=self.settings.staging_dir,
            on_serving=self.set_serving,
            swap_mode=self.settings.swap_mode,
            lease_timeout_s=self.settings.lease_timeout_s,
            drain_timeout_s=self.settings.drain_timeout_s or None,
            transfer_timeout_s=self.settings.transfer_timeout_s,
        )
        await self.set_serving(True)

    def _ready(self) -> RolloutEngine:
        if self.engine is None:
            raise Unavailable("the engine is still loading; wait for health SERVING")
        return self.engine

    # ------------------------------------------------------------------------------------------ RPCs
    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> AsyncIterator:
        try:
            engine = self._ready()
            check_generate(request, self.settings)
            stream = engine.generate(
                prompt_inputs(request), sampling_spec(request),
                prompt_offsets=list(request.prompt_offsets), tag=request.request_tag,
            )
            async with contextlib.aclosing(stream):
                async for samples in stream:
                    for group in _messages([trajectory(s) for s in samples]):
                        if len(group) == 1:
                            yield pb.GenerateResponse(trajectory=group[0])
                        else:
                            yield pb.GenerateResponse(trajectories=group)
        except (asyncio.CancelledError, GeneratorExit):
            raise  # the client went away: `aclosing` already aborted its engine requests
        except Exception as e:
            await context.abort(*_status(e))

    @_mapped
    async def UpdateWeights(
        self, request_iterator: AsyncIterator[pb.UpdateWeightsRequest], context: grpc.aio.ServicerContext
    ) -> pb.UpdateWeightsResponse:
        engine = self._ready()
        first = await anext(request_iterator, None)
        if first is None or first.WhichOneof("part") != "header":
            engine.counters.rejected_weight_updates += 1
            raise InvalidArgument("the first UpdateWeights message must be the header")
        h = first.header
        metas = [
            {"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "nbytes": t.nbytes} for t in h.tensors
        ]

        async def chunks() -> AsyncIterator[bytes]:
            received = 0
            async for msg in request_iterator:
                if msg.WhichOneof("part") != "chunk":
                    raise InvalidArgument(f"a second header arrived after {received} payload bytes")
                received += len(msg.chunk)
                yield msg.chunk

        r = await engine.update_weights(h.target_version, metas, h.total_bytes, h.sha256, chunks(), h.run_id)
        return pb.UpdateWeightsResponse(
            version=r.version, receive_s=r.receive_s, apply_s=r.apply_s,
            bytes_received=r.bytes_received, drain_s=r.drain_s,
        )

    @_mapped
    async def LoadWeights(
        self, request: pb.LoadWeightsRequest, context: grpc.aio.ServicerContext
    ) -> pb.LoadWeightsResponse:
        engine = self._ready()
        path = request.path
        if path:  # read only inside the allowed roots ('..' refused, symlinks followed)
            try:
                path = str(confine_path(path, self.settings.load_roots(), "path", LOAD_ROOTS))
            except OutsideRoots as e:
                engine.counters.rejected_weight_updates += 1
                raise PermissionDenied(str(e)) from None
            except ValueError as e:
                engine.counters.rejected_weight_updates += 1
                raise InvalidArgument(str(e)) from None
        r = await engine.load_weights(path, request.target_version, request.run_id)
        return pb.LoadWeightsResponse(version=r.version, apply_s=r.apply_s, drain_s=r.drain_s)

    @_mapped
    async def ReleaseLease(
        self, request: pb.ReleaseLeaseRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReleaseLeaseResponse:
        return pb.ReleaseLeaseResponse(released_run_id=self._ready().release_lease(request.run_id, request.force))

    @_mapped
    async def GetInfo(self, request: pb.GetInfoRequest, context: grpc.aio.ServicerContext) -> pb.GetInfoResponse:
        info = self._ready().info()
        eng = info["engine"]
        return pb.GetInfoResponse(
            model=info["model"],
            version=info["version"],
            engine=pb.EngineSettings(
                dtype=str(eng.get("dtype", "")), max_model_len=int(eng.get("max_model_len", 0)),
                enforce_eager=bool(eng.get("enforce_eager", False)),
                logprobs_mode=str(eng.get("logprobs_mode", "")), kv_cache_gib=float(eng.get("kv_cache_gib", 0)),
                device=str(eng.get("device", "")), vllm_version=str(eng.get("vllm_version", "")),
                engine_mode=str(eng.get("engine_mode", "")),
                weight_transfer_backend=str(eng.get("weight_transfer_backend", "")),
                weight_transfer_workers=int(eng.get("weight_transfer_workers", 0)),
                backend=str(eng.get("backend", "")),
                gpu_uuids=[str(u) for u in eng.get("gpu_uuids", ())],
                gpu_memory_utilization=float(eng.get("gpu_memory_utilization") or 0.0),
            ),
            counters=pb.Counters(**info["counters"]),
            vocab_size=info["vocab_size"],
            eos_token_id=info["eos_token_id"],
            lease_run_id=info["lease"][0],
            lease_expires_in_s=info["lease"][1],
        )


    # ----------------------------------------------------------- weight transfer (rollout_service/transfer.py)
    @_mapped
    async def InitWeightTransfer(
        self, request: pb.InitWeightTransferRequest, context: grpc.aio.ServicerContext
    ) -> pb.InitWeightTransferResponse:
        engine = self._ready()
        backend = engine.transfer.backend_name
        if request.backend != backend:
            raise InvalidArgument(f"backend must be this service's weight-transfer backend {backend!r}, got "
                                  f"{request.backend!r}")
        info: dict[str, Any] = {"master_address": request.master_address, "master_port": request.master_port,
                                "rank_offset": request.rank_offset, "world_size": request.world_size}
        if backend == "gloo":
            info["secret"] = request.secret
        if backend == "nccl":
            info["packed"] = request.packed
            if request.packed_buffer_size_bytes:
                info["packed_buffer_size_bytes"] = request.packed_buffer_size_bytes
            if request.packed_num_buffers:
                info["packed_num_buffers"] = request.packed_num_buffers
        await engine.transfer.init(request.run_id, info)
        return pb.InitWeightTransferResponse()

    @_mapped
    async def StartWeightUpdate(
        self, request: pb.StartWeightUpdateRequest, context: grpc.aio.ServicerContext
    ) -> pb.StartWeightUpdateResponse:
        await self._ready().transfer.start(request.run_id, request.target_version)
        return pb.StartWeightUpdateResponse()

    @_mapped
    async def UpdateWeightChunk(
        self, request: pb.UpdateWeightChunkRequest, context: grpc.aio.ServicerContext
    ) -> pb.UpdateWeightChunkResponse:
        following = {"names": list(request.next_names), "dtype_names": list(request.next_dtype_names),
                     "shapes": [list(x.dims) for x in request.next_shapes]} if request.next_names else None
        await self._ready().transfer.chunk(request.run_id, request.target_version, list(request.names),
                                           list(request.dtype_names), [list(x.dims) for x in request.shapes],
                                           following, request.digest)
        return pb.UpdateWeightChunkResponse()

    @_mapped
    async def FinishWeightUpdate(
        self, request: pb.FinishWeightUpdateRequest, context: grpc.aio.ServicerContext
    ) -> pb.FinishWeightUpdateResponse:
        apply_s = await self._ready().transfer.finish(request.run_id, request.target_version)
        return pb.FinishWeightUpdateResponse(version=request.target_version, apply_s=apply_s)

    @_mapped
    async def AbortWeightUpdate(
        self, request: pb.AbortWeightUpdateRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortWeightUpdateResponse:
        aborted = await self._ready().transfer.abort(request.run_id, request.target_version)
        return pb.AbortWeightUpdateResponse(aborted=aborted)

    @_mapped
    async def ShutdownWeightTransfer(
        self, request: pb.ShutdownWeightTransferRequest, context: grpc.aio.ServicerContext
    ) -> pb.ShutdownWeightTransferResponse:
        await self._ready().transfer.shutdown(request.run_id)
        return pb.ShutdownWeightTransferResponse()


def build_server(settings: RolloutSettings) -> tuple[grpc.aio.Server, RolloutServicer, HealthServicer, int]:
    limit = settings.max_message_mib << 20
    token = settings.auth_token()
    refuse_open_bind("rollout service", settings.host, token)
    server = grpc.aio.server(
        interceptors=server_interceptors(token),
        options=grpc_server_options(limit, limit, settings.max_concurrent_streams),
    )
    health = HealthServicer()
    servicer = RolloutServicer(settings, health)
    pb_grpc.add_RolloutServiceServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server,
    )
    try:
        port = add_server_port(server, f"{settings.host}:{settings.port}", settings.tls_cert_file,
                               settings.tls_key_file)
    except RuntimeError as e:
        raise SystemExit(f"cannot listen on {settings.host}:{settings.port} (in use?): {e}") from None
    return server, servicer, health, port


async def _watch_engine(servicer: Any, stop: asyncio.Event, every_s: float = 2.0) -> bool:
    """Stop the service (exit code 1) when the engine dies, so that health never says SERVING for a dead
    engine and a supervisor (Docker, the launcher) sees the failure and can restart it."""
    while not stop.is_set():
        await asyncio.sleep(every_s)
        backend = servicer.engine.backend if servicer.engine is not None else None
        if backend is not None and backend.errored():
            log.error("the vLLM engine died: NOT_SERVING and exiting with status 1")
            await servicer.set_serving(False)
            stop.set()
            return True
    return False


async def serve(settings: RolloutSettings, make_backend: Callable[[RolloutSettings], Any] | None = None) -> int:
    """Run until SIGTERM/SIGINT; returns the process exit code."""
    server, servicer, health, port = build_server(settings)
    await servicer.set_serving(False)
    await server.start()
    log.info("rollout service listening on %s:%d (NOT_SERVING until the engine is up)", settings.host, port)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    load = asyncio.create_task(servicer.load(make_backend))
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({load, stopper}, return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if load.done() and load.exception() is not None:
        log.error("engine failed to start", exc_info=load.exception())
        code = 1
    elif load.done():
        log.info("engine ready: %s (v%d) SERVING on %s:%d", settings.model, 0, settings.host, port)
        watchdog = asyncio.create_task(_watch_engine(servicer, stop))
        await stopper
        if watchdog.done() and watchdog.result():
            code = 1
        watchdog.cancel()
    log.info("shutting down: NOT_SERVING, grace %.1f s", settings.grace_s)
    await health.enter_graceful_shutdown()
    await server.stop(settings.grace_s)
    if not load.done():  # a signal during start-up: the engine is built in a thread; let it finish
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(load, timeout=120)
    if servicer.engine is not None:
        servicer.engine.backend.shutdown()
    stopper.cancel()
    log.info("rollout service stopped")
    return code
