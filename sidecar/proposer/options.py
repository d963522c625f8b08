"""What `walsidecar start` runs the proposer with."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sidecar.linkauth import Security
from sidecar.consensus.commitwait import CommitWait
from sidecar.proposer.primary import catchup_slot


@dataclass(frozen=True)
class StartOptions:
    pg_dsn: str
    safekeepers: tuple[str, ...]
    quorum: int
    application_name: str = "walsidecar"
    slot: str = "walsidecar"
    allow_primary_mismatch: bool = False
    wal_buffer_bytes: int = 64 * 1024 * 1024
    # For the safekeeper links: TLS, or a linkauth.LinkAuth (--link-security auth-only); None: --insecure.
    ssl_context: Security = None
    # How to log in to the safekeepers' reader ports (a config.ReaderCredentials): a lagging safekeeper
    # then catches up from another one when the primary no longer has the WAL. None: from the primary only.
    reader_credentials: Any = None
    # Bytes of WAL the horizon slot keeps below the commit position for lagging safekeepers
    # (--primary-retention); None: all that the slowest safekeeper lacks.
    primary_retention: int | None = None
    # The safekeepers' archive as (URL, S3 endpoint, cluster name): WAL that neither the primary nor any
    # safekeeper of the term holds any more comes from it. None: not from an archive.
    archive: tuple[str, str | None, str | None] | None = None
    # What happens to commits that wait in SyncRep while there is no quorum (--commit-wait).
    commit_wait: CommitWait = CommitWait()
    # degrade-after's broker: etcd endpoints, the cluster's name there, the client certificates (None: http).
    broker: tuple[tuple[str, ...], str, Path | None] | None = None

    @property
    def catchup_slot(self) -> str:
        return catchup_slot(self.slot)
