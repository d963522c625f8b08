"""The broker: etcd, where safekeepers publish their per-timeline state and elect one WAL uploader.

Keys (values are text, readable with `etcdctl get --prefix walsidecar/`):

    walsidecar/<cluster>/<timeline>/safekeepers/<id>/<field>   one key per SafekeeperState field
    walsidecar/<cluster>/<timeline>/uploader                   the id of the safekeeper that uploads WAL
    walsidecar/<cluster>/degraded                              the open degraded range (--commit-wait degrade-after)
    walsidecar/<cluster>/failover-term                         the fence term of the last failover that checked it
    walsidecar/<cluster>/degrade-after                         "on" once a sidecar with degrade-after ran under the name

Every safekeeper key hangs on its safekeeper's lease, so a dead safekeeper's keys vanish when the lease
runs out. The last two hang on no lease: a degraded range outlives the sidecar that opened it, until a
quorum holds what it acknowledged (consensus/degraded.py). The broker is never on the commit path: calls run in a thread of their own (a hung etcd never
holds a thread the WAL's fsync needs) and every failure is a BrokerError for the caller to retry.
The client is etcd3gw (etcd's v3 JSON gateway); `--broker` may name several endpoints of one
etcd cluster, tried in turn.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

from sidecar.consensus.messages import NO_DEGRADED, DegradedRange
from sidecar.logs import get_logger
from sidecar.lsn import format_lsn, parse_lsn

ROOT = "walsidecar"
TIMEOUT = 3.0  # seconds per request to one endpoint
CLUSTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
MAX_VALUE = 1024  # bytes: anything longer under our prefix is not ours
STALE_AFTER = 15.0  # seconds without a publish after which `check` calls an entry stale
T = TypeVar("T")


class BrokerError(Exception):
    """etcd did not answer usefully; the message says which endpoint and why."""


def parse_endpoints(urls: Sequence[str]) -> tuple[str, ...]:
    """`http(s)://HOST:PORT` endpoints, normalised; ValueError saying what is wrong."""
    out = []
    for url in urls:
        parts = urlsplit(url.strip())
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/") \
                or parts.query or parts.username:
            raise ValueError(f"{url!r} is not an etcd endpoint: expected http://HOST:PORT or https://HOST:PORT")
        try:
            port = parts.port or 2379
        except ValueError as e:
            raise ValueError(f"{url!r}: {e}") from None
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        out.append(f"{parts.scheme}://{host}:{port}")
    if len(set(out)) != len(out):
        raise ValueError("an etcd endpoint is listed twice")
    return tuple(out)


def check_cluster_name(name: str) -> str:
    if not CLUSTER_NAME.fullmatch(name):
        raise ValueError(f"{name!r}: a cluster name is 1-63 letters, digits, '_', '.' or '-', "
                         "starting with a letter or digit")
    return name


def timeline_prefix(cluster: str, timeline: int) -> str:
    return f"{ROOT}/{cluster}/{timeline}/"


def safekeepers_prefix(cluster: str, timeline: int) -> str:
    return timeline_prefix(cluster, timeline) + "safekeepers/"


def uploader_key(cluster: str, timeline: int) -> str:
    return timeline_prefix(cluster, timeline) + "uploader"


def degraded_key(cluster: str) -> str:
    return f"{ROOT}/{cluster}/degraded"


def failover_term_key(cluster: str) -> str:
    return f"{ROOT}/{cluster}/failover-term"


def degrade_after_key(cluster: str) -> str:
    return f"{ROOT}/{cluster}/degrade-after"


def encode_degraded(record: DegradedRange) -> str:
    """One text per range (the transactions compare it byte for byte), readable with etcdctl."""
    import json
    return json.dumps({"term": record.term, "start_lsn": format_lsn(record.start_lsn), "version": record.version,
                       "members": sorted(record.members)}, sort_keys=True, separators=(",", ":"))


def decode_degraded(text: str) -> DegradedRange:
    """ValueError unless `text` is what encode_degraded writes."""
    import json
    try:
        obj = json.loads(text)
        record = DegradedRange(int(obj["term"]), parse_lsn(obj["start_lsn"]), int(obj["version"]),
                               frozenset(int(n) for n in obj["members"]))
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"not a degraded range: {text[:200]!r} ({e})") from None
    if not record or encode_degraded(record) != text:
        raise ValueError(f"not a degraded range as walsidecar writes it: {text[:200]!r}")
    return record


def _term_text(term: int) -> str:
    return f"{term:020d}"  # etcd compares values as bytes: zero-padded, byte order is number order


def entry_key_beside(uploader: str, node_id: int) -> str:
    """A key of safekeeper `node_id`'s entry in the timeline of the `uploader` key: it hangs on that
    safekeeper's lease, as the uploader key does when that safekeeper holds it."""
    return uploader.removesuffix("uploader") + f"safekeepers/{node_id}/last_updated"


