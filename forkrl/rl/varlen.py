"""Attention of packed rows, each sequence on its own: sdpa per sequence instead of over the whole packed row.

    with varlen_attention(model):        # sdpa models only; others unchanged
        hidden = decoder_forward(model, ids, None, use_cache=False, position_ids=pos, **seq_bounds(lengths))

A packed row (forkrl/rl/forward.py `packed_rows`) under transformers' sdpa is one attention call over the whole row
with a block-diagonal mask: correct, but the product of every query with every key of the row is computed and
then masked, so a row of T tokens costs T^2 per layer where its sequences need only the sum of their own L^2
(on a row of several sequences, most of it). flash-attention's varlen kernel computes only each sequence's own
block; this is the same for sdpa: an attention implementation registered with transformers (`NAME`) that runs
transformers' own sdpa function once per sequence (causal; a sliding window, when the layer has one, as a band
mask inside the sequence: 0 <= q - k < window, transformers' rule), from the sequence bounds the forward passes
as `cu_seq_lens_q` (flash-attention's argument, which flash's varlen path reads too). A call without them (any
other forward) is transformers' sdpa unchanged, with the mask transformers builds for sdpa (`NAME` takes sdpa's
mask function), so the switch changes no other forward.

`varlen_attention` switches a model from sdpa to `NAME` for the duration of a `with` block and back, around the
whole train step: activation checkpointing recomputes a layer's forward in the backward, which must run the
same attention. Models on another implementation (eager, flash-attention) are left as they are.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

__all__ = ["NAME", "seq_bounds", "varlen_attention"]

NAME = "forkrl_varlen_sdpa"


def seq_bounds(lengths: Tensor) -> dict[str, object]:
    """The forward's keyword arguments that say where each sequence of a packed row starts (flash-attention's)."""
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=lengths.device)
    cu[1:] = torch.cumsum(lengths, 0)
    longest = int(lengths.max())
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


def _band(n: int, window: int, device: torch.device) -> Tensor:
    i = torch.arange(n, device=device)
    d = i.unsqueeze(1) - i.unsqueeze(0)
    return ((d >= 0) & (d < window)).view(1, 1, n, n)


def _varlen_sdpa(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                 dropout: float = 0.0, scaling: float | None = None, sliding_window: int | None = None,
                 **kwargs: object) -> tuple[Tensor, None]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cu = kwargs.pop("cu_seq_lens_q", None)
    for k in ("cu_seq_lens_k", "max_length_q", "max_length_k"):
        kwargs.pop(k, None)
    if not isinstance(cu, Tensor) or query.shape[0] != 1 or key.shape[2] != query.shape[2]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    bounds = cu.tolist()
    outs = []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        n = b - a
        band = _band(n, sliding_window, query.device) if sliding_window is not None and n > sliding_window else None
        out, _ = sdpa_attention_forward(module, query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], band,
                                        dropout=dropout, scaling=scaling, is_causal=True, **kwargs)
        outs.append(out)  # [1, n, heads, head_dim]
    return torch.cat(outs, dim=1), None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask

    if NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(NAME, _varlen_sdpa)
    if NAME not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        AttentionMaskInterface.register(NAME, sdpa_mask)


@contextmanager
def varlen_attention(*models: torch.nn.Module | None) -> Iterator[None]:
    """Within the block, the models on sdpa run `NAME` (module docstring); each is switched back after it."""
    switched = []
    try:
        for model in models:
            config = getattr(model, "config", None)
            if config is not None and getattr(config, "_attn_implementation", None) == "sdpa":
                _register()
                config._attn_implementation = NAME
                switched.append(config)
        yield
    finally:
        for config in switched:
            config._attn_implementation = "sdpa"
