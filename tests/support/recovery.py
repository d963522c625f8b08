"""Archive recovery of a base backup with a restore_command, as a disaster-recovery test runs it."""

from __future__ import annotations

import os
import pwd
from pathlib import Path

import psycopg

from sidecar.pgcluster import LocalCluster
from support.helpers import free_port, wait_for


def recover(restored: LocalCluster, restore_command: str, **settings: str) -> None:
    """Start `restored` with recovery.signal and `restore_command`; wait until recovery ends and it is a primary."""
    restored.set({"port": str(restored.port), "synchronous_standby_names": "", "restore_command": restore_command,
                  **settings})
    signal = restored.data_dir / "recovery.signal"
    signal.touch()
    if os.geteuid() == 0:  # the server runs as the postgres OS user
        pw = pwd.getpwnam("postgres")
        os.chown(signal, pw.pw_uid, pw.pw_gid)
    restored.start(timeout=120)

    def promoted() -> bool:
        with psycopg.connect(restored.dsn(), autocommit=True, connect_timeout=5) as c:
            return c.execute("SELECT NOT pg_is_in_recovery()").fetchone()[0]
    wait_for(promoted, timeout=120, ignore=(psycopg.OperationalError,), what="the restored server to finish recovery")


def base_backup(home: Path, primary_dsn: str) -> LocalCluster:
    """A base backup of the primary (no WAL: recovery fetches it) in HOME/data, not started."""
    restored = LocalCluster(home / "data", free_port(), log_file=home / "restored.log")
    restored._prepare_log_file()
    restored.run_bin("pg_basebackup", "-D", str(restored.data_dir), "-d", primary_dsn, "-X", "none",
                     "-c", "fast", timeout=120)
    return restored
