"""How a causal LM's logits follow from its last hidden state, per architecture: the one rule the train step
(forkrl/rl/entropy.py, from the hidden states in chunks), the probe (forkrl/probe/sampling.py) and the StartRun
check (forkrl/training/preflight.py) share.

    post = logits_post(model.config)       # or the dict of config.json; UnsupportedModel (a ValueError) if unknown
    z = post.apply_(F.linear(h, W, b))     # the model's own logits: lm_head (weight, and its bias if any), then
                                           # x scale, then soft-capped: cap * tanh(z / cap)

Each model type below was read in transformers' modeling code (5.19, `<Model>ForCausalLM.forward`): its logits
are `lm_head(decoder output)` followed by exactly what its `LogitsPost` says (the lm_head's bias, when the module
has one — Phi, GPT-J — is read from the module, not from here), and each was checked on a tiny random model: the
train step's log-probs and entropies equal its own forward's on the plain and the shared-prompt path (float64 to
1e-14, GPT-J 1e-7: its rotary tables are float32; the MoE types in float32 to 2e-6, their expert matmuls take no
float64). Attention-only decoders all: a hybrid with a recurrent state (granitemoehybrid, falcon_h1) is left out,
as its state over a right-padded prompt would not be the row's own in the shared-prompt path. A model type not
in the table is refused by name: forkrl cannot know whether its forward does something to the logits after the head
(hyperclovax multiplies by `logits_scaling`, granite divides by it; falcon_h1 has `lm_head_multiplier`; ...), and a
dropped step there trains on silently wrong log-probs.

`attention_window(config)` is the other architectural fact the train step needs: the sliding window of its
attention (or None), for the shared-prompt forward (forkrl/rl/forward.py), whose padded layout would otherwise
move keys in or out of a window.

`check_packing(config)`: whether packed sequences (forkrl/rl/forward.py `packed_rows`: several sequences in one row,
position ids restarting at each, no attention mask, no cache) give each sequence the hidden states it has alone.
transformers (5.19) finds the sequences from the position ids and masks attention block-causally (with a sliding
window applied inside each sequence: distances within a sequence are unchanged) in its eager and sdpa mask builders,
and flash-attention runs them as varlen sequences (and forkrl/rl/varlen.py runs sdpa per sequence in the train step);
every type of the table was checked on a tiny random model with windows shorter than the sequences, sdpa and eager:
packed equals alone to float64 rounding (the MoE types to float32 rounding; tests/unit/test_packing.py). The attention
implementations allowed are those (`PACKED_ATTENTION`); another (a custom kernel registered by name) may ignore the
position ids and let each sequence attend to the ones before it, and is refused, as is a model type added to the table
before it is checked packed (`_PACKED`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor

__all__ = ["PACKED_ATTENTION", "LogitsPost", "UnsupportedModel", "attention_window", "check_packing", "logits_post",
           "supported_model_types"]


class UnsupportedModel(ValueError):
    """The model's type is not one whose logits forkrl knows how to compute from its hidden states."""


@dataclass(frozen=True)
class LogitsPost:
    """What a model does to `lm_head(h)` before its logits come out: z * scale, then, with `softcap`,
    softcap * tanh(z / softcap) (Gemma 2/3's `final_logit_softcapping`). The identity by default."""

    scale: float = 1.0
    softcap: float | None = None

    @property
    def identity(self) -> bool:
        return self.scale == 1.0 and self.softcap is None

    def apply_(self, z: Tensor) -> Tensor:
        """The model's logits from the head's output `z`, in place (z: a fresh tensor the caller owns)."""
        if self.scale != 1.0:
            z.mul_(self.scale)
        if self.softcap is not None:
            z.div_(self.softcap).tanh_().mul_(self.softcap)
        return z

    def grad_factor(self, logits: Tensor) -> Tensor | float:
        """d logits / d z elementwise, from the logits `apply_` returned: a float when it is a constant (scale),
        else a fresh tensor (soft-capping: scale * (1 - (logits / cap)^2))."""
        if self.softcap is None:
            return self.scale
        t = logits / self.softcap
        return t.mul_(t).neg_().add_(1.0).mul_(self.scale)


def _get(config: Any, key: str) -> Any:
    return config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)


def _positive(config: Any, key: str, model_type: str) -> float:
    v = _get(config, key)
    if isinstance(v, bool) or not isinstance(v, int | float) or not v > 0:
        raise UnsupportedModel(f"model_type {model_type!r}: its {key} must be a number > 0, got {v!r}")
    return float(v)


def _softcap(model_type: str) -> Callable[[Any], LogitsPost]:
    def rule(config: Any) -> LogitsPost:
        if _get(config, "final_logit_softcapping") is None:
            return LogitsPost()
        return LogitsPost(softcap=_positive(config, "final_logit_softcapping", model_type))
    return rule


