"""The trainer's side of the rollout services: prompts spread over one or more of them, weights pushed to all.

    rollouts = Rollouts(["127.0.0.1:50051", "127.0.0.1:50061"], run_id="20261201-...")
    rollouts.wait_ready()
    rollouts.adopt(version=0)              # the trainer's version of what every service serves now
    groups = rollouts.generate(prompts, n=8, temperature=1.0, max_new_tokens=32, seed=run_seed("gen", 0, 1, 0))
    rollouts.push(model, version=1, mode="stream", run_dir=run_dir)     # every service serves version 1
    rollouts.restore(model, version=1, ...)   # after a rollout restart: wait for health, push the weights again
    rollouts.release()                        # the run ended: give up the rollout lease

Sampling seeds follow the global prompt index (`prompt_offsets`), so the trajectories do not depend on how many
services share the prompts. A push either streams the state dict (UpdateWeights) or writes one safetensors file
into the run dir that every service loads (LoadWeights).

Versions: each service numbers the weights it serves itself (a push must be its served version + 1, and a
restarted service starts again at 0), the trainer numbers its policies. `Rollouts` maps one to the other per
service: every trajectory returned carries the *trainer's* version of the weights that sampled it, or -1 when
the service's version is none this run pushed there (a restarted service serving its initial weights again, or
weights someone else pushed). Pushes carry the run id, which takes the services' lease (rollout_service/engine.py).
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

    def __init__(self, addresses: list[str], token: str | None = None, run_id: str = "") -> None:
        """`token`: the services' bearer token (None: from the environment, forkrl.security.load_token). `run_id`:
        sent with every push (the lease)."""
        # no waiting on a dead service until the deadline: the loop waits for health SERVING itself (bounded)
        self.clients = [RolloutClient(a, token=token, wait_for_ready=False) for a in addresses]
        self.run_id = run_id
        # per service: its version -> the trainer's version of the same weights (see the module docstring)
        self.versions: list[dict[int, int]] = [{} for _ in self.clients]
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
                if self.versions[j]:  # the trainer's numbering (as is before adopt(): nothing to map yet)
                    t.policy_version = self.versions[j].get(t.policy_version, -1)
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

    def adopt(self, version: int) -> None:
        """What every service serves now is the trainer's `version` (at the start of a run)."""
        self.versions = [{c.info().version: version} for c in self.clients]

    def lost(self) -> list[int]:
        """Indices of the services that no longer serve the weights this run last pushed there (restarted)."""
        out = []
        for j, c in enumerate(self.clients):
            served = c.info().version
            if self.versions[j] and (served not in self.versions[j] or served < max(self.versions[j])):
                out.append(j)
        return out

    def restore(self, model: torch.nn.Module | dict[str, torch.Tensor], version: int, mode: WeightSync,
                run_dir: Path, wait_s: float) -> list[int]:
        """After a fault (UNAVAILABLE, a foreign sample): wait up to `wait_s` for every service to be SERVING, then
        push `version` again to those that lost it. Returns their indices."""
        self.wait_ready(wait_s)
        lost = self.lost()
        if lost:
            self.push(model, version, mode, run_dir, only=lost)
        return lost

    def release(self) -> None:
        """Give up the lease on every service (the run ended); a service that is gone is skipped."""
        for c in self.clients:
            try:
                c.release_lease(self.run_id, timeout_s=5.0)
            except Exception:  # noqa: BLE001 - best effort: the lease expires by itself
                pass

    def serve_initial(self, model_dir: str) -> bool:
        """True when every service still serves the checkpoint it started with and that is `model_dir`."""
        want = Path(model_dir).resolve()
        return all(i.version == 0 and Path(i.model).resolve() == want for i in (c.info() for c in self.clients))

    def push(self, model: torch.nn.Module | dict[str, torch.Tensor], version: int, mode: WeightSync,
             run_dir: Path, only: list[int] | None = None) -> float:
        """Send the weights (a model, or its full state dict) as the trainer's `version` to every service (or those
        in `only`), each as its served version + 1; returns the seconds it took."""
        items = model.items() if isinstance(model, dict) else model.state_dict().items()
        state = {k: v.detach() for k, v in items}
        t0 = time.perf_counter()
        if mode == "path":
            from safetensors.torch import save

            sync = run_dir / "weights_sync"
            sync.mkdir(parents=True, exist_ok=True)
            blob = save({k: v.contiguous() for k, v in untie(state).items()})
            atomic_write(sync / "model.safetensors", blob)

        def one(j: int) -> None:
            c = self.clients[j]
            target = c.info().version + 1
            if mode == "path":
                got = c.load_weights(str(run_dir / "weights_sync"), target, run_id=self.run_id)
            else:
                got = c.update_weights(state, target, run_id=self.run_id)
            if got != target:
                raise RuntimeError(f"rollout service {c.address} reports version {got} after a push of {target}")
            if target == 1 or target - 1 not in self.versions[j]:
                self.versions[j] = {}  # a restarted service: its old numbers now name other weights
            self.versions[j][target] = version

        which = list(range(len(self.clients))) if only is None else only
        list(self.pool.map(one, which))
        elapsed = time.perf_counter() - t0
        resps = [self.clients[j].last_weights_response for j in which]
        self.last_swap = {"swap_drain_s": max((r.drain_s for r in resps if r is not None), default=0.0),
                          "swap_apply_s": max((r.apply_s for r in resps if r is not None), default=0.0)}
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
