"""`walsidecar check`: is this primary, with these safekeepers, quorum-safe? One line per check."""

from __future__ import annotations

import asyncio
import json
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from collections.abc import Collection
from typing import Literal

import psycopg

from sidecar.broker import STALE_AFTER, Broker, BrokerError, UploaderHolder, read_clusters, uploader_holder, uploader_key
from sidecar.config import CheckSettings
from sidecar.consensus import lineage
from sidecar.consensus.degraded import describe
from sidecar.consensus.messages import DegradedRange, InfoReply
from sidecar.consensus.quorum import peers_needed_after_a_lost_disk
from sidecar.lsn import format_lsn, parse_lsn
from sidecar.ops.probe import connect, fetch_status, redact_dsn
from sidecar.skclient import ProbeError, probe_safekeeper
from sidecar.proposer import pgerrors, syncrep
from sidecar.proposer.primary import catchup_slot, quote_ident, read_syncrep_state
from sidecar.linkauth import client_security
from sidecar.tls import TlsError, client_context

Status = Literal["OK", "WARNING", "FAILED"]
PLACEHOLDERS = {"N", "DIR", "CERTS_DIR"}  # in hints: what the user fills in
# Whole segments a safekeeper's backup_lsn may trail its commit_lsn by: one or two while a segment
# uploads; more means the archive stalls, and with it WAL removal.
ARCHIVE_LAG_WARNING, ARCHIVE_LAG_FAILED = 4, 64
# In segments: WAL starts in segment 1, the first term somewhere in it or later (backup.first_archived_lsn).
FIRST_ARCHIVABLE_END = 3


@dataclass
class Check:
    name: str
    status: Status
    detail: str = ""
    hint: str = ""

    def line(self) -> str:
        text = f"{self.name}: {self.status}"
        if self.detail:
            text += f" ({self.detail})"
        if self.hint and self.status != "OK":
            text += f" hint: {self.hint}"
        return text


def _ok(name: str, detail: str = "") -> Check:
    return Check(name, "OK", detail)


def _warn(name: str, detail: str, hint: str) -> Check:
    return Check(name, "WARNING", detail, hint)


def _fail(name: str, detail: str, hint: str) -> Check:
    return Check(name, "FAILED", detail, hint)


def _restart_hint(setting: str, value: str) -> str:
    return f"ALTER SYSTEM SET {setting} = {value}; then restart PostgreSQL (pg_ctl restart -D PGDATA, or " \
           "systemctl restart postgresql)"


def _reload_hint(setting: str, value: str) -> str:
    return f"ALTER SYSTEM SET {setting} = {value}; SELECT pg_reload_conf();"


