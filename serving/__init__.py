"""What the forkrl services share as servers, outside the core (which holds no server code).

`grpc_server.py`: the options, token interceptor and (TLS) listening of every grpc.aio server;
`bind.py`: the start-up rule of every service (no token: loopback only). The services import this package;
the core (`forkrl/`) and the client scripts (`clients/`) never do (tests/unit/test_layout.py).
"""
