"""RunConfig: validation messages name the field and value; the proto mapping is derived by name and complete;
loss_config() builds the loss's own config; docs/configuration.md documents every field."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Literal, get_args, get_origin

import pytest
from pydantic import ValidationError

from forkrl.cli import describe_validation_error
from forkrl.rl import advantages, losses, mask, options
from forkrl.training.config import INT32_MAX, INT64_MAX, RunConfig, from_proto, to_proto
from forkrl.wire.trainer.v1 import trainer_pb2

PROTO_FIELDS = trainer_pb2.RunConfig.DESCRIPTOR.fields_by_name
LITERAL_FIELDS = [n for n, f in RunConfig.model_fields.items() if get_origin(f.annotation) is Literal]
PROTO_INT_MAX = {PROTO_FIELDS["num_steps"].type: INT32_MAX, PROTO_FIELDS["seed"].type: INT64_MAX}


def _msg(**kw) -> str:
    with pytest.raises(ValidationError) as exc:
        RunConfig(**kw)
    return describe_validation_error(exc.value)


def test_bad_values_name_the_field_and_value() -> None:
    assert _msg(entropy_top_frac=1.5) == "entropy_top_frac must be in (0, 1], got 1.5"
    assert _msg(entropy_top_frac=0.0) == "entropy_top_frac must be in (0, 1], got 0.0"
    assert _msg(num_steps=0) == "num_steps: Input should be greater than or equal to 1, got 0"
    assert "loss" in _msg(loss="ppo") and "'ppo'" in _msg(loss="ppo")
    assert _msg(rollout_addresses=["nohost"]) == \
        "rollout_addresses: expected host:port (port 0 to 65535), got 'nohost'"
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


def _reference_rows() -> dict[str, str]:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    return {m[1]: m[2] for m in re.finditer(r"^\| `--([a-z0-9-]+)` \| [^|]* \| ((?:[^|]|\\\|)*) \|$", doc, re.M)}


def test_configuration_reference_documents_every_flag() -> None:
    rows = _reference_rows()
    missing = [n for n in RunConfig.model_fields if n.replace("_", "-") not in rows]
    assert not missing, f"docs/configuration.md's flag table lacks {missing}"
    # the meaning column is the field's docstring (the --help text), so the two cannot drift apart
    stale = {n: " ".join(f.description.split()) for n, f in RunConfig.model_fields.items()
             if rows[n.replace("_", "-")] != " ".join(f.description.split()).replace("|", "\\|")}
    assert not stale, f"docs/configuration.md rows differ from the docstrings; expected meanings: {stale}"


def _bounds(name: str) -> dict[str, float]:
    """The field's numeric constraints (ge, gt, le, lt) from its metadata."""
    out: dict[str, float] = {}
    for m in RunConfig.model_fields[name].metadata:
        for key in ("ge", "gt", "le", "lt"):
            if getattr(m, key, None) is not None:
                out[key] = getattr(m, key)
    return out


def _numeric(kind: type) -> list[str]:
    return [n for n, f in RunConfig.model_fields.items() if f.annotation in (kind, kind | None)]


def _said(value: float) -> list[str]:
    """How a bound may be written in a docstring: 10,000,000 / 1024 / 0.01 / 1e9 / 2^63 - 1."""
    return [f"{value:,}", f"{value:g}", f"{value:.0e}".replace("e+0", "e"), {INT64_MAX: "2^63 - 1"}.get(value, "-")]


@pytest.mark.parametrize("name", _numeric(int))
def test_every_int_field_has_a_range_within_its_proto_type_said_in_its_docstring(name: str) -> None:
    b = _bounds(name)
    proto_max = PROTO_INT_MAX[PROTO_FIELDS[name].type]
    assert "ge" in b and "le" in b and b["le"] <= proto_max, (name, b)  # to_proto can never overflow
    assert any(s in RunConfig.model_fields[name].description for s in _said(b["le"])), (name, b["le"])
    assert name in _msg(**{name: b["le"] + 1}) and name in _msg(**{name: b["ge"] - 1})
    for value in (INT32_MAX, INT64_MAX):
        if value > b["le"]:
            assert _msg(**{name: value}).startswith(f"{name}: Input should be less than or equal to {b['le']}")


