"""The one config mechanism of every entry point: pydantic-settings models whose attribute docstrings are the
`--help`, parsed by `pydantic_settings.CliApp`.

    class TrainerSettings(CliSettings):
        model_config = SettingsConfigDict(env_prefix="TRAINER_", cli_prog_name="python -m trainer_service")

        port: int = Field(50052, ge=0, le=65535)
        \"\"\"gRPC port (0 = pick a free one and print it).\"\"\"

    settings = parse_settings(TrainerSettings)     # flags > TRAINER_* variables > defaults; bad values exit 2

Flags are the field names in kebab-case (`--runs-root` <-> `runs_root`), booleans are `--x/--no-x`, list
fields take comma-separated values or a repeated flag. Used by `python -m rollout_service`, `-m trainer_service`,
`-m probe_service` and `clients/start_run.py`. Imports nothing heavy: parse before torch/vLLM are imported.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

from pydantic import Field, PrivateAttr, SecretStr, ValidationError, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, CliApp, PydanticBaseSettingsSource, SettingsConfigDict, SettingsError

from forkrl.security import (
    TLS_CERT_ENV,
    TLS_KEY_ENV,
    TOKEN_ENV,
    TOKEN_FILE_ENV,
    TokenError,
    read_tls_file,
    resolve_token,
)

S = TypeVar("S", bound=BaseSettings)


def shown(value: object, limit: int = 80) -> str:
    """repr(value), cut to `limit` characters: messages echo what was sent, never unbounded input."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


class CliSettings(BaseSettings):
    """Base of every settings model with a CLI; subclasses add env_prefix and cli_prog_name."""

    model_config = SettingsConfigDict(
        cli_kebab_case=True,
        cli_implicit_flags=True,
        cli_hide_none_type=True,
        cli_avoid_json=True,
        use_attribute_docstrings=True,
        extra="forbid",
    )


