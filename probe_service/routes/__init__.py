"""The probe service's routes: `jobs.py` (submit, list, status, cancel), `outputs.py` (a done job's records,
manifest, plots and report), `ops.py` (/healthz, open; /metrics). Each module's `router` needs the token when the
service has one (`create_app` includes it with the token's dependencies); `ops.open_router` never does."""
