"""The transfer route's trainer side (forkrl/training/rollouts.py, "--weight-sync transfer"): its backend, its
rendezvous address, the source that walks the live model in step on every rank, vLLM's NCCL engine with a deadline,
and the checks made before a push: a service on this trainer's own GPU (NCCL refuses two ranks of one group on one
GPU), and the wait for the optimizer's kernels before vLLM's producer reads the parameters on its own streams.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

TRANSFER_ADDRESS_ENV = "TRAINER_TRANSFER_ADDRESS"


def trainer_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


class TransferUnavailable(Exception):
    """The transfer route cannot be used with these services (auto falls back to the other routes)."""


def transfer_address() -> tuple[str, int]:
    """(host, port) of the transfer route's rendezvous from TRAINER_TRANSFER_ADDRESS ("host" or "host:port"; port 0
    or none: a free one); default 127.0.0.1. The store listens on that address only, and the services connect to
    it: 0.0.0.0 / [::] (every interface, and no address to connect to) is refused."""
    value = os.environ.get(TRANSFER_ADDRESS_ENV, "").strip() or "127.0.0.1"
    if value.startswith("["):  # [IPv6] or [IPv6]:port
        host, _, rest = value[1:].partition("]")
        port = rest.removeprefix(":")
    elif value.count(":") == 1:
        host, port = value.split(":")
    else:  # a name, an IPv4 address, or a bare IPv6 address
        host, port = value, ""
    try:
        number = int(port or 0)
    except ValueError:
        raise ValueError(f"{TRANSFER_ADDRESS_ENV} must be host or host:port, got {value!r}") from None
    if not 0 <= number < 65536:
        raise ValueError(f"{TRANSFER_ADDRESS_ENV}: port must be in [0, 65535], got {number}")
    try:
        unspecified = ipaddress.ip_address(host).is_unspecified
    except ValueError:  # a host name
        unspecified = False
    if unspecified:
        raise ValueError(f"{TRANSFER_ADDRESS_ENV} must be an address of this host the rollout services can reach (the "
                         f"weight channel listens there only), got {host!r}, every interface")
    return host, number


def lockstep_source(module: torch.nn.Module, on_transfer: Callable[[], None]) -> Any:
    """vLLM's ModuleSource over `module` that calls `on_transfer` when an iteration begins: the other ranks of a
    sharded model then join the gathers of exactly the iterations rank 0 runs (once the services accepted the
    push). The same order on every rank: named_parameters(), one all-gather per parameter."""
    from vllm.distributed.weight_transfer.base import ModuleSource

    class LockstepSource(ModuleSource):
        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            on_transfer()
            yield from super().__iter__()

    return LockstepSource(module)


def join_transfer(module: torch.nn.Module) -> None:
    """A rank > 0 of a sharded trainer, told "transfer" by rank 0: take part in the gathers of rank 0's push (the
    same iteration, every parameter all-gathered in turn and dropped)."""
    for _ in lockstep_source(module, lambda: None):
        pass


def nccl_engine(host: str, port: int, world_size: int, sync: Any, source: Any) -> Any:
    """vLLM's own NCCL trainer engine (GPU): the same client and source; its rendezvous needs a fixed port. Its sends
    get a deadline, and a service that refuses or fails a chunk (its workers then never join the broadcast) aborts
    the communicator at once; the push then raises that service's error (forkrl/weights/deadline.py)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

    from forkrl.weights.deadline import bound_send
    from forkrl.weights.transfer_gloo import TIMEOUT_S

    if not port:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
    engine = WeightTransferTrainerFactory.trainer_init(NCCLTrainerInitInfo(host, port, world_size, rank=0),
                                                       client=sync, source=source)
    engine.port = port
    bound_send(engine, sync, TIMEOUT_S)
    return engine


def _uuid(u: str) -> str:
    # NVML says "GPU-8f6c...", torch's device properties "8f6c...": compare the hex digits
    return u.lower().removeprefix("gpu-")


def own_gpu_uuid() -> str | None:
    """The UUID of this process's current CUDA device (the sender's, on rank 0), None without CUDA."""
    if not torch.cuda.is_available():
        return None
    return str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)


def shared_gpu(own: str | None, addresses: Sequence[str], gpu_uuids: Sequence[Sequence[str]]) -> str | None:
    """Why the nccl transfer cannot work when a service (its `gpu_uuids`, GetInfo) runs on this trainer's GPU `own`;
    None when none does (or a side cannot tell)."""
    if not own:
        return None
    for address, uuids in zip(addresses, gpu_uuids, strict=True):
        if _uuid(own) in {_uuid(u) for u in uuids}:
            return (f"rollout service {address} runs on this trainer's GPU ({own}): NCCL refuses two ranks of one "
                    "group on one GPU, so the nccl weight transfer needs the rollout on other GPUs; use "
                    "--weight-sync shm (or auto, which picks it) on one GPU")
    return None


def wait_for_updates(module: torch.nn.Module) -> None:
    """Before a send that reads `module`'s parameters on other CUDA streams (vLLM's packed producer packs them on
    its own): wait for the work queued on the current stream, opt.step() included, to finish."""
    p = next(module.parameters(), None)
    if p is not None and p.device.type == "cuda":
        torch.cuda.current_stream(p.device).synchronize()
