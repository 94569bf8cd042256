"""Random-init Qwen2-architecture models of a given size, built from a config (no download).

    python -m forkrl.models.random_qwen2 --size 400m --out .cache/bench-models/qwen2-400m
    build_random_qwen2(out, "1.5g")          # -> out (reused when it already holds that build)

For benchmarks and the GPU check (bench/bench_weights.py, bench/bench_lengths.py, scripts/gpu_check.sh): the weights
are noise, the tokenizer is the embedded default model's character tokenizer. Most sizes take their vocab_size from
it, so the bytes sit in the decoder layers as in a real model of that size without the 150k-token embedding; `1.5b`
is Qwen2.5-1.5B's shape whole (its config.json: vocab_size 151936, tied embeddings, rope_theta 1e6), and `tiny-1.5b`
the tiny layers with that vocabulary and tying (the GPU check's --dry-run). Ids past the tokenizer's vocabulary
decode to nothing, as Qwen2.5's padded ids do. fp32 safetensors, loadable by transformers and vLLM
unchanged.

`no_eos` (`--no-eos`): the model never samples EOS, so that every response runs to max_new_tokens (long-response
tests: a random-init model over the 99-token character vocabulary would emit EOS about once in 100 tokens). One
residual dimension is held constant: every embedding has 1 there and no attention or MLP output writes to it,
so after the final RMSNorm it is positive at every position; EOS's output row reads only that dimension with
weight -NO_EOS_WEIGHT (10), so EOS's logit is about -80 while the others stay within about +-1 (its probability
below 1e-30). Everything else is the random init; training a few steps at a small learning rate keeps it so.

Sizes (fp32 bytes of the weights):

| size | hidden | layers | heads (kv) | intermediate | vocab | parameters |
|---|---|---|---|---|---|---|
| tiny | 64 | 2 | 2 (1) | 256 | tokenizer's | 0.1 M |
| tiny-1.5b | 64 | 2 | 2 (1) | 256 | 151936, tied | 9.8 M (39 MB) |
| bench | 256 | 2 | 4 (2) | 1024 | tokenizer's | 2.0 M |
| 400m | 1024 | 8 | 16 (2) | 3584 | tokenizer's | 107 M (0.43 GB) |
| 0.5b | 1024 | 28 | 16 (2) | 5120 | tokenizer's | 507 M (2.0 GB) |
| 1.5g | 1536 | 8 | 12 (2) | 8960 | tokenizer's | 374 M (1.50 GB) |
| 1.5b | 1536 | 28 | 12 (2) | 8960 | 151936, tied | 1544 M (6.2 GB) |
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

# Qwen2.5-1.5B's vocabulary, tying and RoPE base (its config.json); the other sizes keep Qwen2Config's defaults.
_QWEN25 = dict(vocab_size=151936, tie_word_embeddings=True, rope_theta=1_000_000.0)
SIZES: dict[str, dict[str, int | float | bool]] = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                 intermediate_size=256),
    "tiny-1.5b": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                      intermediate_size=256, **_QWEN25),
    "bench": dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=1024),  # bench/bench_lengths.py: long rows on a 2-core CPU
    "400m": dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=2,
                 intermediate_size=3584),
    "0.5b": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=2,
                 intermediate_size=5120),
    "1.5g": dict(hidden_size=1536, num_hidden_layers=8, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960),
    "1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960, **_QWEN25),
}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
NO_EOS_WEIGHT = 10.0  # no_eos: EOS's output row, on the constant residual dimension (module docstring)
_STAMP = "forkrl_random_qwen2.json"


def build_random_qwen2(out: str | Path, size: str, *, seed: int = 0, max_position_embeddings: int = 2048,
                       no_eos: bool = False) -> Path:
    """Write (or reuse) a random-init Qwen2ForCausalLM of `size` (a key of SIZES) into `out`; `no_eos`: one that
    never samples EOS (module docstring)."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from forkrl.models.embedded import COMMITTED_DIR

    out = Path(out)
    spec = {"size": size, "seed": seed, "max_position_embeddings": max_position_embeddings, **SIZES[size],
            **({"no_eos": True} if no_eos else {})}
    stamp = out / _STAMP
    if stamp.exists() and json.loads(stamp.read_text()) == spec and (out / "model.safetensors").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    for name in _TOKENIZER_FILES:
        shutil.copyfile(COMMITTED_DIR / name, out / name)
    tok = AutoTokenizer.from_pretrained(out)
    shape = {"vocab_size": len(tok), "tie_word_embeddings": False, **SIZES[size]}
    if shape["vocab_size"] < len(tok):
        raise ValueError(f"size {size}: vocab_size {shape['vocab_size']} < the tokenizer's {len(tok)} tokens")
    cfg = Qwen2Config(
        max_position_embeddings=max_position_embeddings, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, rms_norm_eps=1e-6, **shape,
    )
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = Qwen2ForCausalLM(cfg)
    if no_eos:
        _suppress_eos(model, tok.eos_token_id)
    model.save_pretrained(out, safe_serialization=True)  # fp32 (the config's default dtype)
    stamp.write_text(json.dumps(spec))
    return out


def _suppress_eos(model, eos: int) -> None:
    """Make EOS's logit about -8 x NO_EOS_WEIGHT at every position (module docstring: `no_eos`)."""
    import torch

    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 1.0  # the constant dimension, in every token's embedding ...
        for layer in model.model.layers:  # ... that no layer writes to
            layer.self_attn.o_proj.weight[0, :] = 0.0
            layer.mlp.down_proj.weight[0, :] = 0.0
        model.model.norm.weight[0] = 1.0
        head = model.lm_head.weight  # tied sizes: the embedding itself (EOS never is an input of a response)
        head[eos, :] = 0.0
        head[eos, 0] = -NO_EOS_WEIGHT


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=list(SIZES), required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-position-embeddings", type=int, default=2048, help="the context (default 2048)")
    p.add_argument("--no-eos", action="store_true", help="a model that never samples EOS: every response runs "
                   "to max_new_tokens")
    args = p.parse_args(argv)
    print(build_random_qwen2(args.out, args.size, seed=args.seed,
                             max_position_embeddings=args.max_position_embeddings, no_eos=args.no_eos))
    return 0


if __name__ == "__main__":
    sys.exit(main())
