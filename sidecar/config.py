"""Configuration of every command from flags, a TOML file and WALSIDECAR_* variables.

Precedence: command-line flags, then the `--config` TOML file, then environment variables,
then defaults. One name per option everywhere: `--wal-buffer` is `wal_buffer` in TOML and
`WALSIDECAR_WAL_BUFFER` in the environment. In the TOML file, top-level keys apply to every
command that has that option, and a table named after the command (`[start]`,
`[safekeeper]`, `[check]`, `[status]`, `[init-postgres]`, `[up]`, `[ctl]`) overrides them for it.

Each option is declared once, as a field of a settings class with its type, default and
description: `configured` makes the click options from the fields, `options_table` the README's.
"""

from __future__ import annotations

import fcntl
import functools
import os
import re
import tomllib
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import click
from click.core import ParameterSource
from pydantic import AfterValidator, BeforeValidator, Field, ValidationError, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, NoDecode, PydanticBaseSettingsSource, SettingsConfigDict

from sidecar.address import Address
from sidecar.pgrepl import check_slot_name

ENV_PREFIX = "WALSIDECAR_"

# How links between walsidecar processes are secured (sidecar/linkauth.py implements auth-only).
LinkSecurity = Literal["tls", "auth-only"]


class ConfigError(Exception):
    """Configuration that cannot be used; the message names the option and where it came from."""


@dataclass(frozen=True)
class Metavar:
    """What a field's flag takes, as --help shows it (`--listen HOST:PORT`)."""
    text: str


def _address(value: str) -> str:
    return str(Address.parse(value))


def _endpoint(value: str | None) -> str | None:
    return str(Address.parse(value, port_zero=True)) if value else None


def _split(value: Any) -> Any:
    if isinstance(value, str):
        if not value.strip():
            return ()  # an empty variable or TOML string: none given
        items = tuple(s.strip() for s in value.split(","))
        if "" in items:
            # Dropping it would hide a typo: `a:1,,b:2` may have meant three addresses.
            raise ValueError("an empty item between commas (or at an end): separate the items with single commas")
        return items
    return value


def _distinct(value: tuple[str, ...]) -> tuple[str, ...]:
    if len(set(value)) != len(value):
        raise ValueError("a safekeeper is listed twice")
    return value


def _archive_url(value: str | None) -> str | None:
    if value:
        from sidecar.objectstore import open_storage
        if "://" not in value:
            raise ValueError("give a URL: s3://bucket/prefix or file:///path")
        open_storage(value)
    return value


def _slot(value: str) -> str:
    return check_slot_name(value)


# Addresses are kept as normalised HOST:PORT text; an HTTP endpoint may listen on port 0.
PeerAddress = Annotated[str, AfterValidator(_address), Metavar("HOST:PORT")]
Endpoint = Annotated[str | None, AfterValidator(_endpoint), Metavar("HOST:PORT")]
Safekeepers = Annotated[
    tuple[PeerAddress, ...], NoDecode, BeforeValidator(_split), AfterValidator(_distinct), Metavar("HOST:PORT,..."),
    Field(description="Comma-separated HOST:PORT list of all safekeepers (their --listen addresses).")]
PgDsn = Annotated[str, Metavar("DSN")]
Metrics = Annotated[Endpoint, Field(
    description="HOST:PORT to serve Prometheus /metrics and a JSON /status on (e.g. 127.0.0.1:9187); off when "
                "not given. Plain HTTP on loopback, HTTPS with the --certs-dir certificate elsewhere.")]
Timeout = Annotated[float, Field(gt=0, description="Seconds to wait for each answer.")]
FilePath = Annotated[Path, Metavar("FILE")]


def _size(value: str | None) -> str | None:
    from sidecar.sizes import parse_size
    if value is not None:
        parse_size(value)
    return value


def _disk_limit(value: str | None) -> str | None:
    from sidecar.sizes import DiskLimit
    if value is not None:
        DiskLimit.parse(value)
    return value


def _commit_wait(value: str) -> str:
    from sidecar.consensus.commitwait import parse_commit_wait
    parse_commit_wait(value)
    return value


# Kept as the operator wrote them (for --help and errors); sidecar/sizes.py reads them.
Size = Annotated[str | None, AfterValidator(_size), Metavar("SIZE")]
DiskLimitText = Annotated[str | None, AfterValidator(_disk_limit), Metavar("SIZE|PCT%")]
CommitWaitPolicy = Annotated[str, AfterValidator(_commit_wait), Metavar("POLICY")]


