"""grpc.aio wiring of the trainer service: transport only. Runs (threads, states) live in runs.py; the config is
resolved once here, in StartRun (forkrl/training/preflight.py), and the loop is forkrl/training/loop.py."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from pydantic import ValidationError

from forkrl.cli import describe_validation_error, shown
from forkrl.training.config import RunConfig, from_proto, to_proto
from forkrl.wire.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from serving.bind import refuse_open_bind
from serving.grpc_server import add_server_port, grpc_server_options, server_interceptors
from trainer_service.config import TrainerSettings
from trainer_service.runs import Run, RunConflict, RunManager, UnknownRun

if TYPE_CHECKING:
    from forkrl.training.ranks import RankLink

log = logging.getLogger("trainer_service")
SERVICE_NAME = trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"].full_name
# Status details travel in a header (percent-encoded: up to 3 bytes per byte), and headers past gRPC's metadata
# limit (8 KiB by default) fail the call with RESOURCE_EXHAUSTED instead of the code meant: cut them to this.
MAX_DETAILS_BYTES = 2048


def _said(message: str) -> str:
    """`message` cut to MAX_DETAILS_BYTES of UTF-8 (whole characters), marked when cut."""
    raw = message.encode()
    if len(raw) <= MAX_DETAILS_BYTES:
        return message
    return raw[:MAX_DETAILS_BYTES - 6].decode(errors="ignore") + " [cut]"


async def _abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> None:
    await context.abort(code, _said(message))


def _metrics_pb(step: int, values: dict[str, float]) -> trainer_pb2.StepMetrics:
    msg = trainer_pb2.StepMetrics(step=step)
    for k, v in values.items():
        msg.values[k] = float(v)
    return msg


def _item_pb(item: dict) -> trainer_pb2.WatchRunResponse:
    if item["type"] == "metrics":
        return trainer_pb2.WatchRunResponse(metrics=_metrics_pb(item["step"], item["values"]))
    ev = trainer_pb2.RunEvent(
        kind=trainer_pb2.EventKind.Value("EVENT_KIND_" + item["kind"]),
        step=int(item["step"]),
        message=item["message"],
        path=item.get("path", ""),
        state=trainer_pb2.RunState.Value("RUN_STATE_" + item["state"]) if item.get("state") else 0,
    )
    for k, v in item.get("values", {}).items():
        ev.values[k] = float(v)
    return trainer_pb2.WatchRunResponse(event=ev)


class TrainerServicer(trainer_pb2_grpc.TrainerServiceServicer):
    def __init__(self, manager: RunManager, preflight: Callable[[RunConfig], RunConfig]) -> None:
        self.manager = manager
        self.preflight = preflight

    def _run_pb(self, run: Run) -> trainer_pb2.GetRunResponse:
        return trainer_pb2.GetRunResponse(
            run_id=run.run_id, state=trainer_pb2.RunState.Value("RUN_STATE_" + run.state), step=run.step,
            num_steps=run.config.num_steps, config=to_proto(run.config), error=run.error,
            run_dir=str(run.run_dir), last_metrics=_metrics_pb(run.step, run.last_metrics),
        )

    async def _find(self, run_id: str, context, find: Callable[[str], Run] | None = None) -> Run:
        """find(run_id) (default manager.get; "" = the latest run): NOT_FOUND, or INVALID_ARGUMENT for an id longer
        than any run's (its length said, the id never echoed)."""
        try:
            return (find or self.manager.get)(run_id)
        except UnknownRun as err:
            await _abort(context, grpc.StatusCode.NOT_FOUND, str(err))
        except ValueError as err:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(err))
        raise AssertionError("unreachable")  # abort raises

    async def StartRun(self, request, context):
        try:
            config = from_proto(request.config)
        except ValidationError as err:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, describe_validation_error(err))
        try:
            config = await asyncio.to_thread(self.preflight, config)  # the only resolve: the loop gets it as is
        except ValueError as err:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except PermissionError as err:  # outside the trainer's roots, an unknown rollout, a custom reward
            await _abort(context, grpc.StatusCode.PERMISSION_DENIED, str(err))
        except FileNotFoundError as err:
            await _abort(context, grpc.StatusCode.FAILED_PRECONDITION, str(err))
        except OSError as err:  # a path the file system cannot check (too long once symlinks are followed, I/O)
            await _abort(context, grpc.StatusCode.FAILED_PRECONDITION,
                         f"a path of the run could not be checked: {err.strerror or err} ({shown(err.filename)})")
        try:
            run = self.manager.start(config)
        except RunConflict as err:
            await _abort(context, grpc.StatusCode.FAILED_PRECONDITION, str(err))
        return trainer_pb2.StartRunResponse(run_id=run.run_id, run_dir=str(run.run_dir), start_step=run.start_step)

    async def GetRun(self, request, context):
        run = await self._find(request.run_id, context)
        return self._run_pb(run)

    async def StopRun(self, request, context):
        run = await self._find(request.run_id, context, self.manager.stop)
        return trainer_pb2.StopRunResponse(state=trainer_pb2.RunState.Value("RUN_STATE_" + run.state))

    async def WatchRun(self, request, context):
        run = await self._find(request.run_id, context)
        index = 0
        while True:
            items, done = await asyncio.to_thread(run.wait_history, index, 1.0)
            for item in items:
                yield _item_pb(item)
            index += len(items)
            if done and not items:
                return


