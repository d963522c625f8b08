"""The safekeepers' WAL archive as a layout and as a reader: where a system's WAL is, the names of its objects,
and checked copies of them. Both the uploader (safekeeper/backup.py) and the readers (restore-wal, the
proposer's catch-up) use it, so it lives below both services, beside objectstore.py.

Only PostgreSQL's exact names are read (`<prefix>/<cluster>/<system id>/wal/<name>`): a partial segment is
archived as `<name>.term-T.end-X-Y.partial` and is never handed out for `<name>`. A segment is checked as
WAL from a safekeeper is (size, page headers, record CRCs) before it is given.
"""

from __future__ import annotations

from dataclasses import dataclass

from sidecar import pgrepl
from sidecar.consensus.limits import LimitError, check_seg_size
from sidecar.lsn import format_lsn, parse_segment_file_name
from sidecar.objectstore import Storage, open_storage
from sidecar.wal.format import LONG_PAGE_HEADER, WalFormatError
from sidecar.wal.verify import check_segment_wal


def default_cluster(system_id: int) -> str:
    """The cluster name when --cluster is not given."""
    return str(system_id)


def wal_prefix(cluster: str, system_id: int) -> str:
    """Where a cluster's WAL lives under the archive URL."""
    return f"{cluster}/{system_id}/wal"


def partial_name(segment_name: str, term: int, end_lsn: int) -> str:
    """The object name of a partial segment: no complete segment and no other term's partial has it."""
    return f"{segment_name}.term-{term}.end-{format_lsn(end_lsn).replace('/', '-')}.partial"


class ArchiveError(Exception):
    """The archive could not be read (unreachable, refused, misconfigured): nothing is known about the file."""


class AmbiguousArchive(Exception):
    """The archive holds several systems' WAL and nothing says which one is meant."""


@dataclass(frozen=True)
class ArchivedWal:
    """One system's wal/ directory in the archive."""

    store: Storage
    system_id: int

    @property
    def location(self) -> str:
        return self.store.location

    def _read(self, name: str) -> bytes | None:
        try:
            return self.store.read(name)
        except FileNotFoundError:
            return None
        except Exception as e:  # boto3's and the filesystem's errors alike: the archive did not answer
            raise ArchiveError(f"{self.location}/{name}: {type(e).__name__}: {e}") from e

    def segment(self, name: str, timeline: int) -> bytes | None:
        """The whole, checked segment `name`; None when the archive lacks it, WalFormatError when it is bad."""
        data = self._read(name)
        if data is None:
            return None
        try:
            seg_size = check_seg_size(len(data))
        except LimitError as e:
            raise WalFormatError(f"{len(data)} bytes: not a whole segment ({e})") from None
        header_size = LONG_PAGE_HEADER.unpack_from(data)[6]
        if header_size != seg_size:
            raise WalFormatError(f"{len(data)} bytes, but its header says segments of {header_size} bytes")
        _, segno, _ = parse_segment_file_name(name, seg_size)
        check_segment_wal(data, segno * seg_size, seg_size, system_id=self.system_id, timeline=timeline)
        return data

    def history(self, name: str) -> bytes | None:
        """The checked .history file `name`; None when the archive lacks it."""
        data = self._read(name)
        if data is None:
            return None
        try:
            pgrepl.parse_timeline_history(data.decode())
        except (UnicodeDecodeError, pgrepl.ReplicationProtocolError) as e:
            raise WalFormatError(f"not a timeline history file: {e}") from None
        return data


def systems(store: Storage, cluster: str | None) -> set[tuple[str, int]]:
    """The (cluster, system id) pairs with a wal/ directory in the archive, within `cluster` when given."""
    try:
        keys = store.list(f"{cluster}/" if cluster else "")
    except Exception as e:  # as in ArchivedWal._read
        raise ArchiveError(f"{store.location}: cannot list it: {type(e).__name__}: {e}") from e
    found: set[tuple[str, int]] = set()
    for key in keys:
        parts = key.split("/")
        if len(parts) == 4 and parts[2] == "wal" and parts[1].isdigit():
            found.add((parts[0], int(parts[1])))
    return found


def open_archived_wal(url: str, s3_endpoint: str | None, cluster: str | None, system_id: int | None) -> ArchivedWal:
    """The wal/ directory of `system_id` (of the only system in the archive, or in `cluster`, when None)."""
    root = open_storage(url, s3_endpoint=s3_endpoint)
    if system_id is not None:
        return ArchivedWal(root.child(wal_prefix(cluster or default_cluster(system_id), system_id)), system_id)
    found = systems(root, cluster)
    if len(found) == 1:
        (name, sysid), = found
        return ArchivedWal(root.child(wal_prefix(name, sysid)), sysid)
    where = f"{root.location}/{cluster}/" if cluster else f"{root.location}/"
    if not found:
        raise ArchiveError(f"no <cluster>/<system id>/wal/ under {where}: is --archive the safekeepers' --archive"
                           + (", and --cluster theirs?" if cluster else "?"))
    listed = ", ".join(f"{c}/{s}" for c, s in sorted(found))
    raise AmbiguousArchive(f"{where} holds the WAL of several systems ({listed}): give --system-id (and --cluster) "
                           "to choose one")
