"""forkrl/models/random_qwen2.py `no_eos`: a random-init model whose responses run to max_new_tokens (the long-response
tests), and without it the same model emits EOS often (why the option exists)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from forkrl.models.random_qwen2 import build_random_qwen2, main


def _eos_logprobs(model_dir: Path) -> torch.Tensor:
    """log p(EOS) at every position of 4 random token sequences of 64 (no EOS among them)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, len(tok), (4, 64), generator=g)  # past the special tokens
    with torch.no_grad():
        logp = model(input_ids=ids).logits.log_softmax(-1)
    return logp[..., tok.eos_token_id]


def test_no_eos_model_never_samples_eos_and_the_plain_one_does(tmp_path: Path) -> None:
    plain = _eos_logprobs(build_random_qwen2(tmp_path / "plain", "tiny"))
    assert plain.exp().mean() > 1e-3  # ~1 / 99: a 2048-token response would almost surely stop early
    never = _eos_logprobs(build_random_qwen2(tmp_path / "never", "tiny", no_eos=True))
    assert never.max() < -50, never.max()  # p(EOS) < 2e-22 at every position


def test_the_cli_builds_it_with_its_context(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--size", "tiny", "--out", str(tmp_path), "--no-eos", "--max-position-embeddings", "4096"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["max_position_embeddings"] == 4096
    stamp = json.loads((tmp_path / "forkrl_random_qwen2.json").read_text())
    assert stamp["no_eos"] is True  # a later build without no_eos does not reuse it
    build_random_qwen2(tmp_path, "tiny", max_position_embeddings=4096)
    assert "no_eos" not in json.loads((tmp_path / "forkrl_random_qwen2.json").read_text())
