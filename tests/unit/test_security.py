"""The token rules of forkrl/security.py and of the services' settings (the servers: tests/security/)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from forkrl.cli import parse_settings
from forkrl.remote.channel import http_headers
from forkrl.security import check_authorization, ensure_token_file, load_token, main, resolve_token
from probe_service.config import ProbeSettings
from rollout_service.config import RolloutSettings
from serving.bind import is_loopback, refuse_open_bind
from tests.service_fixtures import REPO_ROOT
from trainer_service.config import TrainerSettings


def test_token_comes_from_the_variable_before_the_file(tmp_path: Path) -> None:
    f = tmp_path / "token"
    f.write_text("  from-file\n")
    f.chmod(0o600)
    assert load_token({"FORKRL_TOKEN": "direct", "FORKRL_TOKEN_FILE": str(f)}) == "direct"
    assert load_token({"FORKRL_TOKEN": " ", "FORKRL_TOKEN_FILE": str(f)}) == "from-file"
    assert load_token({}) is None
    assert resolve_token(None, None) is None
    with pytest.raises(ValueError, match="cannot be read"):
        resolve_token(None, str(tmp_path / "missing"))
    (tmp_path / "empty").write_text("\n")
    (tmp_path / "empty").chmod(0o600)
    with pytest.raises(ValueError, match="is empty"):
        resolve_token(None, str(tmp_path / "empty"))


def test_authorization_header_must_carry_the_exact_token() -> None:
    assert check_authorization("Bearer s3cret", "s3cret") is None
    assert check_authorization("bearer  s3cret ", "s3cret") is None
    for header, why in [(None, "no token"), ("", "no token"), ("s3cret", "must be 'Bearer"),
                        ("Basic s3cret", "must be 'Bearer"), ("Bearer", "must be 'Bearer"),
                        ("Bearer s3cre", "wrong token"), ("Bearer s3cret2", "wrong token")]:
        problem = check_authorization(header, "s3cret")
        assert problem is not None and why in problem and "FORKRL_TOKEN" in problem, (header, problem)
    assert http_headers("t") == {"authorization": "Bearer t"} and http_headers("") == {}


@pytest.mark.parametrize("host,loop", [("127.0.0.1", True), ("127.0.0.53", True), ("::1", True), ("[::1]", True),
                                       ("localhost", True), ("0.0.0.0", False), ("::", False), ("10.0.0.2", False),
                                       ("myhost", False)])
def test_loopback_addresses(host: str, loop: bool) -> None:
    assert is_loopback(host) is loop


def test_no_token_is_refused_on_any_address_but_loopback(caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(SystemExit, match="refusing to listen on 0.0.0.0 without a token.*FORKRL_TOKEN"):
        refuse_open_bind("trainer service", "0.0.0.0", None)
    refuse_open_bind("trainer service", "0.0.0.0", "t")  # a token: any address
    with caplog.at_level("WARNING"):
        refuse_open_bind("trainer service", "127.0.0.1", None)
    assert "NO TOKEN SET" in caplog.text


@pytest.mark.parametrize("cls,argv", [(RolloutSettings, ["--model", "m"]), (TrainerSettings, []), (ProbeSettings, [])])
def test_every_service_reads_forkrl_token_and_its_file(cls, argv, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FORKRL_TOKEN", "env-token")
    s = parse_settings(cls, argv)
    assert s.auth_token() == "env-token" and "env-token" not in repr(s)  # a SecretStr: never in logs
    monkeypatch.delenv("FORKRL_TOKEN")
    assert parse_settings(cls, argv).auth_token() is None
    f = tmp_path / "tok"
    f.write_text("file-token\n")
    f.chmod(0o600)
    monkeypatch.setenv("FORKRL_TOKEN_FILE", str(f))
    assert parse_settings(cls, argv).auth_token() == "file-token"
    assert parse_settings(cls, [*argv, "--token", "flag-token"]).auth_token() == "flag-token"


def test_an_unreadable_token_file_exits_2_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FORKRL_TOKEN")  # a token given directly wins over the file
    with pytest.raises(SystemExit) as e:
        parse_settings(TrainerSettings, ["--token-file", str(tmp_path / "nope")])
    assert e.value.code == 2 and "token file" in capsys.readouterr().err


def test_ensure_token_creates_a_private_file_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "secrets" / "token"
    p, created = ensure_token_file(path)
    token = path.read_text().strip()
    assert created and p == path and len(token) >= 40 and path.stat().st_mode & 0o777 == 0o600
    assert ensure_token_file(path) == (path, False) and path.read_text().strip() == token
    monkeypatch.delenv("FORKRL_TOKEN")
    other = tmp_path / "other"
    assert main(["ensure-token", str(other)]) == 0 and other.is_file()
    monkeypatch.setenv("FORKRL_TOKEN", "given")
    assert main(["ensure-token", str(tmp_path / "unused")]) == 0 and not (tmp_path / "unused").exists()
    assert main(["bogus"]) == 2


def test_the_probe_refuses_to_start_open_on_a_public_address() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("FORKRL_TOKEN", "FORKRL_TOKEN_FILE")}
    done = subprocess.run([sys.executable, "-m", "probe_service", "--host", "0.0.0.0", "--port", "0"], cwd=REPO_ROOT,
                          env=env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert done.returncode != 0 and "refusing to listen on 0.0.0.0 without a token" in done.stderr


# ---- the token file's modes (issue 42 item 11) --------------------------------------------------------------------
@pytest.mark.parametrize("mode,who", [(0o644, "read"), (0o640, "read"), (0o604, "read"), (0o620, "write"),
                                      (0o602, "write"), (0o666, "read")],
                         ids=lambda v: f"{v:04o}" if isinstance(v, int) else v)
def test_a_token_file_other_users_can_read_or_write_is_refused(tmp_path: Path, mode: int, who: str,
                                                               capsys: pytest.CaptureFixture,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "token"
    f.write_text("s3cret\n")
    f.chmod(mode)
    why = rf"token file '{f}' has mode {mode:04o}: other users can {who} it; run `chmod 600 {f}`"
    with pytest.raises(ValueError, match=why):
        resolve_token(None, str(f))
    monkeypatch.delenv("FORKRL_TOKEN")
    with pytest.raises(SystemExit) as e:  # a service refuses to start on it, naming the file, mode and chmod
        parse_settings(TrainerSettings, ["--token-file", str(f)])
    assert e.value.code == 2 and f"has mode {mode:04o}" in capsys.readouterr().err
    monkeypatch.setenv("FORKRL_TOKEN_FILE", str(f))
    with pytest.raises(ValueError, match=why):  # a client too
        load_token()
    for private in (0o600, 0o400):
        f.chmod(private)
        assert resolve_token(None, str(f)) == "s3cret"


def test_a_token_file_another_user_owns_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "token"
    f.write_text("s3cret\n")
    f.chmod(0o600)
    other = f.stat().st_uid + 1
    monkeypatch.setattr(os, "geteuid", lambda: other)  # the reader is someone else than the file's owner
    with pytest.raises(ValueError, match=rf"token file '{f}' is owned by uid {other - 1}, not by this user "
                                         rf"\(uid {other}\).*chown {other} {f}"):
        resolve_token(None, str(f))


def test_ensure_token_makes_a_0700_folder_and_never_writes_through_a_planted_name(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The folder took the umask's mode, and the token went to `.token.<pid>.tmp` opened with O_TRUNC and no
    O_EXCL/O_NOFOLLOW: a symlink planted at that name made ensure-token overwrite the file it pointed to."""
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    secrets_dir = tmp_path / "data" / "secrets"
    old_umask = os.umask(0)  # the most permissive umask: the modes must not come from it
    try:
        secrets_dir.parent.mkdir(mode=0o755)
        secrets_dir.mkdir(mode=0o700)
        (secrets_dir / f".token.{os.getpid()}.tmp").symlink_to(victim)  # the name the old code used
        path, created = ensure_token_file(secrets_dir / "token")
        assert created and path.stat().st_mode & 0o777 == 0o600 and victim.read_text() == "precious\n"
        assert stat.S_IMODE(secrets_dir.stat().st_mode) == 0o700
        fresh = tmp_path / "new" / "deeper" / "token"
        ensure_token_file(fresh)
        assert [stat.S_IMODE(d.stat().st_mode) for d in (fresh.parent.parent, fresh.parent)] == [0o700, 0o700]
        assert stat.S_IMODE(fresh.stat().st_mode) == 0o600
    finally:
        os.umask(old_umask)
    # a random temporary name, opened O_CREAT|O_EXCL|O_NOFOLLOW: a link at that very name is not followed
    import forkrl.security as sec

    monkeypatch.setattr(sec.secrets, "token_hex", lambda n=16: "guessed")
    (tmp_path / "new" / "deeper" / ".token2.guessed.tmp").symlink_to(victim)
    with pytest.raises(FileExistsError):
        ensure_token_file(tmp_path / "new" / "deeper" / "token2")
    assert victim.read_text() == "precious\n" and not (tmp_path / "new" / "deeper" / "token2").exists()


def test_ensure_token_refuses_an_existing_token_file_that_is_not_private(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "token"
    f.write_text("kept\n")
    f.chmod(0o644)
    monkeypatch.delenv("FORKRL_TOKEN")
    assert main(["ensure-token", str(f)]) == 1
    assert "has mode 0644" in capsys.readouterr().err and f.read_text() == "kept\n"
