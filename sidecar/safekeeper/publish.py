"""Publish this safekeeper's state to the broker about once a second, and read its peers' states there.

Wakes on `positions.PositionWatch` (a term or LSN moved; coalesced to at most one publish per
MIN_INTERVAL) or after a second without change. The broker is never on the commit path: when etcd
does not answer, publishing retries with back-off, logging once when it fails and once when it
works again, while commits and reads go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Protocol

from sidecar.broker import (
    Broker, BrokerError, Lease, LeaseElection, SafekeeperState, group_states, safekeepers_prefix, uploader_key,
)
from sidecar.logs import get_logger
from sidecar.lsn import format_lsn
from sidecar.safekeeper.positions import PositionWatch
from sidecar.safekeeper.view import BrokerView, SafekeeperView

INTERVAL = 1.0  # seconds between publishes when nothing changes
MIN_INTERVAL = 0.2  # seconds between publishes under load: LSN moves are coalesced
BACKOFF_MAX = 5.0  # seconds between attempts while etcd does not answer


class Published(Protocol):
    """What the publisher needs of a safekeeper: a view and the positions to wait on."""

    positions: PositionWatch

    def view(self) -> SafekeeperView: ...


class Publisher:
    """Keeps `walsidecar/<cluster>/<timeline>/safekeepers/<id>/` up to date under this safekeeper's lease.

    With `elect_uploader`, each round also campaigns for the timeline's upload lease: `election` is then the
    uploader's UploadElection (see broker.LeaseElection).
    """

    def __init__(self, sk: Published, broker: Broker, *, ttl: int, cluster: str | None = None,
                 advertise: str | None = None, advertise_pg: str | None = None,
                 elect_uploader: bool = False) -> None:
        self.sk, self.broker = sk, broker
        self.cluster_option = cluster
        self.advertise, self.advertise_pg = advertise, advertise_pg
        self.lease = Lease(broker, ttl)
        v = sk.view()
        self.node_id = v.node_id
        self.election = LeaseElection(broker, self.lease, v.node_id)
        self.elect_uploader = elect_uploader
        self.log = get_logger(node=v.node_id)
        self.connected: bool | None = None
        self.error: str | None = None
        self.peers: dict[int, SafekeeperState] = {}
        self._published: float | None = None  # monotonic time of the last publish etcd took
        self._where: tuple[str | None, int] = (cluster, 0)

    def cluster(self, v: SafekeeperView) -> str | None:
        """The cluster's name: --cluster, else the system id once a proposer gave it."""
        return self.cluster_option or (str(v.state.system_id) if v.state.system_id else None)

    def state(self, v: SafekeeperView) -> SafekeeperState:
        """What to publish now."""
        p, history = v.positions, v.state.term_history
        return SafekeeperState(
            v.node_id, flush_lsn=p.flush_lsn, commit_lsn=p.commit_lsn, backup_lsn=v.state.backup_lsn, term=p.term,
            last_log_term=history[-1].term if history else 0, proposer_connected=v.proposer_connected,
            last_updated=time.time(), address=self.advertise or v.listen,
            pg_address=self.advertise_pg or v.reader_listen or "")

    async def run(self) -> None:
        """Publish until cancelled; on a clean stop, revoke the lease so the entry goes at once."""
        failures = 0
        try:
            while True:
                try:
                    await self.publish_once()
                    failures = 0
                except BrokerError as e:
                    failures += 1
                    self._failed(str(e))
                if failures:
                    await asyncio.sleep(min(0.5 * 2 ** (failures - 1), BACKOFF_MAX))
                    continue
                await self._wait_for_change()
        finally:
            await self._withdraw()

    async def _wait_for_change(self) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.sk.positions.changed(), INTERVAL)
        if self._published is not None:
            # Coalescing under load, not synchronisation: at most one publish per MIN_INTERVAL.
            await asyncio.sleep(max(0.0, self._published + MIN_INTERVAL - time.monotonic()))

    async def publish_once(self) -> None:
        """One round: renew the lease, write this safekeeper's keys, read the timeline's, campaign."""
        v = self.sk.view()
        cluster = self.cluster(v)
        if cluster is None:
            return  # nothing to name the keys by before the first proposer's greeting
        timeline = v.state.timeline or 1
        self._where = (cluster, timeline)
        prefix = safekeepers_prefix(cluster, timeline)
        state = self.state(v)
        mine = {f"{prefix}{self.node_id}/{k}": value for k, value in state.to_keys().items()}
        if not await self.broker.put_all(mine, await self.lease.ensure()):
            self.lease.lost()  # expired while etcd was away: a new lease, and the keys again
            self.log.info("broker lease expired; publishing under a new one", cluster=cluster, timeline=timeline)
            await self.broker.put_all(mine, await self.lease.ensure())
        self._published = time.monotonic()
        self.peers = group_states(await self.broker.read_prefix(prefix)).get(cluster, {}).get(timeline, {})
        if self.elect_uploader:
            await self.election.campaign(uploader_key(cluster, timeline), self._eligible(v, state))
        if self.connected is not True:
            self.log.info("publishing to the broker", broker=",".join(self.broker.endpoints), cluster=cluster,
                          timeline=timeline, peers=sorted(self.peers), ttl=self.lease.ttl)
        self.connected, self.error = True, None

    def _eligible(self, v: SafekeeperView, mine: SafekeeperState) -> bool:
        """May lead the uploads: running, and holding what a peer says is committed (within a segment)."""
        if v.stopped:
            return False
        committed = max((p.commit_lsn for p in self.peers.values()), default=0)
        return mine.flush_lsn + (v.state.wal_seg_size or 0) >= committed

    def _failed(self, error: str) -> None:
        self.election.step_down()
        if self.connected is not False:
            self.log.warning("broker unreachable; publishing again with back-off. Commits and reads go on; "
                             "uploader hand-over and WAL removal wait for it", error=error,
                             broker=",".join(self.broker.endpoints),
                             flush_lsn=format_lsn(self.sk.positions.value.flush_lsn))
        self.connected, self.error = False, error

    async def _withdraw(self) -> None:
        lease, self.lease.id = self.lease.id, None
        self.election.step_down()
        if lease is not None and self.connected:
            with contextlib.suppress(BrokerError, asyncio.TimeoutError):
                await asyncio.wait_for(self.broker.revoke(lease), 2.0)
        self.broker.close()

    def view(self) -> BrokerView:
        """What /status and /metrics show of the broker (never calls back into the safekeeper)."""
        cluster, timeline = self._where
        return BrokerView(
            endpoints=self.broker.endpoints, cluster=cluster, timeline=timeline, connected=self.connected,
            error=self.error,
            published_ago=None if self._published is None else round(time.monotonic() - self._published, 3),
            peers=tuple(self.peers[k] for k in sorted(self.peers)),
            uploader=self.election.holder if self.elect_uploader else None, leading=self.election.leading)
