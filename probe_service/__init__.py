"""HTTP probe service: runs `forkrl.probe` jobs on checkpoints and serves their outputs.

    python -m probe_service --host 127.0.0.1 --port 8000 --allowed-roots runs,models
    curl -X POST localhost:8000/probe -H 'content-type: application/json' \
         -d '{"checkpoint_root": "runs/x/checkpoints", "steps": [20, 80], "include_final": true}'
"""