class Settings(BaseSettings):
    """Options every command has."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid")
    command: ClassVar[str] = ""
    cli_words: ClassVar[str] = ""  # the words that run it when they are not `command` (a subcommand)
    up_has_config: ClassVar[bool] = False  # given nothing, point at a running `walsidecar up`'s --config file

    log_format: Literal["plain", "json"] = Field("plain", description="Log line format.")
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="Least severe log level shown.")

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
                                   env_settings: PydanticBaseSettingsSource,
                                   dotenv_settings: PydanticBaseSettingsSource,
                                   file_secret_settings: PydanticBaseSettingsSource,
                                   ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Flags and the TOML file arrive merged as init values and win over the environment.
        return init_settings, env_settings


class LinkSettings(Settings):
    """How the links a command runs or uses are secured."""

    certificates: ClassVar[str] = "the --certs-dir certificates"
    insecure: bool = Field(False, description="Run without TLS or authentication: anyone who can reach a "
                                              "safekeeper's port can change its state. For debugging only.")
    link_security: LinkSecurity = Field(
        "tls", description="tls: encrypted and mutually authenticated. auth-only: the same certificates prove both "
                           "ends at connection start, then WAL and messages travel in clear and can be read or "
                           "altered on the path (docs/security.md). Every process of a deployment must use the same.")

    @model_validator(mode="after")
    def _auth_only(self) -> LinkSettings:
        if self.link_security != "tls" and self.insecure:
            raise ValueError(f"link_security: {self.link_security} authenticates with {self.certificates}; "
                             "it cannot be combined with {insecure}")
        return self


class TlsSettings(LinkSettings):
    """How a command authenticates its links: a certificates directory, or an explicit --insecure."""

    cert_role: ClassVar[str] = "client"
    certs_dir: Path | None = Field(None, description="Directory with ca.crt, node.crt and node.key (a {cert_role} "
                                                     "certificate from `walsidecar certs create-node`). Required "
                                                     "unless --insecure.")

    @model_validator(mode="after")
    def _tls(self) -> TlsSettings:
        from sidecar.certs import make_commands
        if self.certs_dir is not None and self.insecure:
            raise ValueError("certs_dir: cannot be used with {insecure}: give either --certs-dir or --insecure, "
                             "not both")
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

    application_name: str = Field("walsidecar", min_length=1, description="The sidecar's application_name: the "
                                                                         "name synchronous_standby_names lists.")
    slot: Annotated[str, AfterValidator(_slot)] = Field(
        "walsidecar", description="The sidecar's physical replication slot. A second slot `<slot>_horizon` stays at "
                                  "the position every safekeeper has (at most `start --primary-retention` behind the commit), so one "
                                  "that was down briefly catches up from pg_wal.")


class SafekeepersMixin(Settings):
    """The safekeepers and the quorum, for the commands that reach them."""

    safekeepers: Safekeepers = ()
    quorum: int | None = Field(None, description="Votes and flushes a commit needs; default and minimum "
                                                 "N//2+1 (two quorums must intersect). check and status take the "
                                                 "proposer's.")

    @model_validator(mode="after")
    def _quorum(self) -> SafekeepersMixin:
        if self.safekeepers:
            from sidecar.consensus.quorum import QuorumError, validate_quorum
            try:
                self.quorum = validate_quorum(len(self.safekeepers), self.quorum)
            except QuorumError as e:
                raise ValueError(f"quorum: {e}") from e
        return self


def _broker_endpoints(value: tuple[str, ...]) -> tuple[str, ...]:
    from sidecar.broker import parse_endpoints
    return parse_endpoints(value)


def _cluster_name(value: str | None) -> str | None:
    from sidecar.broker import check_cluster_name
    return check_cluster_name(value) if value is not None else None


class ClusterSettings(Settings):
    """The cluster's name, in the broker's keys and the archive's layout."""

    cluster: Annotated[str | None, AfterValidator(_cluster_name)] = Field(
        None, description="The cluster's name in the broker's keys (walsidecar/<cluster>/...) and the archive's "
                          "layout; default: the primary's system id.")


class ArchiveSettings(Settings):
    """Where the WAL archive is: the safekeepers upload to it, restore-wal reads from it."""

    archive: Annotated[str | None, AfterValidator(_archive_url), Metavar("URL")] = Field(
        None, description="The WAL archive, s3://bucket/prefix or file:///path, holding <prefix>/<cluster>/<system "
                          "id>/wal/: safekeepers upload committed, completed WAL segments and timeline history "
                          "files to it; restore-wal reads what the safekeepers no longer hold from it, and start "
                          "catches a safekeeper up from it when neither the primary nor a peer has the WAL. Off "
                          "when not given.")
    s3_endpoint: Annotated[str | None, Metavar("URL")] = Field(
        None, description="S3 endpoint for an s3:// archive (default: AWS's, or AWS_ENDPOINT_URL); credentials come "
                          "from the usual AWS_* variables and files.")


class BrokerSettings(ClusterSettings):
    """The broker (etcd) where safekeepers publish their state, and the cluster's name there."""

    broker: Annotated[tuple[str, ...], NoDecode, BeforeValidator(_split), AfterValidator(_broker_endpoints),
                      Metavar("URL,...")] = Field(
        (), description="etcd endpoints of one etcd cluster, http://HOST:PORT or https://HOST:PORT, comma-separated. "
                        "Over https the --certs-dir certificate is the client certificate (etcd --client-cert-auth).")


