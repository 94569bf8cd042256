"""Sampling, grading, the no-grad entropy pass, entropy bins and position selection (algorithms.md §4.1).

    trajs = sample_trajectories(model, prompt_ids, group_size=8, temperature=1.0, max_new_tokens=11,
                                seed=0, eos_ids={2}, pad_id=0)
    grade(trajs, tokenizer, problems, reward="")           # fills text / reward / correct
    stats = token_stats(model, trajs, temperature=1.0)     # per-token entropy and logp of each response
    bins = rank_bins(entropy, 5, seeded_generator(0, "bins"))
    chosen, available = select_positions(bins, traj_of, correct_of, eligible, n_bins=5, per_cell=64, per_traj=4)

`sample_trajectories` is the transformers sampler (sampler "transformers"; `forkrl.probe.engines` holds the
vLLM and rollout-service samplers, which return the same `Trajectory` rows). It is forkrl's one KV-cache
sampler (`forkrl.models.sampling`): ancestral sampling from softmax(z / T)
(top-p 1, no top-k, as in RL rollouts, §1.3), batched over prompts of equal length, driven by a job-local
`torch.Generator` so two jobs in one process never share RNG state. Each response is cut at its first EOS,
**keeping the EOS** (the EOS is a generated token the policy chose and is trained on); everything after it
is padding, and padding never reaches a statistic: the entropy pass only scores response tokens, and
positions index real tokens only.

Bins are by rank, not by value edges: pool every response token, sort by (H, seeded random tie-break) and
set bin = floor(K * rank / N). Near-zero entropies tie a lot, and quantile edges then collapse.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from forkrl.data.prompts import run_reward_fn
from forkrl.models.sampling import sample_tokens
from forkrl.rl.entropy import token_logprobs_and_entropy
from forkrl.rl.head import LogitsPost, UnsupportedModel, logits_post
from forkrl.seeds import seeded_generator

__all__ = [
    "TokenStats",
    "Trajectory",
    "bin_edges",
    "edge_bins",
    "grade",
    "pad_right",
    "rank_bins",
    "resolve_reward_name",
    "sample_trajectories",
    "seeded_generator",
    "select_positions",
    "token_stats",
    "top_frac_mask",
]


@dataclass
class Trajectory:
    """One sampled response. `response_ids` ends at (and includes) the first EOS when `finished`."""

    index: int
    prompt_index: int
    prompt_ids: list[int]
    response_ids: list[int]
    finished: bool
    text: str = ""
    reward: float | None = None
    correct: bool = False
    extra: dict = field(default_factory=dict)

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    @property
    def n_response(self) -> int:
        return len(self.response_ids)


def sample_trajectories(
    model: nn.Module,
    prompt_ids: Sequence[Sequence[int]],
    *,
    group_size: int,
    temperature: float,
    max_new_tokens: int,
    seed: int,
    eos_ids: Iterable[int],
    pad_id: int,
    batch_size: int = 64,
    check: Callable[[], None] | None = None,
) -> list[Trajectory]:
    """`group_size` samples per prompt, prompt-major order (trajectory i*G + g is sample g of prompt i), from
    the shared sampler (`forkrl.models.sampling.sample_tokens`). `check` is called before every batch."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    rows = [(p, list(prompt_ids[p])) for p in range(len(prompt_ids)) for _ in range(group_size)]
    sampled = sample_tokens(
        model, [ids for _, ids in rows], temperature=temperature, max_new_tokens=max_new_tokens, eos_ids=eos_ids,
        pad_id=pad_id, seed=seed, batch_size=batch_size, check=check,
    )  # fmt: skip
    return [
        Trajectory(r, p, p_ids, resp, finished)
        for r, ((p, p_ids), (resp, finished)) in enumerate(zip(rows, sampled, strict=True))
    ]


def resolve_reward_name(reward: str, dataset: str, task: str = "") -> str:
    """The training convention: empty = the built-in task's own reward (exact_match for sum3/add2, countdown
    for countdown), math_verify for a dataset."""
    from forkrl.data.tasks import DEFAULT_TASK, get_task

    return reward or ("math_verify" if dataset else get_task(task or DEFAULT_TASK).reward)


