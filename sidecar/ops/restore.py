"""`walsidecar restore-wal %f %p`: PostgreSQL's restore_command, served by the safekeepers' reader ports.

A segment comes whole from the first safekeeper whose commit position passes its end. The last,
unfinished segment is given only when a majority of the safekeepers answer, up to the highest
commit position they report (each a position a quorum flushed: invariant 5), zero-padded to the
segment size as PostgreSQL expects of a segment. What arrives is checked (size, page headers,
record CRCs) before `%p` is written: a temporary file, fsync, rename.

With `--archive`, a file no safekeeper gives (removed below backup_lsn, none reachable, or no
`--safekeeper-readers`) is looked up there, by its exact name, and checked the same way.
"""

from __future__ import annotations

import contextlib
import enum
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sidecar import pgrepl
from sidecar.address import Address
from sidecar.config import RestoreWalSettings
from sidecar.logs import module_logger
from sidecar.archivedwal import AmbiguousArchive, ArchiveError, open_archived_wal
from sidecar.lsn import format_lsn, parse_segment_file_name
from sidecar.walclient import ReaderError, ReaderUnreachable, WalReader, copy_wal
from sidecar.wal.format import WalFormatError
from sidecar.wal.verify import check_segment_wal

log = module_logger(command="restore-wal")

UNDEFINED_FILE = "58P01"  # the safekeeper does not hold it (never had, or removed)
INVALID_PARAMETER = "22023"  # a position or timeline this safekeeper cannot serve
NO_WAL_YET = "55000"
_NOT_HELD = (UNDEFINED_FILE, INVALID_PARAMETER)
_HISTORY = re.compile(r"[0-9A-F]{8}\.history")


class Exit(enum.IntEnum):
    """restore-wal's exit codes. PostgreSQL takes 1-125 as "not there" and moves on (under recovery.signal:
    to the end of recovery), and above 125 stops recovery: so only a file known not to exist is 1, and
    under archive recovery every other failure is STOP + its code."""

    RESTORED = 0
    NOT_FOUND = 1  # known not to exist: beyond the committed end (a majority said so), or not in an archive alone
    USAGE = 2  # wrong options (click's own code), or an archive holding several systems and no --system-id
    UNREACHABLE = 3  # too few safekeepers answered to know, or the archive did not answer
    BAD_DATA = 4  # the safekeepers (or the archive) that hold it gave WAL that fails the checks
    CANNOT_WRITE = 5  # %p could not be written
    MISSING = 6  # committed (a safekeeper's commit position passes it), yet no one gives it

    STOP = 128  # added to a failure's code when it must stop archive recovery (--on-error stop)


RECOVERY_SIGNAL, STANDBY_SIGNAL = "recovery.signal", "standby.signal"
RETRY_FIRST, RETRY_MAX = 0.5, 5.0  # seconds between tries under archive recovery


