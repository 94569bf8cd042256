"""The rollout service: vLLM's async engine behind gRPC, with in-place weight reloads.

Entry point `python -m rollout_service`; settings in `config.py`, gRPC wiring in `server.py`, the logic in
`engine.py` (validation, generation, versions, swaps) with `gate.py` (drain, then swap), `receive.py`
(receiving pushed weights) and `types.py` (errors, records, the Backend protocol); `vllm_backend.py` is the
only code that touches vLLM, and `worker_ext.py` the part that runs inside vLLM's worker.
"""