class SafekeeperBrokerSettings(BrokerSettings):
    """What a safekeeper publishes to the broker, and for how long it outlives it."""

    broker_lease: int = Field(10, ge=2, le=600, description="Seconds a safekeeper's broker keys outlive its last "
                              "renewal (the etcd lease TTL): a dead safekeeper's entry and its upload lease go "
                              "after this.")
    advertise: PeerAddress | None = Field(None, description="HOST:PORT peers and tools reach the proposer port "
                                                            "(--listen) at, as published to the broker; default "
                                                            "--listen.")
    advertise_pg: PeerAddress | None = Field(None, description="HOST:PORT readers reach the reader port (--pg-listen) at, as "
                                                     "published to the broker; default --pg-listen.")

    @model_validator(mode="after")
    def _advertised(self) -> SafekeeperBrokerSettings:
        if not self.broker:
            return self
        for name, listen_name in (("advertise", "listen"), ("advertise_pg", "pg_listen")):
            listen = getattr(self, listen_name, None)
            if getattr(self, name) is None and listen and Address.parse(listen, port_zero=True).host in ("0.0.0.0", "::"):
                raise ValueError(f"{name}: {flag(listen_name)} {listen} listens on every address; give {flag(name)} "
                                 "HOST:PORT, the address others reach it at, for the broker")
        return self


class SafekeeperDataSettings(Settings):
    """Which safekeeper, and where it keeps its state."""

    id: int = Field(ge=1, description="This safekeeper's id (stable, unique, 1 or more).")
    data_dir: Path = Field(description="Where the control file and WAL segments live.")


class SafekeeperInitSettings(SafekeeperDataSettings):
    """walsidecar safekeeper-init: create a safekeeper's data directory as a member of a new cluster."""

    command: ClassVar[str] = "safekeeper-init"
    members: int = Field(ge=1, le=1000, description="How many safekeepers the new cluster has (the proposer's "
                                                   "--safekeepers): a safekeeper that later loses its disk learns "
                                                   "its term from N-Q+1 of them before it votes.")


class SafekeeperSettings(SafekeeperDataSettings, ArchiveSettings, SafekeeperBrokerSettings, TlsSettings):
    """walsidecar safekeeper: store WAL durably and vote in proposer elections."""

    command: ClassVar[str] = "safekeeper"
    cert_role: ClassVar[str] = "safekeeper"
    listen: PeerAddress = Field("127.0.0.1:7601", description="HOST:PORT to accept proposers on.")
    metrics: Metrics = None
    pg_listen: Endpoint = Field(None, description="HOST:PORT to serve WAL to readers on (pg_receivewal, standbys, "
                                                  "restore-wal) over PostgreSQL's replication protocol; off when not "
                                                  "given. TLS with the --certs-dir certificate.")
    pg_auth_file: FilePath | None = Field(None, description="The readers' SCRAM-SHA-256 verifiers (made by "
                                                            "`walsidecar readers add`, mode 0600). Without it the "
                                                            "reader port refuses everyone, unless --insecure.")
    pg_wal_sender_timeout: Timeout = Field(60.0, description="Seconds a streaming reader may leave the WAL and the "
                                           "replies it is sent untaken, or send no status, before its stream ends "
                                           "(PostgreSQL's wal_sender_timeout).")
    pg_authentication_timeout: Timeout = Field(10.0, description="Seconds a reader port connection has from "
                                               "connecting to logging in (PostgreSQL's authentication_timeout); "
                                               "a connection still silent or authenticating then is closed.")
    keep_wal: Size = Field(None, description="Without an archive: remove WAL segments more than this far behind "
                                             "the flush position (10GB, 512MiB), unless a reader slot still needs "
                                             "them. Default: keep everything. Removed WAL then exists only on the "
                                             "other safekeepers and the primary.")
    max_slot_wal_keep_size: Size = Field("10GB", description="WAL a reader slot may hold behind the flush "
                                          "position, as PostgreSQL's max_slot_wal_keep_size: a slot further "
                                          "behind is invalidated (it holds nothing and cannot be streamed from; "
                                          "drop it and make it again), so that no reader can fill the disk.")
    max_reader_slots: int = Field(100, ge=1, le=10_000, description="Reader slots this safekeeper keeps at most, "
                                                                    "of all readers together.")
    max_slots_per_reader: int = Field(10, ge=1, le=10_000, description="Reader slots one reader name (of "
                                                                       "--pg-auth-file) may create.")
    peers: Safekeepers = Field((), description="The other safekeepers' --listen addresses (HOST:PORT,...), every "
                                             "one of them. When the data directory is empty (a lost disk: a new "
                                             "cluster's are created by `safekeeper-init`), it votes only after "
                                             "N-Q+1 of them that did not lose theirs told their term, so it cannot "
                                             "vote twice in a term it forgot. Without it, an empty safekeeper never "
                                             "votes.")
    max_disk_usage: DiskLimitText = Field(None, description="Stop taking new WAL while this safekeeper's WAL files "
                                                            "take more than SIZE, or its filesystem is more than PCT% "
                                                            "full; commits go on with the other safekeepers, and it "
                                                            "resumes once removal brings it below. Default: no limit.")
    # Archiving: --archive and --s3-endpoint (ArchiveSettings), --cluster (ClusterSettings).
    archive_takeover: float = Field(30.0, gt=0, description="Without a broker the lowest id uploads; safekeeper "
                                    "--id N uploads a committed segment still missing from the archive after (N-1) "
                                    "times this many seconds.")

    @model_validator(mode="after")
    def _reader_port(self) -> SafekeeperSettings:
        if self.pg_auth_file is not None and not self.pg_listen:
            raise ValueError("pg_auth_file: it is for the reader port; give --pg-listen HOST:PORT too")
        return self


