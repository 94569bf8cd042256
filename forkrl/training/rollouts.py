"""The trainer's side of the rollout services: prompts spread over one or more of them, weights pushed to all.

    rollouts = Rollouts(["127.0.0.1:50051", "127.0.0.1:50061"], run_id="20261201-...")
    rollouts.wait_ready()
    rollouts.adopt(version=0)              # the trainer's version of what every service serves now
    groups = rollouts.generate(prompts, n=8, temperature=1.0, max_new_tokens=32, seed=run_seed("gen", 0, 1, 0))
    rollouts.push(model, version=1, mode="auto", run_dir=run_dir)       # every service serves version 1
    rollouts.push(PolicyWeights(full_state, model, on_transfer), 2, "auto", run_dir)   # a trainer on N ranks
    rollouts.restore(model, version=1, ...)   # after a rollout restart: wait for health, push the weights again
    rollouts.release()                        # the run ended: give up the rollout lease
    rollouts.close()                          # and the shared-memory weights file

Sampling seeds follow the global prompt index (`prompt_offsets`), so the trajectories do not depend on how many
services share the prompts. A push goes to every service in parallel (one thread each), by one of the
`--weight-sync` routes:
- transfer: vLLM's weight-transfer API. The services' workers join a process group with this trainer's rank 0
  (gloo on CPU, forkrl/weights/transfer_gloo.py; vLLM's nccl on a GPU) over a rendezvous this trainer serves at
  TRAINER_TRANSFER_ADDRESS (host[:port], default 127.0.0.1 and a free port: an address every rollout service can
  reach), and the weights are broadcast layer by layer from the live model (`PolicyWeights.module`): each
  layer is gathered (FSDP2: on every rank, which `PolicyWeights.on_transfer` sets going), sent and freed, so
  the whole model is never materialized on one rank;
- stream: UpdateWeights, the state streamed tensor by tensor in 4 MiB chunks (works across hosts);
- path: one safetensors file in the run dir that every service loads (LoadWeights; a shared volume);
- shm: one safetensors file in shared memory (forkrl/weights/shm.py), rewritten in place each push, loaded
  with LoadWeights: a service on this host that sees the same /dev/shm;
- auto (default): transfer when every service offers this trainer's backend (GetInfo) and none runs on this
  trainer's GPU (nccl cannot join two ranks on one GPU: the 1-GPU layout takes shm from the start); if joining the
  group fails, the routes below from then on (logged). Otherwise shm for every service whose address is on this host,
  stream for the others; a service
  that answers the shm load with NOT_FOUND or PERMISSION_DENIED (another /dev/shm: a container, another
  user) gets the same version streamed at once and is streamed to from then on, as does every service when
  the file cannot be written (the sync dir belongs to another user, shared memory is full). The route of each service
  is logged when it is chosen or changes, and counted in the step metrics (push_shm_services).

Versions: each service numbers the weights it serves itself (a push must be its served version + 1, and a
restarted service starts again at 0), the trainer numbers its policies. `Rollouts` maps one to the other per
service: every trajectory returned carries the *trainer's* version of the weights that sampled it, or -1 when
the service's version is none this run pushed there (a restarted service serving its initial weights again, or
weights someone else pushed). Pushes carry the run id, which takes the services' lease (rollout_service/engine.py).
"""

from __future__ import annotations

import functools
import logging
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import torch

from forkrl.files import atomic_write
from forkrl.remote.rollout import RolloutClient
from forkrl.training.config import WeightSync
from forkrl.training.pool import ServicePool, failover_fault, sample_groups
from forkrl.training.transfer_route import (  # noqa: F401 - join_transfer, lockstep_source: the route's API
    TRANSFER_ADDRESS_ENV,
    TransferUnavailable,
    join_transfer,
    lockstep_source,
    nccl_engine,
    own_gpu_uuid,
    shared_gpu,
    trainer_backend,
    transfer_address,
    wait_for_updates,
)
from forkrl.weights.shm import SharedWeightsFile, default_sync_dir