def grade(trajs: Sequence[Trajectory], tokenizer, problems: Sequence, reward: str = "", dataset: str = "",
          prompt_format: str = "raw") -> None:
    """Decode each response (EOS and other special tokens dropped) and score it in place, with the reward reading
    the answer where `prompt_format` puts it (forkrl.data.prompts.run_reward_fn, as in training).

    correct = reward > 0, which fits both the 1/0 and the +1/-1 conventions; a None reward (ungradable gold
    answer) leaves reward None and correct False, and the probe leaves such a sample out of the cells (and
    counts it) rather than calling it incorrect.
    """
    for t in trajs:
        t.text = tokenizer.decode(t.response_ids, skip_special_tokens=True)
    texts = [t.text for t in trajs]
    probs = [problems[t.prompt_index] for t in trajs]
    result = run_reward_fn(resolve_reward_name(reward, dataset), prompt_format)(texts, probs)
    rewards = list(getattr(result, "rewards", result))
    for t, r in zip(trajs, rewards, strict=True):
        t.reward = None if r is None else float(r)
        t.correct = t.reward is not None and t.reward > 0


def pad_right(seqs: Sequence[Sequence[int]], pad_id: int, device: torch.device | str = "cpu") -> tuple[Tensor, Tensor]:
    """Right-padded (B, L) ids and attention mask. Real tokens come first, so causal attention never lets a
    pad position influence a real one."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long, device=device)
    attn = torch.zeros((len(seqs), width), dtype=torch.long, device=device)
    for r, s in enumerate(seqs):
        ids[r, : len(s)] = torch.tensor(list(s), dtype=torch.long, device=device)
        attn[r, : len(s)] = 1
    return ids, attn


@dataclass
class TokenStats:
    """Per response token of one trajectory (length = n_response): entropy and logp at T, entropy at T=1."""

    entropy: Tensor
    logp: Tensor
    entropy_t1: Tensor | None = None


def _logp_entropy(logits: Tensor, targets: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    """The core's one-pass logp (differentiable) and entropy (detached) at T; float64 logits stay float64."""
    logp, ent = token_logprobs_and_entropy(logits, targets, temperature=temperature, with_entropy=True)
    return logp, ent


def _cat(xs: list[Tensor]) -> Tensor:
    return torch.cat(xs).double().cpu() if xs else torch.zeros(0, dtype=torch.float64)


@torch.no_grad()
def token_stats(
    model: nn.Module,
    trajs: Sequence[Trajectory],
    *,
    temperature: float,
    also_t1: bool = False,
    batch_size: int = 32,
    pad_id: int = 0,
    chunk_rows: int = 1024,
    check: Callable[[], None] | None = None,
) -> list[TokenStats]:
    """Entropy H and logp of every response token (§1), computed from the backbone's hidden states at the
    response positions only, with the vocab projection in chunks (§1.2): no (B, L, V) tensor is built."""
    device = next(model.parameters()).device
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    head = model.get_output_embeddings()
    # the model's own post-processing of its head's output (bias, scaling, soft-capping: the train step's rule,
    # forkrl/rl/head.py); a model type it does not know goes through the full forward (its own logits)
    try:
        post: LogitsPost | None = logits_post(model.config)
    except UnsupportedModel:
        post = None
    results: list[TokenStats] = []
    for start in range(0, len(trajs), batch_size):
        chunk = trajs[start : start + batch_size]
        if check is not None:
            check()
        ids, attn = pad_right([t.ids for t in chunk], pad_id, device)
        # logits at position p score token p + 1: response token j of row r sits at P_r + j
        rows_b, rows_p = [], []
        for r, t in enumerate(chunk):
            p0 = len(t.prompt_ids)
            rows_b += [r] * t.n_response
            rows_p += list(range(p0 - 1, p0 - 1 + t.n_response))
        b_idx = torch.tensor(rows_b, dtype=torch.long, device=device)
        p_idx = torch.tensor(rows_p, dtype=torch.long, device=device)
        targets = ids[b_idx, p_idx + 1]
        use_hidden = decoder is not None and head is not None and post is not None
        if use_hidden:
            rows = decoder(input_ids=ids, attention_mask=attn, use_cache=False).last_hidden_state[b_idx, p_idx]
        else:
            rows = model(input_ids=ids, attention_mask=attn, use_cache=False).logits[b_idx, p_idx]
        ents, logps, ents1 = [], [], []
        for s in range(0, len(rows_b), chunk_rows):
            e = min(s + chunk_rows, len(rows_b))
            logits = post.apply_(head(rows[s:e])) if post is not None and use_hidden else rows[s:e]
            lp, h = _logp_entropy(logits, targets[s:e], temperature)
            logps.append(lp)
            ents.append(h)
            if also_t1:
                ents1.append(_logp_entropy(logits, targets[s:e], 1.0)[1])
        ent, lp = _cat(ents), _cat(logps)
        ent1 = _cat(ents1) if also_t1 else None
        off = 0
        for t in chunk:
            n = t.n_response
            h1 = None if ent1 is None else ent1[off : off + n]
            results.append(TokenStats(ent[off : off + n], lp[off : off + n], h1))
            off += n
    return results