class StartSettings(ArchiveSettings, BrokerSettings, SafekeepersMixin, PrimarySettings, TlsSettings):
    """walsidecar start: the WAL proposer attached to a primary."""

    command: ClassVar[str] = "start"
    cert_role: ClassVar[str] = "proposer"
    pg_dsn: PgDsn = Field(min_length=1, description="libpq connection string of the primary (a role with REPLICATION).")
    safekeepers: Safekeepers = Field(min_length=1)
    wal_buffer: int = Field(64, ge=1, description="MiB of WAL kept in memory for lagging safekeepers; beyond it "
                                                  "they catch up from the primary.")
    allow_primary_mismatch: bool = Field(False, description="DANGEROUS: stream even if the primary lacks WAL a "
                                                            "quorum committed; this discards that WAL. For "
                                                            "disaster recovery only.")
    metrics: Metrics = None
    primary_retention: Size = Field("1GB", description="WAL the primary keeps for lagging safekeepers beyond the "
                                    "quorum's commit position (its horizon slot): a safekeeper further behind "
                                    "catches up from a peer's reader port instead. Bounds what a dead safekeeper "
                                    "makes the primary hold.")
    quorum_wait_alert: float = Field(10.0, ge=0, description="Log an error and set "
                                     "walsidecar_proposer_quorum_wait_alert when WAL has waited this many seconds "
                                     "for the quorum (commits are hanging); 0 turns it off.")
    commit_wait: CommitWaitPolicy = Field(
        "wait", description="What a commit waiting for the quorum does while fewer than a quorum of safekeepers "
        "are up. wait: it waits until they are back (never acknowledged below the quorum). terminate-after=T "
        "(e.g. 30s): a backend that waited T in SyncRep without a quorum is terminated "
        "(pg_terminate_backend, never a cancel), so its client gets an error and the commit's outcome is "
        "unknown to it; nothing is ever acknowledged without the quorum. Needs pg_signal_backend. "
        "degrade-after=T (opt-in, DANGEROUS to availability of failovers, not to the primary's commits): after T "
        "without a quorum, commits are acknowledged by the safekeepers that are up, once the degraded range is "
        "recorded in etcd (--broker, --cluster) and on them; until a quorum holds them again, `check` fails and "
        "failover/failover-gate refuse every standby unless one of those safekeepers votes (docs/operations.md).")

    @model_validator(mode="after")
    def _degrade_needs_the_broker(self) -> StartSettings:
        if self.commit_wait.strip().startswith("degrade-after"):
            missing = [name for name, value in (("broker", self.broker), ("cluster", self.cluster)) if not value]
            if missing:
                raise ValueError(f"{missing[0]}: --commit-wait degrade-after records its degraded ranges in etcd: "
                                 "give " + " and ".join(f"--{m}" for m in missing) + " (the same --cluster as "
                                 "failover and failover-gate get)")
        return self


class CheckSettings(BrokerSettings, SafekeepersMixin, PrimarySettings, TlsSettings):
    """walsidecar check: one line per check of the primary, the safekeepers and the sidecar."""

    command: ClassVar[str] = "check"
    up_has_config: ClassVar[bool] = True
    pg_dsn: PgDsn = Field(min_length=1, description="libpq connection string of the primary.")
    safekeepers: Safekeepers = Field(min_length=1)
    proposer_metrics: Endpoint = Field(None, description="Also check the proposer's --metrics endpoint.")
    format: Literal["console", "json"] = Field("console", description="One line per check, or a JSON document.")
    timeout: Timeout = 5.0


class StatusSettings(BrokerSettings, SafekeepersMixin, PrimarySettings, TlsSettings):
    """walsidecar status: each safekeeper's and the proposer's state."""

    command: ClassVar[str] = "status"
    up_has_config: ClassVar[bool] = True
    proposer_metrics: Endpoint = Field(None, description="The proposer's --metrics address: the full picture.")
    pg_dsn: PgDsn | None = Field(None, description="libpq connection string of the primary: adds its flush LSN, "
                                                   "waiting commits and the sidecar's sync state.")
    standby_dsn: PgDsn | None = Field(None, description="libpq connection string of a standby fed by the "
                                                        "safekeepers: adds whether it streams and how far it "
                                                        "replayed.")
    patroni: Annotated[tuple[str, ...], NoDecode, BeforeValidator(_split), Metavar("URL,...")] = Field(
        (), description="Patroni REST API URLs (http://HOST:8008,...): adds Patroni's leader and members, from the "
                        "first that answers (docs/ha.md).")
    format: Literal["table", "json"] = Field("table", description="A table like `patronictl list`, or JSON.")
    watch: float | None = Field(None, gt=0, description="Refresh every this many seconds until Ctrl-C.")
    count: int | None = Field(None, ge=1, description="With --watch: stop after this many refreshes.")
    timeout: Timeout = 3.0

    @model_validator(mode="after")
    def _something(self) -> StatusSettings:
        if not (self.proposer_metrics or self.safekeepers or self.pg_dsn or self.broker or self.patroni):
            raise ValueError("nothing to ask: give --proposer-metrics (the proposer's --metrics address), "
                             "--safekeepers, --pg-dsn or --broker")
        return self


