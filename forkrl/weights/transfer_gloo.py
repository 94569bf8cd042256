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
that group concurrently with broadcasting the tensors, then they are freed. Pipelined: each chunk names the one
that follows (`next`), so the workers post its receives at once and the sender broadcasts it while the workers
still load (vLLM's layerwise processing) the current one; the trainer holds at most two groups (a decoder layer,
or the embeddings) gathered at a time, never the model. A worker checks every received tensor is finite (in the
dtype the model serves: forkrl/weights/finite.py) and refuses the chunk otherwise (`NonFiniteWeights`); a chunk
its service refused before loading is received and dropped (`discard`). An update that ends without finishing
drops the group on both sides (receives posted ahead cannot be taken back): the trainer forms it again for its
next push.

Authentication (forkrl/weights/transfer_auth.py). The store and the pair sockets accept whoever reaches them, so
nothing received on them is trusted alone: the trainer draws a secret per group and sends it to the workers only in
the init info (InitWeightTransfer, over gRPC with token and TLS); the rendezvous keys live under a prefix derived
from it, and each chunk's update info carries `digest`, a keyed BLAKE3 of the chunk that the worker compares with
its own digest of the received bytes (hashed as they arrive, beside the loading of the chunk before) before loading
any of it (`TamperedWeights`). Not provided: secrecy (the tensor bytes travel in clear) and availability (whoever
reaches the ports can break a group formation or a broadcast: the push fails). The store listens on the trainer's
given address only, the pair sockets on the address that routes to it.
"""

from __future__ import annotations

import datetime
import socket
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
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
from forkrl.weights.guard import NonFiniteWeights, served_dtype
from forkrl.weights.safetensors import DTYPES
from forkrl.weights.transfer_auth import (
    Spec,
    check_digest,
    chunk_digest,
    digest_behind,
    new_secret,
    secret_bytes,
    store_prefix,
)

BACKEND = "gloo"
TIMEOUT_S = 300.0  # one broadcast (and the TCPStore) may wait this long for a peer
CONNECT_TIMEOUT_S = 60.0  # joining the group: every member connects within this


def local_address(master_address: str, master_port: int) -> str:
    """This host's address on the route to master_address (where its gloo pair sockets listen; no packet sent)."""
    with socket.socket(socket.AF_INET6 if ":" in master_address else socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((master_address, master_port))
        return str(s.getsockname()[0])


@dataclass(kw_only=True)
class GlooWeightTransferInitInfo(WeightTransferInitInfo):
    """Worker side: where the group meets, its size, this engine's first rank in it, the broadcast timeout."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    secret: str = ""  # the group's secret, hex (the trainer's, from the gRPC call): required
    timeout_s: float = TIMEOUT_S

    def __post_init__(self) -> None:
        secret_bytes(self.secret)
        if not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be in [1, 65535], got {self.master_port}")
        if not 0 < self.rank_offset < self.world_size:
            raise ValueError(f"rank_offset must be in [1, world_size {self.world_size}), got {self.rank_offset}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")


@dataclass
class GlooWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    """One chunk: the tensors the sender broadcasts next, in order. `discard`: receive them and drop them. `next`:
    the chunk that follows ({names, dtype_names, shapes}), received while this one loads. `digest`: the sender's
    `chunk_digest` of it (required unless discarded)."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    discard: bool = False
    next: dict[str, Any] | None = None
    digest: str = ""

    def __post_init__(self) -> None:
        _specs(self.names, self.dtype_names, self.shapes)
        if self.next is not None:
            _specs(self.next.get("names", []), self.next.get("dtype_names", []), self.next.get("shapes", []))

    def specs(self) -> list[Spec]:
        return _specs(self.names, self.dtype_names, self.shapes)

    def next_specs(self) -> list[Spec]:
        n = self.next or {}
        return _specs(n.get("names", []), n.get("dtype_names", []), n.get("shapes", []))


def _specs(names: Sequence[str], dtype_names: Sequence[str], shapes: Sequence[Sequence[int]]) -> list[Spec]:
    if not len(names) == len(dtype_names) == len(shapes):
        raise ValueError(f"names, dtype_names and shapes must have one entry per tensor, got "
                         f"{len(names)}, {len(dtype_names)}, {len(shapes)}")
    for name, dtype in zip(names, dtype_names, strict=True):
        if dtype not in DTYPES:
            raise ValueError(f"tensor {name!r}: dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return [(n, d, [int(x) for x in s]) for n, d, s in zip(names, dtype_names, shapes, strict=True)]


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


def _join(address: str, port: int, rank: int, world_size: int, timeout_s: float, secret: str,
          listen: socket.socket | None = None) -> Any:
    """A gloo ProcessGroup of `world_size` over a TCPStore at address:port (rank 0 serves it, from `listen` when
    given; its keys under `store_prefix(secret)`), apart from the default group, its pair sockets on this host's
    address towards `address`. Joining waits at most CONNECT_TIMEOUT_S; broadcasts `timeout_s`."""
    from torch._C._distributed_c10d import ProcessGroup
    from torch.distributed import PrefixStore, rendezvous
    from torch.distributed.distributed_c10d import ProcessGroupGloo
    from vllm.distributed.utils import create_tcp_store

    connect = datetime.timedelta(seconds=min(CONNECT_TIMEOUT_S, timeout_s))
    if listen is not None:
        store = create_tcp_store(address, port, listen_socket=listen, world_size=world_size, is_master=True,
                                 timeout=connect, multi_tenant=True)
    else:
        store, rank, world_size = next(rendezvous(f"tcp://{address}:{port}", rank, world_size, timeout=connect))
    timeout = datetime.timedelta(seconds=timeout_s)
    store.set_timeout(timeout)
    prefixed = PrefixStore(store_prefix(secret), store)
    opts = ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [ProcessGroupGloo.create_device(hostname=address if listen is not None
                                                    else local_address(address, port))]
    # vllm.distributed.utils.init_gloo_process_group, with this device (the default one binds where the host name
    # resolves, which need not be the interface the group meets on)
    group, backend = ProcessGroup(prefixed, rank, world_size), ProcessGroupGloo(prefixed, rank, world_size, opts)
    group._set_default_backend(ProcessGroup.BackendType.GLOO)
    backend._set_sequence_number_for_group()
    group._register_backend(torch.device("cpu"), ProcessGroup.BackendType.GLOO, backend)
    return group


def _post(group: Any, tensor: torch.Tensor) -> Any:
    """Post a broadcast from rank 0 (sent from `tensor` on rank 0, received into it elsewhere); its Work. Posted
    ops run in posting order on every rank."""
    opts = torch.distributed.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    return group.broadcast([tensor], opts)


def _broadcast(group: Any, tensor: torch.Tensor) -> None:
    _post(group, tensor).wait()


class GlooWeightTransferEngine(WeightTransferEngine[GlooWeightTransferInitInfo, GlooWeightTransferUpdateInfo]):
    """Worker side: receives each chunk by broadcast from rank 0 and loads it through vLLM's layerwise reload
    (started by `start_weight_update`, finalized by `finish_weight_update`): on CPU that pipeline re-packs the
    oneDNN weights, which a plain `model.load_weights` after start-up does not."""

    init_info_cls = GlooWeightTransferInitInfo
    update_info_cls = GlooWeightTransferUpdateInfo
    checks_finite = True  # before loading any of a chunk (forkrl/weights/guard.py leaves it alone)

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: Any = None
        self.secret = ""  # the group's (init info): the chunks' digests are keyed with it
        self.in_update = False  # between start_weight_update and finish (or abort)
        self._ahead: tuple[list[Spec], list[torch.Tensor], Future[str]] | None = None  # the next chunk, posted

    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
        self.shutdown()  # a new trainer connection replaces the last one
        pc = self.parallel_config
        rank = pc.data_parallel_index * pc.world_size + pc.rank + init_info.rank_offset
        if rank >= init_info.world_size:
            raise ValueError(f"this worker's rank {rank} is outside world_size {init_info.world_size}")
        self.group = _join(init_info.master_address, init_info.master_port, rank, init_info.world_size,
                           init_info.timeout_s, init_info.secret)
        self.secret = init_info.secret

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)
        self.in_update = True

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # vLLM's base class also calls torch.accelerator.synchronize(), which raises on a CPU-only machine; every
        # broadcast this chunk needs is waited for here, so there is nothing to synchronize
        self.receive_weights(self.parse_update_info(update_info))

    def _post_all(self, specs: list[Spec]) -> tuple[list[torch.Tensor], Future[str]]:
        """Post the receives of a chunk; its tensors and the digest of what they receive (hashed as they arrive)."""
        tensors = [torch.empty(shape, dtype=DTYPES[dtype]) for _, dtype, shape in specs]
        return tensors, digest_behind(self.secret, specs, tensors, [_post(self.group, t) for t in tensors])

    def receive_weights(self, update_info: GlooWeightTransferUpdateInfo) -> None:
        """Receive the chunk's tensors (posted by the previous chunk when it announced this one), while the next
        chunk's receives (`next`) run behind them; then check the chunk's digest (TamperedWeights) and that every
        tensor is finite in the served dtype (NonFiniteWeights, naming the first bad one), and load it: a chunk
        that fails a check is received whole and none of it is loaded."""
        if self.group is None:
            raise RuntimeError("gloo weight transfer is not initialized (init_weight_transfer_engine first)")
        specs = update_info.specs()
        if self._ahead is not None:
            announced, tensors, received = self._ahead
            self._ahead = None
            if announced != specs:
                self.shutdown()  # receives are posted for other tensors: the group is out of step
                raise RuntimeError("the chunk is not the one the previous chunk announced; the group is dropped")
        else:
            tensors, received = self._post_all(specs)
        if update_info.next and not update_info.discard:
            following = update_info.next_specs()
            self._ahead = (following, *self._post_all(following))
        digest = received.result()  # every receive of the chunk completed
        if update_info.discard:
            return
        check_digest(digest, update_info.digest, specs)
        served = served_dtype(self)
        for (name, _, _), t in zip(specs, tensors, strict=True):
            if not is_finite(t, served):
                raise NonFiniteWeights(f"tensor {name!r} holds NaN or inf values (in its dtype or the served "
                                       f"{served}); none of the chunk was loaded")
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        with disable_mtp_completeness_check():
            self.model.load_weights(iter([(name, t) for (name, _, _), t in zip(specs, tensors, strict=True)]))

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        if self._ahead is not None:
            raise RuntimeError("the update finished with a chunk announced and never sent")
        finalize_layerwise_reload(self.model, self.model_config)
        self.in_update = False

    def abort_weight_update(self) -> None:
        """End an update that will not finish: vLLM's finalize puts the kept tensors back in every layer that got
        nothing (a model with a layer left on the meta device cannot run); layers that were loaded keep theirs.
        Receives posted ahead cannot be taken back: the group is dropped (the trainer forms it again)."""
        if self._ahead is not None:
            self._ahead = None
            self.shutdown()
        if self.in_update:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)
            self.in_update = False

    def shutdown(self) -> None:
        group, self.group, self._ahead, self.secret = self.group, None, None, ""
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
        self.secret = ""  # this group's, drawn in trainer_init; reaches the workers only through `client`
        self.last_stats: dict[str, float] = {}  # of the last send: bytes, groups, peak_held_bytes

    @classmethod
    def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client: VLLMWeightSyncClient,
                     source: WeightSource | None = None) -> GlooTrainerWeightTransferEngine:
        if source is None:
            raise ValueError("the gloo trainer weight transfer needs a WeightSource")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        if not engine.is_sender:
            return engine
        # bound to the given address only (an IPv6 one too), never every interface
        family = socket.AF_INET6 if ":" in init_info.master_address else socket.AF_INET
        listen = socket.create_server((init_info.master_address, init_info.master_port), family=family)
        engine.port = listen.getsockname()[1]
        engine.secret = new_secret()
        worker_info = {"master_address": init_info.master_address, "master_port": engine.port, "rank_offset": 1,
                       "world_size": init_info.world_size, "timeout_s": init_info.timeout_s,
                       "secret": engine.secret}
        joined: list[Any] = []

        def join() -> None:
            try:
                joined.append(_join(init_info.master_address, engine.port, 0, init_info.world_size,
                                    init_info.timeout_s, engine.secret, listen=listen))
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
        """start -> one update_weights per layerwise group, concurrent with its broadcast -> finish. Pipelined:
        group g's broadcasts are posted before group g-1's update returns (the workers posted g's receives when
        g-1 announced it), so g travels while the workers load g-1; g's digest is computed while it travels, and
        goes with g's update_weights. Every rank iterates the whole source even
        after an error (the others are in its gathers); the error is raised after."""
        assert self.source is not None
        source = self.source
        if not self.is_sender:
            for _ in source.iter_groups():
                pass
            return
        assert self.group is not None, "trainer_init() first"
        meta = {m.name: m for m in source.metadata()}
        order = source.groups()

        def chunk(g: int) -> dict[str, Any]:
            names = order[g]
            return {"names": list(names), "dtype_names": [str(meta[n].dtype).removeprefix("torch.") for n in names],
                    "shapes": [list(meta[n].shape) for n in names]}

        self.client.start_weight_update()
        error: BaseException | None = None
        sent = held = groups = 0  # held: the most bytes of gathered groups alive at once (this one + the last)
        rpc = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forkrl-gloo-rpc")
        previous: tuple[Any, list[Any], list[torch.Tensor], int] | None = None  # call, works, tensors, bytes
        try:
            for g, (_, tensors) in enumerate(source.iter_groups()):  # each rank materializes the group here
                groups += 1
                nbytes = sum(t.numel() * t.element_size() for t in tensors)
                if error is not None:
                    del tensors
                    continue
                try:
                    info = chunk(g) | {"next": chunk(g + 1) if g + 1 < len(order) else None}
                    # detached: the live parameters' storage, outside autograd (a broadcast is no op of the graph)
                    tensors = [t.detach().contiguous() for t in tensors]
                    works = [_post(self.group, t) for t in tensors]
                    info["digest"] = chunk_digest(self.secret, _specs(info["names"], info["dtype_names"],
                                                                      info["shapes"]), tensors)
                    if previous is None:
                        call = rpc.submit(self.client.update_weights, info)
                    held = max(held, nbytes + (previous[3] if previous is not None else 0))
                    if previous is not None:
                        previous[0].result()  # the workers loaded g-1 (and posted g's receives before)
                        for w in previous[1]:
                            w.wait()
                        sent += previous[3]
                        call = rpc.submit(self.client.update_weights, info)
                    previous = (call, works, tensors, nbytes)
                except BaseException as e:  # noqa: BLE001 - raised once every rank is through the source
                    error = e
                del tensors
            if error is None and previous is not None:
                previous[0].result()
                for w in previous[1]:
                    w.wait()
                sent += previous[3]
        except BaseException as e:  # noqa: BLE001
            error = error or e
        finally:
            previous = None
            rpc.shutdown(wait=False)  # never wait on a call whose broadcast peer may be gone
        self.last_stats = {"bytes": float(sent), "groups": float(groups), "peak_held_bytes": float(held)}
        if error is not None:
            raise error
        self.client.finish_weight_update(weight_version)

    def shutdown(self) -> None:
        group, self.group, self.secret = self.group, None, ""
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
