"""The safetensors format, read and written without loading tensors: which files hold a checkpoint's
weights, their headers, a header for a raw payload, and zero-copy tensors from a file's memory map.

One dtype table serves every reader: the trainer's push, the rollout service's checks, and the vLLM
worker extension that reloads staged weights (it runs inside vLLM's worker process and imports this).

    files = checkpoint_files("runs/x/checkpoints/step_000020")   # top-level *.safetensors, never optimizer
    specs = read_checkpoint_specs(files[0].parent)                # {name: (dtype, shape)} from headers only
    check_data_section(files[0])                                  # every tensor's bytes inside the file
    header = safetensors_prefix(metas)                            # then the raw bytes: a valid file
    for name, tensor in iter_safetensors(files): ...              # views of a private memory map
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

# Floating dtypes only travel as weights: they are pushed into a model whose parameters are floating point.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}
_TO_SAFETENSORS = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float64": "F64"}
_FROM_SAFETENSORS = {v: k for k, v in _TO_SAFETENSORS.items()}
# Everything a safetensors file may hold, for reading whole files.
_ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
# Trainer state that older layouts kept next to the weights: never model weights.
NOT_WEIGHTS = frozenset({"optimizer.safetensors"})
_MAX_HEADER = 100 << 20


class WeightsError(ValueError):
    """Weights that cannot be what the caller expects (a file that is not safetensors, metadata that does
    not match the served model, ...); the message names the file or field."""


def checkpoint_files(path: str | os.PathLike) -> list[Path]:
    """The weight files of a checkpoint: `path` itself if it is a file, else its top-level `*.safetensors`
    (sorted), never trainer state."""
    p = Path(path)
    if p.is_file():
        return [p]
    return sorted(f for f in p.glob("*.safetensors") if f.name not in NOT_WEIGHTS)


def read_header(f: str | os.PathLike) -> tuple[dict[str, Any], int]:
    """(header dict, header length n): tensor data starts at byte 8 + n."""
    with open(f, "rb") as fh:
        head = fh.read(8)
        if len(head) != 8:
            raise WeightsError(f"{f} is not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER:
            raise WeightsError(f"{f} is not a safetensors file (header length {n})")
        try:
            return json.loads(fh.read(n)), n
        except ValueError as e:
            raise WeightsError(f"{f} is not a safetensors file ({e})") from None


def read_checkpoint_specs(path: str | os.PathLike) -> dict[str, tuple[str, list[int]]]:
    """{name: (dtype, shape)} from the safetensors headers of a checkpoint (no tensor data is read)."""
    files = checkpoint_files(path)
    if not files:
        raise WeightsError(f"no *.safetensors files in {path}")
    specs: dict[str, tuple[str, list[int]]] = {}
    for f in files:
        header, _ = read_header(f)
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if name in specs:
                raise WeightsError(f"tensor {name!r} appears in more than one file of {path}")
            specs[name] = (_FROM_SAFETENSORS.get(info["dtype"], info["dtype"].lower()), list(info["shape"]))
    return specs


def safetensors_prefix(metas: Sequence[dict[str, Any]]) -> bytes:
    """The safetensors header (length + JSON) for a payload laid out as `metas` ({name, dtype, shape,
    nbytes}, in payload order) describes."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for m in metas:
        nbytes = int(m["nbytes"])
        header[m["name"]] = {
            "dtype": _TO_SAFETENSORS[m["dtype"]],
            "shape": list(m["shape"]),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned, as safetensors writes it
    return struct.pack("<Q", len(raw)) + raw


def iter_safetensors(files: Sequence[str | os.PathLike]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) in file order, as views of a private memory map of each file: no copy is
    made here (a reload copies into the parameters), which matters for files staged in /dev/shm.
    Order matters for memory too: vLLM's layerwise reload buffers a fused layer's parts until all of
    them arrived, so checkpoint order (layer by layer) keeps that small."""
    for f in files:
        header, n = read_header(f)
        with open(f, "rb") as fh:
            # ACCESS_COPY: writable views (torch.frombuffer wants them) that never write to the file
            mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY) if os.path.getsize(f) > 8 + n else None
        entries = sorted(
            ((k, v) for k, v in header.items() if k != "__metadata__"), key=lambda kv: kv[1]["data_offsets"][0]
        )
        for name, info in entries:
            start, end = info["data_offsets"]
            dtype = _ST_DTYPES[info["dtype"]]
            if end == start:
                yield name, torch.empty(info["shape"], dtype=dtype)
                continue
            raw = torch.frombuffer(mm, dtype=torch.uint8, count=end - start, offset=8 + n + start)
            yield name, raw.view(dtype).reshape(info["shape"])
        del mm  # closed once the last view is gone


def check_data_section(path: str | os.PathLike) -> None:
    """Every tensor's bytes lie inside the file and match its dtype and shape (WeightsError naming the tensor).

    vLLM's in-place reload swaps each layer's parameters for placeholders first and restores them only
    when the whole iterator was consumed: a file that fails half-way (truncated, a bad header) would leave
    the model unable to take any later reload. So a file is checked completely before the reload starts (by the
    rollout service before the engine is touched, and again by the worker extension)."""
    header, n = read_header(path)
    data = os.path.getsize(path) - 8 - n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        dtype = _ST_DTYPES.get(info["dtype"])
        if dtype is None:
            raise WeightsError(f"{path}: tensor {name!r} has unknown dtype {info['dtype']!r}")
        if not 0 <= start <= end <= data:
            raise WeightsError(f"{path}: tensor {name!r} spans bytes [{start}, {end}) of a {data}-byte data section "
                               "(a truncated file?)")
        if end - start != math.prod(info["shape"]) * dtype.itemsize:
            raise WeightsError(f"{path}: tensor {name!r} has {end - start} bytes for shape {info['shape']}")