class InitPostgresSettings(PrimarySettings):
    """walsidecar init-postgres: apply sql/install.sql to a primary."""

    command: ClassVar[str] = "init-postgres"
    pg_dsn: PgDsn = Field(min_length=1, description="libpq connection string of the primary. Connect as a superuser.")
    role: str = Field("walsidecar", description="Role to create with LOGIN REPLICATION, pg_monitor and "
                                                "pg_signal_backend for the sidecar; '' for none.")
    max_slot_wal_keep_size: str = Field("10GB", description="Set when unlimited (-1): WAL the primary keeps for a "
                                                            "safekeeper that stays down.")
    sync: Literal["auto", "on", "off"] = Field("auto", description="Name the sidecar in an empty "
                                               "synchronous_standby_names: on, off, or auto (only once it streams).")
    uninstall: bool = Field(False, description="Apply sql/uninstall.sql instead (stop `walsidecar start` first).")
    sql_dir: Path | None = Field(None, description="Directory holding install.sql and uninstall.sql; default: the "
                                                   "package's sql/.")


UP_DIR = Path("/tmp/walsidecar-up")
UP_LOCK = "up.pid"  # held locked by a running `up` in its --dir
UP_CONFIG = "walsidecar.toml"  # the --config file `up` writes for status, check and failover


def running_up_config(base: Path | None = None) -> Path | None:
    """The --config file of a `walsidecar up` running in `base` (default: up's, WALSIDECAR_DIR or /tmp/walsidecar-up)."""
    base = base or Path(os.environ.get(env_name("dir")) or UP_DIR)
    try:
        with open(base / UP_LOCK) as f:
            # Taken and let go at once: only an `up` starting in this instant could see it held.
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        config = base / UP_CONFIG
        return config if config.exists() else None
    except OSError:
        pass  # no lock file: no `up` ever ran there
    return None


class UpSettings(LinkSettings):
    """walsidecar up: a local PostgreSQL, 3 safekeepers and the proposer, with its own CA under --dir."""

    command: ClassVar[str] = "up"
    certificates: ClassVar[str] = "the certificates `up` makes"
    dir: Path = Field(UP_DIR, description="Where the cluster, the safekeepers and the certificates `up` makes live.")
    pg_port: int = Field(55432, ge=1, le=65535, description="Port of the local PostgreSQL.")
    safekeeper_port: int = Field(7601, ge=1, le=65533, description="First of three consecutive safekeeper ports.")
    metrics_port: int = Field(7610, ge=0, le=65532, description="First of four consecutive metrics ports "
                              "(proposer, then safekeepers 1-3); 0 picks free ports.")
    standby: bool = Field(False, description="Also run a standby that streams from safekeeper1's reader port (on "
                                             "--pg-port + 1), ready for `walsidecar failover`; the members keep "
                                             "running when the primary dies.")
    ha: bool = Field(False, description="Run two Patroni-managed PostgreSQL nodes (node1 on --pg-port, node2 on "
                                        "the next port) with etcd instead of one primary: Patroni fails over on "
                                        "its own, through `walsidecar failover-gate`, and the sidecar follows "
                                        "the leader (docs/ha.md). Needs `pip install 'walsidecar[ha]'`.")


class CtlSettings(Settings):
    """walsidecar ctl: stop, start and list the members of a running `walsidecar up`."""

    command: ClassVar[str] = "ctl"
    dir: Path = Field(UP_DIR, description="The --dir of the running `walsidecar up`.")
    timeout: float = Field(120.0, gt=0, description="Seconds to wait for the answer (starting the primary may "
                                                    "take a minute).")


class ReadersSettings(Settings):
    """walsidecar readers: the reader port's password file."""

    command: ClassVar[str] = "readers"
    pg_auth_file: FilePath | None = Field(None, description="The file of SCRAM-SHA-256 verifiers the safekeepers' "
                                                            "--pg-auth-file names; `readers add` makes it (mode "
                                                            "0600).")


class ReaderCredentials(TlsSettings):
    """How a command logs in to the safekeepers' reader ports (restore-wal, failover, readers slot)."""

    reader_user: str = Field("walsidecar", min_length=1, description="The reader name to log in to the "
                                                                     "safekeepers' reader ports as (`walsidecar "
                                                                     "readers add`).")
    reader_passfile: FilePath | None = Field(None, description="libpq password file (.pgpass format, mode 0600) "
                                                               "holding the reader's password; default: libpq's "
                                                               "own (PGPASSFILE, ~/.pgpass, PGPASSWORD).")
    reader_timeout: Timeout = Field(10.0, description="Seconds to wait for a safekeeper's reader port to connect "
                                                      "and, while streaming, to say anything.")


ReaderAddresses = Annotated[
    tuple[PeerAddress, ...], NoDecode, BeforeValidator(_split), AfterValidator(_distinct), Metavar("HOST:PORT,..."),
    Field(min_length=1, description="Comma-separated HOST:PORT list of every safekeeper's reader port (their "
                                    "--pg-listen addresses).")]