@dataclass(frozen=True)
class UploaderHolder:
    """Who holds a timeline's upload lease key, as etcd has it: its value, its lease, and whether a
    safekeeper entry of the id it names hangs on that same lease (False: no safekeeper wrote the key)."""

    value: str
    lease: int
    published: bool

    @property
    def node_id(self) -> int | None:
        return int(self.value) if self.value.isdigit() else None

    def describe(self) -> str:
        return f"{self.value[:64]!r} (lease {self.lease:x})" if self.lease else f"{self.value[:64]!r} (no lease)"


async def uploader_holder(broker: Broker, key: str) -> UploaderHolder | None:
    """The holder of upload lease key `key`, None when nobody holds it."""
    held = await broker.holder(key)
    if held is None:
        return None
    value, lease = held
    published = False
    if lease and value.isdigit():
        entry = await broker.holder(entry_key_beside(key, int(value)))
        published = entry is not None and entry[1] == lease
    return UploaderHolder(value, lease, published)


@dataclass(frozen=True)
class SafekeeperState:
    """What one safekeeper publishes about one timeline, about once a second."""

    id: int
    flush_lsn: int = 0
    commit_lsn: int = 0
    backup_lsn: int = 0  # end of what the archive holds (0: no archive, or nothing uploaded yet)
    term: int = 0
    last_log_term: int = 0
    proposer_connected: bool = False
    last_updated: float = 0.0  # Unix time of the publish
    address: str = ""  # HOST:PORT of its proposer port (--advertise)
    pg_address: str = ""  # HOST:PORT of its reader port (--advertise-pg), "" without one

    _LSNS = ("flush_lsn", "commit_lsn", "backup_lsn")

    def to_keys(self) -> dict[str, str]:
        """Field name -> text value, one key each (the id is in the path)."""
        out = {}
        for f in fields(self):
            if f.name == "id":
                continue
            v = getattr(self, f.name)
            out[f.name] = format_lsn(v) if f.name in self._LSNS else ("true" if v else "false") if \
                isinstance(v, bool) else f"{v:.3f}" if isinstance(v, float) else str(v)
        return out

    @classmethod
    def from_keys(cls, node_id: int, values: Mapping[str, str]) -> SafekeeperState:
        """Parse what `to_keys` wrote; fields missing or malformed (another version, a hand edit) keep defaults."""
        kw: dict[str, Any] = {}
        for f in fields(cls):
            text = values.get(f.name)
            if f.name == "id" or text is None:
                continue
            try:
                if f.name in cls._LSNS:
                    kw[f.name] = parse_lsn(text)
                elif f.type == "bool":
                    kw[f.name] = text == "true"
                elif f.type == "int":
                    kw[f.name] = int(text)
                elif f.type == "float":
                    kw[f.name] = float(text)
                else:
                    kw[f.name] = text
            except ValueError:
                continue
        return cls(node_id, **kw)

    def age(self, now: float | None = None) -> float:
        """Seconds since the publish (by this host's clock)."""
        return (time.time() if now is None else now) - self.last_updated


