"""The decoder's forward for the train step: the final hidden states of an HF causal LM (pure torch, no I/O),
plain (`final_hidden_states`), with each distinct prompt computed once (`shared_prefix_rows`), or with the rows
packed end to end into one row without padding (`packed_rows`, at the bottom).

`final_hidden_states` runs the model's own forward with the lm_head applied to no position, so wrappers of the
whole model (FSDP2's root hooks) run as for any forward, and reads the decoder's output with a forward hook.

A GRPO batch holds G samples of every prompt, so a plain forward over its rows computes each prompt's tokens G
times. Here the forward runs in two passes of the model's own forward:

1. the distinct prompts of the micro-batch, right-padded, with a KV cache: their keys and values, and the final
   hidden state of each prompt's last token (the one that scores the first completion token);
2. the completions (all but their last token, whose output scores nothing), one row per sample, attending to
   their prompt's keys and values: the cache is expanded row by row (`index_select`, so the backward sums each
   row's gradient into its prompt's) with explicit position ids and an attention mask that hides the prompt's
   padding.

The scored rows come back in the order of `hidden[:, :-1][response_mask]` of the plain forward and equal it up to
float rounding (the same math on other matmul shapes; tests/unit/test_prefix.py checks logp, entropy and every
gradient against the plain path in float64). The work saved is (G - 1) x the prompt tokens of each group.

`shared_prefix_rows` returns None, and the caller runs the plain forward, when nothing repeats (no saving), the
batch is not in build_batch's layout (forkrl/rl/batch.py: prompt then completion, right-padded), or the model's
attention has a sliding window (forkrl/rl/head.py `attention_window`) that the second pass could cross: that
pass's keys sit at the padded positions [0, P_max + w) of the cache (w: the longest completion less its last
token), so a row with a shorter prompt sees its own prompt P_max - P tokens further away than it is, and HF's
sliding mask (by cache position) and sliding cache layer (the last window - 1 keys) would hide keys the model's own
forward attends to (issue 42: Δlogp 0.05-0.09 on tiny Mistral / Gemma 2 with a window of 4). Only when
P_max + w <= window is no key of any row out of reach in either forward, and the numbers are the plain forward's
(tests/unit/test_logits_head.py: equal at P_max + w = window; forced one token past it, off by 0.006-0.16). Real
windows (4,096) are crossed by long responses: those batches take the plain forward, which is the model's own.
The train step uses it on one process and on replicated ranks; not under FSDP2 (a second forward before the
backward would all-gather every layer twice) nor with activation checkpointing (HF's checkpointing turns the KV
cache off).
"""

from __future__ import annotations

import torch
from torch import Tensor

from forkrl.rl.head import attention_window, check_packing
from forkrl.rl.varlen import NAME, seq_bounds

__all__ = ["decoder_forward", "final_hidden_states", "packed_rows", "shared_prefix_rows"]


