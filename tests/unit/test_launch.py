"""forkrl/launch.py: torchrun on one node with its rendezvous on 127.0.0.1; the arguments it sets itself are
refused by name (the 2-rank run that checks nothing listens beyond the loopback:
tests/dist/test_transfer_two_ranks.py)."""

from __future__ import annotations

import pytest

from forkrl.launch import torchrun_args


def test_one_node_with_the_store_on_the_loopback() -> None:
    args = torchrun_args(["--nproc-per-node", "2", "-m", "trainer_service", "--port", "0"], 4242)
    assert args == ["--nnodes", "1", "--rdzv-backend", "static", "--master-addr", "127.0.0.1", "--master-port",
                    "4242", "--nproc-per-node", "2", "-m", "trainer_service", "--port", "0"]


@pytest.mark.parametrize("arg", ["--standalone", "--rdzv-endpoint=0.0.0.0:29400", "--master-addr", "--nnodes"])
def test_a_rendezvous_argument_is_refused_by_name(arg: str) -> None:
    with pytest.raises(SystemExit, match=arg.split("=")[0]):
        torchrun_args(["--nproc-per-node", "2", arg, "script.py"], 4242)


def test_the_scripts_own_arguments_are_its_own() -> None:
    args = torchrun_args(["--nproc-per-node", "2", "worker.py", "--master-addr", "x"], 1)
    assert args[-3:] == ["worker.py", "--master-addr", "x"]
    args = torchrun_args(["--nproc-per-node=2", "-m", "trainer_service", "--nnodes", "x"], 1)
    assert args[-4:] == ["-m", "trainer_service", "--nnodes", "x"]