class RestoreWalSettings(ArchiveSettings, ClusterSettings, ReaderCredentials):
    """walsidecar restore-wal: PostgreSQL's restore_command, served by the safekeepers, then the archive."""

    command: ClassVar[str] = "restore-wal"
    safekeeper_readers: Annotated[tuple[PeerAddress, ...], NoDecode, BeforeValidator(_split),
                                  AfterValidator(_distinct), Metavar("HOST:PORT,...")] = Field(
        (), description="Comma-separated HOST:PORT list of every safekeeper's reader port (their --pg-listen "
                        "addresses); without it, only --archive is read.")
    on_error: Literal["auto", "stop", "continue"] = Field(
        "auto", description="A file it cannot give and cannot say is beyond the committed end (too few "
                            "safekeepers answer, the archive does not answer, no good copy, a committed segment "
                            "no one holds): stop exits 128+code, which stops PostgreSQL's archive recovery "
                            "instead of letting it open without that WAL; continue exits 2-6, after which a "
                            "standby streams and asks again. auto: stop under recovery.signal, continue under "
                            "standby.signal (PostgreSQL runs restore_command in the data directory) or "
                            "neither.")
    retry_for: float = Field(60.0, ge=0, description="Before it stops recovery (--on-error stop): seconds to keep "
                                                     "asking again, as safekeepers come back or the archive "
                                                     "answers.")
    system_id: int | None = Field(None, ge=1, description="With --archive: the system id whose WAL to read "
                                                          "(<cluster>/<system id>/wal/); default: the safekeepers' "
                                                          "(IDENTIFY_SYSTEM), else the only one in the archive.")

    @model_validator(mode="after")
    def _somewhere(self) -> RestoreWalSettings:
        if not self.safekeeper_readers and not self.archive:
            raise ValueError("safekeeper_readers: give --safekeeper-readers HOST:PORT,..., --archive URL, or both")
        return self

    @model_validator(mode="after")
    def _tls(self) -> RestoreWalSettings:
        # From the archive alone no safekeeper link is opened: no certificates to ask for.
        if not self.safekeeper_readers and self.certs_dir is None:
            return self
        return TlsSettings._tls(self)  # type: ignore[return-value]


class ReaderSlotSettings(ReaderCredentials):
    """walsidecar readers slot: reader slots on the safekeepers, over their reader ports."""

    command: ClassVar[str] = "readers-slot"
    cli_words: ClassVar[str] = "readers slot create"
    safekeeper_readers: ReaderAddresses
    reserve_wal: bool = Field(False, description="create: hold WAL from each safekeeper's commit position now "
                                                 "(RESERVE_WAL), as a standby whose base backup is taken next "
                                                 "needs. Only where the reader streams from: such a slot holds "
                                                 "that safekeeper's WAL until the reader moves it.")


class FailoverBase(BrokerSettings, SafekeepersMixin, ReaderCredentials):
    """What failover and failover-gate share: the standby, the safekeepers and how long each step may take."""

    cert_role: ClassVar[str] = "proposer"
    standby_dsn: PgDsn = Field("", description="libpq connection string of the standby to promote (a "
                                               "superuser: it runs pg_promote() and reads its timeline "
                                               "history).")
    safekeepers: Safekeepers = Field(min_length=1)
    timeout: float = Field(60.0, gt=0, description="Seconds to win the fence term and commit its start on a quorum, "
                                                   "and for pg_promote() to finish.")
    catchup_timeout: float = Field(60.0, gt=0, description="Seconds the standby may replay nothing while below "
                                                           "the committed end before failover gives up without "
                                                           "promoting it.")



class FailoverSettings(FailoverBase):
    """walsidecar failover: promote a standby without losing an acknowledged commit."""

    command: ClassVar[str] = "failover"
    undo: bool = Field(False, description="Undo a failover that never promoted: lift the end it put on the old "
                                          "primary's timeline, so that its sidecar may stream again. Refused once "
                                          "the promoted standby's sidecar streams. No --standby-dsn.")

    @model_validator(mode="after")
    def _standby_unless_undo(self) -> FailoverSettings:
        if self.undo and self.standby_dsn:
            raise ValueError("standby_dsn: --undo promotes nothing; leave out --standby-dsn")
        if not self.undo and not self.standby_dsn:
            raise ValueError("standby_dsn: give --standby-dsn, the standby to promote (or --undo)")
        return self


class FailoverGateSettings(ArchiveSettings, FailoverBase):
    """walsidecar failover-gate: Patroni's pre_promote; failover's fence, recover and catch up, without promoting."""

    command: ClassVar[str] = "failover-gate"
    # Patroni renews its leader lock while the hook runs, but a refusal should come soon enough for the
    # other node to get its turn within a few ttl.
    timeout: float = Field(20.0, gt=0, description="Seconds to win the fence term and commit its start on a "
                                                   "quorum; longer and the gate refuses.")
    catchup_timeout: float = Field(20.0, gt=0, description="Seconds the standby may replay nothing while below "
                                                           "the committed end before the gate refuses.")
    safekeeper_readers: Annotated[tuple[PeerAddress, ...], NoDecode, BeforeValidator(_split),
                                  AfterValidator(_distinct), Metavar("HOST:PORT,...")] = Field(
        (), description="Every safekeeper's reader port: the gate writes the committed WAL the standby lacks, up "
                        "to E, into its pg_wal (the gate runs on the standby's host as its OS user), from them "
                        "and from --archive for what they removed once archived. Without it the standby must "
                        "get that WAL itself (restore_command = 'walsidecar restore-wal ...').")

    @model_validator(mode="after")
    def _standby(self) -> FailoverGateSettings:
        if not self.standby_dsn:
            raise ValueError("standby_dsn: give --standby-dsn, this node's PostgreSQL (the standby Patroni "
                             "promotes)")
        return self


