"""Opening a safekeeper's data directory: the control file, the stored WAL's checks, its end.

A safekeeper starts only on a data directory that is its own and whose WAL is whole below the
last completed segment (walcheck.py); WAL in doubt after a failed fsync is cut back first, and
the WAL store opens at the end of the last valid record.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sidecar.consensus.acceptor import Acceptor
from sidecar.consensus.state import AcceptorState
from sidecar.lsn import format_lsn
from sidecar.safekeeper.control import ControlData, control_path, load_control, remove_leftovers, save_control
from sidecar.safekeeper.storage import NoWal, StorageError, WalStorage
from sidecar.safekeeper.walcheck import StartupError, check_stored_wal, record_end


def open_data_dir(node_id: int, data_dir: Path, on_disk_full: Callable[[str], None],
                  log: Any, peers: int = 0) -> tuple[Acceptor, WalStorage | NoWal]:
    """The acceptor and WAL store of `data_dir`, the WAL checked and cut at the end of its last record.

    A new cluster's safekeepers are created with a control file (create.py), so a data directory without
    one is a lost disk: the acceptor is amnesic until it learns its term from its `peers` (the number of
    --peers addresses; amnesia.py), and forever without any.
    Raises ControlFileError or StartupError, with a message for the operator, when it must not start.
    """
    try:
        return _open(node_id, data_dir, on_disk_full, log, peers)
    except (OSError, StorageError) as e:  # permissions, a vanished file, an unusable marker
        raise StartupError(f"safekeeper {node_id} cannot start from {data_dir}: {e}") from e


def _open(node_id: int, data_dir: Path, on_disk_full: Callable[[str], None],
          log: Any, peers: int) -> tuple[Acceptor, WalStorage | NoWal]:
    began = time.perf_counter()
    data_dir.mkdir(parents=True, exist_ok=True)
    remove_leftovers(data_dir)
    control = load_control(data_dir)
    if control is not None and control.node_id != node_id:
        raise StartupError(f"{data_dir} belongs to safekeeper {control.node_id}, not {node_id}")
    state = control.state if control else AcceptorState()
    storage: WalStorage | NoWal = NoWal()  # never greeted: no segment size, so no WAL store yet
    end = 0
    if state.wal_seg_size:
        try:
            storage = WalStorage(data_dir / "wal", state.wal_seg_size, state.timeline, on_disk_full,
                                 state.timeline_history)
        except ValueError as e:
            raise StartupError(f"{control_path(data_dir)} holds an invalid value: {e}; "
                               f"restore it or re-create this safekeeper from its peers") from None
        try:
            checked_to, end = _check_wal(storage, state, log)
            state = _commit_within(node_id, data_dir, state, end, log)
        except BaseException:
            storage.close()
            raise
        log.info("stored WAL checked", durable_end=format_lsn(checked_to), flush_lsn=format_lsn(end),
                 seconds=round(time.perf_counter() - began, 3))
    log.info("safekeeper opened", term=state.term, flush_lsn=format_lsn(end),
             commit_lsn=format_lsn(state.commit_lsn), data_dir=str(data_dir))
    acceptor = Acceptor(node_id, state, end, amnesic=control is None, listed_members=peers + 1 if peers else 0)
    if control is None and peers:
        log.warning("empty data directory: a lost disk (a new cluster's safekeepers are created by `walsidecar "
                    "safekeeper-init`); this safekeeper may have promised terms it no longer knows, and votes only "
                    "after learning its term from the peers that did not lose theirs", peers=peers,
                    peers_needed=acceptor.amnesic_peers)
    elif control is None:
        log.error("empty data directory and no --peers: a lost disk (a new cluster's safekeepers are created by "
                  "`walsidecar safekeeper-init`) that cannot learn the terms it promised, so it never votes. Give "
                  "--peers (the other safekeepers' addresses), or, for a brand-new cluster, create every "
                  "safekeeper with `walsidecar safekeeper-init --id N --data-dir DIR --members N`")
    elif peers and state.members > peers + 1:
        log.error("--peers lists fewer than the other members of the cluster: after a lost disk this safekeeper "
                  "could not hear enough of them to learn its term; list every other safekeeper",
                  peers=peers, members=state.members)
    if state.lost_disk_term and acceptor.recovering_from:
        log.warning("this safekeeper lost its disk and holds no term after the one it learned yet: it grants no "
                    "vote (it promises terms and is caught up) until its WAL holds the start of a later term",
                    lost_disk_term=state.lost_disk_term)
    return acceptor, storage


def _check_wal(st: WalStorage, state: AcceptorState, log: Any) -> tuple[int, int]:
    """Cut WAL in doubt, check what is stored, open the store at the end of its last record.

    Returns (the durable end checked, the end of the last record).
    """
    _cut_in_doubt(st, log)
    checked_to = check_stored_wal(st, state.system_id or None)
    end = record_end(st, state).flush_lsn
    if end:
        st.open_at(end)
        # The next start walks the record chain from here (see walcheck.py).
        st.set_verified(end - end % state.wal_seg_size)
    return checked_to, end


def _cut_in_doubt(st: WalStorage, log: Any) -> None:
    """After a failed fdatasync, cut the WAL back to what was durable before it (never trust the page cache)."""
    marker = st.in_doubt()
    if marker is None:
        return
    log.warning("an fsync failed before the last stop: cutting the WAL back to what was durable before "
                "it; the proposer sends the rest again", durable_lsn=format_lsn(marker.durable_lsn),
                in_doubt_to=format_lsn(marker.written_lsn), failure=marker.reason)
    try:
        st.resolve_in_doubt(marker)
    except StorageError as e:
        raise StartupError(f"cannot cut the WAL in doubt back to {format_lsn(marker.durable_lsn)} as "
                           f"{st.in_doubt_path} asks: {e}") from e


def _commit_within(node_id: int, data_dir: Path, state: AcceptorState, end: int, log: Any) -> AcceptorState:
    """commit_lsn means "quorum-acknowledged and present here": WAL lost in a crash (never
    acknowledged by this node) or cut as in doubt takes it down with it, loudly."""
    if state.commit_lsn <= end:
        return state
    log.warning("the stored WAL ends below the commit position this safekeeper had learned; lowering it",
                commit_lsn=format_lsn(state.commit_lsn), flush_lsn=format_lsn(end))
    state = dataclasses.replace(state, commit_lsn=end, peer_horizon_lsn=min(state.peer_horizon_lsn, end))
    save_control(data_dir, ControlData(node_id, state))
    return state
