"""Configuration of every command from flags, a TOML file and WALSIDECAR_* variables.

Precedence: command-line flags, then the `--config` TOML file, then environment variables,
then defaults. One name per option everywhere: `--wal-buffer` is `wal_buffer` in TOML and
`WALSIDECAR_WAL_BUFFER` in the environment. In the TOML file, top-level keys apply to every
command that has that option, and a table named after the command (`[start]`,
`[safekeeper]`, `[check]`, `[status]`, `[init-postgres]`, `[up]`) overrides them for it.
"""

from __future__ import annotations

import functools
import os
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import click
from click.core import ParameterSource
from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, PydanticBaseSettingsSource, SettingsConfigDict

ENV_PREFIX = "WALSIDECAR_"


# How links between walsidecar processes are secured (see sidecar/linkauth.py).
LinkSecurity = Literal["tls", "auth-only"]
LINK_SECURITY: tuple[LinkSecurity, ...] = ("tls", "auth-only")

class ConfigError(Exception):
    """Configuration that cannot be used; the message names the option and where it came from."""


def _address(value: str) -> str:
    from sidecar.proposer.peers import parse_address
    host, port = parse_address(value)
    return f"{host}:{port}"


def _listen(value: str | None) -> str | None:
    if value is None or value == "":
        return None
    from sidecar.http import parse_listen
    host, port = parse_listen(value)
    return f"{host}:{port}"


def _address_list(value: Any) -> Any:
    if isinstance(value, str):
        return tuple(s.strip() for s in value.split(",") if s.strip())
    return value


