"""RunConfig: validation messages name the field and value; proto round trip; env defaults."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from forkrl.training.config import RunConfig, describe_validation_error, from_proto, to_proto


def _msg(**kw) -> str:
    with pytest.raises(ValidationError) as exc:
        RunConfig(**kw)
    return describe_validation_error(exc.value)


def test_bad_values_name_the_field_and_value() -> None:
    assert _msg(entropy_top_frac=1.5) == "entropy_top_frac must be in (0, 1], got 1.5"
    assert _msg(entropy_top_frac=0.0) == "entropy_top_frac must be in (0, 1], got 0.0"
    assert "num_steps" in _msg(num_steps=0) and "got 0" in _msg(num_steps=0)
    assert "loss" in _msg(loss="ppo") and "'ppo'" in _msg(loss="ppo")
    assert "rollout_addresses" in _msg(rollout_addresses=["nohost"])
    assert "group_size >= 2" in _msg(loss="rloo", group_size=1)
    assert "resume needs run_dir" in _msg(resume=True)


def test_proto_round_trip_keeps_every_field() -> None:
    cfg = RunConfig(model="/m", task="sum3", loss="gspo", entropy_top_frac=0.2, mask_scope="step", mask_norm="all",
                    num_steps=7, prompts_per_step=3, group_size=5, max_new_tokens=9, temperature=0.7, lr=1e-5,
                    clip_low=0.1, clip_high=0.3, micro_batch_size=4, save_every=2, run_dir="/r", resume=True,
                    seed=3, rollout_addresses=["127.0.0.1:1", "127.0.0.1:2"], kl_beta=0.01, dynamic_sampling=True,
                    weight_sync="path", eval_every=3, eval_prompts=0, overlong_cache_len=4)
    assert from_proto(to_proto(cfg)) == cfg
    # unset optional fields stay unset (None = the loss default / no mask), not 0.0
    plain = RunConfig(entropy_top_frac=None)
    back = from_proto(to_proto(plain))
    assert back.entropy_top_frac is None and back.clip_low is None and back == plain


def test_entropy_top_frac_defaults_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENTROPY_TOP_FRAC", "0.2")
    assert RunConfig().entropy_top_frac == 0.2
    monkeypatch.delenv("ENTROPY_TOP_FRAC")
    assert RunConfig().entropy_top_frac is None
    monkeypatch.setenv("RL_DATASET_PATH", "/data/x.jsonl")
    assert RunConfig().dataset == "/data/x.jsonl"


def test_readme_documents_every_flag() -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    missing = [n for n in RunConfig.model_fields if f"`--{n.replace('_', '-')}`" not in readme]
    assert not missing, f"README's configuration reference lacks {missing}"
