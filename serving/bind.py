"""The start-up rule of every forkrl service: a service without a token listens only on a loopback address.

    refuse_open_bind("trainer service", settings.host, settings.auth_token())   # SystemExit, or a warning
"""

from __future__ import annotations

import ipaddress
import logging

from forkrl.security import TOKEN_ENV, TOKEN_FILE_ENV

log = logging.getLogger("serving")


def is_loopback(host: str) -> bool:
    """Whether binding `host` reaches only this machine (127.0.0.0/8, ::1, localhost)."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False


def refuse_open_bind(service: str, host: str, token: str | None) -> None:
    """The start-up rule: no token on a non-loopback address → SystemExit; no token on loopback → a warning."""
    if token:
        return
    if not is_loopback(host):
        raise SystemExit(
            f"{service}: refusing to listen on {host} without a token: anyone who reaches it could use it. "
            f"Set {TOKEN_ENV} or {TOKEN_FILE_ENV} (or --token-file), or bind 127.0.0.1.")
    log.warning("%s: NO TOKEN SET: every local user and process can call this service on %s. "
                "Set %s or %s to require one.", service, host, TOKEN_ENV, TOKEN_FILE_ENV)