class ModelToolSettings(CliSettings):
    """Base of the offline model tools' CLIs (python -m forkrl.eval, python -m forkrl.probe): flags only, and
    the torch device and thread count of the process (apply_threads before torch is imported)."""

    device: str = "auto"
    """torch device: auto (cuda if present), cpu, cuda."""
    threads: int = Field(0, ge=0, le=256)
    """torch CPU threads; 0 = torch's default."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings,)  # flags only: a dataset path is read by the job itself, as in training

    def apply_threads(self) -> None:
        """Sets OMP_NUM_THREADS/MKL_NUM_THREADS from --threads; call before torch is imported."""
        if self.threads:
            for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
                os.environ[var] = str(self.threads)


def validation_problems(err: ValidationError, *, flags: bool = False, env_prefix: str = "") -> Iterator[str]:
    """One readable line per problem, naming the field (or with flags=True its `--flag`, and its variable
    when the model reads `env_prefix`* variables) and the value.

    'entropy_top_frac must be in (0, 1], got 1.5' (our validators already name both);
    'num_steps: Input should be greater than or equal to 1, got 0' (pydantic's own checks).
    A long value is cut (`shown`): the lines go into gRPC status details and terminals.
    """
    for e in err.errors():
        msg = e["msg"].removeprefix("Value error, ")
        field = str(e["loc"][0]) if e["loc"] else ""
        if not field:  # a model-level rule (several fields): its message says what is wrong
            yield msg
            continue
        if e["type"] == "extra_forbidden":
            yield f"unknown setting {field!r}"
            continue
        if e["type"] == "missing":
            msg = "required, not given"
        elif "got" not in msg:
            msg = f"{msg}, got {shown(e.get('input'))}"
        elif not flags:  # our own validators name the field and the value already
            yield msg
            continue
        if not flags:
            yield f"{'.'.join(str(p) for p in e['loc'])}: {msg}"
            continue
        env = f" ({env_prefix}{field.upper()})" if env_prefix else ""
        yield f"--{field.replace('_', '-')}{env}: {msg}"


def describe_validation_error(err: ValidationError) -> str:
    """All problems on one line (gRPC INVALID_ARGUMENT details): 'entropy_top_frac must be in (0, 1], got 1.5'."""
    return "; ".join(validation_problems(err))


def parse_settings(cls: type[S], argv: Sequence[str] | None = None, **file_values: Any) -> S:
    """Settings from CLI flags over `file_values` (e.g. a config file) over the model's other sources.

    Invalid values print `<prog>: error: --flag: what is wrong, got value` per problem and exit with status 2,
    as argparse does for an unknown flag; `--help` prints every field with its docstring and exits 0.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    prog = cls.model_config.get("cli_prog_name") or Path(sys.argv[0]).name
    try:
        return CliApp.run(cls, cli_args=args, **file_values)
    except ValidationError as err:
        lines = list(validation_problems(err, flags=True, env_prefix=cls.model_config.get("env_prefix") or ""))
    except SettingsError as err:  # e.g. an environment variable that does not parse
        lines = [str(err)]
    for line in lines:
        print(f"{prog}: error: {line}", file=sys.stderr)
    raise SystemExit(2)


class NamedEnvSource(PydanticBaseSettingsSource):
    """Defaults for some fields from environment variables with names of their own
    (`{"entropy_top_frac": "ENTROPY_TOP_FRAC"}`); empty variables count as unset."""

    def __init__(self, settings_cls: type[BaseSettings], names: dict[str, str]) -> None:
        super().__init__(settings_cls)
        self.names = names

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        var = self.names.get(field_name)
        value = os.environ.get(var, "").strip() if var else ""
        return (value or None), field_name, False

    def __call__(self) -> dict[str, Any]:
        out = {}
        for name in self.names:
            value, _, _ = self.get_field_value(self.settings_cls.model_fields[name], name)
            if value is not None:
                out[name] = value
        return out


class TokenSettings(CliSettings):
    """The token fields every service shares (forkrl/security.py). Besides the flags and the service's own
    prefixed variables (ROLLOUT_TOKEN_FILE, ...), they read FORKRL_TOKEN and FORKRL_TOKEN_FILE, which the
    launcher, compose.yaml and the clients use: one token for the whole stack."""

    token: SecretStr | None = Field(None, repr=False)
    """The bearer token every call but the health check must carry (env FORKRL_TOKEN). Prefer the variable or
    --token-file: a flag is visible to every user of the machine in `ps`. Unset (and no file): the service
    runs open on a loopback address, with a warning, and refuses to start on any other address."""
    token_file: str | None = None
    """File holding the token (env FORKRL_TOKEN_FILE); used when no token is given directly. It must be owned by the
    service's user with no permission for group or others (chmod 600): any other is refused."""
    tls_cert_file: str | None = None
    """TLS: the server's certificate chain (PEM; env FORKRL_TLS_CERT). Set with tls_key_file, the service
    speaks TLS only; clients then need FORKRL_TLS_CA (the CA that signed it). Unset: plaintext."""
    tls_key_file: str | None = None
    """TLS: the private key of tls_cert_file (PEM; env FORKRL_TLS_KEY)."""
    _token: str | None = PrivateAttr(None)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # flags > <PREFIX>_* variables > FORKRL_TOKEN / FORKRL_TOKEN_FILE > defaults
        names = {"token": TOKEN_ENV, "token_file": TOKEN_FILE_ENV, "tls_cert_file": TLS_CERT_ENV,
                 "tls_key_file": TLS_KEY_ENV}
        return init_settings, env_settings, NamedEnvSource(settings_cls, names), dotenv_settings, file_secret_settings

    @model_validator(mode="after")
    def _read_token(self) -> TokenSettings:
        token = self.token.get_secret_value() if self.token is not None else None
        try:
            self._token = resolve_token(token, self.token_file)
        except TokenError as err:
            raise ValueError(f"token_file: {err}") from None
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("tls_cert_file and tls_key_file go together (--tls-cert-file/--tls-key-file, "
                             f"{TLS_CERT_ENV}/{TLS_KEY_ENV}): give both or neither")
        try:
            for path, what in ((self.tls_cert_file, "certificate file"), (self.tls_key_file, "key file")):
                if path:
                    read_tls_file(path, what)
        except TokenError as err:
            raise ValueError(str(err)) from None
        return self

    def auth_token(self) -> str | None:
        """The token the service requires (None: it runs open; see serving.bind.refuse_open_bind)."""
        return self._token
