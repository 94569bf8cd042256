"""Synchronous client of the rollout service (the trainer loop runs in a thread; tests use it as well).

    client = RolloutClient("127.0.0.1:50051")
    client.wait_ready(timeout_s=300)
    for t in client.generate(["1+2+3="], n=8, temperature=1.0, max_new_tokens=32, seed=0):
        t.prompt_index, t.sample_index, list(t.completion_token_ids), list(t.logprobs), t.policy_version
    client.update_weights(model.state_dict(), version=1)    # -> 1
    client.load_weights("runs/x/checkpoints/step_000020", version=2)
    client.update_weights(state, version=3, run_id="20261201-run")   # takes / keeps the rollout's lease
    client.release_lease("20261201-run")                               # the run ended (force=True: operator)

Every call carries a deadline. Only UNAVAILABLE is retried (with backoff, within the deadline); a
Generate stream is retried only before its first trajectory arrived, so no sample is ever duplicated. A
weight push answered ABORTED while the service already serves the target version counts as applied.
Trajectories are the proto messages (`forkrl.rollout.v1.Trajectory`). The calls of vLLM's weight-transfer API
(init_weight_transfer ... finish_weight_update) are never retried: each is one step of a broadcast the trainer
runs beside it. `RolloutWeightSync` is vLLM's `VLLMWeightSyncClient` over one or more services. Every call carries
the services' token (`authorization: Bearer …`, from FORKRL_TOKEN / FORKRL_TOKEN_FILE unless given), over TLS when
FORKRL_TLS_CA names the CA of the service's certificate (forkrl.remote.channel.grpc_channel).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from forkrl.remote.channel import grpc_channel
from forkrl.wire.rollout.v1 import rollout_pb2 as pb
from forkrl.wire.rollout.v1 import rollout_pb2_grpc as pb_grpc

T = TypeVar("T")
_MAX_MESSAGE = 64 << 20
STOP_POLL_S = 0.1  # how often a call with `should_stop` checks it


class CallStopped(Exception):
    """A call cancelled because its `should_stop` said so (the caller's cancellation, not a fault)."""


@contextlib.contextmanager
def _cancel_when(should_stop: Callable[[], bool] | None, call: Any) -> Iterator[threading.Event]:
    """While inside, a watcher thread cancels the gRPC `call` (a streaming call or a future) as soon as
    `should_stop()` is true; yields the event set when it did. A call blocked on a service that never answers
    is ended this way within STOP_POLL_S of the stop, not at its deadline."""
    stopped, done = threading.Event(), threading.Event()
    if should_stop is None:
        yield stopped
        return

    def watch() -> None:
        while not done.wait(STOP_POLL_S):
            if should_stop():
                stopped.set()
                call.cancel()
                return

    watcher = threading.Thread(target=watch, name="forkrl-call-stop", daemon=True)
    watcher.start()
    try:
        yield stopped
    finally:
        done.set()
        watcher.join()


KEEPALIVE_S = 10  # >= serving/grpc_server.py KEEPALIVE_MIN_MS: the servers accept pings this often


class RolloutClient:
    def __init__(self, address: str, *, timeout_s: float = 600.0, max_retries: int = 5,
                 token: str | None = None, wait_for_ready: bool = True) -> None:
        """`timeout_s` is the default deadline of Generate and weight calls (info: 30 s). `token`: the
        services' bearer token (None: FORKRL_TOKEN / FORKRL_TOKEN_FILE of the environment; "": none).
        `wait_for_ready`: a call to an unreachable service waits (up to its deadline) for it to come up; False:
        it fails UNAVAILABLE at once (then retried as any UNAVAILABLE; the trainer waits for health itself)."""
        self.address = address
        self.wait_for_ready = wait_for_ready
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self._channel = grpc_channel(
            address,
            options=[("grpc.max_receive_message_length", _MAX_MESSAGE), ("grpc.max_send_message_length", _MAX_MESSAGE),
                     # a peer that answers no HTTP/2 ping (stopped, partitioned: its kernel still acks TCP) fails the
                     # call in flight UNAVAILABLE within ~KEEPALIVE_S x 2, not at its deadline (minutes)
                     ("grpc.keepalive_time_ms", KEEPALIVE_S * 1000), ("grpc.keepalive_timeout_ms", KEEPALIVE_S * 1000)],
            token=token,
        )
        self._stub = pb_grpc.RolloutServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self.last_weights_response: pb.UpdateWeightsResponse | pb.LoadWeightsResponse | None = None

    # ------------------------------------------------------------------------------------- plumbing
    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _retry(self, call: Callable[[float], T], timeout_s: float) -> T:
        deadline = time.monotonic() + timeout_s
        for attempt in range(self.max_retries + 1):
            left = deadline - time.monotonic()
            try:
                return call(max(left, 0.001))
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE or attempt == self.max_retries:
                    raise
                pause = min(0.2 * 2**attempt, 5.0)
                if time.monotonic() + pause >= deadline:
                    raise
                time.sleep(pause)
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------------------------------ API
    def health(self, timeout_s: float = 60.0) -> int:
        """The service's health status (health_pb2.HealthCheckResponse.SERVING == 1)."""
        return self._health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s).status

    def wait_ready(self, timeout_s: float = 300.0, *, should_stop: Callable[[], bool] | None = None) -> None:
        """Block until health says SERVING (the engine is loaded and no weight swap is running). `should_stop`:
        checked while waiting, also during a health call that gets no answer; true -> CallStopped."""
        deadline = time.monotonic() + timeout_s
        last: object = None
        while time.monotonic() < deadline:
            future = self._health.Check.future(health_pb2.HealthCheckRequest(service=""),
                                               timeout=min(5.0, max(deadline - time.monotonic(), 0.01)))
            with _cancel_when(should_stop, future) as stopped:
                try:
                    if future.result().status == health_pb2.HealthCheckResponse.SERVING:
                        return
                    last = "NOT_SERVING"
                except (grpc.RpcError, grpc.FutureCancelledError) as e:
                    last = e.code() if isinstance(e, grpc.RpcError) else "CANCELLED"
            if stopped.is_set() or (should_stop is not None and should_stop()):
                raise CallStopped(f"stopped while waiting for rollout service {self.address} to be SERVING")
            time.sleep(0.2)
        raise TimeoutError(f"rollout service {self.address} not SERVING after {timeout_s:.0f} s (last: {last})")

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        n: int = 1,
        temperature: float = 1.0,
        top_p: float | None = None,
        max_new_tokens: int = 64,
        stop: Sequence[str] = (),
        seed: int | None = None,
        *,
        prompt_offsets: Sequence[int] = (),
        request_tag: str = "",
        timeout_s: float | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> Iterator[pb.Trajectory]:
        """Yield len(prompts) * n trajectories as they finish (any order). Prompts are text or token ids.
        Stopping the iteration early cancels the call, and the service aborts the unfinished samples.
        `should_stop`: checked while the call runs (also while no answer comes); true -> the call is cancelled
        and CallStopped raised, within STOP_POLL_S (a probe job's cancel)."""
        req = pb.GenerateRequest(
            prompts=[
                pb.Prompt(text=p) if isinstance(p, str) else pb.Prompt(token_ids=pb.TokenIds(ids=list(p)))
                for p in prompts
            ],
            sampling=pb.SamplingParams(
                n=n, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, stop=list(stop), seed=seed
            ),
            request_tag=request_tag,
            prompt_offsets=list(prompt_offsets),
        )
        timeout = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        for attempt in range(self.max_retries + 1):
            call = self._stub.Generate(req, timeout=max(deadline - time.monotonic(), 0.001),
                                       wait_for_ready=self.wait_for_ready)
            got_any = False
            try:
                with _cancel_when(should_stop, call) as stopped:
                    try:
                        for resp in call:
                            got_any = True
                            if resp.HasField("trajectory"):
                                yield resp.trajectory
                            yield from resp.trajectories  # samples that finished together
                    except grpc.RpcError as e:
                        if stopped.is_set():
                            raise CallStopped(f"Generate on {self.address} cancelled by its caller") from e
                        raise
                return
            except grpc.RpcError as e:
                if got_any or e.code() != grpc.StatusCode.UNAVAILABLE or attempt == self.max_retries:
                    raise
                time.sleep(min(0.2 * 2**attempt, 5.0))
            finally:
                call.cancel()  # no-op when finished; aborts the service's work when the caller stopped early

    def update_weights(
        self,
        state_dict: Mapping[str, Any],
        version: int,
        *,
        timeout_s: float | None = None,
        chunk_bytes: int = 4 << 20,
        run_id: str = "",
    ) -> int:
        """Push a state dict (chunked, checksummed); returns the service's new version. The full
        response (receive/apply/drain times) is kept in `last_weights_response`."""
        from forkrl.weights.chunks import pack_state_dict  # torch: imported only by callers that push weights

        def call(left: float) -> pb.UpdateWeightsResponse:
            packed = pack_state_dict(state_dict, chunk_bytes)
            header = pb.WeightsHeader(
                target_version=version,
                tensors=[pb.TensorMeta(**m) for m in packed.metas],
                total_bytes=packed.total_bytes,
                sha256=packed.sha256,
                run_id=run_id,
            )

            def messages() -> Iterator[pb.UpdateWeightsRequest]:
                yield pb.UpdateWeightsRequest(header=header)
                for chunk in packed.chunks:
                    yield pb.UpdateWeightsRequest(chunk=chunk)

            return self._stub.UpdateWeights(messages(), timeout=left, wait_for_ready=self.wait_for_ready)

        return self._applied(lambda: self._retry(call, self.timeout_s if timeout_s is None else timeout_s), version)

    def _applied(self, push: Callable[[], Any], version: int) -> int:
        """Run a weight push. ABORTED (stale version) while the service serves exactly `version` counts as
        done: the usual cause is a push whose answer was lost (a dropped connection after the swap) and that
        was sent again. `last_weights_response` is then None (there is no answer to keep)."""
        try:
            resp = push()
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.ABORTED or self.info().version != version:
                raise
            self.last_weights_response = None
            return version
        self.last_weights_response = resp
        return resp.version

    def load_weights(self, path: str, version: int, *, timeout_s: float | None = None, run_id: str = "") -> int:
        """Make the service load `path` (a checkpoint dir it can read); returns the new version."""
        req = pb.LoadWeightsRequest(path=str(path), target_version=version, run_id=run_id)
        return self._applied(lambda: self._retry(
            lambda left: self._stub.LoadWeights(req, timeout=left, wait_for_ready=self.wait_for_ready),
            self.timeout_s if timeout_s is None else timeout_s,
        ), version)

    def release_lease(self, run_id: str = "", *, force: bool = False, timeout_s: float = 30.0) -> str:
        """Give up the rollout's lease (`run_id`: the run that ended; `force`: the operator's reset, whoever holds
        it). Returns the run that held it ("" = none)."""
        req = pb.ReleaseLeaseRequest(run_id=run_id, force=force)
        return self._retry(
            lambda left: self._stub.ReleaseLease(req, timeout=left, wait_for_ready=self.wait_for_ready), timeout_s
        ).released_run_id

    def info(self, *, timeout_s: float = 30.0) -> pb.GetInfoResponse:
        return self._retry(
            lambda left: self._stub.GetInfo(pb.GetInfoRequest(), timeout=left, wait_for_ready=self.wait_for_ready),
            timeout_s
        )

    # ---------------------------------------- vLLM's weight-transfer API (rollout_service/transfer.py); no retries
    def init_weight_transfer(self, run_id: str, backend: str, master_address: str, master_port: int, world_size: int,
                             rank_offset: int, *, packed: bool = False, packed_buffer_size_bytes: int = 0,
                             packed_num_buffers: int = 0, secret: str = "", timeout_s: float = 120.0) -> None:
        """The engine's workers join the trainer's process group (returns once all members joined). `secret`: the
        group's (gloo: forkrl/weights/transfer_gloo.py), sent over this authenticated channel only."""
        self._stub.InitWeightTransfer(pb.InitWeightTransferRequest(
            run_id=run_id, backend=backend, master_address=master_address, master_port=master_port,
            world_size=world_size, rank_offset=rank_offset, packed=packed,
            packed_buffer_size_bytes=packed_buffer_size_bytes, packed_num_buffers=packed_num_buffers, secret=secret),
            timeout=timeout_s, wait_for_ready=self.wait_for_ready)

    def start_weight_update(self, run_id: str, target_version: int, *, timeout_s: float | None = None) -> None:
        self._stub.StartWeightUpdate(pb.StartWeightUpdateRequest(run_id=run_id, target_version=target_version),
                                     timeout=self.timeout_s if timeout_s is None else timeout_s,
                                     wait_for_ready=self.wait_for_ready)

    def update_weight_chunk(self, run_id: str, target_version: int, names: Sequence[str], dtype_names: Sequence[str],
                            shapes: Sequence[Sequence[int]], *, next: Mapping[str, Any] | None = None,
                            digest: str = "", timeout_s: float | None = None) -> None:
        """One chunk: the service's workers receive these tensors from the trainer's broadcast during the call.
        `next` ({names, dtype_names, shapes}): the chunk that follows (gloo: received while this one loads).
        `digest`: the chunk's keyed digest (gloo), checked by the workers before they load it."""
        n = next or {}
        self._stub.UpdateWeightChunk(pb.UpdateWeightChunkRequest(
            run_id=run_id, target_version=target_version, names=list(names), dtype_names=list(dtype_names),
            shapes=[pb.TensorShape(dims=list(s)) for s in shapes], next_names=list(n.get("names", [])),
            next_dtype_names=list(n.get("dtype_names", [])),
            next_shapes=[pb.TensorShape(dims=list(s)) for s in n.get("shapes", [])], digest=digest),
            timeout=self.timeout_s if timeout_s is None else timeout_s, wait_for_ready=self.wait_for_ready)

    def finish_weight_update(self, run_id: str, target_version: int, *,
                             timeout_s: float | None = None) -> pb.FinishWeightUpdateResponse:
        return self._stub.FinishWeightUpdate(
            pb.FinishWeightUpdateRequest(run_id=run_id, target_version=target_version),
            timeout=self.timeout_s if timeout_s is None else timeout_s, wait_for_ready=self.wait_for_ready)

    def abort_weight_update(self, run_id: str, target_version: int, *, timeout_s: float = 60.0) -> bool:
        return self._stub.AbortWeightUpdate(
            pb.AbortWeightUpdateRequest(run_id=run_id, target_version=target_version),
            timeout=timeout_s, wait_for_ready=self.wait_for_ready).aborted

    def shutdown_weight_transfer(self, run_id: str, *, timeout_s: float = 60.0) -> None:
        self._stub.ShutdownWeightTransfer(pb.ShutdownWeightTransferRequest(run_id=run_id), timeout=timeout_s,
                                          wait_for_ready=self.wait_for_ready)


