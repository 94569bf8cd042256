"""The rollout engine's vocabulary: errors, the records passed between server, engine and backend, and
the `Backend` protocol.

Each error class is one gRPC status code (`server.py` maps them), so the engine and the backends say what
went wrong without importing grpc. `Backend` is what `RolloutEngine` needs from an inference engine:
`VllmBackend` in production, a fake in the server-plumbing tests.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from rollout_service.gate import SwapGate


# ---------------------------------------------------------------------------------------------- errors
class RolloutError(Exception):
    """An error the caller can act on; `server.py` maps each subclass to a gRPC status code."""


class InvalidArgument(RolloutError):
    """INVALID_ARGUMENT"""


class NotFound(RolloutError):
    """NOT_FOUND"""


class StaleVersion(RolloutError):
    """ABORTED"""


class ChecksumMismatch(RolloutError):
    """DATA_LOSS"""


class Unavailable(RolloutError):
    """UNAVAILABLE"""


class FailedPrecondition(RolloutError):
    """FAILED_PRECONDITION"""


class ResourceExhausted(RolloutError):
    """RESOURCE_EXHAUSTED"""


class PermissionDenied(RolloutError):
    """PERMISSION_DENIED"""


# ------------------------------------------------------------------------------------------ core types
@dataclass
class SamplingSpec:
    n: int
    temperature: float
    max_new_tokens: int
    top_p: float | None = None
    stop: list[str] = field(default_factory=list)
    seed: int | None = None


@dataclass
class Completion:
    """What the backend returns for one finished engine request."""

    token_ids: list[int]
    text: str
    logprobs: list[float]
    finish_reason: str  # "stop" | "length" | "abort"


@dataclass
class Sample:
    prompt_index: int
    sample_index: int
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    completion_text: str
    logprobs: list[float]
    finish_reason: str
    policy_version: int  # served when the sample was submitted: no newer than its first token's weights
    last_policy_version: int  # served when it finished: no older than its last token's (== in drain mode)


@dataclass
class Counters:
    requests: int = 0
    samples: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    aborted_requests: int = 0
    weight_reloads: int = 0
    rejected_weight_updates: int = 0
    running_requests: int = 0


@dataclass
class SwapResult:
    version: int
    apply_s: float
    drain_s: float
    receive_s: float = 0.0
    bytes_received: int = 0


# ------------------------------------------------------------------------------------------- backend
class Backend(Protocol):
    """What RolloutEngine needs from an inference engine (VllmBackend; a fake in plumbing tests)."""

    model: str
    vocab_size: int  # tokenizer length (reported)
    vocab_limit: int  # ids must be < this (max of tokenizer length and the model's vocab_size)
    eos_token_id: int
    max_model_len: int
    engine_settings: dict[str, Any]

    def encode(self, text: str) -> list[int]: ...
    async def generate_one(
        self, request_id: str, prompt_ids: list[int], spec: SamplingSpec, seed: int | None
    ) -> Completion: ...
    async def abort(self, request_ids: list[str]) -> None: ...
    async def reload(
        self, path: str, *, keep_running: bool = False, before_resume: Callable[[], None] | None = None
    ) -> None:
        """Apply the weights at `path`. keep_running: between two engine steps, with the requests in flight
        kept scheduled (they continue under the new weights); before_resume runs once the weights are in
        place, before the engine steps again."""
        ...
    # vLLM's weight-transfer API (rollout_service/transfer.py); engine_settings["weight_transfer_backend"] names
    # the backend ("" when the engine has none)
    async def init_weight_transfer(self, init_info: dict[str, Any]) -> None: ...
    async def start_weight_update(self) -> None:
        """Pause generation between two engine steps (requests in flight kept), then start the update."""
        ...
    async def update_weights(self, update_info: dict[str, Any]) -> None: ...
    async def finish_weight_update(self, version: int, before_resume: Callable[[], None]) -> None:
        """Finish the update, run `before_resume` (the version commits), resume generation."""
        ...
    async def abort_weight_update(self) -> None:
        """End an update without finishing it, resume generation."""
        ...
    async def shutdown_weight_transfer(self) -> None: ...
    def num_unfinished(self) -> int: ...
    def errored(self) -> bool: ...
    def shutdown(self) -> None: ...


# ------------------------------------------------------------------------------------------- push target
class PushTarget(Protocol):
    """What a weight push (rollout_service/transfer.py) needs of the engine it pushes into (RolloutEngine): the
    backend, the lease and version rules, the one lock every push holds, the serving state and the swap gate. The
    transfer code depends on this, not on engine.py, so the two modules import in one direction only."""

    backend: Backend
    counters: Counters
    apply_lock: asyncio.Lock
    gate: SwapGate
    broken: str | None
    swap_mode: str
    drain_timeout_s: float
    specs: dict[str, Any]
    ignorable: set[str]

    def lease(self) -> tuple[str, float]: ...
    def check_push(self, run_id: str, target_version: int) -> None: ...
    def take_lease(self, run_id: str) -> None: ...
    def commit(self, target_version: int) -> None: ...
    def abort_for_swap(self) -> None: ...
    async def mark_broken(self, why: str) -> None: ...
    async def set_serving(self, serving: bool) -> None: ...