def rank_bins(entropy: Tensor, n_bins: int, gen: torch.Generator) -> Tensor:
    """bin = floor(K * rank / N), rank by (H, seeded random tie-break): equal-count bins even with ties."""
    n = entropy.numel()
    perm = torch.randperm(n, generator=gen)
    order = perm[torch.sort(entropy[perm], stable=True).indices]
    rank = torch.empty(n, dtype=torch.long)
    rank[order] = torch.arange(n)
    return (rank * n_bins) // max(n, 1)


def bin_edges(entropy: Tensor, bins: Tensor, n_bins: int) -> list[float]:
    """The K - 1 lower edges of bins 1..K-1 (the smallest entropy in each), from a reference checkpoint's
    rank bins; an empty bin gets +inf (nothing reaches it)."""
    return [float(entropy[bins == b].min()) if bool((bins == b).any()) else float("inf") for b in range(1, n_bins)]


def edge_bins(entropy: Tensor, edges: Sequence[float]) -> Tensor:
    """bin = how many edges are <= H: the reference checkpoint's entropy ranges applied to another one.
    (Tokens tied at an edge value, which rank binning may split, all go to the upper bin.)"""
    e = torch.tensor(list(edges), dtype=entropy.dtype)
    return torch.searchsorted(e, entropy.contiguous(), right=True)


def top_frac_mask(entropy: Tensor, frac: float = 0.2) -> Tensor:
    """bool mask of the ceil(frac * N) highest-entropy tokens (ties broken by position, stable)."""
    n = entropy.numel()
    k = min(n, max(1, int(-(-frac * n // 1)))) if n else 0
    mask = torch.zeros(n, dtype=torch.bool)
    if k:
        order = torch.sort(-entropy, stable=True).indices
        mask[order[:k]] = True
    return mask


def select_positions(
    bins: Tensor,
    traj_of: Tensor,
    correct_of: Tensor,
    eligible: Tensor,
    *,
    n_bins: int,
    per_cell: int,
    per_traj: int,
    seed: int = 0,
    salt: str = "",
) -> tuple[dict[tuple[int, bool], list[int]], dict[tuple[int, bool], int]]:
    """Token indices per (bin, correct) cell, and the number of eligible tokens per cell.

    A seeded shuffle of the cell's eligible tokens, taking each unless its trajectory already gave
    `per_traj` tokens to this cell (0 = no such cap), until `per_cell`."""
    chosen: dict[tuple[int, bool], list[int]] = {}
    available: dict[tuple[int, bool], int] = {}
    for b in range(n_bins):
        for c in (True, False):
            cand = ((bins == b) & (correct_of == c) & eligible).nonzero().squeeze(-1)
            available[(b, c)] = int(cand.numel())
            cand = cand[torch.randperm(cand.numel(), generator=seeded_generator(seed, salt, b, c))].tolist()
            taken: list[int] = []
            per: dict[int, int] = {}
            for i in cand:
                tr = int(traj_of[i])
                if per_traj and per.get(tr, 0) >= per_traj:
                    continue
                per[tr] = per.get(tr, 0) + 1
                taken.append(i)
                if len(taken) >= per_cell:
                    break
            chosen[(b, c)] = sorted(taken)
    return chosen, available
