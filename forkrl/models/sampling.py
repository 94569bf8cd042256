"""forkrl's one non-vLLM sampler, a KV-cache decode loop on an HF model: `sample_tokens`, what the probe's and the
eval CLI's "transformers" sampler route and the tiny builder's evaluations (`sample_completions`) generate with.
Rollouts for training always come from vLLM (rollout_service).

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

__all__ = ["sample_completions", "sample_tokens", "trim_at_eos"]


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
