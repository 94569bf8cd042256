"""How the train step (forkrl/rl/step.py) cuts each mini-batch into micro-batches and deals them to the ranks
(pure Python: row indices and lengths only).

A plan is, per mini-batch, a list of micro-batch *slots*; slot j holds, per rank, the batch rows that rank trains
in its j-th forward/backward of the update (row indices, ascending; an empty list: that rank has no tokens there
and joins the others' collectives with an empty share, forkrl/rl/step.py `_Ctx.join`). Every rank runs the same
number of slots per mini-batch, so under FSDP2 every rank takes part in every all-gather and reduce-scatter.
Mini-batches are contiguous runs of `mini` rows (whole groups when `mini` is a multiple of G) in both modes.

- Fixed (`fixed_plan`, `micro_batch_size` B): the mini-batch is cut into global micro-batches of B rows in sample
  order, each dealt to the ranks in contiguous row blocks (forkrl/rl/collectives.py `deal`); a micro-batch of only
  empty completions is left out.
- Token budget (`token_plan`, `max_tokens_per_micro_batch` T): the rows of the mini-batch with at least one
  completion token are packed by length (`pack`: longest first, so that rows of similar length share a
  micro-batch) into micro-batches whose padded size, rows x longest row, is at most T (a single row longer than
  T is a micro-batch of its own), and the micro-batches are dealt to the ranks by tokens (`balance`: the largest
  first onto the rank with the fewest tokens so far). Packing the whole mini-batch before dealing keeps the
  padding low (the rows of all ranks fill the length range densely: on the recipe's long-tailed batch about 2%
  at T = 32k, against ~12% when each of 8 ranks packs only its own rows); dealing whole micro-batches keeps
  every rank within a few percent of the mean as long as each rank gets several of them. Each rank runs its
  micro-batches largest first, so slot j pairs micro-batches of similar size across ranks; a rank with fewer
  micro-batches than another gets empty slots at the end.
- Packed sequences (`token_plan(..., packed=True)`, `pack_sequences`): a micro-batch is one row in which its
  sequences lie end to end (forkrl/rl/forward.py `packed_rows`), so its size is the sum of their lengths, at most T,
  with no padding whatever rows share it. So the rows are dealt to the ranks first, one by one (`balance` over the
  rows: every rank within a fraction of a row of the mean, where whole micro-batches of nearly T tokens each
  would leave a rank up to a whole micro-batch short), and each rank packs its own rows (`fill`:
  first-fit-decreasing bin packing, longest first, each sequence into the first micro-batch it still fits, a
  sequence longer than T alone); each rank's micro-batches run largest first, as above.

The update does not depend on the plan (forkrl/rl/step.py: denominators global to the update; the step-scope
top-k over the entropies in batch-row order), except the micro-batch-scope top-k, which is taken per global
micro-batch; the token-budget path therefore refuses it with the mask on (docs/algorithms-departures.md §6).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from forkrl.rl.collectives import deal

__all__ = ["Plan", "balance", "fill", "fixed_plan", "pack", "padded_size", "token_plan"]

Plan = list[list[list[list[int]]]]
"""plan[k][j][r]: the rows rank r trains in slot j of mini-batch k."""


def _minis(n: int, mini: int) -> list[range]:
    return [range(s, min(s + mini, n)) for s in range(0, n, mini)]


def fixed_plan(resp: Sequence[int], mini: int, micro: int, world: int) -> Plan:
    """Micro-batches of `micro` rows in sample order, each dealt in contiguous blocks (module docstring).
    resp: the completion tokens of each row (a micro-batch whose rows have none is left out, and a mini-batch
    left with no micro-batch)."""
    out: Plan = []
    for rows in _minis(len(resp), mini):
        slots = [[list(range(*deal(a, min(a + micro, rows.stop), world, r))) for r in range(world)]
                 for a in range(rows.start, rows.stop, micro) if any(resp[a:min(a + micro, rows.stop)])]
        if slots:
            out.append(slots)
    return out


def balance(lengths: Sequence[int], world: int) -> list[list[int]]:
    """Indices of `lengths` (tokens of rows or of micro-batches) dealt to `world` ranks so that their sums are
    close: longest first (ties: the lower index), each onto the rank with the fewest tokens so far (ties: the lower
    rank) — greedy longest-processing-time. Each rank's indices come back ascending.

    Bound: the most-loaded rank holds at most the mean plus the last (smallest) item placed on it; with many items
    that are each small next to the mean per rank, every rank is within a few percent of the mean. When that is
    impossible, because one item is larger than the mean per rank (say one 20k-token response among short ones
    on 8 ranks), the rank that gets it gets nothing else and the other ranks share the rest evenly: the slowest
    rank holds max(largest item, ~mean) tokens, which no assignment of whole items can beat (splitting a row
    across ranks is sequence parallelism, not this). Likewise with fewer items than a few per rank, the balance
    is only as fine as the items: the token budget's micro-batches are then too large for the rank count (a
    smaller max_tokens_per_micro_batch gives more of them)."""
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    heap = [(0, r) for r in range(world)]
    out: list[list[int]] = [[] for _ in range(world)]
    for i in order:
        load, r = heapq.heappop(heap)
        out[r].append(i)
        heapq.heappush(heap, (load + lengths[i], r))
    return [sorted(rows) for rows in out]


def pack(rows: Sequence[int], lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """`rows` in micro-batches of padded size (rows x longest row) <= max_tokens: sorted by length, longest first
    (ties: the lower index), each row joins the current micro-batch while the padded size stays within the budget,
    else opens the next one. A row longer than max_tokens is a micro-batch of its own. Lengths only decrease along
    the order, so no later row fits an earlier, closed micro-batch: this is first-fit-decreasing. Each micro-batch's
    rows come back ascending."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens_per_micro_batch must be >= 1, got {max_tokens}")
    out: list[list[int]] = []
    cur: list[int] = []
    for i in sorted(rows, key=lambda i: (-lengths[i], i)):
        if cur and (len(cur) + 1) * lengths[cur[0]] > max_tokens:
            out.append(sorted(cur))
            cur = []
        cur.append(i)
    if cur:
        out.append(sorted(cur))
    return out