class FollowLeaderSettings(Settings):
    """walsidecar follow-leader: run the sidecar on this node while its Patroni is the leader."""

    command: ClassVar[str] = "follow-leader"
    patroni_url: str = Field("http://127.0.0.1:8008", description="This node's Patroni REST API (its "
                                                                  "restapi.listen): GET /primary says whether "
                                                                  "it is the leader.")
    sidecar_config: FilePath = Field(description="The --config file of the `walsidecar start` it runs while "
                                                 "this node is the primary (pg_dsn: this node's PostgreSQL).")
    poll_interval: float = Field(0.5, gt=0, description="Seconds between questions to Patroni.")
    patroni_config: FilePath | None = Field(None, description="This node's patroni.yml: on a replica, the follower "
                                                              "then ends a lost leader's etcd lease (its scope, "
                                                              "namespace and etcd3 say where the key is), so that "
                                                              "Patroni fails over without waiting out ttl. "
                                                              "Without it, only the key's expiry does.")
    leader_lost_after: float = Field(3.0, gt=0, description="Seconds for which the leader's REST API and PostgreSQL "
                                                            "must accept no connection from this node, and etcd "
                                                            "must show its lease not renewed, before the follower "
                                                            "ends that lease (with --patroni-config).")


class VerifyArchiveSettings(LinkSettings):
    """walsidecar verify-archive: the archive's WAL, and with --safekeepers its gaps below their backup_lsn."""

    command: ClassVar[str] = "verify-archive"
    safekeepers: Safekeepers = Field((), description="Also ask these safekeepers (HOST:PORT,...) for their "
                                                     "backup_lsn: every segment below it must be in the archive.")
    certs_dir: Path | None = Field(None, description="Directory with a client certificate (`walsidecar certs "
                                                     "create-node --role client`) to ask --safekeepers with.")
    timeout: Timeout = 5.0
    gaps_only: bool = Field(False, description="Only compare the archive's segment names with the safekeepers' "
                                               "backup_lsn: no Spark, no decoding.")

    @model_validator(mode="after")
    def _asking(self) -> VerifyArchiveSettings:
        if self.safekeepers and self.certs_dir is None and not self.insecure:
            raise ValueError("safekeepers: give --certs-dir DIR (a client certificate) to ask them, or --insecure")
        if self.gaps_only and not self.safekeepers:
            raise ValueError("gaps_only: the gaps are found against the safekeepers' backup_lsn; give --safekeepers")
        return self


# Keys valid somewhere: a top-level key unknown to every command is a typo, not another command's option.
ALL_SETTINGS: tuple[type[Settings], ...] = (SafekeeperSettings, StartSettings, CheckSettings, StatusSettings,
                                            InitPostgresSettings, UpSettings, CtlSettings, ReadersSettings,
                                            RestoreWalSettings, ReaderSlotSettings, FailoverSettings,
                                            FailoverGateSettings, FollowLeaderSettings, VerifyArchiveSettings)


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
        up_config = running_up_config() if cls.up_has_config and config_file is None and not flags else None
        if up_config is not None:
            # Bare `walsidecar status` next to a running `up`: its file is what was meant, not a CA.
            raise ConfigError(f"no --config given: a running `walsidecar up` has one: "
                              f"walsidecar {cls.cli_words or cls.command} --config {up_config}") from None
        raise ConfigError(_explain(e, cls, flags, from_file, config_file)) from None


def _explain(e: ValidationError, cls: type[Settings], flags: dict[str, Any], from_file: dict[str, Any],
             path: Path | None) -> str:
    merged = {**from_file, **flags}

    def source(field: str) -> str:
        if field in flags and flags[field] is not None:
            return flag(field)
        if field in from_file:
            return f"{field} in {path}"
        if env_name(field) in os.environ:
            return env_name(field)
        return f"{field} (default)"

    errors = e.errors()
    lines = []
    for err in errors:
        field = str(err["loc"][0]) if err["loc"] else ""
        msg = err["msg"].removeprefix("Value error, ")
        # Another option a check names ({insecure}) is said as it was given: the flag, the file, the variable.
        msg = re.sub(r"\{(\w+)\}", lambda m: source(m[1]) if m[1] in cls.model_fields else m[0], msg)
        if err["type"] in ("too_short", "string_too_short") and len(err["loc"]) == 1:
            if any(o is not err and o["loc"][:1] == err["loc"] for o in errors):
                continue  # its items' own errors say why none was left
            if not err.get("input"):
                msg = f"empty: give {flag(field)} {_value(cls.model_fields[field])}".rstrip()
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
        # The value as given (`''`, not the empty tuple it became); an item's error shows the item.
        shown = err.get("input") if len(err["loc"]) > 1 else merged.get(field, os.environ.get(env_name(field),
                                                                                            err.get("input")))
        shown = str(shown) if isinstance(shown, Path) else shown
        value = f" = {shown!r}" if shown is not None and not isinstance(shown, dict) else ""
        lines.append(f"{source(field)}{value}: {msg}")
    return "invalid configuration for `walsidecar " + cls.command + "`:\n  " + "\n  ".join(lines)


