"""The publisher against a real etcd, for safekeepers it is handed as views: keys, peers, the upload lease."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import replace

from sidecar.broker import Broker, read_clusters
from sidecar.consensus.messages import TermEntry
from sidecar.consensus.state import AcceptorState
from sidecar.safekeeper.positions import Positions, PositionWatch
from sidecar.safekeeper.publish import Publisher
from sidecar.safekeeper.view import SafekeeperView
from support.etcd import EtcdServer
from support.helpers import until

SEG = 16 << 20
STATE = AcceptorState(7301, SEG, 15, 1, term=5, term_history=(TermEntry(5, 0x1000000),), commit_lsn=3 * SEG,
                      backup_lsn=2 * SEG)


class FakeSafekeeper:
    """Stands in for a Safekeeper: a view and the positions the test moves."""

    def __init__(self, node_id: int, flush_lsn: int) -> None:
        self.positions = PositionWatch(Positions(5, flush_lsn, min(flush_lsn, 3 * SEG)))
        self.current = SafekeeperView(
            node_id=node_id, listen=f"127.0.0.1:{7600 + node_id}", link_security="tls", state=STATE,
            positions=self.positions.value, elected_term=5, write_lsn=flush_lsn, proposer_connected=True,
            disk_full=False, fatal=None, stopped=False)

    def view(self) -> SafekeeperView:
        return replace(self.current, positions=self.positions.value)


def test_each_publishes_its_keys_reads_its_peers_and_only_a_caught_up_one_uploads(etcd: EtcdServer) -> None:
    async def main() -> None:
        ahead, behind = FakeSafekeeper(1, 3 * SEG + 100), FakeSafekeeper(2, SEG)
        pubs = [Publisher(sk, Broker([etcd.url]), ttl=2, elect_uploader=True) for sk in (ahead, behind)]
        reader = Broker([etcd.url])
        try:
            # Safekeeper 2 sees 1's commit_lsn two segments past its own flush: lagging, it does not take the lease.
            pubs[0].elect_uploader = False
            await pubs[0].publish_once()
            await pubs[1].publish_once()
            assert pubs[1].view().uploader is None and not pubs[1].election.leading
            pubs[0].elect_uploader = True
            await pubs[0].publish_once()
            await pubs[1].publish_once()
            assert [p.election.leading for p in pubs] == [True, False]
            assert pubs[1].view().uploader == 1 and [s.id for s in pubs[1].view().peers] == [1, 2]
            entries = (await read_clusters(reader))["7301"][1]
            assert entries.uploader == 1
            assert entries.safekeepers[2].flush_lsn == SEG and entries.safekeepers[1].backup_lsn == 2 * SEG
            assert entries.safekeepers[1].address == "127.0.0.1:7601"

            # Safekeeper 1 stops cleanly: its lease is revoked, its keys go at once, and 2, caught up now, uploads.
            behind.positions.publish(Positions(5, 3 * SEG + 100, 3 * SEG))
            pubs[0].connected = None
            task = asyncio.create_task(pubs[0].run())
            await until(lambda: pubs[0].connected, "safekeeper 1 to publish from its loop")
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            assert set((await read_clusters(reader))["7301"][1].safekeepers) == {2}
            await pubs[1].publish_once()
            assert pubs[1].election.may_upload(3 * SEG)
        finally:
            reader.close()
            for p in pubs:
                p.broker.close()

    asyncio.run(main())
