"""forkrl.weights.chunks: state dict <-> (metas, payload, sha256) and the safetensors layout of the payload."""

from __future__ import annotations

import hashlib
import warnings

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save_file

from forkrl.weights.chunks import pack_state_dict, unpack, validate_metas
from forkrl.weights.safetensors import WeightsError, read_checkpoint_specs, safetensors_prefix


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "emb.weight": torch.randn(7, 5, generator=g),
        "proj.weight": torch.randn(5, 3, generator=g).t(),  # non-contiguous
        "norm.weight": torch.randn(5, generator=g).to(torch.bfloat16),
        "half": torch.randn(2, 2, generator=g).to(torch.float16),
        "scale": torch.tensor(1.5),  # 0-d
        "empty": torch.zeros(0, 4),
    }


def test_metas_are_hand_computable():
    metas, total, sha, chunks = pack_state_dict(
        {"a": torch.zeros(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}
    )
    assert metas == [
        {"name": "a", "dtype": "float32", "shape": [2, 3], "nbytes": 24},
        {"name": "b", "dtype": "bfloat16", "shape": [4], "nbytes": 8},
    ]
    payload = b"".join(chunks)
    assert total == 32 == len(payload)
    assert payload[:24] == bytes(24)  # fp32 zeros
    assert payload[24:] == bytes.fromhex("803f") * 4  # bf16 1.0 = 0x3f80, little endian
    assert sha == hashlib.sha256(payload).hexdigest()


def test_round_trip_with_small_chunks():
    state = _state()
    metas, total, sha, chunks = pack_state_dict(state, chunk_bytes=16)
    parts = list(chunks)
    assert all(len(c) == 16 for c in parts[:-1]) and 0 < len(parts[-1]) <= 16
    assert len(parts) == -(-total // 16)  # small tensors share chunks: no chunk per tensor
    payload = b"".join(parts)
    assert hashlib.sha256(payload).hexdigest() == sha
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # read-only bytes must not warn
        out = unpack(metas, payload)
    assert list(out) == list(state)
    for name, t in state.items():
        assert out[name].dtype == t.dtype and out[name].shape == t.shape
        assert torch.equal(out[name], t), name


def test_unpack_is_zero_copy_on_writable_buffers():
    state = {"w": torch.arange(6, dtype=torch.float32)}
    metas, _, _, chunks = pack_state_dict(state)
    buf = bytearray(b"".join(chunks))
    out = unpack(metas, buf)
    buf[0:4] = torch.tensor([42.0]).numpy().tobytes()
    assert out["w"][0].item() == 42.0


def test_payload_is_the_data_section_of_a_safetensors_file():
    state = _state()
    metas, _, _, chunks = pack_state_dict(state)
    prefix = safetensors_prefix(metas)
    assert (len(prefix) - 8) % 8 == 0  # data section 8-byte aligned
    loaded = st_load(prefix + b"".join(chunks))
    for name, t in state.items():
        assert torch.equal(loaded[name], t), name


def test_pack_rejects_integer_tensors():
    with pytest.raises(WeightsError, match="'ids' has dtype int64"):
        pack_state_dict({"ids": torch.arange(3)})


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda m: m[0].update(nbytes=23), r"tensors\[0\] \('a'\)\.nbytes must be 24 for shape \[2, 3\]"),
        (lambda m: m[1].update(dtype="int8"), r"tensors\[1\] \('b'\)\.dtype must be one of .*got 'int8'"),
        (lambda m: m[1].update(name="a"), r"tensors\[1\] \('a'\): name appears twice"),
        (lambda m: m[0].update(shape=[2, -3]), r"negative dimension"),
        (lambda m: m[0].update(name=""), r"tensors\[0\]\.name is empty"),
    ],
)
def test_validate_metas_names_the_field(mutate, message):
    metas, total, _, _ = pack_state_dict({"a": torch.zeros(2, 3), "b": torch.zeros(4)})
    mutate(metas)
    with pytest.raises(WeightsError, match=message):
        validate_metas(metas, total)