class Failure(Exception):
    """The file was not restored: `code` for the exit, the message for stderr."""

    def __init__(self, code: Exit, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class Seen:
    """What the safekeepers said of the system, for finding its WAL in the archive."""

    system_id: int | None = None


@dataclass
class Answer:
    """What one safekeeper said to IDENTIFY_SYSTEM and SHOW wal_segment_size."""

    address: Address
    reader: WalReader
    system_id: int
    timeline: int
    commit: int
    seg_size: int  # 0: it holds no WAL yet


def stops_recovery(s: RestoreWalSettings, data_dir: Path) -> bool:
    """Whether a failure must stop recovery: --on-error, or auto: archive recovery (recovery.signal alone)."""
    if s.on_error != "auto":
        return s.on_error == "stop"
    return (data_dir / RECOVERY_SIGNAL).exists() and not (data_dir / STANDBY_SIGNAL).exists()


def restore_wal(s: RestoreWalSettings, name: str, target: Path, *, stop: bool | None = None,
                sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic) -> int:
    """Restore `name` into `target`; the exit code. Failures are logged with the reason and returned.

    Under archive recovery (`stop`; default: from the signal files in the working directory, the data
    directory) a failure other than "not there" is asked again for --retry-for seconds, then stops
    recovery: PostgreSQL must not open without WAL that may exist. A standby asks again by itself.
    """
    if stop is None:
        stop = stops_recovery(s, Path.cwd())
    deadline, pause = clock() + s.retry_for, RETRY_FIRST
    while True:
        try:
            data = _restore(s, name)
            write = _write(target, data)
            if write is None:
                return Exit.RESTORED
            raise write
        except Failure as e:
            # PostgreSQL asks for files that do not exist as a matter of course (the next timeline's history).
            if e.code is Exit.NOT_FOUND:
                log.info("not restored", file=name, reason=str(e), exit_code=int(e.code))
                return e.code
            if not stop:
                log.error("not restored", file=name, reason=str(e), exit_code=int(e.code))
                return e.code
            if e.code in (Exit.UNREACHABLE, Exit.BAD_DATA, Exit.MISSING) and clock() + pause <= deadline:
                log.warning("not restored yet; asking again", file=name, reason=str(e), retry_in=pause)
                sleep(pause)
                pause = min(pause * 2, RETRY_MAX)
                continue
            code = Exit.STOP + e.code
            log.error("not restored; stopping archive recovery, which must not end without this WAL: "
                      "fix the cause and start PostgreSQL again", file=name, reason=str(e), exit_code=code)
            return code


def _write(target: Path, data: bytes) -> Failure | None:
    try:
        write_atomically(target, data)
    except OSError as e:
        return Failure(Exit.CANNOT_WRITE, f"cannot write {target}: {e.strerror or e}")
    return None


def _restore(s: RestoreWalSettings, name: str) -> bytes:
    """The checked file: from the safekeepers, else from the archive."""
    history = _HISTORY.fullmatch(name) is not None
    if history:
        tli, segno = int(name[:8], 16), 0
    else:
        try:
            tli, segno, partial = parse_segment_file_name(name)
        except ValueError:
            partial, tli = True, 0
        if partial or tli == 0:
            raise Failure(Exit.NOT_FOUND, f"{name} is neither a WAL segment nor a .history file; the "
                                          "safekeepers and the archive serve only those")
    seen = Seen()
    first: Failure | None = None
    if s.safekeeper_readers:
        try:
            return _history(s, tli, seen) if history else _segment(s, name, tli, segno, seen)
        except Failure as e:
            if s.archive is None:
                raise
            first = e
            log.info("not from the safekeepers; trying the archive", file=name, reason=str(e))
    return _from_archive(s, name, tli, history, seen, first)


def _from_archive(s: RestoreWalSettings, name: str, tli: int, history: bool, seen: Seen,
                  first: Failure | None) -> bytes:
    """`name` from --archive; `first` is why the safekeepers did not give it (None: none were asked)."""
    assert s.archive is not None
    before = f"{first}; " if first is not None else ""
    if s.system_id and seen.system_id and s.system_id != seen.system_id:
        raise Failure(Exit.USAGE, f"{before}--system-id {s.system_id} is not the safekeepers' system "
                                  f"{seen.system_id}: fix --system-id or --safekeeper-readers")
    try:
        wal = open_archived_wal(s.archive, s.s3_endpoint, s.cluster, s.system_id or seen.system_id)
        data = wal.history(name) if history else wal.segment(name, tli)
    except AmbiguousArchive as e:
        raise Failure(Exit.USAGE, f"{before}{e}") from None
    except ArchiveError as e:
        code = first.code if first is not None and first.code is Exit.BAD_DATA else Exit.UNREACHABLE
        raise Failure(code, f"{before}the archive did not answer (check --archive, --s3-endpoint and the AWS "
                            f"credentials): {e}") from None
    except WalFormatError as e:
        raise Failure(Exit.BAD_DATA, f"{before}{wal.location}/{name} in the archive fails the checks: {e}") from None
    if data is None:
        raise Failure(first.code if first is not None else Exit.NOT_FOUND,
                      f"{before}{name} is not in the archive {wal.location} either" if first is not None
                      else f"{name} is not in the archive {wal.location}")
    log.info("restored from the archive", file=name, archive=wal.location, bytes=len(data),
             system_id=wal.system_id)
    return data


def _addresses(s: RestoreWalSettings) -> list[Address]:
    return [Address.parse(a) for a in s.safekeeper_readers]


def _history(s: RestoreWalSettings, tli: int, seen: Seen) -> bytes:
    name = pgrepl.history_file_name(tli)
    unreachable: list[str] = []
    bad: list[str] = []
    for address in _addresses(s):
        try:
            with WalReader(address, s, application_name="walsidecar restore-wal") as r:
                if s.archive is not None and seen.system_id is None:
                    seen.system_id = r.identify()[0] or None  # where the archive keeps it, if needed
                content = r.timeline_history(tli)
        except ReaderUnreachable as e:
            log.warning("safekeeper unreachable", safekeeper=str(address), reason=e.message)
            unreachable.append(f"{address}: {e.message}")
            continue
        except ReaderError as e:
            if e.sqlstate in _NOT_HELD:
                log.info("safekeeper does not hold it", file=name, safekeeper=str(address))
                continue
            bad.append(f"{address}: {e.message}")
            continue
        try:
            pgrepl.parse_timeline_history(content)
        except pgrepl.ReplicationProtocolError as e:
            log.warning("safekeeper sent a bad history file", file=name, safekeeper=str(address), reason=str(e))
            bad.append(f"{address}: {e}")
            continue
        log.info("restored", file=name, safekeeper=str(address), bytes=len(content.encode()))
        return content.encode()
    raise _nowhere(name, unreachable, bad, len(_addresses(s)))


def _nowhere(name: str, unreachable: list[str], bad: list[str], n: int, committed: bool = False) -> Failure:
    """Why no safekeeper gave `name`; `committed`: a commit position says it exists."""
    if bad:
        return Failure(Exit.BAD_DATA, f"{name}: no safekeeper gave a good copy: " + "; ".join(bad + unreachable))
    if unreachable and len(unreachable) * 2 >= n:
        head = "no safekeeper answered" if len(unreachable) >= n else \
            f"not found on the safekeepers that answered, and {len(unreachable)} of {n} did not"
        return Failure(Exit.UNREACHABLE, f"{name}: {head} (check --safekeeper-readers and that their reader "
                                         "ports run): " + "; ".join(unreachable))
    if committed:
        return Failure(Exit.MISSING, f"{name} is committed, but no safekeeper that answered holds it any more "
                                     "(removed once archived: give --archive)")
    return Failure(Exit.NOT_FOUND, f"{name} does not exist on the safekeepers")


def _segment(s: RestoreWalSettings, name: str, tli: int, segno: int, seen: Seen) -> bytes:
    addresses = _addresses(s)
    majority = len(addresses) // 2 + 1
    unreachable: list[str] = []
    bad: list[str] = []
    with contextlib.ExitStack() as stack:
        answers: list[Answer] = []
        for address in addresses:
            r = WalReader(address, s, application_name="walsidecar restore-wal")
            try:
                r.connect()
                stack.callback(r.close)
                system_id, timeline, commit = r.identify()
                try:
                    seg_size = r.wal_segment_size()
                except ReaderError as e:
                    if e.sqlstate != NO_WAL_YET:
                        raise
                    seg_size = 0
            except ReaderUnreachable as e:
                log.warning("safekeeper unreachable", safekeeper=str(address), reason=e.message)
                unreachable.append(f"{address}: {e.message}")
                continue
            except ReaderError as e:
                # It could not be asked: as good as unreachable, not a bad copy.
                log.warning("safekeeper refused", safekeeper=str(address), reason=e.message, sqlstate=e.sqlstate)
                unreachable.append(f"{address}: {e.message}")
                continue
            answers.append(Answer(address, r, system_id, timeline, commit, seg_size))
        holding = [a for a in answers if a.seg_size]
        if len({a.system_id for a in holding}) > 1 or len({a.seg_size for a in holding}) > 1:
            raise Failure(Exit.BAD_DATA, "the safekeepers disagree on the system or the segment size: " + ", ".join(
                f"{a.address} system {a.system_id} segment {a.seg_size}" for a in holding)
                + "; --safekeeper-readers must list the safekeepers of one deployment")
        seen.system_id = next((a.system_id for a in answers if a.system_id), None)
        if not holding:
            raise _nowhere(name, unreachable, bad, len(addresses))
        seg_size, system_id = holding[0].seg_size, holding[0].system_id
        start, end = segno * seg_size, (segno + 1) * seg_size
        whole = [a for a in holding if a.commit >= end]
        ended: list[str] = []  # the timeline ends before the segment does: no segment has this name
        if whole:
            got = _fetch(name, whole, start, end, tli, seg_size, system_id, bad, unreachable, ended)
            if got is not None:
                return got
            if ended and not bad:
                raise Failure(Exit.NOT_FOUND, f"{name} does not exist: {ended[0]}")
            raise _nowhere(name, unreachable, bad, len(addresses), committed=True)
        # The segment is not complete anywhere: the unfinished last one, or one not written yet.
        if len(answers) < majority:
            raise Failure(Exit.UNREACHABLE, f"{name}: only {len(answers)} of {len(addresses)} safekeepers "
                                            f"answered; a partial segment needs a majority ({majority}) to know "
                                            "where the committed WAL ends: " + "; ".join(unreachable))
        top = max(a.commit for a in holding)
        if top <= start:
            raise Failure(Exit.NOT_FOUND, f"{name} does not exist yet: the highest commit position is "
                                          f"{format_lsn(top)}, before the segment's start {format_lsn(start)}")
        ranked = sorted((a for a in holding if a.commit > start), key=lambda a: -a.commit)
        for a in ranked:
            got = _fetch(name, [a], start, a.commit, tli, seg_size, system_id, bad, unreachable, ended)
            if got is not None:
                if a.commit < top:
                    log.warning("served short: the safekeepers with more gave no good copy", file=name,
                                end=format_lsn(a.commit), highest_commit=format_lsn(top))
                return got + bytes(seg_size - len(got))
        if ended and not bad:
            raise Failure(Exit.NOT_FOUND, f"{name} does not exist: {ended[0]}")
        raise _nowhere(name, unreachable, bad, len(addresses), committed=True)


def _fetch(name: str, candidates: list[Answer], start: int, end: int, tli: int, seg_size: int, system_id: int,
           bad: list[str], unreachable: list[str], ended_at: list[str]) -> bytes | None:
    """[start, end) of timeline `tli` from the first candidate that gives a good copy; None if none does.
    Why each did not goes to `bad`, `unreachable`, or `ended_at` (timeline `tli` ends inside the range)."""
    for a in candidates:
        where = str(a.address)
        try:
            data = copy_wal(a.reader, start, end, timeline=tli)
        except ReaderUnreachable as e:
            log.warning("safekeeper lost while streaming", file=name, safekeeper=where, reason=e.message)
            unreachable.append(f"{where}: {e.message}")
            continue
        except ReaderError as e:
            ended = a.reader.timeline_end
            if e.sqlstate in _NOT_HELD or ended is not None:
                why = (f"timeline {tli} ends at {format_lsn(ended.switch_lsn)}, inside the segment"
                       if ended is not None else e.message)
                log.info("safekeeper does not hold it", file=name, safekeeper=where, reason=why)
                if ended is not None or e.sqlstate == INVALID_PARAMETER:  # not in timeline `tli`: no such file
                    ended_at.append(why)
                continue
            log.warning("safekeeper failed", file=name, safekeeper=where, reason=e.message, sqlstate=e.sqlstate)
            bad.append(f"{where}: {e.message}")
            continue
        try:
            check_segment_wal(data, start, seg_size, system_id=system_id, timeline=tli)
        except WalFormatError as e:
            log.error("safekeeper sent bad WAL; trying another", file=name, safekeeper=where, reason=str(e))
            bad.append(f"{where}: bad WAL: {e}")
            continue
        log.info("restored", file=name, safekeeper=where, start=format_lsn(start), end=format_lsn(end),
                 partial=end - start < seg_size)
        return data
    return None


def write_atomically(path: Path, data: bytes) -> None:
    """`path` holds `data` or is untouched: a temporary file beside it, fsync, rename, fsync of the directory."""
    tmp = path.with_name(f".{path.name}.walsidecar-tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