async def _serve(settings: TrainerSettings, link: RankLink) -> int:
    from forkrl.training.loop import run_training
    from forkrl.training.preflight import preflight

    token = settings.auth_token()
    refuse_open_bind("trainer service", settings.host, token)
    server = grpc.aio.server(interceptors=server_interceptors(token),
                             options=grpc_server_options(settings.max_message_mib << 20, 64 << 20,
                                                         settings.max_concurrent_streams))
    manager = RunManager(Path(settings.runs_root),
                         lambda run: run_training(run, device=settings.device, tensorboard=settings.tensorboard,
                                                     token=token, link=link,
                                                     rollout_wait_s=settings.rollout_wait_s, threads=settings.threads))
    rules = settings.rules()
    trainer_pb2_grpc.add_TrainerServiceServicer_to_server(
        TrainerServicer(manager, lambda cfg: preflight(cfg, rules)), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server)
    try:
        port = add_server_port(server, f"{settings.host}:{settings.port}", settings.tls_cert_file,
                               settings.tls_key_file)
    except RuntimeError:  # grpcio raises where older versions returned 0
        port = 0
    if port == 0:
        raise SystemExit(f"could not bind {settings.host}:{settings.port} (in use?)")
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("trainer service listening on %s:%d (runs root %s, reads %s, rollouts %s, custom rewards %s, "
             "%d rank(s))", settings.host, port, rules.runs_root, [str(r) for r in rules.read_roots],
             list(rules.rollout_addresses), "allowed" if rules.allow_custom_rewards else "refused", link.world_size)
    print(f"trainer service listening on {settings.host}:{port}", flush=True)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down: stopping the active run (it writes a checkpoint)")
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    await asyncio.to_thread(manager.shutdown, settings.grace_s * 6)
    await server.stop(settings.grace_s)
    return 0


def serve(settings: TrainerSettings) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import torch

    from forkrl.runtime import train_threads
    from forkrl.training.ranks import follow, init_ranks

    torch.set_num_threads(train_threads(settings.threads, async_run=False))  # each run sets its own (load_policy)
    # Under torchrun (WORLD_SIZE > 1) every rank runs this: rank 0 serves, the others follow its commands.
    link = init_ranks()
    if link.rank != 0:
        follow(settings.device, settings.threads)
        return 0
    try:
        return asyncio.run(_serve(settings, link))
    finally:
        link.tell("exit")
