"""RunConfig: validation messages name the field and value; the proto mapping is derived by name and complete;
loss_config() builds the loss's own config; the README documents every field."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal, get_args, get_origin

import pytest
from pydantic import ValidationError

from forkrl.cli import describe_validation_error
from forkrl.rl import advantages, losses, mask, options
from forkrl.training.config import RunConfig, from_proto, to_proto
from forkrl.wire.trainer.v1 import trainer_pb2

PROTO_FIELDS = trainer_pb2.RunConfig.DESCRIPTOR.fields_by_name
LITERAL_FIELDS = [n for n, f in RunConfig.model_fields.items() if get_origin(f.annotation) is Literal]


def _msg(**kw) -> str:
    with pytest.raises(ValidationError) as exc:
        RunConfig(**kw)
    return describe_validation_error(exc.value)


def test_bad_values_name_the_field_and_value() -> None:
    assert _msg(entropy_top_frac=1.5) == "entropy_top_frac must be in (0, 1], got 1.5"
    assert _msg(entropy_top_frac=0.0) == "entropy_top_frac must be in (0, 1], got 0.0"
    assert _msg(num_steps=0) == "num_steps: Input should be greater than or equal to 1, got 0"
    assert "loss" in _msg(loss="ppo") and "'ppo'" in _msg(loss="ppo")
    assert _msg(rollout_addresses=["nohost"]) == "rollout_addresses: expected host:port, got 'nohost'"
    assert _msg(loss="rloo", group_size=1) == "loss rloo needs group_size >= 2 (leave-one-out baseline), got 1"
    assert _msg(resume=True) == "resume needs run_dir (the run to continue)"
    assert _msg(bogus=1) == "unknown setting 'bogus'"
    assert _msg(mini_batch_prompts=64) == \
        "mini_batch_prompts (64) must be <= prompts_per_step (32); 0 = all prompts in one update"
    assert _msg(ppo_epochs=0) == "ppo_epochs: Input should be greater than or equal to 1, got 0"
    assert _msg(tis_cap=0.5) == "tis_cap: Input should be greater than or equal to 1, got 0.5"


def test_proto_round_trip_keeps_every_field() -> None:
    cfg = RunConfig(model="/m", task="sum3", loss="gspo", entropy_top_frac=0.2, mask_scope="step", mask_norm="all",
                    num_steps=7, prompts_per_step=3, group_size=5, max_new_tokens=9, temperature=0.7, lr=1e-5,
                    clip_low=0.1, clip_high=0.3, micro_batch_size=4, save_every=2, run_dir="/r", resume=True,
                    seed=3, rollout_addresses=["127.0.0.1:1", "127.0.0.1:2"], kl_beta=0.01, dynamic_sampling=True,
                    weight_sync="path", eval_every=3, eval_prompts=0, overlong_cache_len=4, adam_beta1=0.0,
                    dual_clip_c=3.0, cispo_max_weight=2.0, max_gen_batches=5, warmup_steps=2, weight_decay=0.1,
                    mini_batch_prompts=2, ppo_epochs=3, tis_cap=2.0, max_staleness=2)
    assert from_proto(to_proto(cfg)) == cfg
    # unset optional fields stay unset (None = the loss default / no mask), not 0.0
    plain = RunConfig()
    back = from_proto(to_proto(plain))
    assert back.entropy_top_frac is None and back.clip_low is None and back.tis_cap is None and back == plain
    assert from_proto(trainer_pb2.RunConfig()) == plain  # an empty message means every default


@pytest.mark.parametrize("name", LITERAL_FIELDS)
def test_every_literal_value_has_a_proto_enum_value_and_back(name: str) -> None:
    enum = PROTO_FIELDS[name].enum_type
    assert enum is not None, f"RunConfig.{name} is a Literal but proto field {name} is not an enum"
    prefix = enum.values_by_number[0].name.removesuffix("UNSPECIFIED")
    values = get_args(RunConfig.model_fields[name].annotation)
    assert {prefix + v.upper() for v in values} == {v.name for v in enum.values} - {prefix + "UNSPECIFIED"}
    for value in values:
        msg = to_proto(RunConfig(**{name: value}, group_size=2))
        assert enum.values_by_number[getattr(msg, name)].name == prefix + value.upper()
        assert getattr(from_proto(msg), name) == value


def test_model_and_proto_have_the_same_fields_and_enums_only_for_literals() -> None:
    assert set(RunConfig.model_fields) == set(PROTO_FIELDS)
    assert {n for n, f in PROTO_FIELDS.items() if f.enum_type is not None} == set(LITERAL_FIELDS)
    # a proto3 `optional` field is one where unset must differ from 0: nullable, or a non-zero default
    for name, field in PROTO_FIELDS.items():
        info = RunConfig.model_fields[name]
        if field.has_presence:
            assert info.default is None or info.default not in (0, 0.0), name


def test_an_unknown_enum_number_is_reported_with_the_field() -> None:
    msg = to_proto(RunConfig())
    msg.loss = 42
    with pytest.raises(ValidationError) as exc:
        from_proto(msg)
    assert describe_validation_error(exc.value).startswith("loss: Input should be 'grpo'")


def test_allowed_values_are_defined_once_and_shared() -> None:
    assert get_args(RunConfig.model_fields["loss"].annotation) == options.LOSS_NAMES == losses.LOSS_NAMES
    assert get_args(RunConfig.model_fields["mask_scope"].annotation) == options.MASK_SCOPES == mask.MASK_SCOPES
    assert get_args(RunConfig.model_fields["mask_norm"].annotation) == options.MASK_NORMS == losses.MASK_NORMS
    assert set(advantages.DEFAULT_ESTIMATOR) == set(options.LOSS_NAMES)
    assert mask.check_top_frac is options.check_top_frac


def test_loss_config_carries_every_loss_setting() -> None:
    cfg = RunConfig(loss="dapo", entropy_top_frac=0.2, mask_scope="step", mask_norm="all", clip_low=0.1,
                    clip_high=0.3, dual_clip_c=3.0, kl_beta=0.05, max_new_tokens=17, tis_cap=2.0)
    assert cfg.loss_config() == losses.LossConfig(
        name="dapo", clip_low=0.1, clip_high=0.3, dual_clip_c=3.0, kl_beta=0.05, max_len=17, mask_norm="all",
        entropy_top_frac=0.2, mask_scope="step", tis_cap=2.0)
    assert RunConfig(loss="cispo", tis_cap=2.0, max_new_tokens=8).loss_config().tis_cap == 2.0  # §3.8 correction
    assert RunConfig(loss="cispo", cispo_max_weight=2.0, max_new_tokens=5).loss_config().cispo_cap == 2.0
    for name in options.LOSS_NAMES:
        assert RunConfig(loss=name, group_size=2, max_new_tokens=8).loss_config().name == name
    with pytest.raises(ValueError, match="clip_low is not used by loss 'reinforce'"):
        RunConfig(loss="reinforce", clip_low=0.1, max_new_tokens=8).loss_config()


def _readme_rows() -> dict[str, str]:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    return {m[1]: m[2] for m in re.finditer(r"^\| `--([a-z0-9-]+)` \| [^|]* \| ((?:[^|]|\\\|)*) \|$", readme, re.M)}


def test_readme_documents_every_flag() -> None:
    rows = _readme_rows()
    missing = [n for n in RunConfig.model_fields if n.replace("_", "-") not in rows]
    assert not missing, f"README's configuration reference lacks {missing}"
    # the meaning column is the field's docstring (the --help text), so the two cannot drift apart
    stale = {n: " ".join(f.description.split()) for n, f in RunConfig.model_fields.items()
             if rows[n.replace("_", "-")] != " ".join(f.description.split()).replace("|", "\\|")}
    assert not stale, f"README rows differ from the docstrings; expected meanings: {stale}"