log = logging.getLogger("forkrl.rollouts")
# answers to a LoadWeights of the shm file that mean "this service does not see the file": stream instead
_NOT_COLOCATED = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.PERMISSION_DENIED)
# The deadline of one Generate call grows with the tokens it may generate: a fixed one (RolloutClient's default)
# ended every long-response batch that outlasted it (the DAPO recipe asks for prompts x n x 20,480 tokens) with
# DEADLINE_EXCEEDED, which fails the run. The floor rate is far below any engine's, so only a hung service reaches
# it; a dead one breaks the stream at once (UNAVAILABLE).
GENERATE_BASE_S = 600.0
PROBE_S = 2.0  # the health check of a service out of the pool, before each push
GENERATE_FLOOR_TOKENS_PER_S = 10.0


def generate_deadline_s(prompts: int, n: int, max_new_tokens: int) -> float:
    """Seconds one Generate call of `prompts` x `n` samples of up to `max_new_tokens` tokens may take."""
    return GENERATE_BASE_S + prompts * n * max_new_tokens / GENERATE_FLOOR_TOKENS_PER_S


@dataclass
class PolicyWeights:
    """The weights of a push, materialized only as the route needs them: `full_state()` gathers the whole state
    dict (on rank 0 of a sharded model: the stream, shm and path routes); the transfer route streams `module`'s
    parameters layer by layer, after calling `on_transfer()` (a multi-rank trainer tells its other ranks to join
    the gathers: forkrl/training/ranks.py)."""

    full_state: Callable[[], dict[str, torch.Tensor]]
    module: torch.nn.Module
    on_transfer: Callable[[], None] = lambda: None


