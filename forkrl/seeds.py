"""Every seed forkrl derives, in one place.

Each function hashes its parts and keeps 62–63 bits. The formats are frozen: a recorded run (its data
order, its samples, its probe selections) reproduces only while these return the same integers, which
`tests/unit/test_seeds.py` pins with golden values. Add a new function rather than change one.

- `run_seed(*parts)`: the trainer's seeds — data order per epoch ("data", seed, epoch), generation
  rounds ("gen", seed, step, round), evaluation ("eval", seed) and the torch init ("torch", seed).
- `sample_seed(seed, prompt_index, sample_index)`: the engine seed of one sample. It depends on the
  *global* prompt index, so prompts sharded over several rollout services sample identically.
- `seeded_generator(seed, *parts)`: a private CPU `torch.Generator` per purpose (probe bins, position
  selection, random rows), so two jobs in one process never share RNG state.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["generator_seed", "run_seed", "sample_seed", "seeded_generator"]

_INT63 = (1 << 63) - 1


def run_seed(*parts: Any) -> int:
    """sha256 of the ':'-joined parts, first 8 bytes big-endian, shifted to 62 bits."""
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 2


def sample_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    """blake2b-64 of 'seed:prompt:sample', little-endian, masked to 63 bits."""
    h = hashlib.blake2b(f"{seed}:{prompt_index}:{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & _INT63


def generator_seed(seed: int, *parts: object) -> int:
    """sha256 of the NUL-joined parts, first 8 bytes big-endian, masked to 63 bits."""
    digest = hashlib.sha256("\x00".join(map(str, (seed, *parts))).encode()).digest()
    return int.from_bytes(digest[:8], "big") & _INT63


def seeded_generator(seed: int, *parts: object) -> torch.Generator:
    """A CPU generator seeded with `generator_seed(seed, *parts)`."""
    import torch

    return torch.Generator().manual_seed(generator_seed(seed, *parts))
