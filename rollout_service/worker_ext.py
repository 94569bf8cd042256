"""vLLM worker extension: in-place weight reload from safetensors files.

The engine is started with `worker_extension_cls="rollout_service.worker_ext.WeightReloadExtension"`, so
these methods run inside vLLM's worker process and are called through `engine.collective_rpc(...)`.

Why a path and not tensors: on the CPU backend, tensors passed as `collective_rpc` arguments arrive as
pickled lists (slow, small ones fail), and `model.load_weights` after start-up fails because linear
weights were repacked into oneDNN handles. The worker's `reload_weights(weights_iterator=...)` re-runs
the packing and works (vllm-cpu-notes.md, "In-place weight reload"). The rollout service therefore
stages pushed weights as a safetensors file (in /dev/shm when it exists) and passes its path.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import torch

# bf16 engines on CPU die with SIGILL inside the attention kernels unless AMX tiles were requested for
# the process before first use; the worker imports this module at start-up, which is early enough.
if hasattr(torch.cpu, "_init_amx"):
    try:
        torch.cpu._init_amx()
    except Exception:  # not an AMX machine, or the kernel refused: the fp32 path does not need it
        pass


def safetensors_files(path: str | Path) -> list[Path]:
    """The `*.safetensors` files named by `path` (one file, or every such file in a directory)."""
    p = Path(path)
    if p.is_file():
        return [p]
    return sorted(p.glob("*.safetensors"))


_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) in file order, as views of a private memory map of each file: no copy is
    made here (the reload copies into the parameters), which matters for files staged in /dev/shm.
    Order matters for memory too: vLLM's layerwise reload buffers a fused layer's parts until all of
    them arrived, so checkpoint order (layer by layer) keeps that small."""
    for f in files:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
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


class WeightReloadExtension:
    """Mixed into vLLM's worker class; `self` is the worker (it has `reload_weights`)."""

    def forkrl_reload_safetensors(self, path: str) -> dict[str, float | int]:
        """Reload every tensor in the safetensors file(s) at `path`; returns counts and seconds."""
        start = time.perf_counter()
        files = safetensors_files(path)
        if not files:
            raise FileNotFoundError(f"no *.safetensors under {path}")
        count = 0

        def counted() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal count
            for item in iter_safetensors(files):
                count += 1
                yield item

        self.reload_weights(weights_iterator=counted())  # type: ignore[attr-defined]
        return {"tensors": count, "seconds": time.perf_counter() - start}
