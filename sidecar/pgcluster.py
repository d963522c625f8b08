"""Manage a local PostgreSQL cluster with the distribution's server binaries."""

from __future__ import annotations

import grp
import os
import pwd
import shutil
import signal
import stat
import subprocess
from pathlib import Path
from typing import Any, Mapping

from sidecar.processes import read_log, tail

MANAGED_CONF = "walsidecar.conf"
_INCLUDE_LINE = f"include_if_exists = '{MANAGED_CONF}'"

DEFAULT_SETTINGS: dict[str, str] = {
    "wal_level": "replica",
    "max_wal_senders": "10",
    "max_replication_slots": "10",
    "fsync": "on",
    "logging_collector": "off",
    "log_line_prefix": "%m [%p] %q%a ",
}


class ClusterError(RuntimeError):
    """A cluster operation failed; the message carries the relevant output or log tail."""


def find_bin_dir() -> Path:
    """Locate PostgreSQL 15 server binaries (Debian layout first, then pg_config, then PATH)."""
    debian = Path("/usr/lib/postgresql/15/bin")
    if (debian / "postgres").is_file() and (debian / "pg_ctl").is_file():
        return debian
    candidates: list[Path] = [debian]
    pg_config = shutil.which("pg_config")
    if pg_config:
        try:
            out = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, check=True)
            candidates.append(Path(out.stdout.strip()))
        except (OSError, subprocess.CalledProcessError):
            pass
    pg_ctl = shutil.which("pg_ctl")
    if pg_ctl:
        candidates.append(Path(pg_ctl).resolve().parent)
    for cand in candidates:
        if (cand / "postgres").is_file() and (cand / "pg_ctl").is_file():
            return cand
    raise ClusterError(
        "PostgreSQL server binaries not found (looked in "
        + ", ".join(str(c) for c in candidates)
        + "); run scripts/install.sh"
    )


def initdb_args(data_dir: Path) -> list[str]:
    """initdb's arguments for a cluster walsidecar manages (trust auth, UTF8, C locale), wherever it runs."""
    return ["-D", str(data_dir), "-U", "postgres", "-A", "trust", "-E", "UTF8", "--locale=C", "--no-instructions"]


def quote_setting(value: str) -> str:
    """Quote a value for postgresql.conf (single quotes, embedded quotes doubled)."""
    return "'" + value.replace("\\", "\\\\").replace("'", "''") + "'"


def _unquote_setting(raw: str) -> str:
    raw = raw.strip()
    if len(raw) >= 2 and raw[0] == raw[-1] == "'":
        return raw[1:-1].replace("''", "'").replace("\\\\", "\\")
    return raw


