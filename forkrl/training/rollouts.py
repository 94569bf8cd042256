"""The trainer's side of the rollout services: prompts spread over one or more of them, weights pushed to all.

    rollouts = Rollouts(["127.0.0.1:50051", "127.0.0.1:50061"])
    rollouts.wait_ready()
    groups = rollouts.generate(prompts, n=8, temperature=1.0, max_new_tokens=32, seed=run_seed("gen", 0, 1, 0))
    rollouts.push(model, version=1, mode="stream", run_dir=run_dir)     # every service reports version 1

Sampling seeds follow the global prompt index (`prompt_offsets`), so the trajectories do not depend on how many
services share the prompts. A push either streams the state dict (UpdateWeights) or writes one safetensors file
into the run dir that every service loads (LoadWeights).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from forkrl.clients.rollout import RolloutClient
from forkrl.files import atomic_write
from forkrl.training.config import WeightSync


class Rollouts:
    """Spreads prompts over one or more rollout services and pushes weights to all of them."""

    def __init__(self, addresses: list[str], token: str | None = None) -> None:
        """`token`: the services' bearer token (None: from the environment, forkrl.security.load_token)."""
        self.clients = [RolloutClient(a, token=token) for a in addresses]
        self.pool = ThreadPoolExecutor(max_workers=len(self.clients))
        # of the last push, the slowest service's: seconds it waited for in-flight samples (drain) and applied
        # the weights; new samples wait at its gate for drain + apply (the stall of generation per push)
        self.last_swap: dict[str, float] = {}

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        for c in self.clients:
            c.wait_ready(timeout_s)

    def generate(self, prompts: list[str], n: int, temperature: float, max_new_tokens: int,
                 seed: int) -> list[list[Any]]:
        """Trajectories grouped by prompt: result[i] holds the n samples of prompts[i] in sample order."""
        shards = [list(range(j, len(prompts), len(self.clients))) for j in range(len(self.clients))]

        def run(j: int) -> list[tuple[int, Any]]:
            idx = shards[j]
            if not idx:
                return []
            out = []
            # seeds per global prompt index: the result does not depend on how prompts are sharded
            for t in self.clients[j].generate([prompts[i] for i in idx], n=n, temperature=temperature,
                                              max_new_tokens=max_new_tokens, seed=seed, prompt_offsets=idx):
                out.append((idx[t.prompt_index], t))
            return out

        groups: list[list[Any]] = [[None] * n for _ in prompts]
        for part in self.pool.map(run, range(len(self.clients))):
            for i, t in part:
                groups[i][t.sample_index] = t
        missing = sum(t is None for g in groups for t in g)
        if missing:
            raise RuntimeError(f"rollout returned {missing} fewer trajectories than asked")
        return groups

    def version(self) -> int:
        return max(c.info().version for c in self.clients)

    def serve_initial(self, model_dir: str) -> bool:
        """True when every service still serves the checkpoint it started with and that is `model_dir`."""
        want = Path(model_dir).resolve()
        return all(i.version == 0 and Path(i.model).resolve() == want for i in (c.info() for c in self.clients))

    def push(self, model: torch.nn.Module | dict[str, torch.Tensor], version: int, mode: WeightSync,
             run_dir: Path) -> float:
        """Send the weights (a model, or its full state dict) as `version` to every service; returns the
        seconds it took."""
        items = model.items() if isinstance(model, dict) else model.state_dict().items()
        state = {k: v.detach() for k, v in items}
        t0 = time.perf_counter()
        if mode == "path":
            from safetensors.torch import save

            sync = run_dir / "weights_sync"
            sync.mkdir(parents=True, exist_ok=True)
            blob = save({k: v.contiguous() for k, v in untie(state).items()})
            atomic_write(sync / "model.safetensors", blob)
            versions = list(self.pool.map(lambda c: c.load_weights(str(sync), version), self.clients))
        else:
            versions = list(self.pool.map(lambda c: c.update_weights(state, version), self.clients))
        if any(v != version for v in versions):
            raise RuntimeError(f"rollout services report versions {versions} after pushing version {version}")
        elapsed = time.perf_counter() - t0
        resps = [c.last_weights_response for c in self.clients]
        self.last_swap = {"swap_drain_s": max(r.drain_s for r in resps),
                          "swap_apply_s": max(r.apply_s for r in resps)}
        return elapsed


def untie(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop tensors that share storage with an earlier one (tied embeddings) — safetensors refuses them."""
    seen, out = set(), {}
    for k, v in state.items():
        key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape))
        if key not in seen:
            seen.add(key)
            out[k] = v
    return out
