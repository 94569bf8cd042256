"""Random-init Qwen2-architecture models of a given size, built from a config (no download).

    python -m forkrl.models.random_qwen2 --size 400m --out .cache/bench-models/qwen2-400m
    build_random_qwen2(out, "1.5g")          # -> out (reused when it already holds that build)

For benchmarks and the GPU check (bench/bench_weights.py, scripts/gpu_check.sh): the weights are noise, the
tokenizer is the embedded default model's character tokenizer (its vocabulary sets vocab_size), so the
bytes sit in the decoder layers as in a real model of that size without the 150k-token embedding. fp32
safetensors, loadable by transformers and vLLM unchanged. Sizes (fp32 bytes of the weights):

| size | hidden | layers | heads (kv) | intermediate | parameters |
|---|---|---|---|---|---|
| tiny | 64 | 2 | 2 (1) | 256 | 0.1 M |
| 400m | 1024 | 8 | 16 (2) | 3584 | 107 M (0.43 GB) |
| 0.5b | 1024 | 28 | 16 (2) | 5120 | 507 M (2.0 GB) |
| 1.5g | 1536 | 8 | 12 (2) | 8960 | 374 M (1.50 GB) |
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                 intermediate_size=256),
    "400m": dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=2,
                 intermediate_size=3584),
    "0.5b": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=2,
                 intermediate_size=5120),
    "1.5g": dict(hidden_size=1536, num_hidden_layers=8, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960),
}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
_STAMP = "forkrl_random_qwen2.json"


def build_random_qwen2(out: str | Path, size: str, *, seed: int = 0, max_position_embeddings: int = 2048) -> Path:
    """Write (or reuse) a random-init Qwen2ForCausalLM of `size` (a key of SIZES) into `out`."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from forkrl.models.embedded import COMMITTED_DIR

    out = Path(out)
    spec = {"size": size, "seed": seed, "max_position_embeddings": max_position_embeddings, **SIZES[size]}
    stamp = out / _STAMP
    if stamp.exists() and json.loads(stamp.read_text()) == spec and (out / "model.safetensors").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    for name in _TOKENIZER_FILES:
        shutil.copyfile(COMMITTED_DIR / name, out / name)
    tok = AutoTokenizer.from_pretrained(out)
    cfg = Qwen2Config(
        vocab_size=len(tok), max_position_embeddings=max_position_embeddings, tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        rms_norm_eps=1e-6, **SIZES[size],
    )
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = Qwen2ForCausalLM(cfg)
    model.save_pretrained(out, safe_serialization=True)  # fp32 (the config's default dtype)
    stamp.write_text(json.dumps(spec))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=list(SIZES), required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print(build_random_qwen2(args.out, args.size, seed=args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
