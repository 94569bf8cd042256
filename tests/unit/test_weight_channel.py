"""The weight channel's checks at their seam, on CPU, without vLLM's engine (forkrl/weights/transfer_gloo.py,
transfer_auth.py, guard.py): a real gloo group of two in-process members (the trainer's sender and one receiving
worker) over a real TCPStore, and a stand-in model that records what it loads.

- a chunk whose bytes were altered on the socket (the sender broadcasts other bytes than it digested) is refused
  before any of it is loaded; so is a chunk without a digest; the genuine chunk loads;
- a tensor finite in float32 but not in the served float16 is refused (gloo), and on vLLM's other routes
  (`guard_receives`: nccl on a GPU, played by an engine whose receive hands tensors straight to load_weights);
- the store's keys: a client without the secret finds nothing under the address-derived name the group used
  to have, and the secret itself is never written to the store; an init info without a secret is refused.
"""

from __future__ import annotations

import datetime
import socket
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.distributed import TCPStore

from forkrl.weights import transfer_gloo as tg
from forkrl.weights.guard import NonFiniteWeights, guard_receives
from forkrl.weights.transfer_auth import TamperedWeights, chunk_digest, store_prefix

SECRET = "5e" * 32


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.loaded: list[tuple[str, torch.Tensor]] = []

    def load_weights(self, weights: Any) -> None:
        for name, t in weights:
            self.loaded.append((name, t.clone()))


def _worker(group: Any, served: torch.dtype) -> Any:
    w = tg.GlooWeightTransferEngine.__new__(tg.GlooWeightTransferEngine)  # no vLLM config: only the receive
    w.group, w.secret, w._ahead, w.in_update = group, SECRET, None, True
    w.model, w.model_config = Model(), SimpleNamespace(dtype=served)
    return w


@pytest.fixture
def pair() -> Iterator[tuple[Any, Any, int]]:
    """(sender group, worker group, store port): a 2-member group as trainer_init forms it."""
    listen = socket.create_server(("127.0.0.1", 0))
    port = listen.getsockname()[1]
    got: dict[int, Any] = {}
    t = threading.Thread(target=lambda: got.__setitem__(1, tg._join("127.0.0.1", port, 1, 2, 30, SECRET)))
    t.start()
    sender = tg._join("127.0.0.1", port, 0, 2, 30, SECRET, listen=listen)
    t.join(60)
    yield sender, got[1], port
    for g in (sender, got[1]):
        g.shutdown()


def _push(sender: Any, worker: Any, tensors: dict[str, torch.Tensor], *, on_wire: dict[str, torch.Tensor] | None
          = None, digest: str | None = None) -> BaseException | None:
    """Broadcast `on_wire` (default: `tensors`) while the worker receives a chunk whose digest is the sender's
    digest of `tensors`; the worker's error, if any."""
    specs = [(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in tensors.items()]
    info = tg.GlooWeightTransferUpdateInfo([s[0] for s in specs], [s[1] for s in specs], [s[2] for s in specs],
                                           digest=chunk_digest(SECRET, specs, list(tensors.values()))
                                           if digest is None else digest)
    works = [tg._post(sender, t) for t in (on_wire or tensors).values()]
    try:
        worker.receive_weights(info)
        error = None
    except (TamperedWeights, NonFiniteWeights) as e:
        error = e
    for w in works:
        w.wait()
    return error


def test_a_chunk_altered_on_the_wire_is_refused_before_any_of_it_loads(pair: tuple[Any, Any, int]) -> None:
    sender, group, _ = pair
    worker = _worker(group, torch.float32)
    genuine = {"a.weight": torch.randn(4, 3), "b.bias": torch.randn(5).to(torch.bfloat16)}
    altered = {"a.weight": genuine["a.weight"].clone(), "b.bias": genuine["b.bias"].clone()}
    altered["b.bias"][2] += 1  # one element, in the chunk's last tensor
    error = _push(sender, worker, genuine, on_wire=altered)
    assert isinstance(error, TamperedWeights) and "does not match the digest" in str(error)
    assert worker.model.loaded == []  # not even the unaltered first tensor
    assert isinstance(_push(sender, worker, genuine, digest=""), TamperedWeights)  # no digest: refused
    assert isinstance(_push(sender, worker, genuine, digest="00" * 32), TamperedWeights)  # a forged one
    assert isinstance(_push(sender, worker, genuine, digest="é" * 64), TamperedWeights)  # not even hex
    assert worker.model.loaded == []
    assert _push(sender, worker, genuine) is None
    assert [n for n, _ in worker.model.loaded] == list(genuine)
    assert all(torch.equal(t, genuine[n]) for n, t in worker.model.loaded)


def test_a_value_finite_in_float32_is_refused_for_a_float16_model_on_the_gloo_route(pair: tuple[Any, Any, int]
                                                                                    ) -> None:
    sender, group, _ = pair
    worker = _worker(group, torch.float16)
    chunk = {"a.weight": torch.ones(3), "b.weight": torch.ones(2, 2)}
    chunk["b.weight"][1, 1] = 7e4
    error = _push(sender, worker, chunk)
    assert isinstance(error, NonFiniteWeights) and "'b.weight' holds NaN or inf" in str(error)
    assert worker.model.loaded == []


def test_the_store_holds_nothing_an_intruder_can_name_and_never_the_secret(pair: tuple[Any, Any, int]) -> None:
    _, _, port = pair
    intruder = TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=2))
    keys = intruder.list_keys()
    assert keys and all(k.startswith(store_prefix(SECRET)) for k in keys)
    assert not any(SECRET in k for k in keys)
    assert not any(k.startswith("forkrl-weights/127.0.0.1") for k in keys)  # the old name: derived from the address
    with pytest.raises(ValueError, match="secret must be 32 bytes in hex"):
        tg.GlooWeightTransferInitInfo(master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=2)


