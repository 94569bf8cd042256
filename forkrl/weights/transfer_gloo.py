"""A `gloo` backend for vLLM's weight-transfer API: the same path as vLLM's `nccl` backend, on CPU.

vLLM (vllm/distributed/weight_transfer/) moves a trainer's weights into its engines by a broadcast from the
trainer's sender rank (rank 0) to every worker of every engine over a process group of their own: the engine's
`init_weight_transfer_engine` joins the group, `start_weight_update` starts vLLM's layerwise reload, each
`update_weights(names, dtypes, shapes)` receives one chunk of tensors and loads them, `finish_weight_update`
finalizes. This module is that backend over gloo, registered under the name "gloo" with both of vLLM's factories
at import:
- worker side, `GlooWeightTransferEngine` (`WeightTransferEngineFactory`): the rollout service's worker extension
  imports this module in vLLM's worker process before the model is loaded, where vLLM creates the engine of
  `WeightTransferConfig(backend="gloo")`;
- trainer side, `GlooTrainerWeightTransferEngine` (`WeightTransferTrainerFactory`), on every trainer rank:
  rank 0 sends, the others join the gathers of an FSDP2-sharded model (`WeightSource` iteration).

The group is rank 0 (the trainer's sender, which hosts the TCPStore rendezvous at master_address:master_port, so
the trainer and the engines can be separate hosts with no shared filesystem) plus every worker at
`rank_offset + its rank in its engine`. It is built beside, never through, the global default group (the trainer's
FSDP ranks and vLLM's worker each have one) and broadcasts with the ProcessGroup object's own ranks.

The sender streams layer by layer (`WeightSource.iter_groups`, vLLM's `layerwise_groups`): per group every trainer
rank materializes the group's tensors (FSDP2 all-gathers), the sender calls the engine's `update_weights` for
that group concurrently with broadcasting the tensors, then they are freed: the trainer's extra memory is one
group (a decoder layer, or the embeddings), never the model. A worker checks every received tensor is finite and
refuses the chunk otherwise (`NonFiniteWeights`); a chunk its service refused before loading is received and
dropped (`discard`), so the sender's broadcasts always complete.
"""

from __future__ import annotations

import datetime
import queue
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

from forkrl.weights.finite import is_finite
from forkrl.weights.safetensors import DTYPES

BACKEND = "gloo"
TIMEOUT_S = 300.0  # one broadcast (and the TCPStore) may wait this long for a peer
CONNECT_TIMEOUT_S = 60.0  # joining the group: every member connects within this
_PREFETCH = 2  # tensors received ahead of the one being loaded


class NonFiniteWeights(ValueError):
    """A received tensor holds a NaN or inf: the chunk is refused (the message names the tensor)."""


