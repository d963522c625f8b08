"""A safekeeper counts a segment as archived only when the object holds its own WAL of it, byte for byte,
and uploads only a copy that passes the WAL checks: a same-size object or a flipped bit never makes it
remove WAL (audit-2 H-1). Real safekeepers in-process, sharing a `file://` archive."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

from sidecar.consensus.messages import (
    PROTOCOL_VERSION, Append, Elected, Greeting, InfoReply, InfoRequest, Message, TermEntry, VoteRequest,
)
from sidecar.lsn import segment_file_name
from sidecar.archivedwal import wal_prefix
from sidecar.safekeeper.backup import ArchiveOptions
from sidecar.safekeeper.server import Safekeeper
from support.helpers import created, run, until
from support.serving import talking_to
from support.walbuilder import WalBuilder

SEG = 1 << 20
SYSID = 7_300_000_000_000_000_019
SECOND = segment_file_name(1, 2, SEG)  # the second segment the safekeepers hold whole (the first is segment 1)
NEVER = 3600.0  # --archive-takeover for a safekeeper that must not upload during the test


def wal() -> bytes:
    """Valid WAL from SEG to past the end of segment 2: segments 1 and 2 whole, segment 3 begun."""
    b = WalBuilder(SEG, seg_size=SEG, sysid=SYSID)
    b.fill_to(3 * SEG + 100_000, 300)
    return b.bytes()


def safekeeper(tmp_path: Path, node_id: int, archive: Path, takeover: float = 30.0) -> Safekeeper:
    return Safekeeper.open(node_id, created(tmp_path / f"sk{node_id}", node_id), "127.0.0.1", 0,
                           archive=ArchiveOptions(f"file://{archive}", takeover=takeover))


def archived(archive: Path) -> Path:
    return archive / wal_prefix(str(SYSID), SYSID)


async def write_uncommitted(send: Callable[[Message], Awaitable[Message]], data: bytes) -> int:
    """Elect a proposer and send `data` from SEG on without committing any of it; where it ends."""
    await send(Greeting(PROTOCOL_VERSION, "p", SYSID, 1, SEG, 15))
    await send(VoteRequest(1))
    await send(Elected(1, SEG, (TermEntry(1, SEG),)))
    pos = SEG
    for i in range(0, len(data), 128 * 1024):
        piece = data[i:i + 128 * 1024]
        await send(Append(1, pos, 0, 0, piece))
        pos += len(piece)
    return pos


def backup_lsn(sk: Safekeeper) -> int:
    return sk.acceptor.state.backup_lsn


def held(sk: Safekeeper, name: str) -> bytes | None:
    path = sk.data_dir / "wal" / name
    return path.read_bytes() if path.exists() else None


def test_a_same_size_object_of_zeros_is_not_taken_for_the_segment(tmp_path: Path) -> None:
    data, archive = wal(), tmp_path / "archive"
    good = data[SEG:2 * SEG]  # segment 2

    async def main() -> None:
        sk = safekeeper(tmp_path, 1, archive)
        async with talking_to(sk) as send:
            end = await write_uncommitted(send, data)
            # Someone with write access to the archive (or a broken tool) got there first.
            planted = archived(archive) / SECOND
            planted.parent.mkdir(parents=True)
            planted.write_bytes(bytes(SEG))
            await send(Append(1, end, end, 0, b""))  # commits both whole segments
            # Segment 1 goes up; then the uploader either adopts the zeros (backup_lsn 3*SEG) or reports them.
            await until(lambda: backup_lsn(sk) >= 2 * SEG and (sk.uploader.error or backup_lsn(sk) > 2 * SEG),
                        "the uploader to decide about the planted object")
            assert backup_lsn(sk) == 2 * SEG, "a same-size object counted as the archived segment"
            await until(lambda: sk.remover.horizon.lsn == 2 * SEG, "the remover to see backup_lsn")
            assert held(sk, SECOND) == good, "the safekeeper removed its copy of the segment the archive lacks"
            assert planted.read_bytes() == bytes(SEG), "the object is left as it is, for an operator"
            # Reported by name: the view (/status, the gauge), the counter, and InfoReply (`walsidecar check`).
            assert sk.view().archive_mismatch == SECOND
            assert sk.stats.archive_mismatches._value.get() == 1
            reply = await send(InfoRequest())
            assert isinstance(reply, InfoReply) and reply.archive_mismatch == SECOND
            assert "ArchiveMismatch" in (sk.uploader.error or "")

            # An operator sets the object aside: the checked segment goes up, the report clears.
            planted.unlink()
            await until(lambda: backup_lsn(sk) == 3 * SEG, "the segment to be archived once the object is gone",
                        timeout=30)
            assert planted.read_bytes() == good
            assert sk.view().archive_mismatch is None
            assert (await send(InfoRequest())).archive_mismatch == ""  # type: ignore[attr-defined]

    run(main())


def test_a_flipped_bit_is_not_uploaded_and_a_peer_keeps_its_good_copy(tmp_path: Path) -> None:
    data, archive = wal(), tmp_path / "archive"
    good = data[SEG:2 * SEG]

    async def main() -> None:
        uploader = safekeeper(tmp_path, 1, archive)  # the lowest id: uploads at once
        peer = safekeeper(tmp_path, 2, archive, takeover=NEVER)
        async with talking_to(uploader) as send1, talking_to(peer) as send2:
            end = await write_uncommitted(send1, data)
            assert await write_uncommitted(send2, data) == end
            # Bit rot (or a bug) on the uploader's disk, in the middle of segment 2.
            path = uploader.data_dir / "wal" / SECOND
            rotten = bytearray(path.read_bytes())
            rotten[SEG // 2 + 1000] ^= 0x10  # inside a record: its CRC no longer matches
            path.write_bytes(rotten)
            for send in (send1, send2):
                await send(Append(1, end, end, 0, b""))

            await until(lambda: backup_lsn(uploader) >= 2 * SEG
                        and ("SegmentDamaged" in (uploader.uploader.error or "") or backup_lsn(uploader) > 2 * SEG),
                        "the uploader to decide about its segment 2")
            assert backup_lsn(uploader) == 2 * SEG, "a segment failing the WAL checks counted as archived"
            assert "CRC" in (uploader.uploader.error or ""), uploader.uploader.error
            assert not (archived(archive) / SECOND).exists(), "a segment failing the WAL checks was uploaded"
            assert held(uploader, SECOND) == bytes(rotten), "nothing is removed above backup_lsn"

            # The peer verified segment 1 (the uploader's object) against its own copy; segment 2 is missing.
            await until(lambda: backup_lsn(peer) >= 2 * SEG, "the peer to verify segment 1")
            # The damaged copy reaches the archive anyway (an older uploader did upload it): the peer compares
            # it with its own copy and does not take it for the segment.
            (archived(archive) / SECOND).write_bytes(bytes(rotten))
            await until(lambda: peer.uploader.error or backup_lsn(peer) > 2 * SEG,
                        "the peer to decide about the damaged object")
            assert backup_lsn(peer) == 2 * SEG, "the peer counted a damaged object as its segment"
            assert "ArchiveMismatch" in (peer.uploader.error or "")
            await until(lambda: peer.remover.horizon.lsn == 2 * SEG, "the peer's remover to see backup_lsn")
            assert held(peer, SECOND) == good, "the peer removed the only good copy"
            assert peer.view().archive_mismatch == SECOND

    run(main())
