"""Per-token log-probabilities and policy entropy in fp32 (algorithms.md §1), from logits or from the final hidden
states without ever building the logits of a whole sequence.

For each scored row with logits z (any dtype, bf16 included) and target token o:

    s    = z.float() / T          # T = the *sampling* temperature (§1.3), applied to logits, not logprobs
    logq = s - logsumexp(s)       # max-shifted, all <= 0
    logp = logq[o]                # differentiable
    H    = -sum_v exp(logq_v) * logq_v, clamped >= 0   # no grad: used for the mask, logs, probe (§1.2)

The `logq` form of H avoids cancelling two large numbers (`lse - sum p*s`) when H is near 0, which is
where half of CoT tokens sit (§1.1). Rows are processed in chunks (default 1024).

Two entry points:
- `token_logprobs_and_entropy(logits, targets)`: from logits the caller already has (the probe).
- `causal_lm_logprobs_and_entropy(model, input_ids, attention_mask, response_mask)` (the train step): runs the
  HF causal LM's own forward with its lm_head applied to no position, takes the final hidden states of the
  response positions and computes, chunk by chunk, the model's own logits z = post(h_chunk @ W_lmᵀ + b_lm) (the
  head's bias if it has one; `post` the scaling / soft-capping the model's forward applies after its head, one
  rule per model type in forkrl/rl/head.py, an unknown type refused), then logp and H
  (`hidden_logprobs_and_entropy`). A custom autograd function keeps only the hidden rows and one log-sum-exp
  per row for the backward and recomputes each chunk's logits there (§1.2): the extra memory is one chunk's
  [chunk, V] temporaries (one more in the backward under soft-capping: its derivative), never [B, L, V] logits,
  their gradient or a stored log-softmax.

Causal shift: the logits at position p predict the token at p + 1. With model outputs `logits[B, L, V]`
for `input_ids[B, L]`, use `shift_for_causal_lm` and slice any per-token mask the same way (`mask[:, 1:]`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from forkrl.rl.forward import final_hidden_states, packed_rows, shared_prefix_rows
from forkrl.rl.head import LogitsPost, logits_post

__all__ = ["causal_lm_logprobs_and_entropy", "hidden_logprobs_and_entropy", "shift_for_causal_lm",
           "token_logprobs_and_entropy"]


def _check_args(logits: Tensor, targets: Tensor, temperature: float, chunk_size: int) -> None:
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits must have shape [..., V] with V >= 1, got {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be a floating-point tensor, got dtype {logits.dtype}")
    if tuple(targets.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"targets shape {tuple(targets.shape)} must equal logits shape without the vocab dim "
            f"{tuple(logits.shape[:-1])} (logits shape {tuple(logits.shape)})"
        )
    if targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"targets must be an integer (long) tensor, got dtype {targets.dtype}")
    if not temperature > 0:  # also rejects NaN
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _entropy_of(logq: Tensor) -> Tensor:
    """-sum_v exp(logq_v) logq_v per row, clamped >= 0; consumes `logq` (overwritten in place)."""
    p = logq.exp()
    # p * logq is 0 * -inf = NaN where a logit is -inf (a banned token); its true contribution is 0. Nothing else
    # gives a NaN here (p <= 1 and logq finite where p > 0) but a NaN logit, whose row is 0 as before.
    return (-p.mul_(logq).nan_to_num_(nan=0.0).sum(-1)).clamp_min(0.0)


def _rows_logprobs_and_entropy(
    rows: Tensor, targets: Tensor, temperature: float, with_entropy: bool
) -> tuple[Tensor, Tensor | None]:
    """rows [n, V] (any float dtype), targets [n] -> logp [n] (grad), entropy [n] (no grad), both fp32.

    fp64 logits stay fp64 (exact reference models in tests and the probe); everything narrower is upcast.
    """
    s = rows.to(_compute_dtype(rows.dtype))
    if temperature != 1.0:
        s = s / temperature  # divide the logits, never the logprobs (§6 P6)
    logq = torch.log_softmax(s, dim=-1)
    logp = logq.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return logp, None
    with torch.no_grad():
        ent = _entropy_of(logq.detach().clone())
    return logp, ent


def token_logprobs_and_entropy(
    logits: Tensor,
    targets: Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """Log-probability of each target token and the entropy of each position's distribution, from logits.

    Args:
        logits: [..., V] raw logits (bf16/fp16/fp32/fp64). Already shifted: logits[..., j, :] scores
            targets[..., j] (see `shift_for_causal_lm`).
        targets: [...] integer token ids.
        temperature: the sampling temperature T; logits are divided by T before the softmax (§1.3).
        chunk_size: rows per chunk (§1.2).
        with_entropy: if False, skip the entropy (returns None) and save its exp/sum.

    Returns:
        logp: [...] fp32 (fp64 for fp64 logits), differentiable w.r.t. logits.
        entropy: [...] same dtype, detached, >= 0 (or None when with_entropy is False).
    """
    _check_args(logits, targets, temperature, chunk_size)
    out_shape = tuple(targets.shape)
    flat = logits.reshape(-1, logits.shape[-1])
    tflat = targets.reshape(-1)
    logps: list[Tensor] = []
    ents: list[Tensor] = []
    for start in range(0, flat.shape[0], chunk_size):
        lp, ent = _rows_logprobs_and_entropy(
            flat[start : start + chunk_size], tflat[start : start + chunk_size], temperature, with_entropy
        )
        logps.append(lp)
        if ent is not None:
            ents.append(ent)
    if not logps:  # zero rows
        empty = flat.new_zeros(out_shape, dtype=_compute_dtype(logits.dtype))
        return empty, (empty.detach() if with_entropy else None)
    logp = torch.cat(logps).reshape(out_shape)
    entropy = torch.cat(ents).reshape(out_shape) if with_entropy else None
    return logp, entropy


def _scaled_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, post: LogitsPost, temperature: float,
                   with_factor: bool = False) -> tuple[Tensor, Tensor | float]:
    """s = logits / T, the logits exactly as the model's forward gives them (lm_head = hidden @ weightᵀ + bias in
    their dtype, bf16 under mixed precision as the engine serves them; then upcast and the model's post-processing,
    forkrl/rl/head.py), then the fp32 math of §1.1. A fresh tensor; with_factor: also d logits / d lm_head
    (`LogitsPost.grad_factor`: a float, or a fresh tensor under soft-capping), else 1.0."""
    z = F.linear(hidden, weight, bias)
    s = post.apply_(z.to(_compute_dtype(z.dtype)))
    factor = post.grad_factor(s) if with_factor else 1.0
    return (s.div_(temperature) if temperature != 1.0 else s), factor


class _LinearLogprobs(torch.autograd.Function):
    """(hidden [n, h], weight [V, h], bias [V] or None, targets [n]) -> (logp [n], entropy [n] or [0]) chunk by
    chunk, the logits post-processed as the model does (`post`).

    Saved for the backward: the inputs (hidden rows, references to the weight and bias) and lse [n]; the backward
    recomputes each chunk's logits and applies d logp / d s = onehot(o) - softmax(s), / T, x d logits / d lm_head
    (the post-processing's factor), then the linear map's products: d hidden = dz @ W (per chunk),
    d W = sum over chunks of dzᵀ @ h_chunk and d b = sum over rows of dz (accumulated in fp32: in place when W is
    fp32, in an fp32 buffer when it is narrower, cast once at the end).
    """

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, temperature: float,
                chunk_size: int, with_entropy: bool, post: LogitsPost) -> tuple[Tensor, Tensor]:
        n = hidden.shape[0]
        cdt = _compute_dtype(torch.promote_types(hidden.dtype, weight.dtype))
        logp = torch.empty(n, dtype=cdt, device=hidden.device)
        lse = torch.empty(n, dtype=cdt, device=hidden.device)
        ent = torch.empty(n if with_entropy else 0, dtype=cdt, device=hidden.device)
        for a in range(0, n, chunk_size):
            b = min(a + chunk_size, n)
            s, _ = _scaled_logits(hidden[a:b], weight, bias, post, temperature)
            lse_c = torch.logsumexp(s, dim=-1)
            logq = s.sub_(lse_c.unsqueeze(-1))  # in place: s is no longer needed
            logp[a:b] = logq.gather(-1, targets[a:b].unsqueeze(-1)).squeeze(-1)
            lse[a:b] = lse_c
            if with_entropy:
                ent[a:b] = _entropy_of(logq)
            del s, logq  # before the next chunk's logits exist: one chunk's [chunk, V] at a time
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.temperature, ctx.chunk_size, ctx.post = temperature, chunk_size, post
        ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp: Tensor, _g_ent: Tensor) -> tuple[Tensor | None, ...]:
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        t, n, post = ctx.temperature, hidden.shape[0], ctx.post
        grad_h = torch.empty_like(hidden) if need_h else None
        acc = torch.zeros(weight.shape, dtype=_compute_dtype(weight.dtype), device=weight.device) if need_w \
            else None
        acc_b = torch.zeros(bias.shape, dtype=_compute_dtype(bias.dtype), device=bias.device) if need_b else None
        for a in range(0, n, ctx.chunk_size):
            b = min(a + ctx.chunk_size, n)
            g = g_logp[a:b].to(lse.dtype).unsqueeze(-1)
            s, factor = _scaled_logits(hidden[a:b], weight, bias, post, t, with_factor=True)
            p = s.sub_(lse[a:b].unsqueeze(-1)).exp_()  # softmax(s)
            ds = p.mul_(-g).scatter_add_(-1, targets[a:b].unsqueeze(-1), g)  # g (onehot - p)
            if t != 1.0:
                ds.div_(t)
            if not (isinstance(factor, float) and factor == 1.0):
                ds.mul_(factor)  # d logits / d lm_head(h): the post-processing's chain rule
            dz = ds.to(hidden.dtype)
            if grad_h is not None:
                grad_h[a:b] = dz @ weight
            if acc is not None:
                if acc.dtype == dz.dtype:
                    acc.addmm_(dz.t(), hidden[a:b])
                else:
                    acc.add_(dz.t() @ hidden[a:b])
            if acc_b is not None:
                acc_b.add_(dz.sum(0))
            del s, factor, p, ds, dz  # before the next chunk's logits exist
        grad_w = acc.to(weight.dtype) if acc is not None else None
        grad_b = acc_b.to(bias.dtype) if acc_b is not None else None
        return grad_h, grad_w, grad_b, None, None, None, None, None


def hidden_logprobs_and_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = True,
    *,
    bias: Tensor | None = None,
    post: LogitsPost | None = None,
) -> tuple[Tensor, Tensor | None]:
    """logp and entropy of rows whose logits are post(hidden @ weightᵀ + bias), without materializing more than
    one chunk of logits, in the forward or the backward (module docstring).

    Args:
        hidden: [n, h] final hidden states of the scored positions (bf16/fp32/fp64).
        weight: [V, h] the lm_head weight (tied embeddings: the same tensor as the input embeddings).
        targets: [n] integer token ids.
        temperature, chunk_size, with_entropy: as for `token_logprobs_and_entropy`.
        bias: [V] the lm_head's bias, if it has one.
        post: what the model does to the head's output (forkrl/rl/head.py `logits_post`); None: nothing.

    Returns:
        logp: [n] fp32 (fp64 for fp64 inputs), differentiable w.r.t. hidden, weight and bias.
        entropy: [n] same dtype, detached, >= 0 (or None when with_entropy is False).
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden must be [n, h] and weight [V, h]; got hidden {tuple(hidden.shape)} and weight "
                         f"{tuple(weight.shape)}")
    if not (hidden.is_floating_point() and weight.is_floating_point()):
        raise ValueError(f"hidden and weight must be floating-point, got {hidden.dtype} and {weight.dtype}")
    if tuple(targets.shape) != (hidden.shape[0],) or targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"targets must be an integer tensor of shape ({hidden.shape[0]},) (one per hidden row), got "
                         f"{targets.dtype} {tuple(targets.shape)}")
    if not temperature > 0:  # also rejects NaN
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if bias is not None and (tuple(bias.shape) != (weight.shape[0],) or not bias.is_floating_point()):
        raise ValueError(f"bias must be a floating-point [V] = ({weight.shape[0]},) tensor, got {bias.dtype} "
                         f"{tuple(bias.shape)}")
    logp, ent = _LinearLogprobs.apply(hidden, weight, bias, targets.long(), float(temperature), chunk_size,
                                      with_entropy, post or LogitsPost())
    return logp, (ent if with_entropy else None)


