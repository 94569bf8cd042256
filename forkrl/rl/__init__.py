"""The RL math: per-token entropy, the forking-token mask, advantages, the policy losses and one optimizer
step over micro-batches (algorithms.md §0–§3). Pure torch; no I/O, no transport."""