class LocalCluster:
    """One PostgreSQL data directory plus the pg_ctl operations on it."""

    def __init__(
        self,
        data_dir: Path,
        port: int,
        *,
        host: str = "127.0.0.1",
        bin_dir: Path | None = None,
        os_user: str | None = None,
        log_file: Path | None = None,
    ) -> None:
        self.data_dir = Path(data_dir).absolute()
        self.port = port
        self.host = host
        self._bin_dir = Path(bin_dir) if bin_dir is not None else find_bin_dir()
        if os_user is None and os.geteuid() == 0:
            os_user = "postgres"
        # Running as ourselves needs no privilege switch.
        if os_user is not None and os_user == pwd.getpwuid(os.geteuid()).pw_name:
            os_user = None
        self.os_user = os_user
        self.log_file = (
            Path(log_file).absolute()
            if log_file is not None
            else self.data_dir.with_name(self.data_dir.name + ".log")
        )

    def __repr__(self) -> str:
        return f"LocalCluster(data_dir={str(self.data_dir)!r}, port={self.port})"

    @property
    def bin_dir(self) -> Path:
        """Directory holding postgres, pg_ctl, pgbench, pg_waldump, ..."""
        return self._bin_dir

    @property
    def pg_wal_dir(self) -> Path:
        """The cluster's pg_wal directory."""
        return self.data_dir / "pg_wal"

    @property
    def conf_file(self) -> Path:
        """The include file holding the settings this class manages."""
        return self.data_dir / MANAGED_CONF

    # ----- running commands as the cluster's OS user -----

    def spawn_kwargs(self) -> dict[str, Any]:
        """subprocess keyword arguments that run a child as the cluster's OS user."""
        env = dict(os.environ)
        env.update({"PGHOST": self.host, "PGPORT": str(self.port), "PGUSER": "postgres"})
        if self.os_user is None:
            return {"env": env}
        pw = pwd.getpwnam(self.os_user)
        env.update({"HOME": pw.pw_dir, "USER": pw.pw_name, "LOGNAME": pw.pw_name})
        groups = [g.gr_gid for g in grp.getgrall() if pw.pw_name in g.gr_mem]
        return {
            "user": pw.pw_uid,
            "group": pw.pw_gid,
            "extra_groups": groups,
            "env": env,
            # The caller's cwd (e.g. /root) may be unreadable to the OS user.
            "cwd": "/",
        }

    def run_bin(
        self,
        name: str,
        *args: str,
        check: bool = True,
        capture: bool = True,
        input: str | None = None,
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
        cwd: Path | str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run a binary from bin_dir as the OS user; PGHOST/PGPORT/PGUSER point at this cluster."""
        kwargs = self.spawn_kwargs()
        if env:
            kwargs["env"].update(env)
        if cwd is not None:
            kwargs["cwd"] = str(cwd)
        argv = [str(self.bin_dir / name), *args]
        try:
            proc = subprocess.run(
                argv,
                capture_output=capture,
                text=True,
                input=input,
                timeout=timeout,
                stdin=None if input is not None else subprocess.DEVNULL,
                **kwargs,
            )
        except subprocess.TimeoutExpired as exc:
            raise ClusterError(f"{name} timed out after {timeout}s: {' '.join(argv)}") from exc
        if check and proc.returncode != 0:
            raise ClusterError(
                f"{name} exited with {proc.returncode}: {' '.join(argv)}\n"
                f"stdout:\n{tail(proc.stdout or '')}\nstderr:\n{tail(proc.stderr or '')}"
            )
        return proc

    def _pg_ctl(self, *args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.run_bin(
            "pg_ctl", "-D", str(self.data_dir), *args, check=check, timeout=timeout + 30
        )

    # ----- filesystem preparation -----

    def _chown(self, path: Path) -> None:
        if self.os_user is not None:
            pw = pwd.getpwnam(self.os_user)
            os.chown(path, pw.pw_uid, pw.pw_gid)

    def _ensure_traversable(self, directory: Path) -> None:
        """Grant o+x on ancestors the OS user could not otherwise pass through."""
        if self.os_user is None:
            return
        pw = pwd.getpwnam(self.os_user)
        groups = {pw.pw_gid} | {g.gr_gid for g in grp.getgrall() if pw.pw_name in g.gr_mem}
        for d in [directory, *directory.parents]:
            st = d.stat()
            if st.st_uid == pw.pw_uid:
                ok = bool(st.st_mode & stat.S_IXUSR)
            elif st.st_gid in groups:
                ok = bool(st.st_mode & stat.S_IXGRP)
            else:
                ok = bool(st.st_mode & stat.S_IXOTH)
            if not ok:
                os.chmod(d, stat.S_IMODE(st.st_mode) | stat.S_IXOTH)

    def _prepare_dirs(self) -> None:
        parent = self.data_dir.parent
        if not parent.exists():
            parent.mkdir(parents=True, mode=0o755)
        self._ensure_traversable(parent)
        if self.data_dir.exists():
            if any(self.data_dir.iterdir()):
                raise ClusterError(f"data directory {self.data_dir} exists and is not empty")
        else:
            self.data_dir.mkdir(mode=0o700)
        self._chown(self.data_dir)
        self._prepare_log_file()

    def _prepare_log_file(self) -> None:
        # pg_ctl opens the log as the OS user, which may not be able to create it.
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        self._ensure_traversable(self.log_file.parent)
        self.log_file.touch(exist_ok=True)
        self._chown(self.log_file)

    def log_text(self) -> str:
        """The server log so far (empty string when there is none)."""
        return read_log(self.log_file)

    def log_tail(self, lines: int = 40) -> str:
        """Last lines of the server log."""
        return tail(self.log_text(), lines)

    # ----- configuration -----

    def init(self, settings: Mapping[str, str] | None = None) -> None:
        """initdb (trust auth, UTF8) and write the managed settings."""
        if (self.data_dir / "PG_VERSION").exists():
            raise ClusterError(f"{self.data_dir} is already initialised")
        self._prepare_dirs()
        proc = self.run_bin("initdb", *initdb_args(self.data_dir), check=False, timeout=300)
        if proc.returncode != 0:
            raise ClusterError(
                f"initdb failed for {self.data_dir} (exit {proc.returncode}):\n"
                f"{tail(proc.stdout or '')}\n{tail(proc.stderr or '')}"
            )
        self.configure(settings)

    def configure(self, settings: Mapping[str, str] | None = None) -> None:
        """After initdb: include walsidecar.conf from postgresql.conf and write the defaults plus settings to it."""
        with (self.data_dir / "postgresql.conf").open("a") as f:
            f.write(f"\n# Settings managed by walsidecar; later lines win.\n{_INCLUDE_LINE}\n")
        base: dict[str, str] = {
            "listen_addresses": self.host,
            "port": str(self.port),
            # TCP only: avoids socket path length limits and /var/run permissions.
            "unix_socket_directories": "",
            **DEFAULT_SETTINGS,
        }
        self._write_managed({**base, **(settings or {})})

    def managed_settings(self) -> dict[str, str]:
        """The settings currently in walsidecar.conf."""
        result: dict[str, str] = {}
        try:
            text = self.conf_file.read_text()
        except FileNotFoundError:
            return result
        for line in text.splitlines():
            line = line.strip()
            if not line or line.startswith("#") or "=" not in line:
                continue
            key, _, raw = line.partition("=")
            result[key.strip()] = _unquote_setting(raw)
        return result

    def set(self, settings: Mapping[str, str | None]) -> None:
        """Merge settings into walsidecar.conf (None removes one); reload or restart to apply."""
        current = self.managed_settings()
        for key, value in settings.items():
            if value is None:
                current.pop(key, None)
            else:
                current[key] = value
        self._write_managed(current)

    def _write_managed(self, settings: Mapping[str, str]) -> None:
        body = "".join(f"{k} = {quote_setting(str(v))}\n" for k, v in settings.items())
        tmp = self.conf_file.with_suffix(".conf.tmp")
        tmp.write_text("# Managed by walsidecar (sidecar.pgcluster); rewritten on every change.\n" + body)
        self._chown(tmp)
        os.replace(tmp, self.conf_file)

    # ----- lifecycle -----

    def start(self, timeout: float = 60) -> None:
        """Start the server and wait until it accepts connections."""
        if not (self.data_dir / "PG_VERSION").exists():
            raise ClusterError(f"{self.data_dir} is not initialised; call init() first")
        self._prepare_log_file()
        proc = self._pg_ctl(
            "-l", str(self.log_file), "-w", "-t", str(int(max(1, timeout))), "start",
            timeout=timeout, check=False,
        )
        if proc.returncode != 0:
            raise ClusterError(
                f"server failed to start ({self.data_dir}, port {self.port}):\n"
                f"{tail(proc.stdout or '')}{tail(proc.stderr or '')}\n"
                f"--- tail of {self.log_file} ---\n{self.log_tail()}"
            )

    def stop(self, mode: str = "fast", timeout: float = 60) -> None:
        """Stop the server if it is running (smart, fast or immediate)."""
        if not self.is_running():
            return
        proc = self._pg_ctl(
            "-m", mode, "-w", "-t", str(int(max(1, timeout))), "stop", timeout=timeout, check=False
        )
        if proc.returncode != 0 and self.is_running():
            raise ClusterError(
                f"server did not stop ({mode}):\n{tail(proc.stderr or '')}\n"
                f"--- tail of {self.log_file} ---\n{self.log_tail()}"
            )

    def crash(self) -> None:
        """Stop without a shutdown checkpoint, so the next start runs crash recovery."""
        self.stop(mode="immediate")

    def restart(self, timeout: float = 60) -> None:
        """Fast stop then start."""
        self.stop(timeout=timeout)
        self.start(timeout=timeout)

    def reload(self) -> None:
        """Signal the server to reread its configuration (applies asynchronously)."""
        self._pg_ctl("reload")

    def is_running(self) -> bool:
        """True when pg_ctl sees a live postmaster for this data directory."""
        if not (self.data_dir / "PG_VERSION").exists():
            return False
        return self._pg_ctl("status", check=False).returncode == 0

    def postmaster_pid(self) -> int | None:
        """PID of the running postmaster, or None."""
        try:
            first = (self.data_dir / "postmaster.pid").read_text().splitlines()[0]
        except (OSError, IndexError):
            return None
        return int(first) if self.is_running() else None

    def teardown(self) -> None:
        """Stop by any means that targets only this server: pg_ctl fast, immediate, then its postmaster's PID."""
        for mode in ("fast", "immediate"):
            try:
                self.stop(mode=mode, timeout=30)
                return
            except (ClusterError, OSError, subprocess.SubprocessError):
                continue
        pid = self.postmaster_pid()
        if pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def dsn(self, dbname: str = "postgres", user: str = "postgres", **params: str) -> str:
        """libpq keyword/value connection string for this cluster over TCP."""
        parts = {"host": self.host, "port": str(self.port), "user": user, "dbname": dbname, **params}
        return " ".join(f"{k}={_dsn_quote(str(v))}" for k, v in parts.items())


def _dsn_quote(value: str) -> str:
    if value and not any(c in value for c in " '\\\t\n"):
        return value
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