class _NcclLike:
    """vLLM's nccl engine's shape: receive_weights hands each received tensor straight to model.load_weights."""

    def __init__(self, served: torch.dtype, tensors: list[tuple[str, torch.Tensor]]) -> None:
        self.model, self.model_config, self.tensors = Model(), SimpleNamespace(dtype=served), tensors

    def receive_weights(self, update_info: Any) -> None:
        self.model.load_weights(iter(self.tensors))


def test_every_other_route_loads_only_tensors_finite_in_the_served_dtype() -> None:
    big = torch.ones(3)
    big[1] = 7e4
    fine = [("a", torch.ones(2)), ("b", big), ("c", torch.ones(2))]
    engine = guard_receives(_NcclLike(torch.float16, fine))
    with pytest.raises(NonFiniteWeights, match="'b' holds NaN or inf"):
        engine.receive_weights(None)
    assert [n for n, _ in engine.model.loaded] == ["a"]  # nothing from the bad tensor on
    assert "load_weights" not in vars(engine.model)  # the model's own method again
    engine = guard_receives(_NcclLike(torch.float32, fine))  # finite in float32: loaded
    engine.receive_weights(None)
    assert [n for n, _ in engine.model.loaded] == ["a", "b", "c"]
    nan = guard_receives(_NcclLike(torch.bfloat16, [("x", torch.tensor([float("nan")]))]))
    with pytest.raises(NonFiniteWeights):
        nan.receive_weights(None)


@pytest.mark.parametrize("value", ["0.0.0.0", "0.0.0.0:29500", "::", "[::]:29500"])
def test_the_rendezvous_is_never_every_interface(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    from forkrl.training.transfer_route import TRANSFER_ADDRESS_ENV, transfer_address

    monkeypatch.setenv(TRANSFER_ADDRESS_ENV, value)
    with pytest.raises(ValueError, match=f"{TRANSFER_ADDRESS_ENV} must be an address of this host"):
        transfer_address()
    monkeypatch.setenv(TRANSFER_ADDRESS_ENV, "10.1.2.3:29500")
    assert transfer_address() == ("10.1.2.3", 29500)


def _listening() -> set[tuple[str, int]]:
    """(IPv4 address, port) of every TCP socket this process listens on (/proc/net/tcp, by the inodes of its fds)."""
    import os

    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = set()
    for line in open("/proc/self/net/tcp").read().splitlines()[1:]:
        f = line.split()
        if f[3] == "0A" and f[9] in inodes:  # LISTEN
            host, port = f[1].split(":")
            out.add((socket.inet_ntoa(bytes.fromhex(host)[::-1]), int(port, 16)))
    return out


def test_the_group_listens_on_the_address_it_meets_on_not_the_host_names(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sender's pair sockets listen on the rendezvous address it was given, a worker's on its own address on
    the route to it (`local_address`), never where the host name resolves: on a host whose name maps to 127.0.0.1
    (every simulated host of scripts/cluster_sim.py without its own hostname; many real nodes) a worker advertised
    loopback to the trainer and a cross-host push failed. Played on loopback: the store at 127.0.0.2, the worker's
    route address 127.0.0.3 (the machine's name resolves to neither); the TCPStore on the given address only."""
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("reads /proc/self/net/tcp")
    monkeypatch.setattr(tg, "local_address", lambda address, port: "127.0.0.3")
    before = _listening()
    listen = socket.create_server(("127.0.0.2", 0))
    port = listen.getsockname()[1]
    got: dict[int, Any] = {}
    t = threading.Thread(target=lambda: got.__setitem__(1, tg._join("127.0.0.2", port, 1, 2, 30, SECRET)))
    t.start()
    sender = tg._join("127.0.0.2", port, 0, 2, 30, SECRET, listen=listen)
    t.join(60)
    try:
        opened = _listening() - before
        assert ("127.0.0.2", port) in opened  # the store
        assert {a for a, _ in opened} == {"127.0.0.2", "127.0.0.3"}, opened  # pairs: sender's, worker's, nothing else
        x = torch.arange(6, dtype=torch.float32)
        y = torch.zeros(6)
        works = [tg._post(sender, x), tg._post(got[1], y)]
        for w in works:
            w.wait()
        assert torch.equal(x, y)
    finally:
        for g in (sender, got.get(1)):
            if g is not None:
                g.shutdown()