def causal_lm_logprobs_and_entropy(
    model: torch.nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    response_mask: Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = True,
    share_prefix: bool = False,
    pack: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """logp and entropy of the target tokens marked by response_mask, from the model's final hidden states (§1.2).
    share_prefix: compute each distinct prompt once (forkrl/rl/forward.py; the same numbers up to float rounding),
    where the batch repeats prompts; otherwise the plain forward. pack: the rows end to end in one row without
    padding (forkrl/rl/forward.py `packed_rows`; the same numbers up to float rounding; share_prefix is then not
    used).

    Args:
        model: an HF causal LM (its `get_decoder()` output, `get_output_embeddings()`'s weight and bias, and what
            its forward does to the logits after the head: forkrl/rl/head.py; UnsupportedModel for a model type
            it does not know, before any forward).
        input_ids, attention_mask: [B, L]. response_mask: [B, L-1] bool over the *targets* input_ids[:, 1:].
    Returns:
        logp [B, L-1] fp32 (fp64 for an fp64 model), differentiable (w.r.t. the model's parameters); entropy
        [B, L-1] detached (or None). Positions outside the mask get exactly 0 (never a sentinel, §6 P5); their
        rows never enter the softmax and get no gradient.
    """
    if response_mask.dtype != torch.bool:
        raise ValueError(f"response_mask must be a bool tensor, got dtype {response_mask.dtype}")
    if input_ids.dim() != 2 or tuple(response_mask.shape) != (input_ids.shape[0], input_ids.shape[1] - 1):
        raise ValueError(f"response_mask must be [B, L-1] for input_ids [B, L]; got {tuple(response_mask.shape)} "
                         f"and {tuple(input_ids.shape)}")
    post = logits_post(model.config)  # first: an unknown model is refused before any work
    head = model.get_output_embeddings()  # type: ignore[operator]
    rows = None
    if pack:
        rows = packed_rows(model, input_ids, attention_mask, response_mask)
    elif share_prefix:
        rows = shared_prefix_rows(model, input_ids, attention_mask, response_mask)
    if rows is None:
        hidden = final_hidden_states(model, input_ids, attention_mask)
        rows = hidden[:, :-1][response_mask]  # [n, h]: a copy of the scored rows only
        del hidden
    lp, ent = hidden_logprobs_and_entropy(rows, head.weight, input_ids[:, 1:][response_mask], temperature, chunk_size,
                                          with_entropy, bias=getattr(head, "bias", None), post=post)
    idx = response_mask.reshape(-1).nonzero().squeeze(-1)
    zeros = torch.zeros(response_mask.numel(), dtype=lp.dtype, device=lp.device)
    # out of place: the graph reaches the rows through index_put, also when there are none (a rank's empty share)
    logp = zeros.index_put((idx,), lp).reshape(response_mask.shape)
    entropy = zeros.index_put((idx,), ent).reshape(response_mask.shape) if ent is not None else None
    return logp, entropy


def shift_for_causal_lm(logits: Tensor, input_ids: Tensor) -> tuple[Tensor, Tensor]:
    """Align a causal LM's outputs with the tokens they predict (§1.2: position p predicts p + 1).

    Args:
        logits: [B, L, V] model outputs for input_ids.
        input_ids: [B, L].
    Returns:
        (logits[:, :-1], input_ids[:, 1:]): [B, L-1, V] and [B, L-1]. Views, no copy. Slice any per-token
        mask over input_ids the same way (`response_mask[:, 1:]`) so it marks the scored target tokens.
    """
    if logits.dim() != 3 or input_ids.dim() != 2 or tuple(logits.shape[:2]) != tuple(input_ids.shape):
        raise ValueError(
            f"logits must be [B, L, V] and input_ids [B, L]; got logits {tuple(logits.shape)} "
            f"and input_ids {tuple(input_ids.shape)}"
        )
    return logits[:, :-1], input_ids[:, 1:]
