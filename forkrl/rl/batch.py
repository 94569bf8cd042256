"""The rollout batch as the train step reads it: right-padded token ids, the response mask of the targets and the
engine's log-probs (pure torch, no I/O).

    batch = build_batch(prompt_ids, completion_ids, rollout_logprobs, pad_id)
    mb = batch.slice(0, 8).to(device)          # rows 0..7, padding columns they do not need trimmed
    mb = batch.select([3, 9, 10]).to(device)   # any rows (the token-budget micro-batches: forkrl/rl/microbatch.py)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["Batch", "build_batch"]


@dataclass
class Batch:
    """Right-padded trajectories. Shapes: N sequences, L = longest prompt+completion.

    input_ids [N, L] long; attention_mask [N, L] long; response_mask [N, L-1] bool, True where the
    *target* token (input_ids[:, 1:]) is a completion token; rollout_logp [N, L-1] fp32, the engine's
    log-probs at those positions (0 elsewhere).
    """

    input_ids: Tensor
    attention_mask: Tensor
    response_mask: Tensor
    rollout_logp: Tensor

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def to(self, device: torch.device | str) -> Batch:
        return Batch(*(t.to(device, non_blocking=True) for t in
                       (self.input_ids, self.attention_mask, self.response_mask, self.rollout_logp)))

    def slice(self, start: int, stop: int) -> Batch:
        # Trim the padding columns this micro-batch does not need (saves attention and lm_head work).
        width = int(self.attention_mask[start:stop].sum(dim=1).max())
        return Batch(self.input_ids[start:stop, :width], self.attention_mask[start:stop, :width],
                     self.response_mask[start:stop, : width - 1], self.rollout_logp[start:stop, : width - 1])

    def select(self, rows: Sequence[int]) -> Batch:
        """The rows `rows` (in that order; non-empty), padding columns they do not need trimmed; a contiguous
        ascending run is `slice` (views, no copy)."""
        rows = list(rows)
        if not rows:
            raise ValueError("select needs at least one row")
        if rows == list(range(rows[0], rows[0] + len(rows))):
            return self.slice(rows[0], rows[0] + len(rows))
        idx = torch.tensor(rows, dtype=torch.long, device=self.input_ids.device)
        width = int(self.attention_mask[idx].sum(dim=1).max())
        return Batch(self.input_ids[idx, :width], self.attention_mask[idx, :width],
                     self.response_mask[idx, : width - 1], self.rollout_logp[idx, : width - 1])


def build_batch(
    prompt_ids: list[list[int]], completion_ids: list[list[int]], rollout_logprobs: list[list[float]], pad_id: int
) -> Batch:
    if not (len(prompt_ids) == len(completion_ids) == len(rollout_logprobs)):
        raise ValueError(f"got {len(prompt_ids)} prompts, {len(completion_ids)} completions and "
                         f"{len(rollout_logprobs)} logprob lists; they must match")
    if not prompt_ids:
        raise ValueError("build_batch needs at least one trajectory")
    for i, (p, c, lp) in enumerate(zip(prompt_ids, completion_ids, rollout_logprobs, strict=False)):
        if not p:
            raise ValueError(f"trajectory {i} has an empty prompt (a causal LM needs a token to condition on)")
        if len(lp) != len(c):
            raise ValueError(f"trajectory {i}: {len(c)} completion tokens but {len(lp)} logprobs")
    plen = torch.tensor([len(p) for p in prompt_ids])
    clen = torch.tensor([len(c) for c in completion_ids])
    width = int((plen + clen).max())
    # one tensor per field from Python lists (a per-row slice assignment costs more than the row's numbers)
    input_ids = torch.tensor([[*p, *c] + [pad_id] * (width - len(p) - len(c))
                              for p, c in zip(prompt_ids, completion_ids, strict=True)], dtype=torch.long)
    attention = (torch.arange(width) < (plen + clen).unsqueeze(1)).long()
    # target index j predicts input_ids[j + 1]: completion token k sits at len(p) + k, target len(p) + k - 1
    j = torch.arange(width - 1)
    response = (j >= (plen - 1).unsqueeze(1)) & (j < (plen - 1 + clen).unsqueeze(1))
    rollout = torch.zeros((len(prompt_ids), width - 1), dtype=torch.float32)
    # row-major: each row's completion targets are contiguous and in token order, so the flat list lands in place
    rollout[response] = torch.tensor([x for lp in rollout_logprobs for x in lp], dtype=torch.float32)
    return Batch(input_ids, attention, response, rollout)