class Settings(BaseSettings):
    """Options every command has."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid")
    command: ClassVar[str] = ""

    log_format: Literal["plain", "json"] = "plain"
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
                                   env_settings: PydanticBaseSettingsSource,
                                   dotenv_settings: PydanticBaseSettingsSource,
                                   file_secret_settings: PydanticBaseSettingsSource,
                                   ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Flags and the TOML file arrive merged as init values and win over the environment.
        return init_settings, env_settings


class TlsSettings(Settings):
    """How a command authenticates its links: a certificates directory, or an explicit --insecure."""

    cert_role: ClassVar[str] = "client"
    certs_dir: Path | None = None
    insecure: bool = False
    link_security: LinkSecurity = "tls"

    @model_validator(mode="after")
    def _tls(self) -> TlsSettings:
        from sidecar.certs import make_commands
        if self.certs_dir is not None and self.insecure:
            raise ValueError("give either --certs-dir or --insecure, not both")
        if self.link_security != "tls" and self.insecure:
            raise ValueError(f"link_security: {self.link_security} authenticates with the --certs-dir certificates; "
                             "it cannot be combined with --insecure")
        if self.certs_dir is None and not self.insecure:
            role = "safekeeper --id N" if self.cert_role == "safekeeper" else self.cert_role
            raise ValueError(
                "no certificates: walsidecar links use mutually authenticated TLS. Make a CA once and a "
                "certificates directory for each process:\n    " + make_commands(role=role).replace("\n", "\n  ")
                + "\n  then give --certs-dir DIR (certs_dir in the --config file, or WALSIDECAR_CERTS_DIR); "
                "or --insecure (WALSIDECAR_INSECURE=1) to run without authentication, for debugging only")
        return self


class PrimarySettings(Settings):
    """The primary and the names the sidecar uses on it."""

    application_name: str = Field("walsidecar", min_length=1)
    slot: str = "walsidecar"

    @field_validator("slot")
    @classmethod
    def _slot(cls, v: str) -> str:
        from sidecar.proposer.primary import check_slot_name
        return check_slot_name(v)


class SafekeepersMixin(Settings):
    safekeepers: Annotated[tuple[str, ...], NoDecode] = ()
    quorum: int | None = None

    @field_validator("safekeepers", mode="before")
    @classmethod
    def _split(cls, v: Any) -> Any:
        return _address_list(v)

    @field_validator("safekeepers")
    @classmethod
    def _addresses(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        names = tuple(_address(s) for s in v)
        if len(set(names)) != len(names):
            raise ValueError("a safekeeper is listed twice")
        return names

    @model_validator(mode="after")
    def _quorum(self) -> SafekeepersMixin:
        if self.safekeepers:
            from sidecar.consensus.quorum import QuorumError, validate_quorum
            try:
                self.quorum = validate_quorum(len(self.safekeepers), self.quorum)
            except QuorumError as e:
                raise ValueError(f"quorum: {e}") from e
        return self


class SafekeeperSettings(TlsSettings):
    command: ClassVar[str] = "safekeeper"
    cert_role: ClassVar[str] = "safekeeper"
    id: int = Field(ge=1)
    listen: str = "127.0.0.1:7601"
    data_dir: Path
    metrics: str | None = None

    @field_validator("listen")
    @classmethod
    def _listen_ok(cls, v: str) -> str:
        return _address(v)

    @field_validator("metrics")
    @classmethod
    def _metrics_ok(cls, v: str | None) -> str | None:
        return _listen(v)


class StartSettings(PrimarySettings, SafekeepersMixin, TlsSettings):
    command: ClassVar[str] = "start"
    cert_role: ClassVar[str] = "proposer"
    pg_dsn: str = Field(min_length=1)
    safekeepers: Annotated[tuple[str, ...], NoDecode] = Field(min_length=1)
    wal_buffer: int = Field(64, ge=1)
    allow_primary_mismatch: bool = False
    metrics: str | None = None
    quorum_wait_alert: float = Field(10.0, ge=0)

    @field_validator("metrics")
    @classmethod
    def _metrics_ok(cls, v: str | None) -> str | None:
        return _listen(v)


class CheckSettings(PrimarySettings, SafekeepersMixin, TlsSettings):
    command: ClassVar[str] = "check"
    pg_dsn: str = Field(min_length=1)
    safekeepers: Annotated[tuple[str, ...], NoDecode] = Field(min_length=1)
    proposer_metrics: str | None = None
    format: Literal["console", "json"] = "console"
    timeout: float = Field(5.0, gt=0)

    @field_validator("proposer_metrics")
    @classmethod
    def _pm_ok(cls, v: str | None) -> str | None:
        return _listen(v)


class StatusSettings(PrimarySettings, SafekeepersMixin, TlsSettings):
    command: ClassVar[str] = "status"
    proposer_metrics: str | None = None
    pg_dsn: str | None = None
    format: Literal["table", "json"] = "table"
    watch: float | None = Field(None, gt=0)
    count: int | None = Field(None, ge=1)
    timeout: float = Field(3.0, gt=0)

    @field_validator("proposer_metrics")
    @classmethod
    def _pm_ok(cls, v: str | None) -> str | None:
        return _listen(v)

    @model_validator(mode="after")
    def _something(self) -> StatusSettings:
        if not (self.proposer_metrics or self.safekeepers or self.pg_dsn):
            raise ValueError("nothing to ask: give --proposer-metrics (the proposer's --metrics address), "
                             "--safekeepers, or --pg-dsn")
        return self


class InitPostgresSettings(PrimarySettings):
    command: ClassVar[str] = "init-postgres"
    pg_dsn: str = Field(min_length=1)
    role: str = "walsidecar"
    max_slot_wal_keep_size: str = "10GB"
    sync: Literal["auto", "on", "off"] = "auto"
    uninstall: bool = False
    sql_dir: Path | None = None


class UpSettings(Settings):
    command: ClassVar[str] = "up"
    dir: Path = Path("/tmp/walsidecar-up")
    pg_port: int = Field(55432, ge=1, le=65535)
    safekeeper_port: int = Field(7601, ge=1, le=65533)
    metrics_port: int = Field(7610, ge=0, le=65532)
    insecure: bool = False
    link_security: LinkSecurity = "tls"

    @model_validator(mode="after")
    def _auth_only(self) -> UpSettings:
        if self.link_security != "tls" and self.insecure:
            raise ValueError(f"link_security: {self.link_security} uses the certificates `up` makes; "
                             "it cannot be combined with --insecure")
        return self


# Keys valid somewhere: a top-level key unknown to every command is a typo, not another command's option.
ALL_SETTINGS: tuple[type[Settings], ...] = (SafekeeperSettings, StartSettings, CheckSettings, StatusSettings,
                                            InitPostgresSettings, UpSettings)


def read_toml(path: Path, cls: type[Settings]) -> dict[str, Any]:
    """The values `path` holds for `cls.command`: top-level keys it knows, then its own table."""
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read the config file {path}: {e.strerror or e}") from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"the config file {path} is not valid TOML: {e}") from e
    commands = {c.command for c in ALL_SETTINGS}
    known_anywhere = {name for c in ALL_SETTINGS for name in c.model_fields}
    mine = set(cls.model_fields)
    out: dict[str, Any] = {}
    for key, value in doc.items():
        if key in commands:
            continue
        if key not in known_anywhere:
            raise ConfigError(f"unknown option {key!r} in {path}" + _did_you_mean(key, known_anywhere))
        if key in mine:
            out[key] = value
    table = doc.get(cls.command, {})
    if not isinstance(table, dict):
        raise ConfigError(f"[{cls.command}] in {path} must be a table")
    for key, value in table.items():
        if key not in mine:
            raise ConfigError(f"unknown option {key!r} in [{cls.command}] of {path}: `walsidecar {cls.command}` "
                              "has no such option" + _did_you_mean(key, mine))
        out[key] = value
    return out


def _did_you_mean(key: str, names: set[str]) -> str:
    import difflib
    close = difflib.get_close_matches(key, sorted(names), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


def load(cls: type[Settings], flags: dict[str, Any], config_file: Path | None) -> Settings:
    """Validate the merged configuration; ConfigError says which option, from where, and why."""
    from_file = read_toml(config_file, cls) if config_file is not None else {}
    merged = {**from_file, **{k: v for k, v in flags.items() if v is not None}}
    try:
        return cls(**merged)
    except ValidationError as e:
        raise ConfigError(_explain(e, cls, flags, from_file, config_file)) from None


def _explain(e: ValidationError, cls: type[Settings], flags: dict[str, Any], from_file: dict[str, Any],
             path: Path | None) -> str:
    merged = {**from_file, **flags}
    lines = []
    for err in e.errors():
        field = str(err["loc"][0]) if err["loc"] else ""
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "missing":
            lines.append(f"{field} is required: give {flag(field)}, set {field} in the --config file, "
                         f"or set {env_name(field)}")
            continue
        if not field:
            # Model-level checks (quorum against the safekeeper count) start with the option's name.
            head, sep, rest = msg.partition(": ")
            if sep and head in cls.model_fields:
                field, msg = head, rest
            else:
                lines.append(msg)
                continue
        if field in flags and flags[field] is not None:
            source = flag(field)
        elif field in from_file:
            source = f"{field} in {path}"
        elif env_name(field) in os.environ:
            source = env_name(field)
        else:
            source = f"{field} (default)"
        shown = err.get("input") if err["loc"] else merged.get(field)
        value = f" = {shown!r}" if shown is not None and not isinstance(shown, dict) else ""
        lines.append(f"{source}{value}: {msg}")
    return "invalid configuration for `walsidecar " + cls.command + "`:\n  " + "\n  ".join(lines)


CONFIG_OPTION = click.option(
    "--config", "config_file", type=click.Path(dir_okay=False, path_type=Path), envvar="WALSIDECAR_CONFIG",
    help="TOML file with options (flags win over it, it wins over WALSIDECAR_* variables).")


def tls_options(role: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """--certs-dir, --insecure and --link-security, for every command that talks to safekeepers."""
    def wrap(f: Callable[..., Any]) -> Callable[..., Any]:
        f = click.option("--link-security", type=click.Choice(LINK_SECURITY), default="tls",
                         show_default=True,
                         help="tls: encrypted and mutually authenticated. auth-only: the same certificates prove "
                              "both ends at connection start, then WAL and messages travel in clear and can be "
                              "read or altered on the path (README, Security). Every process of a deployment "
                              "must use the same.")(f)
        f = click.option("--insecure", is_flag=True,
                         help="Run without TLS or authentication: anyone who can reach a safekeeper's port can "
                              "change its state. For debugging only.")(f)
        return click.option("--certs-dir", type=click.Path(file_okay=False, path_type=Path),
                            help=f"Directory with ca.crt, node.crt and node.key (a {role} certificate from "
                                 "`walsidecar certs create-node`). Required unless --insecure.")(f)
    return wrap


def configured(cls: type[Settings]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate a click command: add --config, then call it with validated settings as keyword arguments.

    Only flags actually given on the command line count as flags; the click defaults shown in
    --help are the settings' defaults and never hide a TOML or environment value.
    """
    def wrap(f: Callable[..., Any]) -> Callable[..., Any]:
        @CONFIG_OPTION
        @functools.wraps(f)
        def inner(config_file: Path | None, **params: Any) -> Any:
            ctx = click.get_current_context()
            given = {k: v for k, v in params.items() if ctx.get_parameter_source(k) is ParameterSource.COMMANDLINE}
            try:
                settings = load(cls, given, config_file)
            except ConfigError as e:
                raise click.UsageError(str(e), ctx) from None
            return f(**{k: getattr(settings, k) for k in params})
        return inner
    return wrap


def default(cls: type[Settings], name: str) -> Any:
    """The default of option `name`, for click's --help."""
    return cls.model_fields[name].default