def _times(key: str, model_type: str, divide: bool = False) -> Callable[[Any], LogitsPost]:
    def rule(config: Any) -> LogitsPost:
        v = _positive(config, key, model_type)
        return LogitsPost(scale=1.0 / v if divide else v)
    return rule


# logits = lm_head(h), nothing after (lm_head's own bias included, when it has one)
_PLAIN = ("llama", "mistral", "ministral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "phi", "phi3",
          "gemma", "olmo", "olmo2", "olmo3", "starcoder2", "stablelm", "gpt_neox", "gptj", "smollm3", "glm", "glm4",
          "exaone4")
_RULES: dict[str, Callable[[Any], LogitsPost]] = {
    **{t: (lambda _config: LogitsPost()) for t in _PLAIN},
    # logits / cap, tanh, * cap (`if self.config.final_logit_softcapping is not None`)
    "gemma2": _softcap("gemma2"),
    "gemma3_text": _softcap("gemma3_text"),
    # logits * self.logit_scale (= config.logit_scale)
    "cohere": _times("logit_scale", "cohere"),
    "cohere2": _times("logit_scale", "cohere2"),
    # logits / config.logits_scaling
    **{t: _times("logits_scaling", t, divide=True)
       for t in ("granite", "granitemoe", "granitemoeshared")},
}


# known and refused, with the feature the train step does not reproduce (any other unknown type: the generic reason)
_REFUSED = {
    "falcon_h1": "its forward multiplies the logits by lm_head_multiplier and its Mamba layers keep a recurrent state",
    "hyperclovax": "its forward multiplies the logits by logits_scaling",
    "granitemoehybrid": "its Mamba layers keep a recurrent state, which a right-padded shared prompt would not give "
                        "each row",
}


def supported_model_types() -> tuple[str, ...]:
    return tuple(sorted(_RULES))


def logits_post(config: Any) -> LogitsPost:
    """The post-processing of the model's logits after its lm_head, from its config (a transformers config or
    config.json's dict). UnsupportedModel naming the model type when forkrl does not know it."""
    model_type = _get(config, "model_type")
    rule = _RULES.get(model_type) if isinstance(model_type, str) else None
    if model_type is None:
        raise UnsupportedModel("its config names no model_type: forkrl computes log-probs from the last hidden "
                               "state and the lm_head and must know what the model does to its logits after the head")
    if model_type in _REFUSED:
        raise UnsupportedModel(f"model_type {model_type!r} is not supported: {_REFUSED[model_type]}, which forkrl's "
                               "log-probs from the last hidden state and the lm_head do not reproduce")
    if rule is None:
        raise UnsupportedModel(
            f"model_type {model_type!r} is not supported: forkrl computes log-probs from the last hidden state "
            "and the lm_head and must know what the model does to its logits after the head (a bias, a scale, "
            f"soft-capping); known model types: {', '.join(supported_model_types())}")
    return rule(config)


def attention_window(config: Any) -> int | None:
    """The sliding window of the model's attention (the most recent tokens a query sees, itself included), or None
    when every layer attends to the whole row: config's `sliding_window`, unless `use_sliding_window` is off or
    `layer_types` names no sliding layer."""
    window = _get(config, "sliding_window")
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        return None
    if _get(config, "use_sliding_window") is False:
        return None
    layer_types = _get(config, "layer_types")
    if isinstance(layer_types, list | tuple) and not any("sliding" in str(t) for t in layer_types):
        return None
    return window


# model types checked packed == alone (module docstring; tests/unit/test_packing.py runs every one of them)
_PACKED = frozenset(_PLAIN) | {"gemma2", "gemma3_text", "cohere", "cohere2", "granite", "granitemoe",
                               "granitemoeshared"}
PACKED_ATTENTION = ("eager", "sdpa", "flash_attention_2", "flash_attention_3")
"""Attention implementations that separate packed sequences by their position ids (module docstring)."""


def check_packing(config: Any, attn_implementation: str | None = None) -> None:
    """UnsupportedModel (a ValueError) naming the model type or the attention implementation when packed sequences
    (pack_sequences) could let one sequence attend to another or change its numbers (module docstring); None when
    they are the sequences' own. `attn_implementation`: the loaded model's (config._attn_implementation); None
    where it is not known yet (a config.json before the model loads)."""
    logits_post(config)  # an unknown type: refused by name first
    model_type = _get(config, "model_type")
    if model_type not in _PACKED:
        raise UnsupportedModel(f"pack_sequences: model_type {model_type!r} is not checked for packed sequences "
                               f"(checked: {', '.join(sorted(_PACKED))}); train it with pack_sequences off")
    if attn_implementation is not None and attn_implementation not in PACKED_ATTENTION:
        raise UnsupportedModel(f"pack_sequences: the attention implementation {attn_implementation!r} is not one "
                               f"that separates packed sequences by their position ids ({', '.join(PACKED_ATTENTION)}"
                               "); load the model with one of those or train with pack_sequences off")
