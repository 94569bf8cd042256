"""One probe parameter model: the HTTP body is `ProbeParams` itself, /openapi.json documents every field
with its default, the model enforces ranges and cross-field rules, and the allowed values are the ones the
core uses."""

from __future__ import annotations

import subprocess
import sys
import typing

import pytest
from pydantic import ValidationError

from forkrl.data.tasks import SPLITS
from forkrl.probe.params import GRAD_METHODS, MODULE_PATHS, ProbeParams

ROOT = {"checkpoint_root": "runs/x/checkpoints", "steps": [1]}


@pytest.fixture(scope="module")
def openapi(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from probe_service.app import create_app
    from probe_service.config import ProbeSettings

    tmp = tmp_path_factory.mktemp("probe_openapi")
    return create_app(ProbeSettings(allowed_roots=[str(tmp)], jobs_dir=str(tmp / "jobs"))).openapi()


def test_the_request_body_is_the_core_model(openapi):
    body = openapi["paths"]["/probe"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/ProbeParams"}
    assert not any("Request" in name for name in openapi["components"]["schemas"])  # no second request model
    schema = openapi["components"]["schemas"]["ProbeParams"]
    assert set(schema["properties"]) == set(ProbeParams.model_fields)
    assert schema.get("additionalProperties") is False


def test_openapi_documents_every_field_and_its_default(openapi):
    props = openapi["components"]["schemas"]["ProbeParams"]["properties"]
    for name, field in ProbeParams.model_fields.items():
        assert props[name].get("description"), name
        want = field.default_factory() if field.default_factory else field.default
        assert props[name].get("default") == want, name
    assert props["num_prompts"]["minimum"] == 1 and props["temperature"]["exclusiveMinimum"] == 0


def test_defaults_are_the_seeds():
    p = ProbeParams(**ROOT)
    assert (p.entropy_bins, p.max_positions_per_group, p.max_positions_per_trajectory) == (5, 12, 0)
    assert (p.proj_k, p.modules, p.row_spec, p.layer_indices) == (
        [1, 4, 16], ["k_proj", "down_proj"], ["start", "mid", "last"], [0, -1]
    )
    assert (p.temperature, p.num_samples, p.num_prompts, p.row_mode, p.record_grain) == (1.0, 2, 24, "row", "row")
    assert (p.freeze_bins_from, p.bootstrap, p.max_new_tokens) == ("", 200, 0)


def test_seed_names_and_old_names_are_one_field():
    seed = ProbeParams(**ROOT, num_samples=4, layer_indices=[0, 14, 27], row_spec=["start"])
    old = ProbeParams(**ROOT, group_size=4, layers=[0, 14, 27], row_specs=["start"])
    assert seed == old and seed.model_dump() == old.model_dump()
    assert "group_size" not in seed.model_dump() and seed.model_dump()["num_samples"] == 4
    assert ProbeParams(**ROOT, freeze_bins_from=20).freeze_bins_from == "20"  # a step as a JSON number


@pytest.mark.parametrize(
    "field,value",
    [
        ("num_prompts", 0),
        ("group_size", 513),
        ("temperature", 0.0),
        ("entropy_bins", 0),
        ("max_positions_per_trajectory", -1),
        ("grad_chunk_size", 257),
        ("sample_batch_size", 0),
        ("erank_draws", 0),
        ("modules", ["conv"]),
        ("modules", []),
        ("row_specs", ["first"]),
        ("row_specs", ["random:0"]),
        ("dtype", "int8"),
        ("split", "test"),
        ("grad_method", "outer"),
        ("steps", [-1]),
        ("proj_k", [0]),
        ("bogus", 1),
    ],
)
def test_out_of_range_values_name_the_field(field, value):
    with pytest.raises(ValidationError) as err:
        ProbeParams(**{**ROOT, field: value})
    assert any(field in e["loc"] for e in err.value.errors())


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"steps": [1]}, "need checkpoint_root"),
        ({"include_final": True}, "need checkpoint_root"),
        ({}, "nothing to probe"),
        ({"checkpoint_root": "r"}, "nothing to probe"),  # a root alone names no checkpoint
        ({"model": "m", "task": "sum3", "dataset": "d.jsonl"}, "mutually exclusive"),
    ],
)
def test_cross_field_rules(kw, match):
    with pytest.raises(ValidationError, match=match):
        ProbeParams(**kw)


def test_allowed_values_are_the_cores():
    from forkrl.probe import gradients

    assert typing.get_args(ProbeParams.model_fields["split"].annotation) == SPLITS
    modules = typing.get_args(typing.get_args(ProbeParams.model_fields["modules"].annotation)[0])
    assert modules == tuple(gradients.MODULE_PATHS) and gradients.MODULE_PATHS is MODULE_PATHS
    assert typing.get_args(ProbeParams.model_fields["grad_method"].annotation) == GRAD_METHODS == gradients.METHODS
    for spec in ("start", "mid", "last", "random:3", "0,5,-1"):  # what the model accepts, the parser takes
        ProbeParams(**ROOT, row_specs=[spec])
        assert gradients.parse_row_spec(spec, 64)


def test_params_module_imports_nothing_heavy():
    """A CLI on this model must answer --help before torch is imported."""
    code = "import sys, forkrl.probe.params; print(sorted({'torch', 'transformers', 'fastapi'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
