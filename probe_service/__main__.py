"""Start the probe service.

    python -m probe_service --host 127.0.0.1 --port 8000 --allowed-roots runs,models
    python -m probe_service --help          # every flag; each also reads PROBE_<FLAG>

The CLI is parsed before torch is imported, so --help and bad flags answer at once.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    from forkrl.cli import parse_settings
    from probe_service.config import ProbeSettings

    settings = parse_settings(ProbeSettings, argv)
    from serving.bind import refuse_open_bind

    refuse_open_bind("probe service", settings.host, settings.auth_token())  # no token: loopback only
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # read when torch is imported
        os.environ.setdefault(var, str(settings.threads))
    import signal

    import uvicorn

    from probe_service.app import create_app

    # uvicorn shuts down gracefully on SIGTERM/SIGINT, then re-raises the signal against the handlers that
    # were in place before it started. Make those "exit 0", so a graceful stop is not reported as a kill.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: sys.exit(0))

    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level=settings.log_level,
                ssl_certfile=settings.tls_cert_file, ssl_keyfile=settings.tls_key_file)  # TLS when both are set
    return 0


if __name__ == "__main__":
    sys.exit(main())
