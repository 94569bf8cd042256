"""The weight channel's authentication (forkrl/weights/transfer_gloo.py): a secret per group, the store's key
prefix derived from it, and the keyed digest of each chunk.

The TCPStore and gloo's pair sockets take no credentials, so nothing received on them is trusted alone. The
trainer draws the group's secret (`new_secret`, 32 bytes) and hands it to the workers only over the authenticated
gRPC call (InitWeightTransfer: token + TLS). The rendezvous keys live under `store_prefix(secret)`, a one-way
function of it (a store client can list keys once written, never read the secret back). Each chunk's
UpdateWeightChunk carries `chunk_digest`: keyed BLAKE3 (a MAC) of the chunk's names, dtypes, shapes and tensor
bytes, in order; a worker computes the same over the bytes it received (`digest_behind`, each tensor hashed as
its receive completes) and compares in constant time (`check_digest`) before loading any of it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import blake3
import torch

SECRET_BYTES = 32
Spec = tuple[str, str, list[int]]  # one tensor of a chunk: name, dtype name, shape


class TamperedWeights(ValueError):
    """The received bytes of a chunk do not match the digest the trainer sent over gRPC: refused, nothing loaded."""


def new_secret() -> str:
    """A group's secret, hex."""
    return secrets.token_hex(SECRET_BYTES)


def secret_bytes(hex_secret: str) -> bytes:
    """The secret's bytes; ValueError naming `secret` unless it is SECRET_BYTES in hex."""
    try:
        key = bytes.fromhex(hex_secret)
    except ValueError:
        key = b""
    if len(key) != SECRET_BYTES:
        raise ValueError(f"secret must be {SECRET_BYTES} bytes in hex (the trainer draws it per group), got "
                         f"{len(hex_secret)} characters")
    return key


def store_prefix(hex_secret: str) -> str:
    """The rendezvous keys' prefix: derived from the secret one way (a store client may list it, never invert it)."""
    name = hmac.new(secret_bytes(hex_secret), b"forkrl-store", hashlib.sha256).hexdigest()[:32]
    return f"forkrl-weights/{name}"


def _chunk_mac(hex_secret: str, specs: Sequence[Spec]) -> Any:
    # BLAKE3's keyed mode is a MAC, several times faster per core than HMAC-SHA256 (a push hashes every byte twice)
    mac = blake3.blake3(b"forkrl-chunk\0", key=secret_bytes(hex_secret), max_threads=1)
    mac.update(json.dumps([list(s) for s in specs]).encode())
    return mac


def _bytes(t: torch.Tensor) -> Any:
    return t.detach().reshape(-1).view(torch.uint8).numpy()


def chunk_digest(hex_secret: str, specs: Sequence[Spec], tensors: Sequence[torch.Tensor]) -> str:
    """Keyed BLAKE3 (the group's secret) of a chunk: its specs (name, dtype, shape) and each tensor's bytes, in
    order (hex)."""
    mac = _chunk_mac(hex_secret, specs)
    for t in tensors:
        mac.update(_bytes(t))
    return mac.hexdigest()


def digest_behind(hex_secret: str, specs: Sequence[Spec], tensors: Sequence[torch.Tensor],
                  works: Sequence[Any]) -> Future[str]:
    """`chunk_digest` of tensors still being received (`works`: their receives), each hashed as its receive
    completes, on a thread of its own (blake3 releases the GIL on large inputs: it runs beside the loading of the
    chunk before; a daemon, so a receive that never completes holds no exit)."""
    done: Future[str] = Future()

    def run() -> None:
        try:
            mac = _chunk_mac(hex_secret, specs)
            for t, work in zip(tensors, works, strict=True):
                work.wait()
                mac.update(_bytes(t))
            done.set_result(mac.hexdigest())
        except BaseException as e:  # noqa: BLE001 - the receive's error, raised where the chunk is taken
            done.set_exception(e)

    threading.Thread(target=run, name="forkrl-gloo-digest", daemon=True).start()
    return done


def check_digest(received: str, sent: str, specs: Sequence[Spec]) -> None:
    """TamperedWeights unless the digest of the received bytes equals the one the trainer sent (constant time)."""
    if not sent:
        raise TamperedWeights("the chunk carries no digest (the trainer sends one with every chunk): refused, none "
                              "of it was loaded")
    if not hmac.compare_digest(received.encode(), sent.encode()):
        raise TamperedWeights(f"the chunk of {len(specs)} tensor(s) from {specs[0][0]!r} does not match the digest "
                              "the trainer sent (altered or injected on the weight channel); none of it was loaded")
