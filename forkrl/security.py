"""The shared bearer token of the forkrl services and the confinement of request paths: the rules, no server.

    token = load_token()                        # FORKRL_TOKEN, else the file named by FORKRL_TOKEN_FILE, else None
    check_authorization("Bearer abc", token)    # None when it is the token, else the sentence a refused client gets
    confine_path(p, roots, "run_dir", "the trainer's runs_root (--runs-root)")   # the real path, or refused

All three services take one token (`--token-file` / `FORKRL_TOKEN_FILE`, or `FORKRL_TOKEN`); every RPC and
route but the health checks (and gRPC reflection) needs it. The local launcher and compose.yaml create a token
when none is given:

    python -m forkrl.security ensure-token /data/secrets/token     # keeps an existing file; 0600, folder 0700

A token file must be private: owned by the user reading it and without any permission for group or others (0600
or 0400); any other is refused with the chmod/chown that fixes it (UnsafeTokenFile), by services and clients alike.

Where the rules are applied: the services' gRPC interceptor, server options, TLS listening and the loopback-only
rule without a token are in `serving/` (outside the core: the core holds no server code); the clients' channel,
metadata and HTTP headers in `forkrl/remote/channel.py`; the probe's HTTP check in `probe_service/`.

Paths a request names are confined to the roots a service is configured with (`confine_path`: '..' refused,
symlinks followed). Comparison is constant-time (hmac.compare_digest).
"""

from __future__ import annotations

import hmac
import os
import secrets
import stat
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

TOKEN_ENV = "FORKRL_TOKEN"
TOKEN_FILE_ENV = "FORKRL_TOKEN_FILE"
# TLS (optional): the services read a certificate and key, the clients a CA file; set, the clients use TLS.
TLS_CERT_ENV = "FORKRL_TLS_CERT"
TLS_KEY_ENV = "FORKRL_TLS_KEY"
TLS_CA_ENV = "FORKRL_TLS_CA"
TLS_SERVER_NAME_ENV = "FORKRL_TLS_SERVER_NAME"  # the name to check the certificate for, when not the address's
HEADER = "authorization"
# What a refused client is told: how to give it the token.
HOW_TO_SET = (f"set {TOKEN_ENV} (or {TOKEN_FILE_ENV}, a file holding it) in the client's environment to the "
              "services' token; the local launcher writes it to <data-dir>/secrets/token, compose to "
              "/data/secrets/token in its volume")


class TokenError(ValueError):
    """A token file that cannot be used (missing, unreadable, empty, or not private: UnsafeTokenFile)."""


class UnsafeTokenFile(TokenError):
    """A token file other users may read or write, or one another user owns: refused, never replaced."""


def _check_private(path: str | os.PathLike, st: os.stat_result) -> None:
    """UnsafeTokenFile naming the file, its mode or owner and the command that fixes it, unless the file is
    owned by this user and has no permission for group or others (0600 or 0400)."""
    mode, uid = stat.S_IMODE(st.st_mode), os.geteuid()
    if st.st_uid != uid:
        raise UnsafeTokenFile(f"token file {str(path)!r} is owned by uid {st.st_uid}, not by this user (uid {uid}): "
                              f"whoever owns it can change the token; run `chown {uid} {path}` (or use a token file "
                              "of your own, mode 0600)")
    if mode & 0o077:
        who = "read" if mode & 0o044 else "write"
        raise UnsafeTokenFile(f"token file {str(path)!r} has mode {mode:04o}: other users can {who} it; run "
                              f"`chmod 600 {path}` (a token file must be private to its owner)")