class SetupChecker:
    """Runs the checks against one primary and its safekeepers."""

    def __init__(self, s: CheckSettings) -> None:
        self.s = s
        self.checks: list[Check] = []
        self.system_id: int | None = None
        self.seg_size: int | None = None
        self.pg_major: int | None = None
        self.ssl = client_context(s.certs_dir) if s.certs_dir is not None else None  # HTTPS endpoints
        self.link = self.ssl if s.link_security == "tls" else client_security(s.certs_dir, s.link_security)
        self.standby_names: syncrep.SyncStandbyConfig | None = None
        self.ids: dict[str, int] = {}  # safekeeper address -> the id it answered with
        self.lineage: tuple[int, int] | None = None  # the primary's (timeline, flush LSN)
        self._proposer_doc: dict | None = None  # the proposer's /status, with --proposer-metrics
        self._degraded_copies: dict[str, DegradedRange] = {}  # safekeeper address -> its copy of a degraded range
        self._degrade_seen = False  # a safekeeper was written by a sidecar with --commit-wait degrade-after

    def command(self, name: str, *options: str, certs: str = "CERTS_DIR") -> str:
        """`walsidecar NAME OPTIONS` with this check's TLS choice, ready to paste; CAPITALS are for the user to fill."""
        tls = ["--insecure"] if self.s.insecure else ["--certs-dir", certs] + \
            (["--link-security", self.s.link_security] if self.s.link_security != "tls" else [])
        return " ".join(["walsidecar", name, *(o if o in PLACEHOLDERS else shlex.quote(o) for o in options), *tls])

    def _start_command(self) -> str:
        s = self.s
        extra = [*(["--quorum", str(s.quorum)] if s.quorum else []),
                 *(["--application-name", s.application_name] if s.application_name != "walsidecar" else []),
                 *(["--slot", s.slot] if s.slot != "walsidecar" else [])]
        return self.command("start", "--pg-dsn", redact_dsn(s.pg_dsn), "--safekeepers", ",".join(s.safekeepers),
                            *extra)

    def _status_command(self) -> str:
        where = ["--proposer-metrics", self.s.proposer_metrics] if self.s.proposer_metrics else []
        certs = str(self.s.certs_dir) if self.s.certs_dir else "CERTS_DIR"
        return self.command("status", *where, "--safekeepers", ",".join(self.s.safekeepers),
                            "--pg-dsn", redact_dsn(self.s.pg_dsn), certs=certs)

    def add(self, c: Check) -> None:
        self.checks.append(c)

    async def run(self) -> list[Check]:
        conn = await self._connect()
        try:
            if conn is not None:
                await self._primary(conn)
        finally:
            if conn is not None:
                await conn.close()
        self._transport()
        await self._safekeepers()
        if conn is not None:
            await self._streaming()
        if self.s.proposer_metrics:
            await self._proposer()
        if self.s.broker:
            await self._broker()
        await self._degraded()
        return self.checks

    async def _degraded(self) -> None:
        """FAILED while a degraded range is open (--commit-wait degrade-after): in etcd (with --broker, the record),
        else as the proposer or a safekeeper's copy says. Nothing for a cluster that never ran degrade-after."""
        s = self.s
        prop = (self._proposer_doc or {}).get("degraded")
        in_use = self._degrade_seen or prop is not None or \
            str((self._proposer_doc or {}).get("commit_wait", "")).startswith("degrade")
        if not in_use:
            return
        record = None
        cluster = s.cluster or (str(self.system_id) if self.system_id else None)
        if s.broker and cluster:
            try:
                broker = Broker(s.broker, s.certs_dir, timeout=s.timeout)
                try:
                    record = await broker.read_degraded(cluster)
                finally:
                    broker.close()
            except (BrokerError, TlsError) as e:
                self.add(_fail("degraded range", f"cannot read it from etcd: {e}", "start etcd, or fix --broker"))
                return
        copies = {addr: r for addr, r in self._degraded_copies.items() if r}
        if record:
            where = f"etcd (walsidecar/{cluster}/degraded)"
            detail = describe(record)
        elif record is None and prop:
            where = f"the proposer at {s.proposer_metrics}"
            detail = (f"degraded range of term {prop['term']} from {prop['start_lsn']} (version {prop['version']}, "
                      f"members: safekeepers {', '.join(map(str, prop['members'])) or 'none'})")
        elif record is None and copies:
            addr, r = sorted(copies.items())[0]
            where = f"safekeeper {addr}" + (f" and {len(copies) - 1} other(s)" if len(copies) > 1 else "")
            detail = describe(r)
        else:
            self.add(_ok("degraded range", "none open: every acknowledged commit is on a quorum"))
            return
        self.add(_fail("degraded range", f"{where} holds an open {detail}: commits were acknowledged by fewer than a "
                                         "quorum of safekeepers; failover and failover-gate refuse every standby "
                                         "unless one of its members votes",
                       "bring the safekeepers back: the range closes once a quorum holds every commit"))

    async def _connect(self) -> psycopg.AsyncConnection | None:
        try:
            conn = await connect(self.s.pg_dsn, self.s.timeout, "check")
        except (psycopg.Error, OSError, asyncio.TimeoutError) as e:
            self.add(_fail("PostgreSQL", str(e).strip().splitlines()[0] if str(e).strip() else "timed out",
                           pgerrors.permanent(e) or "is PostgreSQL running at the host and port of --pg-dsn, and "
                                                    "does it listen there (listen_addresses)?"))
            return None
        return conn

    async def _primary(self, conn: psycopg.AsyncConnection) -> None:
        row = await (await conn.execute(
            """SELECT current_setting('server_version'), current_setting('server_version_num')::int,
                      (SELECT system_identifier FROM pg_control_system()), pg_is_in_recovery(),
                      current_user, (SELECT rolreplication OR rolsuper FROM pg_roles WHERE rolname = current_user),
                      (SELECT setting::int FROM pg_settings WHERE name = 'wal_segment_size')""")).fetchone()
        assert row is not None
        version, version_num, system_id, in_recovery, user, can_replicate, seg_size = row
        self.system_id, self.seg_size, self.pg_major = int(system_id), int(seg_size), int(version_num) // 10000
        self.add(_ok("PostgreSQL", f"{version}, system id {system_id}, as {user}"))
        if version_num < 150000:
            self.add(_fail("PostgreSQL version", f"{version} is too old", "walsidecar needs PostgreSQL 15 or later"))
        if in_recovery:
            self.add(_fail("is primary", "the server is a standby (pg_is_in_recovery() is true)",
                           "point --pg-dsn at the primary"))
        else:
            self.add(_ok("is primary"))
        if can_replicate:
            self.add(_ok("replication role", f"{user} may open replication connections"))
        else:
            self.add(_fail("replication role", f"{user} has neither REPLICATION nor SUPERUSER",
                           f"ALTER ROLE {quote_ident(user)} REPLICATION;"))

        settings = dict(await (await conn.execute(
            """SELECT name, setting FROM pg_settings WHERE name IN ('wal_level', 'max_wal_senders',
                 'max_replication_slots', 'synchronous_standby_names', 'synchronous_commit',
                 'max_slot_wal_keep_size')""")).fetchall())
        if not in_recovery:
            tli, flush = (await (await conn.execute(
                "SELECT pg_walfile_name(pg_current_wal_flush_lsn()), pg_current_wal_flush_lsn()::text")).fetchone())
            self.lineage = (int(tli[:8], 16), parse_lsn(flush))
        self._wal_level(settings["wal_level"])
        await self._senders_and_slots(conn, int(settings["max_wal_senders"]), int(settings["max_replication_slots"]))
        self._standby_names(settings["synchronous_standby_names"])
        await self._synchronous_commit(conn, settings["synchronous_commit"])
        self._keep_size(int(settings["max_slot_wal_keep_size"]))
        await self._slots(conn)

    def _wal_level(self, level: str) -> None:
        if level == "minimal":
            self.add(_fail("wal_level", "minimal cannot stream WAL", _restart_hint("wal_level", "replica")))
        else:
            self.add(_ok("wal_level", level))

    async def _senders_and_slots(self, conn: psycopg.AsyncConnection, senders: int, slots: int) -> None:
        n = len(self.s.safekeepers)
        # One stream, plus a reader per safekeeper catching up from pg_wal and one for checks.
        wanted = n + 2
        if senders == 0:
            self.add(_fail("max_wal_senders", "0: no replication connection is allowed",
                           _restart_hint("max_wal_senders", "10")))
        elif senders < wanted:
            self.add(_warn("max_wal_senders", f"{senders}: the sidecar may use up to {wanted} at once",
                           _restart_hint("max_wal_senders", str(max(10, wanted)))))
        else:
            self.add(_ok("max_wal_senders", str(senders)))
        ours = (self.s.slot, catchup_slot(self.s.slot))
        row = await (await conn.execute(
            "SELECT count(*), count(*) FILTER (WHERE slot_name IN (%s, %s)) FROM pg_replication_slots",
            ours)).fetchone()
        assert row is not None
        used, mine = row
        missing = 2 - mine
        if slots == 0:
            self.add(_fail("max_replication_slots", "0: the sidecar cannot create its slots",
                           _restart_hint("max_replication_slots", "10")))
        elif slots - used < missing:
            self.add(_fail("max_replication_slots",
                           f"{slots}, of which {used} are in use: no room for the sidecar's {missing} missing slot(s)",
                           _restart_hint("max_replication_slots", str(used + missing + 2))))
        else:
            self.add(_ok("max_replication_slots", f"{slots}, {used} in use"))

    def _standby_names(self, value: str) -> None:
        app = self.s.application_name
        name = "synchronous_standby_names"
        hint = syncrep.set_standby_names_hint(app)
        shown = repr(value) if value else "'' (empty)"
        try:
            config = syncrep.parse_synchronous_standby_names(value)
        except syncrep.SyncStandbyNamesError as e:
            self.add(_fail(name, f"{shown} does not parse ({e})", hint))
            return
        self.standby_names = config
        others = syncrep.waited_for_instead(config, app)
        if others:
            self.add(_fail(name, f"{shown} does not name {app!r}: commits wait for {others}, not for the "
                                 "safekeeper quorum", hint))
            return
        if not syncrep.standby_name_matches(config, app):
            self.add(_fail(name, f"{shown} does not name {app!r}: commits do not wait for the safekeeper quorum",
                           hint))
            return
        assert config is not None
        if config.num_sync > len(config.names) and "*" not in config.names:
            self.add(_fail(name, f"{shown} asks for {config.num_sync} standbys but lists {len(config.names)}: "
                                 "commits wait forever", hint))
        elif not syncrep.sidecar_is_required(config, app):
            self.add(_warn(name, f"{shown} lets other standbys release a commit without {app!r}", hint))
        else:
            self.add(_ok(name, value))

    async def _synchronous_commit(self, conn: psycopg.AsyncConnection, value: str) -> None:
        name = "synchronous_commit"
        if value in ("off", "local"):
            self.add(_fail(name, f"{value}: commits return before the safekeeper quorum has their WAL",
                           _reload_hint("synchronous_commit", "on")))
            return
        rows = await (await conn.execute(
            r"""SELECT coalesce(r.rolname, ''), coalesce(d.datname, ''), c
                  FROM pg_db_role_setting s
                  LEFT JOIN pg_roles r ON r.oid = s.setrole
                  LEFT JOIN pg_database d ON d.oid = s.setdatabase, unnest(s.setconfig) AS c
                 WHERE lower(c) LIKE 'synchronous\_commit=%'""")).fetchall()
        weak, fixes = [], []
        for role, db, setting in rows:
            v = setting.split("=", 1)[1].strip().lower()
            if v in ("off", "local"):
                target = " ".join(filter(None, [f"role {role}" if role else "", f"database {db}" if db else ""]))
                weak.append(f"{target} sets {v}")
                where = f"ROLE {quote_ident(role)}" + (f" IN DATABASE {quote_ident(db)}" if db else "") if role \
                    else f"DATABASE {quote_ident(db)}"
                fixes.append(f"ALTER {where} RESET synchronous_commit;")
        if weak:
            self.add(_warn(name, f"{value}, but " + "; ".join(weak) + ": those sessions do not wait for the quorum",
                           " ".join(fixes)))
        else:
            self.add(_ok(name, value))

    def _keep_size(self, mb: int) -> None:
        name = "max_slot_wal_keep_size"
        if mb < 0:
            self.add(_warn(name, "-1 (unlimited): a safekeeper that stays down makes the primary keep WAL "
                                 "until its disk is full",
                           _reload_hint("max_slot_wal_keep_size", "'10GB'")))
        else:
            self.add(_ok(name, f"{mb} MB"))

    async def _slots(self, conn: psycopg.AsyncConnection) -> None:
        rows = {r[0]: r[1:] for r in await (await conn.execute(
            """SELECT slot_name, slot_type, active, restart_lsn::text, wal_status, safe_wal_size,
                      pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::bigint, pg_current_wal_lsn()::text
                 FROM pg_replication_slots WHERE slot_name IN (%s, %s)""",
            (self.s.slot, catchup_slot(self.s.slot)))).fetchall()}
        for slot, critical in ((self.s.slot, True), (catchup_slot(self.s.slot), False)):
            name = f"replication slot {slot}"
            bad = _fail if critical else _warn
            row = rows.get(slot)
            if row is None:
                self.add(bad(name, "does not exist", f"`walsidecar start` creates it when it attaches: "
                                                     f"{self._start_command()}"))
                continue
            slot_type, active, restart, wal_status, safe, kept, current = row
            drop = f"SELECT pg_drop_replication_slot('{slot}'); then restart `walsidecar start`, which recreates it " \
                   f"({self._start_command()})"
            if slot_type != "physical":
                self.add(_fail(name, f"is a {slot_type} slot", drop))
            elif restart is None:
                self.add(bad(name, "has no restart_lsn (not initialised)", drop))
            elif wal_status == "lost":
                self.add(bad(name, "wal_status lost: WAL it needed was removed (max_slot_wal_keep_size)", drop))
            elif wal_status == "unreserved":
                self.add(bad(name, f"wal_status unreserved: WAL it needs goes at the next checkpoint "
                                   f"({kept} bytes retained)",
                             "bring the safekeepers back and let them catch up now, or keep more WAL: "
                             + _reload_hint("max_slot_wal_keep_size", "'20GB'")))
            else:
                safe_txt = f", safe_wal_size {safe} bytes" if safe is not None else ""
                detail = f"wal_status {wal_status}, {'active' if active else 'inactive'}, restart_lsn {restart}, " \
                         f"{kept} bytes retained{safe_txt}"
                if not critical:  # the horizon slot: what the primary still keeps for the safekeepers
                    detail = f"the primary keeps {kept} bytes of WAL for the safekeepers (restart_lsn {restart}, " \
                             f"current WAL {current}; --primary-retention bounds it); wal_status {wal_status}{safe_txt}"
                if wal_status == "extended":
                    self.add(_warn(name, detail, "the slot keeps more than max_wal_size: a safekeeper is lagging; "
                                                 f"see {self._status_command()}"))
                else:
                    self.add(_ok(name, detail))

    def _transport(self) -> None:
        if self.s.insecure:
            self.add(_warn("TLS", "--insecure: the safekeepers are asked without TLS; if they answer, anyone who "
                                  "can reach their ports can change their state",
                           "make certificates (walsidecar certs create-ca --ca-dir CA_DIR; then for each process "
                           "walsidecar certs create-node --ca-dir CA_DIR --certs-dir CERTS_DIR --role ROLE [--id N]) "
                           "and run every process with --certs-dir CERTS_DIR instead of --insecure"))
        elif self.s.link_security == "auth-only":
            self.add(_warn("TLS", f"--link-security auth-only: client certificate from {self.s.certs_dir} proves "
                                  "both ends, but WAL and messages travel unencrypted and unprotected on the path",
                           "use it only on a private, trusted network"))
        else:
            self.add(_ok("TLS", f"client certificate from {self.s.certs_dir}"))

    async def _safekeepers(self) -> None:
        async def one(addr: str) -> InfoReply | ProbeError:
            try:
                return await probe_safekeeper(addr, self.s.timeout, self.link)
            except ProbeError as e:
                return e

        replies = await asyncio.gather(*(one(a) for a in self.s.safekeepers))
        self._degraded_copies = {a: r.degraded for a, r in zip(self.s.safekeepers, replies) if isinstance(r, InfoReply)}
        self._degrade_seen = any(isinstance(r, InfoReply) and r.degrade_term for r in replies)
        n_listed = len(self.s.safekeepers)
        good = 0
        ids: dict[int, str] = {}
        for addr, r in zip(self.s.safekeepers, replies):
            name = f"safekeeper {addr}"
            if isinstance(r, ProbeError):
                up = str(r).startswith("it refused")  # running but stopped, by a full disk say: it says why
                start = self.command("safekeeper", "--id", "N", "--data-dir", "DIR", "--listen", addr)
                hint = "read its log" if up else \
                    f"start it ({start}, with its own id and data directory) or fix --safekeepers"
                if "disk guard:" in str(r):
                    hint = ("free what holds the removal horizon: advance or drop that reader slot "
                            "(DROP_REPLICATION_SLOT on its reader port), let the archive catch up, lower --keep-wal; "
                            "or raise --max-disk-usage and restart it")
                self.add(_fail(name, str(r) if up else f"unreachable: {r}", hint))
                continue
            tail = f"id {r.node_id}, term {r.term}, flush_lsn {format_lsn(r.flush_lsn)}" + \
                   (", proposer attached" if r.proposer_connected else "")
            if r.amnesic:
                need = peers_needed_after_a_lost_disk(max(r.members, n_listed))
                init = self.command("safekeeper-init", "--id", str(r.node_id), "--data-dir", "DIR", "--members",
                                    str(n_listed))
                self.add(_fail(name, f"id {r.node_id}: an empty data directory (a lost disk) that has not learned "
                                     f"its term: it votes for no one until {need} of its peers that did not lose "
                                     "their disk told it theirs (see its log for whom it waits for)",
                               "start it with --peers listing every other safekeeper, and those peers; for a "
                               f"brand-new cluster instead, stop it and create it ({init})"))
                continue
            if r.lost_disk_term:
                tail += (f"; lost its disk and learned term {r.lost_disk_term}: it grants no vote (it takes WAL) "
                         "until its WAL holds the start of a later term, after the next election")
                self.add(_warn(name, tail, "keep the other safekeepers up until then: a term is elected only "
                                           "by the others"))
            else:
                self.add(_ok(name, tail))
            if r.node_id in ids:
                self.add(_fail(f"{name} id", f"id {r.node_id} is also the id of {ids[r.node_id]}",
                               "every safekeeper needs its own --id and --data-dir"))
                continue
            ids[r.node_id] = addr
            self.ids[addr] = r.node_id
            if self._identity(addr, r):
                good += 1
        q, n = self.s.quorum or len(self.s.safekeepers) // 2 + 1, len(self.s.safekeepers)
        self._lineage([r for r in replies if isinstance(r, InfoReply) and r.system_id == self.system_id])
        self._archive([r for r in replies if isinstance(r, InfoReply) and r.system_id and r.wal_seg_size])
        for addr, r in zip(self.s.safekeepers, replies):
            if isinstance(r, InfoReply):
                self._reader_slots(addr, r)
        if good >= q:
            self.add(_ok("safekeeper quorum", f"{good} of {n} usable, quorum {q}"))
        else:
            self.add(_fail("safekeeper quorum", f"only {good} of {n} usable, quorum {q}: commits wait",
                           f"start or repair safekeepers (see the lines above) until {q} of {n} answer with this "
                           "primary's system id"))

    def _reader_slots(self, addr: str, r: InfoReply) -> None:
        """What the reader slots hold on one safekeeper: WARNING at half --max-slot-wal-keep-size, FAILED at it."""
        if not r.slots:
            return
        name = f"safekeeper {addr} reader slots"
        limit = r.slot_wal_limit
        held = ", ".join(f"{h.name} invalidated" if h.invalidated else f"{h.name} holds {h.wal_bytes} bytes"
                         for h in sorted(r.slots, key=lambda h: (not h.invalidated, -h.wal_bytes)))
        detail = f"{held}; --max-slot-wal-keep-size {limit or 'unlimited'}"
        drop = ("a reader stopped advancing its slot: let its standby stream again, or drop the slot "
                "(DROP_REPLICATION_SLOT NAME on the reader port, or walsidecar readers slot drop)")
        most = max(h.wal_bytes for h in r.slots)
        if any(h.invalidated for h in r.slots):
            self.add(_fail(name, detail, "an invalidated slot holds no WAL and its reader cannot stream with it: "
                                         "drop it and make it again, then rebuild that standby from a base backup"))
        elif limit and most >= limit:
            self.add(_fail(name, detail, drop))
        elif limit and most >= limit // 2:
            self.add(_warn(name, detail, drop))
        else:
            self.add(_ok(name, detail))

    def _lineage(self, replies: list[InfoReply]) -> None:
        """Is this the primary the safekeepers' WAL came from, or an old one back after a failover?"""
        if self.lineage is None or not replies:
            return
        timeline, flush = self.lineage
        theirs = max(r.timeline for r in replies)
        commit = max(r.commit_lsn for r in replies)
        rejoin = ("it must not be a primary again: stop it, and rejoin it as a standby of the new primary: "
                  "pg_rewind --target-pgdata=PGDATA --source-server='NEW_PRIMARY_DSN', then touch "
                  "PGDATA/standby.signal, set primary_conninfo to a safekeeper's reader port (or restore_command = "
                  "'walsidecar restore-wal %f %p --config F') and start it")
        fence = lineage.latest(*(r.fence for r in replies))
        if fence.timeline == timeline:
            self.add(_fail("primary lineage", f"the failover of term {fence.term} ended this server's timeline "
                                              f"{timeline} at {format_lsn(fence.lsn)} to promote a standby: this is "
                                              "the old primary; its sidecar is refused and its commits wait",
                           rejoin + "; or, if that failover never promoted, undo it: "
                           + self.command("failover", "--undo", "--safekeepers", ",".join(self.s.safekeepers))))
        elif theirs > timeline:
            self.add(_fail("primary lineage", f"this server is on timeline {timeline}, the safekeepers' WAL on "
                                              f"timeline {theirs}: a standby was promoted (walsidecar failover) and "
                                              "this is the old primary; its sidecar is refused", rejoin))
        elif flush < commit:
            self.add(_fail("primary lineage", f"this server's WAL ends at {format_lsn(flush)}, below the "
                                              f"committed {format_lsn(commit)} the safekeepers hold: it lacks "
                                              "acknowledged commits (an old primary, or one restored from an old "
                                              "backup); its sidecar is refused", rejoin))
        else:
            self.add(_ok("primary lineage", f"timeline {timeline}, at or past the committed {format_lsn(commit)}"))

    def _archive(self, replies: list[InfoReply]) -> None:
        """Does the archive keep up? Each safekeeper's backup_lsn against its own commit_lsn (from InfoReply)."""
        if not replies:
            return
        hint = ("read the safekeepers' logs for 'archiving failed' (the archive unreachable, its credentials, a "
                "full bucket) and their /status (archive_failing); WAL removal waits for the archive, so their "
                "disks fill meanwhile")
        for r in (r for r in replies if r.archive_mismatch):
            self.add(_fail("archive", f"safekeeper {r.node_id}: the archived object {r.archive_mismatch} is not its "
                                      "WAL of that segment (its log gives both SHA-256s); backup_lsn stops at "
                                      f"{format_lsn(r.backup_lsn)} and nothing from there on is removed",
                           "compare the object with the segment on the safekeepers (and the primary's pg_wal); set "
                           "the bad object aside (move it out of the archive): the uploader puts the checked "
                           "segment there and archiving resumes"))
        replies = [r for r in replies if not r.archive_mismatch]
        if not replies:
            return
        if not any(r.backup_lsn for r in replies):
            # A cluster's WAL begins in segment 1, so the first segment a safekeeper holds whole (the uploader's
            # first) starts at segment 2 or later: below the end of segment 2 nothing can be archived yet.
            seg = min(r.wal_seg_size for r in replies)
            commit = max(r.commit_lsn for r in replies)
            if commit < FIRST_ARCHIVABLE_END * seg:
                self.add(_ok("archive", f"nothing to archive yet: commit_lsn {format_lsn(commit)} is below "
                                        f"{format_lsn(FIRST_ARCHIVABLE_END * seg)}, the earliest end of the first "
                                        "segment the safekeepers hold whole"))
                return
            self.add(_warn("archive", "no safekeeper reports archived WAL (backup_lsn 0 on every one): either they "
                                      "run without --archive, and WAL is then only as safe as its copies on the "
                                      "safekeepers (fewer still with --keep-wal), or nothing was uploaded yet",
                           "give every safekeeper --archive s3://BUCKET/PREFIX (or file:///PATH) and the same "
                           "--cluster; if they have it, " + hint))
            return
        for r in replies:
            lag = max(r.commit_lsn - r.backup_lsn, 0) // r.wal_seg_size
            detail = f"safekeeper {r.node_id}: backup_lsn {format_lsn(r.backup_lsn)}, {lag} segment(s) behind its " \
                     f"commit_lsn {format_lsn(r.commit_lsn)}"
            if lag > ARCHIVE_LAG_FAILED:
                self.add(_fail("archive", f"{detail}: the archive is not keeping up", hint))
            elif lag > ARCHIVE_LAG_WARNING:
                self.add(_warn("archive", f"{detail}: the archive falls behind", hint))
            else:
                self.add(_ok("archive", detail))

    def _identity(self, addr: str, r: InfoReply) -> bool:
        name = f"safekeeper {addr} system id"
        if r.system_id == 0:
            self.add(_ok(name, "not initialised yet: takes the primary's identity at the first proposer contact"))
            return True
        if self.system_id is None:
            self.add(_warn(name, f"{r.system_id}; the primary was not reachable to compare",
                           "fix the PostgreSQL check first"))
            return True
        problems = []
        if r.system_id != self.system_id:
            problems.append(f"holds WAL of system {r.system_id}, the primary is {self.system_id}")
        if self.seg_size and r.wal_seg_size != self.seg_size:
            problems.append(f"segment size {r.wal_seg_size}, the primary's is {self.seg_size}")
        if self.pg_major and r.pg_version != self.pg_major:
            problems.append(f"PostgreSQL {r.pg_version}, the primary is {self.pg_major}")
        if problems:
            self.add(_fail(name, "; ".join(problems),
                           "it belongs to another cluster: list this cluster's safekeepers in --safekeepers, "
                           "or give this one an empty --data-dir if its WAL is not needed"))
            return False
        self.add(_ok(name, str(r.system_id)))
        return True

    async def _streaming(self) -> None:
        name = "sidecar streaming"
        app = self.s.application_name
        try:
            conn = await connect(self.s.pg_dsn, self.s.timeout, "check")
        except (psycopg.Error, OSError, asyncio.TimeoutError):
            return
        try:
            st = await read_syncrep_state(conn, app)
        finally:
            await conn.close()
        state, sync_state, flush = st.replication_state, st.sync_state, st.sidecar_flush_lsn
        if state is None:
            self.add(_fail(name, f"no replication connection named {app!r} in pg_stat_replication",
                           f"start the proposer ({self._start_command()}); then read its log"))
        else:
            lag = st.flush_lsn - flush if flush is not None else None
            shown = format_lsn(flush) if flush is not None else None
            detail = f"{state}, sync_state {sync_state}, flush_lsn {shown}, {lag} bytes behind the primary"
            if state != "streaming":
                self.add(_warn(name, detail, "it is starting or catching up; check again in a moment"))
            elif sync_state not in ("sync", "quorum"):
                self.add(_fail(name, detail, "commits do not wait for it: " + syncrep.set_standby_names_hint(app)))
            else:
                self.add(_ok(name, detail))
        count, oldest = st.commits_waiting, st.oldest_wait_seconds or 0.0
        others = syncrep.waited_for_instead(self.standby_names, app)
        if count and others:
            # Not the quorum's doing: the primary waits for a standby that is not the sidecar.
            self.add(_fail("commits waiting", f"{count} waiting for {others} named in synchronous_standby_names, "
                                              f"which is not the sidecar {app!r}: the safekeeper quorum cannot "
                                              "release them", syncrep.set_standby_names_hint(app)))
        elif count and oldest > 5:
            self.add(_warn("commits waiting", f"{count} waiting for the quorum, the oldest for {oldest:.0f}s",
                           f"see which safekeepers are down: {self._status_command()}"))
        else:
            self.add(_ok("commits waiting", str(count)))

    async def _proposer(self) -> None:
        name = f"proposer endpoint {self.s.proposer_metrics}"
        try:
            doc = await fetch_status(self.s.proposer_metrics, self.s.timeout, self.ssl)  # type: ignore[arg-type]
        except ProbeError as e:
            self.add(_fail(name, str(e), f"is the proposer running with --metrics {self.s.proposer_metrics}? "
                                         f"({self._start_command()} --metrics {self.s.proposer_metrics})"))
            return
        self._proposer_doc = doc
        detail = f"term {doc.get('term')}, {doc.get('phase')}, commit_lsn {doc.get('commit_lsn')}"
        if doc.get("insecure"):
            self.add(_warn(f"{name} TLS", "the proposer runs with --insecure: its safekeeper links are not "
                                          "authenticated", "restart it with --certs-dir CERTS_DIR instead of --insecure"))
        if doc.get("quorum_available"):
            self.add(_ok(name, detail + ", quorum available"))
        else:
            self.add(_fail(name, detail + ", no quorum in the current term",
                           f"see which safekeepers are down: {self._status_command()}"))


    async def _broker(self) -> None:
        """Every listed safekeeper publishes in the broker, recently; the broker answers."""
        s = self.s
        where = ",".join(s.broker)
        cluster = s.cluster or (str(self.system_id) if self.system_id else None)
        if cluster is None:
            self.add(_fail("broker", "cannot tell the cluster's name: the primary did not answer and --cluster is "
                                     "not given", "give --cluster NAME (the safekeepers' --cluster; by default the "
                                                  "primary's system id)"))
            return
        try:
            broker = Broker(s.broker, s.certs_dir, timeout=s.timeout)
        except TlsError as e:
            self.add(_fail("broker", str(e), "fix --certs-dir"))
            return
        holder: UploaderHolder | None = None
        try:
            timelines = (await read_clusters(broker, cluster)).get(cluster, {})
            if timelines:
                holder = await uploader_holder(broker, uploader_key(cluster, max(timelines)))
        except BrokerError as e:
            self.add(_fail("broker", f"unreachable: {e}. Commits and reads go on, but the uploader's hand-over and "
                                     "WAL removal wait for it", f"start etcd at {where}, or fix --broker"))
            return
        finally:
            broker.close()
        prefix = f"walsidecar/{cluster}/"
        if not timelines:
            self.add(_fail("broker", f"no safekeeper publishes under {prefix} at {where}",
                           "start the safekeepers with --broker " + where +
                           (f" --cluster {cluster}" if s.cluster else "") + ", or give the --cluster they use"))
            return
        tl = max(timelines)
        entries = timelines[tl]
        up = f", uploader {entries.uploader}" if entries.uploader is not None else ""
        self.add(_ok("broker", f"{where}: {len(entries.safekeepers)} safekeeper(s) publish under {prefix}{tl}/{up}"))
        self._uploader(holder, entries.safekeepers, f"{prefix}{tl}/")
        by_address = {e.address: e for e in entries.safekeepers.values()}
        now = time.time()
        for addr in s.safekeepers:
            name = f"safekeeper {addr} in the broker"
            node = self.ids.get(addr)
            e = entries.safekeepers.get(node) if node is not None else by_address.get(addr)
            if e is None:
                self.add(_fail(name, f"publishes nothing under {prefix}{tl}/safekeepers/" +
                               (f"{node}/" if node is not None else ""),
                               f"run it with --broker {where}" + (f" --cluster {cluster}" if s.cluster else "") +
                               f" (and --advertise {addr} if it listens on another address); if it runs so, "
                               "read its log for the broker's error"))
                continue
            age = now - e.last_updated
            detail = f"id {e.id}, term {e.term}, flush_lsn {format_lsn(e.flush_lsn)}, commit_lsn " \
                     f"{format_lsn(e.commit_lsn)}, backup_lsn {format_lsn(e.backup_lsn)}, published {age:.1f}s ago"
            if age > STALE_AFTER:
                self.add(_fail(name, detail + f": stale (more than {STALE_AFTER:g}s)",
                               "is its clock right? read its log for the broker's error"))
            else:
                self.add(_ok(name, detail))


    def _uploader(self, holder: UploaderHolder | None, published: Collection[int], prefix: str) -> None:
        """Who holds the upload lease, if not one of the safekeepers checked: none of them uploads meanwhile.
        Also the entries of ids that are none of theirs (only when every safekeeper answered with its id)."""
        ours = set(self.ids.values())
        everyone = len(self.ids) == len(self.s.safekeepers)
        strangers = sorted(set(published) - ours) if everyone else []
        if strangers:
            self.add(_warn("broker entries", f"{prefix}safekeepers/ holds entries of id(s) "
                                             f"{', '.join(map(str, strangers))}, none of the safekeepers checked (ids "
                                             f"{', '.join(map(str, sorted(ours)))}): the safekeepers count their "
                                             "positions when they decide who may upload",
                           "if these are safekeepers of this cluster, add them to --safekeepers; if not, someone "
                           "with write access to etcd wrote them: find who, and revoke their lease "
                           "(etcdctl lease revoke ID)"))
        if holder is None or (holder.published and (holder.node_id in ours or not everyone)):
            return  # nobody yet, one of the safekeepers checked, or one we cannot tell apart from them
        key = f"{prefix}uploader"
        if not holder.published:
            self.add(_warn("broker uploader", f"{key} is held by {holder.describe()}, a key no safekeeper wrote (not "
                                              "on the lease of a safekeeper entry of that id): no safekeeper uploads "
                                              "while it stands", "the safekeepers delete such a key at their next "
                                              "round; if it stays, read their logs for 'an upload lease key no "
                                              "safekeeper wrote', and find who writes to etcd"))
            return
        self.add(_warn("broker uploader", f"{key} is held by {holder.describe()}, which is none of the safekeepers "
                                          f"checked (ids {', '.join(map(str, sorted(ours)))}): the uploader is not "
                                          "uploading for them, and their WAL removal waits for the archive",
                       f"if safekeeper {holder.value[:64]} belongs to this cluster, check it; if not, someone with write "
                       f"access to etcd holds the lease: revoke it (etcdctl lease revoke {holder.lease:x})"))