def group_states(kvs: Mapping[str, str]) -> dict[str, dict[int, dict[int, SafekeeperState]]]:
    """`walsidecar/...` keys -> {cluster: {timeline: {id: state}}}; keys of another shape are ignored."""
    raw: dict[tuple[str, int, int], dict[str, str]] = {}
    for key, value in kvs.items():
        parts = key.split("/")
        if len(parts) != 6 or parts[0] != ROOT or parts[3] != "safekeepers" or not parts[2].isdigit() \
                or not parts[4].isdigit():
            continue
        raw.setdefault((parts[1], int(parts[2]), int(parts[4])), {})[parts[5]] = value
    out: dict[str, dict[int, dict[int, SafekeeperState]]] = {}
    for (cluster, timeline, node), values in sorted(raw.items()):
        out.setdefault(cluster, {}).setdefault(timeline, {})[node] = SafekeeperState.from_keys(node, values)
    return out


@dataclass(frozen=True)
class TimelineEntries:
    """What the broker holds for one timeline of one cluster."""

    safekeepers: dict[int, SafekeeperState]
    uploader: int | None  # the id holding the upload lease


async def read_clusters(broker: Broker, cluster: str | None = None) -> dict[str, dict[int, TimelineEntries]]:
    """Every cluster's (or `cluster`'s) timelines as published: {cluster: {timeline: entries}}."""
    kvs = await broker.read_prefix(f"{ROOT}/{cluster}/" if cluster else f"{ROOT}/")
    out: dict[str, dict[int, TimelineEntries]] = {}
    for name, timelines in group_states(kvs).items():
        for tl, states in timelines.items():
            up = kvs.get(uploader_key(name, tl), "")
            out.setdefault(name, {})[tl] = TimelineEntries(states, int(up) if up.isdigit() else None)
    return out


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _unb64(text: str) -> str:
    return base64.b64decode(text).decode(errors="replace")