class RolloutWeightSync:
    """vLLM's `VLLMWeightSyncClient` (vllm/distributed/weight_transfer/base.py) over rollout services: a trainer
    engine (forkrl/weights/transfer_gloo.py, or vLLM's NCCL one) drives a push through it, and each call goes to
    every service at once (a thread each), for the session of `run_id` that makes service j serve `targets[j]`
    (set before each push). Service j's workers take the ranks from the init info's `rank_offset` + the workers of
    the services before it (`workers`, from GetInfo). A call that fails on any service raises its first error
    once every service answered (`abort()` then ends the sessions the others still hold)."""

    def __init__(self, clients: Sequence[RolloutClient], run_id: str, backend: str, workers: Sequence[int]) -> None:
        self.clients = list(clients)
        self.run_id = run_id
        self.backend = backend
        self.workers = list(workers)
        self.targets = [0] * len(self.clients)
        self.finished: list[pb.FinishWeightUpdateResponse] = []  # of the last push, per service
        self._pool = ThreadPoolExecutor(max_workers=len(self.clients), thread_name_prefix="forkrl-weight-sync")

    def _each(self, call: Callable[[int, RolloutClient], T]) -> list[T]:
        futures = [self._pool.submit(call, j, c) for j, c in enumerate(self.clients)]
        errors = [f.exception() for f in futures]
        for e in errors:
            if e is not None:
                raise e
        return [f.result() for f in futures]

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        base = int(init_info["rank_offset"])
        self._each(lambda j, c: c.init_weight_transfer(
            self.run_id, self.backend, str(init_info["master_address"]), int(init_info["master_port"]),
            int(init_info["world_size"]), base + sum(self.workers[:j]), packed=bool(init_info.get("packed", False)),
            packed_buffer_size_bytes=int(init_info.get("packed_buffer_size_bytes", 0)),
            packed_num_buffers=int(init_info.get("packed_num_buffers", 0)), secret=str(init_info.get("secret", ""))))

    def start_weight_update(self) -> None:
        self._each(lambda j, c: c.start_weight_update(self.run_id, self.targets[j]))

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        if not isinstance(update_info, dict):
            raise ValueError("per-worker update infos are not supported: every worker receives the same chunk")
        self._each(lambda j, c: c.update_weight_chunk(self.run_id, self.targets[j], update_info["names"],
                                                      update_info["dtype_names"], update_info["shapes"],
                                                      next=update_info.get("next"),
                                                      digest=str(update_info.get("digest", ""))))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Commit on every service (each as its own targets[j]; `weight_version`, the trainer's, is not sent)."""
        self.finished = self._each(lambda j, c: c.finish_weight_update(self.run_id, self.targets[j]))

    def abort(self) -> None:
        """Best effort: end the push's session wherever one is still open."""
        for j, c in enumerate(self.clients):
            try:
                c.abort_weight_update(self.run_id, self.targets[j])
            except grpc.RpcError:
                pass

    def shutdown(self) -> None:
        """Best effort: every service leaves the process group."""
        for c in self.clients:
            try:
                c.shutdown_weight_transfer(self.run_id)
            except grpc.RpcError:
                pass
        self._pool.shutdown(wait=False)