class Rollouts:
    """Spreads prompts over one or more rollout services and pushes weights to all of them."""

    def __init__(self, addresses: list[str], token: str | None = None, run_id: str = "") -> None:
        """`token`: the services' bearer token (None: from the environment, forkrl.security.load_token). `run_id`:
        sent with every push (the lease)."""
        # no waiting on a dead service until the deadline: the loop waits for health SERVING itself (bounded)
        self.clients = [RolloutClient(a, token=token, wait_for_ready=False) for a in addresses]
        self.run_id = run_id
        # per service: its version -> the trainer's version of the same weights (see the module docstring)
        self.versions: list[dict[int, int]] = [{} for _ in self.clients]
        self.executor = ThreadPoolExecutor(max_workers=len(self.clients))
        self.pool = ServicePool(len(self.clients))  # the services in (sampled, pushed to) and out
        self.samples = [0] * len(self.clients)  # trajectories each service returned (a run's metrics)
        # of the last push, the slowest service's: seconds it waited for in-flight samples (drain) and applied
        # the weights; new samples wait at its gate for drain + apply (the stall of generation per push)
        self.last_swap: dict[str, float] = {}
        self.routes: list[str] = []  # of the last push: "stream", "path" or "shm" per service
        self._no_shm: set[int] = set()  # services that answered the shm load with NOT_FOUND/PERMISSION_DENIED
        self._shm: SharedWeightsFile | None = None
        self._transfer: Any = None  # the trainer's weight-transfer engine, joined with every service's workers
        self._sync: Any = None  # its RolloutWeightSync
        self._no_transfer = False  # auto: joining the group failed once; the other routes from then on
        self.last_transfer: dict[str, float] = {}  # of the last transfer push: bytes, groups, peak_held_bytes
        self.offers: list[str] | None = None  # each service's weight-transfer backend, as of adopt()
        self.shared_gpu: str | None = None  # as of adopt(): why a service on this trainer's GPU rules out nccl

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        for c in self.clients:
            c.wait_ready(timeout_s)

    def generate(self, prompts: list[str], n: int, temperature: float, max_new_tokens: int,
                 seed: int) -> list[list[Any]]:
        """Trajectories grouped by prompt: result[i] holds the n samples of prompts[i] in sample order. The prompts
        are spread over the services in the pool; a service whose call fails over (forkrl/training/pool.py) is taken
        out and its prompts asked of the others, whole groups (the samples of a failed call are never used)."""
        groups: list[list[Any]] = [[None] * n for _ in prompts]
        todo = list(range(len(prompts)))
        while todo:
            active = self.pool.active()
            shards = [(j, todo[k::len(active)]) for k, j in enumerate(active)]
            todo = []
            for (j, idx), part in zip(shards, self.executor.map(lambda s: sample_groups(
                    self.clients[s[0]], self.versions[s[0]], s[1], prompts, n, temperature, max_new_tokens, seed,
                    generate_deadline_s(len(s[1]), n, max_new_tokens)), shards),
                    strict=True):
                if isinstance(part, BaseException):
                    why = f"{part.code().name}: {part.details()}" if isinstance(part, grpc.RpcError) else str(part)
                    if not (failover_fault(part) and self.pool.drop(j, why)):
                        raise part
                    log.warning("rollout service %s is out of the pool (%s): its %d prompt(s) go to the others",
                                self.clients[j].address, why, len(idx))
                    if self.routes and self.routes[0] == "transfer":
                        self._no_transfer = True  # the group's broadcast includes it: the other routes from now on
                    todo += idx
                    continue
                for i, t in part:
                    groups[i][t.sample_index] = t
                self.samples[j] += len(part)
            todo.sort()
        return groups

    def version(self) -> int:
        return max(c.info().version for c in self.clients)

    def adopt(self, version: int) -> None:
        """What every service serves now is the trainer's `version` (at the start of a run); also notes the
        weight-transfer backend each offers (--weight-sync auto)."""
        infos = [c.info() for c in self.clients]
        self.versions = [{i.version: version} for i in infos]
        self._note_offers(infos)

    def _note_offers(self, infos: list[Any]) -> None:
        self.offers = [i.engine.weight_transfer_backend for i in infos]
        self.shared_gpu = shared_gpu(own_gpu_uuid(), [c.address for c in self.clients],
                                     [list(i.engine.gpu_uuids) for i in infos])

    def lost(self) -> list[int]:
        """Indices of the services that no longer serve the weights this run last pushed there (restarted)."""
        out = []
        for j, c in enumerate(self.clients):
            served = c.info().version
            if self.versions[j] and (served not in self.versions[j] or served < max(self.versions[j])):
                out.append(j)
        return out

    def restore(self, model: torch.nn.Module | dict[str, torch.Tensor] | PolicyWeights, version: int, mode: WeightSync,
                run_dir: Path, wait_s: float) -> list[int]:
        """After a fault (UNAVAILABLE, a foreign sample): wait up to `wait_s` for every service to be SERVING, then
        push `version` again to those that lost it or are out of the pool; they are in again once they serve it.
        Returns their indices."""
        self.wait_ready(wait_s)
        if self.offers is not None:  # a restarted service may offer another backend (or none)
            self._note_offers([c.info() for c in self.clients])
        lost = sorted(set(self.lost()) | set(self.pool.out()))
        if lost:
            self.push(model, version, mode, run_dir, only=lost)
        for j in lost:
            self.pool.readmit(j, self.versions[j].get(self.clients[j].info().version), version)
        return lost

    def pool_metrics(self) -> dict[str, float]:
        """The pool in a step's metrics: services in, failovers so far, and the trajectories each service returned."""
        return {"rollout_services_in": float(len(self.pool.active())), "rollout_failovers": float(self.pool.failovers),
                **{f"rollout_samples_{j}": float(k) for j, k in enumerate(self.samples)}}

    def release(self) -> list[str]:
        """Give up the lease on every service (the run ended). A service that is gone is skipped with a warning
        (its lease expires by itself, or it restarted without one); returns the addresses it failed on. The
        deadline is one only a hang exceeds: a slow answer is still waited for."""
        failed = []
        for c in self.clients:
            try:
                c.release_lease(self.run_id, timeout_s=60.0)
            except Exception as e:  # noqa: BLE001 - never in the way of the run's own outcome
                why = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.RpcError) else repr(e)
                log.warning("releasing the rollout lease of run %s on %s failed (%s); it expires by itself",
                            self.run_id, c.address, why)
                failed.append(c.address)
        return failed

    def serve_initial(self, model_dir: str) -> bool:
        """True when every service still serves the checkpoint it started with and that is `model_dir`."""
        want = Path(model_dir).resolve()
        return all(i.version == 0 and Path(i.model).resolve() == want for i in (c.info() for c in self.clients))

    def close(self) -> None:
        self._drop_transfer(shutdown=True)
        if self._shm is not None:
            self._shm.discard()
        self.executor.shutdown(wait=False)
        for c in self.clients:
            c.close()

    def choose_routes(self, mode: WeightSync) -> list[str]:
        """The route of each service for a push in `mode` (see the module docstring)."""
        if mode in ("stream", "path", "shm", "transfer"):
            return [mode] * len(self.clients)
        # a service on this trainer's GPU: not nccl (NCCL refuses it), the other routes from the start
        if not self._no_transfer and not self.pool.out() and self.offers is not None and \
                set(self.offers) == {trainer_backend()} and self.shared_gpu is None:
            return ["transfer"] * len(self.clients)
        sync = default_sync_dir()
        return ["shm" if sync is not None and i not in self._no_shm and is_local(c.address) else "stream"
                for i, c in enumerate(self.clients)]

    def push(self, model: torch.nn.Module | dict[str, torch.Tensor] | PolicyWeights, version: int, mode: WeightSync,
             run_dir: Path, only: list[int] | None = None) -> float:
        """Send the weights (a model, its full state dict, or PolicyWeights) as the trainer's `version` to every
        service (or those in `only`; the transfer route always sends to all: they share one broadcast) in
        parallel, each as its served version + 1; returns the seconds it took."""
        t0 = time.perf_counter()
        weights = model if isinstance(model, PolicyWeights) else None
        routes = self.choose_routes(mode)
        if routes != self.routes:
            log.info("weight sync (%s): %s", mode,
                     ", ".join(f"{c.address} {r}" for c, r in zip(self.clients, routes, strict=True)))
        if routes[0] == "transfer":
            module = weights.module if weights is not None else model
            if not isinstance(module, torch.nn.Module):
                raise ValueError("--weight-sync transfer streams a model's parameters: pass the module, not a "
                                 "state dict")
            try:
                self._push_transfer(module, version, weights.on_transfer if weights is not None else lambda: None)
                self.routes = routes
                return time.perf_counter() - t0
            except TransferUnavailable as e:
                if mode == "transfer":
                    raise RuntimeError(str(e)) from e
                log.warning("weight sync: %s; using the other routes from now on", e)
                self._no_transfer = True
                routes = self.choose_routes(mode)
        if weights is not None:
            model = weights.full_state()
        items = model.items() if isinstance(model, dict) else model.state_dict().items()
        state = {k: v.detach() for k, v in items}
        probed = self.pool.answering(self.clients, PROBE_S) if only is None else []  # out: pushed to, then in
        which = sorted(self.pool.active() + probed) if only is None else only
        file: str = ""
        if any(routes[j] == "path" for j in which):
            from safetensors.torch import save

            sync = run_dir / "weights_sync"
            sync.mkdir(parents=True, exist_ok=True)
            blob = save({k: v.contiguous() for k, v in untie(state).items()})
            atomic_write(sync / "model.safetensors", blob)
            file = str(sync)
        elif any(routes[j] == "shm" for j in which):
            sync_dir = default_sync_dir()
            if sync_dir is None:
                raise RuntimeError("--weight-sync shm needs a writable /dev/shm or FORKRL_SYNC_DIR")
            if self._shm is None:
                self._shm = SharedWeightsFile(sync_dir)
            try:
                file = str(self._shm.write(untie(state)))
            except OSError as e:  # the sync dir is not ours, or shared memory is full
                self._shm.discard()
                self._shm = None
                if mode != "auto":
                    raise
                log.warning("weight sync: cannot write %s (%s): streaming to every service from now on",
                            sync_dir, e)
                self._no_shm.update(i for i, r in enumerate(routes) if r == "shm")
                routes = ["stream"] * len(routes)

        def send(c: RolloutClient, route: str, target: int) -> int:
            if route == "stream":
                return c.update_weights(state, target, run_id=self.run_id)
            return c.load_weights(file, target, run_id=self.run_id)

        def one(j: int) -> None:
            c = self.clients[j]
            target = c.info().version + 1  # the service's own numbering (module docstring)
            try:
                got = send(c, routes[j], target)
            except grpc.RpcError as e:
                if routes[j] != "shm" or mode != "auto" or e.code() not in _NOT_COLOCATED:
                    raise
                log.info("weight sync: %s does not see %s (%s): streaming to it from now on", c.address, file,
                         e.code().name)
                self._no_shm.add(j)
                routes[j] = "stream"
                got = send(c, "stream", target)
            if got != target:
                raise RuntimeError(f"rollout service {c.address} reports version {got} after a push of {target}")
            if target == 1 or target - 1 not in self.versions[j]:
                self.versions[j] = {}  # a restarted service: its old numbers now name other weights
            self.versions[j][target] = version

        def attempt(j: int) -> BaseException | None:
            try:
                one(j)
            except BaseException as e:  # noqa: BLE001 - handed back: the pool decides
                return e
            return None

        try:
            for j, e in zip(which, list(self.executor.map(attempt, which)), strict=True):
                why = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.RpcError) else str(e)
                if e is None and j in probed:  # it serves the trainer's current version: back in
                    if self.pool.readmit(j, self.versions[j].get(max(self.versions[j], default=-1)), version):
                        log.warning("rollout service %s is back in the pool at version %d", self.clients[j].address,
                                    version)
                elif e is not None and j in probed:
                    log.warning("rollout service %s stays out of the pool: the push failed (%s)",
                                self.clients[j].address, why)
                elif e is not None and not (failover_fault(e) and self.pool.drop(j, why)):
                    raise e
                elif e is not None:
                    log.warning("rollout service %s is out of the pool: the push failed (%s)",
                                self.clients[j].address, why)
        except BaseException:
            if self._shm is not None:  # a reload may still read it: never rewrite those pages
                self._shm.discard()
                self._shm = None
            raise
        elapsed = time.perf_counter() - t0
        self.routes = routes
        resps = [self.clients[j].last_weights_response for j in which]
        self.last_swap = {"swap_drain_s": max((r.drain_s for r in resps if r is not None), default=0.0),
                          "swap_apply_s": max((r.apply_s for r in resps if r is not None), default=0.0),
                          "push_shm_services": float(routes.count("shm"))}
        return elapsed

    # ------------------------------------------------------------------------- the transfer route
    def _transfer_backend(self) -> str | None:
        """This trainer's weight-transfer backend when every service offers it now, else None."""
        want = trainer_backend()
        offered = {c.info().engine.weight_transfer_backend for c in self.clients}
        return want if offered == {want} else None

    def _push_transfer(self, module: torch.nn.Module, version: int, on_transfer: Callable[[], None]) -> None:
        """Stream `module` into every service through vLLM's weight-transfer API (the module docstring)."""
        for attempt in range(2):
            if self._transfer is None:
                self._join_transfer(module)
            sync = self._sync
            sync.targets = [c.info().version + 1 for c in self.clients]  # each service's own numbering
            self._transfer.source = lockstep_source(module, on_transfer)
            wait_for_updates(module)  # opt.step()'s kernels, before vLLM's producer reads on its own streams
            try:
                self._transfer.send_weights()
            except grpc.RpcError as e:
                sync.abort()
                self._drop_transfer(shutdown=False)
                # a service restarted since the group was formed (it has none): form it again, once
                if attempt == 0 and e.code() == grpc.StatusCode.FAILED_PRECONDITION and \
                        "InitWeightTransfer first" in (e.details() or ""):
                    continue
                raise
            except Exception as e:
                sync.abort()
                self._drop_transfer(shutdown=False)
                # the broadcast failed: a service that went away says so here (UNAVAILABLE: a rollout fault the
                # loop recovers from by waiting for it and pushing again)
                for c in self.clients:
                    try:
                        c.info(timeout_s=30)
                    except grpc.RpcError as gone:
                        raise gone from e
                raise
            break
        for j, resp in enumerate(sync.finished):
            target = sync.targets[j]
            if resp.version != target:
                raise RuntimeError(f"rollout service {self.clients[j].address} reports version {resp.version} "
                                   f"after a push of {target}")
            if target == 1 or target - 1 not in self.versions[j]:
                self.versions[j] = {}  # a restarted service: its old numbers now name other weights
            self.versions[j][target] = version
        self.last_swap = {"swap_drain_s": 0.0, "swap_apply_s": max(r.apply_s for r in sync.finished),
                          "push_shm_services": 0.0}
        self.last_transfer = dict(getattr(self._transfer, "last_stats", {}))

    def _join_transfer(self, module: torch.nn.Module) -> None:
        """Form the process group of this trainer's rank 0 and every service's workers (trainer_init)."""
        from forkrl.remote.rollout import RolloutWeightSync

        backend = self._transfer_backend()
        if backend is None:
            raise TransferUnavailable("a rollout service does not offer this trainer's weight-transfer backend")
        if backend == "nccl":  # before any NCCL call: a shared GPU fails in it as "Duplicate GPU detected"
            infos = [c.info() for c in self.clients]
            why = shared_gpu(own_gpu_uuid(), [c.address for c in self.clients],
                             [list(i.engine.gpu_uuids) for i in infos])
            if why is not None:
                raise TransferUnavailable(why)
        if backend == "nccl" and next(module.parameters()).device.type != "cuda":
            raise TransferUnavailable("the nccl weight transfer needs the model on a GPU")
        workers = [c.info().engine.weight_transfer_workers for c in self.clients]
        host, port = transfer_address()
        sync = RolloutWeightSync(self.clients, self.run_id, backend, workers)
        source = lockstep_source(module, lambda: None)
        try:
            if backend == "gloo":
                from forkrl.weights.transfer_gloo import GlooTrainerInitInfo, GlooTrainerWeightTransferEngine

                info = GlooTrainerInitInfo(host, port, 1 + sum(workers), rank=0)
                engine = GlooTrainerWeightTransferEngine.trainer_init(info, client=sync, source=source)
            else:
                engine = nccl_engine(host, port, 1 + sum(workers), sync, source)
        except (grpc.RpcError, OSError, RuntimeError, ValueError) as e:
            sync.shutdown()
            raise TransferUnavailable(f"joining the weight-transfer group at {host}:{port} ({TRANSFER_ADDRESS_ENV}) "
                                       f"failed ({type(e).__name__}: {e})") from e
        log.info("weight sync: %s weight-transfer group of this trainer and %d worker(s), rendezvous at %s:%s",
                 backend, sum(workers), host, getattr(engine, "port", port))
        self._transfer, self._sync = engine, sync

    def _drop_transfer(self, shutdown: bool) -> None:
        engine, sync, self._transfer, self._sync = self._transfer, self._sync, None, None
        if engine is not None:
            engine.shutdown()
        if sync is not None and shutdown:
            sync.shutdown()


@functools.lru_cache(maxsize=256)
def is_local(address: str) -> bool:
    """True when host:port names this host (loopback, or this host's name or one of its addresses);
    cached: the name lookup runs once per address, not per push."""
    host = address.rpartition(":")[0].strip("[]")
    if host in ("localhost", "::1") or host.startswith("127."):
        return True
    try:
        name = socket.gethostname()
        return host in {name, socket.getfqdn()} or host in {a[4][0] for a in socket.getaddrinfo(name, None)}
    except OSError:
        return False


def untie(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop tensors that share storage with an earlier one (tied embeddings) — safetensors refuses them."""
    seen, out = set(), {}
    for k, v in state.items():
        key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape))
        if key not in seen:
            seen.add(key)
            out[k] = v
    return out