@dataclass(kw_only=True)
class GlooWeightTransferInitInfo(WeightTransferInitInfo):
    """Worker side: where the group meets, its size, this engine's first rank in it, the broadcast timeout."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_s: float = TIMEOUT_S

    def __post_init__(self) -> None:
        if not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be in [1, 65535], got {self.master_port}")
        if not 0 < self.rank_offset < self.world_size:
            raise ValueError(f"rank_offset must be in [1, world_size {self.world_size}), got {self.rank_offset}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")


@dataclass
class GlooWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    """One chunk: the tensors the sender broadcasts next, in order. `discard`: receive them and drop them."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    discard: bool = False

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(f"names, dtype_names and shapes must have one entry per tensor, got "
                             f"{len(self.names)}, {len(self.dtype_names)}, {len(self.shapes)}")
        for name, dtype in zip(self.names, self.dtype_names, strict=True):
            if dtype not in DTYPES:
                raise ValueError(f"tensor {name!r}: dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """Trainer side: the address the sender (rank 0) listens on for the rendezvous (port 0: a free one), the size
    of the group (1 + every worker of every engine) and the broadcast timeout. `rank` (keyword): this trainer
    rank."""

    backend: ClassVar[str] = BACKEND

    master_address: str
    master_port: int
    world_size: int
    timeout_s: float = TIMEOUT_S


def _join(address: str, port: int, rank: int, world_size: int, timeout_s: float,
          listen: socket.socket | None = None) -> Any:
    """A gloo ProcessGroup of `world_size` over a TCPStore at address:port (rank 0 serves it, from `listen` when
    given), apart from the default group. Joining waits at most CONNECT_TIMEOUT_S; broadcasts `timeout_s`."""
    from torch.distributed import PrefixStore, rendezvous
    from vllm.distributed.utils import create_tcp_store, init_gloo_process_group

    connect = datetime.timedelta(seconds=min(CONNECT_TIMEOUT_S, timeout_s))
    if listen is not None:
        store = create_tcp_store(address, port, listen_socket=listen, world_size=world_size, is_master=True,
                                 timeout=connect, multi_tenant=True)
    else:
        store, rank, world_size = next(rendezvous(f"tcp://{address}:{port}", rank, world_size, timeout=connect))
    timeout = datetime.timedelta(seconds=timeout_s)
    store.set_timeout(timeout)
    return init_gloo_process_group(PrefixStore(f"forkrl-weights/{address}:{port}", store), rank, world_size, timeout)


def _broadcast(group: Any, tensor: torch.Tensor) -> None:
    opts = torch.distributed.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    group.broadcast([tensor], opts).wait()


class GlooWeightTransferEngine(WeightTransferEngine[GlooWeightTransferInitInfo, GlooWeightTransferUpdateInfo]):
    """Worker side: receives each chunk by broadcast from rank 0 and loads it through vLLM's layerwise reload
    (started by `start_weight_update`, finalized by `finish_weight_update`): on CPU that pipeline re-packs the
    oneDNN weights, which a plain `model.load_weights` after start-up does not."""

    init_info_cls = GlooWeightTransferInitInfo
    update_info_cls = GlooWeightTransferUpdateInfo

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: Any = None
        self.in_update = False  # between start_weight_update and finish (or abort)

    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
        self.shutdown()  # a new trainer connection replaces the last one
        pc = self.parallel_config
        rank = pc.data_parallel_index * pc.world_size + pc.rank + init_info.rank_offset
        if rank >= init_info.world_size:
            raise ValueError(f"this worker's rank {rank} is outside world_size {init_info.world_size}")
        self.group = _join(init_info.master_address, init_info.master_port, rank, init_info.world_size,
                           init_info.timeout_s)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)
        self.in_update = True

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # vLLM's base class also calls torch.accelerator.synchronize(), which raises on a CPU-only machine; the
        # broadcasts here are synchronous (`wait()`), so there is nothing to synchronize
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooWeightTransferUpdateInfo) -> None:
        """Receive the chunk's tensors (a thread receives up to _PREFETCH ahead of the one being loaded) and load
        each finite one. Every tensor is received whatever happens, so the sender's broadcasts complete; a NaN
        or inf raises NonFiniteWeights at the end, naming the first such tensor (the tensors after it are not
        loaded)."""
        if self.group is None:
            raise RuntimeError("gloo weight transfer is not initialized (init_weight_transfer_engine first)")
        specs = list(zip(update_info.names, update_info.dtype_names, update_info.shapes, strict=True))
        received: queue.Queue[tuple[str, torch.Tensor] | BaseException | None] = queue.Queue(maxsize=_PREFETCH)

        def receive() -> None:
            try:
                for name, dtype, shape in specs:
                    t = torch.empty(shape, dtype=DTYPES[dtype])
                    _broadcast(self.group, t)
                    received.put((name, t))
                received.put(None)
            except BaseException as e:  # noqa: BLE001 - handed to the loading thread
                received.put(e)

        bad: list[str] = []

        def finite() -> Iterator[tuple[str, torch.Tensor]]:
            while (item := received.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                if not (update_info.discard or bad):
                    if is_finite(item[1]):
                        yield item
                    else:
                        bad.append(item[0])

        receiver = threading.Thread(target=receive, name="forkrl-gloo-receive", daemon=True)
        receiver.start()
        stream = finite()
        try:
            if update_info.discard:
                for _ in stream:
                    pass
            else:
                from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

                with disable_mtp_completeness_check():
                    self.model.load_weights(stream)
                for _ in stream:  # whatever load_weights left unread is still received
                    pass
        finally:
            while receiver.is_alive():  # an error while loading: drain, so the sender is not left waiting
                item = received.get()
                if item is None or isinstance(item, BaseException):
                    break
            receiver.join()
        if bad:
            raise NonFiniteWeights(f"tensor {bad[0]!r} holds NaN or inf values")

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        self.in_update = False

    def abort_weight_update(self) -> None:
        """End an update that will not finish: vLLM's finalize puts the kept tensors back in every layer that got
        nothing (a model with a layer left on the meta device cannot run); layers that were loaded keep theirs."""
        if self.in_update:
            self.finish_weight_update()

    def shutdown(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            try:
                group.shutdown()
            except Exception:  # noqa: BLE001 - a broken group: dropping it is all that is left
                pass


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """Trainer side, on every trainer rank: rank 0 (the sender) holds the group and calls the engines through
    `client`; every rank iterates the source group by group (the FSDP2 gathers are collectives)."""

    init_info_cls = GlooTrainerInitInfo

    def __init__(self, *, client: VLLMWeightSyncClient, source: WeightSource | None = None,
                 is_sender: bool = True) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.group: Any = None
        self.port = 0
        self.last_stats: dict[str, float] = {}  # of the last send: bytes, groups, the largest group's bytes

    @classmethod
    def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client: VLLMWeightSyncClient,
                     source: WeightSource | None = None) -> GlooTrainerWeightTransferEngine:
        if source is None:
            raise ValueError("the gloo trainer weight transfer needs a WeightSource")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        if not engine.is_sender:
            return engine
        listen = socket.create_server((init_info.master_address, init_info.master_port))
        engine.port = listen.getsockname()[1]
        worker_info = {"master_address": init_info.master_address, "master_port": engine.port, "rank_offset": 1,
                       "world_size": init_info.world_size, "timeout_s": init_info.timeout_s}
        joined: list[Any] = []

        def join() -> None:
            try:
                joined.append(_join(init_info.master_address, engine.port, 0, init_info.world_size,
                                    init_info.timeout_s, listen=listen))
            except BaseException as e:  # noqa: BLE001 - reported below
                joined.append(e)

        # the engines join inside init_weight_transfer_engine while this rank serves the rendezvous; the join runs
        # on a daemon thread, so an engine that refuses the init fails the call at once instead of after the wait
        joiner = threading.Thread(target=join, name="forkrl-gloo-join", daemon=True)
        joiner.start()
        try:
            client.init_weight_transfer_engine(worker_info)
        except BaseException:
            listen.close()
            raise
        joiner.join()
        if isinstance(joined[0], BaseException):
            raise joined[0]
        engine.group = joined[0]
        return engine

    def send_weights(self) -> None:
        self.send()

    def send(self, weight_version: str | None = None) -> None:
        """start -> one update_weights per layerwise group, concurrent with its broadcast -> finish. Every rank
        iterates the whole source even after an error (the others are in its gathers); the error is raised after."""
        assert self.source is not None
        if not self.is_sender:
            for _ in self.source.iter_groups():
                pass
            return
        assert self.group is not None, "trainer_init() first"
        self.client.start_weight_update()
        error: BaseException | None = None
        sent = largest = groups = 0
        rpc = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forkrl-gloo-rpc")
        try:
            for names, tensors in self.source.iter_groups():  # each rank materializes the group here
                nbytes = sum(t.numel() * t.element_size() for t in tensors)
                largest, groups = max(largest, nbytes), groups + 1
                if error is None:
                    try:
                        info = {"names": names, "dtype_names": [str(t.dtype).removeprefix("torch.") for t in tensors],
                                "shapes": [list(t.shape) for t in tensors]}
                        call = rpc.submit(self.client.update_weights, info)
                        if call.done():  # refused before receiving: no peer for the broadcasts
                            call.result()
                        for t in tensors:
                            _broadcast(self.group, t if t.is_contiguous() else t.contiguous())
                        call.result()
                        sent += nbytes
                    except BaseException as e:  # noqa: BLE001 - raised once every rank is through the source
                        error = e
                del tensors
        finally:
            rpc.shutdown(wait=False)  # never wait on a call whose broadcast peer may be gone
        self.last_stats = {"bytes": float(sent), "groups": float(groups), "largest_group_bytes": float(largest)}
        if error is not None:
            raise error
        self.client.finish_weight_update(weight_version)

    def shutdown(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            try:
                group.shutdown()
            except Exception:  # noqa: BLE001
                pass


def _register() -> None:
    for factory, name in ((WeightTransferEngineFactory, "GlooWeightTransferEngine"),
                          (WeightTransferTrainerFactory, "GlooTrainerWeightTransferEngine")):
        try:
            factory.register_engine(BACKEND, __name__, name)
        except ValueError:  # registered already (this module imported under a second name)
            pass


_register()
