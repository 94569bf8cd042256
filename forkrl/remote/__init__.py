"""Calling the forkrl services from the core and the scripts: `rollout.py` (RolloutClient and RolloutWeightSync:
deadlines, health waits, retries of UNAVAILABLE only) and `channel.py` (the gRPC channel and HTTP headers that
carry the token, TLS by FORKRL_TLS_CA). Named `remote`, not `clients`: `clients/` at the top is the scripts a
person runs."""