CONFIG_OPTION = click.option(
    "--config", "config_file", type=click.Path(dir_okay=False, path_type=Path), envvar="WALSIDECAR_CONFIG",
    help="TOML file with options (flags win over it, it wins over WALSIDECAR_* variables).")


def fields(cls: type[Settings]) -> list[str]:
    """The options of `cls` in --help order: the command's own first, those every command has last."""
    names: list[str] = []
    for klass in cls.__mro__:
        names += [n for n in klass.__dict__.get("__annotations__", {}) if n in cls.model_fields and n not in names]
    return names


def _kinds(annotation: Any) -> list[Any]:
    """`annotation` and what it is made of, outermost first (Optional, Annotated and tuple unwrapped)."""
    out = [annotation]
    for arg in typing.get_args(annotation):
        if arg is not type(None) and arg is not Ellipsis and typing.get_origin(annotation) is not Literal:
            out += _kinds(arg)
    return out


def _base(field: FieldInfo) -> Any:
    """The field's type without None: bool, int, float, str, Path, a Literal or a tuple."""
    args = [a for a in typing.get_args(field.annotation) if a is not type(None)]
    kind = args[0] if typing.get_origin(field.annotation) in (typing.Union, types.UnionType) else field.annotation
    return typing.get_args(kind)[0] if typing.get_origin(kind) is Annotated else kind


def _value(field: FieldInfo) -> str:
    """What a flag takes, as --help and the README show it; empty for a switch."""
    kind = _base(field)
    if kind is bool:
        return ""
    if typing.get_origin(kind) is Literal:
        return "|".join(typing.get_args(kind))
    metadata = list(field.metadata) + [m for k in _kinds(field.annotation) if typing.get_origin(k) is Annotated
                                       for m in k.__metadata__]
    return next((m.text for m in metadata if isinstance(m, Metavar)),
                {int: "N", float: "SECONDS", Path: "DIR"}.get(kind, "TEXT"))


def _help(cls: type[Settings], name: str) -> str:
    field = cls.model_fields[name]
    text = (field.description or "").replace("{cert_role}", getattr(cls, "cert_role", ""))
    return text + (" Required." if field.is_required() else "")


def _shown_default(field: FieldInfo) -> Any:
    default = field.get_default()
    return None if field.is_required() or default is None or default is False or default == () else default


def _option(cls: type[Settings], name: str) -> click.Option:
    """The click option of field `name`: a switch for a bool, a choice for a Literal, a directory for a Path."""
    field = cls.model_fields[name]
    kind = _base(field)
    if kind is bool:
        return click.Option([flag(name)], is_flag=True, help=_help(cls, name))
    default = _shown_default(field)
    if typing.get_origin(kind) is Literal:
        return click.Option([flag(name)], type=click.Choice(typing.get_args(kind)), default=default,
                            show_default=True, help=_help(cls, name))
    directory = click.Path(file_okay=False, path_type=Path)
    if _value(field) == "FILE":
        directory = click.Path(dir_okay=False, path_type=Path)
    type_ = {int: click.INT, float: click.FLOAT, Path: directory}.get(kind)
    return click.Option([flag(name)], type=type_ or click.STRING, default=default, show_default=default is not None,
                        metavar=_value(field), help=_help(cls, name))


def _config_option() -> click.Option:
    return click.Option(["--config", "config_file"], type=click.Path(dir_okay=False, path_type=Path),
                        envvar="WALSIDECAR_CONFIG",
                        help="TOML file with options (flags win over it, it wins over WALSIDECAR_* variables).")


def configured(cls: type[Settings]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give a click command the options of `cls` and --config; call it with the validated settings.

    Only flags actually given on the command line count as flags; the defaults --help shows are
    the settings' own and never hide a TOML or environment value. Logging is set up before the call.
    """
    def wrap(f: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(f)
        def inner(config_file: Path | None, **params: Any) -> Any:
            from sidecar.logs import configure
            ctx = click.get_current_context()
            # A command's own arguments (a reader's NAME) are not settings: they go to it as they are.
            arguments = {k: params.pop(k) for k in list(params) if k not in cls.model_fields}
            given = {k: v for k, v in params.items() if ctx.get_parameter_source(k) is ParameterSource.COMMANDLINE}
            try:
                settings = load(cls, given, config_file)
            except ConfigError as e:
                raise click.UsageError(str(e), ctx) from None
            configure(settings.log_format, settings.log_level)
            return f(settings, **arguments)
        # click lists __click_params__ in reverse, as decorators stack them.
        inner.__click_params__ = [_config_option()] + [_option(cls, n) for n in reversed(fields(cls))]  # type: ignore
        return inner
    return wrap


def options_table(cls: type[Settings]) -> str:
    """The options of `cls` as the markdown table the README shows."""
    rows = ["| option | default | meaning |", "|---|---|---|"]
    for name in fields(cls):
        field = cls.model_fields[name]
        option = f"{flag(name)} {_value(field)}".strip().replace("|", "\\|")
        default = _shown_default(field)
        shown = "required" if field.is_required() else "" if default is None else f"`{default}`"
        rows.append(f"| `{option}` | {shown} | {_help(cls, name).removesuffix(' Required.')} |")
    return "\n".join(rows) + "\n"
