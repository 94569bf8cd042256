"""torchrun for one node, with its rendezvous store on 127.0.0.1 only.

    python -m forkrl.launch --nproc-per-node 2 -m trainer_service --port 50052 --runs-root runs

takes torchrun's arguments (`python -m torch.distributed.run`) less the rendezvous ones: it runs torchrun's static
rendezvous (`--nnodes 1 --rdzv-backend static --master-addr 127.0.0.1`) on a port it picked itself. Why not
`torchrun --standalone` (or `--rdzv-endpoint 127.0.0.1:PORT`, or `--master-addr 127.0.0.1`): torch's TCPStore
server binds every interface whatever host it is given, and the ranks exchange pickled objects through it (and
through the process group it sets up), so anyone on the network who reaches the port could read or write them.
Here the store is served from a socket this module bound to 127.0.0.1 (TCPStore's `master_listen_fd`, as
vLLM's `create_tcp_store` does): nothing of the run listens beyond the loopback (the ranks' gloo pairs bind to
127.0.0.1, where the rendezvous is). Several nodes: torchrun itself (docs/scaling.md), on a network of its own.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Sequence
from typing import Any

ADDRESS = "127.0.0.1"
OWN = ("--standalone", "--nnodes", "--rdzv-backend", "--rdzv_backend", "--rdzv-endpoint", "--rdzv_endpoint",
       "--rdzv-id", "--rdzv_id", "--rdzv-conf", "--rdzv_conf", "--master-addr", "--master_addr", "--master-port",
       "--master_port", "--node-rank", "--node_rank")


def torchrun_args(argv: Sequence[str], port: int) -> list[str]:
    """torchrun's arguments for `argv` (the caller's, up to the script or -m): one node, the store at
    127.0.0.1:port. A rendezvous argument of the caller's is refused by name."""
    from torch.distributed.run import get_args_parser

    actions = get_args_parser()._option_string_actions
    value = False  # the word is the value of the option before it
    for arg in argv:
        name = arg.split("=", 1)[0]
        if value:
            value = False
        elif name in OWN:
            raise SystemExit(f"forkrl.launch: {name} is set by forkrl.launch (one node, the rendezvous on "
                             f"{ADDRESS}); for several nodes run torchrun itself")
        elif not arg.startswith("-"):
            break  # the script (or, after -m, the module) and its own arguments follow
        else:
            value = "=" not in arg and name in actions and actions[name].nargs != 0
    return ["--nnodes", "1", "--rdzv-backend", "static", "--master-addr", ADDRESS, "--master-port", str(port),
            *argv]


def serve_store_from(listen: socket.socket) -> None:
    """Make the static rendezvous's TCPStore server (this process, torchrun's agent) serve from `listen`."""
    from torch.distributed.elastic.rendezvous import static_tcp_rendezvous

    store_cls = static_tcp_rendezvous.TCPStore

    def tcp_store(*args: Any, **kwargs: Any) -> Any:
        is_master = kwargs.get("is_master", args[3] if len(args) > 3 else False)
        if is_master and "master_listen_fd" not in kwargs and listen.fileno() != -1:
            kwargs["master_listen_fd"] = listen.detach()  # the store owns it now
        return store_cls(*args, **kwargs)

    static_tcp_rendezvous.TCPStore = tcp_store  # type: ignore[misc,assignment]


def main(argv: Sequence[str] | None = None) -> None:
    from torch.distributed.run import main as torchrun

    listen = socket.create_server((ADDRESS, 0))
    args = torchrun_args(sys.argv[1:] if argv is None else argv, listen.getsockname()[1])
    serve_store_from(listen)
    torchrun(args)


if __name__ == "__main__":
    main()
