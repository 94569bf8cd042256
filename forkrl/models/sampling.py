"""forkrl's own (non-vLLM) KV-cache samplers: `sample_tokens` (the tiny builder's evaluations and the probe's
responses) and `sample_rows` (the rollout service's torch backend: rows of any prompt length in one left-padded
batch, one generator per row, the logprob of every sampled token; its docstring says the rest).

    rows = sample_tokens(model, [[1, 5, 6], [1, 7]], temperature=1.0, max_new_tokens=16, eos_ids=[2],
                         pad_id=0, seed=0)
    tokens, finished = rows[0]            # up to and including the first EOS; finished = an EOS was drawn
    texts = sample_completions(model, tokenizer, ["1+2+3="], temperature=0.0)   # greedy, as text

Plain ancestral sampling from softmax(z / T) (top-p 1, no top-k: what RL rollouts use, algorithms.md
§1.3), softmax in fp32 (fp64 for an fp64 model); temperature 0 is greedy (argmax, no draw). Every draw
comes from a private `torch.Generator` seeded with `seed`, so a job never touches or shares the global
RNG. A row that has drawn an EOS continues as `pad_id` until the whole batch is done; the caller gets its
tokens cut after the first EOS, the EOS kept (it is a token the policy chose).

Batches hold prompts of one length only, so no prompt is ever padded: no position-id shifts, no
fully-masked attention rows (eager float64 attention turns those into NaN that leaks into real rows), and
a batched sample is computed exactly like an unbatched one. Rows are grouped by prompt length in order of
first appearance and keep their order inside a group; batches of `batch_size` are drawn in that order.
Which batch a row lands in decides which part of the RNG stream it sees, so that order is part of the
result: a caller that wants another order passes its rows in that order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # heavy imports stay out of module import (the tiny builder's --help)
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["RowSample", "sample_completions", "sample_rows", "sample_tokens", "trim_at_eos"]


def trim_at_eos(tokens: Sequence[int], eos_ids: Iterable[int]) -> tuple[list[int], bool]:
    """Tokens up to and including the first EOS, and whether an EOS was found."""
    eos = set(eos_ids)
    for i, tok in enumerate(tokens):
        if tok in eos:
            return list(tokens[: i + 1]), True
    return list(tokens), False


def sample_tokens(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    temperature: float,
    max_new_tokens: int,
    eos_ids: Iterable[int],
    pad_id: int,
    seed: int = 0,
    batch_size: int = 64,
    check: Callable[[], None] | None = None,
) -> list[tuple[list[int], bool]]:
    """One response per prompt row (repeat a prompt for several samples): (tokens, finished) each, the tokens
    cut after the first EOS. `check` is called before every batch (a job's cancellation raises from it)."""
    import torch

    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if max_new_tokens < 1 or batch_size < 1:
        raise ValueError(f"max_new_tokens and batch_size must be >= 1, got {max_new_tokens} and {batch_size}")
    eos = sorted({int(e) for e in eos_ids})
    if not eos:
        raise ValueError("at least one EOS token id is needed")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt")
    device = next(model.parameters()).device
    eos_t = torch.tensor(eos, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    by_len: dict[int, list[int]] = {}
    for r, ids in enumerate(prompts):
        by_len.setdefault(len(ids), []).append(r)
    raw: dict[int, list[int]] = {}
    was_training = model.training
    model.eval()
    try:
        for members in by_len.values():
            for start in range(0, len(members), batch_size):
                chunk = members[start : start + batch_size]
                if check is not None:
                    check()
                ids = torch.tensor([list(prompts[r]) for r in chunk], dtype=torch.long, device=device)
                batch = _sample_batch(model, ids, temperature, max_new_tokens, eos_t, pad_id, gen)
                raw.update(zip(chunk, batch, strict=True))
    finally:
        model.train(was_training)
    return [trim_at_eos(raw[r], eos) for r in range(len(prompts))]


def _sample_batch(
    model: torch.nn.Module,
    ids: torch.Tensor,
    temperature: float,
    max_new_tokens: int,
    eos_t: torch.Tensor,
    pad_id: int,
    gen: torch.Generator,
) -> list[list[int]]:
    """Equal-length prompts (B, P) -> (B, steps) new tokens; rows past their EOS continue as pad."""
    import torch

    with torch.no_grad():
        done = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
        new_tokens: list[torch.Tensor] = []
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        for step in range(max_new_tokens):
            logits = out.logits[:, -1]
            logits = logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32)
            if temperature == 0:
                tok = logits.argmax(-1)
            else:
                probs = torch.softmax(logits / temperature, dim=-1)
                tok = torch.multinomial(probs, 1, generator=gen).squeeze(1)
            tok = torch.where(done, torch.full_like(tok, pad_id), tok)
            new_tokens.append(tok)
            done |= torch.isin(tok, eos_t)
            if bool(done.all()) or step == max_new_tokens - 1:
                break
            out = model(input_ids=tok[:, None], past_key_values=out.past_key_values, use_cache=True, logits_to_keep=1)
        return torch.stack(new_tokens, dim=1).tolist()


def sample_completions(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    *,
    temperature: float = 1.0,
    n_samples: int = 1,
    max_new_tokens: int = 16,
    seed: int = 0,
    batch_size: int = 512,
) -> list[list[str]]:
    """`n_samples` completions per prompt as text (after the prompt, up to EOS, EOS and special tokens
    dropped); temperature 0 is greedy.

    Rows go in ascending prompt length (ties in prompt order, a prompt's samples side by side): the batch
    order of tiny-model builder v2, whose stopping evaluation, and hence its bytes, depend on it."""
    ids = tokenizer(list(prompts), add_special_tokens=True)["input_ids"]
    rows = [i for i in sorted(range(len(ids)), key=lambda i: len(ids[i])) for _ in range(n_samples)]
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    sampled = sample_tokens(
        model,
        [ids[i] for i in rows],
        temperature=temperature,
        max_new_tokens=max_new_tokens,
        eos_ids=[eos],
        pad_id=pad,
        seed=seed,
        batch_size=batch_size,
    )
    out: list[list[str]] = [[] for _ in prompts]
    for i, (tokens, finished) in zip(rows, sampled, strict=True):
        out[i].append(tokenizer.decode(tokens[:-1] if finished else tokens, skip_special_tokens=True))
    return out


class RowSample:
    """One row's result from `sample_rows`: its new tokens (an EOS kept), their logprobs and why it ended."""

    __slots__ = ("finish", "logprobs", "tokens")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.finish = ""  # "stop" (an EOS, or `on_token` said so), "length" or "abort"


def sample_rows(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: Sequence[int],
    generators: Sequence[torch.Generator],
    *,
    temperature: float,
    top_p: float = 1.0,
    eos_ids: Iterable[int],
    pad_id: int,
    between_steps: Callable[[], None] | None = None,
    on_token: Callable[[int, RowSample], bool] | None = None,
    on_done: Callable[[int, RowSample], None] | None = None,
    aborted: Callable[[int], bool] | None = None,
) -> list[RowSample]:
    """Rows of any prompt lengths in one batch (left-padded, masked, positions counted from each row's first
    token), each with its own length limit and its own `torch.Generator`, and the logprob of every sampled
    token under the distribution it was drawn from: log_softmax(z / T) (log_softmax(z) for greedy, T = 0),
    renormalized over the nucleus when top_p < 1 — what vLLM's `logprobs_mode="processed_logprobs"` reports.

    A draw is argmax(p / q) with q ~ Exp(1) from the row's generator (the exponential race: a sample of p),
    so a row's tokens depend on its prompt, its generator and the weights, not on the rows beside it.
    `between_steps` runs before every forward pass (a weight reload may take place there); `on_token(r, row)`
    after row r got a token returns True to end the row ("stop", e.g. a stop string); `on_done(r, row)` runs
    once per row as it ends; `aborted(r)` is asked before each step (True: the row ends "abort")."""
    import torch

    n = len(prompts)
    if not (n == len(max_new_tokens) == len(generators)):
        raise ValueError("prompts, max_new_tokens and generators need one entry per row")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt")
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"temperature must be >= 0 and top_p in (0, 1], got {temperature} and {top_p}")
    rows = [RowSample() for _ in range(n)]
    if n == 0:
        return rows
    device = next(model.parameters()).device
    eos = {int(e) for e in eos_ids}
    # rows of one prompt share its prefill: each distinct prompt is run once, then its KV cache is copied per row
    distinct: dict[tuple[int, ...], int] = {}
    source = [distinct.setdefault(tuple(int(t) for t in p), len(distinct)) for p in prompts]
    width = max(len(p) for p in prompts)
    ids = torch.full((len(distinct), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(distinct), width), dtype=torch.long)
    for u, p in enumerate(distinct):
        ids[u, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[u, width - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    expand = torch.tensor(source, dtype=torch.long, device=device) if len(distinct) < n else None
    limit = list(max_new_tokens)
    live = [True] * n

    def end(r: int, why: str) -> None:
        live[r] = False
        rows[r].finish = why
        if on_done is not None:
            on_done(r, rows[r])

    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():  # nothing here is ever differentiated (the cache and tensors die with the call)
            cache = None
            draws, drawn_at = None, 0  # the rows' Exp(1) draws for the steps drawn_at.. (see _draw_ahead)
            step_ids, step_pos = ids, positions
            for step in range(max(limit)):
                if aborted is not None:
                    for r in range(n):
                        if live[r] and aborted(r):
                            end(r, "abort")
                if not any(live):
                    break
                if between_steps is not None:
                    between_steps()
                out = model(input_ids=step_ids, attention_mask=mask, position_ids=step_pos, past_key_values=cache,
                            use_cache=True, logits_to_keep=1)
                cache = out.past_key_values
                z = out.logits[:, -1]
                if expand is not None:  # after the prefill of the distinct prompts: one row per sample
                    cache.reorder_cache(expand)
                    z, mask, step_pos = z[expand], mask[expand], step_pos[expand]
                    expand = None
                z = z.to(torch.float64 if z.dtype == torch.float64 else torch.float32)
                if temperature == 0:
                    logp = torch.log_softmax(z, -1)
                    tok = z.argmax(-1)
                else:
                    logp = torch.log_softmax(z / temperature, -1)
                    if top_p < 1:
                        logp = _nucleus(logp, top_p)
                    if draws is None or step - drawn_at >= draws.shape[1]:
                        draws, drawn_at = _draw_ahead(logp, generators, live, limit, step), step
                    tok = (logp.exp() / draws[:, step - drawn_at]).argmax(-1)
                tok_lp = logp.gather(-1, tok[:, None])[:, 0]
                if not bool(torch.isfinite(tok_lp).all()):
                    # a fully masked (padding) attention row turned into NaN and leaked: e.g. eager float64
                    # attention; never hand such samples on
                    raise RuntimeError(
                        f"non-finite logits at decode step {step} (attention implementation "
                        f"{getattr(model.config, '_attn_implementation', '?')!r}, dtype {z.dtype}): left-padded "
                        "batches need an attention that keeps padding rows finite, as sdpa does")
                toks, lps = tok.tolist(), tok_lp.tolist()
                for r in range(n):
                    if not live[r]:
                        toks[r] = pad_id
                        continue
                    row = rows[r]
                    row.tokens.append(toks[r])
                    row.logprobs.append(lps[r])
                    if toks[r] in eos or (on_token is not None and on_token(r, row)):
                        end(r, "stop")
                    elif len(row.tokens) >= limit[r]:
                        end(r, "length")
                if not any(live):
                    break
                step_ids = torch.tensor(toks, dtype=torch.long, device=device)[:, None]
                step_pos = step_pos[:, -1:] + 1
                mask = torch.cat([mask, torch.ones((n, 1), dtype=mask.dtype, device=device)], dim=1)
    finally:
        model.train(was_training)
    return rows


DRAW_AHEAD_ELEMENTS = 1 << 16
"""How many Exp(1) draws (steps x vocabulary) `sample_rows` takes from a row's generator in one call."""


def _draw_ahead(logp: torch.Tensor, generators: Sequence[torch.Generator], live: list[bool], limit: list[int],
                step: int) -> torch.Tensor:
    """(rows, K, vocab) Exp(1) draws for the decode steps step .. step + K - 1: one call per live row and K steps
    (K = DRAW_AHEAD_ELEMENTS // vocab, at least 1) instead of one per row and step: a call is a dispatch (on a GPU a
    kernel launch), which at a small vocabulary costs more than its draws. A row draws min(K, its steps left) in
    order from its own generator, so its draws depend on its generator, its own limit and the vocabulary only,
    never on the rows beside it (on CPU, where torch draws element by element, they are exactly the draws of one
    call per step); ended rows and steps past a row's limit hold 1.0. At most DRAW_AHEAD_ELEMENTS floats per row
    are held (256 KiB in float32)."""
    import torch

    vocab = logp.shape[-1]
    k = max(1, min(DRAW_AHEAD_ELEMENTS // vocab, max(limit) - step))
    q = torch.ones((logp.shape[0], k, vocab), dtype=logp.dtype, device=logp.device)
    for r, gen in enumerate(generators):
        if live[r]:
            q[r, : min(k, limit[r] - step)].exponential_(generator=gen)
    return q


def _nucleus(logp: torch.Tensor, top_p: float) -> torch.Tensor:
    """log-probabilities renormalized over the smallest set of top tokens whose mass reaches top_p (-inf
    elsewhere): vLLM's top-p."""
    import torch

    sorted_lp, order = logp.sort(-1, descending=True)
    before = sorted_lp.exp().cumsum(-1) - sorted_lp.exp()  # mass of the tokens ranked above each one
    drop = before >= top_p
    sorted_lp = sorted_lp.masked_fill(drop, float("-inf"))
    kept = torch.full_like(logp, float("-inf")).scatter(-1, order, sorted_lp)
    return torch.log_softmax(kept, -1)