def render(s: CheckSettings, checks: list[Check], fmt: str) -> str:
    """Console lines (one per check) or a JSON document."""
    counts = {k: sum(c.status == k for c in checks) for k in ("OK", "WARNING", "FAILED")}
    if fmt == "json":
        return json.dumps({"primary": redact_dsn(s.pg_dsn), "safekeepers": list(s.safekeepers),
                           "quorum": s.quorum, "ok": counts["FAILED"] == 0, "counts": counts,
                           "checks": [asdict(c) for c in checks]}, indent=2)
    head = f"walsidecar check: primary {redact_dsn(s.pg_dsn)}; safekeepers {','.join(s.safekeepers)}; " \
           f"quorum {s.quorum} of {len(s.safekeepers)}"
    tail = f"{counts['OK']} OK, {counts['WARNING']} WARNING, {counts['FAILED']} FAILED"
    return "\n".join([head] + ["\t" + c.line() for c in checks] + [tail])


def run_check(s: CheckSettings) -> int:
    """Print the checks; the exit code is 1 if any FAILED."""
    try:
        checker = SetupChecker(s)
    except TlsError as e:
        print(f"walsidecar check: {e}", file=sys.stderr, flush=True)
        return 2
    checks = asyncio.run(checker.run())
    print(render(s, checks, s.format), flush=True)
    return 1 if any(c.status == "FAILED" for c in checks) else 0