class Broker:
    """A client of one etcd cluster (any of `endpoints`), with TLS client certificates from `certs_dir`.

    Every method is a coroutine running one blocking etcd3gw call in the broker's own thread.
    """

    def __init__(self, endpoints: Sequence[str], certs_dir: Path | None = None, timeout: float = TIMEOUT,
                 tls_files: TlsFiles | None = None) -> None:
        import etcd3gw  # here: a safekeeper without --broker never loads it

        self.endpoints = parse_endpoints(endpoints)
        self._clients = []
        for url in self.endpoints:
            parts = urlsplit(url)
            assert parts.hostname is not None
            self._clients.append(etcd3gw.Etcd3Client(
                host=parts.hostname, port=parts.port or 2379, protocol=parts.scheme, timeout=timeout,
                api_path="/v3/", session=_session(certs_dir if parts.scheme == "https" else None,
                                                  tls_files if parts.scheme == "https" else None)))
        self._current = 0
        self._errors: tuple[type[BaseException], ...] = (etcd3gw.exceptions.Etcd3Exception, OSError, ValueError,
                                                         KeyError, TypeError)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="broker")

    def __repr__(self) -> str:
        return f"Broker({','.join(self.endpoints)})"

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for c in self._clients:
            c.session.close()

    async def _call(self, what: str, fn: Callable[[Any], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._try_each, what, fn)

    def _try_each(self, what: str, fn: Callable[[Any], T]) -> T:
        """Call `fn(client)` on the endpoint that answered last, then on the others in turn."""
        errors = []
        for i in range(len(self._clients)):
            n = (self._current + i) % len(self._clients)
            try:
                result = fn(self._clients[n])
            except self._errors as e:
                import etcd3gw
                if isinstance(e, etcd3gw.exceptions.Etcd3Exception) and \
                        not isinstance(e, (etcd3gw.exceptions.ConnectionFailedError,
                                           etcd3gw.exceptions.ConnectionTimeoutError)):
                    raise BrokerError(f"{what}: {self.endpoints[n]} refused: {_etcd_message(e)}") from None
                errors.append(f"{self.endpoints[n]}: {_reason(e)}")
                continue
            self._current = n
            return result
        raise BrokerError(f"{what}: no etcd endpoint answered ({'; '.join(errors)})")

    async def health(self) -> None:
        """Raise BrokerError unless an endpoint answers a read."""
        await self._call("read", lambda c: c.get(ROOT + "/", count_only=True))

    async def grant(self, ttl: int) -> int:
        """A new lease of `ttl` seconds; its id."""
        return await self._call("grant a lease", lambda c: c.lease(ttl).id)

    async def keepalive(self, lease: int) -> bool:
        """Renew `lease`; False once it has expired (its keys are gone)."""
        import etcd3gw.lease
        return await self._call("renew the lease", lambda c: etcd3gw.lease.Lease(lease, c).refresh() > 0)

    async def lease_ttl(self, lease: int) -> tuple[int, int]:
        """(seconds left, seconds granted) of `lease`; seconds left is -1 once it has expired."""
        def ask(c: Any) -> tuple[int, int]:
            r = c.post(c.get_url("/kv/lease/timetolive"), json={"ID": lease})
            return int(r.get("TTL", -1)), int(r.get("grantedTTL", 0))
        return await self._call("read a lease", ask)

    async def revoke(self, lease: int) -> None:
        """End `lease` now: its keys go at once."""
        import etcd3gw.lease
        await self._call("revoke the lease", lambda c: etcd3gw.lease.Lease(lease, c).revoke())

    async def put_all(self, values: Mapping[str, str], lease: int) -> bool:
        """Write every key in one transaction under `lease`; False when the lease has expired."""
        txn = {"compare": [], "failure": [],
               "success": [{"request_put": {"key": _b64(k), "value": _b64(v), "lease": lease}}
                           for k, v in values.items()]}
        try:
            await self._call("publish", lambda c: c.transaction(txn))
        except BrokerError as e:
            if "lease not found" in str(e):
                return False
            raise
        return True

    async def read_prefix(self, prefix: str) -> dict[str, str]:
        """Every key under `prefix` and its value (values longer than MAX_VALUE are dropped)."""
        def read(c: Any) -> dict[str, str]:
            return {meta["key"].decode(errors="replace"): value.decode(errors="replace")
                    for value, meta in c.get_prefix(prefix) if len(value) <= MAX_VALUE}
        return await self._call("read", read)

    async def holder(self, key: str) -> tuple[str, int] | None:
        """(value, lease) of `key`, None when absent."""
        got = await self._call("read", lambda c: c.get(key, metadata=True))
        if not got:
            return None
        value, meta = got[0]
        return value.decode(errors="replace"), int(meta.get("lease", 0))

    async def create(self, key: str, value: str, lease: int) -> bool:
        """Write `key` under `lease` if it does not exist; True if this call made it."""
        txn = {"compare": [{"key": _b64(key), "result": "EQUAL", "target": "CREATE", "create_revision": 0}],
               "success": [{"request_put": {"key": _b64(key), "value": _b64(value), "lease": lease}}],
               "failure": []}
        return bool((await self._call("campaign", lambda c: c.transaction(txn))).get("succeeded", False))

    async def read_degraded(self, cluster: str) -> DegradedRange:
        """The open degraded range of `cluster` (NO_DEGRADED: none); BrokerError when it cannot be read."""
        got = await self._call("read the degraded range", lambda c: c.get(degraded_key(cluster)))
        if not got:
            return NO_DEGRADED
        text = got[0].decode(errors="replace")
        try:
            return decode_degraded(text)
        except ValueError as e:
            raise BrokerError(f"{degraded_key(cluster)}: {e}") from None

    async def mark_degrade_after(self, cluster: str) -> None:
        """Say, for good, that a sidecar with degrade-after runs under `cluster`: a failover given another name sees
        safekeepers such a sidecar wrote and no mark under its name, and refuses instead of reading the wrong key."""
        await self._call("mark degrade-after", lambda c: c.put(degrade_after_key(cluster), "on"))

    async def degrade_after_marked(self, cluster: str) -> bool:
        return bool(await self._call("read the degrade-after mark", lambda c: c.get(degrade_after_key(cluster))))

    async def store_degraded(self, cluster: str, record: DegradedRange, previous: DegradedRange) -> bool:
        """Write `record` in place of `previous`, in one transaction; False when the key holds something else.

        A new range (`previous` is none) needs the key absent and no failover of its term or a later one since:
        the sidecar of a primary a failover replaced must not open a range on safekeepers the fence missed.
        """
        key, value = _b64(degraded_key(cluster)), _b64(encode_degraded(record))
        put = [{"request_put": {"key": key, "value": value}}]  # no lease: it outlives this sidecar
        if previous:
            compares = [[{"key": key, "result": "EQUAL", "target": "VALUE",
                          "value": _b64(encode_degraded(previous))}]]
        else:
            absent = {"key": key, "result": "EQUAL", "target": "CREATE", "create_revision": 0}
            floor = _b64(failover_term_key(cluster))
            compares = [[absent, {"key": floor, "result": "EQUAL", "target": "CREATE", "create_revision": 0}],
                        [absent, {"key": floor, "result": "LESS", "target": "VALUE",
                                  "value": _b64(_term_text(record.term))}]]
        for compare in compares:
            txn = {"compare": compare, "success": put, "failure": []}
            if (await self._call("record the degraded range", lambda c: c.transaction(txn))).get("succeeded"):
                return True
        return False

    async def close_degraded(self, cluster: str, record: DegradedRange) -> bool:
        """Delete the range if the key still holds `record`; False when it holds something else (or nothing)."""
        key = _b64(degraded_key(cluster))
        txn = {"compare": [{"key": key, "result": "EQUAL", "target": "VALUE", "value": _b64(encode_degraded(record))}],
               "success": [{"request_delete_range": {"key": key}}], "failure": []}
        return bool((await self._call("close the degraded range", lambda c: c.transaction(txn))).get("succeeded"))

    async def failover_final(self, cluster: str, gate: DegradedRange, fence_term: int) -> bool:
        """A failover's last step before promoting: the key still holds the range it gated on (or none), which it
        deletes, and the failover term rises to `fence_term`; False (nothing changed) when the key changed."""
        key = _b64(degraded_key(cluster))
        if gate:
            compare = {"key": key, "result": "EQUAL", "target": "VALUE", "value": _b64(encode_degraded(gate))}
        else:
            compare = {"key": key, "result": "EQUAL", "target": "CREATE", "create_revision": 0}
        success = [{"request_put": {"key": _b64(failover_term_key(cluster)), "value": _b64(_term_text(fence_term))}}]
        if gate:
            success.append({"request_delete_range": {"key": key}})
        txn = {"compare": [compare], "success": success, "failure": []}
        return bool((await self._call("check the degraded range", lambda c: c.transaction(txn))).get("succeeded"))

    async def delete_if(self, key: str, lease: int) -> None:
        """Delete `key` if it still hangs on `lease` (a holder resigning never deletes its successor's)."""
        txn = {"compare": [{"key": _b64(key), "result": "EQUAL", "target": "LEASE", "lease": lease}],
               "success": [{"request_delete_range": {"key": _b64(key)}}], "failure": []}
        await self._call("resign", lambda c: c.transaction(txn))


@dataclass(frozen=True)
class TlsFiles:
    """An etcd's TLS as another program's configuration names it (Patroni's etcd3 cacert, cert, key)."""

    ca: str | None
    cert: str | None = None
    key: str | None = None


def _session(certs_dir: Path | None, files: TlsFiles | None = None) -> Any:
    """An HTTP session trusting only the deployment's CA and presenting its certificate, given `certs_dir`,
    or the files given."""
    import requests

    from sidecar.tls import node_files
    session = requests.Session()
    # Not REQUESTS_CA_BUNDLE, proxies or .netrc from the environment: etcd is reached as configured.
    session.trust_env = False
    if certs_dir is not None:
        ca, cert, key = node_files(certs_dir)  # TlsError saying how to make what is missing
        session.verify = str(ca)
        session.cert = (str(cert), str(key))
    elif files is not None:
        session.verify = files.ca or True
        if files.cert:
            session.cert = (files.cert, files.key) if files.key else files.cert
    return session


def _etcd_message(e: Any) -> str:
    import json
    try:
        return str(json.loads(e.detail_text)["message"])
    except (TypeError, ValueError, KeyError):
        return str(e.detail_text or e)


def _reason(e: BaseException) -> str:
    text = str(getattr(e, "detail_text", None) or e)
    if "Connection refused" in text:
        return "connection refused"
    if "timed out" in text.lower() or "timeout" in type(e).__name__.lower():
        return "no answer in time"
    if "CERTIFICATE_VERIFY_FAILED" in text or "certificate" in text.lower():
        return "TLS: " + text[text.lower().find("certificate"):][:200]
    return text[:300]


class Lease:
    """This process's lease: granted on first use and again after it expired; renewed well before half its TTL."""

    def __init__(self, broker: Broker, ttl: int) -> None:
        self.broker, self.ttl = broker, ttl
        self.id: int | None = None
        self._renewed = 0.0

    async def ensure(self) -> int:
        """The live lease's id, renewed if due; a new lease if it expired (its keys are gone then)."""
        now = time.monotonic()
        # Renewed early enough that a caller coming back every second finds it `fresh` between renewals.
        if self.id is not None and now - self._renewed >= self.ttl / 3 - 1.0:
            if not await self.broker.keepalive(self.id):
                self.id = None
            else:
                self._renewed = now
        if self.id is None:
            self.id = await self.broker.grant(self.ttl)
            self._renewed = now
        return self.id

    def lost(self) -> None:
        """The broker said the lease is gone: the next `ensure` grants another."""
        self.id = None

    @property
    def fresh(self) -> bool:
        """True while the lease is surely alive: renewed less than half its TTL ago."""
        return self.id is not None and time.monotonic() - self._renewed < self.ttl / 2


class LeaseElection:
    """The upload election (safekeeper.backup.UploadElection) through etcd. One uploader per timeline: the
    safekeeper whose lease holds `walsidecar/<cluster>/<tl>/uploader`.

    `campaign()` runs about once a second (the publisher calls it): it takes the key when free and
    this safekeeper may lead, or resigns. `may_upload` answers from the last round, without I/O, and
    says no as soon as the lease may have run out, so two uploaders overlap for at most a moment
    (and write identical bytes then).
    """

    def __init__(self, broker: Broker, lease: Lease, node_id: int) -> None:
        self.broker, self.lease, self.node_id = broker, lease, node_id
        self.key: str | None = None
        self.holder: int | None = None  # the leader's id as last read, None: none or unknown
        self._held_lease: int | None = None  # our lease id while we hold the key

    def may_upload(self, segment_start_lsn: int) -> bool:
        """True while this safekeeper holds the upload lease (the segment's bytes are the uploader's to check)."""
        return self._held_lease is not None and self._held_lease == self.lease.id and self.lease.fresh

    def seen_archived(self, segment_start_lsn: int) -> None:
        """Nothing to learn: the lease, not the archive, says who uploads."""

    @property
    def leading(self) -> bool:
        return self.may_upload(0)

    async def campaign(self, key: str, eligible: bool) -> None:
        """One round for `key`: take it if free and `eligible`; resign if held and not `eligible`."""
        if self.key is not None and key != self.key:  # a new timeline or cluster name
            await self.resign()
        self.key = key
        lease = await self.lease.ensure()
        held = await self.broker.holder(key)
        if held is not None and held[1] != lease and (h := await uploader_holder(self.broker, key)) is not None \
                and not h.published:
            # A safekeeper writes the key with its id, under the lease its own entry hangs on. Anything
            # else came from whoever has write access to etcd: a key without a lease would stop uploads
            # for ever, and one on a lease the writer keeps renewing as long as it likes.
            get_logger(node=self.node_id).warning("an upload lease key no safekeeper wrote; deleting it",
                                                  key=key, value=held[0][:64], lease=held[1])
            await self.broker.delete_if(key, held[1])
            held = await self.broker.holder(key)
        if held is not None and held[1] == lease:
            if eligible:
                self._held_lease, self.holder = lease, self.node_id
                return
            await self.resign()
            return
        self._held_lease = None
        if held is None and eligible and await self.broker.create(key, str(self.node_id), lease):
            self._held_lease, self.holder = lease, self.node_id
            return
        self.holder = int(held[0]) if held is not None and held[0].isdigit() else None

    async def resign(self) -> None:
        """Give the key up if we hold it (a peer takes it at its next round)."""
        lease, self._held_lease = self._held_lease, None
        if lease is not None and self.key is not None:
            await self.broker.delete_if(self.key, lease)
        self.holder = None

    def step_down(self) -> None:
        """The broker is unreachable: stop uploading at once (the key is someone else's once the lease ends)."""
        self._held_lease = None