def read_token_file(path: str | os.PathLike) -> str:
    """The token in `path` (surrounding whitespace stripped); TokenError naming the file otherwise, and
    UnsafeTokenFile when the file is not private to this user (mode and owner read from the open file)."""
    try:
        # O_NONBLOCK: a FIFO in its place must not hang the service (regular files ignore it)
        fd = os.open(Path(path).expanduser(), os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as err:
        raise TokenError(f"token file {str(path)!r} cannot be read: {err.strerror or err}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise TokenError(f"token file {str(path)!r} is not a regular file")
        _check_private(path, st)
        try:
            text = f.read(1 << 16).decode("utf-8").strip()
        except (OSError, UnicodeDecodeError) as err:
            raise TokenError(f"token file {str(path)!r} cannot be read: {err}") from None
    if not text:
        raise TokenError(f"token file {str(path)!r} is empty")
    return text


def resolve_token(token: str | None, token_file: str | None) -> str | None:
    """`token` when non-empty, else the content of `token_file` when given, else None."""
    if token and token.strip():
        return token.strip()
    if token_file and token_file.strip():
        return read_token_file(token_file.strip())
    return None


def load_token(env: Mapping[str, str] | None = None) -> str | None:
    """The clients' token: FORKRL_TOKEN, else the file named by FORKRL_TOKEN_FILE, else None (send none)."""
    env = os.environ if env is None else env
    return resolve_token(env.get(TOKEN_ENV), env.get(TOKEN_FILE_ENV))


def tokens_equal(given: str, expected: str) -> bool:
    """Constant-time comparison (the time does not reveal how much of a guess was right)."""
    return hmac.compare_digest(given.encode("utf-8"), expected.encode("utf-8"))


def check_authorization(header: str | None, token: str) -> str | None:
    """None when `header` is `Bearer <token>`; else why not (the message a refused client gets)."""
    if not header:
        return f"no token: every call needs the header '{HEADER}: Bearer <token>'; {HOW_TO_SET}"
    scheme, _, given = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        return f"the {HEADER} header must be 'Bearer <token>'; {HOW_TO_SET}"
    if not tokens_equal(given.strip(), token):
        return f"wrong token; {HOW_TO_SET}"
    return None


def read_tls_file(path: str, what: str) -> bytes:
    """The bytes of a TLS file (certificate, key, CA); TokenError naming `what` and the file when it cannot be
    read or is empty."""
    try:
        data = Path(path).expanduser().read_bytes()
    except OSError as err:
        raise TokenError(f"TLS {what} {path!r} cannot be read: {err.strerror or err}") from None
    if not data.strip():
        raise TokenError(f"TLS {what} {path!r} is empty")
    return data


# --------------------------------------------------------------------------------------------- paths
class OutsideRoots(PermissionError):
    """A path that resolves (symlinks followed) outside the roots a service may use: PERMISSION_DENIED / 403."""


PATH_MAX = 4096  # bytes of a whole path (Linux)
NAME_MAX = 255  # bytes of one name in it


def _shown(path: str | os.PathLike, limit: int = 200) -> str:
    text = repr(str(path))
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


def confine_path(path: str | os.PathLike, roots: Sequence[Path], what: str, setting: str) -> Path:
    """The real path of `path` (symlinks followed) when it lies inside one of `roots` (real paths).

    '..' anywhere → ValueError (a request that tries to climb out is malformed, whatever it resolves to);
    outside → OutsideRoots naming `setting` (the roots' setting, e.g. "the trainer's runs_root (--runs-root)")
    and, when a symlink leads out, where it leads. A path that does not exist yet is resolved as far as it
    exists (a new run dir inside a symlinked folder is judged by where the folder leads). A path the file system
    cannot take (its real path longer than PATH_MAX or a name longer than NAME_MAX, wherever the working directory
    puts a relative one) or cannot resolve (a symlink loop, I/O) → ValueError naming `what`. Messages echo at
    most 200 characters of the path."""
    p = Path(path).expanduser()
    if ".." in p.parts:
        raise ValueError(f"{what} {_shown(path)} must not contain '..'")
    try:
        real = p.resolve()
    except (OSError, RuntimeError) as err:  # RuntimeError: Python 3.11's "Symlink loop"
        raise ValueError(f"{what} {_shown(path)} cannot be resolved: {getattr(err, 'strerror', None) or err}") \
            from None
    longest = max((len(os.fsencode(part)) for part in real.parts), default=0)
    if len(os.fsencode(real)) > PATH_MAX or longest > NAME_MAX:
        raise ValueError(f"{what} {_shown(path)} is too long for the file system: its real path {_shown(real, 80)} "
                         f"has {len(os.fsencode(real)):,} bytes (at most {PATH_MAX}), its longest name {longest:,} "
                         f"(at most {NAME_MAX})")
    if not any(real == r or real.is_relative_to(r) for r in roots):
        allowed = [str(r) for r in roots]
        if real != p.absolute():  # a symlink (of the path or of a folder above it) leads out
            raise OutsideRoots(f"{what} {_shown(path)} links outside {setting} {allowed} (to {_shown(real)})")
        raise OutsideRoots(f"{what} {_shown(path)} is outside {setting} {allowed}")
    return real


def real_roots(roots: Sequence[str | os.PathLike]) -> list[Path]:
    return [Path(r).expanduser().resolve() for r in roots]


# --------------------------------------------------------------------------------------------- CLI
def ensure_token_file(path: str | os.PathLike) -> tuple[Path, bool]:
    """Create `path` holding a new random token (mode 0600) unless it already holds one; (path, created).

    A folder it creates is 0700 (whatever the umask). The token is written to a random temporary name in that
    folder, opened with O_CREAT|O_EXCL|O_NOFOLLOW (never a file or link someone placed there), fsynced, and
    renamed over `path` in one step. An existing token file that is not private (UnsafeTokenFile) is refused,
    not replaced: the services would refuse it too."""
    p = Path(path).expanduser()
    try:
        read_token_file(p)
        return p, False
    except UnsafeTokenFile:
        raise
    except TokenError:
        pass
    _private_dirs(p.parent)
    tmp = p.parent / f".{p.name}.{secrets.token_hex(16)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            os.fchmod(f.fileno(), 0o600)  # exactly: the umask may only have removed bits
            f.write(secrets.token_urlsafe(32) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return p, True


def _private_dirs(folder: Path) -> None:
    """Create `folder` and its missing parents with mode 0700 (an existing folder is left as it is)."""
    missing = []
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    for d in reversed(missing):
        try:
            d.mkdir(mode=0o700)
        except FileExistsError:  # created meanwhile by someone else: left as it is
            continue
        d.chmod(0o700)  # mkdir's mode is filtered by the umask


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m forkrl.security ensure-token FILE`: the one-shot of compose.yaml and the local launcher.
    With FORKRL_TOKEN set nothing is written (the services use that); else FILE is created once."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2 or args[0] != "ensure-token":
        print("usage: python -m forkrl.security ensure-token FILE", file=sys.stderr)
        return 2
    if os.environ.get(TOKEN_ENV, "").strip():
        print(f"{TOKEN_ENV} is set: the services use it ({args[1]} is not needed)")
        return 0
    try:
        path, created = ensure_token_file(args[1])
    except TokenError as err:
        print(f"ensure-token: {err}", file=sys.stderr)
        return 1
    print(f"token {'created' if created else 'kept'}: {path} (clients: export {TOKEN_FILE_ENV}={path})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