@pytest.mark.parametrize("name", _numeric(float))
def test_every_float_field_is_finite_and_bounded(name: str) -> None:
    for value in (math.nan, math.inf, -math.inf):
        assert _msg(**{name: value}).startswith(f"{name}: Input should be a finite number"), value
    b = _bounds(name)
    if name in ("lr", "entropy_top_frac"):  # lr: any finite value > 0 (the trainer's guards catch a blow-up);
        return  # entropy_top_frac: (0, 1] by check_top_frac
    upper = b.get("le", b.get("lt"))
    assert upper is not None and ("ge" in b or "gt" in b), (name, b)
    assert any(s in RunConfig.model_fields[name].description for s in _said(upper)), (name, upper)
    assert name in _msg(**{name: upper * 2 + 1})


def test_lr_takes_any_finite_positive_value() -> None:
    assert RunConfig(lr=1e308).lr == 1e308 and RunConfig(lr=5e-324).lr == 5e-324
    assert _msg(lr=0.0) == "lr: Input should be greater than 0, got 0.0"


def test_temperature_is_the_engines_range() -> None:
    assert RunConfig(temperature=0.01).temperature == 0.01 and RunConfig(temperature=2.0).temperature == 2.0
    assert _msg(temperature=3.0) == "temperature: Input should be less than or equal to 2, got 3.0"
    assert _msg(temperature=0.005) == "temperature: Input should be greater than or equal to 0.01, got 0.005"


def test_strings_and_lists_are_bounded_and_never_echoed_whole() -> None:
    for name, limit in (("model", 4096), ("dataset", 4096), ("run_dir", 4096), ("task", 256), ("reward", 256)):
        long = "/" + "/".join(["x" * 255] * 16) if limit == 4096 else "x" * limit
        assert len(long) == limit and RunConfig(**{name: long}) is not None
        msg = _msg(**{name: "y" * 100_000})
        assert msg.startswith(f"{name}: String should have at most {limit} characters") and len(msg) < 300, msg
        assert "100,002 characters" in msg  # the repr's length, said instead of the value
    for name in ("model", "dataset", "run_dir"):  # bytes, not characters: what the file system counts
        assert _msg(**{name: "/d/" + "é" * 128}) == (f"{name} must have at most 4096 bytes (UTF-8), at most 255 per "
                                                     "name in it, got 259 bytes, the longest name 256")
        assert "got 4,222 bytes" in _msg(**{name: "/".join(["é" * 100] * 21) + "/x"})
        assert RunConfig(**{name: "/d/" + "é" * 127}) is not None
    msg = _msg(rollout_addresses=["h" * 100_000 + ":1"])
    assert "at most 300 characters" in msg and len(msg) < 300, msg
    assert "at most 64 items" in _msg(rollout_addresses=[f"127.0.0.1:{p}" for p in range(65)])
    assert "port 0 to 65535" in _msg(rollout_addresses=["127.0.0.1:65536"])


def test_overlong_cache_len_fits_in_max_new_tokens() -> None:
    assert RunConfig(max_new_tokens=8, overlong_cache_len=8).overlong_cache_len == 8
    assert _msg(max_new_tokens=8, overlong_cache_len=9) == \
        "overlong_cache_len (9) must be <= max_new_tokens (8): the penalty ramp lies inside the length budget"
    cfg = RunConfig(overlong_cache_len=9)  # max_new_tokens 0: the task's default, checked once resolved
    with pytest.raises(ValueError, match="overlong_cache_len"):
        cfg.model_copy(update={"max_new_tokens": 4}).check_overlong()


def test_every_field_at_its_maximum_survives_the_proto() -> None:
    top = {n: _bounds(n).get("le") for n in _numeric(int) + _numeric(float)}
    cfg = RunConfig(**{n: v for n, v in top.items() if v is not None})
    assert from_proto(to_proto(cfg)) == cfg
    assert cfg.num_steps == 10**7 and cfg.seed == INT64_MAX
