"""The rollout service: vLLM's async engine behind gRPC, with in-place weight reloads.

Entry point `python -m rollout_service`; settings in `config.py`, gRPC wiring in `server.py`, the logic in
`engine.py`, the vLLM worker extension in `worker_ext.py`.
"""