def test_validate_against_the_served_model():
    metas, total, _, _ = pack_state_dict({"a": torch.zeros(2, 3), "b": torch.zeros(4)})
    expected = {"a": ("float32", [2, 3]), "b": ("bfloat16", [4])}
    validate_metas(metas, total, expected)  # any float dtype is fine: the engine casts
    with pytest.raises(WeightsError, match=r"total_bytes must be 40 .*got 41"):
        validate_metas(metas, total + 1, expected)
    with pytest.raises(WeightsError, match=r"\('b'\)\.shape must be \[5\] .*got \[4\]"):
        validate_metas(metas, total, {"a": ("float32", [2, 3]), "b": ("float32", [5])})
    with pytest.raises(WeightsError, match=r"\('b'\): no tensor of that name"):
        validate_metas(metas, total, {"a": ("float32", [2, 3])})
    with pytest.raises(WeightsError, match=r"lacks 1 tensor\(s\) of the served model: c"):
        validate_metas(metas, total, {**expected, "c": ("float32", [1])})
    validate_metas(metas, total, {"a": ("float32", [2, 3])}, ignorable={"b"})  # e.g. a tied lm_head


def test_unpack_rejects_a_short_payload():
    metas, _, _, chunks = pack_state_dict({"a": torch.zeros(2, 3)})
    with pytest.raises(WeightsError, match="total_bytes must be 24"):
        unpack(metas, b"".join(chunks)[:-1])


def test_read_checkpoint_specs(tmp_path):
    save_file(
        {"x": torch.zeros(3, 2), "y": torch.zeros(4, dtype=torch.bfloat16)}, str(tmp_path / "m-1.safetensors")
    )
    save_file({"z": torch.zeros(1)}, str(tmp_path / "m-2.safetensors"))
    specs = read_checkpoint_specs(tmp_path)
    assert specs == {"x": ("float32", [3, 2]), "y": ("bfloat16", [4]), "z": ("float32", [1])}
    save_file({"z": torch.zeros(1)}, str(tmp_path / "m-3.safetensors"))
    with pytest.raises(WeightsError, match="'z' appears in more than one file"):
        read_checkpoint_specs(tmp_path)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "a.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{oops")
    with pytest.raises(WeightsError, match="not a safetensors file"):
        read_checkpoint_specs(tmp_path / "bad")
    with pytest.raises(WeightsError, match="no \\*.safetensors"):
        read_checkpoint_specs(tmp_path / "nothing-here")


def test_a_staged_payload_reads_back_in_the_worker(tmp_path):
    """The service's staging path end to end, without vLLM: prefix + pushed chunks = the file the
    worker extension memory-maps and feeds to the engine's reload."""
    from forkrl.weights.safetensors import iter_safetensors

    state = _state()
    metas, _, _, chunks = pack_state_dict(state, chunk_bytes=40)
    path = tmp_path / "v1.safetensors"
    path.write_bytes(safetensors_prefix(metas) + b"".join(chunks))
    out = dict(iter_safetensors([path]))
    assert list(out) == list(state)  # payload order = file order = the order the engine loads layers in
    for name, t in state.items():
        assert out[name].dtype == t.dtype and torch.equal(out[name], t), name


def test_a_file_is_checked_completely_before_reloading(tmp_path):
    """vLLM cannot take another reload after one that failed half-way: the rollout service (and again its worker
    extension) refuses a truncated or inconsistent file before it touches the model."""
    from forkrl.weights.safetensors import check_data_section

    path = tmp_path / "m.safetensors"
    save_file({k: v.contiguous() for k, v in _state().items()} | {"big": torch.zeros(64, 64)}, str(path))
    check_data_section(path)  # a complete file passes
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    with pytest.raises(ValueError, match=r"tensor '[\w.]+' spans bytes \[\d+, \d+\) of a \d+-byte data section"):
        check_data_section(path)
    metas, _, _, chunks = pack_state_dict({"w": torch.zeros(4)})
    lying = [dict(metas[0], shape=[5])]  # the header says 5 floats, the offsets hold 4
    prefix = safetensors_prefix(lying).replace(b'"data_offsets":[0,20]', b'"data_offsets":[0,16]')
    path.write_bytes(prefix + b"".join(chunks))
    with pytest.raises(ValueError, match=r"tensor 'w' has 16 bytes for shape \[5\]"):
        check_data_section(path)
