"""Start the probe service.

    python -m probe_service --host 127.0.0.1 --port 8000 --allowed-roots runs,models

Every flag can also be set as PROBE_<FLAG> in the environment (e.g. PROBE_PORT=8000).
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str] | None = None) -> int:
    from probe_service.config import parse_settings

    settings = parse_settings(argv)  # parses (and answers --help) before torch is imported
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # read when torch is imported
        os.environ.setdefault(var, str(settings.threads))
    import signal

    import uvicorn

    from probe_service.app import create_app

    # uvicorn shuts down gracefully on SIGTERM/SIGINT, then re-raises the signal against the handlers that
    # were in place before it started. Make those "exit 0", so a graceful stop is not reported as a kill.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: sys.exit(0))

    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level=settings.log_level)
    return 0


if __name__ == "__main__":
    sys.exit(main())