def final_hidden_states(model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """The HF causal LM's last hidden states [B, L, h] (after its final norm), from the model's own forward with the
    lm_head applied to no position (`logits_to_keep` = an empty index), so wrappers of the whole model (FSDP2's
    root hooks) run as for any forward. Read from the decoder's output with a forward hook."""
    return decoder_forward(model, input_ids, attention_mask, use_cache=False)[0]


def decoder_forward(model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor,
                    **kwargs: object) -> tuple[Tensor, object]:
    """`final_hidden_states` with the forward's other arguments (`kwargs`: use_cache, past_key_values, position_ids)
    and its output's KV cache (None without use_cache): (hidden [B, L, h], cache)."""
    box: list[Tensor] = []

    def keep(_module: torch.nn.Module, _args: object, out: object) -> None:
        box.append(out[0] if isinstance(out, tuple) else out.last_hidden_state)  # type: ignore[attr-defined]

    handle = model.get_decoder().register_forward_hook(keep)  # type: ignore[operator]
    try:
        out = model(input_ids=input_ids, attention_mask=attention_mask,
                    logits_to_keep=torch.empty(0, dtype=torch.long, device=input_ids.device), **kwargs)
    finally:
        handle.remove()
    if len(box) != 1:
        raise RuntimeError(f"expected one output of {type(model).__name__}'s decoder per forward, got {len(box)}")
    return box[0], getattr(out, "past_key_values", None)


def shared_prefix_rows(model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor,
                       response_mask: Tensor) -> Tensor | None:
    """The final hidden states [n, h] of the scored positions (n = response_mask.sum()), in row-major order, each
    distinct prompt computed once (module docstring); None when that saves nothing or the layout is not
    build_batch's."""
    device = input_ids.device
    counts = response_mask.sum(dim=1)
    rows = counts.nonzero().squeeze(1)
    if rows.numel() < 2:
        return None
    first = response_mask[rows].int().argmax(dim=1)
    plen, clen = first + 1, counts[rows]
    window = attention_window(model.config)  # type: ignore[union-attr]
    if window is not None and int(plen.max()) + int(clen.max()) - 1 > window:
        return None  # a sliding window the padded second pass could cross (module docstring): the plain forward
    # build_batch's layout: attention over exactly [0, P + C), the targets P-1 .. P+C-2 all scored
    width = input_ids.shape[1]
    pos = torch.arange(width, device=device)
    want_att = pos.unsqueeze(0) < (plen + clen).unsqueeze(1)
    want_resp = (pos[:-1].unsqueeze(0) >= first.unsqueeze(1)) & (pos[:-1].unsqueeze(0) < (first + clen).unsqueeze(1))
    if not (torch.equal(attention_mask[rows].bool(), want_att) and torch.equal(response_mask[rows], want_resp)):
        return None
    plist, ids = plen.tolist(), input_ids[rows].tolist()
    index: dict[tuple[int, ...], int] = {}
    inv = [index.setdefault(tuple(r[:p]), len(index)) for r, p in zip(ids, plist, strict=True)]
    if len(index) == len(plist):
        return None
    prompts = list(index)
    u, pmax = len(prompts), max(plist)
    pre_ids = torch.zeros((u, pmax), dtype=input_ids.dtype, device=device)
    pre_att = torch.zeros((u, pmax), dtype=attention_mask.dtype, device=device)
    for k, pr in enumerate(prompts):
        pre_ids[k, : len(pr)] = torch.tensor(pr, dtype=input_ids.dtype, device=device)
        pre_att[k, : len(pr)] = 1
    uplen = torch.tensor([len(pr) for pr in prompts], device=device)
    h_pre, cache = decoder_forward(model, pre_ids, pre_att, use_cache=True,
                                   position_ids=torch.arange(pmax, device=device).expand(u, -1))
    if cache is None or not hasattr(cache, "reorder_cache"):
        return None  # a model without HF's KV cache: the plain forward
    inv_t = torch.tensor(inv, device=device)
    h_first = h_pre[torch.arange(u, device=device), uplen - 1][inv_t]  # [R, h]: scores each completion's token 0
    w = int(clen.max()) - 1
    if w == 0:
        return h_first
    # completions without their last token, right-padded to w; position ids continue each row's prompt
    tok = torch.zeros((len(plist), w), dtype=input_ids.dtype, device=device)
    src = input_ids[rows]
    j = torch.arange(w, device=device)
    valid = j.unsqueeze(0) < (clen - 1).unsqueeze(1)
    gather_at = (plen.unsqueeze(1) + j.unsqueeze(0)).clamp(max=width - 1)
    tok = torch.where(valid, src.gather(1, gather_at), tok)
    att = torch.cat([pre_att[inv_t], valid.to(attention_mask.dtype)], dim=1)
    cache.reorder_cache(inv_t)  # every layer's keys and values: one row per sample (differentiable)
    h_resp, _ = decoder_forward(model, tok, att, past_key_values=cache, use_cache=True,
                                position_ids=plen.unsqueeze(1) + j.unsqueeze(0))
    full = torch.cat([h_first.unsqueeze(1), h_resp], dim=1)  # [R, w + 1, h]: target k of each row at column k
    keep = torch.arange(w + 1, device=device).unsqueeze(0) < clen.unsqueeze(1)
    return full[keep]


def packed_rows(model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor, response_mask: Tensor) -> Tensor:
    """The final hidden states [n, h] of the scored positions (n = response_mask.sum()), in the order of the plain
    forward's `hidden[:, :-1][response_mask]`, from ONE forward over the rows laid end to end (each row's
    attention_mask.sum() tokens, no padding) with position ids restarting at 0 for each row, no attention mask and
    no KV cache: transformers then masks attention block-causally, so each sequence sees only itself, at the
    positions it has in its padded row (build_batch's layout: right-padded, so 0, 1, ... as in the plain forward).
    With a cache, or an attention mask, it would not (the second sequence would attend to the first: logits off
    by O(0.1)). forkrl/rl/head.py `check_packing` refuses a model or attention implementation where packing is
    not the sequences' own forward (UnsupportedModel); ValueError for a batch not right-padded. Under
    forkrl/rl/varlen.py `varlen_attention` (the train step's) an sdpa model attends within each sequence only,
    instead of over the whole row with a block-diagonal mask: the same numbers for a fraction of the work."""
    attn = getattr(model.config, "_attn_implementation", None)  # type: ignore[union-attr]
    check_packing(model.config, "sdpa" if attn == NAME else attn)
    b, width = input_ids.shape
    device = input_ids.device
    lengths = attention_mask.sum(dim=1)
    pos = torch.arange(width, device=device)
    if not torch.equal(attention_mask.bool(), pos.unsqueeze(0) < lengths.unsqueeze(1)):
        raise ValueError("packed rows need right-padded rows (attention_mask 1 on each row's first tokens, then 0)")
    if bool((response_mask & ~(pos[:-1].unsqueeze(0) < (lengths - 1).unsqueeze(1))).any()):
        raise ValueError("response_mask marks a target past its row's last token")
    keep = attention_mask.bool()
    ids = input_ids[keep].unsqueeze(0)  # [1, S]: row 0's tokens, then row 1's, ...
    position_ids = pos.expand(b, -1)[keep].unsqueeze(0)
    # the sequence bounds: flash-attention's varlen path and forkrl/rl/varlen.py's read them; sdpa and eager ignore
    # them and mask by the position ids
    hidden, _ = decoder_forward(model, ids, None, use_cache=False, position_ids=position_ids,  # type: ignore[arg-type]
                                **seq_bounds(lengths))
    starts = torch.cumsum(lengths, 0) - lengths  # each row's first token in the packed row
    at = (starts.unsqueeze(1) + pos[:-1].unsqueeze(0))[response_mask]  # row-major: the plain forward's order
    return hidden[0, at]
