"""Model weights on the wire: a state dict as (tensor metadata, one byte payload, sha256), never pickle.

The payload is the tensors' raw bytes, one after the other in metadata order, so it is exactly the data
section of a safetensors file: the receiver can write `safetensors_prefix(metas)` and then the chunks as
they arrive, and end up with a valid `.safetensors` file without holding a second copy in memory.

    metas, total_bytes, sha256_hex, chunks = pack_state_dict(model.state_dict())
    for chunk in chunks: ...                       # <= 4 MiB each
    state = unpack(metas, payload)                 # dtype/shape/byte-count checked

`metas` are plain dicts {"name", "dtype", "shape", "nbytes"} (the fields of the rollout proto's
TensorMeta); dtype names are torch's without the prefix ("float32", "bfloat16", ...).
"""

from __future__ import annotations

import hashlib
import math
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from forkrl.weights.safetensors import DTYPES, WeightsError

CHUNK_BYTES = 4 << 20  # gRPC's default message limit is 4 MiB; chunks stay at or under it

TensorMeta = dict[str, Any]  # {"name": str, "dtype": str, "shape": list[int], "nbytes": int}


class PackedStateDict(NamedTuple):
    metas: list[TensorMeta]
    total_bytes: int
    sha256: str
    chunks: Iterator[bytes]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _byte_view(t: torch.Tensor) -> memoryview:
    """The tensor's bytes without a copy (CPU, contiguous); 0-d tensors are reshaped first."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def tensor_metas(state: Mapping[str, torch.Tensor]) -> list[TensorMeta]:
    """{name, dtype, shape, nbytes} of each tensor in order, from shapes alone (no data is touched)."""
    metas: list[TensorMeta] = []
    for name, t in state.items():
        name_dtype = dtype_name(t.dtype)
        if name_dtype not in DTYPES:
            raise WeightsError(f"tensor {name!r} has dtype {name_dtype}; only {', '.join(DTYPES)} are sent")
        metas.append({"name": name, "dtype": name_dtype, "shape": list(t.shape),
                      "nbytes": t.numel() * t.element_size()})
    return metas


def _on_cpu(t: torch.Tensor) -> torch.Tensor:
    """`t` as a contiguous CPU tensor: itself when it already is one, else a copy of this tensor alone."""
    return t.detach().to("cpu").contiguous()


def pack_state_dict(state: Mapping[str, torch.Tensor], chunk_bytes: int = CHUNK_BYTES) -> PackedStateDict:
    """Describe `state` and stream its bytes, tensor by tensor.

    Memory: contiguous CPU tensors are read in place. Any other tensor (on a GPU, non-contiguous) is
    copied to CPU alone, once for the checksum pass and once more when the chunk iterator reaches it, and
    dropped after each: at most one tensor's copy and one `chunk_bytes` buffer are alive at a time, never a
    second copy of the whole state (`tests/unit/test_weights_stream.py` counts it).
    """
    if not 0 < chunk_bytes <= CHUNK_BYTES:
        raise ValueError(f"chunk_bytes must be in (0, {CHUNK_BYTES}], got {chunk_bytes}")
    metas = tensor_metas(state)
    digest = hashlib.sha256()
    for t in state.values():
        digest.update(_byte_view(_on_cpu(t)))
    total = sum(int(m["nbytes"]) for m in metas)
    return PackedStateDict(metas, total, digest.hexdigest(), _chunks(state.values(), chunk_bytes))


def _chunks(tensors: Iterable[torch.Tensor], chunk_bytes: int) -> Iterator[bytes]:
    # Small tensors (norms, biases) are packed together: one message per tensor would mean thousands
    # of tiny messages for a real model. Whole chunks inside a large tensor are copied once, directly.
    buf = bytearray()
    for t in tensors:
        view = _byte_view(_on_cpu(t))
        pos = 0
        while pos < view.nbytes:
            if not buf and view.nbytes - pos >= chunk_bytes:
                yield view[pos : pos + chunk_bytes].tobytes()
                pos += chunk_bytes
                continue
            take = min(chunk_bytes - len(buf), view.nbytes - pos)
            buf += view[pos : pos + take]
            pos += take
            if len(buf) == chunk_bytes:
                yield bytes(buf)
                buf.clear()
        del view
    if buf:
        yield bytes(buf)


def validate_metas(
    metas: Sequence[TensorMeta],
    total_bytes: int,
    expected: Mapping[str, tuple[str, list[int]]] | None = None,
    ignorable: Iterable[str] = (),
    field: str = "tensors",
) -> None:
    """Check metadata on its own (known dtypes, byte counts, total) and, with `expected`
    ({name: (dtype, shape)} of the served model), names and shapes. Any floating dtype is accepted for
    an expected tensor (the engine casts). Names in `ignorable` may be present or absent (e.g. a tied
    lm_head). Raises WeightsError naming the offending field."""
    if not metas:
        raise WeightsError(f"{field} is empty")
    seen: set[str] = set()
    running = 0
    ignorable = set(ignorable)
    for i, m in enumerate(metas):
        name, dtype, shape, nbytes = m["name"], m["dtype"], list(m["shape"]), int(m["nbytes"])
        where = f"{field}[{i}] ({name!r})"
        if not name:
            raise WeightsError(f"{field}[{i}].name is empty")
        if name in seen:
            raise WeightsError(f"{where}: name appears twice")
        seen.add(name)
        if dtype not in DTYPES:
            raise WeightsError(f"{where}.dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        if any(d < 0 for d in shape):
            raise WeightsError(f"{where}.shape has a negative dimension: {shape}")
        want = math.prod(shape) * DTYPES[dtype].itemsize
        if nbytes != want:
            raise WeightsError(
                f"{where}.nbytes must be {want} for shape {shape} and dtype {dtype}, got {nbytes}"
            )
        running += nbytes
        if expected is not None and name not in ignorable:
            if name not in expected:
                raise WeightsError(f"{where}: no tensor of that name in the served model")
            exp_shape = list(expected[name][1])
            if shape != exp_shape:
                raise WeightsError(f"{where}.shape must be {exp_shape} (the served model's), got {shape}")
    if running != total_bytes:
        raise WeightsError(f"total_bytes must be {running} (the sum of {field}[].nbytes), got {total_bytes}")
    if expected is not None:
        missing = sorted(set(expected) - seen - ignorable)
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise WeightsError(f"{field} lacks {len(missing)} tensor(s) of the served model: {shown}")


def unpack(metas: Sequence[TensorMeta], payload: bytes | bytearray | memoryview) -> dict[str, torch.Tensor]:
    """Tensors from a payload, zero-copy: the tensors alias `payload`. Treat them as read-only when the
    payload is `bytes` (clone them to modify)."""
    view = memoryview(payload).cast("B")
    validate_metas(metas, view.nbytes)
    out: dict[str, torch.Tensor] = {}
    offset = 0
    with warnings.catch_warnings():
        # torch warns on read-only buffers (bytes); the docstring says what that means for the caller.
        warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
        for m in metas:
            dtype, nbytes = DTYPES[m["dtype"]], int(m["nbytes"])
            if nbytes == 0:
                out[m["name"]] = torch.empty(list(m["shape"]), dtype=dtype)
                continue
            raw = torch.frombuffer(view, dtype=torch.uint8, count=nbytes, offset=offset)
            out[m["name"]] = raw.view(dtype).reshape(list(m["shape"]))
            offset += nbytes
    return out