def fill(rows: Sequence[int], lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """`rows` in packed micro-batches of at most max_tokens tokens in all (the sum of their lengths: one packed row
    each): first-fit-decreasing bin packing, longest first (ties: the lower index), each row into the first
    micro-batch (in opening order) with room for it, else a new one. A row longer than max_tokens is a micro-batch
    of its own. FFD needs at most 11/9 OPT + 6/9 micro-batches. Each micro-batch's rows come back ascending."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens_per_micro_batch must be >= 1, got {max_tokens}")
    out: list[list[int]] = []
    room: list[int] = []
    for i in sorted(rows, key=lambda i: (-lengths[i], i)):
        k = next((k for k, left in enumerate(room) if lengths[i] <= left), None)
        if k is None:
            out.append([i])
            room.append(max(0, max_tokens - lengths[i]))
        else:
            out[k].append(i)
            room[k] -= lengths[i]
    return [sorted(m) for m in out]


def padded_size(rows: Sequence[int], lengths: Sequence[int]) -> int:
    """Tokens of the micro-batch as the forward sees them: rows x longest row."""
    return len(rows) * max((lengths[i] for i in rows), default=0)


def token_plan(lengths: Sequence[int], resp: Sequence[int], mini: int, max_tokens: int, world: int,
               packed: bool = False) -> Plan:
    """Micro-batches by tokens (module docstring). lengths: each row's tokens (prompt + completion, its width
    unpadded); resp: its completion tokens (a row with none trains nothing and is left out). packed: each
    micro-batch is one packed row of at most max_tokens tokens (`fill`) instead of padded rows (`pack`)."""
    if len(lengths) != len(resp):
        raise ValueError(f"got {len(lengths)} lengths but {len(resp)} response counts")
    out: Plan = []
    for span in _minis(len(lengths), mini):
        rows = [i for i in span if resp[i] > 0]
        if not rows:
            continue
        if packed:  # rows dealt one by one, then packed per rank (module docstring)
            parts = [[rows[k] for k in part] for part in balance([lengths[i] for i in rows], world)]
            per_rank = [sorted(fill(part, lengths, max_tokens), key=lambda m: (-sum(lengths[i] for i in m), m[0]))
                        for part in parts]
        else:
            micro = pack(rows, lengths, max_tokens)
            tokens = [sum(lengths[i] for i in m) for m in micro]
            per_rank = [[micro[j] for j in sorted(part, key=lambda j: (-tokens[j], j))]
                        for part in balance(tokens, world)]
        slots = max(len(m) for m in per_rank)
        out.append([[m[j] if j < len(m) else [] for m in per_rank] for j in range(slots)])
    return out
