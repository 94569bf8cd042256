"""A deadline on the NCCL weight transfer's blocking calls: past it, the communicator is aborted.

vLLM's NCCL weight transfer (vllm/distributed/weight_transfer/nccl_engine.py) has no timeout of its own: a worker
receiving a chunk blocks in the packed consumer's `stream.synchronize()` (holding the engine's thread) until the
trainer's broadcast arrives, and the trainer's packed producer blocks the same way until every worker joined. A peer
that died or refused the chunk leaves the other side there for good. gloo's groups take a timeout (forkrl/weights/
transfer_gloo.py); NCCL's only way out of a pending operation is `ncclCommAbort` from another thread, which ends the
communicator's operations in flight: the blocked call returns (with an error) and the communicator is gone (both
sides form the group again: InitWeightTransfer).

`call_with_deadline` runs a blocking call with a timer that aborts (`abort_communicator`) when it fires, and then
raises `TransferDeadline` naming what timed out. The worker side wraps the NCCL engine's `receive_weights`
(`bound_receives`, installed by rollout_service/worker_ext.py), the trainer side its `send_weights`
(forkrl/training/rollouts.py). Not run on a GPU yet (docs/scaling.md, "GPU settings"): the abort ending a pending
`synchronize()` is NCCL's documented behaviour, read, not measured here.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

log = logging.getLogger("forkrl.weights")
T = TypeVar("T")


class TransferDeadline(TimeoutError):
    """A weight-transfer call outlived its deadline; the communicator was aborted (the group must be formed anew)."""


def call_with_deadline(fn: Callable[[], T], deadline_s: float, abort: Callable[[], None], what: str) -> T:
    """`fn()`, but when it has not returned after `deadline_s` seconds, `abort()` runs (from a timer thread) and
    `TransferDeadline` is raised once `fn` returns or fails; an error of `fn` that came after the abort is chained."""
    if not deadline_s > 0:
        raise ValueError(f"deadline_s must be > 0, got {deadline_s}")
    expired = threading.Event()

    def fire() -> None:
        expired.set()
        log.error("%s: nothing completed within %g s: aborting the NCCL communicator", what, deadline_s)
        try:
            abort()
        except Exception:  # noqa: BLE001 - the abort is best effort; the caller still sees TransferDeadline
            log.exception("aborting the communicator failed")

    timer = threading.Timer(deadline_s, fire)
    timer.daemon = True
    timer.start()
    message = f"{what} did not complete within {deadline_s:g} s; the NCCL communicator was aborted"
    try:
        result = fn()
    except BaseException as e:
        if expired.is_set():
            raise TransferDeadline(message) from e
        raise
    finally:
        timer.cancel()
    if expired.is_set():  # returned, but the communicator is gone: what it received is not to be trusted
        raise TransferDeadline(message)
    return result


def abort_communicator(group: Any) -> None:
    """`ncclCommAbort` on vLLM's PyNcclCommunicator `group` (None: nothing to abort), which ends its operations in
    flight, and mark it disabled so that its `destroy()` does not abort it twice."""
    if group is None or getattr(group, "disabled", False):
        return
    group.nccl.ncclCommAbort(group.comm)
    group.available, group.disabled = False, True


def bound_receives(engine: Any, deadline_s: float) -> None:
    """Give the NCCL weight-transfer `engine` (a worker's vLLM NCCLWeightTransferEngine) a deadline on every
    `receive_weights`: past `deadline_s` its communicator is aborted and the receive raises `TransferDeadline`
    (vLLM's worker then ends the update with that error, and the engine's thread is free)."""
    receive = type(engine).receive_weights

    def receive_weights(update_info: Any) -> None:
        call_with_deadline(lambda: receive(engine, update_info), deadline_s,
                           lambda: abort_communicator(engine.model_update_group),
                           f"receiving {len(getattr(update_info, 'names', []))} tensor(s) from the trainer")

    engine.receive_weights = receive_weights


def bound_send(engine: Any, client: Any, deadline_s: float) -> None:
    """Give the trainer's NCCL weight-transfer `engine` (vLLM's NCCLTrainerWeightTransferEngine, driving the services
    through `client`) a deadline on every `send_weights`, and abort its communicator as soon as `client.update_weights`
    fails (a service refused or failed the chunk: its workers never join the broadcast the engine blocks in). The
    send then raises that failure (the service's error, e.g. INVALID_ARGUMENT) rather than NCCL's."""
    send = type(engine).send_weights
    update = client.update_weights
    failures: list[BaseException] = []

    def abort() -> None:
        abort_communicator(engine.model_update_group)

    def update_weights(update_info: Any) -> None:
        try:
            update(update_info)
        except BaseException as e:
            failures.append(e)
            abort()
            raise

    def send_weights() -> None:
        failures.clear()
        try:
            call_with_deadline(lambda: send(engine), deadline_s, abort, "sending the weights to the rollout services")
        except BaseException as e:
            if failures and failures[0] is not e:
                raise failures[0] from e
            raise

    client.update_weights = update_weights
    engine.send_weights = send_weights
